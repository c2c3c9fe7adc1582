"""Per-request seeds: the derivation, and every executor seeding each request by its position."""

import asyncio
import itertools
import textwrap

import pytest

from rlhf.agents import (
    EnvironmentFactory,
    FunctionReward,
    MultiTurnExecutor,
    OpenAIAgentExecutor,
    SamplingParams,
    SingleTurnExecutor,
    group_seed,
    nth_sample,
    request_seed,
    sample_group,
    seeded,
)


def test_request_seed_is_splitmix64_and_separates_positions() -> None:
    # SplitMix64's first output for state 0 (Vigna's reference generator) is 0xE220A8397B1DCDAF;
    # request_seed(0, 0) is exactly that step (finaliser of 0 + the golden gamma), shifted into
    # [0, 2**63).
    assert request_seed(0, 0) == 0xE220A8397B1DCDAF >> 1
    grid = [request_seed(42, *p) for p in itertools.product(range(8), range(8), range(4))]
    assert len(set(grid)) == len(grid)
    assert all(0 <= s < 2**63 for s in grid)
    assert request_seed(42, 1, 2) != request_seed(42, 2, 1)
    assert request_seed(42, 1) != request_seed(43, 1)
    assert request_seed(42, -1) == request_seed(42, -1) != request_seed(42, 1)
    plain = SamplingParams(max_new_tokens=3)
    assert seeded(plain, None, 1, 2) is plain
    assert seeded(plain, 5, 1, 2) == plain.replace(seed=request_seed(5, 1, 2))


def test_group_seeds_leave_room_for_their_samples() -> None:
    # A group's seed is request_seed halved: SplitMix64's first output shifted twice.
    assert group_seed(0, 0) == 0xE220A8397B1DCDAF >> 2
    grid = [group_seed(42, p) for p in range(256)]
    assert len(set(grid)) == len(grid) and all(0 <= s < 2**62 for s in grid)
    # Sample i of a group draws with the group's seed + i (vLLM's seeds for a request's n).
    plain = SamplingParams(max_new_tokens=3)
    assert nth_sample(plain, 3) is plain
    group = plain.replace(seed=2**62 - 1)
    assert [nth_sample(group, i).seed for i in range(3)] == [2**62 - 1, 2**62, 2**62 + 1]
    assert all(nth_sample(group, i).seed < 2**63 for i in range(1000))


class Recorder:
    """Wraps a real generator and records the seed of every request."""

    def __init__(self, inner) -> None:
        self.inner, self.seeds = inner, []

    async def generate(self, prompt_token_ids, sampling):
        self.seeds.append(sampling.seed)
        return await self.inner.generate(prompt_token_ids, sampling)


class GroupRecorder(Recorder):
    """A `GroupRecorder` takes a prompt's samples as one request (as a vLLM engine does with
    ``n``), recording (seed, n) per group request; sample i is the wrapped generator's with
    seed + i."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.groups = []

    async def generate_group(self, prompt_token_ids, sampling, n):
        self.groups.append((sampling.seed, n))
        return [
            await self.inner.generate(prompt_token_ids, nth_sample(sampling, i)) for i in range(n)
        ]


def chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def single_turn(tokenizer, generator) -> SingleTurnExecutor:
    """Six new tokens at temperature 1, every sample rewarded 0."""
    return SingleTurnExecutor(
        tokenizer=tokenizer,
        generator=generator,
        reward=FunctionReward(lambda queries, prompts, labels, responses: [0.0] * len(responses)),
        sampling=SamplingParams(max_new_tokens=6, temperature=1.0),
        max_len=64,
    )


def test_single_turn_samples_depend_on_their_position_not_on_the_batch(
    tokenizer, generator
) -> None:
    rec = Recorder(generator)
    ex = single_turn(tokenizer, rec)
    prompts = [chat(tokenizer, "What is 3 plus 4?"), chat(tokenizer, "Guess a number")]
    both = asyncio.run(ex.run(prompts=prompts, labels=[0, 0], n_samples_per_prompt=3, seed=7))
    assert sorted(rec.seeds) == sorted(group_seed(7, p) + s for p in range(2) for s in range(3))
    rec.seeds.clear()
    alone = asyncio.run(
        ex.run(prompts=prompts[1:], labels=[0], n_samples_per_prompt=3, prompt_indices=[1], seed=7)
    )
    assert [t.token_ids for t in alone.trajectories] == [
        t.token_ids for t in both.trajectories if t.prompt_index == 1
    ]
    # The three samples of one prompt are not one sample three times.
    assert len({t.token_ids for t in alone.trajectories}) > 1
    rec.seeds.clear()
    asyncio.run(ex.run(prompts=prompts, labels=[0, 0], n_samples_per_prompt=1))
    assert rec.seeds == [None, None]


def test_single_turn_sends_each_prompt_as_one_group_with_the_same_samples(
    tokenizer, generator
) -> None:
    prompts = [chat(tokenizer, "What is 3 plus 4?"), chat(tokenizer, "Guess a number")]
    runs = {}
    for name, rec in (("requests", Recorder(generator)), ("groups", GroupRecorder(generator))):
        result = asyncio.run(
            single_turn(tokenizer, rec).run(
                prompts=prompts,
                labels=[0, 0],
                n_samples_per_prompt=4,
                prompt_indices=[3, 8],
                seed=5,
            )
        )
        runs[name] = [(t.prompt_index, t.sample_index, t.token_ids) for t in result.trajectories]
    # One group request per prompt, seeded by the prompt's position; no single requests.
    assert sorted(rec.groups) == sorted([(group_seed(5, 3), 4), (group_seed(5, 8), 4)])
    assert rec.seeds == []
    assert runs["groups"] == runs["requests"]
    assert len({tokens for _, _, tokens in runs["groups"]}) > 2


def test_sample_group_checks_n_and_what_a_group_generator_returns(generator) -> None:
    class Short(GroupRecorder):
        async def generate_group(self, prompt_token_ids, sampling, n):
            return (await super().generate_group(prompt_token_ids, sampling, n))[:-1]

    sampling = SamplingParams(max_new_tokens=2, seed=1)
    with pytest.raises(ValueError, match="n must be >= 1"):
        asyncio.run(sample_group(Recorder(generator), [3, 4], sampling, n=0))
    with pytest.raises(RuntimeError, match="returned 2 samples for n=3"):
        asyncio.run(sample_group(Short(generator), [3, 4], sampling, n=3))


def test_multi_turn_seeds_each_turn_and_keeps_an_environment_seed(tmp_path, tokenizer, generator):
    path = tmp_path / "env.py"
    path.write_text(
        textwrap.dedent(
            """
            class Environment:
                def reset(self, prompt, label):
                    self.turn = 0
                def step(self, action_text):
                    self.turn += 1
                    override = {"seed": 99} if self.turn == 2 else {}
                    return {"feedback": "more", "done": self.turn == 3, "sampling": override}
            """
        )
    )
    rec = Recorder(generator)
    ex = MultiTurnExecutor(
        tokenizer=tokenizer,
        generator=rec,
        environments=EnvironmentFactory.from_file(str(path)),
        sampling=SamplingParams(max_new_tokens=4, temperature=1.0),
        max_len=256,
        max_turns=3,
    )
    asyncio.run(ex.run(prompts=[chat(tokenizer, "go")], labels=[None], prompt_indices=[5], seed=3))
    # Turns 0 and 1 are the run's; the override after turn 1 names seed 99 for turn 2.
    assert rec.seeds == [request_seed(3, 5, 0, 0), request_seed(3, 5, 0, 1), 99]


AGENT = """
from openai import AsyncOpenAI

async def agent(base_url, prompt, label):
    client = AsyncOpenAI(base_url=base_url, api_key="unused")
    messages = [{"role": "user", "content": prompt}]
    for turn in range(3):
        extra = {"seed": 11} if turn == 2 else {}
        reply = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=3, **extra)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "again"}]
    await client.close()
    return 1.0
"""


def test_agent_sessions_seed_each_completion_unless_the_request_names_one(
    tmp_path, tokenizer, generator
) -> None:
    path = tmp_path / "agent.py"
    path.write_text(AGENT)
    rec = Recorder(generator)
    ex = OpenAIAgentExecutor.from_file(
        str(path),
        tokenizer=tokenizer,
        generator=rec,
        sampling=SamplingParams(max_new_tokens=3),
        max_len=256,
    )
    asyncio.run(ex.run(prompts=["hi"], labels=[None], n_samples_per_prompt=2, seed=4))
    session = {s: request_seed(4, 0, s) for s in range(2)}
    expected = [request_seed(session[s], k) for s in range(2) for k in range(2)] + [11, 11]
    assert sorted(rec.seeds) == sorted(expected)
