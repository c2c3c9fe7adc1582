"""Rollout dumps: what is written reads back equal, field for field and bit for bit; a step
appears whole or not at all; a directory of other samples or another format is refused."""

from __future__ import annotations

import json
import math

import pytest
from safetensors import safe_open

from rlhf.agents import Trajectory
from rlhf.rollout import DUMP_FORMAT, DumpError, Rollout, RolloutDump


def trajectory(i: int) -> Trajectory:
    """Sample ``i``: ragged lengths, log-probs that need all of float64's bits, a multi-turn
    one with its turn ends, an unknown weight version on odd samples."""
    prompt = [7, 8, 9][: 1 + i % 3]
    actions = list(range(10, 10 + 2 + i))
    mask = [0] * len(prompt) + [1] * len(actions)
    logprobs = [0.0] * len(prompt) + [-math.pi / (k + 1) - 1e-13 * i for k in range(len(actions))]
    turns = (0.25, 0.5) if i == 2 else (1.0 / 3.0,)
    ends = (len(prompt), len(mask) - 1) if i == 2 else ()
    return Trajectory(
        token_ids=tuple(prompt + actions),
        action_mask=tuple(mask),
        rollout_logprobs=tuple(logprobs),
        prompt_length=len(prompt),
        reward=sum(turns),
        turn_rewards=turns,
        score=0.1 * i,
        truncated=i == 1,
        finish_reason="length" if i == 1 else "stop",
        metrics={"reward/format": 0.5 * i} if i else {},
        prompt_index=i // 2,
        sample_index=i % 2,
        weight_version=None if i % 2 else 3,
        turn_ends=ends,
    )


def rollout(step: int) -> Rollout:
    return Rollout(
        step=step,
        trajectories=[trajectory(i) for i in range(4)],
        metrics={"rollout/samples_crc32": 123456789.0, "time/generation_s": 0.1 + 0.2},
        sampler_state={"positions": [3, 1], "epoch": 2},
        sources=["math", "math", "code", "code"],
    )


def test_a_dumped_rollout_reads_back_equal(tmp_path) -> None:
    dump = RolloutDump.create(tmp_path / "dump", meta={"model": "abc", "n_samples": 2})
    written = [rollout(0), rollout(4)]
    for r in written:
        dump.write(r)
    again = RolloutDump.open(tmp_path / "dump")
    assert again.meta == {"model": "abc", "n_samples": 2}
    assert again.steps() == [0, 4]
    for r in written:
        assert again.read(r.step) == r  # dataclass equality: every field, floats exactly
    # The documented layout: 1-based step directories, safetensors without pickle, JSON.
    step = tmp_path / "dump" / "step-000005"
    with safe_open(str(step / "samples.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": DUMP_FORMAT}
        # sample i: 1 + i % 3 prompt tokens and 2 + i actions: 3, 5, 7, 6 tokens
        assert f.get_tensor("offsets").tolist() == [0, 3, 8, 15, 21]
        assert f.get_tensor("turn_end_offsets").tolist() == [0, 0, 0, 2, 2]
    assert json.loads((step / "rollout.json").read_text())["step"] == 4


def test_steps_are_whole_or_absent_and_missing_ones_are_named(tmp_path) -> None:
    dump = RolloutDump.create(tmp_path, meta={})
    dump.write(rollout(0))
    (tmp_path / "step-000002.tmp").mkdir()  # a write cut short: never a step
    assert dump.steps() == [0]
    with pytest.raises(DumpError, match="holds no rollout for step 2 \\(it holds steps 1-1\\)"):
        dump.read(1)
    dump.write(rollout(0))  # written again: replaced whole
    assert dump.read(0) == rollout(0)


def test_a_directory_of_other_samples_or_format_is_refused(tmp_path) -> None:
    RolloutDump.create(tmp_path / "d", meta={"model": "abc", "seed": 1})
    again = RolloutDump.create(tmp_path / "d", meta={"model": "abc", "seed": 1})  # a resume
    assert again.check_meta({"model": "abc", "seed": 1}) == []
    with pytest.raises(DumpError, match="seed: dumped 1, here 2"):
        RolloutDump.create(tmp_path / "d", meta={"model": "abc", "seed": 2})
    with pytest.raises(DumpError, match="no rollout dump"):
        RolloutDump.open(tmp_path / "empty")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "dump.json").write_text('{"format": "rlhf-rollout-dump/0"}')
    with pytest.raises(DumpError, match="format 'rlhf-rollout-dump/0'"):
        RolloutDump.open(tmp_path / "old")
