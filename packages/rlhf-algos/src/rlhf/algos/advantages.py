"""Advantage estimators: group baselines, discounted returns, GAE, and the estimator registry.

An estimator is three steps:

1. a scalar step on the sequence reward R within each prompt group (`GROUP_BASELINES`),
2. a token step (`TOKEN_STEPS`): GAE(γ, λ) over the shaped per-token rewards with critic
   values, the discounted return G_t, or the reverse KL to a teacher at each sampled token
   (on-policy distillation); each step declares the inputs it reads beyond the rewards,
3. optional global masked whitening over every valid token of the step.

`ADVANTAGE_ESTIMATORS` maps OpenRLHF's estimator names (and ``distill``) to such a recipe
(`EstimatorSpec`); `compute_advantages` runs one. Positions outside the action mask
(environment feedback in multi-turn episodes, padding) are not steps: returns and GAE carry
their values across them, as Molt does and OpenRLHF does not. The value past the last action
token is 0 (no bootstrapping from truncated samples, as in OpenRLHF and verl).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from rlhf.algos import _checks
from rlhf.algos.masked import WhitenStats, masked_mean, masked_whiten
from rlhf.algos.registry import Registry
from rlhf.algos.shaping import clip_rewards, shape_token_rewards

GROUP_STD_EPS = 1e-9

# Family signature: fn(rewards: (B,), *, n_samples_per_prompt: int) -> (B,)
GroupBaseline = Callable[..., Tensor]
GROUP_BASELINES: Registry[GroupBaseline] = Registry("group baseline")


def _groups(rewards: Tensor, n_samples_per_prompt: int) -> Tensor:
    """(P, n) float64 groups, each shifted by its first member.

    Every baseline here is shift-invariant, and the shift makes a group of identical rewards
    exactly zero (in float32, R − mean(R) is off by one rounding step and the std is that same
    tiny number, which would turn their ratio into ±sqrt((n − 1)/n) instead of 0).
    """
    r = _checks.floating("rewards", rewards, ndim=1)
    _checks.group_size("n_samples_per_prompt", n_samples_per_prompt, batch=r.shape[0])
    g = r.detach().to(torch.float64).view(-1, n_samples_per_prompt)
    return g - g[:, :1]


@GROUP_BASELINES.register("none")
def no_baseline(rewards: Tensor, *, n_samples_per_prompt: int) -> Tensor:
    """R unchanged (PPO with a critic, REINFORCE++). Shapes: (B,) → (B,)."""
    _groups(rewards, n_samples_per_prompt)
    return rewards.detach()


@GROUP_BASELINES.register("mean")
def mean_baseline(rewards: Tensor, *, n_samples_per_prompt: int) -> Tensor:
    """R − mean(R) within each prompt group (REINFORCE++-baseline, Dr. GRPO). (B,) → (B,)."""
    g = _groups(rewards, n_samples_per_prompt)
    return (g - g.mean(dim=1, keepdim=True)).reshape(-1).to(rewards.dtype)


@GROUP_BASELINES.register("leave_one_out")
def leave_one_out_baseline(rewards: Tensor, *, n_samples_per_prompt: int) -> Tensor:
    """RLOO (arXiv 2402.14740): R − (ΣR − R)/(n − 1). Needs n >= 2. (B,) → (B,)."""
    g = _groups(rewards, n_samples_per_prompt)
    if n_samples_per_prompt < 2:
        raise ValueError(
            f"n_samples_per_prompt must be >= 2 for a leave-one-out baseline, "
            f"got {n_samples_per_prompt}"
        )
    others = (g.sum(dim=1, keepdim=True) - g) / (n_samples_per_prompt - 1)
    return (g - others).reshape(-1).to(rewards.dtype)


@GROUP_BASELINES.register("group_norm")
def group_norm_baseline(rewards: Tensor, *, n_samples_per_prompt: int) -> Tensor:
    """GRPO (arXiv 2402.03300): (R − mean) / (std + 1e-9), std unbiased (n − 1). (B,) → (B,).

    A group whose rewards are all equal gets exactly 0. Computed in float64. Needs n >= 2.
    """
    g = _groups(rewards, n_samples_per_prompt)
    if n_samples_per_prompt < 2:
        raise ValueError(
            f"n_samples_per_prompt must be >= 2 for group normalisation, got {n_samples_per_prompt}"
        )
    std = g.std(dim=1, keepdim=True, unbiased=True)
    out = (g - g.mean(dim=1, keepdim=True)) / (std + GROUP_STD_EPS)
    return out.reshape(-1).to(rewards.dtype)


@GROUP_BASELINES.register("batch_mean")
def batch_mean_baseline(rewards: Tensor, *, n_samples_per_prompt: int) -> Tensor:
    """R − mean(R) over the whole step's batch, groups or not (FlashREINFORCE, OpenRLHF
    0.11's ``flash_reinforce``: one sample per prompt has no group to compare within). Computed
    in float64, shifted by the first reward as the group baselines are. (B,) → (B,)."""
    r = _checks.floating("rewards", rewards, ndim=1).detach().to(torch.float64)
    _checks.group_size("n_samples_per_prompt", n_samples_per_prompt, batch=r.shape[0])
    r = r - r[:1]
    return (r - r.mean()).to(rewards.dtype)


GROUPLESS_BASELINES = frozenset({"none", "batch_mean"})
"""Baselines that do not compare the samples of a prompt with each other."""


def _token_inputs(token_rewards: Tensor, action_mask: Tensor) -> tuple[Tensor, Tensor]:
    r = _checks.floating("token_rewards", token_rewards, ndim=2).detach()
    m = _checks.mask("action_mask", action_mask, like=r, like_name="token_rewards")
    return r, m


def discounted_returns(token_rewards: Tensor, action_mask: Tensor, *, gamma: float) -> Tensor:
    """G_t = r_t + γ·G_{t'} over action tokens, t' the next action token (G = 0 past the end).

    Masked positions are skipped: they neither discount nor add reward, and get G = 0.

    Args:
        token_rewards: (B, T) float, rewards on action tokens.
        action_mask: (B, T).
        gamma: Discount γ in [0, 1].

    Returns:
        (B, T), 0 outside the mask.
    """
    r, m = _token_inputs(token_rewards, action_mask)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    kept = torch.where(m > 0, r, torch.zeros_like(r))
    if gamma == 1.0:
        # Exact fast path: with γ = 1 skipping gaps is a reverse cumulative sum.
        returns = kept.flip(1).cumsum(1).flip(1)
        return torch.where(m > 0, returns, torch.zeros_like(returns))
    returns = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        step = m[:, t] > 0
        running = torch.where(step, kept[:, t] + gamma * running, running)
        returns[:, t] = torch.where(step, running, torch.zeros_like(running))
    return returns


def gae(
    token_rewards: Tensor,
    values: Tensor,
    action_mask: Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (arXiv 1506.02438) over action tokens.

    δ_t = r_t + γ·V_{t'} − V_t and A_t = δ_t + γλ·A_{t'}, with t' the next action token of the
    same sequence (V_{t'} = A_{t'} = 0 past the last one); returns R_t = A_t + V_t. Environment
    tokens between two turns are skipped, carrying V and A across the gap.

    Args:
        token_rewards: (B, T) float.
        values: (B, T) critic values V(s_t) at action tokens (detached here).
        action_mask: (B, T).
        gamma: Discount γ in [0, 1].
        lam: GAE λ in [0, 1].

    Returns:
        (advantages, returns), each (B, T), 0 outside the mask.
    """
    r, m = _token_inputs(token_rewards, action_mask)
    v = _checks.floating("values", values)
    _checks.same_shape("token_rewards", r, values=v)
    for name, x in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= x <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {x}")
    v = torch.where(m > 0, v.detach().to(r.dtype), torch.zeros_like(r))
    advantages = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    next_adv = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        step = m[:, t] > 0
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv = delta + gamma * lam * next_adv
        next_adv = torch.where(step, adv, next_adv)
        next_value = torch.where(step, v[:, t], next_value)
        advantages[:, t] = torch.where(step, adv, torch.zeros_like(adv))
    returns = torch.where(m > 0, advantages + v, torch.zeros_like(r))
    return advantages, returns


@dataclass(frozen=True)
class TokenStepInputs:
    """What a token step may read besides the shaped rewards; each (B, T), detached.

    Attributes:
        action_mask: 1 on tokens the policy produced.
        values: Critic values V(s_t) (GAE).
        logprobs: The sampling policy's log-probs of its tokens, log π_old(y_t).
        teacher_logprobs: A frozen teacher's log-probs of the same tokens, log π_T(y_t).
    """

    action_mask: Tensor
    values: Tensor | None = None
    logprobs: Tensor | None = None
    teacher_logprobs: Tensor | None = None


TokenStepInput = Literal["values", "logprobs", "teacher_logprobs"]


@dataclass(frozen=True)
class TokenStep:
    """One token step: ``run(token_rewards, inputs, gamma=, lam=) -> (advantages, returns)``,
    each (B, T), and the `TokenStepInputs` it needs (``needs``)."""

    run: Callable[..., tuple[Tensor, Tensor]]
    needs: frozenset[TokenStepInput] = frozenset()


TOKEN_STEPS: Registry[TokenStep] = Registry("token step")

_INPUT_NAMES: dict[str, str] = {
    "values": "values (critic)",
    "logprobs": "logprobs (the sampling policy's)",
    "teacher_logprobs": "teacher_logprobs (a teacher's)",
}


def _gae_step(
    token_rewards: Tensor, inputs: TokenStepInputs, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    assert inputs.values is not None  # needs: checked by compute_advantages
    return gae(token_rewards, inputs.values, inputs.action_mask, gamma=gamma, lam=lam)


def _returns_step(
    token_rewards: Tensor, inputs: TokenStepInputs, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    returns = discounted_returns(token_rewards, inputs.action_mask, gamma=gamma)
    return returns, returns


def _reverse_kl_step(
    token_rewards: Tensor, inputs: TokenStepInputs, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    assert inputs.logprobs is not None  # needs: checked by compute_advantages
    assert inputs.teacher_logprobs is not None
    advantages = reverse_kl_advantages(
        logprobs=inputs.logprobs,
        teacher_logprobs=inputs.teacher_logprobs,
        action_mask=inputs.action_mask,
    )
    return advantages, advantages


def reverse_kl_advantages(
    *, logprobs: Tensor, teacher_logprobs: Tensor, action_mask: Tensor
) -> Tensor:
    """On-policy distillation's per-token advantage: A_t = log π_T(y_t) − log π(y_t), the
    negative reverse-KL sample at the student's own token y_t (discount 0: each token answers
    for itself). A policy-gradient step on it lowers KL(π ‖ π_T) in expectation over the
    student's samples; only the teacher's log-probs of the sampled tokens are needed.

    Args:
        logprobs: (B, T) the student's log-probs of its sampled tokens (sampling time).
        teacher_logprobs: (B, T) the teacher's log-probs of the same tokens.
        action_mask: (B, T).

    Returns:
        (B, T), 0 outside the mask, detached.
    """
    student = _checks.floating("logprobs", logprobs, ndim=2).detach()
    teacher = _checks.floating("teacher_logprobs", teacher_logprobs).detach()
    _checks.same_shape("logprobs", student, teacher_logprobs=teacher)
    m = _checks.mask("action_mask", action_mask, like=student, like_name="logprobs")
    gap = _checks.upcast(teacher) - _checks.upcast(student)
    return torch.where(m > 0, gap, torch.zeros_like(gap))


TOKEN_STEPS.register("gae")(TokenStep(_gae_step, frozenset({"values"})))
TOKEN_STEPS.register("returns")(TokenStep(_returns_step))
TOKEN_STEPS.register("reverse_kl")(
    TokenStep(_reverse_kl_step, frozenset({"logprobs", "teacher_logprobs"}))
)


@dataclass(frozen=True)
class EstimatorSpec:
    """Recipe of one advantage estimator.

    Attributes:
        baseline: Name in `GROUP_BASELINES` applied to the scalar reward.
        token_step: Name in `TOKEN_STEPS`: ``gae`` (needs critic values), ``returns``
            (discounted return G_t) or ``reverse_kl`` (needs the sampling log-probs and a
            teacher's).
        whiten: Whether global masked whitening is applied by default.
        unit_gamma: Force γ = 1 in the token step (group estimators).
    """

    baseline: str
    token_step: str
    whiten: bool
    unit_gamma: bool = False

    def __post_init__(self) -> None:
        TOKEN_STEPS.canonical(self.token_step)
        GROUP_BASELINES.canonical(self.baseline)

    @property
    def needs(self) -> frozenset[TokenStepInput]:
        """The inputs its token step reads beyond the rewards (`TokenStepInputs`)."""
        return TOKEN_STEPS.get(self.token_step).needs

    @property
    def needs_critic(self) -> bool:
        """The token step needs critic values (GAE)."""
        return "values" in self.needs

    @property
    def needs_teacher(self) -> bool:
        """The token step needs a teacher's log-probs (on-policy distillation)."""
        return "teacher_logprobs" in self.needs

    @property
    def needs_groups(self) -> bool:
        """The baseline compares the samples of a prompt (n_samples_per_prompt >= 2)."""
        return self.baseline not in GROUPLESS_BASELINES

    @property
    def subtracts_baseline(self) -> bool:
        """A baseline is taken from each sample's one scalar reward (so per-turn rewards on
        tokens cannot go through it)."""
        return self.baseline != "none"


ADVANTAGE_ESTIMATORS: Registry[EstimatorSpec] = Registry("advantage estimator")
ADVANTAGE_ESTIMATORS.register("gae")(EstimatorSpec("none", "gae", whiten=True))
ADVANTAGE_ESTIMATORS.register("reinforce")(EstimatorSpec("none", "returns", whiten=True))
ADVANTAGE_ESTIMATORS.register("reinforce_baseline")(
    EstimatorSpec("mean", "returns", whiten=True, unit_gamma=True)
)
ADVANTAGE_ESTIMATORS.register("rloo")(
    EstimatorSpec("leave_one_out", "returns", whiten=False, unit_gamma=True)
)
ADVANTAGE_ESTIMATORS.register("group_norm", "grpo")(
    EstimatorSpec("group_norm", "returns", whiten=False, unit_gamma=True)
)
ADVANTAGE_ESTIMATORS.register("dr_grpo")(
    EstimatorSpec("mean", "returns", whiten=False, unit_gamma=True)
)
ADVANTAGE_ESTIMATORS.register("flash_reinforce")(
    EstimatorSpec("batch_mean", "returns", whiten=False, unit_gamma=True)
)
ADVANTAGE_ESTIMATORS.register("distill")(
    EstimatorSpec("none", "reverse_kl", whiten=False, unit_gamma=True)
)


@dataclass(frozen=True)
class AdvantageConfig:
    """How advantages are estimated (flags ``--algo.advantage.*``).

    Attributes:
        estimator: Name in `ADVANTAGE_ESTIMATORS`: gae, reinforce, reinforce_baseline, rloo,
            group_norm (alias grpo), dr_grpo, flash_reinforce (R minus the batch's mean reward,
            no whitening: for one sample per prompt), distill (the reverse KL to a teacher at
            each sampled token; the reward is not used).
        gamma: Discount γ; group estimators use γ = 1 regardless.
        lam: GAE λ (``gae`` only).
        whiten: Global masked whitening; None uses the estimator's default from the table.
        std_norm: Whitening divides by the std; False only centres (x − μ), OpenRLHF's
            ``--algo.advantage.no_std_norm``. Group baselines (group_norm) are not whitening
            and keep their std.
        reward_clip: Clamp range for the scalar reward after the group baseline; None disables.
    """

    estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 0.95
    whiten: bool | None = None
    std_norm: bool = True
    reward_clip: tuple[float, float] | None = (-10.0, 10.0)

    @property
    def spec(self) -> EstimatorSpec:
        """The estimator's recipe from `ADVANTAGE_ESTIMATORS`."""
        return ADVANTAGE_ESTIMATORS.get(self.estimator)

    def __post_init__(self) -> None:
        ADVANTAGE_ESTIMATORS.canonical(self.estimator)
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"advantage.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.reward_clip is not None:
            _checks.interval("advantage.reward_clip", self.reward_clip)


@dataclass(frozen=True)
class Advantages:
    """Output of `compute_advantages`.

    Attributes:
        advantages: (B, T), 0 outside the action mask.
        returns: (B, T) value targets (GAE) or discounted returns, 0 outside the mask.
        token_rewards: (B, T) the shaped per-token rewards that were used.
        metrics: Detached 0-dim tensors with slash names.
    """

    advantages: Tensor
    returns: Tensor
    token_rewards: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


def compute_advantages(
    *,
    config: AdvantageConfig,
    rewards: Tensor,
    action_mask: Tensor,
    n_samples_per_prompt: int = 1,
    values: Tensor | None = None,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    token_rewards: Tensor | None = None,
    whiten_stats: WhitenStats | None = None,
    logprobs: Tensor | None = None,
    teacher_logprobs: Tensor | None = None,
) -> Advantages:
    """Run the estimator named by ``config.estimator`` on one step's batch.

    Order: group baseline on R → clip to ``config.reward_clip`` → per-token rewards (scalar on the
    last action token, −β·kl, extra ``token_rewards``) → GAE or G_t → optional whitening.

    Args:
        config: The estimator and its parameters.
        rewards: (B,) scalar rewards, samples of one prompt contiguous.
        action_mask: (B, T).
        n_samples_per_prompt: Group size n; must divide B.
        values: (B, T) critic values; required by ``gae``.
        kl: (B, T) per-token KL to the reference for KL-in-reward, or None.
        kl_coef: β for KL-in-reward (0 when the KL is a loss term).
        token_rewards: (B, T) extra per-token rewards, or None.
        whiten_stats: Global whitening statistics when the step's batch is split across ranks:
            the sums of `whiten_stats` of the *unwhitened* advantages (a first call with
            ``whiten=False`` on each rank gives them). None whitens over this batch.
        logprobs: (B, T) the sampling policy's log-probs of its tokens; required by
            ``distill``.
        teacher_logprobs: (B, T) a teacher's log-probs of the same tokens; required by
            ``distill``.

    Raises:
        ValueError: an input the estimator's token step needs is None, naming both.

    Returns:
        `Advantages` with (B, T) tensors, all without gradient (inputs are detached).
    """
    spec = ADVANTAGE_ESTIMATORS.get(config.estimator)
    r = _checks.floating("rewards", rewards, ndim=1).detach()
    _checks.group_size("n_samples_per_prompt", n_samples_per_prompt, batch=r.shape[0])
    scalar = GROUP_BASELINES.get(spec.baseline)(r, n_samples_per_prompt=n_samples_per_prompt)
    scalar = clip_rewards(scalar, clip_range=config.reward_clip)
    shaped = shape_token_rewards(
        rewards=scalar,
        action_mask=action_mask,
        kl=kl,
        kl_coef=kl_coef,
        token_rewards=token_rewards,
    )
    gamma = 1.0 if spec.unit_gamma else config.gamma
    inputs = TokenStepInputs(
        action_mask=action_mask, values=values, logprobs=logprobs, teacher_logprobs=teacher_logprobs
    )
    missing = [need for need in sorted(spec.needs) if getattr(inputs, need) is None]
    if missing:
        named = " and ".join(_INPUT_NAMES[need] for need in missing)
        raise ValueError(f"{named} are required by the {config.estimator!r} estimator")
    step = TOKEN_STEPS.get(spec.token_step)
    adv, returns = step.run(shaped, inputs, gamma=gamma, lam=config.lam)
    whiten = spec.whiten if config.whiten is None else config.whiten
    if whiten:
        adv = masked_whiten(adv, action_mask, scale_std=config.std_norm, stats=whiten_stats)
    m = action_mask.to(adv.dtype)
    metrics = {
        "advantages/mean": masked_mean(adv, m).detach(),
        "advantages/abs_max": torch.where(m > 0, adv.abs(), torch.zeros_like(adv)).max().detach(),
        "returns/mean": masked_mean(returns, m).detach(),
        "rewards/baselined_mean": scalar.mean().detach(),
    }
    if spec.needs_teacher:
        # The reverse KL itself: the negative of the mean advantage over action tokens.
        metrics["distill/reverse_kl"] = -metrics["advantages/mean"]
    return Advantages(advantages=adv, returns=returns, token_rewards=shaped, metrics=metrics)
