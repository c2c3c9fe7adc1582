"""The learner backend protocol: one rank of one role, whatever trains it underneath.

A backend owns one rank's share of one role's model (and optimizer). DeepSpeed
(`rlhf.learner.deepspeed_backend`) and FSDP2 (``rlhf.molt``) implement it; `LearnerGroup`,
`InProcessRole` and the phases (`make_experience`, `ppo_update`) are written against it and
never touch the engine underneath. Backends are handed over as factories
(``LearnerGroup.build(config, backend=DeepSpeedBackend)``), so this package's group code never
imports a concrete one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import Tensor

from rlhf.learner.batch import Batch
from rlhf.learner.config import LearnerConfig

T = TypeVar("T")


class Objective(Protocol):
    """``objective(model, micro_batch) -> (loss_share, metrics)``; see `rlhf.learner.objectives`."""

    def __call__(
        self, model: torch.nn.Module, batch: Batch
    ) -> tuple[Tensor, Mapping[str, Tensor]]: ...


@runtime_checkable
class Backend(Protocol):
    """One rank of one role.

    ``rank`` / ``world_size`` are the process coordinates in the role's group (also the
    data-parallel ones unless the backend also has ``dp_rank`` / ``dp_size``: a backend that
    splits the model over several ranks, e.g. tensor parallel, says which data-parallel
    replica a rank belongs to, and `LearnerGroup` deals micro-batches per replica).
    ``device`` is the rank's device, ``module`` the unwrapped model. Methods that gather or
    reduce are collective: every rank of the role calls them together.
    """

    rank: int
    world_size: int
    device: torch.device

    @property
    def module(self) -> torch.nn.Module: ...

    def fingerprint(self) -> dict[str, list[int]]:
        """Parameter names → full shapes (what a checkpoint is checked against)."""
        ...

    def train_micro_batches(
        self,
        micro_batches: Sequence[Batch],
        objective: Objective,
        *,
        weights: Sequence[float] | None = None,
    ) -> dict[str, float]:
        """Forward/backward every micro-batch of this rank (each share scaled by its weight,
        default 1), then one optimizer step; collective.

        Returns ``loss`` (this rank's weighted sum of shares: the ranks' values add up to the
        global loss), the other metrics averaged over micro-batches of positive weight,
        ``grad_norm`` and ``lr``.
        """
        ...

    def forward_micro_batches(
        self, micro_batches: Sequence[Batch], fn: Callable[[torch.nn.Module, Batch], T]
    ) -> list[T]:
        """``fn(model, batch)`` for every micro-batch without gradient, in eval mode; results
        on the CPU; collective."""
        ...

    def save_checkpoint(self, directory: str, *, client_state: Mapping[str, object]) -> None:
        """Write this rank's part of a resumable checkpoint (all ranks call it)."""
        ...

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        """Restore model, optimizer, scheduler and RNG states; return the client state."""
        ...

    def export_hf(self, directory: str, *, ema: bool = False) -> None:
        """Write a transformers checkpoint of the full model (or its EMA) (rank 0 writes)."""
        ...

    def named_full_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """Every parameter unsharded, in checkpoint names, one at a time (all ranks iterate
        together); a yielded tensor is valid until the next is requested."""
        ...

    def state_dict_on_rank0(self, *, ema: bool = False) -> dict[str, Tensor] | None:
        """The full model state (or its EMA) on the CPU at rank 0, None elsewhere."""
        ...

    def offload_states(self, *, weights: bool = True) -> dict[str, float]:
        """Optimizer states, master weights and gradients (with ``weights`` the model weights
        too) to host memory while colocated engines use the device; returns
        ``allocated_gib_before`` / ``allocated_gib_after``."""
        ...

    def reload_states(self) -> dict[str, float]:
        """Undo `offload_states`; same return value."""
        ...

    def close(self) -> None:
        """Release the model and optimizer (the process group stays)."""
        ...


BackendFactory = Callable[[LearnerConfig], Backend]
"""Builds one rank's backend from the role's config in the rank's process (a class such as
`rlhf.learner.DeepSpeedBackend`, or any picklable callable)."""
