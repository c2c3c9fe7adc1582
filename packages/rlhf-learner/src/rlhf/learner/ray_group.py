"""A role's ranks as Ray actors: one process per rank, set up for ``torch.distributed`` (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

`LearnerGroup` is a `rlhf.learner.Role`: it splits work across its data-parallel coordinates
(`rlhf.learner.role.deal`, as `InProcessRole` does) and gathers results; the driver never
holds model weights. A backend that splits the model over several ranks (tensor parallel)
reports each rank's data-parallel coordinate (``dp_rank``, ``dp_size``): ranks that share one
run the same micro-batches, and only the first of them reports results.
Each rank builds its backend with the factory `LearnerGroup.build` is given, so this module
knows no concrete backend. A group method that shares a name with a `Backend` method takes the
same arguments and runs it on every rank. Ray is imported when a group is created
(``rlhf-learner[ray]``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from rlhf.learner import checkpoint as ckpt
from rlhf.learner.backend import Backend, BackendFactory, Objective
from rlhf.learner.batch import Batch, check_fields
from rlhf.learner.config import LearnerConfig
from rlhf.learner.role import (
    ForwardFn,
    RowResults,
    deal,
    merge_train_metrics,
    rank_work,
    row_results,
)
from rlhf.learner.weights import RankSenders, SentWeights
from rlhf.weights.ports import free_port

if TYPE_CHECKING:
    from ray import ObjectRef

T = TypeVar("T")


@contextlib.contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` for the block, then back (None: left as
    they are)."""
    import torch

    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class RankWorker:
    """The actor body of one rank (wrapped with ``ray.remote`` by `LearnerGroup`)."""

    def __init__(self, *, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=os.environ.get("RLHF_LOCAL_RANK", "0"),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        self.rank = rank
        self.backend: Backend | None = None
        self.senders = RankSenders()  # this rank's weight-sync ends, by transport
        # `kill -USR1 <pid>` (the pids are in a run's placement.json) writes every thread's
        # stack to this actor's Ray log: where a rank waits, e.g. in a collective a peer left.
        faulthandler.register(signal.SIGUSR1, all_threads=True)

    def build(self, config: LearnerConfig, backend: BackendFactory) -> dict[str, list[int]]:
        """(Re)build the role's backend with the factory; returns the model's fingerprint."""
        if self.backend is not None:
            self.backend.close()
            self.backend = None
        self.backend = backend(config)
        return self.backend.fingerprint()

    @property
    def built(self) -> Backend:
        """The rank's backend; a call before `build` is an error naming it."""
        if self.backend is None:
            raise RuntimeError(f"rank {self.rank} has no backend yet: build the group first")
        return self.backend

    def data_parallel(self) -> tuple[int, int]:
        """This rank's data-parallel coordinate and the number of them (the backend's
        ``dp_rank``/``dp_size``; its rank and world size when it has none)."""
        backend = self.built
        rank = getattr(backend, "dp_rank", backend.rank)
        return int(rank), int(getattr(backend, "dp_size", backend.world_size))

    def train_micro_batches(
        self,
        micro_batches: Sequence[Batch],
        objective: Objective,
        weights: Sequence[float] | None = None,
        threads: int | None = None,
    ) -> dict[str, float]:
        with intra_op_threads(threads):
            return self.built.train_micro_batches(micro_batches, objective, weights=weights)

    def forward_micro_batches(
        self, micro_batches: Sequence[Batch], fn: ForwardFn[T], threads: int | None = None
    ) -> list[T]:
        with intra_op_threads(threads):
            return self.built.forward_micro_batches(micro_batches, fn)

    def num_threads(self) -> int:
        """torch's intra-op threads in this rank's process now."""
        import torch

        return torch.get_num_threads()

    def save_checkpoint(self, directory: str, client_state: Mapping[str, object]) -> None:
        self.built.save_checkpoint(directory, client_state=client_state)

    def finalize_checkpoint(
        self, root: str, step: int, client_state: Mapping[str, object], keep: int | None
    ) -> str:
        return str(
            ckpt.finalize(
                root,
                step,
                fingerprint=self.built.fingerprint(),
                client_state=client_state,
                keep=keep,
            )
        )

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        return self.built.load_checkpoint(directory)

    def export_hf(self, directory: str, ema: bool = False) -> None:
        self.built.export_hf(directory, ema=ema)

    def offload_states(self, weights: bool = True) -> dict[str, float]:
        return self.built.offload_states(weights=weights)

    def reload_states(self) -> dict[str, float]:
        return self.built.reload_states()

    def send_weights(self, kind: str, version: int, bucket_bytes: int) -> SentWeights:
        return self.senders.send(self.built, kind=kind, version=version, bucket_bytes=bucket_bytes)

    def close_weight_sender(self, kind: str) -> None:
        self.senders.close(kind)

    def new_weight_group(self, kind: str, world_size: int) -> object:
        import ray

        host = ray.util.get_node_ip_address()
        return self.senders.new_group(self.built, kind=kind, world_size=world_size, host=host)

    def join_weight_group(self, kind: str, group: object) -> None:
        self.senders.join(self.built, kind=kind, group=group)

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(backend, *args)`` in this rank's process (``backend`` None before `build`:
        a function may set up the rank's process itself)."""
        return fn(self.backend, *args)


def gather_ranks(refs: Sequence[ObjectRef[T]]) -> list[T]:
    """Every rank's result of one call (``refs``, one per rank), in rank order.

    A rank's error is raised only once every rank's call has ended: ``ray.get`` of the list
    raises the first error it meets at once, and a caller that moved on (to the next call,
    or to changing the files the call reads) while another rank was still inside the call
    could leave that rank in a collective the others never join. A rank whose process died
    (Ray's ``RayActorError``) is raised at once: the others may never end their collective.
    """
    import ray
    from ray.exceptions import RayActorError

    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(ready[0])
        except RayActorError:
            raise
        except Exception:  # raised below, in rank order, once every call ended
            continue
    return ray.get(list(refs))


class LearnerGroup:
    """The ranks of one role, as Ray actors; a `rlhf.learner.Role`.

    Args:
        num_ranks: Ranks (processes): data-parallel replicas × the backend's model-parallel
            degree.
        num_cpus_per_rank: CPUs each rank reserves in Ray.
        num_gpus_per_rank: GPUs each rank reserves (0 on CPU machines).
        env: Extra environment variables of the rank processes.
        scheduling: One Ray scheduling strategy per rank (e.g. a
            ``PlacementGroupSchedulingStrategy`` naming a bundle, to colocate roles), or None.
    """

    def __init__(
        self,
        *,
        num_ranks: int,
        num_cpus_per_rank: float = 1.0,
        num_gpus_per_rank: float = 0.0,
        env: Mapping[str, str] | None = None,
        scheduling: Sequence[object] | None = None,
    ) -> None:
        import ray

        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        if scheduling is not None and len(scheduling) != num_ranks:
            raise ValueError(f"scheduling has {len(scheduling)} entries for {num_ranks} ranks")
        port = free_port()
        options: dict[str, object] = {
            "num_cpus": num_cpus_per_rank,
            "num_gpus": num_gpus_per_rank,
            "runtime_env": {"env_vars": dict(env or {})},
        }
        actor = ray.remote(RankWorker)
        # Actor handles: Ray types an undecorated actor method as the plain function (no
        # `.remote`) and the handle as an ActorProxy that `ray.kill` does not accept.
        self.workers: list[Any] = [
            actor.options(  # type: ignore[attr-defined]
                **options, **({"scheduling_strategy": scheduling[r]} if scheduling else {})
            ).remote(rank=r, world_size=num_ranks, master_addr="127.0.0.1", master_port=port)
            for r in range(num_ranks)
        ]
        self.world_size = num_ranks
        self.compute_threads: int | None = None
        """torch intra-op threads each rank uses while it trains or runs a forward (then back
        to the process's own: Ray starts an actor with as many as the CPUs it reserves, at
        least 1); None leaves them. For CPU machines where nothing else computes meanwhile
        (a synchronous run's learner phases)."""
        self.packing_samples = False  # set by build(): token budgets count real tokens
        self._dp_ranks: list[int] | None = None  # per rank, asked of the backends once built

    def _all(
        self, method: str, *args: object, per_rank: Sequence[Sequence[object]] | None = None
    ) -> list:
        if per_rank is None:
            refs = [getattr(w, method).remote(*args) for w in self.workers]
        else:
            refs = [
                getattr(w, method).remote(*a) for w, a in zip(self.workers, per_rank, strict=True)
            ]
        return gather_ranks(refs)

    def build(self, config: LearnerConfig, *, backend: BackendFactory) -> dict[str, list[int]]:
        """(Re)build the role on every rank with the ``backend`` factory (e.g.
        `rlhf.learner.DeepSpeedBackend`; the ranks meet in one process group); returns the
        model's fingerprint."""
        return gather_ranks(self.start_build(config, backend=backend))[0]

    def start_build(
        self, config: LearnerConfig, *, backend: BackendFactory
    ) -> list[ObjectRef[dict[str, list[int]]]]:
        """`build` without waiting: one object ref per rank (each resolves to the model's
        fingerprint, or raises the rank's error), so several roles can start side by side."""
        self.packing_samples = config.model.packing_samples
        self._dp_ranks = None
        return [w.build.remote(config, backend) for w in self.workers]

    def _data_parallel(self) -> list[int]:
        """Each rank's data-parallel coordinate (asked of the built backends once)."""
        import ray

        if self._dp_ranks is None:
            layout = ray.get([w.data_parallel.remote() for w in self.workers])
            sizes = {size for _, size in layout}
            ranks = [rank for rank, _ in layout]
            if len(sizes) != 1 or set(ranks) != set(range(sizes.pop())):
                raise RuntimeError(f"the ranks report inconsistent data-parallel layouts: {layout}")
            self._dp_ranks = ranks
        return self._dp_ranks

    def _leaders(self) -> list[int]:
        """The first rank of each data-parallel coordinate, in coordinate order."""
        first: dict[int, int] = {}
        for rank, dp in enumerate(self._data_parallel()):
            first.setdefault(dp, rank)
        return [first[dp] for dp in sorted(first)]

    def _per_rank(self, per_dp: Sequence[T]) -> list[T]:
        """Work made per data-parallel coordinate, given to every rank of that coordinate."""
        return [per_dp[dp] for dp in self._data_parallel()]

    def split(
        self, batch: Batch, *, max_tokens: int | None = None, max_rows: int | None = None
    ) -> list[tuple[list[Batch], list[float]]]:
        """Micro-batches of ``batch`` dealt to the data-parallel coordinates, with their
        weights; one left without any gets a weight-0 copy of the first (every rank must run
        the same collectives)."""
        return self._split(batch, max_tokens, max_rows)[0]

    def _split(
        self, batch: Batch, max_tokens: int | None, max_rows: int | None
    ) -> tuple[list[tuple[list[Batch], list[float]]], list[list[list[int]]]]:
        groups, dealt = deal(
            batch,
            world_size=len(self._leaders()),
            max_tokens=max_tokens,
            max_rows=max_rows,
            packing_samples=self.packing_samples,
        )
        return rank_work(batch, groups, dealt), dealt

    def train_step(
        self,
        batch: Batch,
        objective: Objective,
        *,
        max_tokens: int | None = None,
        max_rows: int | None = None,
    ) -> dict[str, float]:
        """`rlhf.learner.Role.train_step`: one optimizer step on ``batch`` split over the
        ranks."""
        check_fields(batch, objective)
        parts = self.split(batch, max_tokens=max_tokens, max_rows=max_rows)
        return self._train(parts, objective)

    def train_micro_batches(
        self,
        micro_batches: Sequence[Batch],
        objective: Objective,
        *,
        weights: Sequence[float] | None = None,
    ) -> dict[str, float]:
        """`Backend.train_micro_batches` over micro-batches the caller made (e.g. whole
        preference pairs), dealt round-robin to the data-parallel coordinates; one left
        without any runs a weight-0 copy. ``loss`` is the global loss."""
        if not micro_batches:
            raise ValueError("train_micro_batches needs at least one micro-batch")
        for micro in micro_batches:
            check_fields(micro, objective)
        scale = [1.0] * len(micro_batches) if weights is None else list(weights)
        n = len(self._leaders())
        parts = [
            (list(micro_batches[r::n]), scale[r::n]) if micro_batches[r::n]
            else ([micro_batches[0]], [0.0])
            for r in range(n)
        ]  # fmt: skip
        return self._train(parts, objective)

    def _train(
        self, parts: list[tuple[list[Batch], list[float]]], objective: Objective
    ) -> dict[str, float]:
        per_rank = self._per_rank([(m, objective, w, self.compute_threads) for m, w in parts])
        results = self._all("train_micro_batches", per_rank=per_rank)
        return merge_train_metrics([results[r] for r in self._leaders()])

    def forward(
        self,
        batch: Batch,
        fn: ForwardFn[T],
        *,
        max_tokens: int | None = None,
        max_rows: int | None = None,
    ) -> RowResults[T]:
        """`rlhf.learner.Role.forward` on every rank; ``[(rows, result), ...]`` in row
        order."""
        work, dealt = self._split(batch, max_tokens, max_rows)
        per_rank = self._per_rank([(m, fn, self.compute_threads) for m, _ in work])
        results = self._all("forward_micro_batches", per_rank=per_rank)
        return row_results(dealt, [results[r] for r in self._leaders()])

    def save(
        self, root: str, step: int, *, client_state: Mapping[str, object], keep: int | None = None
    ) -> str:
        """A complete checkpoint of ``step`` under ``root`` (staging dir, then renamed)."""
        staging = str(ckpt.staging_dir(root, step))
        self._all("save_checkpoint", staging, dict(client_state))
        import ray

        return ray.get(
            self.workers[0].finalize_checkpoint.remote(root, step, dict(client_state), keep)
        )

    def load(self, directory: str) -> dict[str, Any]:
        """Resume every rank from ``directory``; returns the trainer state."""
        return self._all("load_checkpoint", directory)[0]

    def export_hf(self, directory: str, *, ema: bool = False) -> None:
        """A transformers checkpoint of the role's model (or its EMA) at ``directory``."""
        self._all("export_hf", directory, ema)

    def offload_states(self, *, weights: bool = True) -> list[dict[str, float]]:
        """Every rank's optimizer states, master weights and gradient partitions (and with
        ``weights`` its model weights) to host memory, e.g. while colocated engines
        generate (`DeepSpeedBackend.offload_states`); per rank, its CUDA allocations before
        and after."""
        return self._all("offload_states", weights)

    def reload_states(self) -> list[dict[str, float]]:
        """Undo `offload_states` on every rank."""
        return self._all("reload_states")

    def send_weights(self, *, kind: str, version: int, bucket_bytes: int) -> SentWeights:
        """The role's weights, stamped ``version``, streamed into rank 0's sender of the
        `rlhf.weights` transport ``kind`` (made on first use; a group transport's when its
        group formed) in buckets of at most ``bucket_bytes``; every rank takes part in the
        gathers. Returns rank 0's send (the sync for the engines, its seconds, metrics)."""
        return self._all("send_weights", kind, version, bucket_bytes)[0]

    def close_weight_sender(self, kind: str, *, wait: bool = True) -> list[ObjectRef[None]]:
        """Release rank 0's ``kind`` sender (what its last sync kept alive; a group's
        membership). ``wait=False``: started only, one object ref per rank (a rank runs its
        calls in order, so the next call comes after it)."""
        refs = [w.close_weight_sender.remote(kind) for w in self.workers]
        if wait:
            gather_ranks(refs)
            return []
        return refs

    def new_weight_group(self, *, kind: str, world_size: int) -> object:
        """The spec of a new group of the group transport ``kind`` with rank 0 as member 0
        (``world_size``: 1 + the engines), for the engines to join with `join_weight_group`
        beside rank 0's."""
        return self._all("new_weight_group", kind, world_size)[0]

    def join_weight_group(self, *, kind: str, group: object) -> None:
        """Rank 0 joins ``group`` as its sender; returns once every member joined."""
        self._all("join_weight_group", kind, group)

    def run(self, fn: Callable[..., T], *args: object) -> list[T]:
        """``fn(backend, *args)`` on every rank."""
        return self._all("run", fn, *args)

    def start_run(self, fn: Callable[..., T], *args: object) -> list[ObjectRef[T]]:
        """`run` without waiting: one object ref per rank (each resolves to the rank's
        result, or raises its error). A rank runs its calls in the order they are made."""
        return [w.run.remote(fn, *args) for w in self.workers]

    def num_threads(self) -> list[int]:
        """Every rank's torch intra-op threads now (outside its compute calls)."""
        return self._all("num_threads")

    def shutdown(self) -> None:
        """Kill the rank processes."""
        import ray

        for w in self.workers:
            ray.kill(w)
        self.workers = []
