"""What ``--ckpt.load_enable`` resumes from, checked before anything starts: the newest
complete checkpoint under ``run_dir/checkpoints`` (none: a new run, said so), refused when its
step already reaches ``--train.num_steps`` or when the run's batch shape differs from the one it
was written with (the prompt sampler's position and the optimizer schedule would no longer
mean the same)."""

from __future__ import annotations

import json
import pathlib

from rlhf.cli.config import ConfigError, RLConfig
from rlhf.learner import CheckpointError, latest_checkpoint

SHAPE = (
    "rollout.batch_size",
    "rollout.n_samples_per_prompt",
    "train.batch_size",
    "train.ppo_epochs",
)
"""The flags a checkpoint records (``trainer_state.json``'s ``shape``) and a resume must keep."""


def run_shape(config: RLConfig) -> dict[str, int]:
    """The `SHAPE` values of ``config``."""
    out = {}
    for flag in SHAPE:
        section, name = flag.split(".")
        out[flag] = int(getattr(getattr(config, section), name))
    return out


def check_resume(config: RLConfig, root: pathlib.Path) -> str:
    """One line for the plan: where the run resumes from.

    Raises:
        ConfigError: listing what keeps the checkpoint from continuing this run.
        CheckpointError: a checkpoint whose trainer state does not read.
    """
    latest = latest_checkpoint(root)
    if latest is None:
        return f"no checkpoint under {root}: starting at step 0 (a new run)"
    try:
        state = json.loads((latest / "trainer_state.json").read_text())
        step = int(state["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{latest}/trainer_state.json does not read: {exc!r}") from None
    problems = []
    if step >= config.train.num_steps:
        problems.append(
            f"{latest.name} is at step {step}: --train.num_steps {config.train.num_steps} is "
            "done already; raise --train.num_steps to train further"
        )
    saved = state.get("shape", {})  # checkpoints from before the shape was recorded: unchecked
    for flag, value in run_shape(config).items():
        if flag in saved and saved[flag] != value:
            problems.append(
                f"--{flag} is {value} but {latest.name} was written with {saved[flag]}: resume "
                "with the same value, or start a new --run_dir"
            )
    if len(problems) == 1:
        raise ConfigError(f"--ckpt.load_enable: {problems[0]}")
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"--ckpt.load_enable: {len(problems)} problems:\n{listed}")
    return f"from {latest} (step {step})"
