"""Token-space helpers shared by the executors: prompt encoding and chat-turn rendering."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

_USER_PROBE = "\u2402probe-user\u2402"
_ASSISTANT_PROBE = "\u2402probe-assistant\u2402"


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the executors use."""

    @property
    def chat_template(self) -> str | Mapping[str, str] | None:
        """The chat template (or named templates); None or empty: the tokenizer has none."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = ...) -> str: ...
    def apply_chat_template(
        self,
        conversation: list[dict[str, str]],
        *,
        tokenize: bool = ...,
        add_generation_prompt: bool = ...,
    ) -> object:
        """The conversation rendered (``tokenize=False``: as text; the executors take its
        ``str``)."""
        ...


class CallableTokenizer(Tokenizer, Protocol):
    """A `Tokenizer` that is also called as Hugging Face's are, the way OpenRLHF's executors
    encode text: ``tokenizer(text, add_special_tokens=False)["input_ids"]``."""

    def __call__(
        self, text: str, *, add_special_tokens: bool = ...
    ) -> Mapping[str, Sequence[int]]: ...


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
    The closing of the assistant turn is derived from the template (a probe conversation) and
    matched against the sampled tokens by **token id**, so a turn cut off by the length limit is
    closed with the real end-of-turn token. The new user turn is rendered through the template
    with the actual feedback each time (templates may trim or escape content), and must extend
    the conversation as a prefix. Without a chat template the feedback is appended as plain text.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self.turn_suffix_ids: list[int] = []
        if self.templated:
            base = self._render(self._probe_conversation(), generation_prompt=False)
            if _ASSISTANT_PROBE not in base:
                raise ValueError("the chat template does not render assistant messages")
            suffix = base[base.rindex(_ASSISTANT_PROBE) + len(_ASSISTANT_PROBE) :]
            self.turn_suffix_ids = list(tokenizer.encode(suffix, add_special_tokens=False))
            self.user_turn_ids(_USER_PROBE)  # fail at construction on a prefix-unstable template

    @staticmethod
    def _probe_conversation() -> list[dict[str, str]]:
        return [
            {"role": "user", "content": _USER_PROBE},
            {"role": "assistant", "content": _ASSISTANT_PROBE},
        ]

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        out = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        return str(out)

    def user_turn_ids(self, feedback: str) -> list[int]:
        """Token ids of a new user turn holding ``feedback`` plus the assistant header."""
        convo = self._probe_conversation()
        base = self._render(convo, generation_prompt=False)
        full = self._render([*convo, {"role": "user", "content": feedback}], generation_prompt=True)
        if not full.startswith(base):
            raise ValueError(
                "the tokenizer's chat template does not render a conversation as a prefix of its "
                "continuation; multi-turn token-in-token-out needs a prefix-stable template"
            )
        return list(self.tokenizer.encode(full[len(base) :], add_special_tokens=False))

    def closing_ids(self, action_ids: Sequence[int]) -> list[int]:
        """The part of the template's end-of-turn tokens that the policy did not sample."""
        suffix = self.turn_suffix_ids
        tail = list(action_ids[-len(suffix) :]) if suffix else []
        for k in range(len(suffix), 0, -1):
            if tail[-k:] == suffix[:k]:
                return suffix[k:]
        return list(suffix)

    def feedback_ids(self, action_ids: Sequence[int], feedback: str) -> list[int]:
        """Token ids to append after the policy's action so the next turn starts correctly."""
        if not self.templated:
            return list(self.tokenizer.encode(feedback, add_special_tokens=False))
        return self.closing_ids(action_ids) + self.user_turn_ids(feedback)
