"""Sharded loading: a causal LM is built on the meta device, split and sharded there, and each
rank reads its slices of the safetensors (2 ranks, data or tensor parallel); models whose
weights are partly initialised (a critic's head, LoRA adapters) or whose checkpoint lacks a
tensor load whole first."""

from __future__ import annotations

import functools
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2ForCausalLM

from rlhf.learner import LearnerConfig, LearnerGroup, ModelConfig, OptimizerConfig
from rlhf.molt import FSDPBackend, FSDPConfig
from rlhf.molt.loading import build_on_meta, parameters_on_meta

from .molt_cases import config, full_state


@pytest.fixture(scope="module")
def group(ray_cluster):
    g = LearnerGroup(num_ranks=2, num_cpus_per_rank=0.5)
    yield g
    g.shutdown()


def _bf16_copy(src, dst):
    """The checkpoint at ``src`` saved again in bfloat16 at ``dst``."""
    Qwen2ForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(dst)
    return dst


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_a_causal_lm_loads_slice_by_slice_equal_to_the_checkpoint(group, tiny_tp, tmp_path, tp):
    """A bfloat16 checkpoint read into float32 shards equals `from_pretrained` bit for bit;
    the rotary frequencies (not in checkpoints) are computed, the tied head stays tied."""
    path = _bf16_copy(tiny_tp, tmp_path / "bf16")
    backend = functools.partial(FSDPBackend, fsdp=FSDPConfig(tp_size=tp))
    group.build(config(path), backend=backend)
    assert group.run(lambda b: b.loading) == ["sharded", "sharded"]
    reference = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = full_state(group)
    assert state.keys() == dict(reference.named_parameters()).keys()
    for name, param in reference.named_parameters():
        assert torch.equal(state[name], param.detach()), name

    def rotary_and_tie(b):
        model = b.module
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        return model.model.rotary_emb.inv_freq.cpu(), tied

    for inv_freq, tied in group.run(rotary_and_tie):
        assert torch.equal(inv_freq, reference.model.rotary_emb.inv_freq) and tied


def test_models_with_initialised_weights_load_whole(group, tiny) -> None:
    molt = functools.partial(FSDPBackend, fsdp=FSDPConfig())
    group.build(config(tiny, kind="scalar"), backend=molt)
    assert group.run(lambda b: b.loading) == ["whole", "whole"]
    lora = LearnerConfig(
        model=ModelConfig(path=str(tiny), lora_rank=4), optimizer=OptimizerConfig(lr=1e-3)
    )
    group.build(lora, backend=molt)
    assert group.run(lambda b: b.loading) == ["whole", "whole"]


def test_a_checkpoint_missing_a_tensor_is_not_loaded_by_slices(tiny, tmp_path) -> None:
    shutil.copytree(tiny, tmp_path / "partial")
    file = tmp_path / "partial" / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.norm.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    assert build_on_meta(ModelConfig(path=str(tmp_path / "partial")), dtype=torch.float32) is None
    whole = build_on_meta(ModelConfig(path=str(tiny)), dtype=torch.float32)
    assert whole is not None
    assert {p.device.type for p in whole.parameters()} == {"meta"}
    assert {b.device.type for b in whole.buffers()} == {"cpu"}


def test_parameters_on_meta_keeps_buffers_real() -> None:
    with parameters_on_meta():
        norm = torch.nn.BatchNorm1d(3)
    assert norm.weight.device.type == "meta" and norm.weight.requires_grad
    assert norm.running_var.device.type == "cpu" and torch.equal(norm.running_var, torch.ones(3))
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"  # restored on exit
