"""Presets: each RL algorithm as defaults over the one RL command (``rlhf train <name>``).

A preset only chooses the estimator and the loss settings that define the algorithm; data,
models and budgets come from flags. ``rlhf config show <name>`` prints one resolved.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from rlhf.algos import AdvantageConfig, AlgoConfig, KLConfig, PolicyLossConfig
from rlhf.cli.config import ConfigError, RLConfig, replace

PRESETS: dict[str, Callable[[], RLConfig]] = {}
PRESET_DOCS: dict[str, str] = {}
"""Each preset's docstring (what ``rlhf train --help`` says of it)."""


def preset(name: str) -> Callable[[Callable[[], AlgoConfig]], Callable[[], AlgoConfig]]:
    def register(fn: Callable[[], AlgoConfig]) -> Callable[[], AlgoConfig]:
        PRESETS[name] = lambda: replace(RLConfig(), algo=fn())
        PRESET_DOCS[name] = " ".join((fn.__doc__ or name).split())
        return fn

    return register


@preset("ppo")
def ppo() -> AlgoConfig:
    """PPO with a critic: GAE (γ = 1, λ = 0.95), whitening, clipped value loss, k1 KL in the
    reward (β = 0.01)."""
    return AlgoConfig(advantage=AdvantageConfig(estimator="gae"), kl=KLConfig(init_coef=0.01))


@preset("grpo")
def grpo() -> AlgoConfig:
    """GRPO (arXiv 2402.03300): group-normalised rewards, k3 KL as a loss (β = 0.001)."""
    return AlgoConfig(
        advantage=AdvantageConfig(estimator="group_norm"),
        kl=KLConfig(init_coef=0.001, estimator="k3", use_loss=True),
    )


@preset("dr_grpo")
def dr_grpo() -> AlgoConfig:
    """Dr. GRPO (arXiv 2503.20783): mean-subtracted rewards without the std, a constant
    length normaliser L_max (the generation budget, ``--rollout.max_new_tokens``, unless
    ``--algo.loss_agg_max_len`` says otherwise: `follow_generation_budget`), no KL."""
    return AlgoConfig(
        advantage=AdvantageConfig(estimator="dr_grpo"),
        kl=KLConfig(init_coef=0.0),
        loss_agg_mode="seq-mean-token-sum-norm",
        loss_agg_max_len=256,
    )


@preset("reinforce")
def reinforce() -> AlgoConfig:
    """REINFORCE++ (arXiv 2501.03262): discounted returns of k1 KL-shaped rewards, global
    whitening."""
    return AlgoConfig(advantage=AdvantageConfig(estimator="reinforce"), kl=KLConfig(init_coef=0.01))


@preset("reinforce_baseline")
def reinforce_baseline() -> AlgoConfig:
    """REINFORCE++-baseline: group mean baseline, then whitening; k3 KL as a loss."""
    return AlgoConfig(
        advantage=AdvantageConfig(estimator="reinforce_baseline"),
        kl=KLConfig(init_coef=0.001, estimator="k3", use_loss=True),
    )


@preset("rloo")
def rloo() -> AlgoConfig:
    """RLOO (arXiv 2402.14740): leave-one-out baseline, k1 KL in the reward."""
    return AlgoConfig(advantage=AdvantageConfig(estimator="rloo"), kl=KLConfig(init_coef=0.01))


@preset("dapo")
def dapo() -> AlgoConfig:
    """DAPO (arXiv 2503.14476): clip-higher (ε 0.2/0.28), dynamic filtering of all-right and
    all-wrong groups, token-mean loss, overlong reward shaping, no KL."""
    return AlgoConfig(
        advantage=AdvantageConfig(estimator="group_norm"),
        policy_loss=PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28),
        kl=KLConfig(init_coef=0.0),
        dynamic_filtering_enable=True,
        overlong_buffer_len=64,
        overlong_penalty_factor=1.0,
    )


@preset("distill")
def distill() -> AlgoConfig:
    """On-policy distillation: the student samples, a frozen teacher (``--teacher.model.path``,
    same tokenizer) scores the sampled tokens, and each token's advantage is the negative
    reverse-KL sample log π_T(y_t) − log π(y_t) (estimator ``distill``; the reward is not
    used, only reported), no KL to a reference."""
    return AlgoConfig(advantage=AdvantageConfig(estimator="distill"), kl=KLConfig(init_coef=0.0))


def follow_generation_budget(config: RLConfig, *, given: Collection[str]) -> RLConfig:
    """Under ``seq-mean-token-sum-norm`` the loss divides by a constant L_max, the generation
    budget (Dr. GRPO): ``algo.loss_agg_max_len`` becomes ``--rollout.max_new_tokens`` unless
    the command line or its ``--config`` file set it (``given``: their dotted names)."""
    algo = config.algo
    if algo.loss_agg_mode != "seq-mean-token-sum-norm" or "algo.loss_agg_max_len" in given:
        return config
    return replace(config, **{"algo.loss_agg_max_len": config.rollout.max_new_tokens})


def resolve(name: str) -> RLConfig:
    """The preset's config; an unknown name lists the known ones."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None
