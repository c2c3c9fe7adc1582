"""``rlhf train rm`` and ``rlhf train dpo``: learning from preference pairs.

Rows are ``{prompt_key, chosen_key, rejected_key}``. A step takes ``batch_size`` pairs; each
micro-batch holds whole pairs (chosen rows, then rejected rows). The reward model is a
``scalar`` role (one score at the last real token) and exports as a transformers checkpoint that
``--train.reward_model_path`` scores with, or ``--critic.model.path`` starts a critic from. DPO's
reference log-probs come from the initial model, computed once before training (a resumed
run computes them before it loads its checkpoint, so they stay the initial model's).

Loss options (`rlhf.algos.preference`): RM ``--loss_type`` sigmoid/log_exp with a per-pair
margin from ``--margin_key``; DPO ``--loss_type`` sigmoid (DPO, arXiv 2305.18290) with cDPO's
``--label_smoothing`` or ipo (arXiv 2310.12036), ``--beta``, and an NLL term on the chosen
responses (``--nll_loss_coef``, OpenRLHF's name). Checkpoints and ``--ckpt.load_enable``
resume exactly (`rlhf.cli.trainer_state`); metrics also go to TensorBoard and W&B on request.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
from rlhf.learner.preference import (
    pair_accuracy,
    pair_micro_batches,
    preference_batch,
    select_pairs,
)

if TYPE_CHECKING:
    from rlhf.learner import Batch, Objective


@dataclass(frozen=True)
class PreferenceConfig(LoggingConfig):
    """``rlhf train rm`` / ``rlhf train dpo``.

    Attributes:
        run_dir: Where metrics, the resolved config and the exported model go.
        dataset: Preference rows (.json/.jsonl/.parquet or a saved HF dataset); several
            comma-separated.
        dataset_probs: Blend weights of several comma-separated ``dataset`` sources, one
            each (`rlhf.learner.datasets.dataset_rows`); empty: the sources one after another.
        chat_template: A Jinja chat template that replaces the tokenizer's (OpenRLHF's
            ``--data.tokenizer_chat_template``); the exported model's tokenizer carries it.
        eval_dataset: Held-out pairs for ``*/eval_accuracy`` (optional): before training,
            every ``eval_steps`` and at the end.
        eval_steps: Also evaluate every this many steps (OpenRLHF's ``--eval.steps``); 0:
            before training and at the end only.
        prompt_key: Prompt field.
        chosen_key: Preferred response field.
        rejected_key: Dispreferred response field.
        margin_key: RM only: a numeric pair field m; the loss asks the chosen reward to exceed
            the rejected one by m (−logσ(r_c − r_r − m)). Unset: m = 0. Held-out pairs need
            none.
        input_template: Format string for the prompt when there is no chat template.
        max_len: Truncate each side to this many tokens.
        batch_size: Pairs per optimizer step.
        micro_batch_size: Pairs per forward/backward.
        num_steps: Optimizer steps.
        max_samples: Use at most this many pairs of the dataset (OpenRLHF's
            ``--data.max_samples``); None: all.
        num_epochs: Passes over the dataset (OpenRLHF's ``--train.max_epochs``); > 0 sets
            ``num_steps`` to ``ceil(num_epochs · rows / batch_size)``.
        beta: DPO's β.
        loss_type: RM: sigmoid or log_exp; DPO: sigmoid (dpo) or ipo.
        label_smoothing: cDPO's ε in [0, 0.5) (DPO's sigmoid loss only).
        nll_loss_coef: DPO only: weight of the chosen responses' token-mean NLL added to each
            pair's loss (OpenRLHF's ``--nll_loss_coef``); 0: none.
        seed: Shuffling and initialisation seed.
        model: The model (``--model.model.path``) and its optimizer/engine.
        ckpt: Checkpoints under ``run_dir/checkpoints`` (``--ckpt.save_steps``, always after
            the last step), ``--ckpt.load_enable`` to resume from the newest one,
            ``--ckpt.keep``, ``--ckpt.export_hf``.
        ray: The Ray cluster (a local one, or one to join: ``--ray.address``).
        dry_run: Print the capacity plan from the model's config.json alone and exit (0 when
            it fits, 1 when not; `rlhf.cli.dry_run`); ``--dataset`` is not needed then.
        plan: The machines the capacity plan is for.
    """

    run_dir: str = "runs/pref"
    dataset: str = ""
    dataset_probs: tuple[float, ...] = ()
    chat_template: str | None = None
    eval_dataset: str = ""
    eval_steps: int = 0
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    margin_key: str | None = None
    input_template: str | None = None
    max_len: int = 1024
    batch_size: int = 16
    micro_batch_size: int = 8
    num_steps: int = 100
    num_epochs: int = 0
    max_samples: int | None = None
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    nll_loss_coef: float = 0.0
    seed: int = 42
    model: RoleConfig = field(default_factory=RoleConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
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
        if self.num_epochs < 0:
            raise ConfigError(f"--num_epochs must be >= 0, got {self.num_epochs}")
        if self.eval_steps < 0:
            raise ConfigError(f"--eval_steps must be >= 0, got {self.eval_steps}")
        if min(self.batch_size, self.micro_batch_size, self.num_steps) < 1:
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
        return 2 * self.micro_batch_size * self.max_len

    @property
    def shape(self) -> dict[str, int]:
        """What a checkpoint records and a resume keeps (`rlhf.cli.trainer_state.SHAPE`)."""
        return {flag: int(getattr(self, flag)) for flag in SHAPE}

    def loss_problems(self, kind: str) -> list[str]:
        """The loss options that do not fit ``kind`` (rm or dpo), each naming its flag."""
        from rlhf.algos import PREFERENCE_LOSSES, REWARD_MODEL_LOSSES

        losses = REWARD_MODEL_LOSSES if kind == "rm" else PREFERENCE_LOSSES
        out = []
        if self.loss_type not in losses:
            out.append(
                f"--loss_type {self.loss_type!r} is not a {kind} loss; choose one of: "
                f"{', '.join(losses.names())}"
            )
        if kind == "rm":
            unused = [
                f"--{name}"
                for name, default in (("label_smoothing", 0.0), ("nll_loss_coef", 0.0))
                if getattr(self, name) != default
            ]
            if unused:
                out.append(f"{' and '.join(unused)} apply to `rlhf train dpo` only")
            return out
        if self.margin_key is not None:
            out.append("--margin_key applies to `rlhf train rm` only (a reward margin per pair)")
        if not (math.isfinite(self.beta) and self.beta > 0):
            out.append(f"--beta must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            out.append(f"--label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        elif (
            self.label_smoothing
            and self.loss_type in losses
            and PREFERENCE_LOSSES.canonical(self.loss_type) != "sigmoid"
        ):
            out.append(
                f"--label_smoothing (cDPO) applies to --loss_type sigmoid only, not "
                f"{self.loss_type!r}; set it to 0"
            )
        if not (math.isfinite(self.nll_loss_coef) and self.nll_loss_coef >= 0):
            out.append(f"--nll_loss_coef must be >= 0, got {self.nll_loss_coef}")
        return out


def load_pairs(
    rows: list[dict[str, Any]],
    config: PreferenceConfig,
    tokenizer: Any,
    *,
    source: str,
    pad_token_id: int,
    margin_key: str | None = None,
) -> Batch:
    """`rlhf.learner.preference.preference_batch` with this command's keys and limits."""
    return preference_batch(
        rows,
        tokenizer,
        prompt_key=config.prompt_key,
        chosen_key=config.chosen_key,
        rejected_key=config.rejected_key,
        input_template=config.input_template,
        max_len=config.max_len,
        pad_token_id=pad_token_id,
        source=source,
        margin_key=margin_key,
    )


def preference_step(
    train: Batch, pairs: Sequence[int], *, config: PreferenceConfig, kind: str
) -> tuple[list[Batch], Objective]:
    """One optimizer step's work: the micro-batches of ``pairs`` (indices into ``train``, a
    `load_pairs` batch), each holding whole pairs, and the objective of ``kind``."""
    from rlhf.learner import DPOObjective, RewardModelObjective

    batch = select_pairs(train, pairs)
    objective: Objective = (
        RewardModelObjective(normalizer=float(len(pairs)), loss_type=config.loss_type)
        if kind == "rm"
        else DPOObjective(
            normalizer=float(len(pairs)),
            beta=config.beta,
            loss_type=config.loss_type,
            label_smoothing=config.label_smoothing,
            nll_coef=config.nll_loss_coef,
        )
    )
    return pair_micro_batches(batch, config.micro_batch_size), objective


def run_preference(
    config: PreferenceConfig, *, kind: str, echo: Callable[[str], None] = print
) -> dict[str, Any]:
    """Train a reward model (``kind="rm"``) or a DPO policy (``kind="dpo"``); export it to
    ``run_dir/final``. Returns held-out pair accuracy before and after when an eval set is
    given (RM: chosen scored higher; DPO: chosen's implicit reward higher). With
    ``--ckpt.load_enable`` the newest checkpoint is checked before anything starts and the
    run continues from it."""
    from rlhf.cli.warm import release_group
    from rlhf.learner import MicroBatching, per_sequence, sequence_logps

    if kind not in ("rm", "dpo"):
        raise ValueError(f"kind must be rm or dpo, got {kind!r}")
    config = config.validate()
    config = dataclasses.replace(config, num_steps=steps_of_epochs(config, echo=echo), num_epochs=0)
    problems = config.loss_problems(kind)
    if problems:
        raise ConfigError("; ".join(problems))
    resolved = {"kind": kind, **dataclasses.asdict(config)}
    run = open_trainer_run(config, command=kind, resolved=resolved, echo=echo)
    run_dir, resume, tokenizer = run.run_dir, run.resume, run.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train = load_pairs(
        training_rows(config),
        config,
        tokenizer,
        source=config.dataset,
        pad_token_id=pad,
        margin_key=config.margin_key,
    )
    held = (
        load_pairs(
            read_rows(config.eval_dataset)[: config.max_samples],
            config,
            tokenizer,
            source=config.eval_dataset,
            pad_token_id=pad,
        )
        if config.eval_dataset
        else None
    )
    n_train = train.size // 2
    order = RowOrder(n_train, seed=config.seed)
    if resume is not None:
        order.load_state_dict(resume.state["data"], checkpoint=resume.path.name)
    log = open_trainer_sinks(
        config, run_dir=run_dir, run_config=resolved, resume=resume is not None
    )
    role = config.model
    micro = MicroBatching(max_rows=2 * config.micro_batch_size)
    group, key, finished = None, None, False
    result: dict[str, Any] = {}
    try:
        learner = role.with_model(kind="scalar" if kind == "rm" else "causal_lm").learner(
            seed=config.seed, total_steps=config.num_steps
        )
        group, key = start_trainer_learner(
            role,
            learner,
            ray=config.ray,
            run_dir=run_dir,
            label="reward-model" if kind == "rm" else "DPO",
            echo=echo,
        )
        if kind == "dpo":  # the reference is the initial policy: its log-probs, once
            train.fields["ref_logps"] = per_sequence(group, train, sequence_logps, micro)
            if held is not None:
                held.fields["ref_logps"] = per_sequence(group, held, sequence_logps, micro)
        if held is not None:  # of the initial model, also when resuming
            result["eval_accuracy_start"] = pair_accuracy(group, held, kind=kind, micro=micro)
        start = resume_learner(group, resume, echo=echo)
        progress = Progress(total=config.num_steps, start=start, echo=echo)
        for step in range(start + 1, config.num_steps + 1):
            picked = order.take(config.batch_size)
            micro_batches, objective = preference_step(train, picked, config=config, kind=kind)
            out = group.train_micro_batches(micro_batches, objective)
            # ``loss`` is the step's loss; the objective's own ``<kind>/loss`` is a micro-batch
            # share averaged over micro-batches, so the step's loss takes its name.
            metrics = {k if "/" in k else f"{kind}/{k}": v for k, v in out.items() if k != "loss"}
            log.write(
                {
                    "step": step,
                    **metrics,
                    f"{kind}/loss": out["loss"],
                    "data/rows_crc32": rows_crc32(picked),
                }
            )
            progress.show(step, {}, prefix=f"[{kind}] ", suffix=f" | loss {out['loss']:.4f}")
            every = config.eval_steps
            # (the last step's evaluation is written below)
            if held is not None and every and step % every == 0 and step != config.num_steps:
                accuracy = pair_accuracy(group, held, kind=kind, micro=micro)
                log.write({"step": step, f"{kind}/eval_accuracy": accuracy})
            if saves_at(step, ckpt=config.ckpt, num_steps=config.num_steps):
                save_step(group, command=kind, step=step, config=config, order=order,
                          tokenizer=tokenizer, run_dir=run_dir, echo=echo)  # fmt: skip
        if held is not None:
            result["eval_accuracy_end"] = pair_accuracy(group, held, kind=kind, micro=micro)
            log.write(
                {"step": config.num_steps, f"{kind}/eval_accuracy": result["eval_accuracy_end"]}
            )
            echo(
                f"[{kind}] held-out pair accuracy {result['eval_accuracy_start']:.3f} -> "
                f"{result['eval_accuracy_end']:.3f}"
            )
        if config.ckpt.export_hf:
            group.export_hf(str(run_dir / "final"))
            tokenizer.save_pretrained(run_dir / "final")
        finished = True
    finally:
        log.close()
        if group is not None:
            release_group(group, key, keep=finished)  # a later run may take it over
    return {**result, "model": str(run_dir / "final")}
