"""Turn-taking of hybrid placement (every role and the inference engines on the same GPUs):
which of them holds the GPU memory in each phase of a synchronous step.

`TurnTaking` is written against small protocols (`SleepingEngine`: vLLM's sleep/wake, e.g.
`rlhf.rollout.RayEngine`; `MovingRole`: a role that moves its states, e.g.
`rlhf.learner.LearnerGroup`), so a loop of another team that colocates its engines with our
learner groups reuses it as the ``rlhf`` command does (``--train.colocate_all``).

Phases, in the order a step runs them:

- ``training`` (experience and PPO epochs): the engines sleep (vLLM level 1: weights copied to
  host memory, KV cache freed) and the learners' states are on the device.
- ``sync`` (the weight sync): the learners' optimizer states, fp32 master weights and gradient
  partitions go to host memory, then the engines' weights wake; the learners' model weights
  stay for the sync.
- ``generation`` (rollouts, evaluations): the learners' model weights go to host memory too,
  then the engines' KV cache wakes.

Engines sleep only where vLLM can (on GPUs). With ``settle_sleep`` they sleep in the first
step's training only, which measures what training adds to the learners' memory
(`TrainingPeak`); from the second step they stay awake when that fits next to them, so a run
whose roles all fit pays no sleep or wake at all. Learners move their states when
``offload_learners`` says so (`Headroom` tells whether memory requires it; on a CPU machine
their states stay in host memory while the backends re-link their buffers, so CPU tests run the
same schedule). Checkpoints and the final export run in the ``training`` phase.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar

from rlhf.learner.backend import Backend

_PHASES = ("training", "sync", "generation")
_TAGS = ("weights", "kv_cache")
RESERVE_FRACTION = 0.05
"""Device memory kept free for fragmentation and small buffers when learners stay resident."""
OPTIMIZER_BYTES_PER_PARAM = 12
"""What a trained parameter adds at its first optimizer step: AdamW's two fp32 moments and
its fp32 gradient partition (8 + 4 bytes, divided among the data-parallel ranks)."""

T = TypeVar("T")


class SleepingEngine(Protocol):
    """An inference engine that can free its GPU memory (vLLM's sleep mode)."""

    def sleep(self, level: int = 1) -> None:
        """Level 1: weights copied to host memory, KV cache freed."""
        ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back ``tags`` (``weights``, ``kv_cache``; None: both)."""
        ...


class RunsOnRanks(Protocol):
    """A role whose ranks run a function of their backend (`rlhf.learner.LearnerGroup.run`)."""

    world_size: int

    def run(self, fn: Callable[[Backend], T], /) -> list[T]:
        """``fn(backend)`` on every rank, in rank order."""
        ...


class MovingRole(RunsOnRanks, Protocol):
    """A trained role that moves its states off the device and back (every rank)."""

    def offload_states(self, *, weights: bool = True) -> Sequence[Mapping[str, float]]: ...

    def reload_states(self) -> Sequence[Mapping[str, float]]: ...


@dataclasses.dataclass(frozen=True)
class Headroom:
    """Device memory of the actor's first GPU right after every role started (engines awake
    with their weights and KV cache, learners built but not yet stepped).

    Attributes:
        free_bytes: Free on the device (all processes counted).
        total_bytes: The device's memory.
        optimizer_bytes: What the trained roles' ranks on that device add at their first
            optimizer step (`OPTIMIZER_BYTES_PER_PARAM` per trained parameter, per rank).
    """

    free_bytes: int
    total_bytes: int
    optimizer_bytes: int

    @property
    def learners_fit(self) -> bool:
        """The learners' states can stay while the engines hold their memory."""
        reserve = RESERVE_FRACTION * self.total_bytes
        return self.free_bytes - self.optimizer_bytes >= reserve

    def describe(self) -> str:
        gib = 2**30
        return (
            f"{self.free_bytes / gib:.1f} GiB free with every role resident, "
            f"{self.optimizer_bytes / gib:.1f} GiB of optimizer states to come, "
            f"{RESERVE_FRACTION * self.total_bytes / gib:.1f} GiB reserve"
        )


@dataclasses.dataclass(frozen=True)
class TrainingPeak:
    """Device memory around the first training phase of a hybrid run (the actor's first GPU),
    which decides whether the engines must keep sleeping while the learners train.

    Attributes:
        free_awake_bytes: Free on the device just before the engines first slept (every role
            resident, the engines with their weights and KV cache).
        training_extra_bytes: What the learners' processes on the device added during
            training at their peak (their allocators' reserved bytes: activations, gradients,
            the optimizer states made at the first step), summed over the processes.
        total_bytes: The device's memory.
    """

    free_awake_bytes: int
    training_extra_bytes: int
    total_bytes: int

    @property
    def engines_may_stay_awake(self) -> bool:
        """Training fits next to the awake engines with `RESERVE_FRACTION` to spare."""
        reserve = RESERVE_FRACTION * self.total_bytes
        return self.free_awake_bytes - self.training_extra_bytes >= reserve

    def describe(self) -> str:
        gib = 2**30
        verdict = (
            "engines stay awake from now on"
            if self.engines_may_stay_awake
            else "engines keep sleeping while the learners train"
        )
        return (
            f"{verdict}: training added {self.training_extra_bytes / gib:.1f} GiB at its peak, "
            f"{self.free_awake_bytes / gib:.1f} GiB were free with the engines awake, "
            f"{RESERVE_FRACTION * self.total_bytes / gib:.1f} GiB reserve"
        )


def _reset_peak(backend: Backend) -> int | None:
    """Start a peak window on the rank's CUDA device: its reserved bytes now; None on CPU."""
    import torch

    if backend.device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(backend.device)
    return int(torch.cuda.memory_reserved(backend.device))


def _peak_reserved(backend: Backend) -> int | None:
    """The rank's peak reserved CUDA bytes since `_reset_peak`; None on CPU."""
    import torch

    if backend.device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_reserved(backend.device))


def _device_free_bytes(backend: Backend) -> tuple[int, int] | None:
    """(free, total) bytes of the rank's CUDA device (all processes counted); None on CPU."""
    import torch

    if backend.device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(backend.device)
    return int(free), int(total)


def _rank_memory(backend: Backend) -> tuple[int, int, int] | None:
    """(free, total, trained parameters of this rank's model) on its CUDA device; None on CPU."""
    import torch

    if backend.device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(backend.device)
    trained = sum(p.numel() for p in backend.module.parameters() if p.requires_grad)
    return int(free), int(total), int(trained)


def measure_headroom(learners: Sequence[RunsOnRanks]) -> Headroom | None:
    """`Headroom` on the GPU of each trained role's first rank (the actor's; colocated roles
    share it), or None on CPUs."""
    probed = [group.run(_rank_memory)[0] for group in learners]
    seen = [s for s in probed if s is not None]
    if not seen or len(seen) < len(probed):
        return None
    optimizer = sum(
        OPTIMIZER_BYTES_PER_PARAM * s[2] // g.world_size
        for s, g in zip(seen, learners, strict=True)
    )
    free = min(s[0] for s in seen)
    return Headroom(free_bytes=free, total_bytes=seen[0][1], optimizer_bytes=optimizer)


@dataclasses.dataclass
class TurnTaking:
    """The phase of a hybrid run's engines and learners.

    Attributes:
        engines: The engines (e.g. `rlhf.rollout.RayEngine` handles, started with
            ``enable_sleep_mode`` when ``sleep_engines``).
        learners: The roles whose states move (roles with an optimizer, e.g.
            `rlhf.learner.LearnerGroup` s), the actor first.
        sleep_engines: Put the engines to sleep during ``training``.
        offload_learners: Move the learners' states off the device outside ``training``.
        settle_sleep: Decide ``sleep_engines`` from the first learning phase (`TrainingPeak`):
            the engines sleep through it, and keep sleeping only if what the learners added
            would not fit next to them awake.
        others: Learner groups that hold device memory but do not move (reference, reward
            model); their training-time peak counts in `TrainingPeak`.
        why: Why the learners move or stay (for the plan line).
        phase: Where the run is. A run starts in ``training`` (engines awake, learners
            loaded, nothing moved yet).
        engines_awake: The engines' memory tags that are on the device.
        notes: Decisions made while running, for the console (the driver prints and clears).
    """

    engines: Sequence[SleepingEngine]
    learners: Sequence[MovingRole]
    sleep_engines: bool
    offload_learners: bool
    settle_sleep: bool = False
    others: Sequence[RunsOnRanks] = ()
    why: str = ""
    phase: str = "training"
    engines_awake: set[str] = dataclasses.field(default_factory=lambda: set(_TAGS))
    notes: list[str] = dataclasses.field(default_factory=list)
    _window: tuple[int, int, list[int | None]] | None = dataclasses.field(
        default=None, init=False, repr=False
    )  # (free with the engines awake, device total, reserved at the start) while measuring

    def describe(self) -> str:
        """One line for the plan: what moves between phases."""
        if not self.sleep_engines:
            engines = "engines keep their memory (vLLM sleeps on GPUs only)"
        elif self.settle_sleep:
            engines = (
                "engines sleep while the learners train in the first step (vLLM level 1: weights "
                "to host memory, KV cache freed), then only if training does not fit next to them"
            )
        else:
            engines = (
                "engines sleep while the learners train (vLLM level 1: weights to host memory, "
                "KV cache freed) and wake weights-first for the sync"
            )
        learners = (
            "actor/critic optimizer states, master weights and gradients leave the device for "
            "the sync, their weights too while the engines generate"
            if self.offload_learners
            else "learners keep their states"
        )
        return f"hybrid turn-taking: {engines}; {learners}" + (f" ({self.why})" if self.why else "")

    def enter(self, phase: str, *, learning: bool = False) -> dict[str, float]:
        """Move to ``phase``; returns its metrics: ``time/hybrid_<phase>_s`` and, on GPUs,
        ``hybrid/gpu_free_gib_<phase>`` (device memory free after the move, as the actor's
        first rank sees it), ``hybrid/actor_allocated_gib_<phase>`` (that rank's own CUDA
        allocations after it), ``hybrid/actor_moved_gib_<phase>`` (what its offload or
        reload moved) and ``hybrid/actor_alloc_retries`` (that rank's cudaMalloc retries so
        far: a count that grows when its allocator had to flush its cache to fit).
        ``learning``: this ``training`` phase trains (not a checkpoint's); the first such phase
        measures `TrainingPeak` under ``settle_sleep``."""
        if phase not in _PHASES:
            raise ValueError(f"phase must be one of {_PHASES}, got {phase!r}")
        if phase == self.phase:
            return {}
        tick = time.perf_counter()
        out: dict[str, float] = {}
        if self._window is not None:
            out.update(self._settle())
        moved: list[Mapping[str, float]] = []
        if phase == "training":
            free_awake = None
            if self.sleep_engines and self.engines_awake:
                if self.settle_sleep and learning and self.engines_awake == set(_TAGS):
                    free_awake = self._free()
                for e in self.engines:
                    e.sleep(1)
                self.engines_awake.clear()
            if self.offload_learners:
                moved = self._reload()
            if free_awake is not None:
                starts = [g.run(_reset_peak)[0] for g in self._groups]
                self._window = (free_awake[0], free_awake[1], starts)
        else:
            if self.offload_learners:
                # Optimizer states first (the engines' weights need the room); the model
                # weights only once the sync has read them.
                moved = self._offload(weights=phase == "generation")
            wanted = {"weights"} if phase == "sync" else set(_TAGS)
            missing = sorted(wanted - self.engines_awake)
            if missing:
                for e in self.engines:
                    e.wake_up(missing)
                self.engines_awake |= wanted
        self.phase = phase
        out[f"time/hybrid_{phase}_s"] = time.perf_counter() - tick
        memory = self.learners[0].run(_device_memory)[0] if self.learners else None
        if memory is not None:
            out[f"hybrid/gpu_free_gib_{phase}"] = memory[0]
            out["hybrid/actor_alloc_retries"] = float(memory[1])
            if moved:
                first = moved[0]
                out[f"hybrid/actor_allocated_gib_{phase}"] = first["allocated_gib_after"]
                out[f"hybrid/actor_moved_gib_{phase}"] = abs(
                    first["allocated_gib_after"] - first["allocated_gib_before"]
                )
        return out

    @property
    def _groups(self) -> list[RunsOnRanks]:
        return [*self.learners, *self.others]

    def _free(self) -> tuple[int, int] | None:
        return self.learners[0].run(_device_free_bytes)[0] if self.learners else None

    def _settle(self) -> dict[str, float]:
        """Close the first learning phase's window: decide whether the engines keep sleeping."""
        assert self._window is not None
        free_awake, total, starts = self._window
        self._window = None
        peaks = [g.run(_peak_reserved)[0] for g in self._groups]
        pairs = zip(peaks, starts, strict=True)
        extra = sum(p - s for p, s in pairs if p is not None and s is not None)
        peak = TrainingPeak(
            free_awake_bytes=free_awake, training_extra_bytes=max(extra, 0), total_bytes=total
        )
        self.settle_sleep = False
        self.sleep_engines = not peak.engines_may_stay_awake
        self.notes.append(f"[hybrid] {peak.describe()}")
        return {
            "hybrid/free_awake_gib": free_awake / 2**30,
            "hybrid/training_extra_gib": peak.training_extra_bytes / 2**30,
            "hybrid/engines_sleep": float(self.sleep_engines),
        }

    def _offload(self, *, weights: bool) -> list[Mapping[str, float]]:
        return [moved for group in self.learners for moved in group.offload_states(weights=weights)]

    def _reload(self) -> list[Mapping[str, float]]:
        return [moved for group in self.learners for moved in group.reload_states()]


def _device_memory(backend: Backend) -> tuple[float, int] | None:
    """(free GiB of the rank's CUDA device, all processes on it counted; the rank's allocator
    retries so far: cudaMalloc calls that failed and succeeded only after the cache was
    flushed), or None on CPU."""
    import torch

    seen = _device_free_bytes(backend)
    if seen is None:
        return None
    retries = torch.cuda.memory_stats(backend.device).get("num_alloc_retries", 0)
    return seen[0] / 2**30, int(retries)
