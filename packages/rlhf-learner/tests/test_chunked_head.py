"""The chunked lm_head path: log-probs, entropy and gradients equal to the logits path on a real
model (padded and packed), and the probe that refuses models whose logits are not the plain
projection of their hidden states."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rlhf.algos import AlgoConfig, KLConfig, loss_normalizer
from rlhf.learner import (
    DeepSpeedConfig,
    ModelConfig,
    PPOActorObjective,
    check_chunked_lm_head,
    lm_head_parts,
    token_logprobs,
)

from .test_packing import _assert_same_grads, _grads
from .test_units import _rl_batch


@pytest.fixture(scope="module")
def lm(tiny) -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32)


@pytest.mark.parametrize("packing", [False, True])
def test_chunked_logprobs_and_entropy_equal_the_logits_path(lm, packing) -> None:
    batch = _rl_batch(lm, seed=8)
    ids, mask = batch.input_ids, batch.attention_mask
    lp, ent = token_logprobs(lm, ids, mask, temperature=0.7, with_entropy=True)
    clp, cent = token_logprobs(
        lm, ids, mask, temperature=0.7, with_entropy=True, chunked_lm_head=True,
        packing_samples=packing,
    )  # fmt: skip
    assert ent is not None and cent is not None
    real = mask.bool()
    torch.testing.assert_close(clp[real], lp[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(cent[real], ent[real], rtol=0, atol=1e-5)
    assert (clp[:, 0] == 0).all()


def test_chunked_ppo_gradients_equal_the_logits_path(lm) -> None:
    """Every parameter's gradient, lm_head (tied to the embedding here) included."""
    batch = _rl_batch(lm, seed=9)
    algo = AlgoConfig(kl=KLConfig(use_loss=True, estimator="k3"), entropy_coef=0.01)
    norm = float(loss_normalizer(batch["action_mask"], mode="token-mean"))
    objective = PPOActorObjective(algo=algo, normalizer=norm, kl_coef=0.1)
    loss, _ = objective(lm, batch)
    chunked = dataclasses.replace(batch, chunked_lm_head=True)
    closs, _ = objective(lm, chunked)
    assert closs.item() == pytest.approx(loss.item(), rel=1e-5)
    grads = _grads(lm, objective(lm, chunked)[0])
    assert "lm_head.weight" in grads or "model.embed_tokens.weight" in grads
    _assert_same_grads(grads, _grads(lm, loss))


class _ScaledLogits(torch.nn.Module):
    """A causal LM that multiplies its logits (as models with a logit scale do)."""

    def __init__(self, model: Qwen2ForCausalLM) -> None:
        super().__init__()
        self.inner = model

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def get_decoder(self):
        return self.inner.get_decoder()

    def forward(self, **inputs):
        return types.SimpleNamespace(logits=self.inner(**inputs).logits * 2.0)


def test_the_probe_accepts_a_plain_head_and_names_the_flag_otherwise(lm) -> None:
    check_chunked_lm_head(lm, device="cpu", flag="--actor.model.chunked_lm_head")
    with pytest.raises(ValueError, match=r"--actor.model.chunked_lm_head: this model's logits"):
        check_chunked_lm_head(_ScaledLogits(lm), device="cpu", flag="--actor.model.chunked_lm_head")


def test_a_lora_wrapped_head_is_refused(tiny) -> None:
    from peft import LoraConfig, get_peft_model

    model = Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    body, head = lm_head_parts(model)
    assert head is model.lm_head and body is model.model
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["lm_head"]))
    with pytest.raises(ValueError, match="plain nn.Linear lm_head"):
        lm_head_parts(peft)
    with pytest.raises(ValueError, match=r"flag-name: model.chunked_lm_head needs a plain"):
        check_chunked_lm_head(peft, device="cpu", flag="flag-name")


def test_configs_that_cannot_chunk_the_head_are_refused(tiny) -> None:
    with pytest.raises(ValueError, match="causal_lm roles only"):
        ModelConfig(path=str(tiny), kind="scalar", chunked_lm_head=True)
    chunked = ModelConfig(path=str(tiny), chunked_lm_head=True)
    assert DeepSpeedConfig(zero_stage=2).model_problems(chunked) == []
    assert DeepSpeedConfig(zero_stage=3).model_problems(chunked, prefix="actor.") == [
        "actor.model.chunked_lm_head needs actor.deepspeed.zero_stage <= 2 (ZeRO-3 shards the "
        "lm_head weight outside its own forward)"
    ]
