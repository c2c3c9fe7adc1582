"""A process of the run killed under it (``kill -9``): the run stops naming the role and the
checkpoint to resume from, without a Ray traceback, and resuming as told finishes the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rlhf.learner import latest_checkpoint

from .conftest import rlhf, small_run


def _wait_for(predicate, *, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not get there in time"
        time.sleep(0.2)


@pytest.mark.parametrize(("role", "named"), [("engines", "the vLLM engine 0"),
                                              ("actor", "the actor rank 0")])  # fmt: skip
def test_a_killed_process_stops_the_run_with_the_command_that_resumes_it(
    assets, tmp_path, role, named
):
    run_dir = tmp_path / "run"
    flags = ["--run_dir", str(run_dir), *small_run(assets, steps=8), "--ckpt.save_steps", "1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhf.cli", "train", "grpo", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        ckpt = run_dir / "checkpoints"

        def two_steps_saved() -> bool:
            latest = latest_checkpoint(ckpt) if ckpt.is_dir() else None
            if latest is None:
                return False
            return json.loads((latest / "trainer_state.json").read_text())["step"] >= 2

        _wait_for(two_steps_saved, timeout=600, proc=proc)
        placement = json.loads((run_dir / "placement.json").read_text())
        pid = int(placement[role]["pids"][0])
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert f"rlhf: {named}" in err and "died during the run" in err
    assert "--ckpt.load_enable True to resume" in err
    assert "Traceback" not in err, err[-4000:]
    if role != "engines":
        return
    done = rlhf("train", "grpo", *flags, "--ckpt.load_enable", "True", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows if "reward/mean" in r) == 8
