"""The conformance check: engine log-probs against a transformers forward, in processed mode."""

import asyncio
import math

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rlhf.agents import SamplingParams
from rlhf.rollout import check_logprobs, processed_logprobs

PROMPTS = [[5, 17, 42, 99, 7], [3, 4, 5], [60, 61, 62, 63, 64, 65]]
# log of probabilities 0.1, 0.2, 0.3, 0.4
LOGITS = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))


def probs(sampling: SamplingParams) -> list[float]:
    return processed_logprobs(LOGITS, sampling).exp()[0].tolist()


def test_processed_logprobs_by_hand() -> None:
    # Greedy: the plain softmax, temperature ignored.
    assert probs(SamplingParams(temperature=0.0)) == pytest.approx([0.1, 0.2, 0.3, 0.4])
    # Temperature 0.5 squares the probabilities before renormalising: (1, 4, 9, 16) / 30.
    assert probs(SamplingParams(temperature=0.5)) == pytest.approx(
        [1 / 30, 4 / 30, 9 / 30, 16 / 30]
    )
    # top-k 3 drops the 0.1 token: (2, 3, 4) / 9.
    assert probs(SamplingParams(top_k=3)) == pytest.approx([0.0, 2 / 9, 3 / 9, 4 / 9])
    # top-p 0.5: ascending masses 0.1, 0.3, 0.6, 1.0; the two tokens within 1 - p = 0.5 go,
    # leaving (3, 4) / 7.
    assert probs(SamplingParams(top_p=0.5)) == pytest.approx([0.0, 0.0, 3 / 7, 4 / 7])
    # top-p 0.3: only the 0.4 token is needed, and it always stays.
    assert probs(SamplingParams(top_p=0.3)) == pytest.approx([0.0, 0.0, 0.0, 1.0])
    # Both: top-k 3 gives (2, 3, 4) / 9; ascending masses 2/9, 5/9, 1; top-p 0.7 drops the
    # 2/9 token (2/9 <= 0.3), leaving (3, 4) / 7.
    assert probs(SamplingParams(top_k=3, top_p=0.7)) == pytest.approx([0.0, 0.0, 3 / 7, 4 / 7])
    assert processed_logprobs(LOGITS, SamplingParams(top_k=3))[0, 0].item() == -math.inf


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_new_tokens=12, temperature=0.0),
        SamplingParams(max_new_tokens=12, temperature=1.0, seed=2),
        SamplingParams(max_new_tokens=12, temperature=0.7, top_k=20, top_p=0.9, seed=5),
    ],
    ids=["greedy", "plain", "temperature-topk-topp"],
)
def test_engine_conforms_in_fp32(engine, hf_model, sampling) -> None:
    report = asyncio.run(check_logprobs(engine, hf_model, PROMPTS, sampling=sampling))
    assert report.tokens >= len(PROMPTS)
    assert report.passed, report.summary()
    assert "conformance ok" in report.summary()


def test_a_model_with_other_weights_fails_the_check(engine, checkpoint) -> None:
    other = Qwen2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        other.model.norm.weight.mul_(1.5)
    report = asyncio.run(
        check_logprobs(engine, other, PROMPTS, sampling=SamplingParams(max_new_tokens=12, seed=1))
    )
    assert not report.passed
    assert report.max_abs_diff > 1e-2
    assert "MISMATCH" in report.summary()
    with pytest.raises(ValueError, match="at least one prompt"):
        asyncio.run(check_logprobs(engine, other, [], sampling=SamplingParams()))
