"""Ring attention over gloo equals full causal attention, forward and gradients; the DeepSpeed
backend's ``ring_attn_size`` takes the step of one process.

Every rank builds the same full row batch (same seed), computes plain masked-softmax attention
over the whole sequence as the reference, and runs `ring_attention` on its own contiguous
block of tokens. The ring's output on the local queries and the gradients of the local
queries, keys and values (the keys' and values' gradients arrive from the other ranks'
queries through the ring's backward) must equal the reference's slices. float64, so equal
means 1e-10. 2 ranks, where the ring's two directions coincide, and 3, where a backward sent
the wrong way would land on the wrong rank.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rlhf.algos import AlgoConfig, KLConfig, loss_normalizer
from rlhf.learner import (
    DeepSpeedBackend,
    DeepSpeedConfig,
    LearnerConfig,
    LearnerGroup,
    ModelConfig,
    OptimizerConfig,
    PPOActorObjective,
)
from rlhf.learner.optim import build_optimizer

from .test_units import _rl_batch

B, H, H_KV, D, L = 2, 4, 2, 8, 12
LR, EPS = 0.1, 1.0

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

    from rlhf.learner.rank import default_process_env
    from rlhf.learner.ring_attention import ring_attention

    if not dist.is_initialized():
        default_process_env()
        dist.init_process_group("gloo")
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


@pytest.mark.parametrize(
    ("ranks", "stage", "packing"),
    [(2, 2, False), (2, 2, True), (2, 3, False), (4, 2, False)],
    ids=["ring2-zero2", "ring2-zero2-packed", "ring2-zero3", "dp2xring2-zero2"],
)
def test_deepspeed_ring_attention_step_equals_one_process(
    ray_cluster, tiny, ranks, stage, packing
) -> None:
    """`deepspeed.ring_attn_size` 2: each row's sequence split over a pair of ranks (padded
    rows of 7–11 tokens, odd ones padded to split; or ≤ 16-token packed rows whose samples
    cross the block boundary), dp 1 or 2: loss, gradient norm and every parameter after
    AdamW equal one full-batch step in this process. AdamW's ``eps`` is 1: its first step
    moves a weight by ``lr * g / (|g| + eps)``, so a gradient off by d (the blocks' summation
    order) moves it by at most ``lr * d``; with a tiny ``eps`` an embedding row whose gradient
    is ~1e-10 turns rounding into lr-sized differences."""
    model = Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    batch = _rl_batch(model, seed=2)
    algo = AlgoConfig(kl=KLConfig(use_loss=True, estimator="k3"), entropy_coef=0.01)
    norm = float(loss_normalizer(batch["action_mask"], mode="token-mean"))
    objective = PPOActorObjective(algo=algo, normalizer=norm, kl_coef=0.1)
    cfg = LearnerConfig(
        model=ModelConfig(path=str(tiny), packing_samples=packing),
        optimizer=OptimizerConfig(lr=LR, grad_clip=0.0, betas=(0.9, 0.95), eps=EPS),
    )
    ring = functools.partial(
        DeepSpeedBackend, deepspeed=DeepSpeedConfig(zero_stage=stage, ring_attn_size=2)
    )
    optimizer, scheduler = build_optimizer(model, cfg.optimizer)
    loss, _ = objective(model, dataclasses.replace(batch, packing_samples=packing))
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters())).item()
    optimizer.step()
    scheduler.step()

    group = LearnerGroup(num_ranks=ranks, num_cpus_per_rank=0.5)
    try:
        group.build(cfg, backend=ring)
        coords = group.run(lambda backend: (backend.dp_rank, backend.dp_size))
        assert coords == [(r // 2, ranks // 2) for r in range(ranks)]
        split = {"max_tokens": 16} if packing else {"max_rows": 2}
        out = group.train_step(batch, objective, **split)
        after = group.run(lambda backend: backend.state_dict_on_rank0())[0]
    finally:
        group.shutdown()
    assert out["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    assert out["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    for name, param in model.named_parameters():
        torch.testing.assert_close(after[name], param.detach(), rtol=0, atol=LR * 1e-5, msg=name)


def test_a_ring_that_does_not_divide_the_ranks_is_refused(ray_cluster, tiny) -> None:
    with pytest.raises(ValueError, match="deepspeed.ring_attn_size must be >= 1"):
        DeepSpeedConfig(ring_attn_size=0)
    group = LearnerGroup(num_ranks=3, num_cpus_per_rank=0.5)
    cfg = LearnerConfig(
        model=ModelConfig(path=str(tiny)),
        optimizer=OptimizerConfig(lr=1e-3),
    )
    ring = functools.partial(DeepSpeedBackend, deepspeed=DeepSpeedConfig(ring_attn_size=2))
    try:
        with pytest.raises(
            Exception, match=r"--deepspeed.ring_attn_size 2 must divide the role's 3"
        ):
            group.build(cfg, backend=ring)
    finally:
        group.shutdown()
