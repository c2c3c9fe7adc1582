"""Conformance of an engine's log-probs with a transformers forward of the same weights.

Importance-sampling correction (and every PPO ratio at step 0) assumes that the log-prob the
sampler reports for a token is the log-prob the learner computes for it. `check_logprobs`
samples completions from a `Generator`, recomputes every sampled token's log-prob with a
transformers forward of the checkpoint, and reports the gap.

The reference is vLLM's ``processed_logprobs`` mode: greedy requests (temperature 0) report the
plain log-softmax of the logits; sampled requests report the log-softmax after temperature
scaling and the top-k / top-p filters (filtered tokens get probability 0, the rest are
renormalised). `processed_logprobs` below recomputes exactly that.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlhf.agents import Generator, SamplingParams


def processed_logprobs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Log-probs of the distribution a request samples from.

    Args:
        logits: (T, V) raw next-token logits.
        sampling: The request's sampling parameters.

    Returns:
        (T, V) float32 log-probs: ``log_softmax(logits)`` when greedy; otherwise
        ``log_softmax(filter(logits / temperature))``, where top-k keeps the tokens whose logit
        is at least the k-th largest and top-p keeps the smallest set of most likely tokens
        whose probability reaches p (always at least one), as vLLM's sampler does.
    """
    logits = logits.float()
    if sampling.temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    scaled = logits / sampling.temperature
    vocab = scaled.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(scaled, sampling.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    if sampling.top_p < 1.0:
        ascending, order = torch.sort(scaled, dim=-1)
        # Mass of the tokens at or below each position; a token is dropped when everything up
        # to and including it stays within 1 - p. The most likely token always survives.
        below = torch.softmax(ascending, dim=-1).cumsum(dim=-1)
        drop = below <= 1.0 - sampling.top_p
        drop[..., -1] = False
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), -math.inf)
    return torch.log_softmax(scaled, dim=-1)


@dataclass(frozen=True)
class ConformanceReport:
    """How far an engine's sampled-token log-probs are from the reference forward.

    Attributes:
        tokens: Sampled tokens compared.
        max_abs_diff: Largest ``|engine − reference|`` over them.
        mean_abs_diff: Mean ``|engine − reference|``.
        tolerance: The bound the check was run with.
        worst: ``(sample, position)`` of the largest difference.
    """

    tokens: int
    max_abs_diff: float
    mean_abs_diff: float
    tolerance: float
    worst: tuple[int, int]

    @property
    def passed(self) -> bool:
        """Every compared token is within ``tolerance``."""
        return self.tokens > 0 and self.max_abs_diff <= self.tolerance

    def summary(self) -> str:
        """One line for logs."""
        verdict = "ok" if self.passed else "MISMATCH"
        return (
            f"rollout/trainer log-prob conformance {verdict}: {self.tokens} tokens, max |Δ| "
            f"{self.max_abs_diff:.3g} (sample {self.worst[0]}, token {self.worst[1]}), mean |Δ| "
            f"{self.mean_abs_diff:.3g}, tolerance {self.tolerance:g}"
        )


async def check_logprobs(
    generator: Generator,
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    sampling: SamplingParams,
    tolerance: float = 1e-4,
) -> ConformanceReport:
    """Sample one completion per prompt and compare its log-probs with ``model``'s.

    Args:
        generator: The engine (or pool) under test.
        model: A causal LM with the generator's weights (e.g. ``AutoModelForCausalLM.
            from_pretrained(dir, dtype=torch.float32)``), in eval mode; its device is used.
        prompts: Prompt token ids, one completion each.
        sampling: Sampling parameters of every request (greedy or sampled, any top-k/top-p).
        tolerance: Largest accepted ``|Δ log p|``; about 1e-4 holds in fp32 on CPU, bf16
            engines need ~1e-1.

    Returns:
        The report; `ConformanceReport.passed` says whether it is within ``tolerance``.
    """
    if not prompts:
        raise ValueError("check_logprobs needs at least one prompt")
    generations = await asyncio.gather(*(generator.generate(list(p), sampling) for p in prompts))
    device = next(model.parameters()).device
    diffs: list[torch.Tensor] = []
    for prompt, g in zip(prompts, generations, strict=True):
        if not g.token_ids:
            diffs.append(torch.zeros(0))
            continue
        ids = torch.tensor([list(prompt) + list(g.token_ids)], device=device)
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
        ref = processed_logprobs(logits, sampling)
        picked = ref.gather(-1, torch.tensor(g.token_ids, device=device)[:, None])[:, 0].cpu()
        diffs.append((torch.tensor(g.logprobs, dtype=torch.float32) - picked).abs())
    lengths = [d.numel() for d in diffs]
    flat = torch.cat(diffs)
    if flat.numel() == 0:
        return ConformanceReport(0, math.inf, math.inf, tolerance, (0, 0))
    # A NaN on either side is a mismatch, never a pass.
    flat = torch.nan_to_num(flat, nan=math.inf)
    at = int(flat.argmax())
    sample = next(i for i in range(len(lengths)) if at < sum(lengths[: i + 1]))
    return ConformanceReport(
        tokens=flat.numel(),
        max_abs_diff=float(flat.max()),
        mean_abs_diff=float(flat.mean()),
        tolerance=tolerance,
        worst=(sample, at - sum(lengths[:sample])),
    )
