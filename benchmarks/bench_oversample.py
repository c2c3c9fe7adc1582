"""Oversampling (`rlhf.rollout.sample_step(oversample=)`) against drawing exactly the batch,
in one invocation, alternating rounds.

A step's generation waits for its slowest prompt group; oversampling draws ``factor`` times
the prompts, keeps the first groups to finish and cancels the rest in vLLM. The workload
makes lengths long-tailed on purpose: a random Qwen2 of ``--vocab`` tokens whose final norm is
zeroed, so every next-token distribution is uniform and each sample ends at the end-of-text
token with probability 1/vocab per token: lengths geometric (default vocabulary 32: mean 32,
1.7 % of samples and 6.6 % of groups of 4 capped at ``--max-new`` 128).

Per factor: median seconds per step (one `sample_step` of ``--batch`` groups × ``--n``), tokens
generated per step (kept and not), and the mean length of the kept samples (oversampling
prefers short ones: the bias it trades for time). Ratio = step seconds / factor 1's.

Usage: python benchmarks/bench_oversample.py [--factors 1.25,1.5] [--rounds 5] [--json out]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.agents import ExecutorResult, SamplingParams, Trajectory, sample_group
from rlhf.rollout import EngineConfig, EnginePool, VLLMEngine
from rlhf.rollout.sampling import sample_step


def make_checkpoint(root: pathlib.Path, vocab: int) -> pathlib.Path:
    """The uniform-next-token model: a tiny random Qwen2 (``vocab`` tokens, end-of-text 0) with
    its final RMSNorm's weight zeroed (every logit 0), and the project's small tokenizer."""
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench_rollout import make_checkpoint as tokenizer_and_model

    path = tokenizer_and_model(root, "tiny", torch.float32)
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096,
        tie_word_embeddings=False, eos_token_id=0, bos_token_id=0,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    model.save_pretrained(path)
    return path


@dataclass(frozen=True)
class Prompt:
    text: str
    label: object = None
    source_name: str = ""


class Prompts:
    """Prompt ``k`` is the text ``str(k)``; its token ids come from `GroupExecutor.ids`."""

    def __init__(self) -> None:
        self.drawn = 0

    def next(self, n: int) -> list[Prompt]:
        out = [Prompt(str(self.drawn + i)) for i in range(n)]
        self.drawn += n
        return out

    def state_dict(self) -> dict[str, object]:
        return {"drawn": self.drawn}


class GroupExecutor:
    """An `rlhf.agents.Executor` over the pool: each prompt's ``n`` samples as one group
    request (`rlhf.agents.sample_group`), scored 0 (the benchmark times generation only)."""

    def __init__(self, pool: EnginePool, sampling: SamplingParams, vocab: int) -> None:
        self.pool, self.sampling, self.vocab, self.tokens = pool, sampling, vocab, 0

    def ids(self, text: str) -> list[int]:
        rng = random.Random(int(text))
        return [rng.randrange(1, self.vocab) for _ in range(16)]

    async def run(
        self, *, prompts: Sequence[str], labels: Sequence[Any], n_samples_per_prompt: int = 1,
        prompt_indices: Sequence[int] | None = None, seed: int | None = None,
    ) -> ExecutorResult:  # fmt: skip
        indices = list(prompt_indices) if prompt_indices is not None else range(len(prompts))
        groups = await asyncio.gather(
            *(sample_group(self.pool, self.ids(p), self.sampling, n=n_samples_per_prompt)
              for p in prompts)
        )  # fmt: skip
        out = []
        for index, prompt, group in zip(indices, prompts, groups, strict=True):
            ids = self.ids(prompt)
            for s, g in enumerate(group):
                self.tokens += len(g.token_ids)
                out.append(
                    Trajectory(
                        token_ids=(*ids, *g.token_ids),
                        action_mask=(0,) * len(ids) + (1,) * len(g.token_ids),
                        rollout_logprobs=(0.0,) * len(ids) + g.logprobs, prompt_length=len(ids),
                        reward=0.0, turn_rewards=(0.0,), score=0.0,
                        truncated=g.finish_reason == "length", finish_reason=g.finish_reason,
                        prompt_index=index, sample_index=s,
                    )
                )  # fmt: skip
        return ExecutorResult(out, {"rollout/samples": float(len(out))})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--factors", default="1.25,1.5")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32, help="1/vocab: end-of-text per token")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=pathlib.Path, default=None)
    args = parser.parse_args()
    factors = [1.0, *(float(f) for f in args.factors.split(","))]
    gpu = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as tmp:
        engine = VLLMEngine(
            EngineConfig(
                model=str(make_checkpoint(pathlib.Path(tmp), args.vocab)),
                dtype="bfloat16" if gpu else "float32", max_model_len=args.max_new + 64,
                max_num_seqs=256 if gpu else 64, gpu_memory_utilization=0.5, enforce_eager=not gpu,
            )
        ).start()  # fmt: skip
        try:
            pool = EnginePool([engine], max_in_flight_per_engine=512)
            executor = GroupExecutor(pool, SamplingParams(max_new_tokens=args.max_new), args.vocab)
            prompts = Prompts()
            runs: dict[float, dict[str, list[float]]] = {
                f: {"s": [], "tokens": [], "kept_len": [], "cancelled": []} for f in factors
            }

            async def step(factor: float) -> None:
                executor.tokens = 0
                tick = time.perf_counter()
                rollout = await sample_step(
                    0, batch_size=args.batch, n_samples_per_prompt=args.n, prompts=prompts,
                    executor=executor, oversample=factor,
                )  # fmt: skip
                seconds = time.perf_counter() - tick
                await asyncio.sleep(0.2)  # let the cancelled requests' aborts land
                kept = [len(t.token_ids) - t.prompt_length for t in rollout.trajectories]
                assert len(kept) == args.batch * args.n
                run = runs[factor]
                run["s"].append(seconds)
                run["tokens"].append(float(executor.tokens))
                run["kept_len"].append(statistics.mean(kept))
                run["cancelled"].append(rollout.metrics.get("rollout/oversample_cancelled", 0.0))

            async def rounds() -> None:
                await step(1.0)  # warm-up
                for r in range(args.rounds):
                    for factor in factors[r % len(factors) :] + factors[: r % len(factors)]:
                        await step(factor)

            asyncio.run(rounds())
        finally:
            engine.shutdown()
    base = statistics.median(runs[1.0]["s"])
    results: dict[str, Any] = {"device": "cuda" if gpu else "cpu", "batch": args.batch,
                               "n": args.n, "max_new": args.max_new, "vocab": args.vocab,
                               "rounds": args.rounds}  # fmt: skip
    for factor, run in runs.items():
        median = statistics.median(run["s"])
        results[f"factor_{factor:g}"] = {
            "step_s": round(median, 3),
            "ratio_over_factor_1": round(median / base, 3),
            "generated_tokens_per_step": statistics.median(run["tokens"]),
            "kept_response_len_mean": round(statistics.mean(run["kept_len"]), 1),
            "cancelled_prompts_per_step": statistics.median(run["cancelled"]),
        }
    print(json.dumps(results, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
