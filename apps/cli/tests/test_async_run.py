"""Async mode with partial rollouts on the real stack: syncs pause the engines, load and resume
them while a batch may be in flight, and every sample stays within the staleness bound; the
run's metrics also go to TensorBoard and W&B (offline)."""

from __future__ import annotations

import json

import pytest

from .conftest import rlhf, small_run
from .wandb_offline import history, offline_runs, run_config, run_info


def test_partial_rollouts_pause_sync_and_resume_the_engines(assets, tmp_path) -> None:
    out = rlhf(
        "train", "grpo",
        "--run_dir", str(tmp_path),
        *small_run(assets, steps=4),
        "--train.async_enable", "True",
        "--train.async_queue_size", "2",
        "--train.partial_rollout_enable", "True",
        "--train.use_tensorboard", str(tmp_path / "tb"),
        "--train.use_wandb", "True",
        "--train.wandb_project", "sort4",
        "--train.wandb_group", "async",
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
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
    # So does the W&B run, which carries the resolved config too.
    (wandb_log,) = offline_runs(tmp_path)
    assert run_info(wandb_log)["project"] == "sort4" and run_info(wandb_log)["group"] == "async"
    resolved = json.loads((tmp_path / "config.json").read_text())
    assert run_config(wandb_log)["train"] == resolved["train"]
    logged = [row for row in history(wandb_log) if "reward/mean" in row]
    assert [row["step"] for row in logged] == [1, 2, 3, 4]
    for row, r in zip(logged, steps, strict=True):
        for key in ("reward/mean", "rollout/staleness_max", "time/generation_s"):
            assert row[key] == pytest.approx(r[key], rel=1e-6), key
