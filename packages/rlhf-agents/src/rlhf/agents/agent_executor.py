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
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import uvicorn

from rlhf.agents.loading import load_symbol
from rlhf.agents.openai_server import OpenAICompatibleServer
from rlhf.agents.single_turn import ExecutorResult
from rlhf.agents.tokens import Tokenizer
from rlhf.agents.types import Generator, SamplingParams, Trajectory


class AgentError(RuntimeError):
    """The agent raised or returned something that is not a reward."""


def _coerce_outcome(value: Any, *, where: str) -> tuple[float, float | None, dict[str, float]]:
    if isinstance(value, dict):
        if "reward" not in value:
            raise AgentError(
                f"{where}: the returned dict has no 'reward' key (keys: {sorted(value)})"
            )
        reward, score, metrics = (
            value["reward"],
            value.get("score"),
            dict(value.get("metrics") or {}),
        )
    else:
        reward, score, metrics = value, None, {}
    for name, number in (("reward", reward), ("score", score)):
        if number is None and name == "score":
            continue
        if (
            isinstance(number, bool)
            or not isinstance(number, int | float)
            or not math.isfinite(number)
        ):
            raise AgentError(f"{where}: {name} must be a finite number, got {number!r}")
    return (
        float(reward),
        (None if score is None else float(score)),
        {k: float(v) for k, v in metrics.items()},
    )


class OpenAIAgentExecutor:
    """Run OpenAI-client agents against the policy, one session per sample.

    Args:
        agent: The agent callable (see the module docstring).
        tokenizer: Tokenizer with a chat template.
        generator: The policy.
        sampling: Default sampling parameters for the agent's requests.
        max_len: Token budget of one episode.
        max_concurrency: Agents running at once.
        source: Name used in error messages.
    """

    def __init__(
        self,
        *,
        agent: Callable[..., Any],
        tokenizer: Tokenizer,
        generator: Generator,
        sampling: SamplingParams,
        max_len: int,
        max_concurrency: int = 16,
        source: str = "agent",
    ) -> None:
        self.agent = agent
        self.source = source
        self.server = OpenAICompatibleServer(
            generator=generator, tokenizer=tokenizer, sampling=sampling, max_len=max_len
        )
        self.max_concurrency = max_concurrency

    @classmethod
    def from_file(cls, path: str, *, symbol: str = "agent", **kwargs: Any) -> OpenAIAgentExecutor:
        """Load the agent ``symbol`` from the Python file at ``path``."""
        agent = load_symbol(path, symbol, purpose="agent")
        if not callable(agent):
            raise TypeError(f"agent {symbol} in {path} must be callable")
        return cls(agent=agent, source=f"agent {symbol} in {path}", **kwargs)

    async def _episode(
        self,
        base: str,
        prompt: str,
        label: Any,
        prompt_index: int,
        sample_index: int,
        gate: asyncio.Semaphore,
    ) -> Trajectory:
        where = f"{self.source} (prompt {prompt_index}, sample {sample_index})"
        async with gate:
            sid = self.server.new_session()
            url = f"{base}/sessions/{sid}/v1"
            try:
                if inspect.iscoroutinefunction(self.agent):
                    outcome = await self.agent(url, prompt, label)
                else:
                    outcome = await asyncio.to_thread(self.agent, url, prompt, label)
                    if inspect.isawaitable(outcome):
                        outcome = await outcome
            except Exception as exc:
                self.server.close_session(sid)
                raise AgentError(f"{where} raised: {exc!r}") from exc
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
            truncated=session.finish_reasons[-1] == "length",
            finish_reason=session.finish_reasons[-1],
            metrics=metrics,
            prompt_index=prompt_index,
            sample_index=sample_index,
            weight_version=session.weight_version,
        )

    async def run(
        self,
        *,
        prompts: Sequence[str],
        labels: Sequence[Any],
        n_samples_per_prompt: int = 1,
        prompt_indices: Sequence[int] | None = None,
    ) -> ExecutorResult:
        """Serve the policy on 127.0.0.1 for the duration of the batch and run every agent."""
        if len(prompts) != len(labels):
            raise ValueError(f"got {len(prompts)} prompts but {len(labels)} labels")
        indices = list(prompt_indices) if prompt_indices is not None else list(range(len(prompts)))
        config = uvicorn.Config(
            self.server.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"
        )
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve())
        try:
            while not server.started:
                if serving.done():
                    serving.result()
                    raise RuntimeError("the OpenAI-compatible server stopped during start-up")
                await asyncio.sleep(0.01)
            port = server.servers[0].sockets[0].getsockname()[1]
            gate = asyncio.Semaphore(self.max_concurrency)
            trajectories = await asyncio.gather(
                *(
                    self._episode(
                        f"http://127.0.0.1:{port}", prompts[p], labels[p], indices[p], s, gate
                    )
                    for p in range(len(prompts))
                    for s in range(n_samples_per_prompt)
                )
            )
        finally:
            server.should_exit = True
            await serving
        n = max(len(trajectories), 1)
        metrics = {
            "rollout/samples": float(len(trajectories)),
            "agent/completions_mean": sum(t.metrics["agent/completions"] for t in trajectories) / n,
            "rollout/truncated_frac": sum(t.truncated for t in trajectories) / n,
        }
        return ExecutorResult(trajectories=list(trajectories), metrics=metrics)
