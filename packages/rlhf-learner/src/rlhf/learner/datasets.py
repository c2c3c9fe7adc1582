"""Rows of training and prompt data from files: ``.json`` (a list), ``.jsonl``, ``.parquet``
and directories written by ``datasets``' ``save_to_disk`` (``rlhf-learner[data]`` brings
pyarrow and datasets), each error naming the file and, where there is one, the line. Several
comma-separated sources blend by weight (`dataset_rows`, `blend_weights`) as OpenRLHF's
``--data.dataset a,b --data.dataset_probs`` do. A trainer draws its rows in a `RowOrder`
(shuffled epochs, resumable from a few integers)."""

from __future__ import annotations

import importlib
import json
import math
import pathlib
import random
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

_EXTRA = "rlhf-cli[data]"
"""What ``pip install`` adds for .parquet files and saved HF datasets (the command's extra;
``rlhf-learner[data]`` alone brings the same two packages)."""


class DataSourceError(ValueError):
    """A data source cannot be read or a row lacks a field; the message names them."""


def read_rows(path: str) -> list[dict[str, Any]]:
    """Rows of a .json (a list), .jsonl, .parquet file or a ``datasets.save_to_disk`` dir
    (a ``DatasetDict``'s ``train`` split, else its first split)."""
    p = pathlib.Path(path)
    if not p.exists():
        raise DataSourceError(f"data source {path!r} does not exist")
    reader = _saved_dataset_rows if p.is_dir() else _READERS.get(p.suffix)
    if reader is None:
        raise DataSourceError(
            f"{path}: use .json, .jsonl, .parquet or a saved HF dataset directory"
        )
    return reader(p)


def _import(module: str, *, path: pathlib.Path) -> Any:
    """``module`` (a package of the ``data`` extra), or a `DataSourceError` that says what to
    install to read ``path``."""
    package = module.partition(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] == package:
            hint = f"pip install {package} (or pip install '{_EXTRA}' for every format)"
        else:
            hint = f"it is installed but fails to import ({exc}): pip install -U '{_EXTRA}'"
        raise DataSourceError(f"reading {path} needs {package}: {hint}") from None


def _text(path: pathlib.Path) -> str:
    """The file as UTF-8 text, or a `DataSourceError` naming the line and byte offset of the
    first byte that is not UTF-8."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        byte = raw[exc.start : exc.start + 1]
        raise DataSourceError(
            f"{path}:{line} is not UTF-8 text (byte {exc.start}: {byte!r}, {exc.reason}): "
            "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def _jsonl_rows(path: pathlib.Path) -> list[dict[str, Any]]:
    rows = []
    for n, line in enumerate(_text(path).splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataSourceError(f"{path}:{n} is not valid JSON: {exc}") from None
    return rows


def _json_rows(path: pathlib.Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(_text(path))
    except json.JSONDecodeError as exc:
        raise DataSourceError(
            f"{path}:{exc.lineno}:{exc.colno} is not valid JSON: {exc.msg}"
        ) from None
    if not isinstance(data, list):
        raise DataSourceError(f"{path} must hold a JSON list of rows, not {type(data).__name__}")
    return data


def _parquet_rows(path: pathlib.Path) -> list[dict[str, Any]]:
    pyarrow = _import("pyarrow", path=path)
    pq = _import("pyarrow.parquet", path=path)
    try:
        return pq.read_table(path).to_pylist()
    except (OSError, pyarrow.ArrowException) as exc:
        raise DataSourceError(f"{path} is not a readable parquet file: {exc}") from None


def _saved_dataset_rows(path: pathlib.Path) -> list[dict[str, Any]]:
    datasets = _import("datasets", path=path)
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise DataSourceError(
            f"{path} is a directory but not a dataset saved by datasets' save_to_disk: {exc}"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if not loaded:
            raise DataSourceError(f"{path} is a saved DatasetDict without splits")
        loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    return [dict(r) for r in loaded]


_READERS = {".json": _json_rows, ".jsonl": _jsonl_rows, ".parquet": _parquet_rows}


def count_rows(spec: str, *, max_samples: int | None = None) -> int:
    """Rows of the comma-separated sources ``spec`` (each ``path`` or ``name=path``), each
    source cut at ``max_samples``: what `load_prompts` would load."""
    return sum(
        len(read_rows(item.rpartition("=")[2].strip())[:max_samples])
        for item in spec.split(",")
        if item.strip()
    )


def blend_weights(
    probs: Sequence[float], *, n_sources: int, flag: str = "--data.prompt_data_probs"
) -> list[float]:
    """``probs`` checked (one finite, non-negative weight per source, not all zero), or equal
    weights when empty; ``random.choices`` would fail on all-zero weights only at the first
    draw and silently mis-blend negative ones."""
    if not probs:
        return [1.0] * n_sources
    if len(probs) != n_sources:
        raise DataSourceError(f"{flag} has {len(probs)} weights for {n_sources} sources")
    bad = [p for p in probs if not (math.isfinite(p) and p >= 0)]
    if bad:
        raise DataSourceError(f"{flag} {list(probs)}: weights must be finite and >= 0, not {bad}")
    if sum(probs) <= 0:
        raise DataSourceError(f"{flag} {list(probs)}: at least one weight must be positive")
    return [float(p) for p in probs]


def dataset_rows(
    spec: str,
    *,
    probs: Sequence[float] = (),
    seed: int,
    max_samples: int | None = None,
    flag: str = "--dataset",
) -> list[dict[str, Any]]:
    """The training rows of ``spec``, one source or several comma-separated ones, each cut at
    ``max_samples`` first (OpenRLHF's ``--data.dataset a,b`` with ``--data.dataset_probs``):
    without ``probs`` the sources one after another; with them, rows drawn from the sources by
    those weights (seeded), each source from its start again when it runs out, until every
    source with a weight has given all its rows (HF ``interleave_datasets``' all_exhausted
    rule). The result is cut at ``max_samples`` again."""
    paths = [part.strip() for part in spec.split(",") if part.strip()]
    sources = [read_rows(path)[:max_samples] for path in paths]
    if not probs:
        return [row for rows in sources for row in rows][:max_samples]
    weights = blend_weights(probs, n_sources=len(paths), flag=f"{flag}_probs")
    empty = [path for path, rows in zip(paths, sources, strict=True) if not rows]
    if empty:
        raise DataSourceError(f"{flag}: {', '.join(empty)} has no rows to blend")
    rng = random.Random(f"{seed}-blend")
    drawn = [0] * len(sources)
    left = {i for i, w in enumerate(weights) if w > 0}
    out: list[dict[str, Any]] = []
    while left:
        i = rng.choices(range(len(sources)), weights=weights)[0]
        out.append(sources[i][drawn[i] % len(sources[i])])
        drawn[i] += 1
        if drawn[i] >= len(sources[i]):
            left.discard(i)
    return out[:max_samples]


class RowOrder:
    """The order training rows are drawn in: each epoch a fresh shuffle of all rows (one
    ``random.Random(seed)``), a step's rows taken in turn across epoch boundaries.

    The state (`state_dict`) is the RNG state the current epoch was shuffled from and the
    position in it: the rows still to come are that permutation's tail, shuffled again on
    `load_state_dict`, so a checkpoint holds 625 integers rather than a list as long as the
    dataset.

    Args:
        n_rows: Rows (SFT rows, preference pairs) to draw from, >= 1.
        seed: Seed of the shuffles.
    """

    def __init__(self, n_rows: int, *, seed: int) -> None:
        if n_rows < 1:
            raise DataSourceError("--dataset has no rows to train on")
        self.n_rows = n_rows
        self.rng = random.Random(seed)
        self.epochs = 0
        self.epoch_rng: tuple[Any, ...] = self.rng.getstate()
        self.permutation: list[int] = []
        self.position = 0

    def _shuffle(self) -> None:
        self.epoch_rng = self.rng.getstate()
        self.permutation = list(range(self.n_rows))
        self.rng.shuffle(self.permutation)
        self.position = 0

    def take(self, count: int) -> list[int]:
        """The next ``count`` row indices."""
        out: list[int] = []
        while len(out) < count:
            if self.position == len(self.permutation):
                self._shuffle()
                self.epochs += 1
            chunk = self.permutation[self.position : self.position + count - len(out)]
            out += chunk
            self.position += len(chunk)
        return out

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.epoch_rng
        return {
            "rows": self.n_rows,
            "epochs": self.epochs,
            "position": self.position,
            "epoch_rng": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: Mapping[str, Any], *, checkpoint: str) -> None:
        """Continue from ``state``.

        Raises:
            DataSourceError: when the dataset has another number of rows than the
                checkpoint's (its positions would point at other rows), naming ``--dataset``.
            CheckpointError: a state that does not read.
        """
        try:
            rows, epochs, position = (int(state[k]) for k in ("rows", "epochs", "position"))
            version, internal, gauss = state["epoch_rng"]
            self.rng.setstate((version, tuple(internal), gauss))
        except (KeyError, TypeError, ValueError) as exc:
            from rlhf.learner.checkpoint import CheckpointError

            raise CheckpointError(
                f"{checkpoint}/trainer_state.json: its data order does not read: {exc!r}"
            ) from None
        if rows != self.n_rows:
            raise DataSourceError(
                f"--ckpt.load_enable: --dataset has {self.n_rows} rows but {checkpoint} was "
                f"written for {rows}: resume with the same data, or start a new --run_dir"
            )
        self.epoch_rng = self.rng.getstate()
        self.epochs = epochs
        self.permutation, self.position = [], 0
        if self.epochs:
            self._shuffle()  # the same permutation; the RNG ends where the run's did
            self.position = position


def rows_crc32(rows: Sequence[int]) -> int:
    """A step's row indices as one number (``data/rows_crc32``: which rows made the step)."""
    return zlib.crc32(json.dumps(list(rows)).encode())
