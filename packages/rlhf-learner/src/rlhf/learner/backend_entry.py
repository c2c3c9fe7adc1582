"""What a learner backend says about itself to a command that builds, plans and validates
roles on it: a `BackendEntry` per backend, over the backend's own options and a role's
`RoleTopology` (DeepSpeed's in `rlhf.learner.deepspeed_entry`, molt's in ``rlhf.molt.entry``).

A command keeps one registry of entries by name (``--<role>.backend``) and asks the role's
entry — how it builds (`BackendEntry.factory`), splits (tensor and context parallel),
compiles, offloads, what one rank holds for the planner (`rlhf.learner.capacity`), how a plan
describes it and what keeps a role from building — instead of branching on backend names.
Entries import nothing heavy: the backend itself is imported in the rank that builds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

from rlhf.learner.backend import BackendFactory
from rlhf.learner.capacity import LearnerLoad, Memory
from rlhf.learner.config import ModelConfig, OptimizerConfig

Options = TypeVar("Options", contravariant=True)
"""A backend's own options (`DeepSpeedConfig`, molt's `FSDPConfig`)."""


@dataclass(frozen=True, kw_only=True)
class RoleTopology:
    """What an entry reads of a role besides its backend's options.

    Attributes:
        model: The role's model.
        num_ranks: Its processes.
        gpus_per_rank: GPUs each rank takes (0 on CPUs).
        ring_attn_size: The role's own context-parallel flag (``--<role>.ring_attn_size``;
            1: unset), beside the backend's.
        context_parallel: The context-parallel size the role runs with (the larger of the
            two flags).
        optimizer: Its optimizer (None: eval-only).
    """

    model: ModelConfig
    num_ranks: int = 1
    gpus_per_rank: float = 0.0
    ring_attn_size: int = 1
    context_parallel: int = 1
    optimizer: OptimizerConfig | None = None


class BackendEntry(Protocol[Options]):
    """One ``--<role>.backend``, over its options ``Options``."""

    name: str
    options_field: str
    """The role section that holds ``Options`` (``deepspeed``, ``fsdp``)."""
    context_parallel_flag: str
    """The backend's own context-parallel option, under ``options_field``."""
    features: frozenset[str]
    """Model options built for this backend: ``qlora`` (``model.load_in_4bit``), ``liger``
    (``model.use_liger_kernel``)."""

    def factory(self, options: Options, *, context_parallel: int) -> BackendFactory:
        """The factory every rank calls (`rlhf.learner.LearnerGroup.build`)."""
        ...

    def tensor_parallel(self, options: Options) -> int: ...

    def own_context_parallel(self, options: Options) -> int: ...

    def compiles(self, options: Options) -> bool:
        """The role compiles on CPUs too (TorchDynamo must stay on)."""
        ...

    def compute_bytes(self, options: Options, model: ModelConfig) -> int: ...

    def offloadable(self, options: Options) -> bool:
        """Its states can leave the device between phases (hybrid placement)."""
        ...

    def describe(self, options: Options, *, num_ranks: int, context_parallel: int) -> str:
        """How it trains, for a plan."""
        ...

    def memory(self, options: Options, load: LearnerLoad) -> Memory:
        """One rank's memory for a planner (`rlhf.learner.capacity`)."""
        ...

    def problems(self, options: Options, role: RoleTopology, *, flag: str) -> list[str]:
        """What keeps a role (flags ``--{flag}.*``) from building on this backend."""
        ...
