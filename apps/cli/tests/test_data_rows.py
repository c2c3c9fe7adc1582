"""Prompt rows through ``rlhf train``: truncated and lossy prompts counted in the first step's
metrics, and pass@k over graded scores. How rows become prompts, and the rows that are not
prompts, are tested in the learner's ``tests/test_prompts.py``."""

from __future__ import annotations

import json

import pytest

from .conftest import rlhf, small_run


def test_truncated_and_lossy_prompts_are_counted_in_the_metrics(assets, tmp_path) -> None:
    """Four prompts of 5 tokens (4 digits and ':'); with max_len 9 and 6 new tokens the
    prompt budget is 3 tokens, so each of the 4 prompts of the step is cut. Two of them also
    hold a character the demo tokenizer drops (日): trained on, told and counted."""
    data = tmp_path / "p.jsonl"
    prompts = ["4213:", "日1234:", "3321:", "55日12:"]
    data.write_text("".join(json.dumps({"input": p, "label": "1"}) + "\n" for p in prompts))
    args = [*small_run(assets, steps=1, prompts=4, samples=2, max_new_tokens=6)]
    args[args.index("--rollout.max_len") + 1] = "9"
    args[args.index("--data.prompt_data") + 1] = str(data)
    out = rlhf("train", "grpo", "--run_dir", str(tmp_path / "run"), *args)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"[data] {data} (p): 2 of 4 prompts lose 2 characters" in out.stdout
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    (step,) = [r for r in rows if "reward/mean" in r]
    assert step["rollout/prompts_truncated"] == 4.0
    assert (step["data/lossy_prompts"], step["data/unknown_chars"]) == (2.0, 2.0)


def test_pass_at_k_counts_solved_samples_not_partial_credit() -> None:
    from rlhf.rollout.sampling import pass_at

    # Three prompts, four samples each, graded scores: prompt 0 solved twice, prompt 1 only
    # partial credit, prompt 2 solved once.
    scores = [[1.0, 0.5, 1.0, 0.0], [0.75, 0.5, 0.25, 0.75], [0.0, 0.0, 0.0, 1.0]]
    out = pass_at(scores, k=4, threshold=1.0)
    assert out["pass@1"] == pytest.approx((2 / 4 + 0 + 1 / 4) / 3)
    assert out["pass@4"] == pytest.approx(2 / 3)  # "any score > 0" said 3/3
    assert out["score_mean"] == pytest.approx((2.5 / 4 + 2.25 / 4 + 1 / 4) / 3)
    # A 0/1 reward at threshold 1: pass@1 is the mean score, as before.
    binary = [[1.0, 0.0], [0.0, 0.0]]
    assert pass_at(binary, k=2, threshold=1.0) == {"pass@1": 0.25, "pass@2": 0.5,
                                                   "score_mean": 0.25}  # fmt: skip
    assert pass_at(scores, k=4, threshold=0.5)["pass@4"] == 1.0
