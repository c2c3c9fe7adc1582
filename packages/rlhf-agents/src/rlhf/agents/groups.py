"""A prompt's samples as one request where the generator can (vLLM's ``n``)."""

from __future__ import annotations

from collections.abc import Sequence

from rlhf.agents._aio import gather_or_cancel
from rlhf.agents.seeds import nth_sample
from rlhf.agents.types import Generation, Generator, GroupGenerator, SamplingParams


async def sample_group(
    generator: Generator, prompt_token_ids: Sequence[int], sampling: SamplingParams, *, n: int
) -> list[Generation]:
    """``n`` samples of one prompt, sample ``i`` drawn with ``nth_sample(sampling, i)``.

    A `GroupGenerator` gets one ``generate_group`` call (one engine request: the prompt's
    prefill once, one request's book-keeping instead of ``n``); any other generator ``n``
    ``generate`` calls. Both draw the same samples when ``sampling`` is seeded.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if isinstance(generator, GroupGenerator):
        group = list(await generator.generate_group(prompt_token_ids, sampling, n))
        if len(group) != n:
            raise RuntimeError(f"generate_group returned {len(group)} samples for n={n}")
        return group
    return await gather_or_cancel(
        generator.generate(prompt_token_ids, nth_sample(sampling, i)) for i in range(n)
    )
