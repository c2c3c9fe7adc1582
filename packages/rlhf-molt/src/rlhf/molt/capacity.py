"""Device and host memory of one molt (FSDP2) rank for a planner, in the terms of
`rlhf.learner.capacity` (`LearnerLoad` in, `Memory` out): float32 shards, AdamW moments,
float32 sharded gradients and the compute-dtype copies of the gathered layers, by offload
level. The fit and the H100 checks are described in `rlhf.learner.capacity`."""

from __future__ import annotations

from rlhf.learner.capacity import (
    ADAMW_HOST_STEP_BYTES_PER_PARAM,
    LearnerLoad,
    Memory,
    larger_peak,
)

ADAM_STEP_BYTES_PER_PARAM = 4
"""Structural, checked on an H100: torch's AdamW on the device (its multi-tensor path) makes a
float32 square root of the second moment of every parameter at once, so a molt ``offload
none`` step holds shards, moments and gradients plus ``4t / dp``: 20 bytes per parameter. A
4.35B model that fitted the backward by 8 GiB ran out of memory there (bench_capacity
``--largest``)."""


def molt_memory(
    load: LearnerLoad, *, offload: str, param_dtype_bytes: int, reshard_after_forward: bool
) -> Memory:
    """One FSDP2 rank: float32 shards (``4p / dp``), AdamW moments (``8p / dp``), float32
    sharded gradients, and the compute-dtype copies of the gathered layers."""
    p, t, dp = load.rank_params, load.rank_trainable, load.dp
    shards = 4 * p / dp
    adam = 8 * t / dp if load.trains else 0.0
    gradients = 4 * t / dp if load.trains else 0.0
    copies = 0.0
    if param_dtype_bytes != 4 or dp > 1:  # the unsharded compute copies
        held = p if not reshard_after_forward else 2 * load.layer_params / load.tp
        copies = param_dtype_bytes * (held + load.embedding_params)
    on_device = offload != "full"
    host = 0.0
    if offload == "optimizer":  # pageable masters and moments; one gradient at a time
        host = shards + adam + (4 * load.largest_trained / dp if load.trains else 0.0)
    elif offload == "full":  # FSDP2 pins each shard and each gradient on its own
        host = load.pinned_per_tensor(4) + adam
        if load.trains:
            largest = load.largest_trained / dp
            host += (
                load.pinned_per_tensor(4, trained=True) + ADAMW_HOST_STEP_BYTES_PER_PARAM * largest
            )
    backward = {
        "weights": (shards if on_device else 0.0) + copies,
        "optimizer states": adam if offload == "none" else 0.0,
        "gradients": gradients if on_device else 0.0,
        "activations": load.activations(),
    }
    step: dict[str, float] = {}
    if offload == "none" and load.trains:
        # The step, after the activations and the gathered copies are freed.
        step = {
            "weights": shards,
            "optimizer states": adam,
            "gradients": gradients,
            "optimizer step": ADAM_STEP_BYTES_PER_PARAM * t / dp,
        }
    return Memory(parts=larger_peak(backward, step), host=host)
