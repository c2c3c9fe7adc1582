"""The newer advantage and correction paths against the plain PPO step, side by side.

One "step" is what the learner computes per mini-batch on top of the model: the estimator's
advantages (`rlhf.algos.compute_advantages`) and the clipped policy loss with its backward
(`rlhf.algos.policy_loss`), on B sequences of T tokens (float32, CPU). Variants:

- ``ppo`` (baseline): group-normalised advantages, PPO clip, no correction;
- ``distill``: the reverse-KL advantage against a teacher's log-probs (on-policy distillation);
- ``icepop``: PPO with the token-level ratio mask outside [0.5, 2];
- ``binary_kl`` / ``tv``: PPO with the divergence-gated token mask (≤ 0.01 / ≤ 0.1).

All variants alternate in this process for ``--repeats`` rounds; the ratio of medians against
``ppo`` is reported (lower is faster).

Usage: python benchmarks/bench_losses.py [--repeats 7] [--json out.json] [--small]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from collections.abc import Callable

import torch

from rlhf.algos import (
    AdvantageConfig,
    PolicyLossConfig,
    RolloutCorrectionConfig,
    compute_advantages,
    policy_loss,
)

GROUP = 8


def make_inputs(batch: int, length: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(batch, length, generator=gen) * 2
    return {
        "old": old,
        "rollout": old + (torch.rand(batch, length, generator=gen) - 0.5) * 0.02,
        "teacher": old + (torch.rand(batch, length, generator=gen) - 0.5),
        "new": old + (torch.rand(batch, length, generator=gen) - 0.5) * 0.1,
        "mask": (torch.rand(batch, length, generator=gen) > 0.1).float(),
        "rewards": (torch.rand(batch, generator=gen) > 0.5).float(),
    }


def step(
    x: dict[str, torch.Tensor], *, estimator: str, correction: RolloutCorrectionConfig | None
) -> None:
    adv = compute_advantages(
        config=AdvantageConfig(estimator=estimator),
        rewards=x["rewards"],
        action_mask=x["mask"],
        n_samples_per_prompt=GROUP,
        logprobs=x["rollout"],
        teacher_logprobs=x["teacher"],
    ).advantages
    logprobs = x["new"].clone().requires_grad_()
    loss, _ = policy_loss(
        logprobs=logprobs,
        old_logprobs=x["old"],
        advantages=adv,
        action_mask=x["mask"],
        config=PolicyLossConfig(),
        rollout_logprobs=x["rollout"],
        rollout_correction=correction,
    )
    loss.backward()


VARIANTS: dict[str, Callable[[dict[str, torch.Tensor]], None]] = {
    "ppo": lambda x: step(x, estimator="group_norm", correction=None),
    "distill": lambda x: step(x, estimator="distill", correction=None),
    "icepop": lambda x: step(
        x, estimator="group_norm",
        correction=RolloutCorrectionConfig(mode="mask", threshold=(0.5, 2.0)),
    ),
    "binary_kl": lambda x: step(
        x, estimator="group_norm",
        correction=RolloutCorrectionConfig(mode="mask", threshold=(0.0, 0.01), gating="binary_kl"),
    ),
    "tv": lambda x: step(
        x, estimator="group_norm",
        correction=RolloutCorrectionConfig(mode="mask", threshold=(0.0, 0.1), gating="tv"),
    ),
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=pathlib.Path, default=None)
    parser.add_argument("--small", action="store_true", help="B=16, T=256 (a smoke run)")
    args = parser.parse_args()
    batch, length = (16, 256) if args.small else (64, 2048)
    x = make_inputs(batch, length)
    for fn in VARIANTS.values():  # warm-up
        fn(x)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, fn in VARIANTS.items():
            tick = time.perf_counter()
            fn(x)
            times[name].append(time.perf_counter() - tick)
    base = statistics.median(times["ppo"])
    results = {
        "shape": [batch, length],
        "threads": torch.get_num_threads(),
        "median_ms": {n: 1e3 * statistics.median(t) for n, t in times.items()},
        "ratio_vs_ppo": {n: statistics.median(t) / base for n, t in times.items()},
    }
    for name in VARIANTS:
        print(
            f"{name:10s} {results['median_ms'][name]:8.2f} ms  "
            f"{results['ratio_vs_ppo'][name]:.2f}x ppo"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
