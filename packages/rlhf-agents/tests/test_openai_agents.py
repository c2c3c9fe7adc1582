"""OpenAI-compatible executor: real `openai` clients against the local server, in token space."""

import asyncio
import textwrap

import httpx
import pytest

from rlhf.agents import AgentError, OpenAIAgentExecutor, SamplingParams

RECORDING_AGENT = """
from openai import AsyncOpenAI, OpenAI

TRANSCRIPTS = {}

async def agent(base_url, prompt, label):
    client = AsyncOpenAI(base_url=base_url, api_key="unused")
    messages = [{"role": "user", "content": prompt}]
    for turn in range(3):
        reply = await client.chat.completions.create(model="anything", messages=messages, max_tokens=5)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        if turn < 2:
            messages.append({"role": "user", "content": f"hint {turn}"})
    TRANSCRIPTS[base_url] = messages
    await client.close()
    return {"reward": 0.5, "score": 1.0, "metrics": {"my_metric": 3}}

def sync_agent(base_url, prompt, label):
    client = OpenAI(base_url=base_url, api_key="unused")
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": prompt}], max_tokens=4)
    client.close()
    return float(len(reply.choices[0].message.content))

async def editing_agent(base_url, prompt, label):
    async with AsyncOpenAI(base_url=base_url, api_key="unused") as client:
        messages = [{"role": "user", "content": prompt}]
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        messages += [{"role": "assistant", "content": "EDITED " + reply.choices[0].message.content},
                     {"role": "user", "content": "again"}]
        await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    return 1.0

async def bad_reward_agent(base_url, prompt, label):
    async with AsyncOpenAI(base_url=base_url, api_key="unused") as client:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": prompt}], max_tokens=2)
    return float("nan")

async def lazy_agent(base_url, prompt, label):
    return 1.0
"""


@pytest.fixture
def agent_file(tmp_path):
    path = tmp_path / "agents.py"
    path.write_text(textwrap.dedent(RECORDING_AGENT))
    return str(path)


def make(agent_file, symbol, tokenizer, generator, **kw) -> OpenAIAgentExecutor:
    return OpenAIAgentExecutor.from_file(
        agent_file,
        symbol=symbol,
        tokenizer=tokenizer,
        generator=generator,
        sampling=SamplingParams(max_new_tokens=5),
        max_len=kw.pop("max_len", 256),
        **kw,
    )


def run(ex, prompts, labels, n=1):
    return asyncio.run(ex.run(prompts=prompts, labels=labels, n_samples_per_prompt=n))


def test_session_becomes_one_trajectory_with_one_span_per_completion(
    agent_file, tokenizer, generator
) -> None:
    ex = make(agent_file, "agent", tokenizer, generator)
    result = run(ex, ["Guess a number", "What is 2 plus 2?"], [3, 4], n=2)
    transcripts = ex.agent.__globals__["TRANSCRIPTS"]
    assert len(result.trajectories) == 4
    assert len(transcripts) == 4
    for t in result.trajectories:
        assert t.reward == 0.5
        assert t.score == 1.0
        assert t.metrics["my_metric"] == 3
        assert t.metrics["agent/completions"] == 3
        spans = [
            (p, g)
            for p, g in generator.calls
            if list(t.token_ids[: len(p)]) == p
            and tuple(t.token_ids[len(p) : len(p) + len(g.token_ids)]) == g.token_ids
        ]
        spans.sort(key=lambda c: len(c[0]))
        assert len(spans) == 3
        mask = [0] * len(t.token_ids)
        for p, g in spans:
            mask[len(p) : len(p) + len(g.token_ids)] = [1] * len(g.token_ids)
            assert t.rollout_logprobs[len(p) : len(p) + len(g.token_ids)] == g.logprobs
        assert list(t.action_mask) == mask
        # The stream is exactly the chat template of the agent's own transcript.
        matching = [
            m
            for m in transcripts.values()
            if tokenizer.decode(list(t.token_ids), skip_special_tokens=False)
            == tokenizer.apply_chat_template(m[:-1], tokenize=False, add_generation_prompt=True)
            + tokenizer.decode(list(spans[-1][1].token_ids), skip_special_tokens=False)
        ]
        assert matching, "no agent transcript renders to this trajectory's stream"
        assert t.prompt_length == len(
            tokenizer.encode(
                tokenizer.apply_chat_template(
                    matching[0][:1], tokenize=False, add_generation_prompt=True
                ),
                add_special_tokens=False,
            )
        )
    assert result.metrics["agent/completions_mean"] == 3


def test_sync_agent_with_the_sync_client(agent_file, tokenizer, generator) -> None:
    result = run(make(agent_file, "sync_agent", tokenizer, generator), ["hello"], [None], n=2)
    assert len(result.trajectories) == 2
    for t in result.trajectories:
        text = tokenizer.decode(
            [tok for tok, m in zip(t.token_ids, t.action_mask, strict=True) if m],
            skip_special_tokens=True,
        )
        assert t.reward == float(len(text))


def test_editing_history_is_refused_not_retokenized(agent_file, tokenizer, generator) -> None:
    with pytest.raises(
        AgentError,
        match=r"editing_agent in .*agents\.py \(prompt 0, sample 0\) raised: BadRequestError.*does not extend this session's token history",
    ):
        run(make(agent_file, "editing_agent", tokenizer, generator), ["hello"], [None])


def test_bad_outcomes(agent_file, tokenizer, generator) -> None:
    with pytest.raises(AgentError, match=r"reward must be a finite number, got nan"):
        run(make(agent_file, "bad_reward_agent", tokenizer, generator), ["hello"], [None])
    with pytest.raises(
        AgentError, match=r"returned without asking the policy for a single completion"
    ):
        run(make(agent_file, "lazy_agent", tokenizer, generator), ["hello"], [None])
    with pytest.raises(AttributeError, match=r"defines no 'missing_agent'"):
        make(agent_file, "missing_agent", tokenizer, generator)


def test_budget_exhaustion_truncates_the_episode(agent_file, tokenizer, generator) -> None:
    prompt_len = len(
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
    )
    budget = prompt_len + 6
    (t,) = run(
        make(agent_file, "agent", tokenizer, generator, max_len=budget), ["hello"], [None]
    ).trajectories
    assert t.truncated
    assert t.finish_reason == "length"
    assert len(t.token_ids) <= budget
    assert (
        t.metrics["agent/completions"] == 3
    )  # the agent kept asking and got empty "length" answers


def test_a_refused_request_leaves_the_session_unchanged(tokenizer, generator) -> None:
    from rlhf.agents import OpenAICompatibleServer

    server = OpenAICompatibleServer(
        generator=generator,
        tokenizer=tokenizer,
        sampling=SamplingParams(max_new_tokens=3),
        max_len=128,
    )
    messages = {"messages": [{"role": "user", "content": "hello"}]}

    async def go():
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            sid = server.new_session()
            refused = await client.post(
                f"/sessions/{sid}/v1/chat/completions", json={**messages, "temperature": -1}
            )
            ok = await client.post(f"/sessions/{sid}/v1/chat/completions", json=messages)
        return refused, ok, server.sessions[sid]

    refused, ok, session = asyncio.run(go())
    assert refused.status_code == 400
    assert "temperature" in refused.json()["error"]["message"]
    assert ok.status_code == 200
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(
            messages["messages"], tokenize=False, add_generation_prompt=True
        ),
        add_special_tokens=False,
    )
    assert session.token_ids[: len(prompt)] == prompt
    assert session.prompt_length == len(prompt)
    assert session.action_mask == [0] * len(prompt) + [1] * (len(session.token_ids) - len(prompt))


def test_many_sync_agents_do_not_starve_the_generator(agent_file, tokenizer, generator) -> None:
    result = run(make(agent_file, "sync_agent", tokenizer, generator), ["hello"], [None], n=12)
    assert len(result.trajectories) == 12


def test_models_health_and_sessionless_requests(tokenizer, generator) -> None:
    from rlhf.agents import OpenAICompatibleServer

    server = OpenAICompatibleServer(
        generator=generator,
        tokenizer=tokenizer,
        sampling=SamplingParams(max_new_tokens=2),
        max_len=64,
        model_name="tiny",
    )

    async def go():
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            health = (await client.get("/health")).json()
            models = (await client.get("/v1/models")).json()
            sessionless = await client.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
            )
            unknown = await client.post(
                "/sessions/nope/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "x"}]},
            )
            sid = server.new_session()
            several = await client.post(
                f"/sessions/{sid}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "x"}], "n": 2},
            )
            ok = await client.post(
                f"/sessions/{sid}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "x"}]},
            )
        return health, models, sessionless, unknown, several, ok

    health, models, sessionless, unknown, several, ok = asyncio.run(go())
    assert health == {"status": "ok"}
    assert models["data"][0]["id"] == "tiny"
    assert sessionless.status_code == 400
    assert "use a session's base URL" in sessionless.json()["error"]["message"]
    assert unknown.status_code == 400
    assert "unknown session 'nope'" in unknown.json()["error"]["message"]
    assert several.status_code == 400
    assert "only n=1 is supported" in several.json()["error"]["message"]
    body = ok.json()
    assert body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] == len(generator.calls[-1][1].token_ids)


def test_example_openai_agent(examples, tokenizer, generator) -> None:
    ex = OpenAIAgentExecutor.from_file(
        str(examples / "agent_openai_guess.py"),
        tokenizer=tokenizer,
        generator=generator,
        sampling=SamplingParams(max_new_tokens=6),
        max_len=256,
    )
    result = run(ex, ["Guess a number between 0 and 9."], [5], n=2)
    assert len(result.trajectories) == 2
    for t in result.trajectories:
        assert t.reward in (0.0, 1.0)
        assert 1 <= t.metrics["agent/completions"] <= 4
        assert t.metrics["turns"] == t.metrics["agent/completions"]
