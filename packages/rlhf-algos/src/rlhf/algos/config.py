"""`AlgoConfig`: every algorithmic knob of an RL run in one frozen dataclass (``--algo.*``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf.algos import _checks
from rlhf.algos.advantages import AdvantageConfig
from rlhf.algos.aggregation import AGGREGATIONS
from rlhf.algos.correction import RolloutCorrectionConfig
from rlhf.algos.kl import KLConfig
from rlhf.algos.policy import PolicyLossConfig


@dataclass(frozen=True)
class AlgoConfig:
    """Algorithm configuration composed from the families of `rlhf.algos`.

    Attributes:
        advantage: Advantage estimator and its parameters.
        policy_loss: Policy loss variant (ppo, gspo, cispo) and its clipping.
        kl: KL coefficient, estimator, reward-vs-loss placement and controller.
        value_clip: ε_v of the clipped value loss; None for an unclipped value loss.
        entropy_coef: Weight of the entropy bonus subtracted from the actor loss (0 disables).
        loss_agg_mode: Name in `AGGREGATIONS`.
        loss_agg_max_len: L_max for ``seq-mean-token-sum-norm`` (usually max_new_tokens).
        rollout_correction: Train/rollout importance correction, or None.
        dynamic_filtering_enable: Drop prompt groups whose mean score is outside the range.
        dynamic_filtering_range: (lo, hi), groups kept iff lo < mean score < hi.
        overlong_buffer_len: DAPO overlong buffer length; None disables the penalty.
        overlong_penalty_factor: DAPO overlong penalty at the budget.
        overlong_filtering: Mask truncated samples out of the loss (DAPO).
        stop_properly_penalty_coef: Reward scale (in [0, 1]) or replacement (< 0) for truncated
            samples; None disables.
    """

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    value_clip: float | None = 0.2
    entropy_coef: float = 0.0
    loss_agg_mode: str = "token-mean"
    loss_agg_max_len: int | None = None
    rollout_correction: RolloutCorrectionConfig | None = None
    dynamic_filtering_enable: bool = False
    dynamic_filtering_range: tuple[float, float] = (0.0, 1.0)
    overlong_buffer_len: int | None = None
    overlong_penalty_factor: float = 1.0
    overlong_filtering: bool = False
    stop_properly_penalty_coef: float | None = None

    def __post_init__(self) -> None:
        mode = AGGREGATIONS.canonical(self.loss_agg_mode)
        if mode == "seq-mean-token-sum-norm" and (
            self.loss_agg_max_len is None or self.loss_agg_max_len < 1
        ):
            raise ValueError(
                "algo.loss_agg_max_len must be set (>= 1, e.g. the generation budget) with "
                "algo.loss_agg_mode=seq-mean-token-sum-norm"
            )
        if self.value_clip is not None:
            _checks.positive("algo.value_clip", self.value_clip)
        _checks.positive("algo.entropy_coef", self.entropy_coef, allow_zero=True)
        _checks.interval("algo.dynamic_filtering_range", self.dynamic_filtering_range, strict=True)
        if self.overlong_buffer_len is not None and self.overlong_buffer_len < 1:
            raise ValueError(
                f"algo.overlong_buffer_len must be >= 1 or None, got {self.overlong_buffer_len}"
            )
        _checks.positive(
            "algo.overlong_penalty_factor", self.overlong_penalty_factor, allow_zero=True
        )
        coef = self.stop_properly_penalty_coef
        if coef is not None and coef > 1:
            raise ValueError(
                f"algo.stop_properly_penalty_coef must be in [0, 1] or negative, got {coef}"
            )
