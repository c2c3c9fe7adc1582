"""The weight sync of ``rlhf train``: the actor's weights into every engine.

The actor's ranks stream their parameters (`rlhf.learner.send_weights`: gathered one at a
time, packed into buckets as they fill, never a full state dict on one rank) into an
`rlhf.weights` transport's sender on rank 0; each engine receives the sync in its actor,
validates it whole, loads it and, with ``--vllm.verify_sync``, reads it back.

The transport is Ray's object store, which works for every placement on one node or many.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from rlhf.learner import LearnerGroup, send_weights
from rlhf.rollout import RayEngine
from rlhf.weights import ObjectStoreSender

BUCKET_BYTES = 64 << 20
"""Bucket size: large enough that per-bucket costs vanish, small enough to stream."""


@dataclasses.dataclass
class WeightSync:
    """Loads the actor's weights into the engines as a given version.

    Attributes:
        actor: The policy's ranks.
        engines: The engines to load into.
        verify: Read every weight back from each engine after loading (``--vllm.verify_sync``).
        bucket_bytes: Bucket size of the stream.
    """

    actor: LearnerGroup
    engines: Sequence[RayEngine]
    verify: bool
    bucket_bytes: int = BUCKET_BYTES

    def __call__(self, version: int) -> None:
        send = functools.partial(
            send_weights,
            sender=ObjectStoreSender(),
            version=version,
            bucket_bytes=self.bucket_bytes,
        )
        sync = self.actor.run(send)[0]
        for engine in self.engines:
            engine.update_weights_from(sync, verify=self.verify)
