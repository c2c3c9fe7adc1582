"""The weight transport of ``rlhf train``: which one the placement calls for, that a run uses
the one it chose (the engines count the syncs they loaded by the path they arrived on), and
that every transport delivers the actor's weights (the engines verify them after each sync)."""

from __future__ import annotations

import json

import pytest

from rlhf.cli.config import ConfigError
from rlhf.cli.sync import bucket_mib, choose_transport

from .conftest import rlhf, rlhf_process, small_run


def choose(requested: str = "auto", **where) -> str:
    options = {"gpu": False, "colocated": False, "num_engines": 1, "nodes": 1, "nccl": False}
    return choose_transport(requested, **{**options, **where})[0]


def test_auto_follows_the_placement() -> None:
    """The placement's facts reach `rlhf.weights.choose` (whose own tests hold every case):
    CuPy's presence decides the broadcast on GPUs."""
    assert choose() == "shared_memory"  # one CPU machine
    assert choose(nodes=3) == "object_store"  # several CPU nodes
    assert choose(gpu=True, colocated=True) == "cuda_ipc"  # the engine on the actor's GPU
    assert choose(gpu=True, nccl=True) == "broadcast"  # engines on other GPUs
    assert choose(gpu=True) == "object_store"  # ... without CuPy
    assert choose("broadcast") == "broadcast"  # gloo on CPUs


def test_bucket_size_follows_the_transport_unless_given() -> None:
    # CUDA IPC keeps every bucket alive until the engines loaded: big buckets cost nothing.
    assert bucket_mib(0, "cuda_ipc") > bucket_mib(0, "shared_memory") == 64
    assert bucket_mib(0, "broadcast") == bucket_mib(0, "object_store") == 64
    assert bucket_mib(3, "cuda_ipc") == bucket_mib(3, "shared_memory") == 3


def test_impossible_requests_name_the_flag() -> None:
    flag = "--train.weight_transport"
    with pytest.raises(ConfigError, match=f"^{flag} cuda_ipc needs the engine on the actor's GPU"):
        choose("cuda_ipc", gpu=True, colocated=False)
    with pytest.raises(ConfigError, match=f"^{flag} shared_memory needs one machine; the cluster "):
        choose("shared_memory", nodes=2)
    with pytest.raises(ConfigError, match=f"^{flag} broadcast on GPUs needs CuPy"):
        choose("broadcast", gpu=True)
    with pytest.raises(ConfigError, match="--train.weight_transport must be one of"):
        choose("nccl")


@pytest.mark.parametrize(
    ("transport", "verify"),
    [
        ("auto", "cheap"),
        ("object_store", "full"),
        ("broadcast", "True"),
        ("shared_memory_delta", "full"),
    ],
)
def test_a_run_syncs_over_the_chosen_transport(assets, tmp_path, transport, verify) -> None:
    bucket = [] if transport == "auto" else ["--train.weight_bucket_mib", "1"]
    # The auto case runs as a command of its own: its start-up record counts its imports.
    out = (rlhf_process if transport == "auto" else rlhf)(
        "train", "grpo", "--run_dir", str(tmp_path), *small_run(assets, steps=2),
        "--train.weight_transport", transport, *bucket, "--vllm.verify_sync", verify,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    expected = "shared_memory" if transport == "auto" else transport
    mode = {"True": "full"}.get(verify, verify)
    assert f"[plan] weight sync: {expected} (" in out.stdout
    mib = 1 if bucket else 64  # the default: by the transport
    assert f" {mib} MiB buckets, read-back {mode}" in out.stdout
    report = json.loads((tmp_path / "sync.json").read_text())
    assert report["transport"] == expected
    # Two steps, a sync after each; every sync arrived over the chosen path and verified (a
    # sync whose read-back differs stops the run).
    assert report["engines_loaded"] == [{expected: 2}]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for r in (r for r in rows if "reward/mean" in r):
        # The engine's share of each sync, part by part, lies within the transport's sync,
        # which lies within the step's sync phase.
        parts = [r[f"sync/engine_{p}_s"] for p in ("receive", "validate", "load", "verify")]
        assert all(seconds > 0 for seconds in parts), r
        assert sum(parts) <= r["time/weight_sync_s"] <= r["time/sync_s"], r
        if transport.endswith("_delta"):  # the sender's account, in the step's metrics
            assert 0 < r["sync/bytes_sent"] <= r["sync/bytes_full"], r
            assert 0 <= r["sync/changed_fraction"] <= 1, r
        # The actor's packing and sending (inside its call), then the engines' calls, which
        # hold the engines' parts, except a broadcast's, which the engines receive while it
        # sends.
        send, pack, calls = (r[f"sync/{p}_s"] for p in ("actor_send", "actor_pack", "engine_calls"))
        assert 0 < pack <= send and calls > 0, r
        assert send + calls <= r["time/weight_sync_s"], r
        if expected != "broadcast":
            assert sum(parts) <= calls, r
    if transport == "auto":  # the start-up record of the run (rlhf.cli.startup)
        startup = json.loads((tmp_path / "startup.json").read_text())
        phases = startup["phases_s"]
        assert list(phases) == ["imports", "setup", "ray", "roles", "eval", "step 1"]
        assert all(seconds >= 0 for seconds in phases.values()) and phases["imports"] > 0
        assert startup["to_step_1_s"] == pytest.approx(sum(phases.values()), abs=0.01)
        # The roles started side by side: each was ready within the roles phase.
        ready = startup["roles_ready_s"]
        assert set(ready) == {"engines", "actor", "ref"}  # grpo: KL against a reference
        assert 0 < max(ready.values()) <= phases["roles"]
        assert "[startup] " in out.stdout and " s to step 1: imports " in out.stdout
        steps = [r for r in rows if "time/step_s" in r]
        assert len(steps) == 2
        for r in steps:  # a step's wall time holds its phases
            parts = ("generation", "experience", "training", "sync")
            assert r["time/step_s"] >= sum(r[f"time/{p}_s"] for p in parts)


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_an_engine_of_two_workers_trains_and_syncs(assets, tmp_path, parallel) -> None:
    """``--vllm.tensor_parallel_size 2`` (each layer split over two worker processes) and
    ``--vllm.pipeline_parallel_size 2`` (two stages): every sync reaches both workers and is
    read back from each in full; the engine's log-probs agree with the learner's."""
    out = rlhf(
        "train", "grpo", "--run_dir", str(tmp_path), *small_run(assets, steps=2),
        f"--vllm.{parallel}", "2", "--vllm.verify_sync", "full",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    shape = "x TP 2;" if parallel == "tensor_parallel_size" else "x TP 1 x PP 2;"
    assert f"[plan] placement: 1 vLLM engine(s) {shape}" in out.stdout
    report = json.loads((tmp_path / "sync.json").read_text())
    assert report["engines_loaded"] == [{"shared_memory": 2}]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2
    for r in steps:  # samples of the synced weights score alike in the learner
        assert r["actor/rollout_logprob_diff_max"] < 1e-2, r


def test_a_bad_transport_or_read_back_is_refused_before_any_role_starts(assets, tmp_path) -> None:
    base = ["train", "grpo", "--run_dir", str(tmp_path), *small_run(assets)]
    out = rlhf(*base, "--train.weight_transport", "cuda_ipc")
    assert out.returncode == 2 and "cuda_ipc needs the engine on the actor's GPU" in out.stderr
    out = rlhf(*base, "--vllm.verify_sync", "sometimes")
    assert out.returncode == 2 and "--vllm.verify_sync must be one of" in out.stderr
