"""What every backend's rank does the same way, whatever shards its model (DeepSpeed, FSDP2).

- the process: `default_process_env` (a single-process group when no launcher set one),
  `leave_group_at_exit`, `rank_device`, `allocated_gib`;
- the passes: `most_passes` (every rank runs as many forwards/backwards as the busiest one),
  `train_passes` (weighted micro-batches, weight-0 padding passes, the metrics a driver merges)
  and `forward_passes` (results on the CPU, padding passes dropped);
- the EMA of the trainable weights: `ema_update`, `ema_swapped` and its checkpoint files
  (`save_ema`, `load_ema`);
- `gather_on_rank0`: a full state from a stream of whole parameters.

Backends differ in how a loss is backpropagated, where a rank's stored values live and how a
whole parameter is gathered; those come in as callables.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import pathlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar, cast

import torch
from torch import Tensor

from rlhf.learner.backend import Objective
from rlhf.learner.batch import Batch
from rlhf.learner.checkpoint import CheckpointError, load_tensors, save_tensors
from rlhf.learner.config import ModelConfig
from rlhf.weights.ports import free_port

NamedParams = Iterable[tuple[str, torch.nn.Parameter]]

T = TypeVar("T")


def default_process_env() -> bool:
    """Describe a single-process group (rank 0 of 1 on a free local port) unless RANK is set;
    True when it did."""
    if "RANK" in os.environ:
        return False
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    return True


def leave_group_at_exit() -> None:
    """Destroy the default process group when the interpreter exits (once per process).

    A group left for interpreter teardown is destroyed while its store and worker threads are
    torn down around it; that can abort the process ("terminate called without an active
    exception", exit -6) after its work finished. The backends call it for the single-process
    group they make themselves (a launcher's ranks leave their group as the launcher decides)."""
    global _LEAVING
    if not _LEAVING:
        _LEAVING = True
        atexit.register(_leave_group)


_LEAVING = False


def _leave_group() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def rank_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` (made current) when there is a GPU, else CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def allocated_gib(device: torch.device) -> float:
    """This process's CUDA allocations on ``device`` in GiB (0 on CPU)."""
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def place(batch: Batch, model: ModelConfig, device: torch.device) -> Batch:
    """``batch`` on ``device``, carrying the model's forward options (padding-free packing,
    chunked lm_head) to the objectives' forward functions."""
    return dataclasses.replace(
        batch.to(device),
        packing_samples=model.packing_samples,
        chunked_lm_head=model.chunked_lm_head,
    )


def most_passes(count: int, *, world_size: int, device: torch.device) -> int:
    """The passes every rank must run: the most any rank has (a collective)."""
    if world_size == 1:
        return count
    n = torch.tensor([count], dtype=torch.long, device=device)
    torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MAX)
    return int(n.item())


def train_passes(
    micro_batches: Sequence[Batch],
    objective: Objective,
    *,
    runner: torch.nn.Module,
    passes: int,
    weights: Sequence[float] | None,
    placed: Callable[[Batch], Batch],
    backward: Callable[[Tensor, float], None],
) -> dict[str, float]:
    """Forward and backward of every micro-batch of this rank, then weight-0 repeats of the
    first up to ``passes``; ``backward(loss, w)`` backpropagates a micro-batch's loss with its
    weight ``w`` (the backend applies its data-parallel scale). Returns ``loss`` (the sum of
    ``loss * w``: this rank's share of the global loss) and every other metric over the
    micro-batches of weight > 0 that report it: the largest of a ``*_max`` metric, the mean
    of the others."""
    scale = [1.0] * len(micro_batches) if weights is None else list(weights)
    loss_total = 0.0
    seen: dict[str, list[float]] = {}
    for i in range(passes):
        real = i < len(micro_batches)
        w = scale[i] if real else 0.0
        loss, metrics = objective(runner, placed(micro_batches[i if real else 0]))
        backward(loss, w)
        if real and w > 0:
            loss_total += float(loss.detach()) * w
            for k, v in metrics.items():
                seen.setdefault(k, []).append(float(v))
    out = {k: combine_metric(k, values) for k, values in seen.items()}
    out["loss"] = loss_total
    return out


def combine_metric(name: str, values: Sequence[float]) -> float:
    """One value of metric ``name`` from several micro-batches or ranks: the largest for a
    ``*_max`` metric, else the mean."""
    return max(values) if name.endswith("_max") else sum(values) / len(values)


def forward_passes(
    micro_batches: Sequence[Batch],
    fn: Callable[[torch.nn.Module, Batch], T],
    *,
    runner: torch.nn.Module,
    passes: int,
    placed: Callable[[Batch], Batch],
) -> list[T]:
    """``fn(runner, batch)`` per micro-batch without gradient (repeating the last up to
    ``passes``); the results of the real ones, on the CPU."""
    out = []
    with torch.no_grad():
        for i in range(passes):
            result = fn(runner, placed(micro_batches[min(i, len(micro_batches) - 1)]))
            if i < len(micro_batches):
                out.append(to_cpu(result))
    return out


def to_cpu(value: T) -> T:
    """Tensors in ``value`` (nested tuples, lists, dicts) detached on the CPU; a DTensor
    gathered whole first."""
    # Each branch rebuilds the structure it was given (same type, tensors moved).
    if isinstance(value, Tensor):
        full_tensor: Callable[[], Tensor] | None = getattr(value, "full_tensor", None)
        whole = full_tensor() if callable(full_tensor) else value
        return cast(T, whole.detach().cpu())
    if isinstance(value, tuple):
        return cast(T, tuple(to_cpu(v) for v in value))
    if isinstance(value, list):
        return cast(T, [to_cpu(v) for v in value])
    if isinstance(value, dict):
        return cast(T, {k: to_cpu(v) for k, v in value.items()})
    return value


# -- EMA of the trainable weights -----------------------------------------------------------
def ema_init(named_locals: Iterable[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """A float32 copy of each trainable weight's stored values (this rank's shard)."""
    return {name: local.detach().float().clone() for name, local in named_locals}


def ema_update(
    ema: dict[str, Tensor], named_locals: Iterable[tuple[str, Tensor]], decay: float
) -> None:
    """``ema = decay * ema + (1 - decay) * weight`` for each trainable weight."""
    with torch.no_grad():
        for name, local in named_locals:
            ema[name].mul_(decay).add_(local.float(), alpha=1 - decay)


@contextlib.contextmanager
def ema_swapped(
    ema: dict[str, Tensor] | None,
    params: Callable[[], NamedParams],
    *,
    local: Callable[[torch.nn.Parameter], Tensor],
    release: Callable[[torch.nn.Parameter], None] = lambda _p: None,
) -> Iterator[None]:
    """The EMA in the trainable weights' stored values while open (``local(p)``: where a
    rank stores ``p``; ``release(p)``: drop a gathered copy so the next read sees the
    change), the weights back on exit."""
    if ema is None:
        raise RuntimeError("no EMA weights: set optimizer.ema_decay")
    saved = {}
    with torch.no_grad():
        for name, param in params():
            stored = local(param)
            saved[name] = stored.clone()
            stored.copy_(ema[name].to(stored.dtype))
            release(param)
    try:
        yield
    finally:
        with torch.no_grad():
            for name, param in params():
                local(param).copy_(saved[name])
                release(param)


def save_ema(directory: str, rank: int, ema: dict[str, Tensor]) -> None:
    """This rank's EMA into ``directory/ema/rank-<rank>.safetensors``."""
    (pathlib.Path(directory) / "ema").mkdir(exist_ok=True)
    save_tensors(pathlib.Path(directory) / "ema" / f"rank-{rank}.safetensors", ema)


def load_ema(directory: str, rank: int) -> dict[str, Tensor]:
    """What `save_ema` wrote for ``rank`` (read without unpickling), or a `CheckpointError`."""
    file = pathlib.Path(directory) / "ema" / f"rank-{rank}.safetensors"
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint {directory} has no EMA weights of rank {rank}; it was saved without "
            "optimizer.ema_decay or with another number of ranks"
        )
    tensors, _ = load_tensors(file, what=f"the EMA weights of rank {rank}")
    return tensors


def gather_on_rank0(
    named_whole: Iterable[tuple[str, Tensor]], rank: int
) -> dict[str, Tensor] | None:
    """The stream of whole parameters as a CPU state dict at rank 0 (None elsewhere; every
    rank consumes the stream, whose gathers are collective)."""
    out: dict[str, Tensor] | None = {} if rank == 0 else None
    for name, tensor in named_whole:
        if out is not None:
            out[name] = tensor.detach().to("cpu", copy=True)
    return out
