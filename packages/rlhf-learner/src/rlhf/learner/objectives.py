"""Train-step objectives: what one micro-batch contributes to the loss of a global batch.

Each objective is a small frozen dataclass, picklable, so a driver can build it once and send
it to every rank: ``objective(model, batch) -> (loss_share, metrics)``. ``normalizer`` is the
global normaliser of the whole step (all micro-batches on all ranks), computed by the driver
with `rlhf.algos.loss_normalizer` (or the number of sequences/pairs); the shares then add up to
exactly the full-batch loss, however the batch is split. Backends undo their own data-parallel
averaging (`Backend.train_micro_batches`), so gradients are those of that full-batch loss.

- `PPOActorObjective`: policy loss (`rlhf.algos.policy_loss`), optional train/rollout
  correction, KL loss (k1/k2/k3 against the reference) and entropy bonus.
- `CriticObjective`: clipped value loss.
- `SFTObjective`: token NLL over ``loss_mask``.
- `RewardModelObjective`: pairwise loss; rows are all chosen, then all rejected.
- `DPOObjective`: DPO/cDPO/IPO; rows as above; needs reference sequence log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf.algos import (
    AlgoConfig,
    aggregate_loss,
    clipped_value_loss,
    dpo_loss,
    kl_penalty,
    policy_loss,
    reward_model_loss,
    sft_loss,
)
from rlhf.learner.batch import (
    ActorFields,
    Batch,
    CriticFields,
    DPOFields,
    FieldName,
    LossMaskFields,
    RewardModelFields,
    required_fields,
    view,
)
from rlhf.learner.forward import batch_logprobs, sequence_scores, token_values

Metrics = dict[str, Tensor]


@dataclass(frozen=True)
class PPOActorObjective:
    """Actor loss of one PPO/GRPO/REINFORCE++ step.

    Reads `ActorFields`: ``action_mask``, ``advantages``; ``old_logprobs`` (absent: the
    current policy, detached — exact for one optimizer step per rollout); ``ref_logprobs``
    when ``algo.kl.use_loss`` and ``kl_coef`` is not 0 (β = 0 disables the KL term, and a run
    without it builds no reference); ``rollout_logprobs`` with ``algo.rollout_correction`` (when
    present, ``actor/rollout_logprob_diff_max`` reports the largest sampler/learner gap).

    Attributes:
        algo: Algorithm settings (loss variant, aggregation, KL, entropy, correction).
        normalizer: Global normaliser of ``algo.loss_agg_mode`` over the step.
        kl_coef: Current KL coefficient β (from the controller) for the KL loss.
        temperature: Sampling temperature of the rollout.
        entropy_metric: Compute the policy entropy for ``actor/entropy`` even when it is not
            in the loss (one more pass over the logits; ~8 % of a tiny model's step on CPU).
    """

    algo: AlgoConfig
    normalizer: float
    kl_coef: float = 0.0
    temperature: float = 1.0
    entropy_metric: bool = True

    def fields(self) -> frozenset[FieldName]:
        """The batch fields this step reads (`rlhf.learner.batch.check_fields`)."""
        needed = set(required_fields(ActorFields))
        if self.algo.kl.use_loss and self.kl_coef != 0:
            needed.add("ref_logprobs")
        if self.algo.rollout_correction is not None:
            needed.add("rollout_logprobs")
        return frozenset(needed)

    def __call__(self, model: torch.nn.Module, batch: Batch) -> tuple[Tensor, Metrics]:
        algo = self.algo
        want_entropy = algo.entropy_coef > 0
        logprobs, entropy = batch_logprobs(
            model,
            batch,
            temperature=self.temperature,
            with_entropy=want_entropy or self.entropy_metric,
        )
        f = view(batch, ActorFields, need=self.fields())
        mask = f.action_mask
        # On-policy with one optimizer step per rollout, π_old is the policy itself: the
        # driver may leave old_logprobs out and save a forward pass.
        old, rollout = f.old_logprobs, f.rollout_logprobs
        loss, metrics = policy_loss(
            logprobs=logprobs,
            old_logprobs=logprobs.detach() if old is None else old,
            advantages=f.advantages,
            action_mask=mask,
            config=algo.policy_loss,
            aggregation=algo.loss_agg_mode,
            normalizer=self.normalizer,
            max_len=algo.loss_agg_max_len,
            rollout_logprobs=rollout,
            rollout_correction=algo.rollout_correction,
        )
        if rollout is not None:
            # The sampler and the learner should agree on the log-prob of every sampled token.
            gap = (logprobs.detach() - rollout).abs()
            metrics["actor/rollout_logprob_diff_max"] = torch.where(
                mask > 0, gap, torch.zeros_like(gap)
            ).max()
        agg = {
            "mode": algo.loss_agg_mode,
            "normalizer": self.normalizer,
            "max_len": algo.loss_agg_max_len,
        }
        if algo.kl.use_loss and self.kl_coef != 0:
            assert f.ref_logprobs is not None  # needed: `view` checked it
            kl = kl_penalty(
                logprobs=logprobs,
                ref_logprobs=f.ref_logprobs,
                action_mask=mask,
                estimator=algo.kl.estimator,
                unbiased_gradient=algo.kl.unbiased_gradient,
                old_logprobs=old,
            )
            kl_loss = aggregate_loss(kl, mask, **agg)
            loss = loss + self.kl_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss.detach()
        if entropy is not None:
            entropy_share = aggregate_loss(
                entropy if want_entropy else entropy.detach(), mask, **agg
            )
            if want_entropy:
                loss = loss - algo.entropy_coef * entropy_share
            metrics["actor/entropy"] = entropy_share.detach()
        return loss, _unless_empty(mask, metrics)


@dataclass(frozen=True)
class CriticObjective:
    """Clipped value loss over `CriticFields` (``action_mask``, ``old_values``, ``returns``).

    Attributes:
        algo: Uses ``value_clip`` and the aggregation settings.
        normalizer: Global normaliser of ``algo.loss_agg_mode``.
    """

    algo: AlgoConfig
    normalizer: float

    def fields(self) -> frozenset[FieldName]:
        """The batch fields this step reads (`rlhf.learner.batch.check_fields`)."""
        return required_fields(CriticFields)

    def __call__(self, model: torch.nn.Module, batch: Batch) -> tuple[Tensor, Metrics]:
        values = token_values(
            model, batch.input_ids, batch.attention_mask, packing_samples=batch.packing_samples
        )
        f = view(batch, CriticFields)
        mask = f.action_mask
        per_token, metrics = clipped_value_loss(
            values=values,
            old_values=f.old_values,
            returns=f.returns,
            action_mask=mask,
            clip_eps=self.algo.value_clip,
        )
        loss = aggregate_loss(
            per_token,
            mask,
            mode=self.algo.loss_agg_mode,
            normalizer=self.normalizer,
            max_len=self.algo.loss_agg_max_len,
        )
        metrics["critic/value_loss"] = loss.detach()
        return loss, _unless_empty(mask, metrics)


def _unless_empty(mask: Tensor, metrics: Metrics) -> Metrics:
    """A micro-batch without action tokens (every row filtered, e.g. DAPO's overlong
    filtering) still runs its forward and backward (ranks stay in step) but reports no
    metrics: its means would be 0 over nothing and drag the step's average."""
    return metrics if bool(mask.any()) else {}


@dataclass(frozen=True)
class SFTObjective:
    """Token-mean NLL over `LossMaskFields` (``loss_mask`` (B, L), 1 on tokens to learn).

    Attributes:
        normalizer: Total number of loss tokens in the step.
    """

    normalizer: float

    def fields(self) -> frozenset[FieldName]:
        """The batch fields this step reads (`rlhf.learner.batch.check_fields`)."""
        return required_fields(LossMaskFields)

    def __call__(self, model: torch.nn.Module, batch: Batch) -> tuple[Tensor, Metrics]:
        loss_mask = view(batch, LossMaskFields).loss_mask
        logprobs, _ = batch_logprobs(model, batch)
        return sft_loss(logprobs=logprobs, loss_mask=loss_mask, normalizer=self.normalizer)


def _halves(batch: Batch, values: Tensor) -> tuple[Tensor, Tensor]:
    if batch.size % 2:
        raise ValueError(
            f"a preference micro-batch holds chosen rows then rejected rows; got {batch.size} rows"
        )
    half = batch.size // 2
    return values[:half], values[half:]


@dataclass(frozen=True)
class RewardModelObjective:
    """Pairwise reward-model loss on the last-token scores; `RewardModelFields` (an optional
    ``margin`` (B,)).

    Attributes:
        normalizer: Number of pairs in the step.
        loss_type: Name in `rlhf.algos.REWARD_MODEL_LOSSES`.
    """

    normalizer: float
    loss_type: str = "sigmoid"

    def fields(self) -> frozenset[FieldName]:
        """The batch fields this step reads (`rlhf.learner.batch.check_fields`): none required
        (``margin`` is optional)."""
        return required_fields(RewardModelFields)

    def __call__(self, model: torch.nn.Module, batch: Batch) -> tuple[Tensor, Metrics]:
        scores = sequence_scores(
            model, batch.input_ids, batch.attention_mask, packing_samples=batch.packing_samples
        )
        chosen, rejected = _halves(batch, scores)
        margin = view(batch, RewardModelFields).margin
        return reward_model_loss(
            chosen_rewards=chosen,
            rejected_rewards=rejected,
            margin=None if margin is None else _halves(batch, margin)[0],
            loss_type=self.loss_type,
            normalizer=self.normalizer,
        )


def sequence_logps(model: torch.nn.Module, batch: Batch) -> Tensor:
    """Σ over ``loss_mask`` of the token log-probs: (B,) (DPO's log π(y|x))."""
    mask = view(batch, LossMaskFields).loss_mask
    logprobs, _ = batch_logprobs(model, batch)
    return torch.where(mask > 0, logprobs, torch.zeros_like(logprobs)).sum(dim=1)


@dataclass(frozen=True)
class DPOObjective:
    """DPO-family loss over `DPOFields`: ``loss_mask`` (B, L) on response tokens and
    ``ref_logps`` (B,) from the reference model (`sequence_logps`).

    Attributes:
        normalizer: Number of pairs in the step.
        beta: β.
        loss_type: Name in `rlhf.algos.PREFERENCE_LOSSES`.
        label_smoothing: cDPO's ε.
        nll_coef: Weight of an NLL term on the chosen responses (per token).
    """

    normalizer: float
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    nll_coef: float = 0.0

    def fields(self) -> frozenset[FieldName]:
        """The batch fields this step reads (`rlhf.learner.batch.check_fields`)."""
        return required_fields(DPOFields)

    def __call__(self, model: torch.nn.Module, batch: Batch) -> tuple[Tensor, Metrics]:
        f = view(batch, DPOFields)
        logps = sequence_logps(model, batch)
        chosen, rejected = _halves(batch, logps)
        ref_chosen, ref_rejected = _halves(batch, f.ref_logps)
        chosen_nll = None
        if self.nll_coef > 0:
            tokens = _halves(batch, f.loss_mask.sum(dim=1))[0].clamp(min=1)
            chosen_nll = -chosen / tokens
        return dpo_loss(
            chosen_logps=chosen,
            rejected_logps=rejected,
            ref_chosen_logps=ref_chosen,
            ref_rejected_logps=ref_rejected,
            beta=self.beta,
            loss_type=self.loss_type,
            label_smoothing=self.label_smoothing,
            chosen_nll=chosen_nll,
            nll_coef=self.nll_coef,
            normalizer=self.normalizer,
        )
