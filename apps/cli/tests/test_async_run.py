"""Async mode with partial rollouts on the real stack: syncs pause the engines, load and resume
them while a batch may be in flight, and every sample stays within the staleness bound; the
run's metrics also go to TensorBoard."""

from __future__ import annotations

import json

import pytest

from .conftest import rlhf, small_run


def test_partial_rollouts_pause_sync_and_resume_the_engines(assets, tmp_path) -> None:
    out = rlhf(
        "train", "grpo",
        "--run_dir", str(tmp_path),
        *small_run(assets, steps=4),
        "--train.async_enable", "True",
        "--train.async_queue_size", "2",
        "--train.partial_rollout_enable", "True",
        "--train.use_tensorboard", str(tmp_path / "tb"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert "partial rollouts" in out.stdout  # the plan
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        # Step s (1-based) trains version s - 1; its batch was started on version >= s - 3.
        assert 0.0 <= r["rollout/staleness_max"] <= min(r["step"] - 1, 2), r
        # Requests caught in flight by a sync: whole requests, at most the q = 2 batches ahead.
        paused = r["rollout/requests_paused_for_sync"]
        assert paused == int(paused) and 0 <= paused <= 2 * 16, r
        assert r["rollout/samples"] == 16.0
    # Batches are sampled ahead: by step 3 training no longer waits for a fresh batch only.
    assert any(r["rollout/staleness_max"] >= 1.0 for r in steps[1:])
    # The TensorBoard events carry the same numbers as metrics.jsonl.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for key in ("reward/mean", "rollout/staleness_max", "time/generation_s"):
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        assert logged == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in steps], key
