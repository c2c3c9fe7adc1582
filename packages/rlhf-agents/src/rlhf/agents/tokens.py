"""Token-space helpers shared by the executors: prompt encoding and chat-turn rendering."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

_USER_PROBE = "\u2402probe-user\u2402"
_ASSISTANT_PROBE = "\u2402probe-assistant\u2402"


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the executors use."""

    chat_template: Any

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = ...) -> str: ...
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def encode_prompt(
    tokenizer: Tokenizer, prompt: str, *, max_prompt_len: int
) -> tuple[list[int], bool]:
    """Token ids of an already templated prompt, without special tokens, left-truncated.

    Returns:
        (ids, truncated): the last ``max_prompt_len`` ids and whether any were dropped.
    """
    if max_prompt_len < 1:
        raise ValueError(f"max_len leaves no room for the prompt (max_prompt_len={max_prompt_len})")
    ids = list(tokenizer.encode(prompt, add_special_tokens=False))
    if len(ids) > max_prompt_len:
        return ids[-max_prompt_len:], True
    return ids, False


class ChatTurns:
    """Renders environment feedback as a new user turn through the tokenizer's chat template.

    For a ChatML template the policy's turn ends with the sampled ``<|im_end|>``; the template
    would then write ``\\n<|im_start|>user\\n{feedback}<|im_end|>\\n<|im_start|>assistant\\n``.
    This class derives that text from the template itself (rendering a probe conversation with
    and without an extra user turn), so the token stream equals what the model sees when the
    whole conversation is templated at once. Without a chat template the feedback is appended
    as plain text.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.turn_suffix = ""
        self.user_prefix: str | None = None
        self.user_suffix = ""
        if getattr(tokenizer, "chat_template", None):
            self._probe()

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        out = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        return str(out)

    def _probe(self) -> None:
        convo = [
            {"role": "user", "content": _USER_PROBE},
            {"role": "assistant", "content": _ASSISTANT_PROBE},
        ]
        base = self._render(convo, generation_prompt=False)
        full = self._render(
            [*convo, {"role": "user", "content": _USER_PROBE}], generation_prompt=True
        )
        if not full.startswith(base) or _ASSISTANT_PROBE not in base:
            raise ValueError(
                "the tokenizer's chat template does not render a conversation as a prefix of its "
                "continuation; multi-turn token-in-token-out needs a prefix-stable template"
            )
        self.turn_suffix = base[base.rindex(_ASSISTANT_PROBE) + len(_ASSISTANT_PROBE) :]
        new_turn = full[len(base) :]
        self.user_prefix, self.user_suffix = new_turn.split(_USER_PROBE, 1)

    def feedback_text(self, action_ids: Sequence[int], feedback: str) -> str:
        """Text to append after the policy's action so the next turn starts correctly."""
        if self.user_prefix is None:
            return feedback
        # Close the assistant turn with whatever of the template's turn suffix was not sampled
        # (a stopped turn already ends with the end-of-turn token).
        tail = self.tokenizer.decode(list(action_ids[-4:]), skip_special_tokens=False)
        closing = self.turn_suffix
        for k in range(len(self.turn_suffix), 0, -1):
            if tail.endswith(self.turn_suffix[:k]):
                closing = self.turn_suffix[k:]
                break
        return closing + self.user_prefix + feedback + self.user_suffix
