"""`rlhf.cli.best`: which evaluation is best, what a resumed run remembers, which names exist."""

from __future__ import annotations

import json

import pytest

from rlhf.cli.best import BestModel, check_metric, metric_names
from rlhf.cli.config import ConfigError

M = "eval/math/pass@1"


def test_max_and_min_keep_the_first_of_equal_values(tmp_path) -> None:
    best = BestModel.open(metric=M, mode="max", directory=tmp_path)
    assert best.value is None and best.improves({M: 0.0})
    best.record(step=0, evaluation={M: 0.5})
    assert not best.improves({M: 0.5}) and not best.improves({M: 0.4})
    assert best.improves({M: 0.6})
    low = BestModel(metric=M, mode="min", directory=tmp_path, value=0.5, step=3)
    assert low.improves({M: 0.4}) and not low.improves({M: 0.5}) and not low.improves({M: 0.6})


def test_a_resumed_run_beats_the_recorded_value(tmp_path) -> None:
    BestModel(metric=M, mode="max", directory=tmp_path).record(step=4, evaluation={M: 0.75})
    assert json.loads((tmp_path / "best.json").read_text()) == {
        "metric": M, "mode": "max", "value": 0.75, "step": 4,
    }  # fmt: skip
    again = BestModel.open(metric=M, mode="max", directory=tmp_path)
    assert (again.value, again.step) == (0.75, 4)
    assert not again.improves({M: 0.7}) and again.improves({M: 0.8})
    # Another metric or mode than the record's: start over.
    other = BestModel.open(metric="eval/math/score_mean", mode="max", directory=tmp_path)
    assert other.value is None
    assert BestModel.open(metric=M, mode="min", directory=tmp_path).value is None


def test_only_logged_metrics_are_accepted() -> None:
    assert metric_names(["a"], n_samples=4) == [
        "eval/a/pass@1",
        "eval/a/pass@4",
        "eval/a/score_mean",
    ]
    check_metric("eval/a/pass@4", sources=["a", "b"], n_samples=4)
    with pytest.raises(ConfigError, match=r"--eval.best_metric 'eval/a/pass@8'.*eval/b/score_mean"):
        check_metric("eval/a/pass@8", sources=["a", "b"], n_samples=4)


def test_best_metric_needs_evaluations_and_a_mode(tmp_path) -> None:
    from rlhf.cli.config import replace
    from rlhf.cli.presets import resolve

    base = {"actor.model.path": str(tmp_path), "data.prompt_data": "x.jsonl"}
    config = replace(resolve("grpo"), **base, **{"eval.best_metric": M, "eval.best_mode": "top"})
    with pytest.raises(ConfigError) as refused:
        config.validate()
    assert "--eval.best_mode must be max or min, got 'top'" in str(refused.value)
    assert "--eval.best_metric compares evaluations: give --data.eval_data" in str(refused.value)
