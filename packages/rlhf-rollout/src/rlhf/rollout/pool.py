"""`EnginePool`: several generators behind one, dispatched by least outstanding work.

Outstanding work of an engine is the sum over its requests in flight of ``prompt length +
max_new_tokens`` (an upper bound on the tokens it still has to process). A new request goes to
the engine with the least, among those below ``max_in_flight_per_engine``; when every engine is
full, callers wait (back-pressure) instead of piling requests into vLLM's queue.

Samples of one prompt stay together: `generate_group` places all n on one engine (as one
request with ``n`` where the engine is a `rlhf.agents.GroupGenerator`), and a
`generate` call whose prompt is already waiting or in flight goes where that prompt went (an
executor's n calls for one prompt arrive together), so a group shares one prefix cache and
finishes on one engine, even under back-pressure. Cancelling a call cancels the request on its
engine.

An engine that dies under its requests (`EngineDiedError`) is revived when the pool has a
``revive`` hook: the hook makes a replacement for that slot once (requests failing on the same
dead engine meanwhile await the same revival, and no request is dispatched to the slot until it
ends), the replacement takes the slot, and every failed request is re-issued on the pool with
the same prompt and `SamplingParams` (a seeded request samples what the lost one would have). A
request is re-issued at most ``max_reissues`` times, so a crash loop ends in an error; without
a hook, or when the revival fails, the request's `EngineDiedError` propagates.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Protocol

from rlhf.agents import Generation, Generator, GroupGenerator, SamplingParams, nth_sample
from rlhf.rollout.ray_engine import EngineDiedError


class Revive(Protocol):
    """Makes the replacement of engine ``index`` of a pool, whose engine died: a generator
    that serves the weights the other engines hold (raise to give up: the requests that
    failed on the dead engine then fail with their `EngineDiedError`)."""

    def __call__(self, index: int) -> Awaitable[Generator]: ...


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
    reviving: bool = False

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
        revive: Replaces a dead engine (see the module docstring); settable later as
            ``pool.revive``. None: an `EngineDiedError` propagates.
        max_reissues: Times one request may be re-issued after its engine died.

    Attributes:
        restarts: Engines revived so far (``pool/engine_restarts`` in `metrics`).
    """

    def __init__(
        self,
        engines: Sequence[Generator],
        *,
        max_in_flight_per_engine: int = 64,
        record: bool = False,
        revive: Revive | None = None,
        max_reissues: int = 2,
    ) -> None:
        if not engines:
            raise ValueError("an EnginePool needs at least one engine")
        if max_in_flight_per_engine < 1:
            raise ValueError(
                f"max_in_flight_per_engine must be >= 1, got {max_in_flight_per_engine}"
            )
        self._slots = [_Slot(e) for e in engines]
        self.max_in_flight_per_engine = max_in_flight_per_engine
        if max_reissues < 0:
            raise ValueError(f"max_reissues must be >= 0, got {max_reissues}")
        self.assignments: list[int] | None = [] if record else None
        self.revive = revive
        self.max_reissues = max_reissues
        self.restarts = 0
        self._revivals: dict[int, asyncio.Future[None]] = {}
        self._changed: tuple[asyncio.AbstractEventLoop, asyncio.Condition] | None = None
        self._waiting = 0
        # prompt → [engine index or -1, requests of it waiting or in flight]
        self._pins: dict[tuple[int, ...], list[int]] = {}

    @property
    def engines(self) -> list[Generator]:
        """The pooled generators, in dispatch-index order."""
        return [s.generator for s in self._slots]

    def replace(self, index: int, generator: Generator) -> None:
        """Put ``generator`` in place of engine ``index`` (one found dead outside the pool,
        e.g. during a weight sync); its requests that fail on the dead engine are re-issued
        without a revival. Not counted in `restarts`."""
        self._slots[index].generator = generator

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
            fits = slot.in_flight + count <= cap or slot.in_flight == 0
            return pinned if fits and not slot.reviving else None
        free = [
            i
            for i, s in enumerate(self._slots)
            if (s.in_flight + count <= cap or s.in_flight == 0) and not s.reviving
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
        return (await self._dispatch(prompt_token_ids, [sampling]))[0]

    async def generate_group(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams, n: int
    ) -> list[Generation]:
        """``n`` samples of one prompt, all on one engine, admitted together: one
        ``generate_group`` request where the engine is a `rlhf.agents.GroupGenerator`, else
        ``n`` requests. Sample ``i`` is drawn with ``nth_sample(sampling, i)`` (seed ``+ i``
        when ``sampling.seed`` is set) either way.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        samplings = [nth_sample(sampling, i) for i in range(n)]
        return await self._dispatch(prompt_token_ids, samplings, group=True)

    async def _dispatch(
        self,
        prompt_token_ids: Sequence[int],
        samplings: list[SamplingParams],
        *,
        group: bool = False,
    ) -> list[Generation]:
        """The requests of one prompt on one engine, admitted together; those that fail with
        `EngineDiedError` are re-issued (together) after their engine was revived. ``group``:
        ``samplings[i]`` is ``nth_sample`` ``i`` of the first, so a run of them may travel as
        one group request."""
        key = tuple(int(t) for t in prompt_token_ids)
        out: list[Generation | None] = [None] * len(samplings)
        todo = list(range(len(samplings)))
        for reissue in range(self.max_reissues + 1):
            work = sum(len(key) + samplings[i].max_new_tokens for i in todo)
            slot = await self._acquire(key, len(todo), work)
            generator = slot.generator
            try:
                contiguous = todo == list(range(todo[0], todo[0] + len(todo)))
                results = await _outcomes(
                    generator, key, [samplings[i] for i in todo], group=group and contiguous
                )
            finally:
                await asyncio.shield(self._release(slot, key, len(todo), work))
            failed: list[int] = []
            died: EngineDiedError | None = None
            for i, result in zip(todo, results, strict=True):
                if isinstance(result, EngineDiedError):
                    failed.append(i)
                    died = died or result
                elif isinstance(result, BaseException):
                    raise result
                else:
                    out[i] = result
                    slot.requests += 1
                    slot.tokens += len(result.token_ids)
            if died is None:
                break
            if reissue == self.max_reissues:
                if self.revive is None:
                    raise died
                raise EngineDiedError(
                    f"a request failed on a dead engine {reissue + 1} times "
                    f"(re-issued at most {self.max_reissues} times): {died}",
                    actor_id=died.actor_id,
                ) from died
            await self._revive_once(slot, generator, died)
            todo = failed
        return [g for g in out if g is not None]

    async def _revive_once(self, slot: _Slot, dead: Generator, died: EngineDiedError) -> None:
        """Wait until the slot whose engine ``dead`` died serves a replacement (one revival
        per dead engine, however many of its requests failed); raises ``died`` when there is
        no ``revive`` hook or the revival failed."""
        if self.revive is None:
            raise died
        if slot.generator is not dead:  # another request's revival already replaced it
            return
        index = next(i for i, s in enumerate(self._slots) if s is slot)
        revival = self._revivals.get(index)
        if revival is None:
            revival = self._revivals[index] = asyncio.ensure_future(
                self._revive_slot(index, self.revive)
            )
        try:
            await asyncio.shield(revival)
            return
        except Exception as exc:
            failure = exc
        died.add_note(f"reviving engine {index} failed: {type(failure).__name__}: {failure}")
        raise died

    async def _revive_slot(self, index: int, revive: Revive) -> None:
        changed = self._condition()
        slot = self._slots[index]
        slot.reviving = True
        dead = slot.generator
        try:
            new = await revive(index)
            if slot.generator is dead:  # else `replace` swapped one in meanwhile
                slot.generator = new
                self.restarts += 1
        finally:
            slot.reviving = False
            del self._revivals[index]
            async with changed:
                changed.notify_all()

    def metrics(self) -> dict[str, float]:
        """Per engine ``pool/engine<i>/*``: requests and tokens completed, tokens/s over the time
        it had work, requests in flight (queue depth) and outstanding work; ``pool/waiting``;
        ``pool/engine_restarts`` (engines revived so far)."""
        out: dict[str, float] = {
            "pool/waiting": float(self._waiting),
            "pool/engine_restarts": float(self.restarts),
        }
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


async def _outcomes(
    generator: Generator, key: tuple[int, ...], samplings: list[SamplingParams], *, group: bool
) -> list[Generation | BaseException]:
    """Each request's generation or error (one request is awaited directly: no task).
    ``group`` (``samplings[i]`` is ``nth_sample`` ``i`` of the first): one ``generate_group``
    request where the generator takes one; it fails or succeeds as a whole."""
    if group and len(samplings) > 1 and isinstance(generator, GroupGenerator):
        try:
            generations = await generator.generate_group(key, samplings[0], len(samplings))
        except EngineDiedError as exc:
            return [exc] * len(samplings)
        return list(generations)
    if len(samplings) == 1:
        try:
            return [await generator.generate(key, samplings[0])]
        except EngineDiedError as exc:
            return [exc]
    return list(
        await asyncio.gather(
            *(generator.generate(key, s) for s in samplings), return_exceptions=True
        )
    )
