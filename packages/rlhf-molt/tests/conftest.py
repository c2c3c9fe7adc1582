"""A tiny Qwen2 checkpoint (tied embeddings) with a byte-level BPE tokenizer, made in the test
session, and a local Ray cluster for the 2-rank groups (gloo, one process per rank)."""

from __future__ import annotations

import pathlib

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM


def _tiny_qwen2(path: pathlib.Path, *, heads: int, kv_heads: int) -> pathlib.Path:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [f"what is {a} plus {b}? the answer is {a + b}" for a in range(20) for b in range(20)]
    bpe.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.save_pretrained(path)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> pathlib.Path:
    return _tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"), heads=2, kv_heads=1)


@pytest.fixture(scope="session")
def tiny_tp(tmp_path_factory) -> pathlib.Path:
    """The same shape with 4 attention and 2 key/value heads: splits 2 ways."""
    return _tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2-tp"), heads=4, kv_heads=2)


@pytest.fixture(scope="session")
def tokenizer(tiny) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(tiny)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def groups(ray_cluster):
    """Rank groups of 2 and 4 (one set per test module)."""
    from rlhf.learner import LearnerGroup

    made = {ranks: LearnerGroup(num_ranks=ranks, num_cpus_per_rank=0.5) for ranks in (2, 4)}
    yield made
    for g in made.values():
        g.shutdown()
