"""Supervised fine-tuning loss: token NLL over the response (loss) mask.

ℓ = −Σ logp·m / N, with N the global number of loss tokens: token-mean with the same exact
normaliser as `rlhf.algos.aggregation` (pass N as ``normalizer`` under data parallel or gradient
accumulation, computed with `loss_normalizer(mask, mode="token-mean")`).
"""

from __future__ import annotations

from torch import Tensor

from rlhf.algos import _checks
from rlhf.algos.aggregation import aggregate_loss
from rlhf.algos.masked import masked_mean


def sft_loss(
    *,
    logprobs: Tensor,
    loss_mask: Tensor,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-mean negative log-likelihood.

    Args:
        logprobs: (B, T) log-probs of the target tokens (e.g. from `logprobs_from_logits`).
        loss_mask: (B, T), 1 on tokens that are trained on (assistant turns, or all in
            pretrain mode).
        normalizer: Global loss-token count; None uses this batch's.

    Returns:
        (0-dim loss, metrics: sft/nll (this batch's token mean), sft/tokens).
    """
    lp = _checks.floating("logprobs", logprobs, ndim=2)
    m = _checks.mask("loss_mask", loss_mask, like=lp, like_name="logprobs")
    loss = aggregate_loss(-lp, m, mode="token-mean", normalizer=normalizer)
    return loss, {"sft/nll": masked_mean(-lp.detach(), m), "sft/tokens": m.sum().detach()}
