"""Agent files (`rlhf.agents.AgentFile`): each of the three shapes recognised from the
repository's own examples and run as the executor of its shape; every malformed file refused
with a message naming it; reward specs (`FunctionReward.from_spec`)."""

from __future__ import annotations

import asyncio
import json
import textwrap

import pytest

from rlhf.agents import (
    AgentFile,
    AgentFileError,
    FailurePolicy,
    FunctionReward,
    MultiTurnExecutor,
    OpenAIAgentExecutor,
    SamplingParams,
    has_chat_template,
)
from rlhf.agents.openrlhf import OpenRLHFAgentRunner


@pytest.mark.parametrize(
    ("name", "shape", "executor"),
    [
        ("env_guess_number.py", "environment", MultiTurnExecutor),
        ("agent_openai_guess.py", "openai_agent", OpenAIAgentExecutor),
        ("openrlhf_agent_guess.py", "openrlhf", OpenRLHFAgentRunner),
    ],
)
def test_each_shape_is_recognised_and_gets_its_executor(
    examples, tokenizer, generator, name, shape, executor
) -> None:
    agent = AgentFile.load(str(examples / name), chat_template=True)
    assert agent.shape == shape
    assert (agent.environments is not None) == (shape == "environment")
    built = agent.executor(
        tokenizer=tokenizer,
        generator=generator,
        sampling=SamplingParams(max_new_tokens=4),
        max_len=64,
        max_turns=2,
        step_timeout_s=None,
        policy=FailurePolicy(),
    )
    assert type(built) is executor


FILES = {
    "nothing.py": ("x = 1\n", r"nothing\.py' defines none of the accepted shapes"),
    "foreign_executor.py": (
        "class AgentExecutor:\n    pass\n",
        r"its AgentExecutor does not subclass AgentExecutorBase",
    ),
    "needs_arg.py": (
        "class Environment:\n    def __init__(self, difficulty):\n        pass\n"
        "    def reset(self, prompt, label):\n        return prompt\n"
        "    def step(self, action):\n        return None\n",
        r"needs_arg\.py: .*cannot be called",
    ),
    "chat_agent.py": (
        "def agent(base_url, prompt, label):\n    return 0.0\n",
        r"chat_agent\.py is an OpenAI-client agent.*chat template",
    ),
}


@pytest.mark.parametrize("name", sorted(FILES))
def test_a_file_without_a_runnable_shape_is_refused_naming_it(tmp_path, name) -> None:
    source, message = FILES[name]
    (tmp_path / name).write_text(textwrap.dedent(source))
    with pytest.raises(AgentFileError, match=message) as err:
        AgentFile.load(str(tmp_path / name), chat_template=False, purpose="--my.flag")
    assert str(err.value).startswith("--my.flag ")


def test_a_missing_agent_file_is_an_os_error_naming_the_purpose(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"--my\.flag file .*absent\.py' does not exist"):
        AgentFile.load(str(tmp_path / "absent.py"), chat_template=True, purpose="--my.flag")


def test_a_chat_template_is_read_from_the_tokenizer_files(tmp_path) -> None:
    assert not has_chat_template(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": ""}))
    assert not has_chat_template(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    assert has_chat_template(str(tmp_path))
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "chat_template.jinja").write_text("{{ x }}")
    assert has_chat_template(str(tmp_path))


def test_a_reward_spec_names_a_builtin_or_a_file(examples) -> None:
    builtin = FunctionReward.from_spec("builtin:exact_match")
    # exact_match: the query minus its prompt, stripped, equals the label.
    batch = asyncio.run(
        builtin.score(queries=["Q: 7", "Q: 7 "], prompts=["Q:", "Q:"], labels=["7", "8"])
    )
    assert batch.rewards == [1.0, 0.0]
    assert builtin.source == "builtin:exact_match"
    from_file = FunctionReward.from_spec(str(examples / "reward_math.py"))
    assert from_file.source == f"reward function reward_func in {examples / 'reward_math.py'}"
    with pytest.raises(ValueError, match=r"builtin:nope: no such builtin; use builtin:exact_match"):
        FunctionReward.from_spec("builtin:nope")
    with pytest.raises(FileNotFoundError, match=r"absent\.py"):
        FunctionReward.from_spec(str(examples / "absent.py"))
