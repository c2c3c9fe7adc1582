"""``--rollout.dump_dir`` and ``--rollout.replay_dir``: where an RL run writes the rollouts it
trains on, and where it reads them instead of sampling (`rlhf.rollout.RolloutDump`). A
replay that evaluates nothing starts no vLLM engine (`needs_engines`).

A dump records what produced its samples (`dump_meta`); a replay is refused unless the
starting policy's weights (`rlhf.learner.checkpoint_digest`), the batch, the group size and
the temperature are the dump's (`REPLAY_KEYS`: what the samples' shape and log-probs depend
on), and unless it holds every step the run trains.
"""

from __future__ import annotations

from typing import Any

from rlhf.cli.config import ConfigError, RLConfig
from rlhf.rollout import DumpError, RolloutDump

REPLAY_KEYS = (
    "policy",
    "rollout.batch_size",
    "rollout.n_samples_per_prompt",
    "rollout.temperature",
)
"""The `dump_meta` entries a replay must match."""


def dump_meta(config: RLConfig) -> dict[str, Any]:
    """What produced a run's samples: the starting policy's weights digest, the sampling
    settings and the seed."""
    from rlhf.learner import checkpoint_digest

    r = config.rollout
    return {
        "policy": checkpoint_digest(config.actor.model.path),
        "rollout.batch_size": r.batch_size,
        "rollout.n_samples_per_prompt": r.n_samples_per_prompt,
        "rollout.temperature": r.temperature,
        "rollout.max_new_tokens": r.max_new_tokens,
        "train.seed": config.train.seed,
    }


def needs_engines(config: RLConfig) -> bool:
    """Whether the run samples at all: a replay (``--rollout.replay_dir``) samples only to
    evaluate, so without ``--data.eval_data`` or with ``--eval.steps 0`` it starts no vLLM
    engine and syncs no weights."""
    evaluates = bool(config.data.eval_data.strip()) and config.eval.steps > 0
    return not config.rollout.replay_dir or evaluates


def open_dumps(config: RLConfig) -> tuple[RolloutDump | None, RolloutDump | None]:
    """The run's dump to write and dump to replay (None where the flag is unset).

    Raises:
        ConfigError: naming ``--rollout.dump_dir`` (a directory of other samples) or
            ``--rollout.replay_dir`` (no dump there, another policy or sampling shape, or
            steps missing).
    """
    r = config.rollout
    if not (r.dump_dir or r.replay_dir):
        return None, None
    meta = dump_meta(config)
    dump = replay = None
    if r.dump_dir:
        try:
            dump = RolloutDump.create(r.dump_dir, meta=meta)
        except DumpError as exc:
            raise ConfigError(f"--rollout.dump_dir: {exc}") from None
    if r.replay_dir:
        try:
            replay = RolloutDump.open(r.replay_dir)
        except DumpError as exc:
            raise ConfigError(f"--rollout.replay_dir: {exc}") from None
        differing = replay.check_meta({k: meta[k] for k in REPLAY_KEYS})
        if differing:
            raise ConfigError(
                f"--rollout.replay_dir {r.replay_dir} was dumped by another starting policy or "
                f"sampling shape ({'; '.join(differing)}): replay with the model and flags it "
                "was dumped with"
            )
        held = set(replay.steps())
        missing = [s + 1 for s in range(config.train.num_steps) if s not in held]
        if missing:
            raise ConfigError(
                f"--rollout.replay_dir {r.replay_dir} holds no rollout for step(s) "
                f"{missing[:5]}{' …' if len(missing) > 5 else ''} of --train.num_steps "
                f"{config.train.num_steps}"
            )
    return dump, replay
