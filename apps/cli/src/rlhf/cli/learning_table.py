"""The README's learning table: every RL preset on the demo task with one budget.

One SFT warm start is shared; each algorithm then runs the demo's RL stage (same steps,
prompts, seed) and is reported as held-out pass@1 after SFT and after RL, with wall time.
The last row runs GRPO's RL stage with its learners on molt (FSDP2) from the same warm start,
beside the DeepSpeed rows.
``python -m rlhf.cli.learning_table --readme README.md`` rewrites the table between the
``<!-- learning-table -->`` markers.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re

from rlhf.cli.demo import DemoConfig, run_demo
from rlhf.cli.demo_numbers import machine

ALGOS = ("grpo", "ppo", "reinforce", "reinforce_baseline", "rloo", "dr_grpo")
NAMES = {
    "grpo": "GRPO",
    "ppo": "PPO (critic, GAE)",
    "reinforce": "REINFORCE++",
    "reinforce_baseline": "REINFORCE++-baseline",
    "rloo": "RLOO",
    "dr_grpo": "Dr. GRPO",
}


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: the RL preset and the backend its learners train on."""

    algo: str
    backend: str = "deepspeed"

    @property
    def label(self) -> str:
        name = NAMES.get(self.algo, self.algo)
        return name if self.backend == "deepspeed" else f"{name} on {self.backend} (FSDP2)"


ROWS = (*(Row(a) for a in ALGOS), Row("grpo", backend="molt"))
"""Every preset on DeepSpeed, and GRPO's RL stage on molt from the same warm start."""


def run_table(config: DemoConfig, rows: tuple[Row, ...] = ROWS) -> str:
    """Each row's demo RL stage from one warm start (made by the first row's run)."""
    done = []
    sft = None
    for row in rows:
        run_dir = f"{config.run_dir}/{row.algo}-{row.backend}"
        chosen = dataclasses.replace(
            config, algo=row.algo, backend=row.backend, run_dir=run_dir, sft_model=sft
        )
        done.append((row, run_demo(chosen)))
        sft = sft or str(pathlib.Path(run_dir) / "sft" / "final")
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
    lines += ["", f"Measured on a {machine()} (`nox -s learning-table`)."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--run_dir", default="runs/learning-table")
    parser.add_argument("--rl_steps", type=int, default=DemoConfig.rl_steps)
    parser.add_argument("--readme", type=pathlib.Path, default=None)
    args = parser.parse_args()
    table = run_table(DemoConfig(run_dir=args.run_dir, rl_steps=args.rl_steps))
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
