"""Help a person can read in an 80-column terminal.

- ``rlhf train --help``: the commands, one line each, and where each one's flags are.
- ``rlhf train <command> --help``: the flags most runs set, grouped by section (the first part
  of the dotted name), each with its default and the first sentence of its documentation.
- ``--help-all``: every flag (tyro's full help) and the OpenRLHF spellings the command reads.

The text comes from the configs' own docstrings (their ``Attributes:`` sections), so it
cannot drift from the flags.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

WIDTH = 80

COMMON: dict[str, tuple[str, ...]] = {
    "rl": (
        "run_dir", "dry_run",
        "actor.model.path", "actor.num_ranks", "actor.num_gpus_per_rank",
        "actor.optimizer.lr", "actor.deepspeed.zero_stage", "actor.deepspeed.bf16",
        "critic.model.path", "teacher.model.path",
        "data.prompt_data", "data.input_key", "data.label_key", "data.apply_chat_template",
        "data.eval_data",
        "reward.reward_func", "reward.remote_url",
        "rollout.batch_size", "rollout.n_samples_per_prompt", "rollout.max_new_tokens",
        "rollout.max_len", "rollout.temperature",
        "vllm.num_engines", "vllm.tensor_parallel_size",
        "algo.advantage.estimator", "algo.kl.init_coef",
        "train.num_steps", "train.agent_func_path", "train.async_enable", "train.colocate_all",
        "eval.steps", "ckpt.save_steps", "ckpt.load_enable",
    ),
    "sft": (
        "run_dir", "dry_run", "dataset", "eval_dataset", "input_key", "output_key",
        "messages_key", "input_template", "max_len", "batch_size", "micro_batch_size",
        "num_steps", "num_epochs", "model.model.path", "model.optimizer.lr",
        "model.deepspeed.zero_stage", "ckpt.save_steps", "ckpt.load_enable",
    ),
    "preference": (
        "run_dir", "dry_run", "dataset", "eval_dataset", "prompt_key", "chosen_key",
        "rejected_key", "input_template", "max_len", "batch_size", "micro_batch_size",
        "num_steps", "num_epochs", "beta", "loss_type", "model.model.path",
        "model.optimizer.lr", "model.deepspeed.zero_stage", "ckpt.save_steps",
        "ckpt.load_enable",
    ),
}  # fmt: skip
"""The flags ``--help`` shows per kind of command; ``--help-all`` shows the rest."""

TRAINERS = {
    "sft": "Supervised fine-tuning on prompt/response or chat rows.",
    "rm": "A reward model from preference pairs (chosen over rejected).",
    "dpo": "DPO (or IPO) on preference pairs against the initial model.",
}
"""What ``rlhf train --help`` says of the supervised stages."""


@functools.cache
def attribute_docs(cls: type) -> dict[str, str]:
    """The ``Attributes:`` docstring sections of ``cls`` and the classes it extends, as
    field name → text (one line); a subclass's own text wins."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        docs.update(_own_attribute_docs(klass))
    return docs


def _own_attribute_docs(cls: type) -> dict[str, str]:
    doc = textwrap.dedent((cls.__doc__ or "").split("\n", 1)[-1])
    _, found, section = doc.partition("Attributes:")
    if not found:
        return {}
    docs: dict[str, list[str]] = {}
    current: list[str] | None = None
    indent = None
    for line in section.splitlines():
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        entry = re.match(r"\s*(\w+):\s*(.*)", line)
        if depth == indent and entry:
            current = docs.setdefault(entry.group(1), [entry.group(2)])
        elif depth > indent and current is not None:
            current.append(line.strip())
        elif depth < indent:
            break
    return {name: " ".join(parts) for name, parts in docs.items()}


_ABBREVIATIONS = ("Dr.", "e.g.", "i.e.", "vs.", "etc.", "arXiv.")


def first_sentence(text: str) -> str:
    """The first sentence of ``text`` (up to a full stop before a space, abbreviations such as
    "Dr." and "e.g." aside), RST literals (````x````, ```x```) as plain text."""
    plain = re.sub(r"``([^`]*)``", r"\1", text)
    plain = re.sub(r"`([^`]*)`", r"\1", plain)
    for match in re.finditer(r"\.\s", plain):
        head = plain[: match.start() + 1]
        if not head.endswith(_ABBREVIATIONS):
            return head
    return plain


def _field(cls: type, dotted: str) -> tuple[type, str, Any]:
    """The config class holding ``dotted``'s last part, that part, and its type."""
    owner: Any = cls
    *path, leaf = dotted.split(".")
    for part in path:
        kind = typing.get_type_hints(owner)[part]
        owner = next(m for m in _members(kind) if dataclasses.is_dataclass(m))
    return owner, leaf, typing.get_type_hints(owner)[leaf]


def _members(kind: Any) -> list[Any]:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(kind) if a is not type(None)]
    return [kind]


def _value(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def _metavar(kind: Any) -> str:
    members = _members(kind)
    if bool in members:
        return "[True|False]"
    if int in members:
        return "INT"
    if float in members:
        return "FLOAT"
    if any(typing.get_origin(m) is tuple for m in members):
        return "VALUE ..."
    return "TEXT"


def flag_entry(cls: type, default: Any, dotted: str, *, aliases: Sequence[str] = ()) -> list[str]:
    """``--dotted`` with its metavar and default, then its documentation's first sentence
    and the OpenRLHF spellings that set it (``aliases``), wrapped to `WIDTH`."""
    owner, leaf, kind = _field(cls, dotted)
    value = _value(default, dotted)
    shown = "off" if value is False else "''" if value == "" else value
    head = f"  --{dotted} {_metavar(kind)}  (default: {shown})"
    doc = first_sentence(attribute_docs(owner).get(leaf, ""))
    if aliases:
        doc += f" OpenRLHF: {', '.join(aliases)}."
    body = textwrap.wrap(
        doc, WIDTH, initial_indent=" " * 6, subsequent_indent=" " * 6, break_on_hyphens=False
    )
    return [head if len(head) <= WIDTH else head[: WIDTH - 1] + "…", *body]


def command_help(
    cls: type,
    default: Any,
    *,
    prog: str,
    summary: str,
    common: Sequence[str],
    total: int,
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> str:
    """``prog --help``: ``summary``, then the ``common`` flags grouped by section, each with
    the OpenRLHF spellings that set it (``aliases``: our dotted name → theirs)."""
    lines = [f"usage: {prog} [flags]", "", *textwrap.wrap(summary, WIDTH), ""]
    lines += textwrap.wrap(
        f"The flags most runs set, by section. `{prog} --help-all` lists all {total} "
        "flags (and the OpenRLHF spellings this command reads); `--config FILE` loads "
        "values first.",
        WIDTH,
        break_on_hyphens=False,
    )
    sections: dict[str, list[str]] = {}
    for dotted in common:
        section = dotted.split(".")[0] if "." in dotted else "run"
        sections.setdefault(section, []).append(dotted)
    for section, names in sections.items():
        lines += ["", f"{section}:"]
        for dotted in names:
            lines += flag_entry(cls, default, dotted, aliases=(aliases or {}).get(dotted, ()))
    return "\n".join(lines)


def train_overview() -> str:
    """``rlhf train --help``: every command with one line, and where their flags are."""
    from rlhf.cli.presets import PRESET_DOCS

    def row(name: str, text: str) -> list[str]:
        return textwrap.wrap(
            text,
            WIDTH,
            initial_indent=f"  {name:<20}",
            subsequent_indent=" " * 22,
            break_on_hyphens=False,
        )

    lines = ["usage: rlhf train COMMAND [flags]", "", "Reinforcement learning (one command; "
             "each preset is its algorithm's defaults):"]  # fmt: skip
    for name, doc in PRESET_DOCS.items():
        lines += row(name, first_sentence(doc))
    lines += ["", "Supervised stages:"]
    for name, text in TRAINERS.items():
        lines += row(name, text)
    lines += [""]
    lines += textwrap.wrap(
        "`rlhf train COMMAND --help` shows the flags most runs set, by section; "
        "`--help-all` shows every flag and the OpenRLHF spellings it reads; "
        "`rlhf config show PRESET` prints a preset's values.",
        WIDTH,
        break_on_hyphens=False,
    )
    return "\n".join(lines)
