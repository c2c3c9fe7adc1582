"""``--rollout.dump_dir`` / ``--rollout.replay_dir`` before anything starts: what a replay must
match of the dump, named by flag (the bit-exact replay itself runs in test_commands' GRPO run)."""

from __future__ import annotations

import pytest

from rlhf.agents import Trajectory
from rlhf.cli.config import ConfigError, replace
from rlhf.cli.dumps import open_dumps
from rlhf.cli.presets import resolve
from rlhf.rollout import Rollout


def _config(assets, tmp_path, **changes):
    return replace(
        resolve("grpo"),
        **{
            "actor.model.path": str(assets["model"]),
            "data.prompt_data": str(assets["train"]),
            "run_dir": str(tmp_path / "run"),
            "train.num_steps": 2,
            "rollout.batch_size": 4,
            "rollout.n_samples_per_prompt": 4,
            **changes,
        },
    )


def _rollout(step: int) -> Rollout:
    one = Trajectory(
        token_ids=(1, 2, 3), action_mask=(0, 1, 1), rollout_logprobs=(0.0, -0.5, -0.25),
        prompt_length=1, reward=1.0, turn_rewards=(1.0,), score=1.0, truncated=False,
        finish_reason="stop",
    )  # fmt: skip
    return Rollout(step=step, trajectories=[one], metrics={}, sampler_state={})


def test_a_replay_must_match_the_dumps_policy_shape_and_steps(assets, tmp_path) -> None:
    where = str(tmp_path / "dump")
    dump, replay = open_dumps(_config(assets, tmp_path, **{"rollout.dump_dir": where}))
    assert dump is not None and replay is None
    dump.write(_rollout(0))
    with pytest.raises(ConfigError, match=r"holds no rollout for step\(s\) \[2\] of --train"):
        open_dumps(_config(assets, tmp_path, **{"rollout.replay_dir": where}))
    dump.write(_rollout(1))
    _, replay = open_dumps(_config(assets, tmp_path, **{"rollout.replay_dir": where}))
    assert replay is not None and replay.read(1) == _rollout(1)
    # Another group size: the samples' groups would be cut wrong.
    with pytest.raises(ConfigError) as caught:
        open_dumps(
            _config(
                assets, tmp_path,
                **{"rollout.replay_dir": where, "rollout.n_samples_per_prompt": 8},
            )
        )  # fmt: skip
    assert "--rollout.replay_dir" in str(caught.value)
    assert "rollout.n_samples_per_prompt: dumped 4, here 8" in str(caught.value)
    # A new learning rate is what a replay is for: accepted.
    open_dumps(
        _config(assets, tmp_path, **{"rollout.replay_dir": where, "actor.optimizer.lr": 1.0})
    )
    # Dumping a run of other samples into the same directory is refused.
    with pytest.raises(
        ConfigError, match=r"--rollout.dump_dir: .* \(train.seed: dumped 42, here 7\)"
    ):
        open_dumps(_config(assets, tmp_path, **{"rollout.dump_dir": where, "train.seed": 7}))
    with pytest.raises(ConfigError, match="--rollout.replay_dir: .* holds no rollout dump"):
        open_dumps(_config(assets, tmp_path, **{"rollout.replay_dir": str(tmp_path / "none")}))
    same = _config(assets, tmp_path, **{"rollout.replay_dir": where, "rollout.dump_dir": where})
    with pytest.raises(ConfigError, match="name the same directory"):
        same.validate()
