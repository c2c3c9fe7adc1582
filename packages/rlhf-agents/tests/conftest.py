"""Real parts for the rlhf.agents tests: a BPE tokenizer with a ChatML template trained here,
a tiny random Qwen2 causal LM, and a Generator that samples from it token by token."""

from __future__ import annotations

import asyncio
import pathlib
import threading
import zlib
from collections.abc import Sequence

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from rlhf.agents import Generation, SamplingParams

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
REPO = pathlib.Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "examples"


def _corpus() -> list[str]:
    lines = []
    for a in range(40):
        for b in range(0, 40, 3):
            lines.append(f"What is {a} plus {b}? The answer is \\boxed{{{a + b}}}.")
            lines.append(f"Guess a number: {a}. Too low. Too high. Correct! calc({a}*{b})={a * b}")
    return lines


@pytest.fixture(scope="session")
def examples() -> pathlib.Path:
    """The repository's examples/ folder (reward files, environments, agents)."""
    return EXAMPLES


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:2],
    )
    fast.chat_template = CHATML
    return fast


@pytest.fixture(scope="session")
def model(tokenizer) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config).eval()


class TransformersGenerator:
    """A real `Generator`: samples from a transformers causal LM, one token at a time.

    Log-probs are those of the processed distribution (temperature, top-k), as vLLM's
    ``processed_logprobs``. Stops on EOS or ``stop_token_ids`` (kept in the output) or at
    ``max_new_tokens``. Records every call so tests can compare streams.
    """

    def __init__(
        self, model: Qwen2ForCausalLM, *, eos_token_id: int, banned_token_ids: Sequence[int] = ()
    ) -> None:
        self.model = model
        self.eos_token_id = eos_token_id
        self.banned = list(banned_token_ids)
        self.calls: list[tuple[list[int], Generation]] = []
        self._lock = threading.Lock()
        self._seen: dict[tuple[int, ...], int] = {}

    def _sample(self, prompt: list[int], sampling: SamplingParams, seed: int) -> Generation:
        gen = torch.Generator().manual_seed(seed)
        ids = list(prompt)
        out, logprobs = [], []
        finish = "length"
        with torch.no_grad():
            for _ in range(sampling.max_new_tokens):
                logits = self.model(torch.tensor([ids])).logits[0, -1].float()
                if self.banned:
                    logits[self.banned] = float("-inf")
                if sampling.temperature == 0:
                    token = int(logits.argmax())
                    logp = torch.log_softmax(logits, -1)
                else:
                    scaled = logits / sampling.temperature
                    if sampling.top_k > 0:
                        kth = torch.topk(scaled, sampling.top_k).values[-1]
                        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
                    logp = torch.log_softmax(scaled, -1)
                    token = int(torch.multinomial(logp.exp(), 1, generator=gen))
                out.append(token)
                logprobs.append(float(logp[token]))
                ids.append(token)
                if token == self.eos_token_id or token in sampling.stop_token_ids:
                    finish = "stop"
                    break
        return Generation(token_ids=tuple(out), logprobs=tuple(logprobs), finish_reason=finish)

    async def generate(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> Generation:
        with self._lock:
            # Seeded by the prompt and how often it was seen, not by call order, so concurrent
            # episodes sample the same streams on every run.
            key = tuple(prompt_token_ids)
            self._seen[key] = self._seen.get(key, 0) + 1
            derived = zlib.crc32(repr((key, self._seen[key])).encode())
            seed = sampling.seed if sampling.seed is not None else derived
        result = await asyncio.to_thread(
            self._locked_sample, list(prompt_token_ids), sampling, seed
        )
        self.calls.append((list(prompt_token_ids), result))
        return result

    def _locked_sample(self, prompt: list[int], sampling: SamplingParams, seed: int) -> Generation:
        with self._lock:
            return self._sample(prompt, sampling, seed)


@pytest.fixture
def generator(model, tokenizer) -> TransformersGenerator:
    # A chat policy never emits turn-opening or padding tokens mid-turn, and the random model
    # would otherwise sample lone non-ASCII bytes: ban both, as a deployment would with
    # bad-word lists, so every decoded action is valid text that renders back losslessly.
    banned = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|endoftext|>"])
    banned += [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]
    return TransformersGenerator(
        model, eos_token_id=tokenizer.eos_token_id, banned_token_ids=banned
    )
