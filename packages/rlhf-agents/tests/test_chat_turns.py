"""ChatTurns: feedback rendered through the chat template, closing the policy's turn exactly once."""

import pytest

from rlhf.agents import ChatTurns


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_turn_suffix_is_the_end_of_turn_token_then_newline(tokenizer) -> None:
    turns = ChatTurns(tokenizer)
    assert turns.turn_suffix_ids == [tokenizer.eos_token_id, *ids(tokenizer, "\n")]


def test_feedback_after_a_stopped_turn_and_after_a_cut_turn(tokenizer) -> None:
    turns = ChatTurns(tokenizer)
    new_turn = ids(tokenizer, "<|im_start|>user\nToo low.<|im_end|>\n<|im_start|>assistant\n")
    stopped = [*ids(tokenizer, "7"), tokenizer.eos_token_id]
    cut = ids(tokenizer, "7 and")
    assert turns.feedback_ids(stopped, "Too low.") == ids(tokenizer, "\n") + new_turn
    assert turns.feedback_ids(cut, "Too low.") == [
        tokenizer.eos_token_id,
        *ids(tokenizer, "\n"),
        *new_turn,
    ]


def test_a_cut_turn_ending_in_text_that_looks_like_the_suffix_gets_the_real_token(
    tokenizer,
) -> None:
    # The action's text ends with "<" (a prefix of "<|im_end|>" as text): the closing must still
    # be the end-of-turn *token*, not the characters "|im_end|>".
    turns = ChatTurns(tokenizer)
    action = ids(tokenizer, "x <")
    closing = turns.closing_ids(action)
    assert closing[0] == tokenizer.eos_token_id
    assert tokenizer.decode(action + closing) == "x <<|im_end|>\n"


def test_feedback_goes_through_the_template_so_content_filters_apply(tokenizer) -> None:
    template = tokenizer.chat_template
    tokenizer.chat_template = template.replace("{{ m['content'] }}", "{{ m['content'] | trim }}")
    try:
        turns = ChatTurns(tokenizer)
        out = turns.feedback_ids([tokenizer.eos_token_id], "  Too low.\n")
        assert (
            tokenizer.decode(out)
            == "\n<|im_start|>user\nToo low.<|im_end|>\n<|im_start|>assistant\n"
        )
    finally:
        tokenizer.chat_template = template


def test_without_a_chat_template_feedback_is_plain_text(tokenizer) -> None:
    template = tokenizer.chat_template
    tokenizer.chat_template = None
    try:
        assert ChatTurns(tokenizer).feedback_ids([1, 2], " Too low.") == ids(tokenizer, " Too low.")
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
