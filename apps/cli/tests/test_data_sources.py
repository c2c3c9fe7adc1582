"""Prompt and trainer sources through the formats that need the ``data`` extra: the same rows
read back from every format (.json, .jsonl, .parquet, a saved HF ``Dataset`` or
``DatasetDict``), blending by ``--data.prompt_data_probs`` across them, chat messages through
each, and malformed sources named in a `DataSourceError`. Unit level: no Ray, no engine, no
subprocess. What needs neither pyarrow nor datasets is tested in the learner's
``tests/test_prompts.py`` and ``tests/test_datasets.py``."""

from __future__ import annotations

import collections
import json
import math
import pathlib
import sys
from collections.abc import Callable

import pytest

from rlhf.learner.datasets import DataSourceError, dataset_rows, read_rows
from rlhf.learner.prompts import DataConfig, Prompt, field_notes, load_prompts, prompt_sources

# An extra column the prompt does not use, a non-ASCII prompt and an empty label survive every
# format unchanged.
ROWS = [
    {"input": "12+30=", "label": "42", "id": 0},
    {"input": "Wie viel ist 7·6?", "label": "42", "id": 1},
    {"input": "say nothing", "label": "", "id": 2},
]


def _write_json(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    out = path / "rows.json"
    out.write_text(json.dumps(rows, ensure_ascii=False, indent=1))
    return out


def _write_jsonl(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    out = path / "rows.jsonl"
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return out


def _write_parquet(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out


def _write_dataset(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    import datasets

    out = path / "dataset"
    datasets.Dataset.from_list(rows).save_to_disk(str(out))
    return out


def _write_dataset_dict(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    """A ``DatasetDict`` whose ``train`` split holds ``rows``; the other split comes first, so
    reading it would fail the comparison."""
    import datasets

    out = path / "dataset_dict"
    other = datasets.Dataset.from_list([{**rows[0], "input": "not the train split"}])
    splits = {"test": other, "train": datasets.Dataset.from_list(rows)}
    datasets.DatasetDict(splits).save_to_disk(str(out))
    return out


def _write_dataset_dict_without_train(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    import datasets

    out = path / "dataset_dict_validation"
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows)}).save_to_disk(str(out))
    return out


WRITERS: dict[str, Callable[[pathlib.Path, list[dict]], pathlib.Path]] = {
    "json": _write_json,
    "jsonl": _write_jsonl,
    "parquet": _write_parquet,
    "dataset": _write_dataset,
    "dataset_dict_train": _write_dataset_dict,
    "dataset_dict_without_train": _write_dataset_dict_without_train,
}


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_every_format_reads_back_the_same_rows(tmp_path, fmt) -> None:
    path = WRITERS[fmt](tmp_path, ROWS)
    assert read_rows(str(path)) == ROWS
    (prompts,) = load_prompts(f"src={path}", DataConfig(), None).values()
    # Each prompt names its file (errors) and its source (routing, per-source metrics).
    assert prompts == [Prompt(r["input"], r["label"], str(path), source_name="src") for r in ROWS]


def test_max_samples_and_input_template_apply_to_every_source(tmp_path) -> None:
    json_path = _write_json(tmp_path, ROWS)
    parquet_path = _write_parquet(tmp_path, ROWS)
    config = DataConfig(input_template="Q: {}\nA:", max_samples=2)
    loaded = load_prompts(f"{json_path}, p={parquet_path}", config, None)
    # A bare path is named by its stem; ``name=path`` by its name.
    assert list(loaded) == ["rows", "p"]
    for prompts in loaded.values():
        assert [p.text for p in prompts] == ["Q: 12+30=\nA:", "Q: Wie viel ist 7·6?\nA:"]


def _binomial_bound(n: int, p: float, *, sigmas: float = 5.0) -> float:
    return sigmas * math.sqrt(n * p * (1 - p))


def test_blend_through_prompt_sources(tmp_path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    easy, hard = _write_jsonl(tmp_path / "a", ROWS), _write_parquet(tmp_path / "b", ROWS[:1])
    data = DataConfig(
        prompt_data=f"easy={easy}, hard={hard}",
        prompt_data_probs=(0.25, 0.75),
        eval_data=f"held={_write_json(tmp_path, ROWS)}",
    )
    sampler, evals = prompt_sources(data, None, seed=1)
    assert sampler.names == ["easy", "hard"]
    n = 2000
    count = collections.Counter(p.source for p in sampler.next(n))
    assert abs(count[str(hard)] - n * 0.75) <= _binomial_bound(n, 0.75), count
    assert [p.text for p in evals["held"]] == [r["input"] for r in ROWS]


def _two_sources(tmp_path: pathlib.Path) -> tuple[str, list[dict], list[dict]]:
    a = [{"input": f"a{i}", "output": "x"} for i in range(2)]
    b = [{"input": f"b{i}", "output": "y"} for i in range(3)]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    return f"{_write_jsonl(tmp_path / 'a', a)},{_write_json(tmp_path / 'b', b)}", a, b


def test_trainer_sources_without_weights_follow_one_another(tmp_path) -> None:
    # OpenRLHF concatenates; --max_samples cuts each source, then the whole.
    spec, a, b = _two_sources(tmp_path)
    assert dataset_rows(spec, seed=0) == a + b
    assert dataset_rows(spec, seed=0, max_samples=1) == a[:1]
    assert dataset_rows(spec, seed=0, max_samples=2) == a[:2]  # b[:2] cut by the total
    assert dataset_rows(f"{spec.split(',')[1]}", seed=0, max_samples=2) == b[:2]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trainer_sources_blend_until_each_gave_every_row(tmp_path, seed) -> None:
    # Draws by weight, each source cycling from its start, until every weighted source has
    # given all its rows: each source's rows come in its own order, the last draw completes
    # the last source, and a zero-weight source gives nothing.
    spec, a, b = _two_sources(tmp_path)
    rows = dataset_rows(spec, probs=(0.5, 0.5), seed=seed)
    from_a = [r for r in rows if r["input"].startswith("a")]
    from_b = [r for r in rows if r["input"].startswith("b")]
    assert from_a == [a[i % 2] for i in range(len(from_a))]
    assert from_b == [b[i % 3] for i in range(len(from_b))]
    assert len(from_a) >= 2 and len(from_b) >= 3
    last = from_a if rows[-1]["input"].startswith("a") else from_b
    other = from_b if last is from_a else from_a
    assert len(last) == len(a if last is from_a else b)  # its first full pass ended the blend
    assert len(other) >= len(b if last is from_a else a)
    assert rows == dataset_rows(spec, probs=(0.5, 0.5), seed=seed)  # seeded
    assert dataset_rows(spec, probs=(1.0, 0.0), seed=seed) == a


def test_bad_trainer_blends_are_named(tmp_path) -> None:
    spec, _, _ = _two_sources(tmp_path)
    with pytest.raises(DataSourceError, match=r"--dataset_probs has 1 weights for 2 sources"):
        dataset_rows(spec, probs=(1.0,), seed=0)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataSourceError, match=r"--dataset: .*empty.jsonl has no rows to blend"):
        dataset_rows(f"{spec},{tmp_path / 'empty.jsonl'}", probs=(1, 1, 1), seed=0)


# A role-tagged template: every message as <|role|>content and a newline; the generation
# prompt opens an assistant turn.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _tokenizer(chat_template: str | None):
    """A character-level tokenizer built here (no hub access), with ``chat_template``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    tok.chat_template = chat_template
    return tok


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "dataset"])
def test_a_messages_row_renders_every_turn(tmp_path, fmt) -> None:
    messages = [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "6*7?"},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "and 6*8?"},
    ]
    path = WRITERS[fmt](tmp_path, [{"input": messages, "label": "48"}])
    config = DataConfig(apply_chat_template=True)
    (prompts,) = load_prompts(str(path), config, _tokenizer(TEMPLATE)).values()
    expected = (
        "<|system|>Answer with a number.\n<|user|>6*7?\n<|assistant|>42\n"
        "<|user|>and 6*8?\n<|assistant|>"
    )
    assert prompts == [Prompt(expected, "48", str(path), source_name=path.stem)]


def _write(name: str, text: str) -> Callable[[pathlib.Path], pathlib.Path]:
    def write(root: pathlib.Path) -> pathlib.Path:
        path = root / name
        path.write_text(text)
        return path

    return write


def _write_bytes(name: str, raw: bytes) -> Callable[[pathlib.Path], pathlib.Path]:
    def write(root: pathlib.Path) -> pathlib.Path:
        (root / name).write_bytes(raw)
        return root / name

    return write


def _dataset_dict_without_splits(root: pathlib.Path) -> pathlib.Path:
    import datasets

    datasets.DatasetDict({}).save_to_disk(str(root / "no_splits"))
    return root / "no_splits"


def _not_a_dataset_dir(root: pathlib.Path) -> pathlib.Path:
    (root / "plain").mkdir()
    (root / "plain" / "rows.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    return root / "plain"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            _write("obj.json", '{"input": "1", "label": "1"}'),
            r"obj\.json must hold a JSON list of rows, not dict",
        ),
        (
            _write("broken.json", '[{"input": "1",\n  "label": }]'),
            r"broken\.json:2:12 is not valid JSON",
        ),
        (
            _write("bad.jsonl", '{"input": "1", "label": "1"}\n\n{"input": "2", label}\n'),
            r"bad\.jsonl:3 is not valid JSON",
        ),
        (
            _write("rows.csv", "input,label\n1,1\n"),
            r"rows\.csv: use \.json, \.jsonl, \.parquet or a saved HF dataset",
        ),
        (_write("fake.parquet", "not parquet"), r"fake\.parquet is not a readable parquet file"),
        (  # line 1 is 29 bytes; "é" in Latin-1 (0xE9) is byte 14 of line 2
            _write_bytes("latin1.jsonl", b'{"input": "1", "label": "1"}\n{"input": "caf\xe9"}\n'),
            r"latin1\.jsonl:2 is not UTF-8 text \(byte 43: b'\\xe9', invalid continuation byte\)",
        ),
        (_write("empty.jsonl", "\n"), r"data source '.*empty\.jsonl' has no rows"),
        (lambda root: root / "missing.jsonl", r"data source '.*missing\.jsonl' does not exist"),
        (_dataset_dict_without_splits, r"no_splits is a saved DatasetDict without splits"),
        (
            _not_a_dataset_dir,
            r"plain is a directory but not a dataset saved by datasets' save_to_disk",
        ),
    ],
)
def test_malformed_sources_are_named(tmp_path, make, message) -> None:
    path = make(tmp_path)
    with pytest.raises(DataSourceError, match=message):
        load_prompts(f"src={path}", DataConfig(), None)


def _unimport(monkeypatch, package: str) -> None:
    """Forget ``package`` and its modules (restored after the test), so the next import looks
    for it again."""
    for name in [m for m in sys.modules if m == package or m.startswith(f"{package}.")]:
        monkeypatch.delitem(sys.modules, name)


@pytest.mark.parametrize(
    ("write", "package"), [(_write_parquet, "pyarrow"), (_write_dataset, "datasets")]
)
def test_a_missing_package_names_it_and_the_extra(tmp_path, monkeypatch, write, package) -> None:
    path = write(tmp_path, ROWS)
    _unimport(monkeypatch, package)
    # None in sys.modules makes an import fail as if the package were not installed.
    monkeypatch.setitem(sys.modules, package, None)
    message = (
        rf"reading .* needs {package}: pip install {package} \(or pip install 'rlhf-cli\[data\]'"
    )
    with pytest.raises(DataSourceError, match=message):
        read_rows(str(path))


def test_a_package_that_fails_to_import_is_told_apart(tmp_path, monkeypatch) -> None:
    """pyarrow 15 under numpy 2 raises this ImportError: installed, but broken."""
    path = _write_parquet(tmp_path, ROWS)
    fake = tmp_path / "site" / "pyarrow"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("numpy.core.multiarray failed to import")')
    _unimport(monkeypatch, "pyarrow")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    message = (
        r"needs pyarrow: it is installed but fails to import \(numpy\.core\.multiarray failed to"
        r" import\): pip install -U 'rlhf-cli\[data\]'"
    )
    with pytest.raises(DataSourceError, match=message):
        read_rows(str(path))


def test_a_trainer_dataset_without_rows_is_named(tmp_path) -> None:
    from rlhf.cli.preference import PreferenceConfig
    from rlhf.cli.trainer_state import training_rows

    (tmp_path / "empty.jsonl").write_text("\n")
    config = PreferenceConfig(dataset=str(tmp_path / "empty.jsonl"))
    with pytest.raises(DataSourceError, match=r"--dataset .*empty\.jsonl has no rows to train on"):
        training_rows(config)


def test_a_parquet_column_of_numbers_is_told_as_it_loads(tmp_path, assets) -> None:
    """Integers in the input column and floats in the label column: the prompts are their
    decimal text, and both columns are named in the notes."""
    from transformers import AutoTokenizer

    path = _write_parquet(tmp_path, [{"input": 1234, "label": 4321.0}] * 3)
    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    loaded = load_prompts(str(path), DataConfig(input_template="{}:"), tokenizer)
    assert [p.text for p in loaded["rows"]] == ["1234:"] * 3
    prompts_note, labels_note = field_notes(loaded.items(), input_key="input", label_key="label")
    assert prompts_note.startswith(f"{path} (rows): 3 of 3 prompts are numbers")
    assert labels_note.startswith(f"{path} (rows): 3 of 3 labels are numbers (row 0: 4321.0)")


def test_an_empty_step_says_which_cause_took_its_samples() -> None:
    from rlhf.rollout.sampling import empty_step_message

    text = empty_step_message(
        0, dropped_groups=3, incomplete=1, lost={"env/skipped": 4.0, "reward/failed": 0.0},
        failure="environment Environment in env.py (prompt 0, sample 0): reset() raised",
    )  # fmt: skip
    assert text == (
        "step 1: no sample is left to train on: 4 episodes failed and were left out by "
        "--train.agent_failure_policy (skip; or fallback, which has nothing to keep when an "
        "episode fails before the policy's first action, e.g. in reset()); 1 prompt groups "
        "lost samples and were dropped whole; dynamic filtering dropped 3 prompt groups whose "
        "mean score was outside --algo.dynamic_filtering_range. The first failure: "
        "environment Environment in env.py (prompt 0, sample 0): reset() raised"
    )


def test_progress_shows_the_first_and_last_steps_and_one_per_interval() -> None:
    from rlhf.cli.metrics import Progress

    quiet = Progress(total=5, every_s=3600.0)
    assert [quiet.due(step) for step in range(1, 6)] == [True, False, False, False, True]
    chatty = Progress(total=3, start=1, every_s=0.0)
    assert [chatty.due(step) for step in (2, 3)] == [True, True]
