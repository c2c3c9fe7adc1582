"""``rlhf train sft|rm|dpo``: checkpoints and exact resume (an SFT run killed with SIGKILL, a
DPO run resumed from its mid-run checkpoint), refusals before start-up, the loss flags
(``--margin_key``, ``--nll_loss_coef``) against their formulas, and the TensorBoard and W&B
sinks."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from .conftest import rlhf

SFT = ["--input_template", "{}", "--batch_size", "8", "--micro_batch_size", "4",
       "--model.optimizer.lr", "1e-3", "--ckpt.save_steps", "2"]  # fmt: skip


def _rows(run_dir: pathlib.Path) -> dict[int, dict]:
    """The metrics rows by step (a step logged again after a resume: its later row)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "data/rows_crc32" in r}


def _same_weights(a: pathlib.Path, b: pathlib.Path) -> None:
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sorted(wa) == sorted(wb)
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []


def _tensorboard(directory: pathlib.Path, key: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(key)]


@pytest.fixture(scope="module")
def sft_data(assets, tmp_path_factory) -> pathlib.Path:
    """12 rows: batches of 8 cross an epoch boundary at step 2 (4 rows of epoch 1, 4 of
    epoch 2), so the step-2 checkpoint holds a half-used epoch and the shuffle RNG."""
    path = tmp_path_factory.mktemp("sft-data") / "sft12.jsonl"
    path.write_text("".join(assets["sft"].read_text().splitlines(keepends=True)[:12]))
    return path


class Started:
    """An ``rlhf`` command running in the background (a run costs ~15 s, mostly start-up
    spent waiting, so two overlap well); `done` waits for it and checks it succeeded."""

    def __init__(self, run_dir: pathlib.Path, *args: str) -> None:
        self.run_dir = run_dir
        self.log = run_dir.parent / f"{run_dir.name}.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rlhf.cli", *args, "--run_dir", str(run_dir)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def done(self) -> pathlib.Path:
        assert self.proc.wait(timeout=900) == 0, self.log.read_text()[-3000:]
        return self.run_dir


@pytest.fixture(scope="module")
def sft_whole(assets, sft_data, tmp_path_factory) -> Iterator[Started]:
    """4 uninterrupted SFT steps, checkpoints after steps 2 and 4, TensorBoard events;
    started when first asked for."""
    run = tmp_path_factory.mktemp("sft-whole") / "run"
    started = Started(run, "train", "sft", "--model.model.path", str(assets["model"]),
                      "--dataset", str(sft_data), "--num_steps", "4", *SFT,
                      "--use_tensorboard", str(run / "tb"))  # fmt: skip
    yield started
    if started.proc.poll() is None:  # a test failed before waiting for it
        os.killpg(started.proc.pid, signal.SIGKILL)
        started.proc.wait(timeout=60)


def test_a_killed_sft_run_resumes_with_the_same_losses_and_weights(
    assets, sft_data, sft_whole, tmp_path
) -> None:
    """The run is held at a known point: its ``metrics.jsonl`` is a FIFO the test reads, and
    `MetricsLog` opens the file for each row, which blocks while nobody reads. The test stops
    reading the moment step 2's row is there; the run writes the step-2 checkpoint and trains
    step 3 (~0.1 s) before it opens the file again, then waits at step 3's row, so no later
    checkpoint can race the kill. (Were the test itself held up longer than that, the run
    would finish and the test fail below; it cannot pass that way.)"""
    part = tmp_path / "part"
    part.mkdir()
    fifo = part / "metrics.jsonl"
    os.mkfifo(fifo)
    # Read-write: the test is a reader from the start (the run's first two rows go through)
    # and, being a writer too, reads block instead of seeing end-of-file between rows.
    reader = os.open(fifo, os.O_RDWR)
    args = ["train", "sft", "--run_dir", str(part), "--model.model.path", str(assets["model"]),
            "--dataset", str(sft_data), "--num_steps", "4", *SFT]  # fmt: skip
    with (tmp_path / "held.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlhf.cli", *args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    received = b""
    deadline = time.monotonic() + 300
    try:
        while received.count(b"\n") < 2:
            assert proc.poll() is None, (tmp_path / "held.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no step-2 row within 5 minutes"
            if select.select([reader], [], [], 0.2)[0]:
                received += os.read(reader, 65536)
    finally:
        os.close(reader)
    marker = part / "checkpoints" / "step-00000002" / "COMPLETE"
    while not marker.exists():
        assert proc.poll() is None, (tmp_path / "held.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no step-2 checkpoint within 5 minutes"
        time.sleep(0.1)
    assert proc.poll() is None, "the held run ended on its own"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert sorted(p.name for p in (part / "checkpoints").iterdir()) == ["step-00000002"]
    fifo.unlink()
    fifo.write_bytes(received)  # the rows of steps 1 and 2, as a plain file again

    resumed = rlhf(*args, "--ckpt.load_enable", "True")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"[plan] resume: from {part}/checkpoints/step-00000002 (step 2)" in resumed.stdout
    whole = sft_whole.done()  # it ran alongside the held run
    a, b = _rows(whole), _rows(part)
    assert sorted(b) == [1, 2, 3, 4]
    # Same rows, same learning rate, bitwise the same loss at every step: model, optimizer,
    # scheduler and data order all come back exactly (CPU DeepSpeed runs deterministically).
    for key in ("data/rows_crc32", "lr", "sft/loss"):
        assert [b[s][key] for s in range(1, 5)] == [a[s][key] for s in range(1, 5)], key
    assert len({a[s]["sft/loss"] for s in range(1, 5)}) == 4  # the steps differ at all
    _same_weights(whole / "final", part / "final")
    # The whole run's TensorBoard events hold its metrics.jsonl's losses.
    tb = _tensorboard(whole / "tb", "sft/loss")
    assert tb == [(s, pytest.approx(a[s]["sft/loss"], rel=1e-6)) for s in range(1, 5)]


def _refuse(argv: list[str], capsys, monkeypatch) -> str:
    """``rlhf`` in this process, with Ray start-up made to fail the test: the refusal must
    come before it. Returns stderr."""
    from rlhf.cli import cluster
    from rlhf.cli.main import main

    def no_ray(**_: object) -> None:
        raise AssertionError("Ray was started before the refusal")

    monkeypatch.setattr(cluster, "start_ray", no_ray)
    assert main(argv) == 2
    return capsys.readouterr().err


def test_a_resume_that_cannot_continue_is_refused_before_start_up(
    assets, sft_data, sft_whole, tmp_path, capsys, monkeypatch
) -> None:
    run = tmp_path / "run"
    shutil.copytree(sft_whole.done() / "checkpoints", run / "checkpoints")
    common = ["train", "sft", "--run_dir", str(run), "--model.model.path", str(assets["model"]),
              "--dataset", str(sft_data), *SFT, "--ckpt.load_enable", "True"]  # fmt: skip
    done = _refuse([*common, "--num_steps", "4"], capsys, monkeypatch)
    assert (
        "rlhf: --ckpt.load_enable: step-00000004 is at step 4: --num_steps 4 is done already; "
        "raise --num_steps to train further"
    ) in done
    reshaped = _refuse([*common, "--num_steps", "6", "--batch_size", "4"], capsys, monkeypatch)
    assert (
        "--ckpt.load_enable: --batch_size is 4 but step-00000004 was written with 8: resume "
        "with the same value, start a new --run_dir, or accept the change with "
        "--ckpt.allow_config_change batch_size"
    ) in reshaped
    unchecked = [*common, "--num_steps", "6", "--ckpt.allow_config_change", "micro_batch_size"]
    assert (
        "--ckpt.allow_config_change names micro_batch_size, which a resume does not check; it "
        "checks batch_size"
    ) in _refuse(unchecked, capsys, monkeypatch)
    fewer = tmp_path / "fewer.jsonl"
    fewer.write_text("".join(sft_data.read_text().splitlines(keepends=True)[:6]))
    other_data = _refuse(
        [*common, "--num_steps", "6", "--dataset", str(fewer)], capsys, monkeypatch
    )
    assert "--dataset has 6 rows but step-00000004 was written for 12" in other_data
    as_dpo = [
        "train", "dpo", "--run_dir", str(run), "--model.model.path", str(assets["model"]),
        "--dataset", str(sft_data), "--num_steps", "6", "--ckpt.load_enable", "True",
    ]  # fmt: skip
    assert "was written by `rlhf train sft`, not `rlhf train dpo`" in _refuse(
        as_dpo, capsys, monkeypatch
    )
    # No checkpoint: an error under --ckpt.load_enable True (a mistyped --run_dir?) ...
    typo = ["train", "sft", "--run_dir", str(tmp_path / "typo"), "--model.model.path",
            str(assets["model"]), "--dataset", str(sft_data), "--ckpt.load_enable", "True"]  # fmt: skip
    assert (f"--ckpt.load_enable True: no checkpoint under {tmp_path}/typo/checkpoints") in _refuse(
        typo, capsys, monkeypatch
    )
    # ... and one line under auto (this run then stops at its missing dataset).
    from rlhf.cli.sections import CkptConfig
    from rlhf.cli.sft import SFTConfig, run_sft
    from rlhf.learner.datasets import DataSourceError

    config = SFTConfig(
        run_dir=str(tmp_path / "typo"),
        dataset=str(tmp_path / "missing.jsonl"),
        ckpt=CkptConfig(load_enable="auto"),
    )
    config = dataclasses.replace(config, model=config.model.with_model(path=str(assets["model"])))
    said: list[str] = []
    with pytest.raises(DataSourceError):
        run_sft(config, echo=said.append)
    assert said == [
        f"[plan] resume: no checkpoint under {tmp_path}/typo/checkpoints: starting at step 0 "
        "(a new run)"
    ]


@pytest.fixture(scope="module")
def dpo_pairs(tmp_path_factory) -> pathlib.Path:
    """6 pairs with one prompt and one chosen response (so the chosen NLL of any batch is the
    same number) and 6 different rejected ones (so which pairs make a step matters)."""
    rejected = ["4311", "1314", "3411", "1143", "4131", "3114"]
    path = tmp_path_factory.mktemp("dpo-data") / "pairs.jsonl"
    path.write_text("".join(
        json.dumps({"prompt": "3141:", "chosen": "1134", "rejected": r}) + "\n" for r in rejected
    ))  # fmt: skip
    return path


def _chosen_nll(model_dir: pathlib.Path, pairs: pathlib.Path) -> float:
    """Token-mean NLL of the chosen response under the initial model, with plain
    transformers (the rows tokenised as the command does)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.learner import preference_row

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    row = json.loads(pairs.read_text().splitlines()[0])
    chosen, _ = preference_row(row, 0, tokenizer, input_template="{}")
    ids = torch.tensor([chosen.input_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    token_logprobs = logprobs.gather(1, ids[0, 1:, None])[:, 0]
    mask = torch.tensor(chosen.loss_mask[1:], dtype=torch.float32)
    return float(-(token_logprobs * mask).sum() / mask.sum())


def test_dpo_resumes_exactly_and_adds_the_nll_term(assets, dpo_pairs, tmp_path) -> None:
    coef = 0.5
    common = ["train", "dpo", "--model.model.path", str(assets["model"]),
              "--dataset", str(dpo_pairs), "--input_template", "{}", "--num_steps", "4",
              "--batch_size", "4", "--micro_batch_size", "2", "--model.optimizer.lr", "1e-3",
              "--ckpt.save_steps", "2", "--nll_loss_coef", str(coef)]  # fmt: skip
    whole = tmp_path / "whole"
    out = rlhf(*common, "--run_dir", str(whole), "--use_tensorboard", str(tmp_path / "tb"))
    assert out.returncode == 0, out.stderr[-3000:]
    a = _rows(whole)
    # Step 1: the policy is the reference, so z = 0 in every pair and DPO's term is
    # −logσ(β·0) = log 2; the NLL term adds coef × the chosen token-mean NLL. The trainer's
    # and this test's fp32 forwards differ only by summation order (~1e-6 per log-prob).
    nll = _chosen_nll(assets["model"], dpo_pairs)
    assert a[1]["dpo/nll"] == pytest.approx(nll, abs=1e-4)
    assert a[1]["dpo/loss"] == pytest.approx(math.log(2) + coef * nll, abs=1e-4)
    assert _tensorboard(tmp_path / "tb", "dpo/loss") == [
        (s, pytest.approx(a[s]["dpo/loss"], rel=1e-6)) for s in range(1, 5)
    ]

    # Resumed from the step-2 checkpoint alone (as after a crash during step 3): the
    # reference log-probs are the initial model's again, and steps 3 and 4 are the whole run's.
    part = tmp_path / "part"
    shutil.copytree(whole / "checkpoints" / "step-00000002",
                    part / "checkpoints" / "step-00000002")  # fmt: skip
    resumed = rlhf(*common, "--run_dir", str(part), "--ckpt.load_enable", "True")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    b = _rows(part)
    assert sorted(b) == [3, 4]
    for key in ("data/rows_crc32", "dpo/lr", "dpo/loss", "dpo/nll", "dpo/margin"):
        assert [b[s][key] for s in (3, 4)] == [a[s][key] for s in (3, 4)], key
    assert a[3]["data/rows_crc32"] != a[4]["data/rows_crc32"]
    _same_weights(whole / "final", part / "final")


def test_rm_margin_key_shifts_each_pair_by_its_margin(assets, tmp_path) -> None:
    """The step `rlhf train rm` sends to its learners (`preference_step` on the rows
    `load_pairs` reads), evaluated here on the initial reward model. Chosen = rejected, so
    r_c − r_r = 0 whatever the model, and a pair with margin m costs −logσ(0 − m) =
    log(1 + e^m); the step's loss is the mean over its pairs."""
    import torch
    from transformers import AutoTokenizer

    from rlhf.cli.preference import PreferenceConfig, load_pairs, preference_step
    from rlhf.learner import ModelConfig, load_model
    from rlhf.learner.datasets import read_rows

    margins = [0.0, 1.5, -2.0, 3.0, 0.5]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(
        json.dumps({"prompt": f"{i}{i}:", "chosen": f"{i}" * (i + 1), "rejected": f"{i}" * (i + 1),
                    "m": m}) + "\n"
        for i, m in enumerate(margins)
    ))  # fmt: skip
    config = PreferenceConfig(input_template="{}", micro_batch_size=2, margin_key="m")
    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    train = load_pairs(
        read_rows(str(pairs)), config, tokenizer, source=str(pairs), pad_token_id=0, margin_key="m"
    )
    model = load_model(ModelConfig(path=str(assets["model"]), kind="scalar")).eval()
    picked = [3, 0, 4, 1]  # pair 2 (m = −2) left out of this step
    micro, objective = preference_step(train, picked, config=config, kind="rm")
    assert [m.size for m in micro] == [4, 4]  # two pairs each: chosen rows, then rejected
    with torch.no_grad():
        shares = [objective(model, m) for m in micro]
    # Each micro-batch's share of the step's loss: its pairs' terms over the step's 4 pairs.
    for (loss, metrics), pair_ids in zip(shares, (picked[:2], picked[2:]), strict=True):
        expected = sum(math.log1p(math.exp(margins[i])) for i in pair_ids) / len(picked)
        assert float(loss) == pytest.approx(expected, abs=1e-6), pair_ids
        assert abs(float(metrics["rm/margin"])) < 1e-5  # r_c − r_r
    # Without --margin_key the same step costs log 2 a pair.
    plain = load_pairs(read_rows(str(pairs)), config, tokenizer, source=str(pairs), pad_token_id=0)
    micro, objective = preference_step(plain, picked, config=config, kind="rm")
    with torch.no_grad():
        total = sum(float(objective(model, m)[0]) for m in micro)
    assert total == pytest.approx(math.log(2), abs=1e-6)


@pytest.mark.parametrize(
    ("kind", "flags", "message"),
    [
        ("dpo", ["--loss_type", "ipo", "--label_smoothing", "0.1"],
         "--label_smoothing (cDPO) applies to --loss_type sigmoid only, not 'ipo'; set it to 0"),
        ("dpo", ["--loss_type", "hinge"],
         "--loss_type 'hinge' is not a dpo loss; choose one of: dpo, ipo, sigmoid"),
        ("dpo", ["--margin_key", "m"], "--margin_key applies to `rlhf train rm` only"),
        ("rm", ["--nll_loss_coef", "0.1"], "--nll_loss_coef apply to `rlhf train dpo` only"),
        ("rm", ["--loss_type", "ipo"],
         "--loss_type 'ipo' is not a rm loss; choose one of: log_exp, sigmoid"),
        ("dpo", ["--nll_loss_coef", "-1"], "--nll_loss_coef must be >= 0, got -1.0"),
    ],
)  # fmt: skip
def test_loss_options_that_do_not_fit_are_refused_naming_the_flag(
    assets, dpo_pairs, tmp_path, capsys, monkeypatch, kind, flags, message
) -> None:
    err = _refuse(["train", kind, "--run_dir", str(tmp_path), "--model.model.path",
                   str(assets["model"]), "--dataset", str(dpo_pairs), *flags],
                  capsys, monkeypatch)  # fmt: skip
    assert message in err


def test_a_margin_that_is_not_a_number_names_the_row_and_the_flag(
    assets, tmp_path, capsys, monkeypatch
) -> None:
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        json.dumps({"prompt": "1:", "chosen": "1", "rejected": "2", "m": 1.0}) + "\n"
        + json.dumps({"prompt": "2:", "chosen": "2", "rejected": "1"}) + "\n"
    )  # fmt: skip
    err = _refuse(["train", "rm", "--run_dir", str(tmp_path / "rm"), "--model.model.path",
                   str(assets["model"]), "--dataset", str(pairs), "--margin_key", "m"],
                  capsys, monkeypatch)  # fmt: skip
    assert f"row 1 of {pairs}: --margin_key 'm' must name a finite number, got None" in err


def test_wandb_errors_name_this_commands_flag(monkeypatch, tmp_path) -> None:
    from rlhf.cli.config import ConfigError
    from rlhf.cli.sft import SFTConfig
    from rlhf.cli.trainer_state import open_trainer_sinks

    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a stored key
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    import wandb

    wandb.teardown()
    with pytest.raises(ConfigError, match=r"^--use_wandb: .*wandb login.*WANDB_MODE=offline"):
        open_trainer_sinks(SFTConfig(use_wandb=True), run_dir=tmp_path, run_config={}, resume=False)
    wandb.teardown()
