"""Roles kept warm between the runs of one process (`rlhf.cli.warm`): a run takes over the
engine and learner ranks the previous run of the same options left, and trains exactly as on
new ones; a run that fails leaves nothing behind."""

from __future__ import annotations

import json
import time

import psutil

from .conftest import connect_shared, run_here, small_run


def _pids(run_dir) -> dict[str, list[int]]:
    placement = json.loads((run_dir / "placement.json").read_text())
    return {role: [int(p) for p in where["pids"]] for role, where in placement.items()}


def _steps(run_dir) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


RAISES = """
def reward_func(queries, prompts, labels, **kwargs):
    raise ValueError("no score today")
"""


def test_a_run_takes_over_the_previous_runs_processes_and_trains_alike(assets, tmp_path):
    from rlhf.cli.warm import keep_roles_warm

    connect_shared()
    flags = [*small_run(assets), "--actor.optimizer.lr", "1e-3"]
    with keep_roles_warm() as warm:
        first = run_here("train", "grpo", "--run_dir", str(tmp_path / "a"), *flags)
        assert first.returncode == 0, first.stderr[-3000:]
        assert warm.parked == 3 and warm.taken == {"engines": 0, "groups": 0}  # engine, actor, ref
        second = run_here("train", "grpo", "--run_dir", str(tmp_path / "b"), *flags)
        assert second.returncode == 0, second.stderr[-3000:]
        assert warm.taken == {"engines": 1, "groups": 2}
        a, b = _pids(tmp_path / "a"), _pids(tmp_path / "b")
        assert a == b  # the same processes: engine, actor rank, reference rank
        # The reset engine and the rebuilt ranks sample, score and train as new ones did.
        for key in ("rollout/samples_crc32", "reward/mean", "actor/grad_norm", "actor/kl_loss",
                    "actor/rollout_logprob_diff_max"):  # fmt: skip
            assert [r[key] for r in _steps(tmp_path / "a")] == [
                r[key] for r in _steps(tmp_path / "b")
            ], key
        # Engine counters start again from zero: a new run's sync report counts its own syncs.
        report = json.loads((tmp_path / "b" / "sync.json").read_text())
        assert report["engines_loaded"] == [{"shared_memory": 2}], report

        # A run that fails stops what it took over instead of parking it.
        raises = tmp_path / "raises.py"
        raises.write_text(RAISES)
        bad = run_here("train", "grpo", "--run_dir", str(tmp_path / "c"), *flags,
                       "--train.reward_func", str(raises))  # fmt: skip
        assert bad.returncode == 2 and "no score today" in bad.stderr, bad.stderr[-3000:]
        assert warm.parked == 0 and warm.taken == {"engines": 2, "groups": 4}
        deadline = time.monotonic() + 60
        left = [p for ps in b.values() for p in ps]
        while any(psutil.pid_exists(p) for p in left) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in left if psutil.pid_exists(p)]
