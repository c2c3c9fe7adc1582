"""Prompt datasets: files and saved HF datasets, templating, blending, a resumable sampler."""

from __future__ import annotations

import json
import pathlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlhf.cli.config import DataConfig


class DataSourceError(ValueError):
    """A data source cannot be read or a row lacks a field; the message names them."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: the text the policy sees (templated) and its label."""

    text: str
    label: Any
    source: str


def read_rows(path: str) -> list[dict[str, Any]]:
    """Rows of a .json (a list), .jsonl, .parquet file or a ``datasets.save_to_disk`` dir."""
    p = pathlib.Path(path)
    if not p.exists():
        raise DataSourceError(f"data source {path!r} does not exist")
    try:
        if p.is_dir():
            import datasets  # pyright: ignore[reportMissingImports]

            loaded = datasets.load_from_disk(str(p))
            if isinstance(loaded, datasets.DatasetDict):
                loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
            return [dict(r) for r in loaded]
        if p.suffix == ".jsonl":
            rows = []
            for n, line in enumerate(p.read_text().splitlines(), start=1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise DataSourceError(f"{path}:{n} is not valid JSON: {exc}") from None
            return rows
        if p.suffix == ".json":
            data = json.loads(p.read_text())
            if not isinstance(data, list):
                raise DataSourceError(f"{path} must hold a JSON list of rows")
            return data
        if p.suffix == ".parquet":
            import pyarrow.parquet as pq  # pyright: ignore[reportMissingImports]

            return pq.read_table(p).to_pylist()
    except ImportError as exc:
        raise DataSourceError(f"reading {path} needs {exc.name}: pip install {exc.name}") from None
    raise DataSourceError(f"{path}: use .json, .jsonl, .parquet or a saved HF dataset directory")


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
    return Prompt(text, row[config.label_key], source)


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
        rows = read_rows(path)[: config.max_samples]
        if not rows:
            raise DataSourceError(f"data source {path!r} has no rows")
        out[name] = [render(r, i, path, config, tokenizer) for i, r in enumerate(rows)]
    return out


class PromptSampler:
    """Prompts in shuffled epochs, blended across sources by probability; its state is a few
    integers, so a resumed run sees the same prompts in the same order.

    Args:
        sources: Prompts per source.
        probs: Blend weights (default equal).
        seed: Shuffling seed.
    """

    def __init__(
        self, sources: Mapping[str, Sequence[Prompt]], *, probs: Sequence[float] = (), seed: int
    ) -> None:
        self.names = list(sources)
        self.sources = [list(sources[n]) for n in self.names]
        if probs and len(probs) != len(self.sources):
            raise DataSourceError(
                f"--data.prompt_data_probs has {len(probs)} weights for {len(self.sources)} sources"
            )
        self.probs = list(probs) or [1.0] * len(self.sources)
        self.seed = seed
        self.drawn = 0
        self.positions = [0] * len(self.sources)

    def _order(self, source: int, epoch: int) -> list[int]:
        order = list(range(len(self.sources[source])))
        random.Random(f"{self.seed}-{source}-{epoch}").shuffle(order)
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
