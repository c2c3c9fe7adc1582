"""``rlhf train sft``: supervised fine-tuning on prompt/response or chat rows."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlhf.cli.backends import backend_factory, role_problems
from rlhf.cli.config import ConfigError, PlanConfig, RayConfig, RoleConfig, absolute_path
from rlhf.cli.data import read_rows
from rlhf.cli.metrics import MetricsLog


@dataclass(frozen=True)
class SFTConfig:
    """``rlhf train sft``.

    Attributes:
        run_dir: Where metrics, the resolved config and the exported model go.
        dataset: A .json/.jsonl/.parquet file or saved HF dataset.
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
        seed: Shuffling and initialisation seed.
        model: The model to train (``--model.model.path``) and its optimizer/engine.
        ray: The Ray cluster (a local one, or one to join: ``--ray.address``).
        dry_run: Print the capacity plan from the model's config.json alone and exit (0 when
            it fits, 1 when not; `rlhf.cli.dry_run`); ``--dataset`` is not needed then.
        plan: The machines the capacity plan is for.
    """

    run_dir: str = "runs/sft"
    dataset: str = ""
    input_key: str = "input"
    output_key: str = "output"
    messages_key: str | None = None
    input_template: str | None = None
    pretrain: bool = False
    max_len: int = 1024
    batch_size: int = 32
    micro_batch_size: int = 8
    num_steps: int = 100
    seed: int = 42
    model: RoleConfig = field(default_factory=RoleConfig)
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
        if self.batch_size < 1 or self.micro_batch_size < 1 or self.num_steps < 1:
            raise ConfigError("--batch_size, --micro_batch_size and --num_steps must be >= 1")
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


def run_sft(config: SFTConfig, *, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Train, export ``run_dir/final``; returns the first and last losses."""
    from transformers import AutoTokenizer

    from rlhf.cli.cluster import start_ray
    from rlhf.cli.placement import record_placement, role_strategies
    from rlhf.learner import LearnerGroup, SFTObjective, collate, sft_row

    config = config.validate()
    run_dir = pathlib.Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=1))
    tokenizer = AutoTokenizer.from_pretrained(config.model.model.path)
    rows = [
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
        for i, row in enumerate(read_rows(config.dataset))
    ]
    gpu = start_ray(address=config.ray.address).gpu
    role = config.model
    group = LearnerGroup(
        num_ranks=role.num_ranks,
        num_cpus_per_rank=role.num_cpus_per_rank,
        num_gpus_per_rank=role.num_gpus_per_rank if gpu else 0.0,
        scheduling=role_strategies(role, flag="--model.node"),
    )
    log = MetricsLog(run_dir / "metrics.jsonl")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    order: list[int] = []
    rng = random.Random(config.seed)
    losses = []
    try:
        group.build(
            role.learner(seed=config.seed, total_steps=config.num_steps),
            backend=backend_factory(role),
        )
        record_placement(group, role, run_dir / "placement.json")
        for step in range(1, config.num_steps + 1):
            while len(order) < config.batch_size:
                epoch = list(range(len(rows)))
                rng.shuffle(epoch)
                order += epoch
            picked, order = order[: config.batch_size], order[config.batch_size :]
            batch = collate(
                [rows[i].input_ids for i in picked],
                pad_token_id=pad,
                per_token={"loss_mask": [rows[i].loss_mask for i in picked]},
            )
            objective = SFTObjective(normalizer=float(batch["loss_mask"].sum()))
            out = group.train_step(batch, objective, max_rows=config.micro_batch_size)
            losses.append(out["loss"])
            log.write({"step": step, "sft/loss": out["loss"], "lr": out["lr"]})
            if step == 1 or step % 50 == 0 or step == config.num_steps:
                echo(f"[sft] step {step} loss {out['loss']:.4f}")
        group.export_hf(str(run_dir / "final"))
        tokenizer.save_pretrained(run_dir / "final")
    finally:
        group.shutdown()
    return {"first_loss": losses[0], "last_loss": losses[-1], "model": str(run_dir / "final")}
