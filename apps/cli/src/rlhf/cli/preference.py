"""``rlhf train rm`` and ``rlhf train dpo``: learning from preference pairs.

Rows are ``{prompt_key, chosen_key, rejected_key}``. A step takes ``batch_size`` pairs; each
micro-batch holds whole pairs (chosen rows, then rejected rows). The reward model is a
``scalar`` role (one score at the last real token) and exports as a transformers checkpoint that
``--train.reward_model_path`` scores with, or ``--critic.model.path`` starts a critic from. DPO's
reference log-probs come from the initial model, computed once before training.
"""

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
class PreferenceConfig:
    """``rlhf train rm`` / ``rlhf train dpo``.

    Attributes:
        run_dir: Where metrics, the resolved config and the exported model go.
        dataset: Preference rows (.json/.jsonl/.parquet or a saved HF dataset).
        eval_dataset: Held-out pairs for ``*/eval_accuracy`` (optional).
        prompt_key: Prompt field.
        chosen_key: Preferred response field.
        rejected_key: Dispreferred response field.
        input_template: Format string for the prompt when there is no chat template.
        max_len: Truncate each side to this many tokens.
        batch_size: Pairs per optimizer step.
        micro_batch_size: Pairs per forward/backward.
        num_steps: Optimizer steps.
        beta: DPO's β.
        loss_type: RM: sigmoid or log_exp; DPO: sigmoid (dpo) or ipo.
        label_smoothing: cDPO's ε.
        seed: Shuffling and initialisation seed.
        model: The model (``--model.model.path``) and its optimizer/engine.
        ray: The Ray cluster (a local one, or one to join: ``--ray.address``).
        dry_run: Print the capacity plan from the model's config.json alone and exit (0 when
            it fits, 1 when not; `rlhf.cli.dry_run`); ``--dataset`` is not needed then.
        plan: The machines the capacity plan is for.
    """

    run_dir: str = "runs/pref"
    dataset: str = ""
    eval_dataset: str = ""
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    input_template: str | None = None
    max_len: int = 1024
    batch_size: int = 16
    micro_batch_size: int = 8
    num_steps: int = 100
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    seed: int = 42
    model: RoleConfig = field(default_factory=RoleConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    dry_run: bool = False
    plan: PlanConfig = field(default_factory=PlanConfig)

    def validate(self) -> PreferenceConfig:
        if not self.model.model.path:
            raise ConfigError("--model.model.path is required")
        if not self.dataset and not self.dry_run:
            raise ConfigError("--dataset is required")
        if self.plan.problems():
            raise ConfigError("; ".join(self.plan.problems()))
        if min(self.batch_size, self.micro_batch_size, self.num_steps) < 1:
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
        return 2 * self.micro_batch_size * self.max_len


def _pairs(path: str, config: PreferenceConfig, tokenizer: Any) -> list[tuple[Any, Any]]:
    from rlhf.learner import preference_row

    return [
        preference_row(
            row,
            i,
            tokenizer,
            prompt_key=config.prompt_key,
            chosen_key=config.chosen_key,
            rejected_key=config.rejected_key,
            input_template=config.input_template,
            max_len=config.max_len,
        )
        for i, row in enumerate(read_rows(path))
    ]


def _batch(pairs: list[tuple[Any, Any]], pad: int) -> Any:
    from rlhf.learner import collate

    rows = [c for c, _ in pairs] + [r for _, r in pairs]
    return collate(
        [r.input_ids for r in rows],
        pad_token_id=pad,
        per_token={"loss_mask": [r.loss_mask for r in rows]},
    )


def _pair_chunks(batch: Any, pairs_per_micro: int) -> list[Any]:
    """Micro-batches of whole pairs: rows ``i`` and ``n + i`` stay together, chosen first."""
    n = batch.size // 2
    chunks = []
    for s in range(0, n, pairs_per_micro):
        pairs = range(s, min(s + pairs_per_micro, n))
        chunks.append(batch.select([*pairs, *(n + i for i in pairs)]))
    return chunks


def run_preference(
    config: PreferenceConfig, *, kind: str, echo: Callable[[str], None] = print
) -> dict[str, Any]:
    """Train a reward model (``kind="rm"``) or a DPO policy (``kind="dpo"``); export it to
    ``run_dir/final``. Returns held-out pair accuracy before and after when an eval set is
    given (RM: chosen scored higher; DPO: chosen's implicit reward higher)."""
    from transformers import AutoTokenizer

    from rlhf.cli.cluster import start_ray
    from rlhf.cli.placement import record_placement, role_strategies
    from rlhf.learner import (
        DPOObjective,
        LearnerGroup,
        MicroBatching,
        RewardModelObjective,
        per_sequence,
        sequence_logps,
        sequence_scores_of,
    )

    if kind not in ("rm", "dpo"):
        raise ValueError(f"kind must be rm or dpo, got {kind!r}")
    config = config.validate()
    run_dir = pathlib.Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = {"kind": kind, **dataclasses.asdict(config)}
    (run_dir / "config.json").write_text(json.dumps(resolved, indent=1))
    tokenizer = AutoTokenizer.from_pretrained(config.model.model.path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train = _batch(_pairs(config.dataset, config, tokenizer), pad)
    held = (
        _batch(_pairs(config.eval_dataset, config, tokenizer), pad) if config.eval_dataset else None
    )
    gpu = start_ray(address=config.ray.address).gpu
    role = config.model
    group = LearnerGroup(
        num_ranks=role.num_ranks,
        num_cpus_per_rank=role.num_cpus_per_rank,
        num_gpus_per_rank=role.num_gpus_per_rank if gpu else 0.0,
        scheduling=role_strategies(role, flag="--model.node"),
    )
    micro = MicroBatching(max_rows=2 * config.micro_batch_size)
    fn = sequence_scores_of if kind == "rm" else sequence_logps
    log = MetricsLog(run_dir / "metrics.jsonl")
    rng = random.Random(config.seed)
    n_train = train.size // 2
    order: list[int] = []
    result: dict[str, Any] = {}
    try:
        learner = role.with_model(kind="scalar" if kind == "rm" else "causal_lm").learner(
            seed=config.seed, total_steps=config.num_steps
        )
        group.build(learner, backend=backend_factory(role))
        record_placement(group, role, run_dir / "placement.json")
        if kind == "dpo":  # the reference is the initial policy: its log-probs, once
            train.fields["ref_logps"] = per_sequence(group, train, sequence_logps, micro)
            if held is not None:
                held.fields["ref_logps"] = per_sequence(group, held, sequence_logps, micro)

        def accuracy() -> float:
            assert held is not None
            values = per_sequence(group, held, fn, micro)
            if kind == "dpo":
                values = values - held["ref_logps"]
            n = held.size // 2
            return float((values[:n] > values[n:]).float().mean())

        if held is not None:
            result["eval_accuracy_start"] = accuracy()
        for step in range(1, config.num_steps + 1):
            while len(order) < config.batch_size:
                epoch = list(range(n_train))
                rng.shuffle(epoch)
                order += epoch
            picked, order = order[: config.batch_size], order[config.batch_size :]
            batch = train.select([*picked, *(n_train + i for i in picked)])
            objective = (
                RewardModelObjective(normalizer=float(len(picked)), loss_type=config.loss_type)
                if kind == "rm"
                else DPOObjective(
                    normalizer=float(len(picked)),
                    beta=config.beta,
                    loss_type=config.loss_type,
                    label_smoothing=config.label_smoothing,
                )
            )
            out = group.train_micro_batches(_pair_chunks(batch, config.micro_batch_size), objective)
            log.write(
                {"step": step, **{k if "/" in k else f"{kind}/{k}": v for k, v in out.items()}}
            )
            if step == 1 or step % 50 == 0 or step == config.num_steps:
                echo(f"[{kind}] step {step} loss {out['loss']:.4f}")
        if held is not None:
            result["eval_accuracy_end"] = accuracy()
            log.write(
                {"step": config.num_steps, f"{kind}/eval_accuracy": result["eval_accuracy_end"]}
            )
            echo(
                f"[{kind}] held-out pair accuracy {result['eval_accuracy_start']:.3f} -> "
                f"{result['eval_accuracy_end']:.3f}"
            )
        group.export_hf(str(run_dir / "final"))
        tokenizer.save_pretrained(run_dir / "final")
    finally:
        group.shutdown()
    return {**result, "model": str(run_dir / "final")}
