"""`rlhf.learner.datasets`: rows read back from JSON and JSON Lines, undecodable and malformed
files named by line, and blending by weight (the counts follow from the rule: every source
with a weight gives all its rows, the others none)."""

from __future__ import annotations

import collections
import json
import random

import pytest

from rlhf.learner.datasets import (
    DataSourceError,
    RowOrder,
    blend_weights,
    count_rows,
    dataset_rows,
    read_rows,
)


def test_json_and_jsonl_read_back_the_same_rows(tmp_path) -> None:
    rows = [{"input": "Wie viel ist 7·6?", "label": "42"}, {"input": "1+1=", "label": ""}]
    (tmp_path / "a.json").write_text(json.dumps(rows, ensure_ascii=False))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert read_rows(str(tmp_path / "a.json")) == rows
    assert read_rows(str(tmp_path / "a.jsonl")) == rows
    assert count_rows(f"x={tmp_path / 'a.json'},{tmp_path / 'a.jsonl'}", max_samples=1) == 2


def test_unreadable_files_are_named_with_the_line(tmp_path) -> None:
    (tmp_path / "latin.jsonl").write_bytes(b'{"input": "a"}\n{"input": "caf\xe9"}\n')
    with pytest.raises(DataSourceError, match=r"latin\.jsonl:2 is not UTF-8 text \(byte 29"):
        read_rows(str(tmp_path / "latin.jsonl"))
    (tmp_path / "cut.jsonl").write_text('{"input": "a"}\n{"input": \n')
    with pytest.raises(DataSourceError, match=r"cut\.jsonl:2 is not valid JSON"):
        read_rows(str(tmp_path / "cut.jsonl"))
    (tmp_path / "obj.json").write_text('{"input": "a"}')
    with pytest.raises(DataSourceError, match=r"must hold a JSON list of rows, not dict"):
        read_rows(str(tmp_path / "obj.json"))
    (tmp_path / "rows.csv").write_text("input,label\n")
    with pytest.raises(DataSourceError, match=r"use \.json, \.jsonl, \.parquet"):
        read_rows(str(tmp_path / "rows.csv"))


def test_blends_give_every_weighted_row_and_refuse_bad_weights(tmp_path) -> None:
    for name, n in (("a", 3), ("b", 5), ("c", 2)):
        (tmp_path / f"{name}.jsonl").write_text("".join(f'{{"s": "{name}"}}\n' for _ in range(n)))
    spec = ",".join(str(tmp_path / f"{n}.jsonl") for n in "abc")
    assert [r["s"] for r in dataset_rows(spec, seed=0)] == list("aaabbbbbcc")
    drawn = collections.Counter(r["s"] for r in dataset_rows(spec, probs=(1, 1, 0), seed=3))
    # a and b are drawn until both gave all rows (a repeats from its start), c never.
    assert drawn["c"] == 0 and drawn["a"] >= 3 and drawn["b"] >= 5
    assert blend_weights((), n_sources=2) == [1.0, 1.0]
    with pytest.raises(DataSourceError, match=r"has 1 weights for 2 sources"):
        blend_weights((1.0,), n_sources=2)
    with pytest.raises(DataSourceError, match=r"at least one weight must be positive"):
        blend_weights((0.0, 0.0), n_sources=2)
    with pytest.raises(DataSourceError, match=r"must be finite and >= 0, not \[-1\.0\]"):
        blend_weights((1.0, -1.0), n_sources=2)


def _legacy_order(n: int, batch: int, steps: int, seed: int) -> list[list[int]]:
    """The draw the commands used before checkpoints existed: whole shuffled epochs appended
    to a list while it is shorter than a batch."""
    rng, order, out = random.Random(seed), [], []
    for _ in range(steps):
        while len(order) < batch:
            epoch = list(range(n))
            rng.shuffle(epoch)
            order += epoch
        out.append(order[:batch])
        order = order[batch:]
    return out


@pytest.mark.parametrize(("n", "batch"), [(1, 1), (5, 2), (6, 4), (3, 7), (12, 8)])
def test_the_row_order_continues_exactly_from_its_state(n, batch) -> None:
    steps = 9
    expected = _legacy_order(n, batch, steps, seed=3)
    whole = RowOrder(n, seed=3)
    assert [whole.take(batch) for _ in range(steps)] == expected
    for stop in range(steps):
        first = RowOrder(n, seed=3)
        for _ in range(stop):
            first.take(batch)
        state = json.loads(json.dumps(first.state_dict()))  # as trainer_state.json holds it
        resumed = RowOrder(n, seed=99)  # the seed does not matter once the state is loaded
        resumed.load_state_dict(state, checkpoint="step-x")
        assert [resumed.take(batch) for _ in range(stop, steps)] == expected[stop:], stop
