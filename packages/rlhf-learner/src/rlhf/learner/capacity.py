"""Device memory of one learner rank, from the model's shape (`rlhf.learner.model_shape`) and
the role's options alone: the arithmetic a planner multiplies (``rlhf train … --dry_run``).
The molt backend's model is `rlhf.molt.capacity`, a vLLM engine's `rlhf.rollout.capacity`.

Model states are counted exactly (bytes per parameter of each copy a backend keeps);
activations follow the transformer's structure with constants fitted to peaks measured on an
H200 (`ACTIVATION_LAYER_SCALE`, `LOGITS_BYTES_PER_VOCAB`, `FORWARD_LOGITS_BYTES_PER_VOCAB`; the
measurements and the fit are
in benchmarks/README.md, `bench_capacity.py`). Byte counts are what torch's allocator holds;
`RUNTIME_BYTES` and `FRAGMENTATION` add what it does not show.

Learner ranks (``p``: parameters on the rank after tensor parallelism, ``dp``: data-parallel
replicas, ``w``: bytes of the compute dtype):

============================  ===================  ==================  ==================
DeepSpeed, bf16               weights              optimizer states    gradients (backward)
============================  ===================  ==================  ==================
ZeRO-0                        ``2p``               ``12p`` (fp32       ``2p``
                                                   master + Adam)
ZeRO-1 / ZeRO-2               ``2p``               ``12p / dp``        ``2p`` / ``2p / dp``
ZeRO-3                        ``2p / dp`` + the    ``12p / dp``        ``2p / dp``
                              gathered layers
``offload_optimizer``         as above             0 (host)            one reduce bucket
                                                                       (ZeRO-1/2: and the
                                                                       largest parameter)
============================  ===================  ==================  ==================

A bf16 rank's peak is the larger of the backward's (the table and the activations) and the
optimizer step's (the table without activations, plus ``8t / dp``: `STEP_BYTES_PER_PARAM`).

In float32 (``w`` 4) ZeRO-1/2/3 still keep their own flat float32 partitions beside the
model's weights (``16p`` in all at ZeRO-2, one rank); ZeRO-0 steps torch's AdamW on the
weights themselves (``12p``).

molt (FSDP2, float32 shards, bf16 compute): ``offload none`` keeps ``12p / dp`` (shards and
Adam) and ``4p / dp`` float32 gradients, and its optimizer step adds ``4t / dp``
(`ADAM_STEP_BYTES_PER_PARAM`); ``optimizer`` keeps the ``4p / dp`` shards and the gradients
(masters and Adam on the host, stepped one parameter at a time); ``full`` keeps neither.

Host memory (offloaded states, without the process's own few GiB) is DeepSpeed 0.19's and
FSDP2's buffers as their sources allocate them on a GPU, where they are pinned and torch's
pinned allocator rounds each buffer up to a power of two (`pinned`): see
`_deepspeed_offloaded_optimizer` for ``offload_optimizer``; ``offload_params`` pins each
parameter's partition and, for a trained role, its optimizer pins a flat copy of them too
(the allocator keeps the first blocks after the copy); molt
``optimizer`` keeps pageable float32 masters and moments (``12t / dp``) and one gradient;
``full`` pins every shard and every gradient on its own. Checked on an H100 against the peak
resident memory of one PPO step of 6-33 layers of Qwen2.5-7B width (bench_capacity
``--largest``; data in tests/data/measured_peaks.json): measured / planned 0.99-1.07.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
"""Bytes per element of the dtypes a config's ``torch_dtype`` / ``dtype`` names."""

GIB = 2**30

ACTIVATION_LAYER_SCALE = 0.83
"""Fitted: saved activations of one decoder layer are ``ACTIVATION_LAYER_SCALE * (36 h + 8 i)``
bytes per token in bf16 (the structural count: norms kept in float32 and the attention's
hidden-sized tensors ``36 h``; gate, up, activation and product of the MLP ``8 i``)."""

LOGITS_BYTES_PER_VOCAB = 4.5
"""Fitted: bytes per token per vocabulary entry held by the output head and the log-prob path
at the backward's peak (bf16 logits and their gradient, and a float32 chunk)."""

FORWARD_LOGITS_BYTES_PER_VOCAB = 3.5
"""Fitted: the same for a forward without gradient (the reference's log-probs: bf16 logits
and a float32 chunk of the log-softmax)."""


def pinned(nbytes: float) -> float:
    """Host bytes one CUDA-pinned buffer of ``nbytes`` takes: torch's pinned-memory allocator
    rounds each block up to a power of two (a 7B-width model's float32 masters pinned one block
    per tensor take 1.9x their bytes, computed from its shapes)."""
    return float(2 ** math.ceil(math.log2(nbytes))) if nbytes > 0 else 0.0


STEP_BYTES_PER_PARAM = 8
"""Structural, checked against held-out peaks: besides the weights, the optimizer states and the
bf16 gradient partition, a DeepSpeed bf16 rank's optimizer step holds a float32 copy of its
gradient partition (4 bytes per trained parameter) and one float32 temporary of AdamW's update
(4): ``8t / dp``. With few activations (gradient checkpointing, one row) this, not the
backward, is the rank's peak: 24 bytes per parameter at 1.5B on one rank (34.57 GiB measured
alike at one row, two and four checkpointed rows)."""

ADAMW_HOST_STEP_BYTES_PER_PARAM = 8
"""Structural: torch's AdamW on host tensors (its single-tensor path) divides a square root
of the second moment by a scalar, so one parameter's step holds two float32 temporaries of
its size at once."""

DEEPSPEED_SUB_GROUP = 1_000_000_000
"""DeepSpeed's default ``zero_optimization.sub_group_size`` (elements): ZeRO-3 steps its
optimizer one sub-group of the partition at a time (the backend keeps the default)."""

FLOOR_BYTES = int(0.064 * GIB)
"""Measured: what torch's allocator holds in every process once a matmul ran (cuBLAS
workspaces), before and after any backend."""

RUNTIME_BYTES = 1 * GIB
"""Per process, outside torch's allocator: the CUDA context and kernels' modules."""

FRAGMENTATION = 0.10
"""Headroom on the allocator's bytes for its fragmentation (a plan that fits only without it
is reported as not fitting)."""


@dataclass(frozen=True, kw_only=True)
class Memory:
    """One process's device memory, in bytes, by what holds it.

    Attributes:
        parts: ``{"weights": …, "gradients": …, "optimizer states": …, "activations": …}``
            as the allocator would hold them at the process's peak.
        host: Bytes the process keeps in host memory (offloaded states, sleeping weights).
    """

    parts: dict[str, float]
    host: float = 0.0

    @property
    def allocated(self) -> float:
        """What torch's allocator holds at the peak."""
        return sum(self.parts.values()) + FLOOR_BYTES

    @property
    def total(self) -> float:
        """What the device must have free: the allocator's peak with its fragmentation
        headroom, and the runtime outside it."""
        return self.allocated * (1 + FRAGMENTATION) + RUNTIME_BYTES

    def describe(self) -> str:
        """``41.2 GiB (weights 2.9 + … ; host 0.0)``."""
        parts = ", ".join(
            f"{name} {value / GIB:.1f}" for name, value in self.parts.items() if value
        )
        host = f"; host {self.host / GIB:.1f} GiB" if self.host else ""
        return f"{self.total / GIB:.1f} GiB ({parts}, runtime and headroom{host})"


@dataclass(frozen=True, kw_only=True)
class LearnerLoad:
    """What one learner rank holds and computes.

    Attributes:
        params: Parameters of the whole model.
        layer_params: Parameters of one decoder layer.
        embedding_params: Input embedding plus an untied output head.
        vocab_matrix: One vocabulary x hidden matrix (the embedding, or the head): what
            ZeRO-3 gathers whole for the first or the last step of a forward.
        hidden: ``h``.
        intermediate: ``i``.
        layers: ``L``.
        outputs: Width of the output head: the vocabulary for a policy, 1 for a value or
            score head.
        tokens: Tokens of one micro-batch on this rank (rows x padded length, or the packed
            budget), before context-parallel splitting.
        trains: False for eval-only roles (the reference, a reward model): no gradients, no
            optimizer, no activations kept for a backward.
        trainable: Parameters the optimizer updates (all, or the LoRA adapters').
        tp: Tensor-parallel degree.
        cp: Context-parallel degree (ring attention): the sequence is split this many ways.
        dp: Data-parallel replicas.
        compute_bytes: 2 for bf16 compute, 4 for float32.
        gradient_checkpointing: Only each layer's input is kept; one layer is recomputed at a
            time in the backward.
        logits_held: False with the chunked output head (no logits tensor is kept).
        layer_tensors: Elements of each parameter tensor of one decoder layer
            (`ModelShape.layer_tensors`), for host buffers pinned one per tensor; empty:
            such buffers are counted without their rounding.
        other_tensors: The same for the embedding, an untied head and the final norm.
    """

    params: int
    layer_params: int
    embedding_params: int
    vocab_matrix: int
    hidden: int
    intermediate: int
    layers: int
    outputs: int
    tokens: int
    trains: bool = True
    trainable: int | None = None
    tp: int = 1
    cp: int = 1
    dp: int = 1
    compute_bytes: int = 2
    gradient_checkpointing: bool = False
    logits_held: bool = True
    layer_tensors: tuple[int, ...] = ()
    other_tensors: tuple[int, ...] = ()

    @property
    def rank_params(self) -> int:
        """Parameters on one rank: the decoder layers split ``tp`` ways, the rest (embedding,
        untied head, final norm) whole."""
        decoder = self.layers * self.layer_params
        return self.params - decoder + -(-decoder // self.tp)

    @property
    def rank_trainable(self) -> int:
        """Trained parameters on one rank."""
        if self.trainable is None:
            return self.rank_params
        return -(-self.trainable // self.tp)

    def rank_tensors(self) -> tuple[int, ...]:
        """Elements of each parameter tensor on one rank before data-parallel sharding: the
        decoder layers' split ``tp`` ways, the others whole (empty without the tensor lists)."""
        layer = tuple(-(-n // self.tp) for n in self.layer_tensors)
        return layer * self.layers + self.other_tensors

    @property
    def largest_tensor(self) -> int:
        """Elements of the rank's largest parameter tensor (the vocabulary matrix without the
        tensor lists)."""
        return max(self.rank_tensors(), default=self.vocab_matrix)

    @property
    def largest_trained(self) -> int:
        """Elements of the rank's largest trained tensor (at most all of LoRA's adapters)."""
        if self.trainable is None:
            return self.largest_tensor
        return min(self.largest_tensor, self.rank_trainable)

    def pinned_per_tensor(
        self, element_bytes: int, *, sharded: bool = True, trained: bool = False
    ) -> float:
        """Host bytes of one pinned buffer per parameter tensor of this rank, each rounded up
        by `pinned`: of its ``1 / dp`` shard (FSDP2, DeepSpeed's ZeRO-3 partitions), or of the
        whole tensor for ``1 / dp`` of the tensors (``sharded`` False: DeepSpeed's ZeRO-1/2
        buffers per parameter). Without the tensor lists, and for LoRA's adapters (``trained``
        with ``trainable`` set), their bytes unrounded."""
        tensors = self.rank_tensors()
        if (trained and self.trainable is not None) or not tensors:
            count = self.rank_trainable if trained else self.rank_params
            return element_bytes * count / self.dp
        if sharded:
            return sum(pinned(element_bytes * -(-n // self.dp)) for n in tensors)
        return sum(pinned(element_bytes * n) for n in tensors) / self.dp

    def activations(self) -> float:
        """Bytes of activations at the backward's peak (forward-only roles: one layer's worth
        and the logits)."""
        h, i, tokens = self.hidden, self.intermediate, -(-self.tokens // self.cp)
        scale = ACTIVATION_LAYER_SCALE * self.compute_bytes / 2
        layer = scale * (20 * h + (16 * h + 8 * i) / self.tp) * tokens
        per_vocab = LOGITS_BYTES_PER_VOCAB if self.trains else FORWARD_LOGITS_BYTES_PER_VOCAB
        head = per_vocab * self.outputs * tokens if self.logits_held else 0.0
        if not self.trains:
            return layer + head
        if self.gradient_checkpointing:
            return self.layers * self.compute_bytes * h * tokens + layer + head
        return self.layers * layer + head


def deepspeed_memory(
    load: LearnerLoad,
    *,
    zero_stage: int,
    offload_optimizer: bool,
    offload_params: bool,
    reduce_bucket_elements: int = 500_000_000,
) -> Memory:
    """One DeepSpeed rank (bf16 when ``load.compute_bytes`` is 2: bf16 weights and
    gradients, float32 masters; float32 otherwise: the weights are the masters)."""
    p, t, w, dp = load.rank_params, load.rank_trainable, load.compute_bytes, load.dp
    masters = 4 * t if w == 2 or zero_stage >= 1 else 0  # ZeRO's flat float32 partitions
    states = (masters + 8 * t) / (dp if zero_stage >= 1 else 1) if load.trains else 0.0
    weights = 0.0 if offload_params else w * p / (dp if zero_stage == 3 else 1)
    gathered = 0.0
    if zero_stage == 3:  # the layers gathered around the one computing, and the head
        gathered = w * (2 * load.layer_params / load.tp + load.vocab_matrix)
    if not load.trains:
        gradients = 0.0
    elif offload_optimizer:  # one reduce bucket; ZeRO-1/2 stage the largest gradient too
        gradients = min(w * t, w * reduce_bucket_elements)
        if zero_stage in (1, 2):
            gradients += w * load.largest_trained
    else:
        gradients = w * t / (dp if zero_stage >= 2 else 1)
    host = 0.0
    if offload_optimizer and load.trains:
        host += _deepspeed_offloaded_optimizer(load, zero_stage=zero_stage)
        states = 0.0
    if offload_params:  # each parameter's partition; a trained role's optimizer adds a flat one
        host += load.pinned_per_tensor(w) + (pinned(w * p / dp) if load.trains else 0.0)
    backward = {
        "weights": weights,
        "gathered layers": gathered,
        "optimizer states": states,
        "gradients": gradients,
        "activations": load.activations(),
    }
    step: dict[str, float] = {}
    if load.trains and states and w == 2 and zero_stage >= 1:
        # The optimizer step, after the activations are freed.
        step = {
            "weights": weights,
            "optimizer states": states,
            "gradients": gradients,
            "optimizer step": STEP_BYTES_PER_PARAM * t / dp,
        }
    return Memory(parts=larger_peak(backward, step), host=host)


def _deepspeed_offloaded_optimizer(load: LearnerLoad, *, zero_stage: int) -> float:
    """Host bytes of a DeepSpeed rank's ``offload_optimizer`` states (DeepSpeed 0.19, pinned
    buffers as on a GPU; ``t``: the rank's partition of the trained parameters).

    ZeRO-1/2 (stage_1_and_2): float32 masters, their compute-dtype staging copy and float32
    gradients, one pinned buffer each; a pinned compute-dtype buffer of the largest
    parameter's gradient; one pinned buffer per parameter that accumulates its gradient over
    a step's micro-batches (made once a step has more than one; counted always); AdamW's
    moments ``8t`` and the temporaries of torch's AdamW on the one flat partition ``8t``
    (its square root of the second moment and the quotient, both whole).

    ZeRO-3 (stage3): the float32 gradients pinned once flat and once per optimizer sub-group
    (`DEEPSPEED_SUB_GROUP` elements), the float32 masters and the moments, pageable."""
    t, w = load.rank_trainable / load.dp, load.compute_bytes
    if zero_stage in (1, 2):
        buffers = pinned(4 * t) + pinned(w * t) + pinned(4 * t) + pinned(w * load.largest_trained)
        accumulation = load.pinned_per_tensor(w, sharded=False, trained=True)
        return buffers + accumulation + 8 * t + ADAMW_HOST_STEP_BYTES_PER_PARAM * t
    full, rest = divmod(int(t), DEEPSPEED_SUB_GROUP)
    sub_groups = full * pinned(4 * DEEPSPEED_SUB_GROUP) + pinned(4 * rest)
    return pinned(4 * t) + sub_groups + 4 * t + 8 * t


def larger_peak(backward: dict[str, float], step: dict[str, float]) -> dict[str, float]:
    """The rank's peak: the backward's parts or, where it holds more, the optimizer step's
    (``step`` empty where the step cannot be the peak)."""
    return step if sum(step.values()) > sum(backward.values()) else backward
