"""Forward passes of the roles: action log-probs (and entropy), values, sequence scores.

All outputs are aligned with ``input_ids`` (see `rlhf.learner.batch`): ``out[:, t]`` belongs to
token ``t``, computed from the hidden state at ``t − 1``; position 0 is 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf.algos import logprobs_and_entropy


def _shift_right(x: Tensor) -> Tensor:
    """(B, L−1) → (B, L) with a zero first column."""
    return torch.cat([x.new_zeros(x.shape[0], 1), x], dim=1)


def token_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of every token given its prefix, on temperature-scaled logits.

    Args:
        model: A causal LM.
        input_ids: (B, L).
        attention_mask: (B, L).
        temperature: The sampler's temperature (log-probs must match what it sampled from).
        with_entropy: Also return the entropy of each position's distribution.

    Returns:
        (B, L) float32 log-probs and (B, L) entropies or None; column 0 is 0.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    lp, ent = logprobs_and_entropy(
        logits[:, :-1], input_ids[:, 1:], temperature=temperature, with_entropy=with_entropy
    )
    return _shift_right(lp.float()), (_shift_right(ent.float()) if ent is not None else None)


def token_values(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Critic values V(s_t) of the state in which token ``t`` is chosen.

    Returns:
        (B, L) float32; column 0 is 0.
    """
    out = model(input_ids=input_ids, attention_mask=attention_mask).logits[..., 0]
    return _shift_right(out[:, :-1].float())


def sequence_scores(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Reward-model score of each sequence: the head at its last real token.

    Returns:
        (B,) float32.
    """
    out = model(input_ids=input_ids, attention_mask=attention_mask).logits[..., 0]
    last = attention_mask.long().sum(dim=1).clamp(min=1) - 1
    return out.gather(1, last[:, None])[:, 0].float()
