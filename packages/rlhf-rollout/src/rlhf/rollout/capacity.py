"""Device memory of one vLLM engine GPU from the model's shape and the engine's options: the
KV cache left inside its share of the GPU (what a planner reports as tokens of KV cache)."""

from __future__ import annotations

from dataclasses import dataclass

RUNTIME_BYTES = 2**30
"""Per engine process, outside torch's allocator: the CUDA context and kernels' modules (the
learner planner counts the same, `rlhf.learner.capacity.RUNTIME_BYTES`)."""


@dataclass(frozen=True, kw_only=True)
class EngineLoad:
    """One vLLM engine GPU.

    Attributes:
        params: Parameters of the whole model.
        weight_bytes: Bytes per weight as served (``--vllm.dtype``).
        kv_bytes_per_token: Key and value bytes of one token over all layers, whole model.
        tp: Tensor-parallel degree of the engine.
        pp: Pipeline-parallel degree.
        kv_heads: Key/value heads (replicated when fewer than ``tp``).
        gpu_memory_utilization: The share of the GPU the engine takes.
        vocab: Vocabulary size (the sampler's logits).
        max_num_seqs: Sequences scheduled at once.
        hidden: ``h``.
        intermediate: ``i``.
        max_num_batched_tokens: Tokens of one scheduled step (``--vllm.max_num_batched_tokens``;
            unset: 2048, what vLLM 0.25 chose with our engine options on an H200).
    """

    params: int
    weight_bytes: int
    kv_bytes_per_token: int
    tp: int
    pp: int
    kv_heads: int
    gpu_memory_utilization: float
    vocab: int
    max_num_seqs: int
    hidden: int
    intermediate: int
    max_num_batched_tokens: int = 2048

    @property
    def weights(self) -> float:
        """Bytes of weights on one GPU (vLLM splits the head and embedding too)."""
        return self.weight_bytes * self.params / (self.tp * self.pp)

    @property
    def kv_per_token(self) -> float:
        """KV bytes per token on one GPU: heads split ``tp`` ways (replicated below one
        head per GPU), layers ``pp`` ways."""
        split = min(self.tp, self.kv_heads)
        return self.kv_bytes_per_token / (split * self.pp)

    @property
    def workspace(self) -> float:
        """What vLLM's profiling run peaks at besides the weights: a full scheduled batch's
        activations and the sampler's float32 logits."""
        tokens = self.max_num_batched_tokens
        act = 2 * tokens * (4 * self.hidden + 2 * self.intermediate) / self.tp
        return act + 4 * 2 * self.max_num_seqs * self.vocab / self.tp

    def kv_cache_bytes(self, gpu_bytes: float) -> float:
        """What is left for the KV cache inside the engine's share of the GPU."""
        share = self.gpu_memory_utilization * gpu_bytes
        return share - self.weights - self.workspace - RUNTIME_BYTES

    def kv_tokens(self, gpu_bytes: float) -> int:
        """Tokens the KV cache holds (0 when the weights do not fit in the share)."""
        return max(int(self.kv_cache_bytes(gpu_bytes) // self.kv_per_token), 0)
