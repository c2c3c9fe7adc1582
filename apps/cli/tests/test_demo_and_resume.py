"""The embedded demo learns (a reduced budget of README command one), and an RL run killed
after a checkpoint resumes exactly where it stopped."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from .conftest import process_env, rlhf, small_run


def test_learning_table_rows_and_the_distillation_note() -> None:
    sys.path.insert(0, str(pathlib.Path(__file__).parents[3] / "benchmarks"))
    from learning_table import ROWS, Row, teacher_reached

    assert len({row.key for row in ROWS}) == len(ROWS)  # each row its own run directory
    (distill,) = [row for row in ROWS if row.teacher]
    assert distill.teacher in {row.key for row in ROWS[: ROWS.index(distill)]}  # ran before
    assert distill.label == "On-policy distillation (teacher: GRPO's final policy)"
    assert Row("grpo", variant="IcePop").label == "GRPO with IcePop"
    assert Row("grpo", variant="binary_kl gating").key == "grpo-deepspeed-binary_kl_gating"
    curve = [(0, 1.0, 0.30), (5, 9.0, 0.70), (10, 17.0, 0.79), (15, 25.0, 0.85)]
    # The first evaluation at or above 0.81 - 0.02 = 0.79 is step 10.
    assert teacher_reached(curve, 0.81).startswith(
        "Distillation reached its teacher's pass@1 (0.810) within 0.02 at step 10 (0.790), "
        "17 s after"
    )
    assert teacher_reached(curve, 0.90) == (
        "Distillation did not come within 0.02 of its teacher's pass@1 (0.900) in 15 steps "
        "(best 0.850)."
    )


@pytest.mark.parametrize("backend", ["deepspeed", "molt"])
def test_demo_improves_held_out_accuracy(tmp_path, backend) -> None:
    """The full demo (300 SFT + 40 RL steps) went from 0.40 to 0.86 pass@1 when measured;
    12 RL steps must add at least 0.15, on either learner backend (warm start and RL)."""
    out = rlhf(
        "demo", "--run_dir", str(tmp_path), "--rl_steps", "12", "--eval_steps", "6",
        "--backend", backend,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["end_pass@1"] - summary["start_pass@1"] >= 0.15, summary
    # The pass@1 curve: every evaluation's step, seconds since the roles started, pass@1.
    curve = summary["curve"]
    assert [c[0] for c in curve] == [0, 6, 12]
    assert 0 <= curve[0][1] < curve[1][1] < curve[2][1] <= summary["rl_wall_s"]
    assert (curve[0][2], curve[-1][2]) == (summary["start_pass@1"], summary["end_pass@1"])
    assert (tmp_path / "rl" / "curves.png").is_file()
    assert "[demo] held-out pass@1" in out.stdout
    expected = "FSDP2 (molt, float32)" if backend == "molt" else "ZeRO-2"
    assert f"actor 1 rank(s) {expected}" in out.stdout


def _steps(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


ASYNC = ["--train.async_enable", "True", "--train.async_queue_size", "1"]

HELD_REWARD = '''
import os
import pathlib
import pathlib
import time


def reward_func(queries, prompts, labels, **kwargs):
    """The graded reward of the shared assets; with RLHF_TEST_HOLD_AT set, a call that would
    score beyond that many samples (counted in the RLHF_TEST_LEDGER file) never returns, so
    the run stops making progress at a known step until it is killed."""
    hold = os.environ.get("RLHF_TEST_HOLD_AT")
    if hold:
        ledger = pathlib.Path(os.environ["RLHF_TEST_LEDGER"])
        scored = len(ledger.read_text()) if ledger.exists() else 0
        while scored >= int(hold):  # held until the test kills the run
            time.sleep(1.0)
        with ledger.open("a") as f:
            f.write("." * len(queries))
    return [
        sum(a == b for a, b in zip(response, label)) / len(label)
        for response, label in zip(kwargs["responses"], labels)
    ]
'''


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_killed_run_resumes_with_the_same_prompts_and_schedule(assets, tmp_path, mode) -> None:
    """In async mode the step-2 checkpoint also holds step 3's batch, sampled with the weights
    after step 1 before the kill: the resumed run trains on exactly those samples."""
    held = tmp_path / "held_reward.py"
    held.write_text(HELD_REWARD)
    common = [
        *small_run(assets, steps=4, reward=False),
        "--train.reward_func", str(held),
        "--actor.optimizer.lr", "1e-3",
        "--actor.optimizer.min_lr_ratio", "0.0",
        "--ckpt.save_steps", "2",
        *(ASYNC if mode == "async" else []),
    ]  # fmt: skip
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert rlhf("train", "grpo", "--run_dir", str(whole), *common).returncode == 0
    # The same run, killed (SIGKILL, with its Ray processes) once its step-2 checkpoint is in
    # place, then started again with --ckpt.load_enable. Its reward holds the samples of the
    # first batch the step-2 checkpoint does not contain (step 3's; step 4's in async mode,
    # where the checkpoint holds step 3's batch), so no later checkpoint can race the kill.
    per_step = 16
    held_batches = 3 if mode == "async" else 2
    # Its own Ray cluster: the reward runs in the engine's process, which must see the hold.
    env = process_env(
        cluster="own",
        RLHF_TEST_HOLD_AT=str(per_step * held_batches),
        RLHF_TEST_LEDGER=str(tmp_path / "ledger"),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhf.cli", "train", "grpo", "--run_dir", str(part), *common],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
    )  # fmt: skip
    marker = part / "checkpoints" / "step-00000002" / "COMPLETE"
    deadline = time.monotonic() + 600
    while not marker.exists() and proc.poll() is None:
        assert time.monotonic() < deadline, "no step-2 checkpoint within 10 minutes"
        time.sleep(0.2)
    assert proc.poll() is None, "the held run ended on its own"
    assert len((tmp_path / "ledger").read_text()) == per_step * held_batches
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    resumed = rlhf("train", "grpo", "--run_dir", str(part), "--ckpt.load_enable", "True", *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step-00000002 at step 2" in resumed.stdout
    a = {r["step"]: r for r in _steps(whole)}
    b = {r["step"]: r for r in _steps(part)}  # a step re-run after the kill: the later row
    assert sorted(b) == [1, 2, 3, 4]
    assert [b[s]["data/prompts_crc32"] for s in range(1, 5)] == [
        a[s]["data/prompts_crc32"] for s in range(1, 5)
    ]
    # The optimizer schedule continued (cosine over 4 steps from the checkpoint's position).
    assert [b[s]["actor/lr"] for s in range(1, 5)] == [a[s]["actor/lr"] for s in range(1, 5)]
    # Seeded requests: both runs sampled the same tokens at every step, the resumed steps
    # included, so they trained on the same batches and saw the same rewards.
    digests = [a[s]["rollout/samples_crc32"] for s in range(1, 5)]
    assert [b[s]["rollout/samples_crc32"] for s in range(1, 5)] == digests
    assert len(set(digests)) == 4
    assert [b[s]["reward/mean"] for s in range(1, 5)] == [a[s]["reward/mean"] for s in range(1, 5)]
    if mode == "sync":
        assert all(r.get("rollout/staleness_max", 0.0) == 0.0 for r in (*a.values(), *b.values()))
        return
    # Batch j was sampled with the weights of step j - 1 (the engines report the version).
    for run in (a, b):
        assert [run[s]["rollout/staleness_max"] for s in range(1, 5)] == [0.0, 1.0, 1.0, 1.0]
    assert "1 sampled batch(es) restored" in resumed.stdout
    state = json.loads((part / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    (queued,) = state["queue"]
    samples = queued["trajectories"]
    assert queued["step"] == 2 and len(samples) == 16
    assert {t["weight_version"] for t in samples} == {1}
    assert b[3]["reward/mean"] == pytest.approx(sum(t["reward"] for t in samples) / 16, abs=1e-6)
    lengths = [sum(t["action_mask"]) for t in samples]
    assert b[3]["rollout/response_length_mean"] == pytest.approx(sum(lengths) / 16, abs=1e-6)


def test_a_resume_that_cannot_continue_the_run_is_refused_before_start_up(assets, tmp_path):
    """The checkpoint is read before Ray starts: a run that is already done, has another
    batch shape (unless --ckpt.allow_config_change accepts it), has no checkpoint, or whose
    newest checkpoint was damaged since it was written is refused naming the flag; ``auto``
    passes over what is missing or damaged."""
    common = [*small_run(assets, steps=2), "--ckpt.save_steps", "1"]
    first = rlhf("train", "grpo", "--run_dir", str(tmp_path / "run"), *common)
    assert first.returncode == 0, first.stderr[-3000:]
    state = json.loads((tmp_path / "run/checkpoints/step-00000002/trainer_state.json").read_text())
    assert state["shape"] == {"rollout.batch_size": 4, "rollout.n_samples_per_prompt": 4,
                              "train.batch_size": 0, "train.ppo_epochs": 1}  # fmt: skip
    resume = ["train", "grpo", "--run_dir", str(tmp_path / "run"), *common,
              "--ckpt.load_enable", "True"]  # fmt: skip
    done = rlhf(*resume)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "step-00000002 is at step 2: --train.num_steps 2 is done already" in done.stderr
    reshaped = rlhf(*resume, "--train.num_steps", "3", "--rollout.batch_size", "2")
    assert reshaped.returncode == 2, reshaped.stderr[-2000:]
    assert (
        "--rollout.batch_size is 2 but step-00000002 was written with 4: resume with the same "
        "value, start a new --run_dir, or accept the change with --ckpt.allow_config_change "
        "rollout.batch_size" in reshaped.stderr
    )
    assert "Traceback" not in done.stderr + reshaped.stderr
    # What passes goes on to start Ray: checked here in this process (`check_resume` is what
    # the command runs before anything starts).
    accepted = plan_line(*resume, "--train.num_steps", "3", "--rollout.batch_size", "2",
                         "--ckpt.allow_config_change", "rollout.batch_size")  # fmt: skip
    assert accepted.endswith("step-00000002 (step 2)"), accepted
    # A file damaged after the save: named before start-up, the intact step 1 offered.
    rng = tmp_path / "run/checkpoints/step-00000002/rng/rank-0.safetensors"
    good = rng.read_bytes()
    rng.write_bytes(b"not a checkpoint")
    damaged = rlhf(*resume, "--train.num_steps", "3")
    assert damaged.returncode == 2, damaged.stderr[-3000:]
    assert (
        f"step-00000002 is damaged (rng/rank-0.safetensors has 16 bytes, {len(good)} were written); "
        "the newest intact one is step-00000001" in damaged.stderr
    )
    skipped = plan_line(*resume[:-1], "auto", "--train.num_steps", "3")
    assert skipped.startswith("step-00000002 is damaged") and skipped.endswith("(step 1)")
    # Damaged under a manifest that matches it (a hand-edited checkpoint): the learner actor's
    # reader refuses it, with its own message rather than Ray's traceback.
    from rlhf.learner import checkpoint as ckpt

    complete = tmp_path / "run/checkpoints/step-00000002/COMPLETE"
    complete.write_text(json.dumps({"step": 2, "files": ckpt.manifest(complete.parent)}))
    corrupt = rlhf(*resume, "--train.num_steps", "3")
    assert corrupt.returncode == 2, corrupt.stderr[-3000:]
    last = corrupt.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("rlhf: ")
        and "rank-0.safetensors (the RNG state of rank 0) does not load" in last
    )
    assert "\x1b[" not in last and "RayTaskError" not in last
    # No checkpoint: an error with True (a mistyped --run_dir?), a new run with auto.
    typo = ["train", "grpo", "--run_dir", str(tmp_path / "typo"), *common]
    missing = rlhf(*typo, "--ckpt.load_enable", "True")
    assert missing.returncode == 2 and "--ckpt.load_enable True: no checkpoint under" in (
        missing.stderr
    )
    fresh = plan_line(*typo, "--ckpt.load_enable", "auto")
    assert fresh.startswith("no checkpoint under") and fresh.endswith("(a new run)")


def plan_line(command: str, preset: str, *flags: str) -> str:
    """The ``[plan] resume:`` line ``rlhf train <preset> <flags>`` prints before Ray starts."""
    import pathlib

    from rlhf.cli.main import _parse
    from rlhf.cli.presets import resolve
    from rlhf.cli.resume import check_resume

    config = _parse(type(resolve(preset)), flags, resolve(preset), "rlhf train")
    root = pathlib.Path(config.run_dir) / "checkpoints"
    config = config.validate()
    return check_resume(
        root, ckpt=config.ckpt, num_steps=config.train.num_steps, shape=config.shape()
    )[1]


def test_assets_for_a_run_from_an_sft_model_are_the_same_rows_without_a_model(tmp_path) -> None:
    """``rlhf demo --sft_model`` makes no random model (``make_assets(model=False)``); its
    prompts, held-out prompts and SFT rows are byte for byte those of a full demo's seed."""
    from rlhf.cli.demo import make_assets

    full = make_assets(tmp_path / "full", noise=0.6, seed=3)
    rows = make_assets(tmp_path / "rows", noise=0.6, seed=3, model=False)
    assert (full["model"] / "config.json").is_file()
    assert "model" not in rows and not (tmp_path / "rows" / "init").exists()
    assert sorted(rows) == sorted(k for k in full if k != "model")
    for key, path in rows.items():
        assert path.read_bytes() == full[key].read_bytes(), key
