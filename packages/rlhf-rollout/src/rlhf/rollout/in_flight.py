"""The requests a `rlhf.rollout.VLLMEngine` has in vLLM, and how an engine step's finished
outputs resolve them into `rlhf.agents.Generation` results.

Runs on the engine's step thread only (no locks): the engine adds a request when its
``generate`` arrives, stamps the requests added since the last step with the weight version
that step runs on, and hands each step's outputs here.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from rlhf.agents import Generation
from rlhf.rollout.errors import EngineError
from rlhf.rollout.vllm_sampling import FINISH

if TYPE_CHECKING:
    from vllm.logprobs import FlatLogprobs
    from vllm.outputs import CompletionOutput, RequestOutput


@dataclass
class Request:
    """One request in vLLM."""

    future: Future[Generation | list[Generation]]
    """Its `Generation`, or a group's list of them."""
    group: int = 0
    """``n`` of a group request; 0 for one sample."""
    weight_version: int = -1
    """The weight version of the first engine step after it arrived (set by `stamp`)."""


class InFlight:
    """The requests in flight by request id, with the counts the engine reports
    (``requests_done``, ``tokens_generated``, ``aborted``)."""

    def __init__(self) -> None:
        self.pending: dict[str, Request] = {}
        self._unstepped: list[Request] = []  # added since the last step
        self.requests_done = 0
        self.tokens_generated = 0
        self.aborted = 0

    def __len__(self) -> int:
        return len(self.pending)

    def add(
        self, request_id: str, future: Future[Generation | list[Generation]], *, group: int
    ) -> None:
        """A request vLLM has just accepted (``group``: its ``n``, 0 for one sample)."""
        request = Request(future, group)
        self.pending[request_id] = request
        self._unstepped.append(request)

    def abort(self, request_id: str) -> bool:
        """Fail request ``request_id`` as aborted; False when it is no longer in flight
        (finished, or aborted already), so vLLM has nothing to abort."""
        request = self.pending.pop(request_id, None)
        if request is None:
            return False
        self.aborted += 1
        if not request.future.done():
            request.future.set_exception(EngineError(f"request {request_id} was aborted"))
        return True

    def stamp(self, weight_version: int) -> None:
        """The requests added since the last step run from now on weights ``weight_version``."""
        for request in self._unstepped:
            request.weight_version = weight_version
        self._unstepped.clear()

    def resolve(self, outputs: Sequence[RequestOutput]) -> None:
        """Answer every finished request of one step's ``outputs``; a malformed output fails
        its own request only."""
        for out in outputs:
            if not out.finished:
                continue
            request = self.pending.pop(out.request_id, None)
            if request is None or request.future.done():
                continue
            try:
                generations = [self._generation(c, request.weight_version) for c in out.outputs]
                if not request.group:
                    request.future.set_result(generations[0])
                elif len(generations) == 1:  # greedy: one sample stands for the group's n
                    request.future.set_result(generations * request.group)
                else:
                    request.future.set_result(generations)
            except Exception as exc:
                request.future.set_exception(EngineError(f"request {out.request_id}: {exc!r}"))

    def _generation(self, completion: CompletionOutput, weight_version: int) -> Generation:
        ids = tuple(completion.token_ids)
        # Requests ask for flat_logprobs (`vllm_sampling`): one FlatLogprobs, not a list.
        flat = cast("FlatLogprobs | None", completion.logprobs)
        # With logprobs=0 each position holds exactly the sampled token's entry.
        lps = tuple(flat.logprobs) if flat is not None else ()
        if len(lps) != len(ids) or (flat is not None and tuple(flat.token_ids) != ids):
            raise EngineError(f"vLLM returned {len(lps)} log-probs for {len(ids)} tokens")
        self.tokens_generated += len(ids)
        self.requests_done += 1
        return Generation(
            token_ids=ids,
            logprobs=lps,
            finish_reason=FINISH.get(str(completion.finish_reason), "stop"),  # type: ignore[arg-type]
            weight_version=weight_version,
        )

    def fail_all(self, error: BaseException) -> None:
        """Fail every request in flight with ``error`` (the engine stopped or its step failed)."""
        for request in self.pending.values():
            if not request.future.done():
                request.future.set_exception(error)
        self.pending.clear()
        self._unstepped.clear()

    def reset_counts(self) -> None:
        """The counts back to zero (a reused engine)."""
        self.requests_done = self.tokens_generated = self.aborted = 0
