"""Checkpoints, exact resume and metric sinks of ``rlhf train sft|rm|dpo``.

A checkpoint is `rlhf.learner`'s (``run_dir/checkpoints/step-XXXXXXXX/``, written into a
staging directory and renamed into place whole, ``COMPLETE`` last): the learner's states as
`LearnerGroup.save` writes them (model, optimizer, scheduler, each rank's RNG) and the run's
own in ``trainer_state.json`` (`trainer_state`): the step, the command, the batch shape and
the data order (`rlhf.learner.datasets.RowOrder`), so a resumed run trains on exactly the
rows the uninterrupted run would have.

`check_resume` picks the checkpoint and reads its ``trainer_state.json`` before anything starts
(no tokenizer, no Ray) with the RL command's rules (`rlhf.cli.resume`: ``--ckpt.load_enable
True|auto``, damaged checkpoints, ``--ckpt.allow_config_change``) and refuses, naming the flag,
a run that is done already or whose batch shape differs.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rlhf.cli.config import ConfigError
from rlhf.cli.metrics import Sinks, open_sinks
from rlhf.cli.resume import ResumePoint, resume_point
from rlhf.cli.sections import CkptConfig, LoggingConfig, RayConfig, RoleConfig
from rlhf.learner.datasets import RowOrder

if TYPE_CHECKING:
    from rlhf.learner import LearnerConfig, LearnerGroup

SHAPE = ("batch_size",)
"""The flags a checkpoint records (``trainer_state.json``'s ``shape``) and a resume must keep:
``batch_size`` sets which rows make a step and what the optimizer schedule counts.
``micro_batch_size`` is left out: the losses are normalised over the whole step, so it splits
the same sums differently (float rounding only) and may change on resume (e.g. after running
out of memory)."""


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


class _Trainer(Protocol):
    """What `open_trainer_run` reads of an SFT or preference config."""

    @property
    def run_dir(self) -> str: ...
    @property
    def num_steps(self) -> int: ...
    @property
    def shape(self) -> dict[str, int]: ...
    @property
    def ckpt(self) -> CkptConfig: ...
    @property
    def chat_template(self) -> str | None: ...
    @property
    def model(self) -> RoleConfig: ...


@dataclass(frozen=True)
class TrainerRun:
    """A trainer command's run before its learner starts.

    Attributes:
        run_dir: ``--run_dir``, created.
        resume: The checkpoint it continues from (``--ckpt.load_enable``), or None.
        resolved: The config written to ``run_dir/config.json``.
        tokenizer: The model's tokenizer (``--chat_template`` applied).
    """

    run_dir: pathlib.Path
    resume: ResumePoint | None
    resolved: dict[str, Any]
    tokenizer: Any


def open_trainer_run(
    config: _Trainer,
    *,
    command: str,
    resolved: Mapping[str, Any],
    echo: Callable[[str], None],
) -> TrainerRun:
    """Before anything starts: the checkpoint to resume from checked (`check_resume`, the
    plan line echoed), the run directory made with ``resolved`` in its ``config.json``, and
    the tokenizer loaded."""
    from transformers import AutoTokenizer

    run_dir = pathlib.Path(config.run_dir)
    resume = None
    if config.ckpt.load_enable:
        resume, line = check_resume(
            run_dir / "checkpoints",
            command=command,
            num_steps=config.num_steps,
            shape=config.shape,
            ckpt=config.ckpt,
        )
        echo(f"[plan] resume: {line}")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dict(resolved), indent=1))
    tokenizer = AutoTokenizer.from_pretrained(config.model.model.path)
    if config.chat_template is not None:
        tokenizer.chat_template = config.chat_template
    return TrainerRun(run_dir, resume, dict(resolved), tokenizer)


def start_trainer_learner(
    role: RoleConfig,
    learner: LearnerConfig,
    *,
    ray: RayConfig,
    run_dir: pathlib.Path,
    label: str,
    echo: Callable[[str], None],
) -> tuple[LearnerGroup, str | None]:
    """Ray started (or joined), and the trainer's one learner group (``--model.*``) built
    from ``learner`` on its ranks, or taken over from an earlier run of this process
    (`rlhf.cli.warm`); returns the group and its key for `rlhf.cli.warm.release_group`."""
    from rlhf.cli.backends import backend_factory, compute_threads, rank_env
    from rlhf.cli.cluster import start_ray
    from rlhf.cli.placement import record_placement, role_strategies
    from rlhf.cli.roles import rank_group
    from rlhf.cli.warm import warm_roles

    gpu = start_ray(address=ray.address).gpu
    warm = warm_roles()
    plural = "s" * (role.num_ranks > 1)
    echo(f"[startup] starting the {label} learner ({role.num_ranks} rank{plural})…")
    began = time.perf_counter()
    group, key = rank_group(
        role,
        gpus=role.num_gpus_per_rank if gpu else 0.0,
        env=rank_env(role, gpu=gpu),
        scheduling=role_strategies(role, flag="--model.node"),
        warm=warm,
    )
    if warm is not None:
        warm.stop_unclaimed()
    group.compute_threads = compute_threads(num_ranks=role.num_ranks, gpu=gpu, beside_engines=False)
    group.build(learner, backend=backend_factory(role))
    record_placement(group, role, run_dir / "placement.json")
    echo(f"[startup] learner ready after {time.perf_counter() - began:.1f} s")
    return group, key


def resume_learner(
    group: LearnerGroup, resume: ResumePoint | None, *, echo: Callable[[str], None]
) -> int:
    """The checkpoint ``resume`` loaded into ``group``; the step it reached (0: none)."""
    if resume is None:
        return 0
    group.load(str(resume.path))
    echo(f"[resume] from {resume.path} at step {resume.step}")
    return resume.step
