"""The README's learning table: every RL preset on the demo task with one budget.

One SFT warm start is shared; each algorithm then runs the demo's RL stage (same steps,
prompts, seed) and is reported as held-out pass@1 after SFT and after RL, with wall time.
GRPO's RL stage also runs with its learners on molt (FSDP2) and with the gated train/rollout
corrections, and on-policy distillation learns from GRPO's final policy (the note under the
table says when it came within 0.02 of its teacher's pass@1).
``python benchmarks/learning_table.py --readme README.md`` rewrites the table between the
``<!-- learning-table -->`` markers.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re

from demo_numbers import machine  # beside this script
from rlhf.algos import RolloutCorrectionConfig
from rlhf.cli.demo import DemoConfig, run_demo

ALGOS = ("grpo", "ppo", "reinforce", "reinforce_baseline", "rloo", "dr_grpo")
NAMES = {
    "grpo": "GRPO",
    "ppo": "PPO (critic, GAE)",
    "reinforce": "REINFORCE++",
    "reinforce_baseline": "REINFORCE++-baseline",
    "rloo": "RLOO",
    "dr_grpo": "Dr. GRPO",
    "distill": "On-policy distillation",
}
TEACHER_MARGIN = 0.02
"""Distillation has reached its teacher at a pass@1 within this of the teacher's."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: the RL preset, the backend its learners train on, and the RL
    settings that make a variant of the preset.

    Attributes:
        algo: The preset.
        backend: ``deepspeed`` or ``molt``.
        variant: What the changes are, for the label and the run directory.
        changes: Dotted RL settings over the demo's (`rlhf.cli.demo.run_demo`).
        teacher: The row (its `key`) whose final RL policy teaches this one (``distill``).
    """

    algo: str
    backend: str = "deepspeed"
    variant: str = ""
    changes: tuple[tuple[str, object], ...] = ()
    teacher: str = ""

    @property
    def key(self) -> str:
        return "-".join(p for p in (self.algo, self.backend, self.variant.replace(" ", "_")) if p)

    @property
    def label(self) -> str:
        name = NAMES.get(self.algo, self.algo)
        if self.variant:
            name = f"{name} with {self.variant}"
        if self.teacher:
            name = f"{name} (teacher: {NAMES.get(self.teacher.split('-')[0])}'s final policy)"
        return name if self.backend == "deepspeed" else f"{name} on {self.backend} (FSDP2)"


ROWS = (
    *(Row(a) for a in ALGOS),
    Row("grpo", backend="molt"),
    Row(
        "grpo",
        variant="IcePop",
        changes=(
            ("algo.rollout_correction", RolloutCorrectionConfig(mode="mask", threshold=(0.5, 2.0))),
        ),
    ),
    Row(
        "grpo",
        variant="binary_kl gating",
        changes=(
            (
                "algo.rollout_correction",
                RolloutCorrectionConfig(mode="mask", threshold=(0.0, 0.01), gating="binary_kl"),
            ),
        ),
    ),
    Row(
        "grpo",
        variant="Muon",
        changes=(
            ("actor.optimizer.name", "muon"),
            ("actor.optimizer.muon_lr", 0.005),
            ("actor.optimizer.grad_clip", 0.0),
        ),
    ),
    Row("distill", teacher="grpo-deepspeed"),
)
"""Every preset on DeepSpeed; GRPO's RL stage on molt, with the gated train/rollout
corrections (IcePop: token mask outside [0.5, 2]; binary-KL gating: tokens whose binary KL
exceeds 0.01 masked) and with Muon on the hidden matrices (muon_lr 0.005, AdamW at the demo's
lr for the rest, no gradient clip); on-policy distillation from GRPO's final policy. All from
the same warm start."""


def run_table(config: DemoConfig, rows: tuple[Row, ...] = ROWS) -> str:
    """Each row's demo RL stage from one warm start (made by the first row's run)."""
    done = []
    sft = None
    for row in rows:
        run_dir = pathlib.Path(config.run_dir) / row.key
        teacher = str(pathlib.Path(config.run_dir) / row.teacher / "rl" / "final")
        chosen = dataclasses.replace(
            config,
            algo=row.algo,
            backend=row.backend,
            run_dir=str(run_dir),
            sft_model=sft,
            teacher_model=teacher if row.teacher else None,
        )
        done.append((row, run_demo(chosen, rl_changes=dict(row.changes))))
        sft = sft or str(run_dir / "sft" / "final")
    steps = config.rl_steps
    lines = [
        f"| algorithm | pass@1 after SFT | pass@1 after {steps} RL steps | RL wall time |",
        "|---|---|---|---|",
    ]
    for row, r in done:
        lines.append(
            f"| {row.label} | {r['start_pass@1']:.3f} | {r['end_pass@1']:.3f} | "
            f"{r['rl_wall_s']:.0f} s |"
        )
    ends = {row.key: r["end_pass@1"] for row, r in done}
    notes = [teacher_reached(r["curve"], ends[row.teacher]) for row, r in done if row.teacher]
    lines += ["", *notes, f"Measured on a {machine()} (`nox -s learning-table`)."]
    return "\n".join(lines)


def teacher_reached(curve: list[tuple[int, float, float]], teacher: float) -> str:
    """The note under the table on distillation: when the student's held-out pass@1 first
    came within `TEACHER_MARGIN` of its teacher's (``curve``: the demo's (step, seconds since
    the roles started, pass@1) per evaluation)."""
    for step, seconds, score in curve:
        if score >= teacher - TEACHER_MARGIN:
            return (
                f"Distillation reached its teacher's pass@1 ({teacher:.3f}) within "
                f"{TEACHER_MARGIN} at step {step} ({score:.3f}), {seconds:.0f} s after its roles "
                "started."
            )
    best = max(score for _, _, score in curve)
    return (
        f"Distillation did not come within {TEACHER_MARGIN} of its teacher's pass@1 "
        f"({teacher:.3f}) in {curve[-1][0]} steps (best {best:.3f})."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--run_dir", default="runs/learning-table")
    parser.add_argument("--rl_steps", type=int, default=DemoConfig.rl_steps)
    parser.add_argument("--readme", type=pathlib.Path, default=None)
    parser.add_argument(
        "--rows",
        default="",
        help="comma-separated row keys to run alone (a distillation row needs its teacher's)",
    )
    args = parser.parse_args()
    keys = [k for k in args.rows.split(",") if k]
    unknown = sorted(set(keys) - {row.key for row in ROWS})
    if unknown:
        parser.error(f"unknown rows {unknown}; the rows are {[row.key for row in ROWS]}")
    rows = tuple(row for row in ROWS if not keys or row.key in keys)
    table = run_table(DemoConfig(run_dir=args.run_dir, rl_steps=args.rl_steps), rows)
    print(table)
    if args.readme is not None:
        text = args.readme.read_text()
        new = re.sub(
            r"(<!-- learning-table -->\n).*?(\n<!-- /learning-table -->)",
            lambda m: m.group(1) + table + m.group(2),
            text,
            flags=re.S,
        )
        if new == text and table not in text:
            raise SystemExit(f"{args.readme} has no <!-- learning-table --> markers")
        args.readme.write_text(new)


if __name__ == "__main__":
    main()
