"""Context parallelism: the decoder of each row runs split along the sequence over a cp group.

`shard_sequence` installs two hooks on a transformers model's base (decoder) model and one
attention implementation:

- before the decoder: the row batch every rank of the group received whole (``input_ids``
  (B, L) with ``attention_mask`` for padded rows, or ``position_ids`` restarting at 0 per
  sample for packed ones) is padded to a multiple of ``cp`` and cut into ``cp`` contiguous
  blocks; rank ``c`` runs block ``c`` with its global position ids;
- in every attention layer: `rlhf.learner.ring_attention` over the blocks (a query attends the
  earlier keys of its own sample, on any rank), instead of the model's attention;
- after the decoder: the blocks' last hidden states are gathered into (B, L, hidden) on
  every rank, differentiably, so every head (lm_head, a critic's or reward model's score,
  the chunked lm_head) and every objective runs unchanged on whole rows.

The decoder's activations shrink ``cp``-fold; the heads and objectives run whole on each rank
(identically), so their memory does not.

Gradients: each rank's loss is the full loss; the gather's backward sums the ``cp`` equal
gradients of each block's hidden states onto the rank that computed it (``cp`` × the true
one), which the backend's mean over the ``dp × cp`` ranks (FSDP2's, DeepSpeed's) divides back
out. The backend scales the loss by ``dp_size`` (the data-parallel replicas) exactly as
without context parallelism.

Used by both backends: the molt backend's ``fsdp.cp_size`` and the DeepSpeed backend's
``deepspeed.ring_attn_size``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from rlhf.learner.ring_attention import ring_attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ATTENTION = "molt_ring"
"""The name the ring attention is registered under in transformers' attention interface."""


def _ring_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **_: Any,
) -> tuple[Tensor, None]:
    """transformers' attention signature: (B, H, Lc, D) in, (B, Lc, H, D) out. Scores in
    float32 at least, as eager attention computes its softmax."""
    # A plain attribute set by `shard_sequence` (torch types Module attributes Tensor | Module).
    context = cast("dict[str, Any]", module.ring_context)
    compute = torch.promote_types(query.dtype, torch.float32)
    out, _lse = ring_attention(
        query.to(compute),
        key.to(compute),
        value.to(compute),
        segment=context["segment"],
        token_index=context["token_index"],
        group=context["group"],
        scale=scaling,
    )
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _no_mask(*_: Any, **__: Any) -> None:
    """The ring builds its own masks from segments and token indices."""
    return None


def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTENTION, _ring_forward)
    AttentionMaskInterface.register(ATTENTION, _no_mask)


class _GatherSequence(torch.autograd.Function):
    """(B, Lc, ...) blocks of the group's ranks → (B, cp · Lc, ...) on every rank; the
    backward sums the ranks' gradients of this rank's block."""

    @staticmethod
    def forward(ctx: Any, block: Tensor, group: Any) -> Tensor:
        import torch.distributed as dist

        ctx.group = group
        ctx.rank, ctx.size = dist.get_rank(group), dist.get_world_size(group)
        blocks = [torch.empty_like(block) for _ in range(ctx.size)]
        dist.all_gather(blocks, block.contiguous(), group=group)
        return torch.cat(blocks, dim=1)

    # torch types backward as (ctx, *grad_outputs); a fixed arity is how autograd documents it.
    @staticmethod
    def backward(  # pyright: ignore[reportIncompatibleMethodOverride]
        ctx: Any, grad: Tensor
    ) -> tuple[Tensor, None]:
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=1)[ctx.rank].contiguous(), None


def _segments(
    input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None
) -> tuple[Tensor, Tensor]:
    """(segment (B, L), position_ids (B, L)) of a row batch: packed rows (no mask, positions
    restarting at 0) get one segment per sample; padded rows one segment, −1 on padding."""
    b, n = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(n, device=input_ids.device).expand(b, n)
        segment = torch.zeros_like(input_ids)
    elif attention_mask is None:
        segment = torch.cumsum((position_ids == 0).long(), dim=1) - 1
    else:
        segment = torch.zeros_like(input_ids)
    if attention_mask is not None:
        segment = segment.masked_fill(attention_mask == 0, -1)
    return segment, position_ids


def check_group_size(size: int, *, world_size: int, flag: str) -> None:
    """Raise ValueError naming ``--{flag}`` unless the context-parallel group size divides
    the role's ranks."""
    if size < 1 or world_size % size:
        raise ValueError(
            f"--{flag} {size} must divide the role's {world_size} rank(s) (ranks = data "
            f"parallel x context parallel); change the rank count or {flag.rsplit('.', 1)[-1]}"
        )


def _base(model: torch.nn.Module, flag: str) -> torch.nn.Module:
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    inner = getattr(model, prefix, None) if prefix else None
    if not isinstance(inner, torch.nn.Module):
        raise ValueError(
            f"--{flag}: {type(model).__name__} has no base decoder model to split along the "
            "sequence; set it to 1"
        )
    return inner


def shard_sequence(model: torch.nn.Module, *, group: Any, flag: str) -> torch.nn.Module:
    """Run ``model``'s decoder on this rank's block of the sequence over ``group`` (see the
    module docstring; ``flag`` names the option in errors); returns the model."""
    import torch.distributed as dist

    _register()
    base = _base(model, flag)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    context: dict[str, Any] = {"group": group}
    for module in base.modules():
        if type(module).__name__.endswith("Attention"):
            module.ring_context = context  # type: ignore[assignment]

    def split(_module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None or kwargs.get("inputs_embeds") is not None:
            raise ValueError("context parallelism splits input_ids; inputs_embeds is not split")
        segment, positions = _segments(
            input_ids, kwargs.get("attention_mask"), kwargs.get("position_ids")
        )
        n = input_ids.shape[1]
        block = -(-n // size)
        pad = block * size - n
        if pad:
            input_ids = torch.nn.functional.pad(input_ids, (0, pad))
            segment = torch.nn.functional.pad(segment, (0, pad), value=-1)
            positions = torch.nn.functional.pad(positions, (0, pad))
        mine = slice(rank * block, (rank + 1) * block)
        context.update(
            segment=segment[:, mine],
            token_index=torch.arange(block * size, device=input_ids.device)[mine],
            length=n,
        )
        kwargs = {
            **kwargs,
            "input_ids": input_ids[:, mine],
            "attention_mask": None,
            "position_ids": positions[:, mine],
        }
        return (), kwargs

    def gather(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
        whole = _GatherSequence.apply(output.last_hidden_state, group)
        output.last_hidden_state = whole[:, : context["length"]]
        return output

    base.register_forward_pre_hook(split, with_kwargs=True)
    base.register_forward_hook(gather)
    # Both are transformers models; torch types a Module's attributes as Tensor | Module.
    cast("PreTrainedModel", model).config._attn_implementation = ATTENTION
    cast("PreTrainedModel", base).config._attn_implementation = ATTENTION
    return model
