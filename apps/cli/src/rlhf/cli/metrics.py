"""Run logging: a JSONL metrics file (one object per line, flushed each step) and the
reward/accuracy curves as a PNG at the end."""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Mapping
from typing import Any


class MetricsLog:
    """Appends one JSON object per call to ``path``."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, metrics: Mapping[str, Any]) -> None:
        clean = {
            k: (v if not isinstance(v, float) or math.isfinite(v) else None)
            for k, v in metrics.items()
        }
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")


def read(path: pathlib.Path) -> list[dict[str, Any]]:
    """The rows of a metrics file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_curves(metrics_path: pathlib.Path, png: pathlib.Path) -> pathlib.Path | None:
    """Training reward and every evaluation metric against the step, one panel each."""
    if not metrics_path.is_file():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read(metrics_path)
    train = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    eval_keys = sorted({k for r in evals for k in r if k.startswith("eval/")})
    panels = [("reward/mean", train)] + [(k, evals) for k in eval_keys]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.2), squeeze=False)
    for ax, (key, data) in zip(axes[0], panels, strict=True):
        points = [(r["step"], r[key]) for r in data if r.get(key) is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o" if key.startswith("eval/") else None)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
