"""Tensor parallelism for transformers models from their own plans (``base_model_tp_plan``).

A transformers model names how its linear layers split across a tensor-parallel group:
``config.base_model_tp_plan`` for the decoder (``layers.*.self_attn.q_proj: colwise``, …) and
the class's ``_tp_plan`` for the heads (``lm_head: colwise_gather_output``). `STYLES` maps those
names to DTensor parallel styles; `parallelize` applies them to a model on the ``tp`` mesh:

- column-wise layers hold ``out_features / tp`` rows and give each rank its heads (the
  attention reshapes by ``-1`` heads, so every rank attends over its own heads);
- row-wise layers hold ``in_features / tp`` columns and all-reduce their output;
- the lm_head's logits are gathered whole (log-softmax needs the full vocabulary);
- a tied input embedding is split by vocabulary rows like the lm_head (its lookups summed over
  the group) and tied again after parallelizing (`parallelize_module` replaces the lm_head's
  weight with a new DTensor parameter, which unties it);
- everything else (norms, a critic's scalar head) stays whole on every rank and sees the same
  inputs there, so its gradient is already the full one.

With ``sequence_parallel`` (`sequence_parallel_styles`) the residual stream between the split
layers is split along the sequence too: the norms (and whatever else sits on the residual) see
``L / tp`` positions per rank, the row-wise layers reduce-scatter their output over the
sequence instead of all-reducing it, and each attention and MLP block gathers the sequence
back before its column-wise layers. The activations on the residual shrink ``tp``-fold; the
decoder's last hidden states are gathered whole again for the heads.

`grad_norm_and_clip` takes the global gradient norm over parameters that live on different
meshes (data-parallel only, or data × tensor parallel), which one `clip_grad_norm_` refuses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from rlhf.molt.config import FSDPConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _colwise() -> Any:
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel()


def _rowwise() -> Any:
    from torch.distributed.tensor.parallel import RowwiseParallel

    return RowwiseParallel()


def _colwise_gathered() -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel(output_layouts=Replicate())


def _vocab_parallel_embedding() -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel

    return RowwiseParallel(input_layouts=Replicate())


STYLES: dict[str, Callable[[], Any]] = {
    "colwise": _colwise,
    "rowwise": _rowwise,
    "colwise_rep": _colwise_gathered,
    "colwise_gather_output": _colwise_gathered,
    "embedding_rowwise": _vocab_parallel_embedding,
}
"""Plan names (transformers' spellings) → factories of DTensor parallel styles."""


def _base(model: torch.nn.Module) -> tuple[str, torch.nn.Module]:
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    inner = getattr(model, prefix, None) if prefix else None
    return (prefix, inner) if isinstance(inner, torch.nn.Module) else ("", model)


def tp_plan(model: torch.nn.Module) -> dict[str, str]:
    """Module patterns (relative to ``model``, ``*`` for any layer index) → style names: the
    config's ``base_model_tp_plan`` under the base model's prefix, the class's ``_tp_plan``
    (its heads), and, for tied embeddings, the input embedding split like the lm_head."""
    prefix, _ = _base(model)
    config = getattr(model, "config", None)
    base_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    plan = {(f"{prefix}.{k}" if prefix else k): v for k, v in base_plan.items()}
    plan.update(dict(getattr(type(model), "_tp_plan", None) or {}))
    if _tied_head(model) is not None:
        embed_name = _module_name(model, _hf(model).get_input_embeddings())
        plan[embed_name] = "embedding_rowwise"
    return plan


def _hf(model: torch.nn.Module) -> PreTrainedModel:
    """``model`` seen as the transformers model it is (torch types a Module's attributes as
    Tensor | Module, which hides transformers' methods)."""
    return cast("PreTrainedModel", model)


def _module_name(model: torch.nn.Module, target: torch.nn.Module) -> str:
    for name, module in model.named_modules():
        if module is target:
            return name
    raise ValueError("module not found in the model")


def _tied_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The output embedding when it shares its weight with the input embedding, else None."""
    get_out: Callable[[], torch.nn.Module | None] | None = getattr(
        model, "get_output_embeddings", None
    )
    head = get_out() if callable(get_out) else None
    embed = _hf(model).get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if head is None or embed is None:
        return None
    return head if head.weight is embed.weight else None


def check_tensor_parallel(
    model_config: Any | None, *, tp_size: int, world_size: int, flag: str
) -> None:
    """Raise `FSDPConfigError` naming ``--{flag}.tp_size`` when a model cannot be split
    ``tp_size`` ways over ``world_size`` ranks (heads, key/value heads and the ranks must all
    divide; the model must carry a tensor-parallel plan). Nothing to check at ``tp_size`` 1;
    only the ranks when ``model_config`` is None (not readable yet)."""
    if tp_size == 1:
        return
    if world_size % tp_size:
        raise FSDPConfigError(
            f"--{flag}.tp_size {tp_size} must divide the role's {world_size} rank(s) "
            "(ranks = data parallel x tensor parallel); change the rank count or tp_size"
        )
    if model_config is None:
        return
    if not getattr(model_config, "base_model_tp_plan", None):
        raise FSDPConfigError(
            f"--{flag}.tp_size {tp_size}: the {getattr(model_config, 'model_type', '?')} model "
            "carries no tensor-parallel plan (base_model_tp_plan); use tp_size 1"
        )
    heads = {
        "num_attention_heads": getattr(model_config, "num_attention_heads", None),
        "num_key_value_heads": getattr(model_config, "num_key_value_heads", None),
    }
    for name, count in heads.items():
        if count is not None and count % tp_size:
            raise FSDPConfigError(
                f"--{flag}.tp_size {tp_size} must divide the model's {name} ({count}); "
                f"choose a tp_size that divides {count}"
            )


def _sequence_split_rowwise() -> Any:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    return RowwiseParallel(output_layouts=Shard(1), use_local_output=False)


def _sequence_split_embedding(*, split: bool) -> Any:
    """The input embedding's output as a sequence-split DTensor: a vocabulary-split (tied)
    embedding reduce-scatters its lookups; a whole one keeps its slice of the positions."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput, RowwiseParallel

    if split:
        return RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        )
    return PrepareModuleOutput(
        output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
    )


def _gather_sequence_style() -> Any:
    """A style for a block whose first layers are column-wise: its hidden-state input (first
    positional argument or ``hidden_states=``), split along the sequence, is all-gathered
    into a replicated DTensor; the column-wise layers then give each rank its heads, and the
    backward reduce-scatters the gradient."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ParallelStyle

    def gather(value: Any) -> Any:
        if isinstance(value, DTensor) and not value.placements[0].is_replicate():
            return value.redistribute(placements=(Replicate(),))
        return value

    def hook(_module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (gather(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}
        return args, kwargs

    class GatherSequence(ParallelStyle):
        def _apply(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
            module.register_forward_pre_hook(hook, with_kwargs=True)
            return module

    return GatherSequence()


def _is_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith("Norm")


def sequence_parallel_styles(model: torch.nn.Module, plan: dict[str, str]) -> dict[str, Any]:
    """The `tp_plan` ``plan`` as DTensor styles with the sequence split between the blocks:
    row-wise layers reduce-scatter over the sequence; the embedding's output is split; every
    norm on the residual stream (direct children of a decoder layer and of the base model)
    runs on its positions (``SequenceParallel``); each block holding a column-wise layer
    (``layers.*.self_attn``, ``layers.*.mlp``) gathers its input first. Patterns keep
    ``*`` for the layer index."""
    from torch.distributed.tensor.parallel import SequenceParallel

    styles: dict[str, Any] = {}
    for pattern, style in plan.items():
        if style == "rowwise":
            styles[pattern] = _sequence_split_rowwise()
        elif style != "embedding_rowwise":
            styles[pattern] = STYLES[style]()
        if style == "colwise" and "." in pattern:
            styles[pattern.rsplit(".", 1)[0]] = _gather_sequence_style()
    embed_name = _module_name(model, _hf(model).get_input_embeddings())
    styles[embed_name] = _sequence_split_embedding(
        split=plan.get(embed_name) == "embedding_rowwise"
    )
    prefix, base = _base(model)
    at = f"{prefix}." if prefix else ""
    for name, child in base.named_children():
        if _is_norm(child):
            styles[f"{at}{name}"] = SequenceParallel(use_local_output=False)
        if isinstance(child, torch.nn.ModuleList) and len(child):
            for sub, grandchild in child[0].named_children():
                if _is_norm(grandchild):
                    styles[f"{at}{name}.*.{sub}"] = SequenceParallel(use_local_output=False)
    return styles


def _gather_last_hidden_state(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
    """Forward hook on the base model: its sequence-split last hidden states gathered into
    one plain tensor (the same on every rank) for the heads."""
    from torch.distributed.tensor import DTensor

    hidden = getattr(output, "last_hidden_state", None)
    if isinstance(hidden, DTensor):
        output.last_hidden_state = hidden.full_tensor()
    return output


def parallelize(
    model: torch.nn.Module, mesh: Any, *, flag: str, sequence_parallel: bool = False
) -> torch.nn.Module:
    """Apply the model's plan (`tp_plan`) on the 1-D ``mesh`` (with the sequence split
    between blocks when ``sequence_parallel``, `sequence_parallel_styles`); returns the
    model, its split layers holding DTensor parameters, a tied embedding tied again."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = tp_plan(model)
    unknown = sorted({style for style in plan.values() if style not in STYLES})
    if unknown:
        raise FSDPConfigError(
            f"--{flag}.tp_size: the model's tensor-parallel plan uses {unknown}, which the molt "
            f"backend does not translate (known: {sorted(STYLES)}); use tp_size 1"
        )
    tied = _tied_head(model) is not None
    if sequence_parallel:
        parallelize_module(model, mesh, sequence_parallel_styles(model, plan))
        _base(model)[1].register_forward_hook(_gather_last_hidden_state)
    else:
        styles = {pattern: STYLES[style]() for pattern, style in plan.items()}
        parallelize_module(model, mesh, styles)
    if tied:
        head = _hf(model).get_output_embeddings()
        assert head is not None  # `tied`: _tied_head found it before the split
        head.weight = _hf(model).get_input_embeddings().weight
    return model


def grad_norm_and_clip(params: Iterable[torch.nn.Parameter], max_norm: float) -> Tensor:
    """The 2-norm of all gradients, as one tensor, with the gradients scaled by
    ``max_norm / (norm + 1e-6)`` when that is below 1 (``clip_grad_norm_``'s rule; no
    clipping for ``max_norm`` <= 0). Gradients are grouped by the mesh they live on; each
    group's norm is reduced over its mesh, then the groups' norms are combined."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[Tensor]] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    total = norms[0] if len(norms) == 1 else torch.stack([n**2 for n in norms]).sum().sqrt()
    if max_norm > 0:
        coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        for grads in groups.values():
            # torch's foreach kernels (what clip_grad_norm_ uses) have only underscore names.
            torch._foreach_mul_(grads, coef)  # pyright: ignore[reportPrivateImportUsage]
    return total
