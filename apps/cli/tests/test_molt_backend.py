"""``--<role>.backend molt``: an RL run whose learners train on FSDP2 (`rlhf.molt`) samples,
trains, syncs verified weights into vLLM, checkpoints and resumes; SFT trains on it too; and
the options it cannot serve stop the run before anything starts, naming the flag."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from .conftest import rlhf, small_run


def _steps(run_dir) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "reward/mean" in r}


def test_cpu_ranks_run_without_torchdynamo_unless_the_role_compiles(monkeypatch) -> None:
    """`rank_env`: a CPU rank gets ``TORCHDYNAMO_DISABLE=1`` (nothing there compiles, and
    DeepSpeed's optimizer check would import Inductor); a role that compiles
    (``fsdp.compile``), a GPU rank and a caller who set the variable get nothing."""
    from rlhf.cli.backends import rank_env
    from rlhf.cli.sections import RoleConfig
    from rlhf.molt import FSDPConfig

    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    off = {"TORCHDYNAMO_DISABLE": "1"}
    assert rank_env(RoleConfig(), gpu=False) == off
    assert rank_env(RoleConfig(backend="molt"), gpu=False) == off
    assert rank_env(RoleConfig(backend="molt", fsdp=FSDPConfig(compile=True)), gpu=False) == {}
    assert rank_env(RoleConfig(), gpu=True) == {}
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    assert rank_env(RoleConfig(), gpu=False) == {}


def test_cpu_ranks_compute_with_the_machine_s_cores_unless_engines_run_beside_them(
    monkeypatch,
) -> None:
    """`compute_threads`: in a synchronous CPU run a role's ranks share this machine's CPUs
    while they compute (the engines wait); GPU ranks and ranks beside generating engines
    (``--train.async_enable``) keep their own count (None)."""
    from rlhf.cli.backends import compute_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(6)))
    assert compute_threads(num_ranks=1, gpu=False, beside_engines=False) == 6
    assert compute_threads(num_ranks=4, gpu=False, beside_engines=False) == 1
    assert compute_threads(num_ranks=8, gpu=False, beside_engines=False) == 1
    assert compute_threads(num_ranks=1, gpu=False, beside_engines=True) is None
    assert compute_threads(num_ranks=1, gpu=True, beside_engines=False) is None


def test_ppo_trains_syncs_and_resumes_on_fsdp2(assets, tmp_path) -> None:
    """PPO (actor on 2 FSDP2 ranks, critic and reference on FSDP2 too) for 3 steps with a
    checkpoint at step 2, and the same run resumed from that checkpoint: the engine verifies
    every synced weight (`--vllm.verify_sync full`), and the resumed step 3 trains on the
    prompts and learning rate of the uninterrupted one."""
    common = [
        *small_run(assets, steps=3),
        "--actor.backend", "molt", "--critic.backend", "molt",
        "--actor.num_ranks", "2", "--critic.num_cpus_per_rank", "0.5",
        "--actor.optimizer.lr", "1e-3",
        "--actor.optimizer.min_lr_ratio", "0.0",
        "--vllm.verify_sync", "full", "--ckpt.save_steps", "2",
    ]  # fmt: skip
    whole, part = tmp_path / "whole", tmp_path / "part"
    out = rlhf("train", "ppo", "--run_dir", str(whole), *common)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "actor 2 rank(s) FSDP2 (molt, float32)" in out.stdout
    assert "critic 1 rank(s) FSDP2 (molt, float32)" in out.stdout
    cpus = len(os.sched_getaffinity(0))
    threads = f"actor {max(1, cpus // 2)}, ref {cpus}, critic {cpus}"
    assert f"CPU threads per learner rank while it computes (the engines wait): {threads}" in (
        out.stdout
    )
    a = _steps(whole)
    assert sorted(a) == [1, 2, 3]
    assert all(r["actor/grad_norm"] > 0 and r["critic/grad_norm"] > 0 for r in a.values())
    # Every sync arrived and the engine read back exactly the actor's weights.
    assert json.loads((whole / "sync.json").read_text())["engines_loaded"] == [{"shared_memory": 3}]
    # The same run from its step-2 checkpoint: a copy without the final (step-3) checkpoint
    # and without the metrics, so every row read below is the resumed run's.
    shutil.copytree(whole, part)
    shutil.rmtree(part / "checkpoints/step-00000003")
    (part / "metrics.jsonl").unlink()
    resumed = rlhf("train", "ppo", "--run_dir", str(part), "--ckpt.load_enable", "True", *common)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "step-00000002 at step 2" in resumed.stdout
    b = _steps(part)
    assert sorted(b) == [3]
    assert b[3]["data/prompts_crc32"] == a[3]["data/prompts_crc32"]
    assert b[3]["actor/lr"] == a[3]["actor/lr"]


def test_grpo_trains_and_syncs_with_a_tensor_parallel_actor(assets, tmp_path) -> None:
    """The actor split over 2 tensor-parallel ranks (the demo model's 4 heads and 2 key/value
    heads split 2 ways, the sequence split between blocks) with AdamW on the host, the
    reference likewise split: it trains, and every sync gathers whole weights the engine
    verifies one by one."""
    out = rlhf(
        "train", "grpo", "--run_dir", str(tmp_path), *small_run(assets, steps=2),
        "--actor.backend", "molt", "--actor.fsdp.tp_size", "2", "--actor.num_ranks", "2",
        "--actor.fsdp.offload", "optimizer", "--actor.fsdp.sequence_parallel", "True",
        "--algo.kl.init_coef", "0.01", "--vllm.verify_sync", "full",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert "actor 2 rank(s) FSDP2 (molt, float32, dp 1 x tp 2, sequence parallel)" in out.stdout
    placement = json.loads((tmp_path / "placement.json").read_text())
    assert len(placement["ref"]["placement_group"]) == 2  # one replica: both tp ranks
    steps = _steps(tmp_path)
    assert sorted(steps) == [1, 2] and all(r["actor/grad_norm"] > 0 for r in steps.values())
    assert json.loads((tmp_path / "sync.json").read_text())["engines_loaded"] == [
        {"shared_memory": 2}
    ]


def test_grpo_trains_and_syncs_with_a_deepspeed_autotp_actor(assets, tmp_path) -> None:
    """``--actor.deepspeed.tp_size 2``: DeepSpeed AutoTP splits the actor's linear layers over
    2 ranks (ZeRO-1), the reference is split likewise; it trains, every sync streams whole
    weights the engine verifies one by one, and the export is whole."""
    out = rlhf(
        "train", "grpo", "--run_dir", str(tmp_path), *small_run(assets, steps=2),
        "--actor.deepspeed.tp_size", "2", "--actor.num_ranks", "2",
        "--actor.deepspeed.zero_stage", "1", "--algo.kl.init_coef", "0.01",
        "--vllm.verify_sync", "full",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert "actor 2 rank(s) ZeRO-1, dp 1 x tp 2 (AutoTP)" in out.stdout
    placement = json.loads((tmp_path / "placement.json").read_text())
    assert len(placement["ref"]["placement_group"]) == 2  # one replica: both tp ranks
    steps = _steps(tmp_path)
    assert sorted(steps) == [1, 2] and all(r["actor/grad_norm"] > 0 for r in steps.values())
    assert json.loads((tmp_path / "sync.json").read_text())["engines_loaded"] == [
        {"shared_memory": 2}
    ]
    exported = json.loads((tmp_path / "final" / "config.json").read_text())
    source = json.loads((assets["model"] / "config.json").read_text())
    assert exported["hidden_size"] == source["hidden_size"]
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "final" / "model.safetensors"))
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (source["hidden_size"], source["hidden_size"])  # whole, not a shard


def test_grpo_trains_with_the_sequence_split_over_context_parallel_ranks(assets, tmp_path) -> None:
    """Each row's sequence split over 2 ranks (ring attention), the reference likewise: it
    trains and every sync is verified weight by weight."""
    out = rlhf(
        "train", "grpo", "--run_dir", str(tmp_path), *small_run(assets, steps=2),
        "--actor.backend", "molt", "--actor.fsdp.cp_size", "2", "--actor.num_ranks", "2",
        "--algo.kl.init_coef", "0.01", "--vllm.verify_sync", "full",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert "actor 2 rank(s) FSDP2 (molt, float32, dp 1 x cp 2)" in out.stdout
    placement = json.loads((tmp_path / "placement.json").read_text())
    assert len(placement["ref"]["placement_group"]) == 2  # one replica: both cp ranks
    steps = _steps(tmp_path)
    assert sorted(steps) == [1, 2] and all(r["actor/grad_norm"] > 0 for r in steps.values())


def test_grpo_trains_with_ring_attention_on_deepspeed(assets, tmp_path) -> None:
    """OpenRLHF's ``--actor.ring_attn_size 2`` on the DeepSpeed backend: each row's sequence
    split over 2 ranks, the reference likewise; it trains and every sync is verified."""
    out = rlhf(
        "train", "grpo", "--run_dir", str(tmp_path), *small_run(assets, steps=2),
        "--actor.ring_attn_size", "2", "--actor.num_ranks", "2",
        "--algo.kl.init_coef", "0.01", "--vllm.verify_sync", "full",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert "actor 2 rank(s) ZeRO-2, dp 1 x ring 2" in out.stdout
    placement = json.loads((tmp_path / "placement.json").read_text())
    assert len(placement["ref"]["placement_group"]) == 2
    steps = _steps(tmp_path)
    assert sorted(steps) == [1, 2] and all(r["actor/grad_norm"] > 0 for r in steps.values())


@pytest.mark.parametrize("backend", ["deepspeed", "molt"])
def test_a_lora_actor_trains_and_syncs_merged_weights(assets, tmp_path, backend) -> None:
    """``--actor.model.lora_rank``: only the adapters train, every sync carries the base
    weights with the adapters merged in (the engine verifies each one), and the final export
    is a plain transformers model."""
    out = rlhf(
        "train", "grpo", "--run_dir", str(tmp_path), *small_run(assets, steps=2),
        "--actor.backend", backend, "--actor.num_ranks", "2",
        "--actor.model.lora_rank", "4", "--actor.model.lora_alpha", "8",
        "--actor.optimizer.lr", "1e-2", "--vllm.verify_sync", "full",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    steps = _steps(tmp_path)
    assert sorted(steps) == [1, 2] and all(r["actor/grad_norm"] > 0 for r in steps.values())
    assert json.loads((tmp_path / "sync.json").read_text())["engines_loaded"] == [
        {"shared_memory": 2}
    ]
    from safetensors import safe_open

    q = "model.layers.0.self_attn.q_proj.weight"
    with safe_open(str(tmp_path / "final" / "model.safetensors"), "pt") as f:
        names, trained = set(f.keys()), f.get_tensor(q)
    with safe_open(str(assets["model"] / "model.safetensors"), "pt") as f:
        assert names == set(f.keys())  # merged: no adapter tensors, the base's names
        assert not torch.equal(trained, f.get_tensor(q))  # with the trained adapters in


def test_hybrid_turns_move_fsdp2_states_aside(assets, tmp_path) -> None:
    """Hybrid placement with the learners' states forced off the device between phases
    (``--train.deepspeed_enable_sleep True``; on a CPU machine they make the round trip in
    host memory): actor and critic on FSDP2 train, the actor's log-probs through the chunked
    lm_head, and each sync after a round trip loads exactly the trained weights
    (`--vllm.verify_sync full`)."""
    out = rlhf(
        "train", "ppo", "--run_dir", str(tmp_path), *small_run(assets, steps=2, samples=2),
        "--actor.backend", "molt", "--critic.backend", "molt",
        "--actor.model.chunked_lm_head", "True",
        "--critic.num_cpus_per_rank", "0.5",
        "--train.colocate_all", "True", "--train.deepspeed_enable_sleep", "True",
        "--vllm.verify_sync", "full",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert "their weights too while the engines generate" in out.stdout
    steps = _steps(tmp_path)
    assert sorted(steps) == [1, 2]
    for row in steps.values():
        assert row["actor/grad_norm"] > 0 and row["critic/grad_norm"] > 0
        assert {"time/hybrid_training_s", "time/hybrid_sync_s"} <= set(row), sorted(row)
    assert json.loads((tmp_path / "sync.json").read_text())["engines_loaded"] == [
        {"shared_memory": 2}
    ]


def test_sft_trains_on_fsdp2(assets, tmp_path) -> None:
    out = rlhf(
        "train", "sft", "--run_dir", str(tmp_path), "--dataset", str(assets["sft"]),
        "--model.model.path", str(assets["model"]), "--model.backend", "molt",
        "--model.num_ranks", "2", "--model.num_cpus_per_rank", "0.5",
        "--input_template", "{}", "--batch_size", "16", "--micro_batch_size", "8",
        "--num_steps", "6", "--model.optimizer.lr", "3e-3",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["sft/loss"] for r in rows if "sft/loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert (tmp_path / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--actor.backend", "fsdp"], "--actor.backend must be one of deepspeed, molt"),
        (
            ["--actor.backend", "molt", "--actor.fsdp.tp_size", "2"],
            "--actor.fsdp.tp_size 2 must divide the role's 1 rank(s)",
        ),
        (
            [
                *("--actor.backend", "molt", "--actor.fsdp.tp_size", "4"),
                *("--actor.num_ranks", "4"),
            ],
            "--actor.fsdp.tp_size 4 must divide the model's num_key_value_heads (2)",
        ),
        (
            ["--actor.backend", "molt", "--actor.fsdp.param_dtype", "float16"],
            "--actor.fsdp.param_dtype must be one of",
        ),
        (
            ["--actor.backend", "molt", "--actor.fsdp.cp_size", "2"],
            "--actor.fsdp.cp_size 2 must divide the role's 1 rank(s)",
        ),
        (
            ["--actor.ring_attn_size", "2", "--actor.num_ranks", "3"],
            "--actor.ring_attn_size 2 must divide the role's 3 rank(s)",
        ),
        (
            [
                *("--actor.backend", "molt", "--actor.ring_attn_size", "2"),
                *("--actor.fsdp.cp_size", "4", "--actor.num_ranks", "4"),
            ],
            "--actor.ring_attn_size 2 and --actor.fsdp.cp_size disagree",
        ),
        (
            ["--actor.backend", "molt", "--actor.fsdp.sequence_parallel", "True"],
            "--actor.fsdp.sequence_parallel splits the sequence over the tensor-parallel ranks: "
            "it needs --actor.fsdp.tp_size > 1",
        ),
        (
            [
                *("--actor.backend", "molt", "--actor.model.lora_rank", "4"),
                *("--actor.fsdp.tp_size", "2", "--actor.num_ranks", "2"),
            ],
            "--actor.model.lora_rank with --actor.fsdp.tp_size 2: LoRA adapters are not split",
        ),
        (
            [
                *("--actor.backend", "molt", "--actor.model.chunked_lm_head", "True"),
                *("--actor.fsdp.tp_size", "2", "--actor.num_ranks", "2"),
            ],
            "--actor.model.chunked_lm_head with --actor.fsdp.tp_size 2",
        ),
        (
            ["--actor.deepspeed.tp_size", "2"],
            "--actor.deepspeed.tp_size 2 must divide the role's 1 rank(s)",
        ),
        (
            [
                *("--actor.deepspeed.tp_size", "2", "--actor.num_ranks", "2"),
                *("--actor.deepspeed.zero_stage", "3"),
            ],
            "--actor.deepspeed.tp_size 2 with --actor.deepspeed.zero_stage 3",
        ),
        (
            ["--actor.deepspeed.tp_size", "4", "--actor.num_ranks", "4"],
            "--actor.deepspeed.tp_size 4 must divide the model's num_key_value_heads (2)",
        ),
        (
            ["--actor.deepspeed.deepcompile", "True", "--actor.deepspeed.bf16", "True"],
            "--actor.deepspeed.deepcompile needs GPUs (--actor.num_gpus_per_rank > 0)",
        ),
        (
            ["--actor.deepspeed.deepcompile", "True"],  # ZeRO-2 (the default) in float32
            "deepspeed.deepcompile with deepspeed.zero_stage 2 needs deepspeed.bf16 True",
        ),
    ],
)
def test_options_the_backend_cannot_serve_name_the_flag(assets, tmp_path, flags, message):
    out = rlhf("train", "grpo", "--run_dir", str(tmp_path), *small_run(assets), *flags)
    assert out.returncode != 0
    assert message in " ".join(out.stderr.replace("│", " ").split())  # tyro boxes some
    assert not (tmp_path / "placement.json").exists()  # stopped before any role started
