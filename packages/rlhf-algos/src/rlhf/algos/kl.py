"""KL estimators between the policy and the reference, and KL coefficient controllers.

With x = logπ − logπ_ref on tokens sampled from π (Schulman, "Approximating KL divergence"):

- ``k1`` = x: unbiased for KL(π‖π_ref); the natural choice for KL-in-reward. As a loss its
  expected gradient is 0, so prefer k2 or k3 there.
- ``k2`` = x²/2: as a loss, its gradient equals ∇KL(π‖π_ref) in expectation.
- ``k3`` = exp(−x) − 1 + x (alias ``low_var_kl``, verl's name): non-negative, unbiased for
  KL(π‖π_ref); as a loss its expected gradient is ∇KL(π_ref‖π). verl additionally clamps
  low_var_kl to [−10, 10]; here x is clamped to ±20 before exp and the result is not clamped.

As a loss, ``unbiased_gradient`` keeps the estimator's value but gives every estimator the
gradient of the reverse KL itself, importance-weighted for the samples of π_old (the rollout
policy of a later mini-batch): ∇ = w·x·∇logπ with w = π/π_old (detached, at most
`KL_IS_WEIGHT_CLIP`), through the surrogate w·x²/2 (OpenRLHF 0.11's
``--algo.kl.unbiased_gradient``).

Controllers (arXiv 1909.08593): fixed β, or adaptive β ← β·(1 + clip(KL/target − 1, −0.2, 0.2)·
n_steps/horizon).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from rlhf.algos import _checks
from rlhf.algos.registry import Registry

LOG_RATIO_CLAMP = 20.0
KL_IS_WEIGHT_CLIP = 10.0

# Family signature: fn(log_ratio: (B, T)) -> (B, T), log_ratio = logπ − logπ_ref
KLEstimator = Callable[[Tensor], Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def k1(log_ratio: Tensor) -> Tensor:
    """k1 = x. Any shape."""
    return log_ratio


@KL_ESTIMATORS.register("k2")
def k2(log_ratio: Tensor) -> Tensor:
    """k2 = x²/2. Any shape."""
    return 0.5 * log_ratio.square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def k3(log_ratio: Tensor) -> Tensor:
    """k3 = exp(−x) − 1 + x, with x clamped to ±20. Any shape."""
    x = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.expm1(-x) + x


def kl_penalty(
    *,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    action_mask: Tensor,
    estimator: str = "k1",
    unbiased_gradient: bool = False,
    old_logprobs: Tensor | None = None,
) -> Tensor:
    """Per-token KL estimate, 0 outside the action mask.

    Args:
        logprobs: (B, T) policy log-probs of the sampled tokens (gradient kept for loss use).
        ref_logprobs: (B, T) reference log-probs of the same tokens (detached here).
        action_mask: (B, T).
        estimator: Name in `KL_ESTIMATORS`.
        unbiased_gradient: Keep the estimator's value, take the gradient w·x·∇logπ (see the
            module docstring).
        old_logprobs: (B, T) log-probs of the policy that sampled the tokens, for w; None: the
            samples are the current policy's (w = 1).

    Returns:
        (B, T), float32 for half-precision inputs.
    """
    lp = _checks.floating("logprobs", logprobs, ndim=2)
    ref = _checks.floating("ref_logprobs", ref_logprobs)
    _checks.same_shape("logprobs", lp, ref_logprobs=ref)
    m = _checks.mask("action_mask", action_mask, like=lp, like_name="logprobs")
    # Masked entries are zeroed before the estimator so a NaN there cannot reach a gradient.
    log_ratio = _checks.zero_masked(_checks.upcast(lp) - _checks.upcast(ref.detach()), m)
    value = KL_ESTIMATORS.get(estimator)(log_ratio)
    if unbiased_gradient:
        weight = torch.ones_like(log_ratio)
        if old_logprobs is not None:
            old = _checks.floating("old_logprobs", old_logprobs)
            _checks.same_shape("logprobs", lp, old_logprobs=old)
            own = _checks.zero_masked(_checks.upcast(lp.detach()) - _checks.upcast(old), m)
            weight = own.exp().clamp(max=KL_IS_WEIGHT_CLIP)
        surrogate = weight.detach() * 0.5 * log_ratio.square()
        value = value.detach() + (surrogate - surrogate.detach())
    return _checks.zero_masked(value, m)


@dataclass(frozen=True)
class KLConfig:
    """KL regularisation (flags ``--algo.kl.*``).

    Attributes:
        init_coef: Initial β (OpenRLHF's ``--init_kl_coef``); 0 disables the KL term.
        estimator: Name in `KL_ESTIMATORS`.
        use_loss: True puts β·aggregate(kl) in the loss; False puts −β·kl in the reward.
        unbiased_gradient: As a loss, the estimator's value with the importance-weighted
            reverse-KL gradient (`kl_penalty`); without ``use_loss`` the KL is in the reward,
            which has no gradient, and this changes nothing (as in OpenRLHF).
        controller: ``fixed`` or ``adaptive``.
        target: Target KL of the adaptive controller.
        horizon: Horizon (in samples) of the adaptive controller.
    """

    init_coef: float = 0.01
    estimator: str = "k1"
    use_loss: bool = False
    unbiased_gradient: bool = False
    controller: str = "fixed"
    target: float | None = None
    horizon: int = 10000

    def __post_init__(self) -> None:
        _checks.positive("kl.init_coef", self.init_coef, allow_zero=True)
        KL_ESTIMATORS.canonical(self.estimator)
        KL_CONTROLLERS.canonical(self.controller)
        if self.controller == "adaptive":
            if self.target is None or not self.target > 0:
                raise ValueError(
                    f"kl.target must be > 0 with kl.controller=adaptive, got {self.target}"
                )
            if self.horizon < 1:
                raise ValueError(f"kl.horizon must be >= 1, got {self.horizon}")


class KLController(Protocol):
    """A KL coefficient β that may adapt to the measured KL."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...
    def state_dict(self) -> dict[str, float]: ...
    def load_state_dict(self, state: dict[str, float]) -> None: ...


class FixedKLController:
    """β stays at its initial value."""

    def __init__(self, *, init_coef: float) -> None:
        self.value = float(init_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: β is fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller of Ziegler et al. (arXiv 1909.08593)."""

    def __init__(self, *, init_coef: float, target: float, horizon: int) -> None:
        if not target > 0 or horizon < 1:
            raise ValueError(f"target must be > 0 and horizon >= 1, got {target} and {horizon}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """β ← β·(1 + clip(KL/target − 1, −0.2, 0.2)·n_steps/horizon)."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


# Family signature: fn(config: KLConfig) -> KLController
KL_CONTROLLERS: Registry[Callable[[KLConfig], KLController]] = Registry("KL controller")
KL_CONTROLLERS.register("fixed")(lambda c: FixedKLController(init_coef=c.init_coef))
KL_CONTROLLERS.register("adaptive")(
    lambda c: AdaptiveKLController(init_coef=c.init_coef, target=c.target or 0.0, horizon=c.horizon)
)


def make_kl_controller(config: KLConfig) -> KLController:
    """The controller named by ``config.controller``."""
    return KL_CONTROLLERS.get(config.controller)(config)
