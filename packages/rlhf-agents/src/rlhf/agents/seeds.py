"""Per-request sampling seeds derived from one base seed.

A run seeds every request it sends: ``request_seed(base, prompt, sample, turn)``, with ``base``
itself derived from the run's seed and the step. The ``n`` samples of one prompt may instead
share one seed, ``group_seed(base, prompt)``, sample ``i`` drawing with that seed ``+ i``
(`nth_sample`): vLLM seeds the samples of one request with ``n`` that way, so a group sampled
as one engine request and as ``n`` requests is the same. A request's sample then depends only on the
run seed, where the request sits in the run and the weights and logits it is sampled from, not
on which other requests share its engine step or in what order they arrive; so a resumed run
draws the same samples as the run it continues, and two runs with one seed draw the same.
"""

from __future__ import annotations

from rlhf.agents.types import SamplingParams

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers that spreads every input bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def request_seed(base: int, *parts: int) -> int:
    """A seed in ``[0, 2**63)`` for the request at position ``parts`` under ``base``.

    Distinct positions get unrelated seeds (each part is folded in through a 64-bit mixing
    step, so ``(1, 2)`` and ``(2, 1)`` differ); the value is the same on every machine and
    Python version (no ``hash``).

    Args:
        base: The seed of the whole set of requests (e.g. a run seed, or a step's seed).
        parts: Integers naming the request within the set (e.g. prompt, sample, turn).
    """
    x = _mix(base & _MASK)
    for part in parts:
        x = _mix((x + 0x9E3779B97F4A7C15 + (part & _MASK)) & _MASK)
    return x >> 1


def seeded(sampling: SamplingParams, base: int | None, *parts: int) -> SamplingParams:
    """``sampling`` with the seed ``request_seed(base, *parts)``; unchanged when ``base`` is
    None (the engine's own random stream then decides)."""
    if base is None:
        return sampling
    return sampling.replace(seed=request_seed(base, *parts))


def group_seed(base: int, *parts: int) -> int:
    """The seed of a group of samples at position ``parts`` under ``base``: `request_seed`
    halved into ``[0, 2**62)``, so that sample ``i`` of the group (`nth_sample`: seed ``+ i``)
    stays a valid 63-bit seed."""
    return request_seed(base, *parts) >> 1


def nth_sample(sampling: SamplingParams, index: int) -> SamplingParams:
    """The sampling of sample ``index`` of a group whose sampling is ``sampling``: seed
    ``sampling.seed + index`` (vLLM's seeds for the samples of one request with ``n``);
    unchanged when ``sampling`` has no seed."""
    if sampling.seed is None:
        return sampling
    return sampling.replace(seed=sampling.seed + index)
