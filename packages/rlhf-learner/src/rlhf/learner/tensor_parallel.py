"""Tensor parallelism of the DeepSpeed backend (``deepspeed.tp_size``): DeepSpeed's AutoTP
training, and whole tensors back out of its shards.

With ``{"tensor_parallel": {"autotp_size": tp}}`` in its config, ``deepspeed.initialize``
replaces the linear layers that the model's transformers plan (``base_model_tp_plan`` and the
class's ``_tp_plan``) names by DeepSpeed's tensor-parallel layers, over groups of ``tp``
adjacent ranks (a ``(dp, tp)`` device mesh):

- column-wise layers (q/k/v, gate/up, an untied lm_head) become ``LinearLayer``: this rank
  holds rows of the weight (and bias) along dim 0, so its share of the heads; the untied
  lm_head gathers its output, so the logits stay whole (B, L, V);
- row-wise layers (o_proj, down_proj) become ``LinearAllreduce``: this rank holds columns
  (dim 1) and the outputs are summed over the group; the bias stays whole;
- everything else (embeddings, norms, a tied lm_head, a scalar role's score head) stays whole
  on every rank. We ask for ``vocab_parallel_lm_head: false``: DeepSpeed would otherwise
  split a tied head by vocabulary and return rank-local logits, which the objectives'
  log-softmax cannot use.

A whole parameter is the concatenation of the group's shards along the split dimension
(`ShardLayout.full`, one all-gather per parameter; shards may differ in width). The shards
are read, never written: DeepSpeed's own ``GatherReplacedLayerParams`` swaps ``param.data``
for a gathered copy and back for a new one, which would detach the parameter from the
flat ZeRO-1/2 buffer the optimizer updates.

Not supported (`tensor_parallel_problems` says why, naming the flags): ZeRO-3 (transformers
refuses to load a model for ZeRO-3 while the DeepSpeed config holds ``tensor_parallel``),
LoRA, the chunked lm_head, context parallelism, models without a transformers plan or whose
(key/value) heads ``tp`` does not divide.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from rlhf.learner.checkpoint import CheckpointError
from rlhf.learner.config import DeepSpeedConfig, ModelConfig


def autotp_section(tp_size: int) -> dict[str, Any]:
    """The ``tensor_parallel`` section of a DeepSpeed config for AutoTP training."""
    return {"autotp_size": tp_size, "vocab_parallel_lm_head": False}


def _model_config(path: str) -> dict[str, Any] | None:
    """The model's config.json (its text config for a multimodal one), None if unreadable."""
    file = pathlib.Path(path) / "config.json"
    if not file.is_file():
        return None
    raw = json.loads(file.read_text())
    return raw.get("text_config", raw) if isinstance(raw, dict) else None


def _plan(config: dict[str, Any]) -> dict[str, str]:
    """The model's transformers tensor-parallel plan of its decoder (the config's own, or its
    class's default)."""
    plan = config.get("base_model_tp_plan")
    if plan:
        return dict(plan)
    model_type = config.get("model_type")
    if not model_type:
        return {}
    try:
        from transformers import AutoConfig

        return dict(getattr(AutoConfig.for_model(model_type), "base_model_tp_plan", None) or {})
    except ValueError:  # a model type this transformers does not know
        return {}


def tensor_parallel_problems(
    *, deepspeed: DeepSpeedConfig, model: ModelConfig, world_size: int, prefix: str = ""
) -> list[str]:
    """What keeps ``deepspeed.tp_size`` from splitting this role; empty when it can (or when
    tp_size is 1). Each message names the flag (``--{prefix}deepspeed.tp_size``, …) and what
    to do. The model's heads and plan are read from ``model.path``'s config.json; a missing
    one is left to the model checks."""
    tp = deepspeed.tp_size
    if tp == 1:
        return []
    flag = f"--{prefix}deepspeed.tp_size {tp}"
    problems = []
    if world_size % tp:
        problems.append(
            f"{flag} must divide the role's {world_size} rank(s) (ranks = data parallel x "
            "tensor parallel); change the rank count or tp_size"
        )
    if deepspeed.zero_stage == 3:
        problems.append(
            f"{flag} with --{prefix}deepspeed.zero_stage 3: transformers does not load a model "
            "for ZeRO-3 while the DeepSpeed config holds tensor_parallel; use zero_stage 0, 1 "
            "or 2 with tp_size"
        )
    if model.lora_rank:
        problems.append(
            f"{flag} with --{prefix}model.lora_rank {model.lora_rank}: LoRA adapters are not "
            "split over tensor-parallel ranks; use tp_size 1 for LoRA"
        )
    if model.chunked_lm_head:
        problems.append(
            f"{flag} with --{prefix}model.chunked_lm_head: the chunked head reads the lm_head "
            "weight whole, which tensor parallelism splits by vocabulary; use one of the two"
        )
    config = _model_config(model.path)
    if config is None:
        return problems
    if not _plan(config):
        problems.append(
            f"{flag}: the {config.get('model_type', '?')} model carries no tensor-parallel "
            "plan (base_model_tp_plan) for DeepSpeed AutoTP to follow; use tp_size 1"
        )
    for name in ("num_attention_heads", "num_key_value_heads"):
        count = config.get(name)
        if isinstance(count, int) and count % tp:
            problems.append(
                f"{flag} must divide the model's {name} ({count}); choose a tp_size that "
                f"divides {count}"
            )
    return problems


@dataclass(frozen=True)
class Split:
    """How one parameter is split over the tensor-parallel group.

    Attributes:
        dim: The split dimension (0: column-wise rows, 1: row-wise columns).
        widths: Each group rank's width along ``dim``, in group rank order.
    """

    dim: int
    widths: tuple[int, ...]


def _supported_layers() -> dict[type, tuple[int, tuple[str, ...]]]:
    """DeepSpeed layer types whose layout is known: split dim, the parameters it splits."""
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer

    return {LinearLayer: (0, ("weight", "bias")), LinearAllreduce: (1, ("weight",))}


def _widths(shard: Tensor, *, dim: int, group: Any) -> tuple[int, ...]:
    """Every group rank's width of its shard along ``dim`` (a collective)."""
    import torch.distributed as dist

    mine = torch.tensor([shard.shape[dim]], dtype=torch.long, device=shard.device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return tuple(int(w.item()) for w in every)


@dataclass(frozen=True)
class ShardLayout:
    """Which of a module's parameters are tensor-parallel shards, and how to make them whole.

    Attributes:
        splits: Parameter names (``module.named_parameters()``) → their `Split`; parameters
            not listed are whole on every rank.
        group: The tensor-parallel process group.
    """

    splits: dict[str, Split]
    group: Any

    @classmethod
    def of(cls, module: torch.nn.Module, *, group: Any) -> ShardLayout:
        """The layout of ``module`` after AutoTP replaced its layers (collective: the ranks
        exchange their shard widths once).

        Raises:
            ValueError: AutoTP used a layer whose layout this backend does not gather.
        """
        from deepspeed.module_inject.layers import TensorParallel_Layer

        known = _supported_layers()
        names = {id(p): n for n, p in module.named_parameters()}
        splits = {}
        for prefix, layer in module.named_modules():
            if not isinstance(layer, TensorParallel_Layer):
                continue
            if type(layer) not in known:
                raise ValueError(
                    f"--deepspeed.tp_size: DeepSpeed AutoTP made {prefix} a "
                    f"{type(layer).__name__}, whose shards this backend cannot make whole; "
                    "use tp_size 1 for this model"
                )
            dim, split_leaves = known[type(layer)]
            for leaf in split_leaves:
                param = getattr(layer, leaf, None)
                if param is not None and id(param) in names:
                    widths = _widths(param, dim=dim, group=group)
                    splits[names[id(param)]] = Split(dim=dim, widths=widths)
        return cls(splits=splits, group=group)

    def full_shape(self, name: str, shard_shape: torch.Size) -> list[int]:
        """The whole shape of parameter ``name`` whose local shard has ``shard_shape``."""
        shape = [int(d) for d in shard_shape]
        split = self.splits.get(name)
        if split is not None:
            shape[split.dim] = sum(split.widths)
        return shape

    def full(self, name: str, shard: Tensor) -> Tensor:
        """Parameter ``name`` whole (a new tensor; collective over the group for a split
        one, ``shard`` itself otherwise). Shards are padded to the widest one for the
        all-gather and cut back."""
        import torch.distributed as dist

        split = self.splits.get(name)
        if split is None:
            return shard
        widest = max(split.widths)
        padding = [0, 0] * (shard.dim() - split.dim - 1) + [0, widest - shard.shape[split.dim]]
        padded = torch.nn.functional.pad(shard, padding).contiguous()
        parts = [torch.empty_like(padded) for _ in split.widths]
        dist.all_gather(parts, padded, group=self.group)
        pieces = [p.narrow(split.dim, 0, w) for p, w in zip(parts, split.widths, strict=True)]
        return torch.cat(pieces, dim=split.dim)


def tensor_parallel_group(*, tp_size: int, rank: int) -> Any:
    """DeepSpeed's tensor-parallel group of this rank (after ``deepspeed.initialize``),
    checked to be the ``tp_size`` adjacent ranks that the data-parallel coordinate
    ``rank // tp_size`` assumes."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    # DeepSpeed's getter is unannotated, inferred as ProcessGroup | int (torch's new_group
    # returns an int to ranks outside the group); it returns this rank's own group.
    group = cast("dist.ProcessGroup", groups.get_tensor_model_parallel_group())
    size, mine = dist.get_world_size(group), dist.get_rank(group)
    if size != tp_size or mine != rank % tp_size:
        raise RuntimeError(
            f"DeepSpeed's tensor-parallel group has {size} ranks with rank {rank} at {mine}; "
            f"expected {tp_size} adjacent ranks (DeepSpeed keeps one tensor-parallel layout "
            "per process: build roles of another tp_size in other processes)"
        )
    return group


SAVED_LAYOUT = "parallel.json"
"""The file under a checkpoint's ``backend/`` recording the tensor-parallel size it was
written with (DeepSpeed keeps one model and optimizer file per tensor-parallel rank)."""


def write_saved_tp_size(directory: str, *, tp_size: int) -> None:
    """Record ``tp_size`` in checkpoint ``directory`` (rank 0, after the engine saved)."""
    file = pathlib.Path(directory) / "backend" / SAVED_LAYOUT
    file.write_text(json.dumps({"tp_size": tp_size}))


def check_saved_tp_size(directory: str, *, tp_size: int) -> None:
    """Raise `CheckpointError` unless checkpoint ``directory`` was written at ``tp_size``
    (one without the record predates the option: tp_size 1)."""
    file = pathlib.Path(directory) / "backend" / SAVED_LAYOUT
    saved = json.loads(file.read_text())["tp_size"] if file.is_file() else 1
    if saved != tp_size:
        raise CheckpointError(
            f"checkpoint {directory} was written with deepspeed.tp_size {saved}, this role "
            f"runs tp_size {tp_size}: each rank's engine state holds its own shards; resume "
            f"with --deepspeed.tp_size {saved}, or start from an HF export of it"
        )
