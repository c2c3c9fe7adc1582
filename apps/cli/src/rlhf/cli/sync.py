"""The weight sync of ``rlhf train``: the actor's weights into every engine, over the
`rlhf.weights` transport the placement calls for (``--train.weight_transport``).

Every sync streams: the actor's ranks gather one parameter at a time
(`rlhf.learner.send_weights`) and rank 0 packs buckets of ``--train.weight_bucket_mib`` as
they fill into the transport's sender; no rank holds a full state dict. Each engine receives
the sync in its actor, validates it whole (bucket and tensor checksums), loads it and reads
back what ``--vllm.verify_sync`` asks for.

The transports and their facts are `rlhf.weights`' registry; ``auto`` takes the one that
serves the placement best (`choose_transport`, `rlhf.weights.choose`): CUDA IPC when the one
engine shares the actor's GPU (``--train.colocate_all``), an NCCL broadcast when engines sit
on other GPUs (CuPy needed; without it, the object store), shared memory on one CPU machine,
and Ray's object store when the cluster spans several CPU nodes. The actor's rank 0 keeps its
sender (`rlhf.learner.RankSenders`); `rlhf.weights.drivers` drives the syncs and handles
engines that die during one; this module picks the transport.
"""

from __future__ import annotations

from rlhf.cli.config import ConfigError
from rlhf.cli.sections import WEIGHT_TRANSPORTS
from rlhf.weights import Placement, choose, transport


def bucket_mib(requested: int, kind: str) -> int:
    """``--train.weight_bucket_mib`` for transport ``kind``: as requested, or the
    transport's own (`rlhf.weights.TransportSpec.bucket_mib`) when 0."""
    return requested or transport(kind).bucket_mib


def choose_transport(
    requested: str,
    *,
    gpu: bool,
    colocated: bool,
    num_engines: int,
    nodes: int,
    nccl: bool,
) -> tuple[str, str]:
    """The transport to use and why (for the plan).

    Args:
        requested: ``--train.weight_transport``.
        gpu: The cluster has GPUs.
        colocated: The engines share the learners' GPUs (``--train.colocate_all``).
        num_engines: ``--vllm.num_engines``.
        nodes: Alive nodes of the Ray cluster.
        nccl: CuPy's NCCL bindings are importable on the cluster.

    Raises:
        ConfigError: a requested transport that cannot reach the engines, naming the flag.
    """
    if requested not in WEIGHT_TRANSPORTS:
        raise ConfigError(f"--train.weight_transport must be one of {WEIGHT_TRANSPORTS}")
    where = Placement(gpu=gpu, colocated=colocated, num_engines=num_engines, nodes=nodes)
    try:
        spec, why = choose(requested, where, installed=lambda module: module != "cupy" or nccl)
    except ValueError as exc:
        raise ConfigError(f"--train.weight_transport {exc}") from None
    return spec.name, why
