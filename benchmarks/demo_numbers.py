"""The README's demo numbers, measured: ``nox -s demo-numbers`` (or ``python
benchmarks/demo_numbers.py --readme README.md``) runs ``rlhf demo`` a few times, each in a fresh
process as a user would, and writes what they measured, and on which machine, between the
README's ``<!-- demo-numbers -->`` markers.

The first run of a fresh installation also compiles DeepSpeed's CPU communication op; that
one-off is left out (a warm-up run before the measured ones) and said so.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from typing import Any


def machine() -> str:
    """This machine as a reader can compare it: cores and CPU model (``2-core Intel(R) Xeon(R)
    … CPU machine``), or the GPU when one is visible."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    model = platform.processor() or ""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cores}-core {model or 'unknown'} CPU machine"


def measure(*, runs: int, run_dir: pathlib.Path, warmup: bool = True) -> list[dict[str, Any]]:
    """``runs`` demo runs (after one unmeasured warm-up), each in its own process; per run
    its ``summary.json`` and the RL stage's ``startup.json``."""
    results = []
    for i in range(-1 if warmup else 0, runs):
        out = run_dir / ("warmup" if i < 0 else f"run-{i}")
        done = subprocess.run(
            [sys.executable, "-m", "rlhf.cli", "demo", "--run_dir", str(out)],
            check=False,
        )
        if done.returncode != 0:
            raise SystemExit(f"rlhf demo failed (exit {done.returncode}); see its output above")
        if i >= 0:
            summary = json.loads((out / "summary.json").read_text())
            startup = json.loads((out / "rl" / "startup.json").read_text())
            results.append({**summary, "to_step_1_s": startup["to_step_1_s"]})
    return results


def _span(values: Sequence[float], digits: int = 0) -> str:
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}-{high}"


def sentence(results: Sequence[dict[str, Any]], *, where: str) -> str:
    """What the runs measured, in the README's words."""
    start = _span([r["start_pass@1"] for r in results], 2)
    end = _span([r["end_pass@1"] for r in results], 2)
    return (
        f"Measured on a {where} (`nox -s demo-numbers`, {len(results)} runs after a warm-up): "
        f"held-out pass@1 **{start} after SFT → {end} after 40 RL steps**, "
        f"{_span([r['wall_s'] for r in results])} s for the whole demo once installed (the RL "
        f"stage {_span([r['rl_wall_s'] for r in results])} s, "
        f"{_span([r['to_step_1_s'] for r in results], 1)} s of it before step 1; the first "
        "run of an installation also compiles DeepSpeed's CPU communication op, ~30 s)."
    )


def rewrite(text: str, sentence: str) -> str:
    """``text`` with ``sentence`` between its ``<!-- demo-numbers -->`` markers."""
    new, count = re.subn(
        r"(<!-- demo-numbers -->\n).*?(\n<!-- /demo-numbers -->)",
        lambda m: m.group(1) + sentence + m.group(2),
        text,
        flags=re.S,
    )
    if not count:
        raise ValueError("the README has no <!-- demo-numbers --> markers")
    return new


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--run_dir", type=pathlib.Path, default=pathlib.Path("runs/demo-numbers"))
    parser.add_argument("--readme", type=pathlib.Path, default=None)
    args = parser.parse_args()
    text = sentence(measure(runs=args.runs, run_dir=args.run_dir), where=machine())
    print(text)
    if args.readme is not None:
        args.readme.write_text(rewrite(args.readme.read_text(), text))


if __name__ == "__main__":
    main()
