"""The console progress line: pace, throughput and time left from the step timings."""

from __future__ import annotations

import rlhf.cli.metrics as metrics_module
from rlhf.cli.metrics import Progress


def test_progress_line_reports_throughput_and_eta(monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: now[0])
    progress = Progress(total=10, start=2)  # resumed at step 2
    now[0] += 30.0  # three steps in 30 s: 10 s/step, 5 steps left
    line = progress.line(
        5,
        {
            "reward/mean": 0.25,
            "rollout/response_length_mean": 6.0,
            "rollout/samples": 64.0,
            "time/generation_s": 4.0,
        },
    )
    # 6 tokens x 64 samples / 4 s = 96 tok/s; ETA 5 x 10 s = 50 s.
    assert line == "[5/10] | reward 0.250 | len 6.0 | 96 tok/s | 10.0 s/step | ETA 0m50s"


def test_progress_line_without_rollout_metrics(monkeypatch) -> None:
    now = [0.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: now[0])
    progress = Progress(total=400)
    now[0] += 36.0
    assert progress.line(1, {}) == "[1/400] | 36.0 s/step | ETA 3h59m"
