"""Read an offline W&B run back: its transaction log (``run-<id>.wandb``) is a LevelDB-style
log — a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks of records, each a
7-byte header (masked CRC32C, length, type: 1 full, 2 first, 3 middle, 4 last) and a piece of
one serialised ``wandb_internal_pb2.Record``."""

from __future__ import annotations

import json
import pathlib
import struct
import time
from typing import Any

BLOCK = 32768
HEADER = 7


def records(path: pathlib.Path) -> list[Any]:
    """Every record of the log, parsed."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log")
    out, pieces, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0:
            break
        pieces += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            out.append(record)
            pieces = b""
    return out


def finished(path: pathlib.Path, *, timeout: float = 60.0) -> pathlib.Path:
    """``path`` once its exit record is on disk: W&B's service process writes the log and may
    still be flushing it when ``finish()`` has returned."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if any(r.WhichOneof("record_type") == "exit" for r in records(path)):
                return path
        except Exception:  # a record cut off mid-write
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} has no exit record after {timeout} s")
        time.sleep(0.2)


def offline_runs(root: pathlib.Path) -> set[pathlib.Path]:
    """The finished transaction logs of the offline runs under ``root/wandb``."""
    return {finished(p) for p in root.glob("wandb/offline-run-*/run-*.wandb")}


def history(path: pathlib.Path) -> list[dict[str, Any]]:
    """The logged rows, W&B's own ``_``-keys left out."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for item in record.history.item}  # fmt: skip
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def run_info(path: pathlib.Path) -> dict[str, str]:
    """Project, group, display name and id of the run."""
    for record in records(path):
        if record.WhichOneof("record_type") == "run":
            run = record.run
            return {"project": run.project, "group": run.run_group, "name": run.display_name,
                    "id": run.run_id}  # fmt: skip
    raise ValueError(f"{path} holds no run record")


def run_config(path: pathlib.Path) -> dict[str, Any]:
    """The config the run started with."""
    for record in records(path):
        if record.WhichOneof("record_type") == "run":
            return {u.key: json.loads(u.value_json) for u in record.run.config.update}
    raise ValueError(f"{path} holds no run record")
