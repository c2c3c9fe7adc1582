"""A role as the RL phases see it: train a batch, run a function over a batch.

`Role` is what `make_experience` and `ppo_update` are written against. Two implementations:
`InProcessRole` (one backend in this process, e.g. a custom loop or a test) and
`rlhf.learner.LearnerGroup` (the role's ranks as Ray actors). Both split a batch the same way
(`deal`): into micro-batches by row and token budget, dealt round-robin to the ranks, ranks
left without one running a weight-0 copy so every rank runs the same collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

import torch

from rlhf.learner.backend import Backend, BackendFactory, Objective
from rlhf.learner.batch import Batch, check_fields, micro_batches, shard
from rlhf.learner.config import LearnerConfig
from rlhf.learner.rank import combine_metric

T = TypeVar("T")

ForwardFn = Callable[[torch.nn.Module, Batch], T]
"""``fn(model, micro_batch) -> T``, run without gradient (picklable for `LearnerGroup`)."""

RowResults = list[tuple[list[int], T]]
"""``[(rows, result), ...]``: one entry per micro-batch, in row order."""


@dataclass(frozen=True)
class MicroBatching:
    """How a role splits a batch into micro-batches (flags ``--train.micro_batch_size``,
    ``--train.max_tokens_per_micro_batch``).

    Attributes:
        max_rows: Rows per micro-batch; None: no row limit.
        max_tokens: Tokens per micro-batch (padded, or real tokens when the role runs
            padding-free); None: no token limit.
    """

    max_rows: int | None = None
    max_tokens: int | None = None


@runtime_checkable
class Role(Protocol):
    """One role (actor, critic, reference, reward model), however many ranks it has."""

    def train_step(
        self,
        batch: Batch,
        objective: Objective,
        *,
        max_tokens: int | None = None,
        max_rows: int | None = None,
    ) -> dict[str, float]:
        """One optimizer step on ``batch``: ``loss`` is the global loss (the sum of every
        micro-batch's share), other metrics averaged over the micro-batches' ranks."""
        ...

    def forward(
        self,
        batch: Batch,
        fn: ForwardFn[T],
        *,
        max_tokens: int | None = None,
        max_rows: int | None = None,
    ) -> RowResults[T]:
        """``fn(model, micro_batch)`` over ``batch`` without gradient; results per
        micro-batch in row order, with the rows of each."""
        ...


def deal(
    batch: Batch,
    *,
    world_size: int,
    max_tokens: int | None = None,
    max_rows: int | None = None,
    packing_samples: bool = False,
) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Micro-batches of ``batch`` (row lists, in order) and, per rank, the row lists it runs
    (round-robin); a rank left without one gets ``[]``."""
    groups = micro_batches(
        batch, max_tokens=max_tokens, max_rows=max_rows, packing_samples=packing_samples
    )
    return groups, shard(groups, world_size)


def rank_work(
    batch: Batch, groups: list[list[int]], dealt: Sequence[Sequence[list[int]]]
) -> list[tuple[list[Batch], list[float]]]:
    """Per rank: its micro-batches and their weights; an idle rank repeats the first
    micro-batch with weight 0."""
    out = []
    for rows in dealt:
        if rows:
            out.append(([batch.select(r) for r in rows], [1.0] * len(rows)))
        else:
            out.append(([batch.select(groups[0])], [0.0]))
    return out


def merge_train_metrics(results: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One step's metrics from the ranks' `Backend.train_micro_batches` results: ``loss``
    summed (each rank's is its share of the global loss), ``grad_norm`` and ``lr`` from rank
    0 (the same on every rank), others over the ranks that reported them (a rank that only
    ran a weight-0 pass reports none): the largest of a ``*_max`` metric, the mean of the
    others (`rlhf.learner.rank.combine_metric`)."""
    keys = {k for r in results for k in r}
    merged = {k: combine_metric(k, [r[k] for r in results if k in r]) for k in keys}
    merged["loss"] = sum(r["loss"] for r in results)
    merged["grad_norm"] = results[0]["grad_norm"]
    merged["lr"] = results[0]["lr"]
    return merged


def row_results(
    dealt: Sequence[Sequence[list[int]]], results: Sequence[Sequence[T]]
) -> RowResults[T]:
    """The ranks' `Backend.forward_micro_batches` results back in row order (an idle rank's
    weight-0 result dropped)."""
    pairs: RowResults[T] = []
    for rows, res in zip(dealt, results, strict=True):
        pairs += list(zip(rows, res[: len(rows)], strict=True))
    return sorted(pairs, key=lambda p: p[0][0])


class InProcessRole:
    """A role with one rank, in this process (no Ray): `Role` over one backend.

    ``build(config, backend=DeepSpeedBackend)`` makes the backend here, like
    ``LearnerGroup.build``; ``InProcessRole(backend)`` wraps one made elsewhere. A custom loop
    or a test calls the phases with it exactly as the CLI does with Ray rank groups.
    """

    def __init__(self, backend: Backend | None = None, *, packing_samples: bool = False) -> None:
        self.backend: Backend | None = None
        self.packing_samples = packing_samples
        if backend is not None:
            self._adopt(backend)

    def _adopt(self, backend: Backend) -> None:
        if backend.world_size != 1:
            raise ValueError(
                f"InProcessRole runs one rank, got a backend of world size {backend.world_size}:"
                " run several ranks as a LearnerGroup"
            )
        self.backend = backend

    def build(self, config: LearnerConfig, *, backend: BackendFactory) -> dict[str, list[int]]:
        """(Re)build the role from ``config`` with the ``backend`` factory; returns the
        model's fingerprint."""
        self.close()
        self._adopt(backend(config))
        self.packing_samples = config.model.packing_samples
        return self._live().fingerprint()

    def _live(self) -> Backend:
        if self.backend is None:
            raise RuntimeError("build() the role before using it")
        return self.backend

    def _work(
        self, batch: Batch, max_tokens: int | None, max_rows: int | None
    ) -> tuple[list[Batch], list[float], list[list[list[int]]]]:
        groups, dealt = deal(
            batch,
            world_size=1,
            max_tokens=max_tokens,
            max_rows=max_rows,
            packing_samples=self.packing_samples,
        )
        micro, weights = rank_work(batch, groups, dealt)[0]
        return micro, weights, dealt

    def train_step(
        self,
        batch: Batch,
        objective: Objective,
        *,
        max_tokens: int | None = None,
        max_rows: int | None = None,
    ) -> dict[str, float]:
        check_fields(batch, objective)
        micro, weights, _ = self._work(batch, max_tokens, max_rows)
        out = self._live().train_micro_batches(micro, objective, weights=weights)
        return merge_train_metrics([out])

    def forward(
        self,
        batch: Batch,
        fn: ForwardFn[T],
        *,
        max_tokens: int | None = None,
        max_rows: int | None = None,
    ) -> RowResults[T]:
        micro, _, dealt = self._work(batch, max_tokens, max_rows)
        return row_results(dealt, [self._live().forward_micro_batches(micro, fn)])

    def close(self) -> None:
        """Release the backend."""
        if self.backend is not None:
            self.backend.close()
            self.backend = None
