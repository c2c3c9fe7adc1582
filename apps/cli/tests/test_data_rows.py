"""Prompt rows: text or chat messages become prompts; anything else is named with its row,
source and flag instead of training on its ``repr``."""

from __future__ import annotations

import json

import pytest

from rlhf.cli.data import DataSourceError, render
from rlhf.cli.sections import DataConfig

from .conftest import rlhf, small_run

# The demo's character tokenizer with a template: user text as is, assistant text + <eos>.
TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}<eos>{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def tokenizer(assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["model"])
    tok.chat_template = TEMPLATE
    return tok


def test_text_numbers_and_chat_messages_are_prompts(tokenizer) -> None:
    plain = DataConfig()
    assert render({"input": "31:", "label": "13"}, 0, "f", plain, tokenizer).text == "31:"
    assert render({"input": 4213, "label": "1234"}, 0, "f", plain, tokenizer).text == "4213"
    chat = DataConfig(apply_chat_template=True)
    messages = [{"role": "user", "content": "31"}, {"role": "assistant", "content": "13"},
                {"role": "user", "content": "42:"}]  # fmt: skip
    rendered = render({"input": messages, "label": "24"}, 0, "f", chat, tokenizer)
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.text == expected == "3113<eos>42:"
    assert render({"input": "7:", "label": "7"}, 0, "f", chat, tokenizer).text == "7:"


@pytest.mark.parametrize(
    ("value", "config", "message"),
    [
        (None, DataConfig(), r"f row 2: 'input' \(--data\.input_key\) is NoneType None, not text"),
        ({"q": "1"}, DataConfig(), r"is dict \{'q': '1'\}, not text"),
        (True, DataConfig(), r"is bool True, not text"),
        ([1, 2], DataConfig(apply_chat_template=True), r"is list \[1, 2\], not text"),
        ("  ", DataConfig(), r"f row 2: 'input' \(--data\.input_key\) is empty"),
        (
            [{"role": "user", "content": "1"}],
            DataConfig(),
            r"is a list of chat messages: add --data\.apply_chat_template True",
        ),
    ],
)
def test_rows_that_are_not_prompts_are_named(tokenizer, value, config, message) -> None:
    with pytest.raises(DataSourceError, match=message):
        render({"input": value, "label": "1"}, 2, "f", config, tokenizer)


def test_truncated_and_lossy_prompts_are_counted_in_the_metrics(assets, tmp_path) -> None:
    """Four prompts of 5 tokens (4 digits and ':'); with max_len 9 and 6 new tokens the
    prompt budget is 3 tokens, so each of the 4 prompts of the step is cut. Two of them also
    hold a character the demo tokenizer drops (日): trained on, told and counted."""
    data = tmp_path / "p.jsonl"
    prompts = ["4213:", "日1234:", "3321:", "55日12:"]
    data.write_text("".join(json.dumps({"input": p, "label": "1"}) + "\n" for p in prompts))
    args = [*small_run(assets, steps=1, prompts=4, samples=2, max_new_tokens=6)]
    args[args.index("--rollout.max_len") + 1] = "9"
    args[args.index("--data.prompt_data") + 1] = str(data)
    out = rlhf("train", "grpo", "--run_dir", str(tmp_path / "run"), *args)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"[data] {data} (p): 2 of 4 prompts lose 2 characters" in out.stdout
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    (step,) = [r for r in rows if "reward/mean" in r]
    assert step["rollout/prompts_truncated"] == 4.0
    assert (step["data/lossy_prompts"], step["data/unknown_chars"]) == (2.0, 2.0)


def test_pass_at_k_counts_solved_samples_not_partial_credit() -> None:
    from rlhf.rollout.sampling import pass_at

    # Three prompts, four samples each, graded scores: prompt 0 solved twice, prompt 1 only
    # partial credit, prompt 2 solved once.
    scores = [[1.0, 0.5, 1.0, 0.0], [0.75, 0.5, 0.25, 0.75], [0.0, 0.0, 0.0, 1.0]]
    out = pass_at(scores, k=4, threshold=1.0)
    assert out["pass@1"] == pytest.approx((2 / 4 + 0 + 1 / 4) / 3)
    assert out["pass@4"] == pytest.approx(2 / 3)  # "any score > 0" said 3/3
    assert out["score_mean"] == pytest.approx((2.5 / 4 + 2.25 / 4 + 1 / 4) / 3)
    # A 0/1 reward at threshold 1: pass@1 is the mean score, as before.
    binary = [[1.0, 0.0], [0.0, 0.0]]
    assert pass_at(binary, k=2, threshold=1.0) == {"pass@1": 0.25, "pass@2": 0.5,
                                                   "score_mean": 0.25}  # fmt: skip
    assert pass_at(scores, k=4, threshold=0.5)["pass@4"] == 1.0
