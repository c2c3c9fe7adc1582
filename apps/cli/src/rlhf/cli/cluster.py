"""One way to start Ray, for every command that needs it."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Cluster:
    """What a command needs to know about the Ray cluster it runs on.

    Attributes:
        gpu: The cluster has GPUs.
        nodes: Alive nodes.
        nccl: CuPy's NCCL bindings import here (the NCCL weight broadcast can run).
    """

    gpu: bool
    nodes: int
    nccl: bool


def start_ray() -> Cluster:
    """Start a local Ray cluster unless this process is already connected to one; returns
    what the cluster has.

    A local cluster announces at least 8 CPUs: roles reserve CPUs for scheduling, and on a
    small machine (CI's 2 cores) an RL run's engine and learner ranks still need to start.
    """
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=max(os.cpu_count() or 1, 8),
            include_dashboard=False,
            log_to_driver=False,
        )
    return Cluster(
        gpu=bool(ray.cluster_resources().get("GPU")),
        nodes=sum(1 for node in ray.nodes() if node.get("Alive")),
        nccl=importlib.util.find_spec("cupy") is not None,
    )
