"""The learner backend protocol: what trainers and RL roles are written against.

A backend owns one rank's share of one role's model (and optimizer). DeepSpeed
(`rlhf.learner.deepspeed_backend`) and FSDP2 (``rlhf.molt``) implement it; trainers never touch
the engine underneath.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from rlhf.learner.batch import Batch


class Objective(Protocol):
    """``objective(model, micro_batch) -> (loss_share, metrics)``; see `rlhf.learner.objectives`."""

    def __call__(
        self, model: torch.nn.Module, batch: Batch
    ) -> tuple[Tensor, Mapping[str, Tensor]]: ...


@runtime_checkable
class Backend(Protocol):
    """One rank of one role.

    ``rank`` / ``world_size`` are the data-parallel coordinates; ``module`` the unwrapped model.
    """

    rank: int
    world_size: int

    @property
    def module(self) -> torch.nn.Module: ...

    def train_step(self, micro_batches: Sequence[Batch], objective: Objective) -> dict[str, float]:
        """Forward/backward every micro-batch of this rank, then one optimizer step.

        Returns ``loss`` (this rank's sum of shares: the ranks' values add up to the global
        loss), the other metrics averaged over micro-batches, ``grad_norm`` and ``lr``.
        """
        ...

    def forward(self, micro_batches: Sequence[Batch], fn: Any) -> list[Any]:
        """``fn(model, batch)`` for every micro-batch without gradient, in eval mode."""
        ...

    def save_checkpoint(self, directory: str, *, client_state: Mapping[str, Any]) -> None:
        """Write this rank's part of a resumable checkpoint (all ranks call it)."""
        ...

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        """Restore model, optimizer, scheduler and RNG states; return the client state."""
        ...

    def export_hf(self, directory: str) -> None:
        """Write a transformers checkpoint of the full model (rank 0 writes)."""
        ...

    def named_full_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """Every parameter unsharded, in checkpoint names (all ranks iterate together)."""
        ...
