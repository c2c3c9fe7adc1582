"""Remote reward client speaking OpenRLHF's JSON wire format.

Request: ``POST {"query": [...], "prompts": [...], "labels": [...]}``; response:
``{"rewards": [...], "scores": [...]?, "extra_logs": {...}?}``. A batch is split into contiguous
shards spread round-robin over the URLs (never an empty request), sent with bounded concurrency,
a per-request timeout and retries with exponential backoff on connection errors, timeouts, 429
and 5xx. A 4xx or a malformed body is not retried. What then happens to the shard's samples is
the `FailurePolicy`: ``raise`` names the URL, the status and an excerpt of the body.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypedDict

import httpx

from rlhf.agents.rewards import (
    FailurePolicy,
    PolicyApplier,
    RewardBatch,
    RewardError,
    fill,
    new_batch,
    parse_reward_output,
)

BODY_EXCERPT = 300


@dataclass(frozen=True)
class RemoteRewardConfig:
    """Remote reward servers (``--reward.remote_url``).

    Attributes:
        urls: One or more endpoints (full URLs, e.g. ``http://127.0.0.1:5000/get_reward``).
        timeout_s: Deadline of one request in seconds (connect, send and the whole response).
        max_retries: Retries after the first attempt for retryable failures.
        backoff_s: First retry delay; doubles with each retry.
        max_concurrency: Requests in flight at once across all URLs.
        max_batch_size: Largest number of samples per request; None shards evenly over the URLs.
        policy: What happens to samples whose request failed for good.
        api_key: Sent as ``Authorization: Bearer <api_key>`` (``rlhf serve-rm --api_key``);
            None sends no credentials.
        notice_s: A request still waiting this long, and every retry, is reported (at most
            once per URL per ``notice_s``) to `RemoteReward`'s ``report``.
    """

    urls: tuple[str, ...]
    timeout_s: float = 30.0
    max_retries: int = 3
    backoff_s: float = 0.5
    max_concurrency: int = 8
    max_batch_size: int | None = None
    policy: FailurePolicy = field(default_factory=FailurePolicy)
    api_key: str | None = field(default=None, repr=False)
    notice_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("reward.remote_url needs at least one URL")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"reward.remote_url {url!r} must start with http:// or https://")
        if not self.timeout_s > 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {self.timeout_s}")
        if not self.notice_s > 0:
            raise ValueError(f"reward.notice_s must be > 0, got {self.notice_s}")
        if self.max_retries < 0 or self.backoff_s < 0 or self.max_concurrency < 1:
            raise ValueError("reward.max_retries and backoff_s must be >= 0, max_concurrency >= 1")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError(
                f"reward.max_batch_size must be >= 1 or None, got {self.max_batch_size}"
            )


class RewardRequest(TypedDict):
    """The JSON body of one request (OpenRLHF's wire format): one entry per sample."""

    query: list[str]
    prompts: list[str]
    labels: list[object]


class _RequestError(Exception):
    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def shard_bounds(n: int, *, n_urls: int, max_batch_size: int | None) -> list[tuple[int, int]]:
    """Contiguous (lo, hi) shards of a batch of n: as many as URLs (more if shards would exceed
    ``max_batch_size``), never more than n, sizes differing by at most one."""
    if n == 0:
        return []
    shards = n_urls if max_batch_size is None else max(n_urls, math.ceil(n / max_batch_size))
    shards = min(shards, n)
    base, extra = divmod(n, shards)
    bounds, lo = [], 0
    for i in range(shards):
        hi = lo + base + (1 if i < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def _seconds(value: float) -> str:
    value = max(value, 0.0)
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


class RemoteReward:
    """A `RewardScorer` that asks HTTP reward servers; use as an async context manager or call
    `aclose`.

    Args:
        config: The servers and how to ask them.
        report: Told, in a line naming the URL, the attempt and the time left before the
            failure policy applies, when a request waits longer than ``config.notice_s`` and
            when one is retried; None: nothing is said.
    """

    def __init__(
        self, config: RemoteRewardConfig, *, report: Callable[[str], None] | None = None
    ) -> None:
        self.config = config
        self.report = report
        self._noticed: dict[str, float] = {}
        self._client: httpx.AsyncClient | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _bind(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        """The HTTP client and semaphore of the running event loop (made anew per loop)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._semaphore is None or self._loop is not loop:
            key = self.config.api_key
            headers = {"Authorization": f"Bearer {key}"} if key else None
            self._client = httpx.AsyncClient(timeout=self.config.timeout_s, headers=headers)
            self._semaphore = asyncio.Semaphore(self.config.max_concurrency)
            self._loop = loop
        return self._client, self._semaphore

    async def __aenter__(self) -> RemoteReward:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP client of the current event loop, if any."""
        if self._client is not None and self._loop is asyncio.get_running_loop():
            await self._client.aclose()
        self._client = self._semaphore = self._loop = None

    async def _post_once(self, url: str, payload: RewardRequest, n: int) -> dict[str, object]:
        client, _ = self._bind()
        try:
            # A hard deadline: httpx's own timeout applies per read, so a server that trickles
            # bytes would never time out.
            response = await asyncio.wait_for(client.post(url, json=payload), self.config.timeout_s)
        except (httpx.TimeoutException, TimeoutError):
            raise _RequestError(
                f"{url}: no answer within {self.config.timeout_s} s", retryable=True
            ) from None
        except httpx.TransportError as exc:
            raise _RequestError(f"{url}: {type(exc).__name__}: {exc}", retryable=True) from None
        body = response.content[:BODY_EXCERPT].decode("utf-8", errors="replace")
        if response.status_code != 200:
            retryable = response.status_code == 429 or response.status_code >= 500
            raise _RequestError(
                f"{url}: HTTP {response.status_code}, body: {body!r}", retryable=retryable
            )
        try:
            data = json.loads(response.content)
        except ValueError:  # JSONDecodeError, or a body that is not UTF-8
            raise _RequestError(f"{url}: malformed JSON body: {body!r}", retryable=False) from None
        if not isinstance(data, dict):
            raise _RequestError(
                f"{url}: expected a JSON object with 'rewards', got: {body!r}", retryable=False
            )
        try:
            parse_reward_output(data, n=n, source=url)
        except RewardError as exc:
            raise _RequestError(f"{exc}; body: {body!r}", retryable=False) from None
        return data

    def _left_s(self, attempt: int, elapsed_s: float) -> float:
        """Seconds until the failure policy applies at the latest: what is left of this
        attempt, then every later attempt with its backoff."""
        c = self.config
        later = range(attempt + 1, c.max_retries + 1)
        return (c.timeout_s - elapsed_s) + sum(
            c.timeout_s + c.backoff_s * 2 ** (k - 1) for k in later
        )

    def _tell(self, url: str, line: str, *, always: bool = False) -> None:
        now = time.monotonic()
        if self.report is None or (
            not always and now - self._noticed.get(url, -math.inf) < self.config.notice_s
        ):
            return
        self._noticed[url] = now
        self.report(line)

    async def _waiting(self, url: str, attempt: int) -> None:
        """Reports a request to ``url`` that is still waiting, every ``notice_s``."""
        start = time.monotonic()
        attempts = self.config.max_retries + 1
        while True:
            await asyncio.sleep(self.config.notice_s)
            elapsed = time.monotonic() - start
            self._tell(
                url,
                f"{url}: waiting {_seconds(elapsed)} s of {self.config.timeout_s:g} s for an "
                f"answer (attempt {attempt + 1} of {attempts}; the failure policy applies in at "
                f"most {_seconds(self._left_s(attempt, elapsed))} s)",
            )

    async def _post(self, url: str, payload: RewardRequest, n: int) -> dict[str, object]:
        attempt = 0
        while True:
            _, semaphore = self._bind()
            waiting = asyncio.ensure_future(self._waiting(url, attempt)) if self.report else None
            try:
                async with semaphore:
                    return await self._post_once(url, payload, n)
            except _RequestError as failure:
                if not failure.retryable or attempt >= self.config.max_retries:
                    suffix = f" (after {attempt + 1} attempts)" if failure.retryable else ""
                    raise RewardError(f"remote reward {failure}{suffix}") from None
                delay = self.config.backoff_s * 2**attempt
                self._tell(
                    url,
                    f"{failure}: retrying in {delay:g} s (attempt {attempt + 2} of "
                    f"{self.config.max_retries + 1}; the failure policy applies in at most "
                    f"{_seconds(self._left_s(attempt + 1, 0.0) + delay)} s)",
                    always=True,
                )
                await asyncio.sleep(delay)
                attempt += 1
            finally:
                if waiting is not None:
                    waiting.cancel()

    async def score(
        self,
        *,
        queries: Sequence[str],
        prompts: Sequence[str],
        labels: Sequence[object],
        **kwargs: object,
    ) -> RewardBatch:
        """Score a batch on the servers; see the module docstring."""
        batch = new_batch(queries, prompts, labels)
        n = len(queries)
        bounds = shard_bounds(
            n, n_urls=len(self.config.urls), max_batch_size=self.config.max_batch_size
        )
        requests = []
        for i, (lo, hi) in enumerate(bounds):
            url = self.config.urls[i % len(self.config.urls)]
            payload: RewardRequest = {
                "query": list(queries[lo:hi]),
                "prompts": list(prompts[lo:hi]),
                "labels": list(labels[lo:hi]),
            }
            requests.append(self._post(url, payload, hi - lo))
        results = await asyncio.gather(*requests, return_exceptions=True)
        policy = self.config.policy
        batch.metrics["reward/requests"] = float(len(bounds))
        for (lo, hi), result, i in zip(bounds, results, range(len(bounds)), strict=True):
            url = self.config.urls[i % len(self.config.urls)]
            applier = PolicyApplier(policy, f"remote reward {url}")
            if isinstance(result, BaseException):
                if not isinstance(result, RewardError) or policy.on_failure == "raise":
                    raise result
                for j in range(lo, hi):
                    applier.fail(batch, j, str(result))
                batch.metrics["reward/failed_requests"] = (
                    batch.metrics.get("reward/failed_requests", 0.0) + 1
                )
                continue
            fill(batch, lo, parse_reward_output(result, n=hi - lo, source=url), applier, result)
        return batch
