"""`EnginePool`: several generators behind one, dispatched by least outstanding work.

Outstanding work of an engine is the sum over its requests in flight of ``prompt length +
max_new_tokens`` (an upper bound on the tokens it still has to process). A new request goes to
the engine with the least, among those below ``max_in_flight_per_engine``; when every engine is
full, callers wait (back-pressure) instead of piling requests into vLLM's queue.

Samples of one prompt stay together: `generate_group` places all n on one engine, and a
`generate` call whose prompt is already waiting or in flight goes where that prompt went (an
executor's n calls for one prompt arrive together), so a group shares one prefix cache and
finishes on one engine, even under back-pressure. Cancelling a call cancels the request on its
engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from rlhf.agents import Generation, Generator, SamplingParams


@dataclass
class _Slot:
    """Book-keeping of one engine."""

    generator: Generator
    in_flight: int = 0
    work: int = 0
    requests: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    busy_since: float | None = None

    def admit(self, count: int, work: int) -> None:
        if self.in_flight == 0:
            self.busy_since = time.perf_counter()
        self.in_flight += count
        self.work += work

    def release(self, count: int, work: int) -> None:
        self.in_flight -= count
        self.work -= work
        if self.in_flight == 0 and self.busy_since is not None:
            self.busy_s += time.perf_counter() - self.busy_since
            self.busy_since = None


class EnginePool:
    """A `Generator` over several generators (`VLLMEngine`, `RayEngine`, …).

    Args:
        engines: The generators, at least one.
        max_in_flight_per_engine: Requests one engine may hold at once; more wait in the pool.
            Match it to the engine's ``max_num_seqs`` (or a small multiple).
        record: Keep `assignments` (engine index per request, in order) for inspection.
    """

    def __init__(
        self,
        engines: Sequence[Generator],
        *,
        max_in_flight_per_engine: int = 64,
        record: bool = False,
    ) -> None:
        if not engines:
            raise ValueError("an EnginePool needs at least one engine")
        if max_in_flight_per_engine < 1:
            raise ValueError(
                f"max_in_flight_per_engine must be >= 1, got {max_in_flight_per_engine}"
            )
        self._slots = [_Slot(e) for e in engines]
        self.max_in_flight_per_engine = max_in_flight_per_engine
        self.assignments: list[int] | None = [] if record else None
        self._changed: tuple[asyncio.AbstractEventLoop, asyncio.Condition] | None = None
        self._waiting = 0
        # prompt → [engine index or -1, requests of it waiting or in flight]
        self._pins: dict[tuple[int, ...], list[int]] = {}

    @property
    def engines(self) -> list[Generator]:
        """The pooled generators, in dispatch-index order."""
        return [s.generator for s in self._slots]

    def _condition(self) -> asyncio.Condition:
        """The pool's condition on the running event loop (one loop at a time)."""
        loop = asyncio.get_running_loop()
        if self._changed is None or self._changed[0] is not loop:
            if self._changed is not None and any(s.in_flight for s in self._slots):
                raise RuntimeError("an EnginePool serves one event loop at a time")
            self._changed = (loop, asyncio.Condition())
        return self._changed[1]

    def _choose(self, key: tuple[int, ...], count: int) -> int | None:
        """The engine for ``count`` requests of prompt ``key``, or None to wait."""
        cap = self.max_in_flight_per_engine
        pinned = self._pins[key][0]
        if pinned >= 0:  # keep a prompt's samples together
            slot = self._slots[pinned]
            return pinned if slot.in_flight + count <= cap or slot.in_flight == 0 else None
        free = [
            i for i, s in enumerate(self._slots) if s.in_flight + count <= cap or s.in_flight == 0
        ]
        if not free:
            return None
        return min(free, key=lambda i: (self._slots[i].work, self._slots[i].in_flight, i))

    async def _acquire(self, key: tuple[int, ...], count: int, work: int) -> _Slot:
        changed = self._condition()
        async with changed:
            pin = self._pins.setdefault(key, [-1, 0])
            pin[1] += count
            self._waiting += count
            try:
                while (index := self._choose(key, count)) is None:
                    await changed.wait()
            except BaseException:
                self._unpin(key, count)
                raise
            finally:
                self._waiting -= count
            pin[0] = index
            slot = self._slots[index]
            slot.admit(count, work)
            if self.assignments is not None:
                self.assignments.extend([index] * count)
            return slot

    async def _release(self, slot: _Slot, key: tuple[int, ...], count: int, work: int) -> None:
        changed = self._condition()
        async with changed:
            slot.release(count, work)
            self._unpin(key, count)
            changed.notify_all()

    def _unpin(self, key: tuple[int, ...], count: int) -> None:
        pin = self._pins[key]
        pin[1] -= count
        if pin[1] == 0:
            del self._pins[key]

    async def generate(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> Generation:
        """Sample one completion on the least loaded engine (see `rlhf.agents.Generator`)."""
        key = tuple(int(t) for t in prompt_token_ids)
        work = len(key) + sampling.max_new_tokens
        slot = await self._acquire(key, 1, work)
        try:
            g = await slot.generator.generate(key, sampling)
        finally:
            await asyncio.shield(self._release(slot, key, 1, work))
        slot.requests += 1
        slot.tokens += len(g.token_ids)
        return g

    async def generate_group(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams, n: int
    ) -> list[Generation]:
        """``n`` samples of one prompt, all on one engine, admitted together.

        Per-request seeds, when ``sampling.seed`` is set, are ``seed + i`` for sample ``i``.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        key = tuple(int(t) for t in prompt_token_ids)
        work = n * (len(key) + sampling.max_new_tokens)
        slot = await self._acquire(key, n, work)
        try:
            outs = await asyncio.gather(
                *(slot.generator.generate(key, _seeded(sampling, i)) for i in range(n))
            )
        finally:
            await asyncio.shield(self._release(slot, key, n, work))
        slot.requests += n
        slot.tokens += sum(len(g.token_ids) for g in outs)
        return list(outs)

    def metrics(self) -> dict[str, float]:
        """Per engine ``pool/engine<i>/*``: requests and tokens completed, tokens/s over the time
        it had work, requests in flight (queue depth) and outstanding work; ``pool/waiting``."""
        out: dict[str, float] = {"pool/waiting": float(self._waiting)}
        now = time.perf_counter()
        for i, s in enumerate(self._slots):
            busy = s.busy_s + (now - s.busy_since if s.busy_since is not None else 0.0)
            p = f"pool/engine{i}/"
            out[p + "requests"] = float(s.requests)
            out[p + "tokens"] = float(s.tokens)
            out[p + "tokens_per_s"] = s.tokens / busy if busy > 0 else 0.0
            out[p + "in_flight"] = float(s.in_flight)
            out[p + "outstanding_work"] = float(s.work)
        return out


def _seeded(sampling: SamplingParams, i: int) -> SamplingParams:
    if sampling.seed is None:
        return sampling
    return replace(sampling, seed=sampling.seed + i)
