"""Prompt datasets: files and saved HF datasets, templating, blending, a resumable sampler."""

from __future__ import annotations

import importlib
import json
import math
import pathlib
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlhf.cli.sections import DataConfig

# What `pip install` adds for .parquet files and saved HF datasets.
_EXTRA = "rlhf-cli[data]"


class DataSourceError(ValueError):
    """A data source cannot be read or a row lacks a field; the message names them."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: the text the policy sees (templated) and its label; ``numeric_input``: the
    row held a number where the prompt text goes (used as its decimal text)."""

    text: str
    label: Any
    source: str
    numeric_input: bool = False


def read_rows(path: str) -> list[dict[str, Any]]:
    """Rows of a .json (a list), .jsonl, .parquet file or a ``datasets.save_to_disk`` dir
    (a ``DatasetDict``'s ``train`` split, else its first split)."""
    p = pathlib.Path(path)
    if not p.exists():
        raise DataSourceError(f"data source {path!r} does not exist")
    reader = _saved_dataset_rows if p.is_dir() else _READERS.get(p.suffix)
    if reader is None:
        raise DataSourceError(
            f"{path}: use .json, .jsonl, .parquet or a saved HF dataset directory"
        )
    return reader(p)


def _import(module: str, *, path: pathlib.Path) -> Any:
    """``module`` (a package of the ``data`` extra), or a `DataSourceError` that says what to
    install to read ``path``."""
    package = module.partition(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] == package:
            hint = f"pip install {package} (or pip install '{_EXTRA}' for every format)"
        else:
            hint = f"it is installed but fails to import ({exc}): pip install -U '{_EXTRA}'"
        raise DataSourceError(f"reading {path} needs {package}: {hint}") from None


def _text(path: pathlib.Path) -> str:
    """The file as UTF-8 text, or a `DataSourceError` naming the line and byte offset of the
    first byte that is not UTF-8."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        byte = raw[exc.start : exc.start + 1]
        raise DataSourceError(
            f"{path}:{line} is not UTF-8 text (byte {exc.start}: {byte!r}, {exc.reason}): "
            "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def _jsonl_rows(path: pathlib.Path) -> list[dict[str, Any]]:
    rows = []
    for n, line in enumerate(_text(path).splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataSourceError(f"{path}:{n} is not valid JSON: {exc}") from None
    return rows


def _json_rows(path: pathlib.Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(_text(path))
    except json.JSONDecodeError as exc:
        raise DataSourceError(
            f"{path}:{exc.lineno}:{exc.colno} is not valid JSON: {exc.msg}"
        ) from None
    if not isinstance(data, list):
        raise DataSourceError(f"{path} must hold a JSON list of rows, not {type(data).__name__}")
    return data


def _parquet_rows(path: pathlib.Path) -> list[dict[str, Any]]:
    pyarrow = _import("pyarrow", path=path)
    pq = _import("pyarrow.parquet", path=path)
    try:
        return pq.read_table(path).to_pylist()
    except (OSError, pyarrow.ArrowException) as exc:
        raise DataSourceError(f"{path} is not a readable parquet file: {exc}") from None


def _saved_dataset_rows(path: pathlib.Path) -> list[dict[str, Any]]:
    datasets = _import("datasets", path=path)
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise DataSourceError(
            f"{path} is a directory but not a dataset saved by datasets' save_to_disk: {exc}"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if not loaded:
            raise DataSourceError(f"{path} is a saved DatasetDict without splits")
        loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    return [dict(r) for r in loaded]


_READERS = {".json": _json_rows, ".jsonl": _jsonl_rows, ".parquet": _parquet_rows}


def render(
    row: Mapping[str, Any], index: int, source: str, config: DataConfig, tokenizer: Any
) -> Prompt:
    """Template one row into a `Prompt`; a missing field names the row, source and flag."""
    for key, flag in (
        (config.input_key, "--data.input_key"),
        (config.label_key, "--data.label_key"),
    ):
        if not isinstance(row, Mapping) or key not in row:
            have = sorted(row) if isinstance(row, Mapping) else type(row).__name__
            raise DataSourceError(f"{source} row {index} has no {key!r} ({flag}); it has {have}")
    value = row[config.input_key]
    where = f"{source} row {index}: {config.input_key!r} (--data.input_key)"
    messages = _chat_messages(value)
    if messages is not None and not config.apply_chat_template:
        raise DataSourceError(
            f"{where} is a list of chat messages: add --data.apply_chat_template True"
        )
    if messages is None and (isinstance(value, bool) or not isinstance(value, str | int | float)):
        raise DataSourceError(
            f"{where} is {type(value).__name__} {value!r:.60}, not text (a prompt is a string, "
            "or a list of {'role', 'content'} messages with --data.apply_chat_template)"
        )
    text = "" if messages is not None else str(value)
    if messages is None and not text.strip():
        raise DataSourceError(f"{where} is empty")
    if config.apply_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise DataSourceError(
                "--data.apply_chat_template needs a tokenizer with a chat template"
            )
        text = tokenizer.apply_chat_template(
            messages or [{"role": "user", "content": text}],
            tokenize=False,
            add_generation_prompt=True,
        )
    elif config.input_template:
        try:
            text = config.input_template.format(text)
        except (KeyError, IndexError, ValueError) as exc:
            raise DataSourceError(
                f"--data.input_template {config.input_template!r} cannot wrap a prompt ({exc!r}):"
                " it takes the prompt as one positional '{}', e.g. 'Q: {}\\nA:'"
            ) from None
    numeric = messages is None and not isinstance(value, str)
    return Prompt(text, row[config.label_key], source, numeric_input=numeric)


def _chat_messages(value: Any) -> list[dict[str, str]] | None:
    """``value`` as chat messages (a non-empty list of ``{"role", "content"}`` mappings with
    text content), or None when it is not one."""
    if not isinstance(value, list) or not value:
        return None
    if not all(
        isinstance(m, Mapping)
        and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str)
        for m in value
    ):
        return None
    return [{"role": m["role"], "content": m["content"]} for m in value]


def load_prompts(spec: str, config: DataConfig, tokenizer: Any) -> dict[str, list[Prompt]]:
    """``spec``: comma-separated sources, each ``path`` or ``name=path``; prompts per name."""
    out: dict[str, list[Prompt]] = {}
    for item in [s for s in spec.split(",") if s.strip()]:
        name, _, path = item.rpartition("=")
        path = path.strip()
        name = name.strip() or pathlib.Path(path).stem
        if name in out:
            raise DataSourceError(
                f"data sources {out[name][0].source!r} and {path!r} are both named {name!r}: "
                "give them names with name=path"
            )
        rows = read_rows(path)[: config.max_samples]
        if not rows:
            raise DataSourceError(f"data source {path!r} has no rows")
        out[name] = [render(r, i, path, config, tokenizer) for i, r in enumerate(rows)]
    return out


def count_rows(spec: str, *, max_samples: int | None = None) -> int:
    """Rows of the comma-separated sources ``spec`` (each ``path`` or ``name=path``), each
    source cut at ``max_samples``: what `load_prompts` would load."""
    return sum(
        len(read_rows(item.rpartition("=")[2].strip())[:max_samples])
        for item in spec.split(",")
        if item.strip()
    )


class PromptSampler:
    """Prompts in shuffled epochs, blended across sources by probability; its state is a few
    integers, so a resumed run sees the same prompts in the same order.

    Args:
        sources: Prompts per source.
        probs: Blend weights, one per source, non-negative and not all zero (default equal).
        seed: Shuffling seed.
    """

    def __init__(
        self, sources: Mapping[str, Sequence[Prompt]], *, probs: Sequence[float] = (), seed: int
    ) -> None:
        self.names = list(sources)
        self.sources = [list(sources[n]) for n in self.names]
        self.probs = _blend_weights(probs, n_sources=len(self.sources))
        self.seed = seed
        self.drawn = 0
        self.positions = [0] * len(self.sources)
        # The shuffled order of each source's current epoch: a pure function of (seed,
        # source, epoch), kept instead of shuffled again for every prompt drawn (16 shuffles
        # of the demo's prompts were 12 ms of the driver's step).
        self._orders: dict[int, tuple[int, list[int]]] = {}

    def _order(self, source: int, epoch: int) -> list[int]:
        cached = self._orders.get(source)
        if cached is not None and cached[0] == epoch:
            return cached[1]
        order = list(range(len(self.sources[source])))
        random.Random(f"{self.seed}-{source}-{epoch}").shuffle(order)
        self._orders[source] = (epoch, order)
        return order

    def next(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts."""
        out = []
        for _ in range(n):
            pick = random.Random(f"{self.seed}-pick-{self.drawn}")
            source = pick.choices(range(len(self.sources)), weights=self.probs)[0]
            epoch, index = divmod(self.positions[source], len(self.sources[source]))
            out.append(self.sources[source][self._order(source, epoch)[index]])
            self.positions[source] += 1
            self.drawn += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": self.drawn, "seed": self.seed, "positions": list(self.positions)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("seed") != self.seed:
            raise DataSourceError(
                f"the checkpoint's prompt sampler used seed {state.get('seed')}, this run "
                f"{self.seed}: resume with the same --train.seed"
            )
        self.drawn = int(state["drawn"])
        self.positions = [int(p) for p in state["positions"]]


def _blend_weights(
    probs: Sequence[float], *, n_sources: int, flag: str = "--data.prompt_data_probs"
) -> list[float]:
    """``probs`` checked (one finite, non-negative weight per source, not all zero), or equal
    weights when empty; ``random.choices`` would fail on all-zero weights only at the first
    draw and silently mis-blend negative ones."""
    if not probs:
        return [1.0] * n_sources
    if len(probs) != n_sources:
        raise DataSourceError(f"{flag} has {len(probs)} weights for {n_sources} sources")
    bad = [p for p in probs if not (math.isfinite(p) and p >= 0)]
    if bad:
        raise DataSourceError(f"{flag} {list(probs)}: weights must be finite and >= 0, not {bad}")
    if sum(probs) <= 0:
        raise DataSourceError(f"{flag} {list(probs)}: at least one weight must be positive")
    return [float(p) for p in probs]


def dataset_rows(
    spec: str,
    *,
    probs: Sequence[float] = (),
    seed: int,
    max_samples: int | None = None,
    flag: str = "--dataset",
) -> list[dict[str, Any]]:
    """The training rows of ``spec``, one source or several comma-separated ones, each cut at
    ``max_samples`` first (OpenRLHF's ``--data.dataset a,b`` with ``--data.dataset_probs``):
    without ``probs`` the sources one after another; with them, rows drawn from the sources by
    those weights (seeded), each source from its start again when it runs out, until every
    source with a weight has given all its rows (HF ``interleave_datasets``' all_exhausted
    rule). The result is cut at ``max_samples`` again."""
    paths = [part.strip() for part in spec.split(",") if part.strip()]
    sources = [read_rows(path)[:max_samples] for path in paths]
    if not probs:
        return [row for rows in sources for row in rows][:max_samples]
    weights = _blend_weights(probs, n_sources=len(paths), flag=f"{flag}_probs")
    empty = [path for path, rows in zip(paths, sources, strict=True) if not rows]
    if empty:
        raise DataSourceError(f"{flag}: {', '.join(empty)} has no rows to blend")
    rng = random.Random(f"{seed}-blend")
    drawn = [0] * len(sources)
    left = {i for i, w in enumerate(weights) if w > 0}
    out: list[dict[str, Any]] = []
    while left:
        i = rng.choices(range(len(sources)), weights=weights)[0]
        out.append(sources[i][drawn[i] % len(sources[i])])
        drawn[i] += 1
        if drawn[i] >= len(sources[i]):
            left.discard(i)
    return out[:max_samples]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def field_notes(
    sources: Iterable[tuple[str, Sequence[Prompt]]], *, input_key: str, label_key: str
) -> list[str]:
    """What a person should know about the fields of each prompt source before training:
    how many prompts were numbers (used as their decimal text: a column of the wrong type, or
    a task of digits), how many labels are null (the reward function receives None) and how
    many are numbers (a text comparison such as builtin:exact_match reads 42.0 as "42.0",
    not "42"), each with an example. Empty when every prompt and label is text."""
    notes = []
    for name, prompts in sources:
        if not prompts:
            continue
        where = f"{prompts[0].source} ({name})" if name != prompts[0].source else name
        inputs = [i for i, p in enumerate(prompts) if p.numeric_input]
        null = [i for i, p in enumerate(prompts) if p.label is None]
        numbers = [i for i, p in enumerate(prompts) if _is_number(p.label)]
        if inputs:
            notes.append(
                f"{where}: {len(inputs)} of {len(prompts)} prompts are numbers (--data.input_key "
                f"{input_key!r}; row {inputs[0]}: {prompts[inputs[0]].text!r:.40}); each is "
                "used as its decimal text: check the column if the prompts should be text"
            )
        if null:
            notes.append(
                f"{where}: {len(null)} of {len(prompts)} labels are null (--data.label_key "
                f"{label_key!r}; row {null[0]} first); the reward function receives None for them"
            )
        if numbers:
            example = prompts[numbers[0]].label
            notes.append(
                f"{where}: {len(numbers)} of {len(prompts)} labels are numbers (row "
                f"{numbers[0]}: {example!r}); a reward that compares text, such as "
                f"builtin:exact_match, compares {str(example)!r}"
            )
    return notes


LOSSY_CHECKED = 10_000
"""Prompts per source `lossy_prompts` reads back through the tokenizer."""


@dataclass(frozen=True)
class LossyPrompts:
    """A prompt source whose text the tokenizer cannot represent.

    Attributes:
        source: The file; ``name`` the source's name.
        lossy: Prompts that lose characters, of ``checked`` read back.
        unknown_chars: Characters lost over those prompts (``data/unknown_chars``).
        example: The first such prompt's index, its text and what its tokens read back as.
    """

    source: str
    name: str
    lossy: int
    checked: int
    total: int
    unknown_chars: int
    example: tuple[int, str, str]

    def note(self) -> str:
        i, text, back = self.example
        checked = f"the first {self.checked}" if self.checked < self.total else f"{self.checked}"
        return (
            f"{self.source} ({self.name}): {self.lossy} of {checked} prompts lose "
            f"{self.unknown_chars} characters in the tokenizer (prompt {i}: {text!r:.80} reads "
            f"back as {back!r:.80}); the policy never sees them: use a tokenizer that covers "
            "them, or clean the data"
        )


def lossy_prompts(
    sources: Iterable[tuple[str, Sequence[Prompt]]], tokenizer: Any
) -> list[LossyPrompts]:
    """Prompt sources whose text the tokenizer cannot represent: a prompt whose non-space
    characters do not read back from its tokens has lost some (a tokenizer without those
    characters, and no byte fallback, drops them), so the policy never sees them. The lost
    characters are the multiset difference of the non-space characters before and after; the
    first `LOSSY_CHECKED` prompts of a source are checked (enough to see a tokenizer that
    does not fit the data)."""
    found = []
    for name, prompts in sources:
        texts = [p.text for p in prompts[:LOSSY_CHECKED]]
        if not texts:
            continue
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        back = tokenizer.batch_decode(ids)
        lost = {
            i: sum((Counter("".join(t.split())) - Counter("".join(b.split()))).values())
            for i, (t, b) in enumerate(zip(texts, back, strict=True))
            if "".join(t.split()) != "".join(b.split())
        }
        if lost:
            i = min(lost)
            found.append(
                LossyPrompts(
                    source=prompts[0].source,
                    name=name,
                    lossy=len(lost),
                    checked=len(texts),
                    total=len(prompts),
                    unknown_chars=sum(lost.values()),
                    example=(i, texts[i], back[i]),
                )
            )
    return found


def check_prompts(
    sources: Sequence[tuple[str, Sequence[Prompt]]],
    data: DataConfig,
    tokenizer: Any,
    *,
    echo: Callable[[str], None],
) -> dict[str, float]:
    """Tell what a person should know about the prompts (`field_notes`, `lossy_prompts`) as
    ``[data]`` lines; refuse lossy prompts under ``--data.lossy_prompts refuse``. Returns the
    counts for the first step's metrics."""
    for note in field_notes(sources, input_key=data.input_key, label_key=data.label_key):
        echo(f"[data] {note}")
    lossy = lossy_prompts(sources, tokenizer)
    if lossy and data.lossy_prompts == "refuse":
        raise DataSourceError(
            f"{lossy[0].note()} (refused by --data.lossy_prompts refuse; 'warn' trains on them)"
        )
    for found in lossy:
        echo(f"[data] {found.note()}")
    return {
        "data/lossy_prompts": float(sum(f.lossy for f in lossy)),
        "data/unknown_chars": float(sum(f.unknown_chars for f in lossy)),
    }


def prompt_sources(
    data: DataConfig, tokenizer: Any, *, seed: int
) -> tuple[PromptSampler, dict[str, list[Prompt]]]:
    """The training prompts' sampler (``--data.prompt_data``, blended by
    ``--data.prompt_data_probs``) and the evaluation prompts per source (``--data.eval_data``)."""
    sampler = PromptSampler(
        load_prompts(data.prompt_data, data, tokenizer), probs=data.prompt_data_probs, seed=seed
    )
    evals = load_prompts(data.eval_data, data, tokenizer) if data.eval_data else {}
    return sampler, evals
