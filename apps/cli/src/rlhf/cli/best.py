"""``--eval.best_metric``: the best evaluated policy of a run, exported as it is found.

After every evaluation whose ``best_metric`` beats the best so far (``best_mode`` max or min),
the actor is exported as a transformers checkpoint to ``run_dir/best`` (staged, then moved
into place) and ``run_dir/best/best.json`` records the step, the metric and its value,
written last and atomically: a resumed run reads it and keeps beating the same value. A
``best`` directory without ``best.json`` (a run stopped mid-export) counts as no best.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from rlhf.cli.config import ConfigError

RECORD = "best.json"
MODES = ("max", "min")


def metric_names(sources: Iterable[str], *, n_samples: int) -> list[str]:
    """The evaluation metrics a run logs (`rlhf.rollout.sampling.evaluate`)."""
    leaves = ("pass@1", f"pass@{n_samples}", "score_mean")
    return [f"eval/{s}/{leaf}" for s in sources for leaf in leaves]


def check_metric(metric: str, *, sources: Iterable[str], n_samples: int) -> None:
    """Refuse a ``--eval.best_metric`` the run never logs, naming the ones it does."""
    known = metric_names(sources, n_samples=n_samples)
    if metric not in known:
        raise ConfigError(
            f"--eval.best_metric {metric!r} is not an evaluation metric of this run; "
            f"choose one of {', '.join(known)}"
        )


@dataclass
class BestModel:
    """The best value so far and where its model lives.

    Attributes:
        metric: The evaluation metric compared (``eval/<source>/<pass@1|pass@k|score_mean>``).
        mode: ``max`` (higher is better) or ``min``.
        directory: ``run_dir/best``.
        value: The best value so far (None: nothing exported yet).
        step: The step it was measured at.
    """

    metric: str
    mode: str
    directory: pathlib.Path
    value: float | None = None
    step: int | None = None

    @classmethod
    def open(cls, *, metric: str, mode: str, directory: pathlib.Path) -> BestModel:
        """The record of ``directory`` if a complete export is there (a resumed run)."""
        best = cls(metric=metric, mode=mode, directory=directory)
        record = directory / RECORD
        if record.is_file():
            saved = json.loads(record.read_text())
            if saved.get("metric") == metric and saved.get("mode") == mode:
                best.value, best.step = float(saved["value"]), int(saved["step"])
        return best

    def improves(self, evaluation: Mapping[str, float]) -> bool:
        """Whether ``evaluation`` beats the best so far (ties keep the earlier model)."""
        value = float(evaluation[self.metric])
        if self.value is None:
            return True
        return value > self.value if self.mode == "max" else value < self.value

    def record(self, *, step: int, evaluation: Mapping[str, float]) -> None:
        """After the export at ``directory``: write ``best.json`` atomically."""
        self.value, self.step = float(evaluation[self.metric]), step
        body = {"metric": self.metric, "mode": self.mode, "value": self.value, "step": step}
        tmp = self.directory / f".{RECORD}.tmp"
        tmp.write_text(json.dumps(body, indent=1))
        os.replace(tmp, self.directory / RECORD)
