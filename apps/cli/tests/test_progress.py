"""The console progress line: pace, throughput and time left from the step timings; a bar
redrawn in place on a terminal, plain lines in a log."""

from __future__ import annotations

import io

import rlhf.cli.metrics as metrics_module
from rlhf.cli.console import Console, bar
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


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_keeps_one_status_line_under_the_scrolling_lines(monkeypatch) -> None:
    monkeypatch.delenv("TERM", raising=False)
    screen = _Terminal()
    console = Console(screen)
    assert console.live
    console("[startup] learner ready")
    console.status("[3/10 ######..............]")
    console("[best] step 3")  # above the status line, which is drawn again below it
    console.status("[4/10 ########............]")
    console.close()
    console.close()  # once
    assert screen.getvalue() == (
        "[startup] learner ready\n"
        "\r\x1b[K[3/10 ######..............]"
        "\r\x1b[K[best] step 3\n[3/10 ######..............]"
        "\r\x1b[K[4/10 ########............]\n"
    )


def test_a_log_gets_every_status_as_a_plain_line(monkeypatch) -> None:
    log = io.StringIO()
    console = Console(log)
    assert not console.live and not Console(_Terminal(), live=False).live
    monkeypatch.setenv("TERM", "dumb")
    assert not Console(_Terminal()).live
    console.status("[1/2]")
    console("x")
    console.close()
    assert log.getvalue() == "[1/2]\nx\n"


def test_progress_draws_a_bar_on_a_terminal_and_lines_in_a_log(monkeypatch) -> None:
    """Four steps 1 s apart: the terminal redraws the bar at each (more than 0.1 s apart) and
    ends it at the last; the log shows the first and the last (every 5 s: none between)."""
    monkeypatch.delenv("TERM", raising=False)
    now = [0.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: now[0])
    screen, log = _Terminal(), io.StringIO()
    live = Progress(total=4, echo=Console(screen))
    plain = Progress(total=4, echo=Console(log))
    for step in range(1, 5):
        now[0] += 1.0
        live.show(step, {}, prefix="[sft] ", suffix=" | loss 1")
        plain.show(step, {}, prefix="[sft] ", suffix=" | loss 1")
    assert screen.getvalue().split("\r\x1b[K")[1:] == [
        f"[sft] [{step}/4 {'#' * (5 * step)}{'.' * (20 - 5 * step)}] | 1.0 s/step | "
        f"ETA 0m{4 - step:02d}s | loss 1"
        for step in range(1, 4)
    ] + ["[sft] [4/4 ####################] | 1.0 s/step | ETA 0m00s | loss 1\n"]
    assert log.getvalue().splitlines() == [
        "[sft] [1/4] | 1.0 s/step | ETA 0m03s | loss 1",
        "[sft] [4/4] | 1.0 s/step | ETA 0m00s | loss 1",
    ]


def test_the_bar_fills_by_whole_cells() -> None:
    assert bar(0, 7, width=7) == "......."
    assert bar(3, 7, width=7) == "###...."
    assert bar(1, 3, width=10) == "###......."  # 3.33 cells: 3 full
    assert bar(9, 7, width=7) == "#######"  # a resumed count past the total stays full
