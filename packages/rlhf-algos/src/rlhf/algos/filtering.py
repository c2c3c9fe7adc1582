"""Dynamic filtering of prompt groups (DAPO's dynamic sampling, arXiv 2503.14476).

A prompt group (its n samples) is kept iff lo < mean(scores) < hi. The default (0, 1) drops
groups whose samples all scored 0 or all scored 1: their group-relative advantages are all 0 and
they would only dilute the batch. Replacing dropped prompts until the batch is full (or the data
ends) is the driver's job; this module decides and reports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf.algos import _checks


@dataclass(frozen=True)
class GroupFilter:
    """Decision of `dynamic_filter`.

    Attributes:
        keep_groups: (P,) bool, one per prompt.
        keep_samples: (B,) bool, ``keep_groups`` repeated n times.
        group_mean: (P,) mean score per prompt.
        group_std: (P,) unbiased std of scores per prompt (0 for n = 1).
        metrics: Detached 0-dim tensors: kept fraction, all-low and all-high fractions.
    """

    keep_groups: Tensor
    keep_samples: Tensor
    group_mean: Tensor
    group_std: Tensor
    metrics: dict[str, Tensor]


def dynamic_filter(
    scores: Tensor,
    *,
    n_samples_per_prompt: int,
    score_range: tuple[float, float] = (0.0, 1.0),
) -> GroupFilter:
    """Keep prompt groups whose mean score lies strictly inside ``score_range``.

    Args:
        scores: (B,) per-sample scores (e.g. 0/1 correctness), samples of a prompt contiguous.
        n_samples_per_prompt: n, dividing B.
        score_range: (lo, hi) with lo < hi.

    Returns:
        `GroupFilter`.
    """
    s = _checks.floating("scores", scores, ndim=1)
    _checks.group_size("n_samples_per_prompt", n_samples_per_prompt, batch=s.shape[0])
    low, high = _checks.interval("score_range", score_range, strict=True)
    groups = s.view(-1, n_samples_per_prompt)
    mean = groups.mean(dim=1)
    std = groups.std(dim=1, unbiased=True) if n_samples_per_prompt > 1 else torch.zeros_like(mean)
    keep = (mean > low) & (mean < high)
    metrics = {
        "filter/kept_frac": keep.float().mean(),
        "filter/low_frac": (mean <= low).float().mean(),
        "filter/high_frac": (mean >= high).float().mean(),
    }
    return GroupFilter(
        keep_groups=keep,
        keep_samples=keep.repeat_interleave(n_samples_per_prompt),
        group_mean=mean,
        group_std=std,
        metrics=metrics,
    )
