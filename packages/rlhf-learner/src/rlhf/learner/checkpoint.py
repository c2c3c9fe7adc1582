"""Resumable checkpoints: layout, atomic finalisation, rotation, validation.

Layout under a run's checkpoint root::

    step-00000012/            a complete checkpoint (renamed into place as a whole)
        COMPLETE              marker written last, before the rename: the step and the
                              manifest (every other file's size and CRC-32)
        model.json            parameter names → shapes of the model it holds
        trainer_state.json    the driver's state (step, data position, KL controller, …)
        rng/rank-<r>.safetensors  each rank's RNG states (torch's as tensors, Python's as
                              JSON in the header)
        ema/rank-<r>.safetensors  each rank's EMA weights (its shards under ZeRO-3), if kept
        backend/              the backend's own files (DeepSpeed engine state, or DCP)

Nothing in it is a pickle of ours: our files are JSON and safetensors, and the DeepSpeed
backend writes DeepSpeed's state files (under DeepSpeed's names) as safetensors with a JSON
skeleton (`rlhf.learner.state_codec`), so reading a checkpoint runs no code. The molt
backend's DCP files are safetensors and JSON as well (``rlhf.molt.dcp_files``).
    .staging-step-00000012/   being written; never read

A checkpoint becomes visible only through ``os.replace`` of its finished staging directory, so
a run killed while saving leaves the previous checkpoint as the latest one. A file changed,
truncated or lost afterwards (a full disk, a bad copy) fails `verify_checkpoint` against the
manifest; `validate` refuses such a checkpoint naming the file and the newest intact one, and
`latest_intact_checkpoint` skips it.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import re
import shutil
import zlib
from collections.abc import Mapping
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


def save_tensors(
    file: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    *,
    meta: Any = None,
) -> None:
    """``tensors`` as a safetensors file, ``meta`` (JSON-serialisable) in its header."""
    from safetensors.torch import save_file

    flat = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    save_file(flat, str(file), metadata={"json": json.dumps(meta)})


def load_tensors(file: str | os.PathLike[str], *, what: str) -> tuple[dict[str, torch.Tensor], Any]:
    """What `save_tensors` wrote: the tensors (on the CPU) and ``meta``. Nothing is unpickled.

    Raises:
        CheckpointError: naming the file and what it holds, when it is not such a file
            (corrupt, truncated, or written by something else).
    """
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        meta = json.loads(header["json"])
    except Exception as exc:  # SafetensorError, KeyError, JSONDecodeError, OSError
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{file} ({what}) does not load as a safetensors file with our header: {reason}; "
            "it is corrupt or was not written by this framework (nothing in it was executed)"
        ) from None
    return tensors, meta


def write_rank_rng(directory: str | os.PathLike[str], rank: int) -> None:
    """Save this process's Python and torch (CPU and CUDA) RNG states: torch's as tensors,
    Python's Mersenne Twister state as JSON, in ``rng/rank-<rank>.safetensors``."""
    path = pathlib.Path(directory) / "rng"
    path.mkdir(parents=True, exist_ok=True)
    version, internal, gauss = random.getstate()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    tensors = {"torch": torch.get_rng_state(), **{f"cuda.{i}": s for i, s in enumerate(cuda)}}
    meta = {"python": [version, list(internal), gauss], "cuda_devices": len(cuda)}
    save_tensors(path / f"rank-{rank}.safetensors", tensors, meta=meta)


def restore_rank_rng(directory: str | os.PathLike[str], rank: int) -> None:
    """Restore what `write_rank_rng` saved for ``rank``."""
    file = pathlib.Path(directory) / "rng" / f"rank-{rank}.safetensors"
    if not file.is_file():
        written = sorted(
            int(f.name.removeprefix("rank-").removesuffix(".safetensors"))
            for f in file.parent.glob("rank-*.safetensors")
        )
        if written and rank > written[-1]:
            raise CheckpointError(
                f"checkpoint {directory} has no RNG state for rank {rank}: it was written with "
                f"{written[-1] + 1} ranks; resume with that many ranks"
            )
        raise CheckpointError(
            f"checkpoint {directory} is missing {file.relative_to(directory)} (deleted, or an "
            "incomplete copy): restore the file or resume from another checkpoint"
        )
    what = f"the RNG state of rank {rank}"
    tensors, meta = load_tensors(file, what=what)
    try:
        version, internal, gauss = meta["python"]
        cuda = [tensors[f"cuda.{i}"] for i in range(int(meta["cuda_devices"]))]
        python_state = (int(version), tuple(int(x) for x in internal), gauss)
        cpu_state = tensors["torch"]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{file} ({what}) lacks {exc}: it was not written by this framework's "
            "write_rank_rng; resume from another checkpoint"
        ) from None
    random.setstate(python_state)
    torch.set_rng_state(cpu_state)
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


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
    marker = {"step": step, "files": manifest(staging)}
    (staging / "COMPLETE").write_text(json.dumps(marker))
    final = final_dir(root, step)
    if final.exists():  # a re-save of the same step replaces it whole
        shutil.rmtree(final)
    os.replace(staging, final)
    if keep is not None and keep > 0:
        for old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _crc32(path: pathlib.Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def manifest(directory: str | os.PathLike[str]) -> dict[str, list[int]]:
    """``relative path → [size, CRC-32]`` of every file under ``directory`` but the marker
    (CRC-32 streams at about 1–2 GB/s per core)."""
    base = pathlib.Path(directory)
    return {
        str(f.relative_to(base)): [f.stat().st_size, _crc32(f)]
        for f in sorted(base.rglob("*"))
        if f.is_file() and f.name != "COMPLETE"
    }


def verify_checkpoint(directory: str | os.PathLike[str]) -> list[str]:
    """What differs between a complete checkpoint's files and its manifest (empty: intact;
    a checkpoint written before manifests existed is not checked)."""
    base = pathlib.Path(directory)
    try:
        recorded = json.loads((base / "COMPLETE").read_text()).get("files")
    except (OSError, ValueError, AttributeError) as exc:
        return [f"COMPLETE does not read: {exc!r}"]
    if recorded is None:
        return []
    if not isinstance(recorded, dict):
        return [f"COMPLETE's manifest is a {type(recorded).__name__}, not an object of files"]
    problems = []
    for name, entry in recorded.items():
        if not (
            isinstance(entry, list)
            and len(entry) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
        ):
            problems.append(f"COMPLETE's entry for {name} is {entry!r}, not [size, CRC-32]")
            continue
        size, crc = entry
        f = base / name
        if not f.is_file():
            problems.append(f"{name} is missing")
        elif f.stat().st_size != size:
            problems.append(f"{name} has {f.stat().st_size} bytes, {size} were written")
        elif _crc32(f) != crc:
            problems.append(f"{name} differs from what was written (CRC-32)")
    return problems


def latest_intact_checkpoint(
    root: str | os.PathLike[str],
) -> tuple[pathlib.Path | None, list[tuple[pathlib.Path, list[str]]]]:
    """The newest complete checkpoint that passes `verify_checkpoint`, and the newer ones
    that did not (each with its problems)."""
    damaged = []
    for path in reversed(complete_checkpoints(root)):
        problems = verify_checkpoint(path)
        if not problems:
            return path, damaged
        damaged.append((path, problems))
    return None, damaged


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
    problems = verify_checkpoint(path)
    if problems:
        intact, _ = latest_intact_checkpoint(path.parent)
        hint = f"; the newest intact one is {intact}" if intact else ""
        listed = "; ".join(problems[:5]) + (" …" if len(problems) > 5 else "")
        raise CheckpointError(f"checkpoint {path} is damaged since it was written ({listed}){hint}")
    saved = _json_file(path / "model.json")
    if not isinstance(saved, dict):
        raise CheckpointError(
            f"{path / 'model.json'} holds a JSON {type(saved).__name__}, not the model's "
            "parameter shapes: resume from another checkpoint"
        )
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
    state = _json_file(path / "trainer_state.json")
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{path / 'trainer_state.json'} holds a JSON {type(state).__name__}, not the "
            "trainer's state: resume from another checkpoint"
        )
    return state


def _json_file(file: pathlib.Path) -> Any:
    """A checkpoint's JSON file, or a `CheckpointError` naming it."""
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{file} does not read ({exc}): the checkpoint was changed after it was written; "
            "resume from another checkpoint"
        ) from None
