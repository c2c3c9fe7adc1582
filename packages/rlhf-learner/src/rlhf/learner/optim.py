"""AdamW parameter groups and the learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rlhf.learner.config import OptimizerConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed weight matrices, and undecayed biases and norm weights
    (every parameter with fewer than 2 dimensions: biases, RMSNorm/LayerNorm scales)."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        dims = len(getattr(param, "ds_shape", None) or param.shape)
        (decay if dims >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def lr_lambda(config: OptimizerConfig) -> Callable[[int], float]:
    """Multiplier of ``config.lr`` at optimizer step ``s`` (0-based, before the step).

    Linear warmup ``(s + 1) / warmup`` for ``s < warmup`` (``warmup_steps``, or
    ``ceil(warmup_ratio · total_steps)``), then from 1 down to
    ``min_lr_ratio`` at ``total_steps`` (cosine: ``r + (1 − r)(1 + cos(π p)) / 2``; linear:
    ``1 − (1 − r) p``; constant: 1), with ``p`` the fraction of the decay done, capped at 1.
    """
    total, floor = config.total_steps, config.min_lr_ratio
    warmup = config.warmup_steps or math.ceil(config.warmup_ratio * total)

    def at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if config.schedule == "constant":
            return 1.0
        span = max(total - warmup, 1)
        p = min((step - warmup) / span, 1.0)
        if config.schedule == "linear":
            return 1.0 - (1.0 - floor) * p
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p))

    return at


def build_optimizer(
    model: torch.nn.Module, config: OptimizerConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """torch AdamW (no compiled extension needed) over `param_groups`, and its schedule."""
    optimizer = torch.optim.AdamW(
        param_groups(model, config.weight_decay),
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
