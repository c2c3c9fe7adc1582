"""``rlhf train sft``: supervised fine-tuning on prompt/response or chat rows.

Checkpoints and ``--ckpt.load_enable`` resume exactly (same rows, same optimizer schedule;
`rlhf.cli.trainer_state`); metrics go to ``run_dir/metrics.jsonl`` and, on request, TensorBoard
and W&B.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlhf.cli.backends import role_problems
from rlhf.cli.config import ConfigError, absolute_path
from rlhf.cli.metrics import Progress
from rlhf.cli.sections import CkptConfig, LoggingConfig, PlanConfig, RayConfig, RoleConfig
from rlhf.cli.trainer_state import (
    SHAPE,
    open_trainer_run,
    open_trainer_sinks,
    resume_learner,
    save_step,
    saves_at,
    start_trainer_learner,
    steps_of_epochs,
    training_rows,
)
from rlhf.learner.datasets import RowOrder, read_rows, rows_crc32


@dataclass(frozen=True)
class SFTConfig(LoggingConfig):
    """``rlhf train sft``.

    Attributes:
        run_dir: Where metrics, the resolved config and the exported model go.
        dataset: A .json/.jsonl/.parquet file or saved HF dataset; several comma-separated.
        dataset_probs: Blend weights of several comma-separated ``dataset`` sources, one
            each (`rlhf.learner.datasets.dataset_rows`); empty: the sources one after another.
        chat_template: A Jinja chat template that replaces the tokenizer's (OpenRLHF's
            ``--data.tokenizer_chat_template``); the exported model's tokenizer carries it.
        eval_dataset: Held-out rows (read like ``dataset``): their token-mean NLL,
            ``sft/eval_loss``, before training, every ``eval_steps`` and at the end.
        eval_steps: Also evaluate every this many steps (OpenRLHF's ``--eval.steps``); 0:
            before training and at the end only.
        input_key: Prompt field (single turn).
        output_key: Response field (single turn).
        messages_key: Chat field (multi turn: every assistant turn is learned); overrides
            input/output keys.
        input_template: Format string for the prompt when there is no chat template.
        pretrain: Learn every token of ``input_key`` (no prompt masking).
        max_len: Truncate rows to this many tokens.
        batch_size: Rows per optimizer step.
        micro_batch_size: Rows per forward/backward.
        num_steps: Optimizer steps (rows are reshuffled every epoch).
        max_samples: Use at most this many rows of the dataset (OpenRLHF's
            ``--data.max_samples``); None: all.
        num_epochs: Passes over the dataset (OpenRLHF's ``--train.max_epochs``); > 0 sets
            ``num_steps`` to ``ceil(num_epochs · rows / batch_size)``.
        seed: Shuffling and initialisation seed.
        model: The model to train (``--model.model.path``) and its optimizer/engine.
        ckpt: Checkpoints under ``run_dir/checkpoints`` (``--ckpt.save_steps``, always after
            the last step), ``--ckpt.load_enable`` to resume from the newest one,
            ``--ckpt.keep``, ``--ckpt.export_hf``.
        ray: The Ray cluster (a local one, or one to join: ``--ray.address``).
        dry_run: Print the capacity plan from the model's config.json alone and exit (0 when
            it fits, 1 when not; `rlhf.cli.dry_run`); ``--dataset`` is not needed then.
        plan: The machines the capacity plan is for.
    """

    run_dir: str = "runs/sft"
    dataset: str = ""
    dataset_probs: tuple[float, ...] = ()
    chat_template: str | None = None
    eval_dataset: str = ""
    eval_steps: int = 0
    input_key: str = "input"
    output_key: str = "output"
    messages_key: str | None = None
    input_template: str | None = None
    pretrain: bool = False
    max_len: int = 1024
    batch_size: int = 32
    micro_batch_size: int = 8
    num_steps: int = 100
    num_epochs: int = 0
    max_samples: int | None = None
    seed: int = 42
    model: RoleConfig = field(default_factory=RoleConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    dry_run: bool = False
    plan: PlanConfig = field(default_factory=PlanConfig)

    def validate(self) -> SFTConfig:
        if not self.model.model.path:
            raise ConfigError("--model.model.path is required")
        if not self.dataset and not self.dry_run:
            raise ConfigError("--dataset is required")
        if self.plan.problems():
            raise ConfigError("; ".join(self.plan.problems()))
        if self.num_epochs < 0:
            raise ConfigError(f"--num_epochs must be >= 0, got {self.num_epochs}")
        if self.eval_steps < 0:
            raise ConfigError(f"--eval_steps must be >= 0, got {self.eval_steps}")
        if self.batch_size < 1 or self.micro_batch_size < 1 or self.num_steps < 1:
            raise ConfigError("--batch_size, --micro_batch_size and --num_steps must be >= 1")
        if self.ckpt.save_steps < 0:
            raise ConfigError(f"--ckpt.save_steps must be >= 0, got {self.ckpt.save_steps}")
        problems = role_problems(self.model, flag="model")
        if problems:
            raise ConfigError("; ".join(problems))
        return dataclasses.replace(
            self,
            run_dir=str(pathlib.Path(self.run_dir).resolve()),
            model=self.model.with_model(path=absolute_path(self.model.model.path)),
        )

    @property
    def micro_batch_tokens(self) -> int:
        """Tokens of one micro-batch at full length (the capacity plan's activations)."""
        return self.micro_batch_size * self.max_len

    @property
    def shape(self) -> dict[str, int]:
        """What a checkpoint records and a resume keeps (`rlhf.cli.trainer_state.SHAPE`)."""
        return {flag: int(getattr(self, flag)) for flag in SHAPE}


def run_sft(config: SFTConfig, *, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Train, export ``run_dir/final``; returns the first and last losses of this process's
    steps. With ``--ckpt.load_enable`` the newest checkpoint is checked before anything
    starts and the run continues from it."""
    from rlhf.cli.warm import release_group
    from rlhf.learner import (
        MicroBatching,
        SFTObjective,
        collate,
        per_sequence,
        sequence_logps,
        sft_row,
    )

    config = config.validate()
    config = dataclasses.replace(config, num_steps=steps_of_epochs(config, echo=echo), num_epochs=0)
    run = open_trainer_run(config, command="sft", resolved=dataclasses.asdict(config), echo=echo)
    run_dir, resume, tokenizer = run.run_dir, run.resume, run.tokenizer

    def tokenized(source: list[dict[str, Any]]) -> list[Any]:
        return [
            sft_row(
                row,
                i,
                tokenizer,
                input_key=config.input_key,
                output_key=config.output_key,
                messages_key=config.messages_key,
                input_template=config.input_template,
                pretrain=config.pretrain,
                max_len=config.max_len,
            )
            for i, row in enumerate(source)
        ]

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows = tokenized(training_rows(config))
    held = None
    if config.eval_dataset:
        held_rows = tokenized(read_rows(config.eval_dataset)[: config.max_samples])
        if not held_rows:
            raise ConfigError(f"--eval_dataset {config.eval_dataset}: it has no rows")
        held = collate(
            [r.input_ids for r in held_rows],
            pad_token_id=pad,
            per_token={"loss_mask": [r.loss_mask for r in held_rows]},
        )
    micro = MicroBatching(max_rows=config.micro_batch_size)

    def eval_loss() -> float:
        """The held-out rows' token-mean NLL under the current weights."""
        assert held is not None
        assert group is not None
        logps = per_sequence(group, held, sequence_logps, micro)
        return float(-logps.sum() / held["loss_mask"].sum())

    order = RowOrder(len(rows), seed=config.seed)
    if resume is not None:
        order.load_state_dict(resume.state["data"], checkpoint=resume.path.name)
    log = open_trainer_sinks(
        config, run_dir=run_dir, run_config=run.resolved, resume=resume is not None
    )
    role = config.model
    group, key, finished = None, None, False
    losses, evals = [], []
    try:
        group, key = start_trainer_learner(
            role,
            role.learner(seed=config.seed, total_steps=config.num_steps),
            ray=config.ray,
            run_dir=run_dir,
            label="SFT",
            echo=echo,
        )
        start = resume_learner(group, resume, echo=echo)
        if held is not None:  # before this process's first step
            evals.append(eval_loss())
            log.write({"step": start, "sft/eval_loss": evals[-1]})
        progress = Progress(total=config.num_steps, start=start, echo=echo)
        for step in range(start + 1, config.num_steps + 1):
            picked = order.take(config.batch_size)
            batch = collate(
                [rows[i].input_ids for i in picked],
                pad_token_id=pad,
                per_token={"loss_mask": [rows[i].loss_mask for i in picked]},
            )
            objective = SFTObjective(normalizer=float(batch["loss_mask"].sum()))
            out = group.train_step(batch, objective, max_rows=config.micro_batch_size)
            losses.append(out["loss"])
            evaluated = {}
            if held is not None and (
                step == config.num_steps or (config.eval_steps and step % config.eval_steps == 0)
            ):
                evals.append(eval_loss())
                evaluated = {"sft/eval_loss": evals[-1]}
            log.write(
                {
                    "step": step,
                    "sft/loss": out["loss"],
                    **evaluated,
                    "lr": out["lr"],
                    "data/rows_crc32": rows_crc32(picked),
                }
            )
            progress.show(step, {}, prefix="[sft] ", suffix=f" | loss {out['loss']:.4f}")
            if saves_at(step, ckpt=config.ckpt, num_steps=config.num_steps):
                save_step(group, command="sft", step=step, config=config, order=order,
                          tokenizer=tokenizer, run_dir=run_dir, echo=echo)  # fmt: skip
        if evals:
            echo(f"[sft] held-out loss {evals[0]:.4f} -> {evals[-1]:.4f}")
        if config.ckpt.export_hf:
            group.export_hf(str(run_dir / "final"))
            tokenizer.save_pretrained(run_dir / "final")
        finished = True
    finally:
        log.close()
        if group is not None:
            release_group(group, key, keep=finished)  # a later run may take it over
    out = {"first_loss": losses[0], "last_loss": losses[-1], "model": str(run_dir / "final")}
    if evals:
        out |= {"eval_loss_start": evals[0], "eval_loss_end": evals[-1]}
    return out
