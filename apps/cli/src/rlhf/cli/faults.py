"""What ``rlhf train`` says when one of its processes dies under it (``kill -9``, the kernel's
out-of-memory killer, a node lost): which role it was, where the run stands, and the command
that resumes it, instead of Ray's ``ActorDiedError`` traceback."""

from __future__ import annotations

import json
import pathlib
import re

from rlhf.cli.config import RunError

ROLE_OF_ACTOR_CLASS = {
    "EngineActor": "a vLLM engine",
    "RankWorker": "a learner rank (actor, critic, reference or reward model)",
}
"""The role each of our Ray actor classes plays, for the message."""


def died_role(
    text: str, *, actor_id: str | None = None, names: dict[str, str] | None = None
) -> str:
    """The process that died: by its actor id when ``names`` knows it ("the actor rank 0",
    "the vLLM engine 1"), else the role its class plays (``class_name: EngineActor`` in Ray's
    message), else "a Ray actor"."""
    if actor_id and names and actor_id in names:
        return f"the {names[actor_id]}"
    match = re.search(r"class_name:\s*(\w+)", text) or re.search(
        "|".join(ROLE_OF_ACTOR_CLASS), text
    )
    if match is None:
        return "a Ray actor"
    name = match.group(1) if match.groups() else match.group(0)
    return ROLE_OF_ACTOR_CLASS.get(name, f"a Ray actor ({name})")


def resume_hint(ckpt_root: pathlib.Path) -> str:
    """Where a resume would start: the newest complete checkpoint, or that there is none."""
    from rlhf.learner import latest_checkpoint

    latest = latest_checkpoint(ckpt_root)
    if latest is None:
        return (
            f"There is no checkpoint under {ckpt_root} yet (--ckpt.save_steps N saves one "
            "every N steps): run the command again to start over"
        )
    try:
        step = json.loads((latest / "trainer_state.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        step = "?"
    return (
        f"The newest checkpoint is {latest} (step {step}): run the same command with "
        "--ckpt.load_enable True to resume from it"
    )


def actor_died(
    exc: BaseException, *, ckpt_root: pathlib.Path, names: dict[str, str] | None = None
) -> RunError:
    """The `RunError` for a Ray actor that died during the run (``names``: actor id → the
    process's name, `rlhf.cli.roles.Roles.process_names`)."""
    text = str(exc)
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    who = died_role(text, actor_id=getattr(exc, "actor_id", None), names=names)
    return RunError(
        f"{who} died during the run ({first[:200]}); the run stopped. {resume_hint(ckpt_root)}"
    )
