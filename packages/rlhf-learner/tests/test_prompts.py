"""`rlhf.learner.prompts`: rows templated into prompts (text, numbers, chat messages through a
locally built tokenizer's template), rows that are not prompts named with their row, source and
flag, the sampler's blend by weight and its resumption, and the notes on numeric, null and
lossy fields. JSON sources only: the formats that need pyarrow or datasets are read in the CLI's
tests (``apps/cli/tests/test_data_sources.py``), whose environment has the ``data`` extra."""

from __future__ import annotations

import collections
import json
import math
import pathlib

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rlhf.learner import (
    DataConfig,
    DataSourceError,
    Prompt,
    PromptSampler,
    check_prompts,
    field_notes,
    load_prompts,
    lossy_prompts,
)
from rlhf.learner.prompts import render

ROWS = [
    {"input": "12+30=", "label": "42", "id": 0},
    {"input": "Wie viel ist 7·6?", "label": "42", "id": 1},
    {"input": "say nothing", "label": "", "id": 2},
]

# A role-tagged template: every message as <|role|>content and a newline; the generation
# prompt opens an assistant turn.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# User text as is, assistant text + <eos>.
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}<eos>{% endif %}{% endfor %}"
)


def _tokenizer(chat_template: str | None, *, chars: str = "") -> PreTrainedTokenizerFast:
    """A character-level tokenizer built here (no hub access) that knows ``chars``, without
    byte fallback: any other character reads back as ``<unk>``."""
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    tok.chat_template = chat_template
    return tok


def _write_json(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    out = path / "rows.json"
    out.write_text(json.dumps(rows, ensure_ascii=False, indent=1))
    return out


def _write_jsonl(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    out = path / "rows.jsonl"
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return out


def test_text_numbers_and_chat_messages_are_prompts() -> None:
    tokenizer = _tokenizer(PLAIN_TEMPLATE)
    plain = DataConfig()
    assert render({"input": "31:", "label": "13"}, 0, "f", plain, tokenizer).text == "31:"
    number = render({"input": 4213, "label": "1234"}, 0, "f", plain, tokenizer)
    assert (number.text, number.numeric_input) == ("4213", True)
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
def test_rows_that_are_not_prompts_are_named(value, config, message) -> None:
    with pytest.raises(DataSourceError, match=message):
        render({"input": value, "label": "1"}, 2, "f", config, _tokenizer(PLAIN_TEMPLATE))


def test_a_row_without_a_field_names_the_field_and_its_flag() -> None:
    with pytest.raises(
        DataSourceError, match=r"f row 3 has no 'answer' \(--data\.label_key\); it has \['input'\]"
    ):
        render({"input": "1"}, 3, "f", DataConfig(label_key="answer"), None)


def test_an_input_template_that_cannot_wrap_a_prompt_is_named() -> None:
    with pytest.raises(DataSourceError, match=r"--data\.input_template 'Q: \{q\}' cannot wrap"):
        render({"input": "1", "label": "1"}, 0, "f", DataConfig(input_template="Q: {q}"), None)


def test_chat_template_renders_a_user_message_with_the_generation_prompt(tmp_path) -> None:
    path = _write_jsonl(tmp_path, ROWS)
    config = DataConfig(apply_chat_template=True, input_template="ignored {}")
    (prompts,) = load_prompts(str(path), config, _tokenizer(TEMPLATE)).values()
    assert [p.text for p in prompts] == [
        "<|user|>12+30=\n<|assistant|>",
        "<|user|>Wie viel ist 7·6?\n<|assistant|>",
        "<|user|>say nothing\n<|assistant|>",
    ]


def test_a_tokenizer_without_a_chat_template_is_named(tmp_path) -> None:
    path = _write_jsonl(tmp_path, ROWS)
    with pytest.raises(
        DataSourceError, match=r"--data\.apply_chat_template needs a tokenizer with a chat template"
    ):
        load_prompts(str(path), DataConfig(apply_chat_template=True), _tokenizer(None))


def test_two_sources_of_one_name_are_refused(tmp_path) -> None:
    """Both files are named by their stem ``rows``: the second would replace the first."""
    (tmp_path / "a").mkdir()
    first, second = _write_jsonl(tmp_path / "a", ROWS), _write_json(tmp_path, ROWS)
    with pytest.raises(DataSourceError, match=r"are both named 'rows': .* name=path"):
        load_prompts(f"{first},{second}", DataConfig(), None)


def _prompts(name: str, n: int) -> list[Prompt]:
    return [Prompt(f"{name}{i}", i, name) for i in range(n)]


def _binomial_bound(n: int, p: float, *, sigmas: float = 5.0) -> float:
    return sigmas * math.sqrt(n * p * (1 - p))


@pytest.mark.parametrize(
    ("probs", "p_first"), [((0.75, 0.25), 0.75), ((), 0.5), ((1.0, 3.0), 0.25)]
)
def test_blend_follows_the_weights(probs, p_first) -> None:
    """Each draw picks a source with ``random.choices(weights=probs)`` from its own seeded
    generator, so the first source's count is Binomial(n, p): within 5 sigma of n * p. Inside a
    source the prompts come in shuffled epochs: after k draws every prompt came floor(k / size)
    or ceil(k / size) times."""
    n = 4000
    sampler = PromptSampler({"a": _prompts("a", 7), "b": _prompts("b", 5)}, probs=probs, seed=3)
    drawn = sampler.next(n)
    count = collections.Counter(p.source for p in drawn)
    assert count["a"] + count["b"] == n
    assert abs(count["a"] - n * p_first) <= _binomial_bound(n, p_first), count
    for name, size in (("a", 7), ("b", 5)):
        per_prompt = collections.Counter(p.text for p in drawn if p.source == name)
        assert len(per_prompt) == size
        assert set(per_prompt.values()) <= {count[name] // size, -(-count[name] // size)}


def test_a_zero_weight_source_is_never_drawn() -> None:
    sampler = PromptSampler(
        {"a": _prompts("a", 3), "b": _prompts("b", 3)}, probs=(0.0, 2.0), seed=0
    )
    assert {p.source for p in sampler.next(500)} == {"b"}


@pytest.mark.parametrize(
    ("probs", "message"),
    [
        ((1.0,), r"--data\.prompt_data_probs has 1 weights for 2 sources"),
        ((1.0, 0.5, 0.5), r"--data\.prompt_data_probs has 3 weights for 2 sources"),
        ((-0.25, 1.25), r"--data\.prompt_data_probs \[-0\.25, 1\.25\]: .* >= 0, not \[-0\.25\]"),
        ((math.nan, 1.0), r"--data\.prompt_data_probs .*must be finite"),
        ((0.0, 0.0), r"--data\.prompt_data_probs \[0\.0, 0\.0\]: at least one weight"),
    ],
)
def test_bad_blend_weights_are_refused(probs, message) -> None:
    with pytest.raises(DataSourceError, match=message):
        PromptSampler({"a": _prompts("a", 2), "b": _prompts("b", 2)}, probs=probs, seed=0)


def test_a_resumed_sampler_draws_what_the_uninterrupted_one_draws() -> None:
    sources = {"a": _prompts("a", 3), "b": _prompts("b", 4)}
    whole = PromptSampler(sources, probs=(1.0, 2.0), seed=5).next(20)
    first = PromptSampler(sources, probs=(1.0, 2.0), seed=5)
    head = first.next(9)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint keeps it
    resumed = PromptSampler(sources, probs=(1.0, 2.0), seed=5)
    resumed.load_state_dict(state)
    assert head + resumed.next(11) == whole
    with pytest.raises(DataSourceError, match=r"used seed 5, this run 6: .* --train\.seed"):
        PromptSampler(sources, seed=6).load_state_dict(state)


def test_numeric_prompts_and_null_or_numeric_labels_are_told_once_per_source() -> None:
    train = [
        Prompt("a", None, "t.jsonl"),
        Prompt("b", "x", "t.jsonl"),
        Prompt("c", None, "t.jsonl"),
    ]
    held = [Prompt("d", 42.0, "e.parquet"), Prompt("7", 7, "e.parquet", numeric_input=True)]
    notes = field_notes([("t", train), ("held", held), ("ok", [Prompt("f", "1", "o")])],
                        input_key="q", label_key="answer")  # fmt: skip
    assert notes == [
        "t.jsonl (t): 2 of 3 labels are null (--data.label_key 'answer'; row 0 first); the "
        "reward function receives None for them",
        "e.parquet (held): 1 of 2 prompts are numbers (--data.input_key 'q'; row 1: '7'); each "
        "is used as its decimal text: check the column if the prompts should be text",
        "e.parquet (held): 2 of 2 labels are numbers (row 0: 42.0); a reward that compares "
        "text, such as builtin:exact_match, compares '42.0'",
    ]


def _lossy() -> tuple[list[Prompt], PreTrainedTokenizerFast]:
    # A tokenizer of digits, ':' and the space, without byte fallback: "日本" is dropped on
    # the way in.
    tokenizer = _tokenizer(None, chars="0123456789: ")
    prompts = [Prompt("12 34:", "1", "p.jsonl"), Prompt("5 日本 6:", "2", "p.jsonl"),
               Prompt("日 7:", "3", "p.jsonl")]  # fmt: skip
    return prompts, tokenizer


def test_prompts_the_tokenizer_cannot_represent_are_told() -> None:
    prompts, tokenizer = _lossy()
    (found,) = lossy_prompts([("p", prompts)], tokenizer)
    # Two prompts lose characters: 日本 from one, 日 from the other.
    assert (found.lossy, found.checked, found.unknown_chars) == (2, 3, 3)
    assert found.note().startswith("p.jsonl (p): 2 of 3 prompts lose 3 characters in the "
                                   "tokenizer (prompt 1: '5 日本 6:' reads back as")  # fmt: skip
    assert lossy_prompts([("p", prompts[:1])], tokenizer) == []


def test_lossy_prompts_are_counted_or_refused() -> None:
    prompts, tokenizer = _lossy()
    lines: list[str] = []
    metrics = check_prompts([("p", prompts)], DataConfig(), tokenizer, echo=lines.append)
    assert metrics == {"data/lossy_prompts": 2.0, "data/unknown_chars": 3.0}
    (line,) = lines
    assert line.startswith("[data] p.jsonl (p): 2 of 3 prompts lose 3 characters")
    with pytest.raises(DataSourceError, match=r"refused by --data\.lossy_prompts refuse"):
        check_prompts([("p", prompts)], DataConfig(lossy_prompts="refuse"), tokenizer,
                      echo=lines.append)  # fmt: skip
    clean = check_prompts([("p", prompts[:1])], DataConfig(), tokenizer, echo=lines.append)
    assert clean == {"data/lossy_prompts": 0.0, "data/unknown_chars": 0.0}
