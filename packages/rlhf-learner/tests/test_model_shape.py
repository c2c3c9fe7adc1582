"""`ModelShape`: a decoder's sizes from its config.json alone, against the parameters and the
KV cache of the real transformers models, and each unreadable config named by its flag."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlhf.learner import ModelLoadError, check_model_dir
from rlhf.learner.model_shape import ModelShape

TINY = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 384,
}


def _configs() -> dict[str, object]:
    return {
        "qwen2-tied": Qwen2Config(**TINY, tie_word_embeddings=True),
        "qwen2-untied": Qwen2Config(**TINY, tie_word_embeddings=False),
        "llama-no-bias": LlamaConfig(**TINY, tie_word_embeddings=False),
        "llama-bias-head-dim": LlamaConfig(**TINY, attention_bias=True, head_dim=32),
    }


def _shape_of(config: object, tmp_path: pathlib.Path) -> ModelShape:
    config.save_pretrained(tmp_path)  # type: ignore[attr-defined]
    return ModelShape.read(tmp_path, flag="--actor.model.path")


@pytest.mark.parametrize("name", list(_configs()))
def test_the_shape_counts_every_parameter_of_the_transformers_model(name, tmp_path):
    config = _configs()[name]
    model_cls = Qwen2ForCausalLM if isinstance(config, Qwen2Config) else LlamaForCausalLM
    model = model_cls(config)
    shape = _shape_of(config, tmp_path)
    assert shape.params == sum(p.numel() for p in model.parameters())  # tied: counted once
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert shape.layer_params == layer
    # One entry per tensor, as the host buffers pinned per tensor see them.
    assert sorted(shape.layer_tensors) == sorted(
        p.numel() for p in model.model.layers[0].parameters()
    )
    layer_ids = {id(p) for p in model.model.layers.parameters()}
    others = [p.numel() for p in model.parameters() if id(p) not in layer_ids]
    assert sorted(shape.other_tensors) == sorted(others)


def test_kv_bytes_per_token_equal_what_a_forward_caches(tmp_path):
    config = Qwen2Config(**TINY)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    tokens = 11
    cache = model(torch.randint(0, 384, (1, tokens)), use_cache=True).past_key_values
    held = sum(
        layer.keys.numel() * layer.keys.element_size()
        + layer.values.numel() * layer.values.element_size()
        for layer in cache.layers
    )
    shape = _shape_of(config, tmp_path)
    assert shape.kv_bytes_per_token(dtype_bytes=2) * tokens == held


def test_a_config_without_a_field_or_with_experts_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(
        ModelLoadError,
        match=r"--actor.model.path .*'intermediate_size' \(None\), 'num_hidden_layers'",
    ):
        ModelShape.read(tmp_path, flag="--actor.model.path")
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "num_local_experts": 8}))
    with pytest.raises(ModelLoadError, match="mixture-of-experts model"):
        ModelShape.read(tmp_path, flag="--actor.model.path")
    with pytest.raises(ModelLoadError, match="no config.json"):
        ModelShape.read(tmp_path / "missing", flag="--actor.model.path")


def test_a_config_json_that_is_no_object_or_cut_short_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    for text, shape, load in (
        ("[1, 2]", r"config\.json holds a JSON list, not the object", r"holds a JSON list"),
        (json.dumps(TINY)[:20], r"cannot read .*config\.json: .*cut short", r"not valid JSON"),
    ):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(ModelLoadError, match=shape):  # the capacity plan (--dry_run)
            ModelShape.read(tmp_path, flag="--actor.model.path")
        with pytest.raises(ModelLoadError, match=load):  # a run's model check
            check_model_dir(str(tmp_path))
