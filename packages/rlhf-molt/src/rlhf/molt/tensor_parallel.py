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

`grad_norm_and_clip` takes the global gradient norm over parameters that live on different
meshes (data-parallel only, or data × tensor parallel), which one `clip_grad_norm_` refuses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from rlhf.molt.config import FSDPConfigError


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
        embed_name = _module_name(model, model.get_input_embeddings())
        plan[embed_name] = "embedding_rowwise"
    return plan


def _module_name(model: torch.nn.Module, target: torch.nn.Module) -> str:
    for name, module in model.named_modules():
        if module is target:
            return name
    raise ValueError("module not found in the model")


def _tied_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The output embedding when it shares its weight with the input embedding, else None."""
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
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


def parallelize(model: torch.nn.Module, mesh: Any, *, flag: str) -> torch.nn.Module:
    """Apply the model's plan (`tp_plan`) on the 1-D ``mesh``; returns the model, its split
    layers holding DTensor parameters, a tied embedding tied again."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = tp_plan(model)
    unknown = sorted({style for style in plan.values() if style not in STYLES})
    if unknown:
        raise FSDPConfigError(
            f"--{flag}.tp_size: the model's tensor-parallel plan uses {unknown}, which the molt "
            f"backend does not translate (known: {sorted(STYLES)}); use tp_size 1"
        )
    tied = _tied_head(model) is not None
    parallelize_module(model, mesh, {pattern: STYLES[style]() for pattern, style in plan.items()})
    if tied:
        head = model.get_output_embeddings()
        head.weight = model.get_input_embeddings().weight
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
            torch._foreach_mul_(grads, coef)
    return total
