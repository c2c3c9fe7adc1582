"""Engine options: validation, the CPU KV-cache size and the engine actors' environment
(pure functions; no engine starts)."""

import pytest

from rlhf.rollout import EngineConfig
from rlhf.rollout.config import AUTO_CPU_KV_CACHE_MAX_BYTES, cpu_kv_cache_bytes
from rlhf.rollout.ray_engine import _actor_env

QWEN2_SMALL = {  # head_dim from hidden_size / heads = 64
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "hidden_size": 896,
}


def test_cpu_kv_cache_is_sized_for_the_engines_concurrency() -> None:
    per_token = 2 * 24 * 2 * 64 * 8  # keys and values, every layer, 8 bytes each
    config = EngineConfig(model="m", max_model_len=64, max_num_seqs=16)
    assert cpu_kv_cache_bytes(config, QWEN2_SMALL) == per_token * 16 * 128  # one block each
    config = EngineConfig(model="m", max_model_len=129, max_num_seqs=16)
    assert cpu_kv_cache_bytes(config, QWEN2_SMALL) == per_token * 16 * 256  # two blocks each


def test_cpu_kv_cache_is_capped_but_holds_one_sequence() -> None:
    big = EngineConfig(model="m", max_model_len=4096, max_num_seqs=256)
    assert cpu_kv_cache_bytes(big, QWEN2_SMALL) == AUTO_CPU_KV_CACHE_MAX_BYTES
    deep = {**QWEN2_SMALL, "num_hidden_layers": 4000, "num_key_value_heads": 14}
    per_token = 2 * 4000 * 14 * 64 * 8
    one = EngineConfig(model="m", max_model_len=32, max_num_seqs=4)
    assert cpu_kv_cache_bytes(one, deep) == per_token * 128  # > 1 GiB: one sequence's worth


def test_cpu_kv_cache_explicit_size_and_unreadable_configs() -> None:
    config = EngineConfig(model="m", cpu_kv_cache_gib=0.25)
    assert cpu_kv_cache_bytes(config, QWEN2_SMALL) == 1 << 28
    assert cpu_kv_cache_bytes(EngineConfig(model="m"), {}) == AUTO_CPU_KV_CACHE_MAX_BYTES
    head_dim = {**QWEN2_SMALL, "head_dim": 128}  # explicit head_dim wins over hidden / heads
    c = EngineConfig(model="m", max_model_len=64, max_num_seqs=16)
    assert cpu_kv_cache_bytes(c, {"text_config": head_dim}) == 2 * 24 * 2 * 128 * 8 * 16 * 128


@pytest.mark.parametrize("bad", [0, -1.0])
def test_cpu_kv_cache_size_must_be_positive(bad) -> None:
    with pytest.raises(ValueError, match="vllm.cpu_kv_cache_gib must be > 0"):
        EngineConfig(model="m", cpu_kv_cache_gib=bad)


def test_engine_actor_environment() -> None:
    eager = EngineConfig(model="m")
    assert _actor_env(eager, None, gpu=False) == {"TORCH_COMPILE_DISABLE": "1"}
    assert _actor_env(eager, {"A": "1"}, gpu=True) == {"A": "1"}
    graphed = EngineConfig(model="m", enforce_eager=False)
    assert _actor_env(graphed, None, gpu=False) == {}
    assert _actor_env(eager, {"TORCH_COMPILE_DISABLE": "0"}, gpu=False) == {
        "TORCH_COMPILE_DISABLE": "0"
    }
