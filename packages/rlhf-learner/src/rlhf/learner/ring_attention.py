"""Ring attention: exact causal attention over a sequence split across a context-parallel group.

Each of the ``cp`` ranks holds one contiguous block of every row's tokens: its queries, keys
and values. The key/value blocks travel around the ring (rank ``r`` passes what it holds to
``r + 1``), so after ``cp`` steps every query block has met every key block. Each step adds
one block's attention to a running result through log-sum-exp merging:

    lse = logaddexp(lse_a, lse_b)
    out = out_a · exp(lse_a − lse) + out_b · exp(lse_b − lse)

which is softmax attention over the union of the keys, exactly (up to float rounding). A
query attends a key when both belong to the same segment (one sample of a packed row; padding
is segment −1 and attends nothing) and the key's global token index is not after the query's.

The ring shift is an autograd function whose backward sends the gradient the opposite way, so
the backward of the whole computation is the backward of full attention, block by block. This
is the reference implementation over any process group (gloo on CPU); it keeps every step's
scores for autograd (memory O(L_local · L) per row, like eager attention), where the GPU
kernels recompute them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

_MASKED = -1e30
"""Score of a masked key: finite, so a block a query cannot see at all gives lse ≈ −1e30 and
weight exp(−1e30 − lse) = 0 when merged, instead of NaN from (−inf) − (−inf)."""


def _shift(tensor: Tensor, group: Any, *, forward: bool) -> Tensor:
    """``tensor`` from the previous rank of the ring (``forward``) or from the next one."""
    import torch.distributed as dist

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    to, frm = (
        ((rank + 1) % size, (rank - 1) % size)
        if forward
        else ((rank - 1) % size, (rank + 1) % size)
    )
    received = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    ops = [
        dist.P2POp(dist.isend, tensor.contiguous(), dist.get_global_rank(group, to), group),
        dist.P2POp(dist.irecv, received, dist.get_global_rank(group, frm), group),
    ]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


class _RingShift(torch.autograd.Function):
    """Forward: take the previous rank's tensor. Backward: the gradient goes back to it."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return _shift(tensor, group, forward=True)

    # torch types backward as (ctx, *grad_outputs); a fixed arity is how autograd documents it.
    @staticmethod
    def backward(  # pyright: ignore[reportIncompatibleMethodOverride]
        ctx: Any, grad: Tensor
    ) -> tuple[Tensor, None]:
        return _shift(grad, ctx.group, forward=False), None


def ring_shift(tensor: Tensor, group: Any) -> Tensor:
    """The tensor the previous rank of ``group`` holds (differentiable: the gradient flows back
    to that rank)."""
    return _RingShift.apply(tensor, group)


def _block(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """Attention of ``query`` over one key block: (out (B, H, Lq, D), lse (B, H, Lq))."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, _MASKED)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), value)
    return out, lse


def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    segment: Tensor,
    token_index: Tensor,
    group: Any,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal attention of this rank's queries over every rank's keys.

    Args:
        query: (B, H, Lc, D) this rank's block of queries.
        key, value: (B, Hkv, Lc, D) this rank's block; ``H`` a multiple of ``Hkv``
            (grouped-query attention: each key/value head serves ``H / Hkv`` query heads).
        segment: (B, Lc) int64 segment of each local token (a packed row's sample index;
            −1 for padding, which neither attends nor is attended).
        token_index: (Lc,) int64 global position of each local token in the full row (the
            causal order).
        group: The context-parallel process group, ranks in ring order.
        scale: Score scale, ``D ** -0.5`` by default.

    Returns:
        (out (B, H, Lc, D), lse (B, H, Lc)): the attention output of the local queries and
        the log-sum-exp of their scores. Padding queries get a finite, meaningless output.
    """
    import torch.distributed as dist

    block_scale = query.shape[-1] ** -0.5 if scale is None else scale
    groups = query.shape[1] // key.shape[1]
    q_segment = segment[:, None, :, None]
    q_index = token_index[None, None, :, None]

    def attend(key: Tensor, value: Tensor, kv_segment: Tensor, kv_index: Tensor):
        mask = (
            (q_segment == kv_segment[:, None, None, :])
            & (kv_segment >= 0)[:, None, None, :]
            & (kv_index[None, None, None, :] <= q_index)
        )
        if groups > 1:
            key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        return _block(query, key, value, mask, block_scale)

    kv_segment, kv_index = segment, token_index
    out, lse = attend(key, value, kv_segment, kv_index)  # the diagonal block first
    for _ in range(dist.get_world_size(group) - 1):
        key, value = ring_shift(key, group), ring_shift(value, group)
        kv_segment = _shift(kv_segment, group, forward=True)
        kv_index = _shift(kv_index, group, forward=True)
        block_out, block_lse = attend(key, value, kv_segment, kv_index)
        merged = torch.logaddexp(lse, block_lse)
        out = out * torch.exp(lse - merged).unsqueeze(-1) + block_out * torch.exp(
            block_lse - merged
        ).unsqueeze(-1)
        lse = merged
    return out, lse
