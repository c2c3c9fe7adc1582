"""Context parallelism in the FSDP2 backend (Ray actors, gloo): each row's sequence split over
2 ranks (and 2 × 2 data × context parallel) takes the same step as one process — padded and
packed rows, actor and critic — and options it cannot serve are refused naming the flag.

Parameters are compared after one AdamW step with ``eps`` 1 (see test_tensor_parallel: a
gradient off by d moves a weight by at most ``lr * d``).
"""

from __future__ import annotations

import functools

import pytest
import torch

from rlhf.molt import FSDPBackend, FSDPConfig, FSDPConfigError
from rlhf.molt.config import check_context_parallel

from .molt_cases import clipped_ppo_case, config, critic_case, full_state

CP2 = functools.partial(FSDPBackend, fsdp=FSDPConfig(cp_size=2))
LR, EPS = 0.1, 1.0


def _attention(backend) -> tuple[str, int, int]:
    """The attention implementation the decoder runs and this rank's data-parallel coords."""
    return backend.module.config._attn_implementation, backend.dp_rank, backend.dp_size


@pytest.mark.parametrize(
    ("ranks", "packing"),
    [(2, False), (4, False), (2, True)],
    ids=["cp2", "dp2xcp2", "cp2-packed"],
)
def test_context_parallel_step_equals_one_process(groups, tiny_tp, ranks, packing) -> None:
    """Micro-batches of 2 padded rows (lengths 7–11, odd ones padded to split evenly) or of
    ≤ 16 packed tokens (samples crossing the block boundary), split over cp 2 (and dp 2),
    the gradient clipped to half its norm: loss, gradient norm and every parameter equal one
    full-batch step."""
    model, batch, objective, cfg, loss, grad_norm = clipped_ppo_case(
        tiny_tp, lr=LR, eps=EPS, packing=packing
    )

    group = groups[ranks]
    group.build(cfg, backend=CP2)
    dp = ranks // 2
    assert group.run(_attention) == [("molt_ring", r // 2, dp) for r in range(ranks)]
    split = {"max_tokens": 16} if packing else {"max_rows": 2}
    out = group.train_step(batch, objective, **split)
    assert out["loss"] == pytest.approx(loss, rel=1e-5)
    assert out["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    state = full_state(group)
    for name, param in model.named_parameters():
        torch.testing.assert_close(state[name], param.detach(), rtol=0, atol=LR * 1e-5)


def test_context_parallel_critic_equals_one_process(groups, tiny_tp, tmp_path) -> None:
    """The critic's scalar head reads the gathered hidden states; loss and gradient norm
    equal one process."""
    path, batch, objective, loss, grad_norm = critic_case(
        tiny_tp, tmp_path, batch_seed=7, value_seed=6
    )
    groups[2].build(config(path, kind="scalar"), backend=CP2)
    out = groups[2].train_step(batch, objective, max_rows=2)
    assert out["loss"] == pytest.approx(loss, rel=1e-5)
    assert out["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)


def test_what_context_parallel_cannot_serve_is_refused_by_flag(groups, tiny_tp) -> None:
    with pytest.raises(FSDPConfigError, match=r"--actor.fsdp.cp_size 2 must divide the role's 3"):
        check_context_parallel(cp_size=2, world_size=3, flag="actor.fsdp")
    check_context_parallel(cp_size=1, world_size=3, flag="actor.fsdp")
    with pytest.raises(FSDPConfigError, match="--fsdp.cp_size with model.lora_rank or"):
        groups[2].build(config(tiny_tp, chunked=True), backend=CP2)
