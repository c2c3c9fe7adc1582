"""Transports that move a weight sync's buckets from the learner to the engines.

``host``: shared memory (same machine) and the Ray object store (any machine), used on CPU and
in CI. ``cuda_ipc``: a GPU buffer shared by handle with a colocated engine. ``nccl``: a
broadcast through CuPy's NCCL bindings to engines on other GPUs. Each moves buffers only; the
bucket headers (`rlhf.rollout.BucketHeader`) travel beside them and the receiver validates the
whole sync before loading it.
"""
