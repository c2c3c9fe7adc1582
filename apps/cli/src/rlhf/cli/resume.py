"""What ``--ckpt.load_enable`` resumes from, checked before anything starts.

`pick_checkpoint` chooses the checkpoint under ``run_dir/checkpoints``: with ``True`` the newest
one, which must exist and be intact (`rlhf.learner.verify_checkpoint` against its manifest);
with ``auto`` the newest intact one, or none (a new run). `check_resume` then refuses one whose
step already reaches ``--train.num_steps`` or whose batch shape differs from the run's (the
prompt sampler's position and the optimizer schedule would no longer mean the same), unless
``--ckpt.allow_config_change`` names the flags that changed."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Collection, Mapping
from typing import Any

from rlhf.cli.config import ConfigError
from rlhf.cli.sections import CkptConfig
from rlhf.learner import CheckpointError, latest_checkpoint, latest_intact_checkpoint


def pick_checkpoint(root: pathlib.Path, ckpt: CkptConfig) -> tuple[pathlib.Path | None, str]:
    """The checkpoint ``--ckpt.load_enable`` resumes from (None: a new run) and a note on the
    damaged ones passed over.

    Raises:
        ConfigError: ``True`` with no checkpoint under ``root``, or with a damaged newest one.
    """
    intact, damaged = latest_intact_checkpoint(root)
    passed = "; ".join(f"{p.name} is damaged ({problems[0]})" for p, problems in damaged)
    if ckpt.load_enable == "auto":
        return intact, (f"{passed}; " if passed else "")
    if latest_checkpoint(root) is None:
        raise ConfigError(
            f"--ckpt.load_enable True: no checkpoint under {root} (a new --run_dir, or a "
            "mistyped one?); start without --ckpt.load_enable, or use --ckpt.load_enable auto "
            "to resume when a checkpoint exists and start anew when none does"
        )
    if damaged:
        offer = (
            f"the newest intact one is {intact.name}: move the damaged ones aside, or use "
            "--ckpt.load_enable auto to resume from it"
            if intact
            else "no intact checkpoint is left: start a new --run_dir"
        )
        raise ConfigError(f"--ckpt.load_enable: {passed}; {offer}")
    return intact, ""


def shape_problems(
    saved: Mapping[str, int], ours: Mapping[str, int], *, name: str, allowed: Collection[str]
) -> list[str]:
    """One line per shape flag whose value differs from the checkpoint's (``name``), except
    those ``--ckpt.allow_config_change`` lists (``allowed``)."""
    return [
        f"--{flag} is {value} but {name} was written with {saved[flag]}: resume with the same "
        "value, start a new --run_dir, or accept the change with --ckpt.allow_config_change "
        f"{flag}"
        for flag, value in ours.items()
        if flag in saved and saved[flag] != value and flag not in allowed
    ]


def raise_problems(problems: list[str]) -> None:
    """One `ConfigError` for the resume's problems, if any."""
    if len(problems) == 1:
        raise ConfigError(f"--ckpt.load_enable: {problems[0]}")
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"--ckpt.load_enable: {len(problems)} problems:\n{listed}")


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from.

    Attributes:
        path: Its directory.
        step: The steps it has done.
        state: Its ``trainer_state.json``.
    """

    path: pathlib.Path
    step: int
    state: dict[str, Any]


def resume_point(
    root: pathlib.Path,
    *,
    ckpt: CkptConfig,
    num_steps: int,
    steps_flag: str,
    shape: Mapping[str, int],
    command: str | None = None,
) -> tuple[ResumePoint | None, str]:
    """The checkpoint ``--ckpt.load_enable`` resumes from (None: a new run) and one line for
    the plan saying where the run starts: chosen by `pick_checkpoint`, then refused when it
    was written by another command (``command``; None: not recorded, unchecked), has done
    ``num_steps`` (the flag ``steps_flag``) already, or was written with another ``shape``
    that ``--ckpt.allow_config_change`` does not accept.

    Raises:
        ConfigError: listing those problems, each naming its flag.
        CheckpointError: a checkpoint whose trainer state does not read.
    """
    unknown = sorted(ckpt.allowed_changes - set(shape))
    if unknown:
        raise ConfigError(
            f"--ckpt.allow_config_change names {', '.join(unknown)}, which a resume does not "
            f"check; it checks {', '.join(shape)}"
        )
    chosen, passed = pick_checkpoint(root, ckpt)
    if chosen is None:
        return None, f"{passed}no checkpoint under {root}: starting at step 0 (a new run)"
    try:
        state = json.loads((chosen / "trainer_state.json").read_text())
        step = int(state["step"])
        # The RL command's checkpoints from before the shape was recorded: unchecked.
        saved = dict(state["shape"] if command is not None else state.get("shape", {}))
        written_by = str(state["command"]) if command is not None else None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{chosen}/trainer_state.json does not read: {exc!r}") from None
    problems = []
    if written_by != command:
        problems.append(
            f"{chosen.name} was written by `rlhf train {written_by}`, not `rlhf train "
            f"{command}`: resume it with that command, or start a new --run_dir"
        )
    if step >= num_steps:
        problems.append(
            f"{chosen.name} is at step {step}: {steps_flag} {num_steps} is done already; raise "
            f"{steps_flag} to train further"
        )
    problems += shape_problems(saved, shape, name=chosen.name, allowed=ckpt.allowed_changes)
    raise_problems(problems)
    return ResumePoint(chosen, step, state), f"{passed}from {chosen} (step {step})"


def check_resume(
    root: pathlib.Path, *, ckpt: CkptConfig, num_steps: int, shape: Mapping[str, int]
) -> tuple[pathlib.Path | None, str]:
    """The RL command's `resume_point` (``--ckpt.*``, ``--train.num_steps``, the run's
    `rlhf.cli.config.RLConfig.shape`): the checkpoint's directory (None: a new run) and the
    plan's line."""
    point, line = resume_point(
        root, ckpt=ckpt, num_steps=num_steps, steps_flag="--train.num_steps", shape=shape
    )
    return (point.path if point is not None else None), line
