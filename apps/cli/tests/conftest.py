"""Assets of the demo task (a random tiny model and prompts), shared by the CLI tests, and a
helper that runs the ``rlhf`` command in a subprocess."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REWARD = '''
def reward_func(queries, prompts, labels, **kwargs):
    """Graded: the fraction of label characters at the right place (varies even for a random
    policy, so group-filtering presets keep some groups)."""
    out = []
    for response, label in zip(kwargs["responses"], labels):
        out.append(sum(a == b for a, b in zip(response, label)) / len(label))
    return out
'''


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict[str, pathlib.Path]:
    from rlhf.cli.demo import make_assets

    root = tmp_path_factory.mktemp("demo-assets")
    made = make_assets(root, noise=0.6, seed=0)
    reward = root / "graded_reward.py"
    reward.write_text(REWARD)
    return {**made, "reward": reward}


def rlhf(
    *args: str, timeout: float = 900, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "rlhf.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def small_run(
    assets: dict[str, pathlib.Path],
    *,
    steps: int = 2,
    prompts: int = 4,
    samples: int = 4,
    max_new_tokens: int = 6,
    reward: bool = True,
) -> list[str]:
    """Flags of a small ``rlhf train`` run on the demo assets: the graded reward file (unless
    ``reward`` is False), short samples, no evaluation, half a CPU per engine and actor rank."""
    return [
        "--actor.model.path", str(assets["model"]),
        "--data.prompt_data", str(assets["train"]),
        *(["--train.reward_func", str(assets["reward"])] if reward else []),
        "--train.num_steps", str(steps),
        "--rollout.batch_size", str(prompts),
        "--rollout.n_samples_per_prompt", str(samples),
        "--rollout.max_new_tokens", str(max_new_tokens),
        "--rollout.max_len", "16",
        "--eval.steps", "0",
        "--vllm.num_cpus", "0.5",
        "--actor.num_cpus_per_rank", "0.5",
    ]  # fmt: skip
