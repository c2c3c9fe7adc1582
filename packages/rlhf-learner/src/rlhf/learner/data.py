"""Dataset rows → token rows with loss masks, for SFT, reward-model and DPO training.

SFT rows are either ``{input_key: prompt, output_key: response}`` (single turn) or
``{messages_key: [{"role", "content"}, ...]}`` (multi turn: every assistant message is learned,
everything else is context), rendered with the tokenizer's chat template or, without one, a
plain ``input_template``. Preference rows are ``{prompt_key, chosen_key, rejected_key}``.
``pretrain`` mode learns every token of ``input_key``.

A row without a needed key raises `DataError` naming the row index and the key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class DataError(ValueError):
    """A dataset row cannot be used; the message names the row and the key."""


@dataclass(frozen=True)
class TokenRow:
    """One training row: token ids and a 0/1 mask of the tokens to learn (same length)."""

    input_ids: list[int]
    loss_mask: list[int]


def _field(row: Mapping[str, Any], key: str, index: int) -> Any:
    if not isinstance(row, Mapping):
        raise DataError(f"row {index} is a {type(row).__name__}, expected a mapping of fields")
    if key not in row or row[key] is None:
        raise DataError(f"row {index} has no {key!r} (it has {sorted(row)}); set the key flag")
    return row[key]


def _render(tokenizer: Any, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _eos(tokenizer: Any) -> list[int]:
    return [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]


def _prompt_and_response(
    tokenizer: Any, prompt: str, response: str, *, input_template: str | None
) -> tuple[list[int], list[int]]:
    """Token ids of the rendered prompt, and of the response as the model must produce it."""
    if input_template is None and getattr(tokenizer, "chat_template", None):
        context = _render(tokenizer, [{"role": "user", "content": prompt}], generation_prompt=True)
        full = _render(
            tokenizer,
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
            generation_prompt=False,
        )
        if not full.startswith(context):
            raise DataError("the chat template does not extend the prompt with the response")
        prompt_ids = _encode(tokenizer, context)
        response_ids = _encode(tokenizer, full)[len(prompt_ids) :]
        return prompt_ids, response_ids
    template = input_template or "{}"
    prompt_ids = _encode(tokenizer, template.format(prompt))
    return prompt_ids, _encode(tokenizer, response) + _eos(tokenizer)


def sft_row(
    row: Mapping[str, Any],
    index: int,
    tokenizer: Any,
    *,
    input_key: str = "input",
    output_key: str = "output",
    messages_key: str | None = None,
    input_template: str | None = None,
    pretrain: bool = False,
    max_len: int | None = None,
) -> TokenRow:
    """One SFT row (see the module docstring); truncated on the right to ``max_len``."""
    if pretrain:
        ids = _encode(tokenizer, str(_field(row, input_key, index))) + _eos(tokenizer)
        mask = [1] * len(ids)
    elif messages_key is not None:
        ids, mask = _multi_turn(_field(row, messages_key, index), index, tokenizer, messages_key)
    else:
        prompt_ids, response_ids = _prompt_and_response(
            tokenizer,
            str(_field(row, input_key, index)),
            str(_field(row, output_key, index)),
            input_template=input_template,
        )
        ids = prompt_ids + response_ids
        mask = [0] * len(prompt_ids) + [1] * len(response_ids)
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    if not any(mask):
        raise DataError(f"row {index} has no token to learn within max_len={max_len}")
    return TokenRow(ids, mask)


def _multi_turn(messages: Any, index: int, tokenizer: Any, key: str) -> tuple[list[int], list[int]]:
    """Every assistant message learned (its content and end-of-turn tokens), the rest context.

    Each turn's tokens are the difference between renderings of the conversation up to it, so
    they are exactly what the chat template produces for the whole conversation."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise DataError(f"row {index}: {key!r} must be a non-empty list of messages")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("multi-turn SFT rows need a tokenizer with a chat template")
    ids: list[int] = []
    mask: list[int] = []
    for turn, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise DataError(f"row {index}: message {turn} of {key!r} needs 'role' and 'content'")
        so_far = list(messages[: turn + 1])
        full = _encode(tokenizer, _render(tokenizer, so_far, generation_prompt=False))
        learn_from = len(full)
        if message["role"] == "assistant":
            context = list(messages[:turn])
            learn_from = len(
                _encode(tokenizer, _render(tokenizer, context, generation_prompt=True))
            )
        if full[: len(ids)] != ids or not len(ids) <= learn_from <= len(full):
            raise DataError(
                f"row {index}: the chat template's rendering of message {turn} does not extend "
                "the conversation before it; multi-turn masks need a prefix-stable template"
            )
        mask += [0] * (learn_from - len(ids)) + [1] * (len(full) - learn_from)
        ids = full
    return ids, mask


def preference_row(
    row: Mapping[str, Any],
    index: int,
    tokenizer: Any,
    *,
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    input_template: str | None = None,
    max_len: int | None = None,
) -> tuple[TokenRow, TokenRow]:
    """(chosen, rejected) rows of a preference pair, responses masked for learning."""
    prompt = str(_field(row, prompt_key, index))
    pair = []
    for key in (chosen_key, rejected_key):
        p, r = _prompt_and_response(
            tokenizer, prompt, str(_field(row, key, index)), input_template=input_template
        )
        ids, mask = p + r, [0] * len(p) + [1] * len(r)
        if max_len is not None:
            ids, mask = ids[:max_len], mask[:max_len]
        pair.append(TokenRow(ids, mask))
    return pair[0], pair[1]
