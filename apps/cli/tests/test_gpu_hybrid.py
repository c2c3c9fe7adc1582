"""GPU, with ``-m gpu``: a hybrid PPO run (actor, critic, reference and one vLLM engine on one
GPU) takes turns: the engine sleeps while the learners train, the learners' DeepSpeed states
leave the GPU while the engine generates, and every sync after a wake travels by CUDA IPC and
is checked (``--vllm.verify_sync``), a checkpoint and the export in between; the actor at
ZeRO-2 and at ZeRO-3 (whose master weights and moments `rlhf.learner.zero3_offload` moves)."""

from __future__ import annotations

import json

import pytest
import torch

from .conftest import rlhf, small_run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("actor_stage", [2, 3])
def test_a_hybrid_ppo_run_takes_turns_on_one_gpu(assets, tmp_path, actor_stage) -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA GPU; run them on the device machine")
    total_gib = torch.cuda.mem_get_info()[1] / 2**30
    weights_gib = (assets["model"] / "model.safetensors").stat().st_size / 2**30  # fp32
    out = rlhf(
        "train", "ppo",
        "--run_dir", str(tmp_path),
        *small_run(assets, steps=3, prompts=4, samples=4),
        "--train.colocate_all", "True",
        "--train.deepspeed_enable_sleep", "True",  # the moves, though this tiny run fits
        "--actor.deepspeed.zero_stage", str(actor_stage),  # ZeRO-3: rlhf.learner.zero3_offload
        "--vllm.gpu_memory_utilization", "0.3",
        "--ckpt.save_steps", "2",
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-6000:])
    assert "colocation: bundles all: actor0+critic0+engines0+ref0" in out.stdout
    assert "engines sleep while the learners train" in out.stdout
    # The one engine shares the actor's GPU: the weights travel by CUDA IPC, never via host.
    assert (
        "[plan] weight sync: cuda_ipc (auto: 1 node with GPUs, 1 engine on the learners' GPUs)"
        in out.stdout
    )
    assert json.loads((tmp_path / "sync.json").read_text())["engines_loaded"] == [{"cuda_ipc": 3}]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    placement = json.loads((tmp_path / "placement.json").read_text())
    assert len({g for role in placement.values() for g in role["placement_group"]}) == 1
    for row in steps:
        # The engine's KV cache (most of its 30 % of the GPU) is free while the learners train.
        freed = row["hybrid/gpu_free_gib_training"] - row["hybrid/gpu_free_gib_generation"]
        assert freed > 0.2 * total_gib, row
        # The actor's states leave the GPU for the sync and generation and come back for
        # training: each way at least its weights' bytes.
        moved = {k: v for k, v in row.items() if k.startswith("hybrid/actor_")}
        print(row["step"], moved, freed)
        out_gib = row["hybrid/actor_moved_gib_sync"] + row["hybrid/actor_moved_gib_generation"]
        assert out_gib >= weights_gib, moved
        assert row["hybrid/actor_moved_gib_training"] >= weights_gib, moved
        assert row["rollout/staleness_max"] == 0.0
        assert row["actor/rollout_logprob_diff_max"] < 5e-2, row
    assert (tmp_path / "checkpoints" / "step-00000002" / "COMPLETE").is_file()
    assert (tmp_path / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize(("utilization", "moves"), [(0.3, False), (0.95, True)])
def test_states_move_by_default_only_when_memory_requires_it(
    assets, tmp_path, utilization, moves
) -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA GPU; run them on the device machine")
    out = rlhf(
        "train", "grpo",
        "--run_dir", str(tmp_path),
        *small_run(assets, steps=2, prompts=4, samples=4),
        "--train.colocate_all", "True",
        "--vllm.gpu_memory_utilization", str(utilization),
        "--vllm.enforce_eager", "True",
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-6000:])
    plan = next(line for line in out.stdout.splitlines() if "hybrid turn-taking" in line)
    assert "GiB free with every role resident" in plan, plan
    # 30 % for the engine leaves most of the GPU: the tiny learners' states stay; at 95 %
    # less than the 5 % reserve is left, so they move as before.
    assert ("optimizer states, master weights and gradients leave the device" in plan) == moves
    assert ("learners keep their states" in plan) == (not moves)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first, second = [r for r in rows if "reward/mean" in r]
    total_gib = torch.cuda.mem_get_info()[1] / 2**30
    # The engine sleeps through step 1's training either way (its KV cache, most of its
    # share of the GPU, is free then). With room to spare it stays awake from step 2 on, so
    # step 2 trains with that memory taken; when the learners must move, it keeps sleeping.
    drop = first["hybrid/gpu_free_gib_training"] - second["hybrid/gpu_free_gib_training"]
    if moves:  # memory is tight: nothing to settle, the engine sleeps every step
        assert "hybrid/engines_sleep" not in first
        assert "[hybrid] engines" not in out.stdout
        assert abs(drop) < 0.1 * total_gib, (first, second)
    else:
        assert first["hybrid/engines_sleep"] == 0.0
        assert "[hybrid] engines stay awake from now on" in out.stdout
        assert drop > 0.2 * total_gib, (first, second)  # its KV cache stays in step 2
