"""The W&B sink against the real ``wandb`` package in offline mode, read back from the run's
transaction log."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from rlhf.cli.metrics import WandbLog

from .wandb_offline import history, offline_runs, run_info


@pytest.fixture(autouse=True)
def fresh_wandb() -> Iterator[None]:
    """W&B keeps its settings in a process-wide singleton; each test (like each CLI run)
    starts from the environment it sets."""
    import wandb

    wandb.teardown()
    yield
    wandb.teardown()


@pytest.fixture
def offline(monkeypatch, tmp_path) -> pathlib.Path:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def test_rows_are_logged_against_our_step_and_a_resume_continues_the_run(offline) -> None:
    log = WandbLog(offline, config={"seed": 3}, project="proj", group="grp", name="first")
    log.write({"step": 1, "reward/mean": 0.25, "data/prompts_crc32": 77, "check/ok": True})
    log.write({"step": 2, "reward/mean": 0.5, "time/generation_s": float("nan")})
    log.close()
    (first,) = offline_runs(offline)
    assert run_info(first) == {
        "project": "proj", "group": "grp", "name": "first",
        "id": (offline / "wandb_run_id").read_text(),
    }  # fmt: skip
    # Identifiers, booleans and non-finite values stay out, as in TensorBoard.
    assert history(first) == [{"step": 1, "reward/mean": 0.25}, {"step": 2, "reward/mean": 0.5}]

    # Killed after step 2, resumed from the step-1 checkpoint: step 2 is logged again, into
    # the same W&B run (rows go against "step", not W&B's own counter, so none is dropped).
    resumed = WandbLog(offline, config={"seed": 3}, project="proj", resume=True)
    resumed.write({"step": 2, "reward/mean": 0.75})
    resumed.close()
    (second,) = offline_runs(offline) - {first}
    assert run_info(second)["id"] == run_info(first)["id"]
    assert history(second) == [{"step": 2, "reward/mean": 0.75}]
    # Without resume a new W&B run starts.
    fresh = WandbLog(offline, config={}, project="proj")
    fresh.close()
    (third,) = offline_runs(offline) - {first, second}
    assert run_info(third)["id"] != run_info(first)["id"]


def test_missing_credentials_name_the_flag_and_the_ways_out(monkeypatch, tmp_path) -> None:
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a stored key
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    with pytest.raises(RuntimeError, match=r"--train.use_wandb: .*wandb login.*WANDB_MODE=offline"):
        WandbLog(tmp_path, config={}, project="proj")
