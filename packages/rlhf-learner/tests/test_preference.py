"""`rlhf.learner.preference`: a batch of P pairs holds the chosen rows, then the rejected rows
in the same order, and every selection and micro-batch keeps pairs whole (row i with row
P + i), margins on both rows of their pair; a bad margin is named by row."""

from __future__ import annotations

import pytest
import torch

from rlhf.learner import DataError, preference_row
from rlhf.learner.preference import (
    pair_accuracy,
    pair_micro_batches,
    preference_batch,
    select_pairs,
)

ROWS = [
    {"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1), "m": float(i)}
    for i in range(5)
]


def _batch(tokenizer, **kw):
    return preference_batch(
        ROWS, tokenizer, prompt_key="prompt", chosen_key="chosen", rejected_key="rejected",
        input_template=None, max_len=64, pad_token_id=0, source="pairs.jsonl", **kw,
    )  # fmt: skip


def _ids(batch, row: int) -> list[int]:
    return batch.input_ids[row][batch.attention_mask[row].bool()].tolist()


def test_pairs_stay_whole_through_selection_and_micro_batches(tokenizer) -> None:
    batch = _batch(tokenizer, margin_key="m")
    assert batch.size == 2 * len(ROWS)
    for i, row in enumerate(ROWS):
        chosen, rejected = preference_row(row, i, tokenizer)
        assert _ids(batch, i) == chosen.input_ids
        assert _ids(batch, len(ROWS) + i) == rejected.input_ids
    assert batch["margin"].tolist() == [float(i) for i in range(5)] * 2
    picked = select_pairs(batch, [3, 1])
    assert [_ids(picked, r) for r in range(4)] == [
        _ids(batch, 3), _ids(batch, 1), _ids(batch, 8), _ids(batch, 6)
    ]  # fmt: skip
    micro = pair_micro_batches(batch, 2)
    assert [m.size for m in micro] == [4, 4, 2]  # pairs (0, 1), (2, 3), (4)
    assert [_ids(micro[2], r) for r in range(2)] == [_ids(batch, 4), _ids(batch, 9)]
    assert torch.equal(micro[1]["margin"], torch.tensor([2.0, 3.0, 2.0, 3.0]))


def test_a_margin_that_is_not_a_finite_number_is_named(tokenizer) -> None:
    bad = [dict(ROWS[0]), {**ROWS[1], "m": float("nan")}]
    with pytest.raises(DataError, match=r"row 1 of pairs.jsonl: --margin_key 'm' must name a"):
        preference_batch(
            bad, tokenizer, prompt_key="prompt", chosen_key="chosen", rejected_key="rejected",
            input_template=None, max_len=64, pad_token_id=0, source="pairs.jsonl", margin_key="m",
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"kind must be 'rm' or 'dpo', got 'ppo'"):
        pair_accuracy(None, _batch(tokenizer), kind="ppo", micro=None)  # type: ignore[arg-type]
