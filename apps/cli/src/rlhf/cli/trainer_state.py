"""Checkpoints, exact resume and metric sinks of ``rlhf train sft|rm|dpo``.

A checkpoint is `rlhf.learner`'s (``run_dir/checkpoints/step-XXXXXXXX/``, written into a
staging directory and renamed into place whole, ``COMPLETE`` last): the learner's states as
`LearnerGroup.save` writes them (model, optimizer, scheduler, each rank's RNG) and the run's
own in ``trainer_state.json`` (`trainer_state`): the step, the command, the batch shape and
the data order (`RowOrder`), so a resumed run trains on exactly the rows the uninterrupted run
would have.

`check_resume` picks the checkpoint and reads its ``trainer_state.json`` before anything starts
(no tokenizer, no Ray) with the RL command's rules (`rlhf.cli.resume`: ``--ckpt.load_enable
True|auto``, damaged checkpoints, ``--ckpt.allow_config_change``) and refuses, naming the flag,
a run that is done already or whose batch shape differs.
"""

from __future__ import annotations

import json
import pathlib
import random
import shutil
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from rlhf.cli.config import ConfigError
from rlhf.cli.metrics import Sinks, open_sinks
from rlhf.cli.resume import ResumePoint, resume_point
from rlhf.cli.sections import CkptConfig, LoggingConfig
from rlhf.learner import CheckpointError

SHAPE = ("batch_size",)


class _Epochs(Protocol):
    @property
    def dataset(self) -> str: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def num_epochs(self) -> int: ...
    @property
    def num_steps(self) -> int: ...
    @property
    def max_samples(self) -> int | None: ...
    @property
    def dataset_probs(self) -> tuple[float, ...]: ...
    @property
    def seed(self) -> int: ...


def training_rows(config: _Epochs) -> list[dict[str, Any]]:
    """The rows a trainer learns from: ``--dataset`` (blended by ``--dataset_probs``), cut
    at ``--max_samples`` (`rlhf.learner.datasets.dataset_rows`)."""
    from rlhf.learner.datasets import DataSourceError, dataset_rows

    rows = dataset_rows(
        config.dataset,
        probs=config.dataset_probs,
        seed=config.seed,
        max_samples=config.max_samples,
    )
    if not rows:
        cut = f" (cut at --max_samples {config.max_samples})" if config.max_samples == 0 else ""
        raise DataSourceError(f"--dataset {config.dataset} has no rows to train on{cut}")
    return rows


def steps_of_epochs(config: _Epochs, *, echo: Any = print) -> int:
    """``--num_steps``, or with ``--num_epochs E`` (OpenRLHF's ``--train.max_epochs``)
    ``ceil(E · rows / batch_size)`` over the dataset's rows (pairs for rm/dpo); the plan line
    says which."""
    if not config.num_epochs:
        return config.num_steps
    rows = len(training_rows(config))
    steps = max(1, -(-config.num_epochs * rows // config.batch_size))
    echo(
        f"[plan] --num_epochs {config.num_epochs}: {rows} rows / --batch_size "
        f"{config.batch_size} -> {steps} steps"
    )
    return steps


"""The flags a checkpoint records (``trainer_state.json``'s ``shape``) and a resume must keep:
``batch_size`` sets which rows make a step and what the optimizer schedule counts.
``micro_batch_size`` is left out: the losses are normalised over the whole step, so it splits
the same sums differently (float rounding only) and may change on resume (e.g. after running
out of memory)."""


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
            raise ConfigError("--dataset has no rows to train on")
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
            ConfigError: when the dataset has another number of rows than the checkpoint's
                (its positions would point at other rows), naming ``--dataset``.
            CheckpointError: a state that does not read.
        """
        try:
            rows, epochs, position = (int(state[k]) for k in ("rows", "epochs", "position"))
            version, internal, gauss = state["epoch_rng"]
            self.rng.setstate((version, tuple(internal), gauss))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"{checkpoint}/trainer_state.json: its data order does not read: {exc!r}"
            ) from None
        if rows != self.n_rows:
            raise ConfigError(
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


def check_resume(
    root: pathlib.Path,
    *,
    command: str,
    num_steps: int,
    shape: Mapping[str, int],
    ckpt: CkptConfig,
) -> tuple[ResumePoint | None, str]:
    """The checkpoint ``--ckpt.load_enable`` resumes from (None: a new run) and one line for
    the console saying where the run starts: `rlhf.cli.resume.resume_point` with this
    command's flags (``--num_steps``; the checkpoint must be this command's)."""
    return resume_point(
        root, ckpt=ckpt, num_steps=num_steps, steps_flag="--num_steps", shape=shape,
        command=command,
    )  # fmt: skip


def trainer_state(
    *, command: str, step: int, shape: Mapping[str, int], order: RowOrder
) -> dict[str, Any]:
    """What a checkpoint of ``step`` records besides the learner's states."""
    return {"step": step, "command": command, "shape": dict(shape), "data": order.state_dict()}


def saves_at(step: int, *, ckpt: CkptConfig, num_steps: int) -> bool:
    """Whether the run checkpoints after ``step`` (1-based): every ``--ckpt.save_steps`` and
    after the last step, as the RL command does."""
    return bool(ckpt.save_steps and step % ckpt.save_steps == 0) or step == num_steps


def save_step(
    group: Any,
    *,
    command: str,
    step: int,
    config: Any,
    order: RowOrder,
    tokenizer: Any,
    run_dir: pathlib.Path,
    echo: Callable[[str], None],
) -> None:
    """What ``rlhf train sft|rm|dpo`` saves after ``step``: the resumable checkpoint under
    ``run_dir/checkpoints`` (``--ckpt.save_state``) and the HF export with the tokenizer
    (``--ckpt.save_hf``), the ``--ckpt.keep`` newest of each kept."""
    keep = config.ckpt.keep
    if config.ckpt.save_state:
        state = trainer_state(command=command, step=step, shape=config.shape, order=order)
        path = group.save(str(run_dir / "checkpoints"), step, client_state=state, keep=keep)
        echo(f"[ckpt] {path}")
    if config.ckpt.save_hf:
        path = save_hf_at(group.export_hf, run_dir=run_dir, step=step, keep=keep)
        tokenizer.save_pretrained(path)
        echo(f"[ckpt] {path}")


HF_SAVES = "hf_checkpoints"
"""Where ``--ckpt.save_hf`` exports go under the run directory."""


def save_hf_at(
    export: Callable[[str], None], *, run_dir: pathlib.Path, step: int, keep: int
) -> pathlib.Path:
    """``--ckpt.save_hf``: ``export(directory)`` (an atomic transformers export) to
    ``run_dir/hf_checkpoints/step_<step>``, keeping the ``keep`` newest (0: all)."""
    root = run_dir / HF_SAVES
    path = root / f"step_{step}"
    export(str(path))
    if keep > 0:
        saved = [p for p in root.glob("step_*") if p.name.removeprefix("step_").isdigit()]
        saved.sort(key=lambda p: int(p.name.removeprefix("step_")))
        for old in saved[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def open_trainer_sinks(
    flags: LoggingConfig, *, run_dir: pathlib.Path, run_config: Mapping[str, Any], resume: bool
) -> Sinks:
    """`rlhf.cli.metrics.open_sinks` for a trainer config (its logging flags at the top
    level): the same sinks, and errors that name ``--use_tensorboard`` / ``--use_wandb``."""
    try:
        return open_sinks(flags, run_dir=run_dir, run_config=run_config, resume=resume)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("--train.use_", "--use_")) from None
