"""One way to start or join Ray, for every command that needs it."""

from __future__ import annotations

import importlib.util
import os
import socket
from dataclasses import dataclass

from rlhf.cli.config import ConfigError
from rlhf.cli.stopping import claim_signals


@dataclass(frozen=True)
class Cluster:
    """What a command needs to know about the Ray cluster it runs on.

    Attributes:
        gpu: The cluster has GPUs.
        nodes: Alive nodes.
        nccl: CuPy's NCCL bindings import here (the NCCL weight broadcast can run).
        joined: The address of the running cluster this process joined ("" when it started
            a local one).
    """

    gpu: bool
    nodes: int
    nccl: bool
    joined: str = ""

    def describe(self) -> str:
        """One line for the plan."""
        where = f"joined the cluster at {self.joined}" if self.joined else "a local cluster"
        return f"{where}, {self.nodes} node(s){', GPUs' if self.gpu else ''}"


def cluster_address(flag: str) -> tuple[str, str]:
    """The address to join and where it came from (``--ray.address``, else ``RAY_ADDRESS``);
    ``("", "")`` for a local cluster."""
    if flag:
        return flag, "--ray.address"
    env = os.environ.get("RAY_ADDRESS", "")
    return (env, "RAY_ADDRESS") if env else ("", "")


def _check_reachable(address: str, source: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a head that does not answer (``ray.init`` retries for minutes)."""
    if address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(
            f"{source} {address!r}: expected host:port of the Ray head, auto, or ray://host:port"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(
            f"{source} {address!r}: no Ray head answers there ({e.strerror or e}); start one "
            "(ray start --head) or fix the address"
        ) from None


def start_ray(*, address: str = "") -> Cluster:
    """Join the cluster at ``address`` (or ``RAY_ADDRESS``), else start a local one, unless
    this process is already connected to one; returns what the cluster has.

    A joined cluster is used as it is (its resources, its nodes): nothing is started. A local
    cluster announces at least 8 CPUs: roles reserve CPUs for scheduling, and on a small
    machine (CI's 2 cores) an RL run's engine and learner ranks still need to start.

    Raises:
        ConfigError: an address nothing answers at, naming where it came from.
    """
    import ray

    joined, source = cluster_address(address)
    if not ray.is_initialized():
        if joined:
            _check_reachable(joined, source)
            ray.init(address=joined, log_to_driver=False)
        else:
            ray.init(
                # "local": a new cluster even where `ray start` left one running on this
                # machine (ray.init would join that one, then refuse num_cpus).
                address="local",
                num_cpus=max(os.cpu_count() or 1, 8),
                include_dashboard=False,
                log_to_driver=False,
            )
        claim_signals()  # ray.init installed its own SIGTERM handler (rlhf.cli.stopping)
    return Cluster(
        gpu=bool(ray.cluster_resources().get("GPU")),
        nodes=sum(1 for node in ray.nodes() if node.get("Alive")),
        nccl=importlib.util.find_spec("cupy") is not None,
        joined=joined,
    )
