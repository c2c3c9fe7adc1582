"""Resumable checkpoints: layout, atomic finalisation, rotation, validation.

Layout under a run's checkpoint root::

    step-00000012/            a complete checkpoint (renamed into place as a whole)
        COMPLETE              marker written last, before the rename
        model.json            parameter names → shapes of the model it holds
        trainer_state.json    the driver's state (step, data position, KL controller, …)
        rng/rank-<r>.pt       each rank's RNG states
        ema/rank-<r>.pt       each rank's EMA weights (its shards under ZeRO-3), if kept
        backend/              the backend's own files (DeepSpeed engine state)
    .staging-step-00000012/   being written; never read

A checkpoint becomes visible only through ``os.replace`` of its finished staging directory, so
a run killed while saving leaves the previous checkpoint as the latest one.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import re
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

import torch

_COMPLETE = re.compile(r"^step-(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed from; the message says why and what to do."""


def final_dir(root: str | os.PathLike[str], step: int) -> pathlib.Path:
    """Where the checkpoint of ``step`` lives once complete."""
    return pathlib.Path(root) / f"step-{step:08d}"


def staging_dir(root: str | os.PathLike[str], step: int) -> pathlib.Path:
    """Where the checkpoint of ``step`` is written before it is finalised."""
    return pathlib.Path(root) / f".staging-step-{step:08d}"


def complete_checkpoints(root: str | os.PathLike[str]) -> list[pathlib.Path]:
    """Complete checkpoints under ``root``, oldest first."""
    base = pathlib.Path(root)
    if not base.is_dir():
        return []
    found = [
        p
        for p in base.iterdir()
        if p.is_dir() and _COMPLETE.match(p.name) and (p / "COMPLETE").is_file()
    ]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: str | os.PathLike[str]) -> pathlib.Path | None:
    """The newest complete checkpoint, or None."""
    found = complete_checkpoints(root)
    return found[-1] if found else None


def write_rank_rng(directory: str | os.PathLike[str], rank: int) -> None:
    """Save this process's Python and torch (CPU and CUDA) RNG states."""
    path = pathlib.Path(directory) / "rng"
    path.mkdir(parents=True, exist_ok=True)
    state = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    torch.save(state, path / f"rank-{rank}.pt")


def load_tensors_only(
    file: str | os.PathLike[str],
    *,
    what: str,
    map_location: Any = "cpu",
    allowed: Sequence[Any] = (),
) -> Any:
    """``torch.load`` that unpickles tensors and plain containers only (and the data
    classes in ``allowed``): a checkpoint from elsewhere cannot run code while it is read.

    Raises:
        CheckpointError: naming the file and what it holds, when it does not unpickle so
            (corrupt, or holding other objects).
    """
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(file, weights_only=True, map_location=map_location)
    except Exception as exc:  # UnpicklingError, RuntimeError (truncated zip), EOFError, …
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(file)
        except Exception:  # not even a readable archive
            unsafe = []
        if unsafe:
            reason = f"it holds objects of {', '.join(sorted(unsafe))}"
        raise CheckpointError(
            f"{file} ({what}) does not load as plain tensors and containers: {reason}; it is "
            "corrupt or was not written by this framework (nothing in it was executed)"
        ) from None


def restore_rank_rng(directory: str | os.PathLike[str], rank: int) -> None:
    """Restore what `write_rank_rng` saved for ``rank``."""
    file = pathlib.Path(directory) / "rng" / f"rank-{rank}.pt"
    if not file.is_file():
        written = sorted(int(f.stem.removeprefix("rank-")) for f in file.parent.glob("rank-*.pt"))
        if written and rank > written[-1]:
            raise CheckpointError(
                f"checkpoint {directory} has no RNG state for rank {rank}: it was written with "
                f"{written[-1] + 1} ranks; resume with that many ranks"
            )
        raise CheckpointError(
            f"checkpoint {directory} is missing {file.relative_to(directory)} (deleted, or an "
            "incomplete copy): restore the file or resume from another checkpoint"
        )
    state = load_tensors_only(file, what=f"the RNG state of rank {rank}")
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def finalize(
    root: str | os.PathLike[str],
    step: int,
    *,
    fingerprint: Mapping[str, list[int]],
    client_state: Mapping[str, Any],
    keep: int | None,
) -> pathlib.Path:
    """Rank 0, after every rank has written into the staging dir: write the metadata and the
    marker, move the checkpoint into place, and keep only the ``keep`` newest."""
    staging = staging_dir(root, step)
    if not staging.is_dir():
        raise CheckpointError(f"no staging directory {staging} to finalise")
    (staging / "model.json").write_text(json.dumps(dict(fingerprint)))
    (staging / "trainer_state.json").write_text(json.dumps(dict(client_state), indent=1))
    (staging / "COMPLETE").write_text(json.dumps({"step": step}))
    final = final_dir(root, step)
    if final.exists():  # a re-save of the same step replaces it whole
        shutil.rmtree(final)
    os.replace(staging, final)
    if keep is not None and keep > 0:
        for old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def validate(directory: str | os.PathLike[str], fingerprint: Mapping[str, list[int]]) -> dict:
    """Check that ``directory`` is a complete checkpoint of this model; return its client state.

    Raises:
        CheckpointError: for a missing, partial or foreign checkpoint, naming what differs.
    """
    path = pathlib.Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.name.startswith(".staging-") or not (path / "COMPLETE").is_file():
        previous = latest_checkpoint(path.parent)
        hint = f"; the latest complete one is {previous}" if previous else ""
        raise CheckpointError(
            f"checkpoint {path} is incomplete (no COMPLETE marker): it was interrupted while "
            f"being written{hint}"
        )
    saved = json.loads((path / "model.json").read_text())
    ours = {k: list(v) for k, v in fingerprint.items()}
    if saved != ours:
        missing = sorted(set(ours) - set(saved))
        extra = sorted(set(saved) - set(ours))
        shapes = sorted(k for k in set(ours) & set(saved) if ours[k] != saved[k])
        parts = [
            f"{what}: {names[:5]}{' …' if len(names) > 5 else ''}"
            for what, names in (
                ("parameters it lacks", missing),
                ("parameters this model lacks", extra),
                ("different shapes", shapes),
            )
            if names
        ]
        raise CheckpointError(
            f"checkpoint {path} was written for another model (" + "; ".join(parts) + "); "
            "point --ckpt.path at this run's checkpoints or start without --ckpt.load_enable"
        )
    return json.loads((path / "trainer_state.json").read_text())
