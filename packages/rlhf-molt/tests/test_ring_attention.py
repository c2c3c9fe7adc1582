"""Ring attention over gloo equals full causal attention, forward and gradients.

Every rank builds the same full row batch (same seed), computes plain masked-softmax attention
over the whole sequence as the reference, and runs `ring_attention` on its own contiguous
block of tokens. The ring's output on the local queries and the gradients of the local
queries, keys and values (the keys' and values' gradients arrive from the other ranks'
queries through the ring's backward) must equal the reference's slices. float64, so equal
means 1e-10. 2 ranks, where the ring's two directions coincide, and 3, where a backward sent
the wrong way would land on the wrong rank.
"""

from __future__ import annotations

import pytest
import torch

from rlhf.learner import LearnerGroup

B, H, H_KV, D, L = 2, 4, 2, 8, 12

SEGMENTS = [
    [0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, -1],  # three packed samples, one pad at the end
    [-1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # left padding, one sample
]


def _reference(q, k, v, segment):
    """Masked softmax attention over the full rows: (B, H, L, D)."""
    index = torch.arange(L)
    mask = (
        (segment[:, None, :, None] == segment[:, None, None, :])
        & (segment >= 0)[:, None, None, :]
        & (index[None, None, None, :] <= index[None, None, :, None])
    )
    groups = H // H_KV
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * D**-0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # pad queries see no key
    return weights @ v


def _compare(_backend) -> dict[str, float]:
    import torch.distributed as dist

    from rlhf.molt import init_distributed
    from rlhf.molt.ring_attention import ring_attention

    init_distributed()
    rank, size = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, L, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, H_KV, L, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, H_KV, L, D, generator=gen, dtype=torch.float64)
    w = torch.randn(B, H, L, D, generator=gen, dtype=torch.float64)
    segment = torch.tensor(SEGMENTS)
    valid = (segment >= 0)[:, None, :, None]  # the loss reads real queries only

    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    expected = _reference(*full, segment)
    (expected * w * valid).sum().backward()

    chunk = L // size
    local = slice(rank * chunk, (rank + 1) * chunk)
    # Leaves laid out (B, Lc, heads, D) and passed transposed, as attention layers do:
    # the ring must cope with non-contiguous blocks.
    mine = [t[:, :, local].transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v)]
    out, lse = ring_attention(
        *(t.transpose(1, 2) for t in mine),
        segment=segment[:, local],
        token_index=torch.arange(L)[local],
        group=dist.group.WORLD,
    )
    (out * w[:, :, local] * valid[:, :, local]).sum().backward()

    def gap(a, b):
        return float((a - b).abs().max())

    keep = valid[:, :, local]
    return {
        "out": gap(out * keep, expected[:, :, local].detach() * keep),
        "finite": float(torch.isfinite(out).all() and torch.isfinite(lse).all()),
        **{
            f"grad_{name}": gap(got.grad.transpose(1, 2), ref.grad[:, :, local])
            for name, got, ref in zip("qkv", mine, full, strict=True)
        },
    }


@pytest.mark.parametrize("ranks", [2, 3])
def test_ring_attention_equals_full_attention(ray_cluster, ranks) -> None:
    group = LearnerGroup(num_ranks=ranks, num_cpus_per_rank=0.5)
    try:
        gaps = group.run(_compare)
    finally:
        group.shutdown()
    for rank, rank_gaps in enumerate(gaps):
        assert rank_gaps.pop("finite") == 1.0, rank
        assert max(rank_gaps.values()) < 1e-10, (rank, rank_gaps)
