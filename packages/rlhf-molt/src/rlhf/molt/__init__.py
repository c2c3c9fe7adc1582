"""rlhf.molt: the FSDP2/DTensor learner backend.

`FSDPBackend` implements `rlhf.learner.Backend` with PyTorch's own FSDP2 (``fully_shard``),
DTensor and distributed checkpoints; hand it to a role as a factory
(``LearnerGroup.build(config, backend=functools.partial(FSDPBackend, fsdp=FSDPConfig()))``).
It depends on torch, transformers, `rlhf.learner` and `rlhf.algos` only.
"""

from rlhf.molt.backend import FSDPBackend, init_distributed
from rlhf.molt.config import OFFLOAD_LEVELS, PARAM_DTYPES, FSDPConfig, FSDPConfigError

__all__ = [
    "OFFLOAD_LEVELS",
    "PARAM_DTYPES",
    "FSDPBackend",
    "FSDPConfig",
    "FSDPConfigError",
    "init_distributed",
]
