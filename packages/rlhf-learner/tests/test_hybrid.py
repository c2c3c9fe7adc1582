"""The hybrid schedule's order of moves (`rlhf.learner.hybrid.TurnTaking`) over a run's phases.

vLLM's sleep mode exists on GPUs only, so here the engines and learner groups are recorders of
the calls the schedule makes; the real moves run in the CPU hybrid run (learners) and on the GPU
machine (``-m gpu``, engines and learners)."""

from __future__ import annotations

import pytest

from rlhf.learner.hybrid import TurnTaking


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


def test_learner_states_move_only_when_memory_requires_it() -> None:
    from rlhf.learner.hybrid import Headroom

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
    from rlhf.learner.hybrid import OPTIMIZER_BYTES_PER_PARAM, measure_headroom

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


GIB = 2**30


class OnGpu(Recorder):
    """A learner group on a GPU: its memory probes answer from ``memory`` (by probe name)."""

    def __init__(self, name: str, calls: list, memory: dict) -> None:
        super().__init__(name, calls)
        self.memory = memory

    def run(self, fn):
        self.calls.append((self.name, fn.__name__))
        return [self.memory[fn.__name__]]


def settling(*, free_awake_gib: float) -> tuple[TurnTaking, list]:
    """Engines sleep in the first learning phase only if needed: the actor's allocator grows
    by 20 GiB while training (10 → 30 GiB reserved), the reference's by 3 GiB (2 → 5)."""
    calls: list = []
    actor = OnGpu("actor", calls, {
        "_device_free_bytes": (int(free_awake_gib * GIB), 140 * GIB),
        "_reset_peak": 10 * GIB, "_peak_reserved": 30 * GIB, "_device_memory": (1.0, 0),
    })  # fmt: skip
    ref = OnGpu("ref", calls, {"_reset_peak": 2 * GIB, "_peak_reserved": 5 * GIB})
    turns = TurnTaking(
        engines=[Recorder("engine0", calls)],
        learners=[actor],
        others=[ref],
        sleep_engines=True,
        offload_learners=False,
        settle_sleep=True,
    )
    return turns, calls


def engine_calls(calls: list) -> list:
    return [c for c in calls if c[0].startswith("engine")]


def test_engines_stay_awake_after_the_first_step_when_training_fits_next_to_them() -> None:
    turns, calls = settling(free_awake_gib=60)
    assert "then only if training does not fit next to them" in turns.describe()
    turns.enter("generation")
    turns.enter("training")  # a checkpoint's training phase measures nothing
    assert ("actor", "_reset_peak") not in calls
    turns.enter("generation")
    calls.clear()
    turns.enter("training", learning=True)
    # The free memory is read with the engines awake, before they sleep; the peak window
    # starts after.
    assert calls[:2] == [("actor", "_device_free_bytes"), ("engine0", "sleep", 1)]
    assert ("actor", "_reset_peak") in calls and ("ref", "_reset_peak") in calls
    metrics = turns.enter("sync")
    # 23 GiB added at the peak; 60 - 23 = 37 GiB >= the 7 GiB reserve of 140 GiB.
    assert metrics["hybrid/training_extra_gib"] == pytest.approx(23.0)
    assert metrics["hybrid/free_awake_gib"] == pytest.approx(60.0)
    assert metrics["hybrid/engines_sleep"] == 0.0
    assert turns.notes == [
        "[hybrid] engines stay awake from now on: training added 23.0 GiB at its peak, "
        "60.0 GiB were free with the engines awake, 7.0 GiB reserve"
    ]
    turns.enter("generation")
    calls.clear()
    for phase in ("training", "sync", "generation", "training"):
        turns.enter(phase, learning=phase == "training")
    assert engine_calls(calls) == []  # no sleep, no wake: the engines kept everything
    assert "engines keep their memory" in turns.describe()


def test_engines_keep_sleeping_when_training_would_not_fit_next_to_them() -> None:
    turns, calls = settling(free_awake_gib=29.5)  # 29.5 - 23 = 6.5 GiB < 7 GiB reserve
    turns.enter("generation")
    turns.enter("training", learning=True)
    metrics = turns.enter("sync")
    assert metrics["hybrid/engines_sleep"] == 1.0
    assert turns.notes[0].startswith("[hybrid] engines keep sleeping while the learners train")
    turns.enter("generation")
    calls.clear()
    turns.enter("training", learning=True)
    assert engine_calls(calls) == [("engine0", "sleep", 1)]
    assert ("actor", "_reset_peak") not in calls  # decided once
    turns.enter("sync")
    assert len(turns.notes) == 1


def test_the_reserve_is_the_edge_between_awake_and_asleep() -> None:
    from rlhf.learner.hybrid import TrainingPeak

    edge = TrainingPeak(free_awake_bytes=30 * GIB, training_extra_bytes=23 * GIB,
                        total_bytes=140 * GIB)  # fmt: skip
    assert edge.engines_may_stay_awake  # exactly the reserve left
    assert not TrainingPeak(
        free_awake_bytes=30 * GIB - 1, training_extra_bytes=23 * GIB, total_bytes=140 * GIB
    ).engines_may_stay_awake
