"""ChatTurns: feedback rendered through the chat template, closing the policy's turn exactly once."""

import pytest

from rlhf.agents import ChatTurns


def test_feedback_after_a_stopped_turn_and_after_a_cut_turn(tokenizer) -> None:
    turns = ChatTurns(tokenizer)
    assert turns.turn_suffix == "<|im_end|>\n"
    stopped = [*tokenizer.encode("7", add_special_tokens=False), tokenizer.eos_token_id]
    cut = tokenizer.encode("7 and", add_special_tokens=False)
    assert (
        turns.feedback_text(stopped, "Too low.")
        == "\n<|im_start|>user\nToo low.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        turns.feedback_text(cut, "Too low.")
        == "<|im_end|>\n<|im_start|>user\nToo low.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_without_a_chat_template_feedback_is_plain_text(tokenizer) -> None:
    template = tokenizer.chat_template
    tokenizer.chat_template = None
    try:
        assert ChatTurns(tokenizer).feedback_text([1, 2], " Too low.") == " Too low."
    finally:
        tokenizer.chat_template = template


def test_a_template_that_rewrites_history_is_refused(tokenizer) -> None:
    template = tokenizer.chat_template
    # Renders only the last message: a conversation is not a prefix of its continuation.
    tokenizer.chat_template = (
        "{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    )
    try:
        with pytest.raises(ValueError, match="prefix-stable template"):
            ChatTurns(tokenizer)
    finally:
        tokenizer.chat_template = template
