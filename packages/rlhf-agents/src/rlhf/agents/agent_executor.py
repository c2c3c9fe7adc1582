"""Executor for black-box agents written against the OpenAI client.

The user's file defines ``agent(base_url, prompt, label, **kwargs)`` (sync or async). It talks to
the policy through any OpenAI-compatible client at ``base_url`` (e.g.
``openai.AsyncOpenAI(base_url=base_url, api_key="unused")``) and returns its reward: a number, or
a dict with ``reward`` and optional ``score`` and ``metrics``. Each sample gets its own session on
a local `OpenAICompatibleServer` (127.0.0.1, a free port, inside the executor's event loop); the
session's token stream becomes one `Trajectory` with one action span per completion. Sync agents
run in worker threads so they never block the server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Required, TypedDict, Unpack

import uvicorn

from rlhf.agents._aio import gather_or_cancel
from rlhf.agents.loading import load_symbol
from rlhf.agents.openai_server import OpenAICompatibleServer
from rlhf.agents.seeds import request_seed
from rlhf.agents.single_turn import ExecutorResult, batch_indices
from rlhf.agents.tokens import Tokenizer
from rlhf.agents.types import Generator, SamplingParams, Trajectory, finite_float


class AgentError(RuntimeError):
    """The agent raised or returned something that is not a reward."""


def _coerce_outcome(value: object, *, where: str) -> tuple[float, float | None, dict[str, float]]:
    if isinstance(value, dict):
        if "reward" not in value:
            raise AgentError(
                f"{where}: the returned dict has no 'reward' key (keys: {sorted(value)})"
            )
        raw_reward, raw_score = value["reward"], value.get("score")
        raw_metrics = value.get("metrics") or {}
    else:
        raw_reward, raw_score, raw_metrics = value, None, {}
    reward = finite_float(raw_reward)
    if reward is None:
        raise AgentError(f"{where}: reward must be a finite number, got {raw_reward!r}")
    score = None if raw_score is None else finite_float(raw_score)
    if raw_score is not None and score is None:
        raise AgentError(f"{where}: score must be a finite number or None, got {raw_score!r}")
    if not isinstance(raw_metrics, dict):
        raise AgentError(f"{where}: metrics must be a dict of numbers, got {raw_metrics!r}")
    metrics = {}
    for key, number in raw_metrics.items():
        metric = finite_float(number)
        if metric is None:
            raise AgentError(f"{where}: metrics[{key!r}] must be a finite number, got {number!r}")
        metrics[str(key)] = metric
    return reward, score, metrics


class OpenAIAgentOptions(TypedDict, total=False):
    """`OpenAIAgentExecutor`'s arguments besides the agent (what `OpenAIAgentExecutor.from_file`
    passes on)."""

    tokenizer: Required[Tokenizer]
    generator: Required[Generator]
    sampling: Required[SamplingParams]
    max_len: Required[int]
    max_concurrency: int


class _QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers: the trainer that embeds it keeps SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class OpenAIAgentExecutor:
    """Run OpenAI-client agents against the policy, one session per sample.

    Args:
        agent: The agent callable (see the module docstring).
        tokenizer: Tokenizer with a chat template.
        generator: The policy.
        sampling: Default sampling parameters for the agent's requests.
        max_len: Token budget of one episode; past it the server answers with an empty
            ``finish_reason="length"`` completion and the trajectory is marked truncated.
        max_concurrency: Agents running at once (sync agents get that many threads of their own).
        source: Name used in error messages.
    """

    def __init__(
        self,
        *,
        agent: Callable[..., object],
        tokenizer: Tokenizer,
        generator: Generator,
        sampling: SamplingParams,
        max_len: int,
        max_concurrency: int = 16,
        source: str = "agent",
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.agent = agent
        self.source = source
        self.server = OpenAICompatibleServer(
            generator=generator, tokenizer=tokenizer, sampling=sampling, max_len=max_len
        )
        self.max_concurrency = max_concurrency

    @classmethod
    def from_file(
        cls, path: str, *, symbol: str = "agent", **kwargs: Unpack[OpenAIAgentOptions]
    ) -> OpenAIAgentExecutor:
        """Load the agent ``symbol`` from the Python file at ``path``."""
        agent = load_symbol(path, symbol, purpose="agent")
        if not callable(agent):
            raise TypeError(f"agent {symbol} in {path} must be callable")
        return cls(agent=agent, source=f"agent {symbol} in {path}", **kwargs)

    async def _call_agent(
        self, url: str, prompt: str, label: object, pool: concurrent.futures.Executor
    ) -> object:
        if inspect.iscoroutinefunction(self.agent):
            return await self.agent(url, prompt, label)
        # Sync agents get threads of their own: in the default pool they could take every
        # thread the generator needs and deadlock the batch.
        outcome = await asyncio.get_running_loop().run_in_executor(
            pool, self.agent, url, prompt, label
        )
        return await outcome if inspect.isawaitable(outcome) else outcome

    async def _episode(
        self,
        *,
        base: str,
        prompt: str,
        label: object,
        prompt_index: int,
        sample_index: int,
        seed: int | None,
        gate: asyncio.Semaphore,
        pool: concurrent.futures.Executor,
    ) -> Trajectory:
        where = f"{self.source} (prompt {prompt_index}, sample {sample_index})"
        async with gate:
            sid = self.server.new_session(seed=seed)
            try:
                outcome = await self._call_agent(f"{base}/sessions/{sid}/v1", prompt, label, pool)
            except Exception as exc:
                raise AgentError(f"{where} raised: {exc!r}") from exc
            finally:
                session = self.server.close_session(sid)
        reward, score, metrics = _coerce_outcome(outcome, where=where)
        if not session.finish_reasons:
            raise AgentError(f"{where} returned without asking the policy for a single completion")
        metrics["agent/completions"] = float(len(session.finish_reasons))
        return Trajectory(
            token_ids=tuple(session.token_ids),
            action_mask=tuple(session.action_mask),
            rollout_logprobs=tuple(session.logprobs),
            prompt_length=session.prompt_length,
            reward=reward,
            turn_rewards=(reward,),
            score=reward if score is None else score,
            truncated=session.truncated or session.finish_reasons[-1] == "length",
            finish_reason=session.finish_reasons[-1],
            metrics=metrics,
            prompt_index=prompt_index,
            sample_index=sample_index,
            weight_version=session.weight_version,
        )

    async def _start(self) -> tuple[_QuietServer, asyncio.Task[None], int]:
        config = uvicorn.Config(
            self.server.app,
            host="127.0.0.1",
            port=0,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        server = _QuietServer(config)
        serving = asyncio.create_task(server.serve())
        while not server.started:
            if serving.done():
                try:
                    serving.result()
                except BaseException as exc:  # uvicorn reports start-up failures as SystemExit
                    raise RuntimeError(
                        f"the OpenAI-compatible server failed to start: {exc!r}"
                    ) from None
                raise RuntimeError("the OpenAI-compatible server stopped during start-up")
            await asyncio.sleep(0.01)
        return server, serving, server.servers[0].sockets[0].getsockname()[1]

    async def run(
        self,
        *,
        prompts: Sequence[str],
        labels: Sequence[object],
        n_samples_per_prompt: int = 1,
        prompt_indices: Sequence[int] | None = None,
        seed: int | None = None,
    ) -> ExecutorResult:
        """Serve the policy on 127.0.0.1 for the duration of the batch and run every agent.

        ``seed``: when set, completion ``k`` of sample ``s`` of the prompt at index ``i`` is
        drawn with seed ``request_seed(request_seed(seed, i, s), k)`` unless the agent's request
        names a seed.
        """
        indices = batch_indices(
            prompts,
            labels,
            n_samples_per_prompt=n_samples_per_prompt,
            prompt_indices=prompt_indices,
        )
        server, serving, port = await self._start()
        gate = asyncio.Semaphore(self.max_concurrency)
        pool = concurrent.futures.ThreadPoolExecutor(
            self.max_concurrency, thread_name_prefix="rlhf-agent"
        )
        try:
            trajectories = await gather_or_cancel(
                self._episode(
                    base=f"http://127.0.0.1:{port}",
                    prompt=prompts[p],
                    label=labels[p],
                    prompt_index=indices[p],
                    sample_index=s,
                    seed=None if seed is None else request_seed(seed, indices[p], s),
                    gate=gate,
                    pool=pool,
                )
                for p in range(len(prompts))
                for s in range(n_samples_per_prompt)
            )
        finally:
            server.should_exit = True
            await serving
            pool.shutdown(wait=False, cancel_futures=True)
        n = max(len(trajectories), 1)
        metrics = {
            "rollout/samples": float(len(trajectories)),
            "agent/completions_mean": sum(t.metrics["agent/completions"] for t in trajectories) / n,
            "rollout/truncated_frac": sum(t.truncated for t in trajectories) / n,
        }
        return ExecutorResult(trajectories=list(trajectories), metrics=metrics)
