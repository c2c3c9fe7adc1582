"""Prompt datasets for an RL loop: rows (read by `rlhf.learner.datasets`) templated into
prompts (`render`, `load_prompts`), checked for what a person should know (`field_notes`,
`lossy_prompts`, `check_prompts`), and a resumable sampler blending the sources
(`PromptSampler`, `prompt_sources`), configured by a `DataConfig`. Every error is a
`DataSourceError` naming the source, the row and the field's flag."""

from __future__ import annotations

import pathlib
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from rlhf.learner.datasets import DataSourceError, blend_weights, read_rows


@dataclass(frozen=True)
class DataConfig:
    """Prompt data (flags ``--data.*``).

    Attributes:
        prompt_data: A .json/.jsonl/.parquet file or a ``datasets.save_to_disk`` directory;
            several comma-separated sources are blended by ``prompt_data_probs``.
        prompt_data_probs: Blend weights, one per source (default equal).
        input_key: Field holding the prompt text.
        label_key: Field holding the label passed to the reward function.
        input_template: Python format string wrapping the prompt, e.g. ``"Q: {}\\nA:"``.
        apply_chat_template: Render the prompt as a user message with the tokenizer's chat
            template (and the generation prompt).
        max_samples: Use at most this many prompts per source.
        eval_data: Evaluation prompts (same fields); ``name=path`` pairs, comma-separated,
            are reported per data source.
        lossy_prompts: Prompts whose characters the tokenizer cannot encode (they read back
            without them): ``warn`` trains on them, says so once per source with an example
            and counts them (``data/lossy_prompts``, ``data/unknown_chars`` in the first
            step's metrics); ``refuse`` stops before start-up.
    """

    prompt_data: str = ""
    prompt_data_probs: tuple[float, ...] = ()
    input_key: str = "input"
    label_key: str = "label"
    input_template: str | None = None
    apply_chat_template: bool = False
    max_samples: int | None = None
    eval_data: str = ""
    lossy_prompts: Literal["warn", "refuse"] = "warn"


class PromptTokenizer(Protocol):
    """The part of a Hugging Face tokenizer prompts use: its chat template (`render`) and a
    round trip of text through token ids (`lossy_prompts`)."""

    @property
    def chat_template(self) -> str | Mapping[str, str] | None:
        """The chat template (or named templates); None or empty: the tokenizer has none."""
        ...

    def apply_chat_template(
        self,
        conversation: list[dict[str, str]],
        *,
        tokenize: bool = ...,
        add_generation_prompt: bool = ...,
    ) -> object:
        """The conversation rendered (``tokenize=False``: as text; prompts take its ``str``)."""
        ...

    def __call__(
        self, text: list[str], *, add_special_tokens: bool = ...
    ) -> Mapping[str, list[list[int]]]: ...

    def batch_decode(self, sequences: list[list[int]]) -> list[str]: ...


@dataclass(frozen=True)
class Prompt:
    """One prompt: the text the policy sees (templated) and its label; ``source``: the file
    it was read from (what errors name); ``numeric_input``: the row held a number where the
    prompt text goes (used as its decimal text); ``source_name``: its data source's name
    (``name=path``, else the file's stem), by which a run reports and routes prompts (a
    teacher per data source)."""

    text: str
    label: Any
    source: str
    numeric_input: bool = False
    source_name: str = ""


def render(
    row: Mapping[str, Any],
    index: int,
    source: str,
    config: DataConfig,
    tokenizer: PromptTokenizer | None,
    *,
    source_name: str = "",
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
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise DataSourceError(
                "--data.apply_chat_template needs a tokenizer with a chat template"
            )
        text = str(
            tokenizer.apply_chat_template(
                messages or [{"role": "user", "content": text}],
                tokenize=False,
                add_generation_prompt=True,
            )
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
    return Prompt(
        text, row[config.label_key], source, numeric_input=numeric, source_name=source_name
    )


def _chat_messages(value: object) -> list[dict[str, str]] | None:
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


def load_prompts(
    spec: str, config: DataConfig, tokenizer: PromptTokenizer | None
) -> dict[str, list[Prompt]]:
    """``spec``: comma-separated sources, each ``path`` or ``name=path``; prompts per name
    (`source_names`)."""
    out: dict[str, list[Prompt]] = {}
    for name, path in source_names(spec):
        if name in out:
            raise DataSourceError(
                f"data sources {out[name][0].source!r} and {path!r} are both named {name!r}: "
                "give them names with name=path"
            )
        rows = read_rows(path)[: config.max_samples]
        if not rows:
            raise DataSourceError(f"data source {path!r} has no rows")
        out[name] = [
            render(r, i, path, config, tokenizer, source_name=name) for i, r in enumerate(rows)
        ]
    return out


def named_items(spec: str) -> list[tuple[str, str]]:
    """(name, value) of each comma-separated item of ``spec`` (``value`` or ``name=value``,
    split on the last ``=``; the name empty where none is given), stripped, in order."""
    out = []
    for item in [s for s in spec.split(",") if s.strip()]:
        name, _, value = item.rpartition("=")
        out.append((name.strip(), value.strip()))
    return out


def source_names(spec: str) -> list[tuple[str, str]]:
    """(name, path) of each source of ``spec`` (`named_items`; an unnamed source is named by
    its file's stem), in order; nothing is read."""
    return [(name or pathlib.Path(path).stem, path) for name, path in named_items(spec)]


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
        self.probs = blend_weights(probs, n_sources=len(self.sources))
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


def _is_number(value: object) -> bool:
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
    sources: Iterable[tuple[str, Sequence[Prompt]]], tokenizer: PromptTokenizer
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
    tokenizer: PromptTokenizer,
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
    data: DataConfig, tokenizer: PromptTokenizer | None, *, seed: int
) -> tuple[PromptSampler, dict[str, list[Prompt]]]:
    """The training prompts' sampler (``--data.prompt_data``, blended by
    ``--data.prompt_data_probs``) and the evaluation prompts per source (``--data.eval_data``)."""
    sampler = PromptSampler(
        load_prompts(data.prompt_data, data, tokenizer), probs=data.prompt_data_probs, seed=seed
    )
    evals = load_prompts(data.eval_data, data, tokenizer) if data.eval_data else {}
    return sampler, evals
