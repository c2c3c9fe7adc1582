"""An OpenRLHF 0.11 command line trains through ``rlhf`` as ours does, and OpenRLHF's reward
file (``--reward.remote_url reward.py``) is its reward function; a bad reward file is named
before anything starts."""

from __future__ import annotations

import json
import pathlib

import pytest

from rlhf.cli.config import ConfigError
from rlhf.cli.main import parse_rl

from .conftest import rlhf, small_run


def _steps(run_dir) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


def test_openrlhf_spellings_train_exactly_as_ours(assets, tmp_path):
    ours = [*small_run(assets, reward=False), "--reward.reward_func", str(assets["reward"]),
            "--actor.optimizer.lr", "1e-3"]  # fmt: skip
    theirs = [
        "--actor.model_name_or_path", str(assets["model"]),
        "--data.prompt_dataset", str(assets["train"]),
        "--reward.remote_url", str(assets["reward"]),  # OpenRLHF's reward file
        "--train.num_steps", "2",
        "--rollout.batch_size", "4",
        "--rollout.n_samples_per_prompt", "4",
        "--rollout.max_new_tokens", "6",
        "--data.max_len", "16",
        "--eval.steps", "-1",  # OpenRLHF's never
        "--actor.adam.lr", "1e-3",
        "--logger.logging_steps", "1",
        "--vllm.num_cpus", "0.5",
        "--actor.num_cpus_per_rank", "0.5",
    ]  # fmt: skip
    a = rlhf("train", "grpo", "--run_dir", str(tmp_path / "ours"), *ours)
    assert a.returncode == 0, a.stderr[-3000:]
    b = rlhf("train", "grpo", "--run_dir", str(tmp_path / "theirs"), *theirs)
    assert b.returncode == 0, b.stderr[-3000:]
    assert "--logger.logging_steps is accepted and has no effect here" in b.stderr
    # Start-up says what it starts and when each part is ready.
    assert "[startup] starting 1 vLLM engine(s) and the actor (1 rank), ref (1 rank)…" in b.stdout
    assert all(f"[startup] {part} ready after" in b.stdout for part in ("engines", "actor", "ref"))
    # The same run (the run directory aside; the reward file as each line named it) ...
    config = {d: json.loads((tmp_path / d / "config.json").read_text()) for d in ("ours", "theirs")}
    assert config["ours"]["reward"]["reward_func"] == str(assets["reward"])
    assert config["theirs"]["reward"]["remote_url"] == str(assets["reward"])
    for c in config.values():
        del c["run_dir"], c["reward"]["reward_func"], c["reward"]["remote_url"]
    assert config["ours"] == config["theirs"]
    # ... samples the same tokens, scores and trains alike.
    for key in ("rollout/samples_crc32", "reward/mean", "actor/grad_norm", "actor/kl_loss"):
        assert [r[key] for r in _steps(tmp_path / "ours")] == [
            r[key] for r in _steps(tmp_path / "theirs")
        ], key


NO_FUNC = "def score(queries, prompts, labels):\n    return [0.0] * len(queries)\n"


BAD_FILES = [
    ("missing.py", None, "missing.py: no such file"),
    ("broken.py", "def reward_func(:\n", "broken.py: not valid Python (line 1)"),
    ("other.py", NO_FUNC, "other.py: defines no reward_func"),
]
CASES = [
    *(
        (flag, *case)
        for flag in ("--reward.remote_url", "--reward.reward_func")
        for case in BAD_FILES
    ),
    # Only a .py remote URL is a file; another is a server address.
    ("--reward.reward_func", "reward.txt", "x", "reward.txt: a reward file must be a .py file"),
]


@pytest.mark.parametrize(("flag", "name", "text", "expected"), CASES)
def test_a_bad_reward_file_is_named_before_anything_starts(
    assets, tmp_path, flag, name, text, expected
):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    config = parse_rl("grpo", ["--actor.model.path", str(assets["model"]),
                               "--data.prompt_data", str(assets["train"]), flag, str(path)])  # fmt: skip
    with pytest.raises(ConfigError) as caught:
        config.validate()
    assert f"{flag} {path}" in str(caught.value) and expected in str(caught.value), caught.value


def test_a_reward_file_and_a_reward_function_together_are_refused(assets):
    config = parse_rl(
        "grpo",
        ["--actor.model.path", str(assets["model"]), "--data.prompt_data", str(assets["train"]),
         "--reward.remote_url", str(assets["reward"]), "--reward.reward_func", "builtin:exact_match"],
    )  # fmt: skip
    with pytest.raises(ConfigError, match="is a reward file: it is the reward function"):
        config.validate()


OPENRLHF_AGENT = '''
import torch

from rlhf.agents.openrlhf import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    """Sort the digits; a wrong first answer gets ':' back and one more try (half reward)."""

    async def reset(self, states, **kwargs):
        self.label, self.turns = states["label"], 0
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.turns += 1
        right = states["action_text"].strip() == self.label
        done = right or self.turns == 2
        reward = 1.0 / self.turns if right else 0.0
        return {
            "rewards": torch.tensor(reward),
            "scores": torch.tensor(float(right)),
            "environment_feedback": "" if done else ":",
            "done": done,
            "sampling_params": states["sampling_params"],
            "extra_logs": {"solved": torch.tensor(float(right))},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


@pytest.mark.parametrize("mode", [[], ["--train.async_enable"]], ids=["sync", "async"])
def test_an_openrlhf_agent_file_trains(assets, tmp_path, mode):
    agent = tmp_path / "agent.py"
    agent.write_text(OPENRLHF_AGENT)
    args = small_run(assets, reward=False)
    args[args.index("--rollout.max_len") + 1] = "24"  # prompt 5 + 2 turns of 6 + feedback
    out = rlhf("train", "grpo", "--run_dir", str(tmp_path / "run"), *args, *mode,
               "--train.agent_func_path", str(agent), "--ckpt.save_steps", "1",
               "--ckpt.save_hf", "--ckpt.disable_ds", "--ckpt.max_num", "1")  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    steps = _steps(tmp_path / "run")
    assert [r["step"] for r in steps] == [1, 2]
    # OpenRLHF's --ckpt.save_hf without --ckpt.disable_ds's state: an HF export per save, the
    # newest --ckpt.max_num kept, the last one the final model.
    saved = tmp_path / "run" / "hf_checkpoints"
    assert [p.name for p in saved.iterdir()] == ["step_2"]
    assert not list((tmp_path / "run" / "checkpoints").glob("*/COMPLETE"))
    from safetensors.torch import load_file

    final = load_file(tmp_path / "run" / "final" / "model.safetensors")
    last = load_file(saved / "step_2" / "model.safetensors")
    assert final.keys() == last.keys() and all(final[k].equal(last[k]) for k in final)
    for r in steps:
        # Every episode ends by its second turn; its extra_logs reach the metrics.
        assert 1.0 <= r["env/turns_mean"] <= 2.0
        assert 0.0 <= r["env/solved_mean"] <= 1.0
        assert r["reward/mean"] in [k / 32 for k in range(0, 33)]  # 1, 1/2 or 0 per sample
        # OpenRLHF's executor gives each turn what is left of max_len (24) after the
        # prompt (5 tokens) and the turns before it.
        assert 1.0 <= r["rollout/response_length_mean"] <= 24 - 5


def test_an_openrlhf_openai_server_agent_file_trains(assets, tmp_path):
    # OpenRLHF's OpenAI-server shape on the real engines: the executor's own HTTP server calls
    # the engine from its thread; the openai client drives each episode.
    agent = pathlib.Path(__file__).parents[3] / "examples" / "openrlhf_agent_openai_server.py"
    args = small_run(assets, reward=False)
    args[args.index("--rollout.max_len") + 1] = "24"
    out = rlhf("train", "grpo", "--run_dir", str(tmp_path / "run"), *args,
               "--train.agent_func_path", str(agent))  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    steps = _steps(tmp_path / "run")
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["env/failed"] == 0.0 and 1.0 <= r["env/tries_mean"] <= 2.0
        assert r["reward/mean"] in [k / 32 for k in range(0, 33)]  # 1, 1/2 or 0 per sample
        # Generated by the engines of this step or the one before (never unknown).
        assert r["rollout/staleness_max"] <= 1


def test_qlora_trains_with_openrlhf_spellings(assets, tmp_path):
    # --ds.load_in_4bit with LoRA: a 4-bit base on the actor (and the reference, which shares
    # it), adapters trained, the engines fed the dequantised merged weights.
    args = [*small_run(assets), "--ds.lora.rank", "4", "--ds.lora.alpha", "8", "--ds.load_in_4bit",
            "--algo.kl.init_coef", "0.01", "--algo.kl.use_loss"]  # fmt: skip
    out = rlhf("train", "grpo", "--run_dir", str(tmp_path / "run"), *args)
    assert out.returncode == 0, out.stderr[-4000:]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["actor"]["model"]["load_in_4bit"] and config["actor"]["model"]["lora_rank"] == 4
    steps = _steps(tmp_path / "run")
    assert [r["step"] for r in steps] == [1, 2]
    # The reference is the same 4-bit model: it and the policy agree exactly before training.
    assert steps[0]["check/step0_policy_ref_logprob_gap_max"] == 0.0
    # The engines sample with the dense weights the learner sends, the learner computes with
    # bitsandbytes' 4-bit kernel: close, not equal (stale or wrong weights differ by ~1).
    assert all(r["actor/rollout_logprob_diff_max"] < 0.5 for r in steps)
