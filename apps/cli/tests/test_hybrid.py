"""The hybrid schedule's order of moves (`rlhf.cli.hybrid.TurnTaking`) over a run's phases.

vLLM's sleep mode exists on GPUs only, so here the engines and learner groups are recorders of
the calls the schedule makes; the real moves run in the CPU hybrid run (learners) and on the GPU
machine (``-m gpu``, engines and learners)."""

from __future__ import annotations

import pytest

from rlhf.cli.hybrid import TurnTaking


class Recorder:
    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def sleep(self, level: int):  # a RayEngine's
        self.calls.append((self.name, "sleep", level))

    def wake_up(self, tags):  # a RayEngine's
        self.calls.append((self.name, "wake_up", tags))

    def offload_states(self, *, weights: bool = True):
        self.calls.append((self.name, "offload_states", weights))
        return [{"allocated_gib_before": 2.0, "allocated_gib_after": 0.5 if weights else 1.0}]

    def reload_states(self):
        self.calls.append((self.name, "reload_states"))
        return [{"allocated_gib_before": 0.5, "allocated_gib_after": 2.0}]

    def run(self, fn):
        class Cpu:
            device = __import__("torch").device("cpu")

        return [fn(Cpu())]


def schedule(*, sleep: bool, offload: bool) -> tuple[TurnTaking, list]:
    calls: list = []
    turns = TurnTaking(
        engines=[Recorder("engine0", calls), Recorder("engine1", calls)],
        learners=[Recorder("actor", calls), Recorder("critic", calls)],
        sleep_engines=sleep,
        offload_learners=offload,
    )
    return turns, calls


def test_a_step_moves_states_in_the_order_that_frees_memory_first() -> None:
    turns, calls = schedule(sleep=True, offload=True)
    turns.enter("generation")  # before the first rollout: engines are awake already
    assert calls == [("actor", "offload_states", True), ("critic", "offload_states", True)]
    calls.clear()
    turns.enter("training")  # engines free their memory before the learners take theirs
    assert calls == [("engine0", "sleep", 1), ("engine1", "sleep", 1),
                     ("actor", "reload_states"), ("critic", "reload_states")]  # fmt: skip
    calls.clear()
    turns.enter("sync")  # optimizer states out, then only the engines' weights in
    assert calls == [("actor", "offload_states", False), ("critic", "offload_states", False),
                     ("engine0", "wake_up", ["weights"]), ("engine1", "wake_up", ["weights"])]  # fmt: skip
    calls.clear()
    turns.enter("generation")  # learner weights out (the sync has read them), then the KV cache
    assert calls == [("actor", "offload_states", True), ("critic", "offload_states", True),
                     ("engine0", "wake_up", ["kv_cache"]), ("engine1", "wake_up", ["kv_cache"])]  # fmt: skip
    calls.clear()
    assert turns.enter("generation") == {}  # already there: nothing moves
    assert calls == []
    turns.enter("training")
    turns.enter("generation")  # e.g. after a checkpoint: everything the engines lack wakes
    assert calls[-2:] == [("engine0", "wake_up", ["kv_cache", "weights"]),
                          ("engine1", "wake_up", ["kv_cache", "weights"])]  # fmt: skip


def test_without_sleep_mode_the_engines_are_left_alone() -> None:
    turns, calls = schedule(sleep=False, offload=True)
    for phase in ("generation", "training", "sync", "generation"):
        metrics = turns.enter(phase)
        assert f"time/hybrid_{phase}_s" in metrics
        assert not any(k.startswith("hybrid/") for k in metrics)  # no GPU to report
    assert {c[0] for c in calls} == {"actor", "critic"}
    assert "engines keep their memory" in turns.describe()
    turns, calls = schedule(sleep=False, offload=False)
    for phase in ("generation", "training", "sync", "generation"):
        turns.enter(phase)
    assert calls == []
    assert "learners keep their states" in turns.describe()


def test_an_unknown_phase_is_refused() -> None:
    turns, _ = schedule(sleep=True, offload=True)
    with pytest.raises(ValueError, match="phase must be one of"):
        turns.enter("eval")


def test_learners_offload_by_default_only_where_it_frees_device_memory() -> None:
    from rlhf.cli.config import replace
    from rlhf.cli.presets import resolve

    ppo = replace(resolve("ppo"), **{"train.colocate_all": True})
    assert ppo.offloads_learners(gpu=True)
    assert not ppo.offloads_learners(gpu=False)  # a CPU's states are in host memory already
    zero3 = replace(ppo, **{"critic.deepspeed.zero_stage": 3})
    assert not zero3.offloads_learners(gpu=True)  # DeepSpeed offloads ZeRO-1/2 states only
    forced = replace(ppo, **{"train.deepspeed_enable_sleep": True})
    assert forced.offloads_learners(gpu=False)
    off = replace(ppo, **{"train.deepspeed_enable_sleep": False})
    assert not off.offloads_learners(gpu=True)
    assert not replace(ppo, **{"train.colocate_all": False}).offloads_learners(gpu=True)


def test_learner_states_move_only_when_memory_requires_it() -> None:
    from rlhf.cli.hybrid import Headroom

    gib = 2**30
    # 140 GiB device: 5 % reserve = 7 GiB.
    roomy = Headroom(free_bytes=80 * gib, total_bytes=140 * gib, optimizer_bytes=12 * gib)
    assert roomy.learners_fit  # 80 - 12 = 68 GiB >= 7
    tight = Headroom(free_bytes=18 * gib, total_bytes=140 * gib, optimizer_bytes=12 * gib)
    assert not tight.learners_fit  # 18 - 12 = 6 GiB < 7
    edge = Headroom(free_bytes=19 * gib, total_bytes=140 * gib, optimizer_bytes=12 * gib)
    assert edge.learners_fit  # exactly the reserve left
    assert "80.0 GiB free with every role resident, 12.0 GiB of optimizer states" in (
        roomy.describe()
    )


def test_the_headroom_counts_each_roles_optimizer_share_per_rank() -> None:
    from rlhf.cli.hybrid import OPTIMIZER_BYTES_PER_PARAM, measure_headroom

    class Group:
        def __init__(self, seen, world_size):
            self.seen, self.world_size = seen, world_size

        def run(self, fn):
            return [self.seen] * self.world_size

    actor = Group((50 * 2**30, 140 * 2**30, 1_000_000), world_size=2)
    critic = Group((49 * 2**30, 140 * 2**30, 400_000), world_size=2)
    headroom = measure_headroom([actor, critic])
    assert headroom is not None
    assert headroom.free_bytes == 49 * 2**30  # the later look at the shared device
    assert headroom.optimizer_bytes == OPTIMIZER_BYTES_PER_PARAM * (1_000_000 + 400_000) // 2
    assert measure_headroom([Group(None, world_size=1)]) is None  # CPU ranks
