"""Colocated placement: the bundle layout each flag asks for, and a hybrid run on the real
stack whose roles all report the same Ray placement group (its reference offloaded)."""

from __future__ import annotations

import json

from rlhf.cli.config import replace
from rlhf.cli.placement import plan_bundles
from rlhf.cli.presets import resolve

from .conftest import rlhf, small_run


def _layout(config) -> dict[str, list[list[str]]]:
    return {
        g.name: [[f"{m.role}{m.rank}" for m in members] for members in g.bundles]
        for g in plan_bundles(config.processes())
    }


def test_bundle_layouts_follow_the_flags() -> None:
    ppo = replace(resolve("ppo"), **{"actor.num_ranks": 2, "critic.num_ranks": 2,
                                     "vllm.num_engines": 2, "actor.num_cpus_per_rank": 0.5})  # fmt: skip
    assert _layout(ppo) == {}
    assert _layout(replace(ppo, **{"train.colocate_actor_ref": True})) == {
        "actor_ref": [["actor0", "ref0"], ["actor1"]]
    }
    hybrid = replace(ppo, **{"train.colocate_all": True})
    assert _layout(hybrid) == {
        "all": [["actor0", "critic0", "engines0", "ref0"], ["actor1", "critic1", "engines1"]]
    }
    (group,) = plan_bundles(hybrid.processes())
    # A bundle reserves what its members ask for: 0.5 (actor) + 1 (critic) + 1 (engine) + 0.5.
    assert [sum(m.cpus for m in b) for b in group.bundles] == [3.0, 2.5]
    rm = replace(ppo, **{"train.reward_model_path": "rm", "train.colocate_critic_reward": True})
    assert _layout(rm) == {"critic_reward": [["critic0", "reward_model0"], ["critic1"]]}
    # Teachers by data source are frozen scorers: in bundle 0 beside the reference, each
    # reserving --teacher.num_cpus_per_rank.
    distill = replace(resolve("distill"), **{
        "actor.num_ranks": 2, "vllm.num_engines": 2, "train.colocate_all": True,
        "teacher.model.path": "math=/m,code=/c", "teacher.num_cpus_per_rank": 0.25,
    })  # fmt: skip
    assert _layout(distill) == {
        "all": [["actor0", "engines0", "teacher:math0", "teacher:code0"], ["actor1", "engines1"]]
    }
    (group,) = plan_bundles(distill.processes())
    assert [sum(m.cpus for m in b) for b in group.bundles] == [2.5, 2.0]


def test_a_hybrid_run_puts_every_role_in_one_placement_group(assets, tmp_path) -> None:
    out = rlhf(
        "train", "ppo",
        "--run_dir", str(tmp_path),
        *small_run(assets, samples=2),
        "--critic.num_cpus_per_rank", "0.5",
        "--train.colocate_all", "True",
        "--train.ref_reward_offload", "True",
        "--ckpt.save_steps", "1",
        "--train.deepspeed_enable_sleep", "True",  # off by default on CPU: nothing to free
        "--actor.deepspeed.zero_stage", "3",  # the critic keeps ZeRO-2: both kinds of move
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert "colocation: bundles all: actor0+critic0+engines0+ref0" in out.stdout
    # On CPU the engines keep their memory; forced here, the actor's (ZeRO-3) and critic's
    # (ZeRO-2) DeepSpeed states go through the offload/reload round trip every step (a
    # checkpoint in between).
    assert "engines keep their memory" in out.stdout
    assert "their weights too while the engines generate" in out.stdout
    assert "parameters offloaded to CPU" in out.stdout
    placement = json.loads((tmp_path / "placement.json").read_text())
    assert sorted(placement) == ["actor", "critic", "engines", "ref"]
    groups = {g for role in placement.values() for g in role["placement_group"]}
    assert len(groups) == 1 and None not in groups, placement
    assert all(role["bundles"] == ["all/0"] for role in placement.values())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        assert {"time/hybrid_training_s", "time/hybrid_sync_s", "time/hybrid_generation_s"} <= set(
            row
        ), sorted(row)
        # The sync after a reload/offload round trip still loads exactly the trained weights.
        assert row["actor/rollout_logprob_diff_max"] < 1e-2, row
    assert len(list((tmp_path / "checkpoints").glob("step-*"))) == 2
    # The offloaded ZeRO-3 reference holds the actor's initial weights: same log-probs.
    assert steps[0]["check/step0_policy_ref_logprob_gap_max"] < 1e-4


def test_a_disaggregated_run_reports_no_shared_group(assets, tmp_path) -> None:
    out = rlhf(
        "train", "grpo",
        "--run_dir", str(tmp_path),
        *small_run(assets, steps=1, prompts=2, samples=2, max_new_tokens=4),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    placement = json.loads((tmp_path / "placement.json").read_text())
    for role in ("actor", "engines"):
        assert placement[role]["bundles"] is None and placement[role]["placement_group"] == [None]
        assert placement[role]["node_spec"] == "any node"
    # Each process reports its Ray node: the local cluster's one node.
    (node,) = placement["actor"]["nodes"]
    assert placement["engines"]["nodes"] == [node] and len(node) == 56


def test_learners_offload_by_default_only_where_it_frees_device_memory() -> None:
    from rlhf.cli.config import replace
    from rlhf.cli.presets import resolve

    ppo = replace(resolve("ppo"), **{"train.colocate_all": True})
    assert ppo.offloads_learners(gpu=True)
    assert not ppo.offloads_learners(gpu=False)  # a CPU's states are in host memory already
    zero3 = replace(ppo, **{"critic.deepspeed.zero_stage": 3})
    assert zero3.offloads_learners(gpu=True)  # ZeRO-3's states move too (zero3_offload)
    zero0 = replace(ppo, **{"critic.deepspeed.zero_stage": 0})
    assert not zero0.offloads_learners(gpu=True)  # ZeRO-0 keeps no partitions to move
    forced = replace(ppo, **{"train.deepspeed_enable_sleep": True})
    assert forced.offloads_learners(gpu=False)
    off = replace(ppo, **{"train.deepspeed_enable_sleep": False})
    assert not off.offloads_learners(gpu=True)
    assert not replace(ppo, **{"train.colocate_all": False}).offloads_learners(gpu=True)
