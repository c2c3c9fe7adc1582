"""One way to start or join Ray, for every command that needs it."""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

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


_LOCAL_INIT: dict[str, Any] = {
    # "local": a new cluster even where `ray start` left one running on this machine
    # (ray.init would join that one, then refuse num_cpus).
    "address": "local",
    # At least 8 CPUs: roles reserve CPUs for scheduling, and on a small machine (CI's 2
    # cores) an RL run's engine and learner ranks still need to start.
    "num_cpus": max(os.cpu_count() or 1, 8),
    "include_dashboard": False,
    "log_to_driver": False,
}

_early: list[tuple[threading.Event, list[BaseException]]] = []
"""`start_ray_early`'s start (set once ``ray.init`` returned) and the error it met, until
`start_ray` takes them."""


class _NoThreadWarning(logging.Filter):
    """Ray's note that ``ray.init`` off the main thread leaves SIGTERM alone: intended here
    (`rlhf.cli.stopping` owns the signals)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


def start_ray_early(*, address: str = "") -> None:
    """Begin starting the local cluster that `start_ray` would start, on a thread, so that
    Ray's processes come up while this process imports and prepares (Ray's start is mostly
    other processes' work: 2.5-4 s on a 2-core machine). `start_ray` waits for it and raises
    its error. Nothing happens when a cluster is to be joined or one is already connected.

    The thread stays (parked) for the life of the process: Ray starts its processes with
    ``PR_SET_PDEATHSIG``, which on Linux kills them when the *thread* that started them ends.
    """
    import ray

    if cluster_address(address)[0] or _early or ray.is_initialized():
        return
    done, errors = threading.Event(), []

    def init() -> None:
        quiet = _NoThreadWarning()
        logger = logging.getLogger("ray._private.worker")
        logger.addFilter(quiet)
        try:
            ray.init(**_LOCAL_INIT)
        except BaseException as exc:  # raised again by start_ray, in the caller's thread
            errors.append(exc)
        finally:
            logger.removeFilter(quiet)
            done.set()
        if not errors:
            threading.Event().wait()  # keep Ray's processes alive (see above)

    threading.Thread(target=init, name="rlhf-ray-start", daemon=True).start()
    _early.append((done, errors))


def settle_early_start() -> BaseException | None:
    """Wait until `start_ray_early`'s ``ray.init`` returned, if one runs; returns the error
    it met."""
    if not _early:
        return None
    done, errors = _early.pop()
    done.wait()
    return errors[0] if errors else None


def start_ray(*, address: str = "") -> Cluster:
    """Join the cluster at ``address`` (or ``RAY_ADDRESS``), else start a local one, unless
    this process is already connected to one (or `start_ray_early` began starting one: it is
    waited for); returns what the cluster has.

    A joined cluster is used as it is (its resources, its nodes): nothing is started. A local
    cluster announces at least 8 CPUs (`_LOCAL_INIT`).

    Raises:
        ConfigError: an address nothing answers at, naming where it came from.
    """
    import ray

    early_error = settle_early_start()
    if early_error is not None:
        raise early_error
    joined, source = cluster_address(address)
    if not ray.is_initialized():
        if joined:
            _check_reachable(joined, source)
            ray.init(address=joined, log_to_driver=False)
        else:
            ray.init(**_LOCAL_INIT)
    # ray.init, here or on start_ray_early's thread, installed Ray's SIGTERM handler, which
    # dumps a stack and arms a 3 s alarm that aborts the process mid-clean-up
    # (rlhf.cli.stopping): ours goes back in place.
    claim_signals()
    return Cluster(
        gpu=bool(ray.cluster_resources().get("GPU")),
        nodes=sum(1 for node in ray.nodes() if node.get("Alive")),
        nccl=importlib.util.find_spec("cupy") is not None,
        joined=joined,
    )
