"""``--train.agent_func_path``: a multi-turn environment from a user's file drives training."""

from __future__ import annotations

import json

import pytest

from .conftest import rlhf
from .test_commands import _train_args

RETRY_ENV = '''
class Environment:
    """Sort the digits; a wrong first answer gets ':' back and one more try (half reward)."""

    def reset(self, prompt, label):
        self.label = label
        self.turns = 0

    def step(self, action_text):
        self.turns += 1
        answer = action_text.replace("<eos>", "").strip()
        if answer == self.label:
            return {"reward": 1.0 / self.turns, "done": True, "metrics": {"solved": 1.0}}
        if self.turns == 2:
            return {"reward": 0.0, "done": True, "metrics": {"solved": 0.0}}
        return {"feedback": ":", "reward": 0.0, "done": False}
'''


ECHO_AGENT = '''
import httpx


async def agent(base_url, prompt, label, **kwargs):
    """One chat request to the policy; reward 1 for the sorted digits."""
    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{base_url}/chat/completions",
            json={"model": "policy", "messages": [{"role": "user", "content": prompt}]},
            timeout=60,
        )
    response.raise_for_status()
    text = response.json()["choices"][0]["message"]["content"] or ""
    return {"reward": float(text.replace("<eos>", "").strip() == label)}
'''

# A template for the character-level demo tokenizer: user text as is, assistant text + <eos>.
TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}<eos>{% endif %}{% endfor %}"
)


def _rows(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.parametrize(
    ("preset", "credit"),
    [
        ("grpo", []),
        # Each turn's reward on its own last token, discounted returns (γ 0.9) credit turn 1.
        ("reinforce", ["--train.turn_credit", "per_turn", "--algo.advantage.gamma", "0.9"]),
    ],
    ids=["episode", "per_turn"],
)
def test_a_multi_turn_environment_trains(assets, tmp_path, preset, credit) -> None:
    env = tmp_path / "retry_env.py"
    env.write_text(RETRY_ENV)
    args = _train_args(assets, tmp_path / "run")
    args[args.index("--rollout.max_len") + 1] = "24"  # prompt 5 + 2 turns of 6 + feedback
    out = rlhf(
        "train", preset, *args, *credit,
        "--train.agent_func_path", str(env), "--train.agent_max_turns", "3",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    steps = [r for r in _rows(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # The environment ends every episode by its second turn; the random policy is wrong
        # at the first turn most of the time, so most episodes take two.
        assert 1.0 < r["env/turns_mean"] <= 2.0
        assert r["reward/mean"] in (0.0, *[k / 32 for k in range(1, 33)])  # 1, 1/2 or 0 each
        # Only the policy's own tokens are actions (the ':' feedback is masked out): at most
        # max_new_tokens = 6 per turn.
        assert 1.0 <= r["rollout/response_length_mean"] <= 6.0 * r["env/turns_mean"]


def test_an_agent_file_without_environment_or_agent_is_named(assets, tmp_path) -> None:
    bad = tmp_path / "nothing.py"
    bad.write_text("X = 1\n")
    out = rlhf("train", "grpo", *_train_args(assets, tmp_path / "run"),
               "--train.agent_func_path", str(bad))  # fmt: skip
    assert out.returncode == 2
    assert "--train.agent_func_path" in out.stderr and "Environment" in out.stderr


HUNG_ENV = """
import threading
class Environment:
    def reset(self, prompt, label):
        pass
    def step(self, action_text):
        threading.Event().wait()  # never returns
"""


def test_an_environment_step_that_never_returns_stops_the_run_at_its_deadline(assets, tmp_path):
    env = tmp_path / "hung_env.py"
    env.write_text(HUNG_ENV)
    out = rlhf("train", "grpo", *_train_args(assets, tmp_path / "run"),
               "--train.agent_func_path", str(env), "--train.agent_step_timeout_s", "1")  # fmt: skip
    assert out.returncode == 2, (out.stdout[-2000:], out.stderr[-3000:])
    assert f"rlhf: environment Environment in {env} (prompt " in out.stderr
    assert "step() on turn 0 did not return within 1.0 s (step_timeout_s)" in out.stderr
    assert "Traceback" not in out.stderr


def test_episodes_that_time_out_end_with_the_fallback_reward(assets, tmp_path) -> None:
    """``--train.agent_failure_policy fallback``: every step() hangs, so every episode ends at
    its deadline after the policy's first action, rewarded 0.25; the run trains on them."""
    env = tmp_path / "hung_env.py"
    env.write_text(HUNG_ENV)
    out = rlhf("train", "rloo", *_train_args(assets, tmp_path / "run"),
               "--train.agent_func_path", str(env), "--train.agent_step_timeout_s", "1",
               "--train.agent_failure_policy", "fallback", "--train.agent_fallback_value", "0.25")  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [r for r in _rows(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert (r["env/failed"], r["env/fallback"], r["env/skipped"]) == (16.0, 16.0, 0.0)
        assert r["reward/mean"] == 0.25 and r["rollout/truncated_frac"] == 1.0


def test_an_openai_client_agent_trains(assets, tmp_path) -> None:
    import shutil

    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(assets["model"], model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(model)
    agent = tmp_path / "echo_agent.py"
    agent.write_text(ECHO_AGENT)
    args = _train_args(assets, tmp_path / "run")
    args[args.index("--actor.model.path") + 1] = str(model)
    out = rlhf("train", "grpo", *args, "--train.agent_func_path", str(agent))
    assert out.returncode == 0, out.stderr[-4000:]
    steps = [r for r in _rows(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["reward/mean"] in [k / 16 for k in range(17)]  # 0/1 per episode
        assert r["rollout/response_length_mean"] >= 1  # the agent's completion was trained on


USER_FILES = {
    "raises.py": 'raise RuntimeError("boom at import")\ndef reward_func(q, p, l):\n    return [0.0]\n',
    "needs_arg.py": (
        "class Environment:\n"
        "    def __init__(self, difficulty):\n"
        "        self.difficulty = difficulty\n"
        "    def reset(self, prompt, label):\n"
        "        return prompt\n"
        "    def step(self, action):\n"
        "        return {'observation': '', 'reward': 0.0, 'done': True}\n"
    ),
    "chat_agent.py": "def agent(base_url, prompt, label):\n    return 0.0\n",
}


@pytest.mark.parametrize(
    ("flag", "name", "message"),
    [
        ("--train.reward_func", "raises.py", r"the reward file .*raises\.py: .*boom at import"),
        ("--train.agent_func_path", "needs_arg.py", r"needs_arg\.py: .*__init__\(difficulty\) "
         r"cannot be called .* once per sample with no arguments .* give its parameters defaults"),
        ("--train.agent_func_path", "chat_agent.py", r"chat_agent\.py is an OpenAI-client agent"
         r".* the tokenizer of --actor\.model\.path has none"),
    ],
)  # fmt: skip
def test_user_files_are_checked_before_anything_starts(assets, tmp_path, flag, name, message):
    from rlhf.cli.config import ConfigError
    from rlhf.cli.main import parse_rl
    from rlhf.cli.sampling import check_user_files

    (tmp_path / name).write_text(USER_FILES[name])
    args = _train_args(assets, tmp_path / "run")
    if flag in args:
        del args[args.index(flag) : args.index(flag) + 2]
    config = parse_rl("grpo", [*args, flag, str(tmp_path / name)])
    config = config.validate().with_absolute_paths()
    with pytest.raises(ConfigError, match=message):
        check_user_files(
            reward=config.resolved_reward(),
            agent_path=config.train.agent_func_path,
            policy_path=config.actor.model.path,
        )


def test_a_reward_file_that_fails_to_import_exits_2_before_ray_starts(assets, tmp_path):
    (tmp_path / "raises.py").write_text(USER_FILES["raises.py"])
    args = _train_args(assets, tmp_path / "run")
    args[args.index("--train.reward_func") + 1] = str(tmp_path / "raises.py")
    out = rlhf("train", "grpo", *args)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "boom at import" in out.stderr and "Traceback" not in out.stderr
    assert "Ray" not in out.stdout + out.stderr  # nothing started
