"""Preference pairs as learner batches (reward models, DPO): a batch of ``P`` pairs holds the
``P`` chosen rows first, then the ``P`` rejected rows in the same order (row ``i`` and row
``P + i`` are one pair), so any selection of pairs stays whole.

- `preference_batch`: rows ``{prompt, chosen, rejected}`` tokenised (`preference_row`) and
  collated, ``loss_mask`` on the responses, and per pair a ``margin`` when asked.
- `select_pairs`, `pair_micro_batches`: pairs by index, and micro-batches of whole pairs.
- `pair_accuracy`: held-out accuracy of a role (RM: the chosen row scores higher; DPO: its
  implicit reward ``log π − log π_ref`` is higher, with ``ref_logps`` in the batch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rlhf.learner.batch import Batch, collate
from rlhf.learner.data import DataError, preference_row
from rlhf.learner.objectives import sequence_logps
from rlhf.learner.phases import per_sequence, sequence_scores_of
from rlhf.learner.role import MicroBatching, Role


def preference_batch(
    rows: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    prompt_key: str,
    chosen_key: str,
    rejected_key: str,
    input_template: str | None,
    max_len: int,
    pad_token_id: int,
    source: str,
    margin_key: str | None = None,
) -> Batch:
    """The pairs of ``rows`` (read from ``source``, which errors name) as one batch of
    ``2 P`` rows: chosen rows, then rejected rows, ``loss_mask`` (2P, L) on the responses,
    and with ``margin_key`` each pair's ``margin`` (2P,) on both of its rows (a `DataError`
    names a row whose margin is not a finite number)."""
    pairs = [
        preference_row(
            row,
            i,
            tokenizer,
            prompt_key=prompt_key,
            chosen_key=chosen_key,
            rejected_key=rejected_key,
            input_template=input_template,
            max_len=max_len,
        )
        for i, row in enumerate(rows)
    ]
    margins = []
    for i, row in enumerate(rows if margin_key is not None else []):
        value = row.get(str(margin_key))
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise DataError(
                f"row {i} of {source}: --margin_key {margin_key!r} must name a finite number, "
                f"got {value!r}"
            )
        margins.append(float(value))
    token_rows = [c for c, _ in pairs] + [r for _, r in pairs]
    return collate(
        [r.input_ids for r in token_rows],
        pad_token_id=pad_token_id,
        per_token={"loss_mask": [r.loss_mask for r in token_rows]},
        per_sequence={"margin": margins + margins} if margin_key is not None else None,
    )


def select_pairs(batch: Batch, pairs: Sequence[int]) -> Batch:
    """Pairs ``pairs`` (indices ``< P``) of a `preference_batch`, still chosen rows first."""
    n = batch.size // 2
    return batch.select([*pairs, *(n + i for i in pairs)])


def pair_micro_batches(batch: Batch, pairs_per_micro: int) -> list[Batch]:
    """``batch`` (a `preference_batch`) in micro-batches of at most ``pairs_per_micro``
    whole pairs, in order."""
    n = batch.size // 2
    return [
        select_pairs(batch, range(s, min(s + pairs_per_micro, n)))
        for s in range(0, n, pairs_per_micro)
    ]


def pair_accuracy(role: Role, held: Batch, *, kind: str, micro: MicroBatching) -> float:
    """The fraction of ``held``'s pairs whose chosen row wins: scored higher by a reward
    model (``kind`` ``rm``), or with the higher implicit reward ``log π − log π_ref``
    (``dpo``; ``held`` carries the reference's ``ref_logps``)."""
    if kind not in ("rm", "dpo"):
        raise ValueError(f"pair_accuracy: kind must be 'rm' or 'dpo', got {kind!r}")
    values = per_sequence(role, held, sequence_scores_of if kind == "rm" else sequence_logps, micro)
    if kind == "dpo":
        values = values - held["ref_logps"]
    n = held.size // 2
    return float((values[:n] > values[n:]).float().mean())
