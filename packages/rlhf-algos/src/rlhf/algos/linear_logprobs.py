"""Log-probs and entropy straight from hidden states and the output projection, chunked.

A causal LM's logits are ``z = h Wᵀ (+ b)`` for hidden states h ∈ R^{N×H} and the ``lm_head``
W ∈ R^{V×H}. `rlhf.algos.logprobs_and_entropy` never upcasts all of z at once, but the model
has still materialised z (N×V in the model's dtype) and autograd keeps it, plus its gradient,
until the backward pass: 2.5 GiB in bf16 for 4×2048 tokens of a 152k vocabulary. Here the
projection happens inside the chunk loop instead: each chunk's logits are computed, reduced to
a logsumexp, a log-prob and an entropy per row, and dropped; the backward pass recomputes them
chunk by chunk (one more ``h Wᵀ`` per chunk, the price of the memory) and accumulates

    ∂/∂h = ∂z · W,        ∂/∂W = Σ_chunks ∂zᵀ · h,        ∂/∂b = Σ_rows ∂z,

with ∂z from the same chunk algebra as `rlhf.algos.logprobs` (compiled on CUDA). ∂/∂W and
∂/∂b accumulate in float32 across chunks and are returned in W's dtype. The chunk's logits are
computed in the dtype of h and W, as the model's own ``lm_head`` would, so results match the
unchunked model to that dtype's rounding. Double backward is not supported.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from rlhf.algos import _checks
from rlhf.algos.logprobs import _compute_dtype, _rows_per_chunk, chunk_kernels, flat_labels


def _logits(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    z = hidden @ weight.T
    return z + bias if bias is not None else z


class _ChunkedLinearLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        temperature: float,
        rows_per_chunk: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        like = {"dtype": _compute_dtype(hidden), "device": hidden.device}
        lse = torch.empty(n, **like)
        logprobs = torch.empty(n, **like)
        entropy = torch.empty(n if with_entropy else 0, **like)
        forward_chunk, _ = chunk_kernels(hidden.device)
        for start in range(0, n, rows_per_chunk):
            end = min(start + rows_per_chunk, n)
            z = _logits(hidden[start:end], weight, bias)
            lse[start:end], lp, ent = forward_chunk(z, labels[start:end], temperature, with_entropy)
            logprobs[start:end] = lp
            if ent is not None:
                entropy[start:end] = ent
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.temperature = temperature
        ctx.rows_per_chunk = rows_per_chunk
        ctx.with_entropy = with_entropy
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(  # pyright: ignore[reportIncompatibleMethodOverride]
        ctx: Any, grad_logprobs: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        g_ent = grad_entropy if ctx.with_entropy else None
        grad_h = torch.empty_like(hidden) if want_h else None
        acc = {"dtype": torch.promote_types(weight.dtype, torch.float32), "device": weight.device}
        grad_w = torch.zeros(weight.shape, **acc) if want_w else None
        grad_b = torch.zeros(weight.shape[0], **acc) if want_b and bias is not None else None
        _, backward_chunk = chunk_kernels(hidden.device)
        for start in range(0, hidden.shape[0], ctx.rows_per_chunk):
            end = min(start + ctx.rows_per_chunk, hidden.shape[0])
            h = hidden[start:end]
            dz = backward_chunk(
                _logits(h, weight, bias),
                lse[start:end],
                labels[start:end],
                grad_logprobs[start:end] if grad_logprobs is not None else None,
                g_ent[start:end] if g_ent is not None else None,
                ctx.temperature,
            ).to(hidden.dtype)
            if grad_h is not None:
                grad_h[start:end] = dz @ weight
            if grad_w is not None:
                grad_w += (dz.T @ h).to(grad_w.dtype)
            if grad_b is not None:
                grad_b += dz.sum(dim=0).to(grad_b.dtype)
        return (
            grad_h,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None and bias is not None else None,
            None,
            None,
            None,
            None,
        )


def linear_logprobs_and_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_elements: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``labels`` and (optionally) entropy of ``softmax((h Wᵀ + b) / τ)``,
    without materialising the logits.

    Args:
        hidden: (..., H) final hidden states (after the model's last norm), any float dtype.
        weight: (V, H) the output projection (``lm_head.weight``), same dtype as ``hidden``.
        labels: (...) integer ids in [0, V), aligned with ``hidden`` (the hidden state at t
            scores the token at t + 1: shift them yourself).
        bias: (V,) the projection's bias, if it has one.
        temperature: τ > 0, the sampling temperature.
        with_entropy: Also return the entropy.
        chunk_elements: Logits per chunk (memory knob, no effect on results); None: the
            device's default (`rlhf.algos.logprobs.default_chunk_elements`).

    Returns:
        (logprobs (...), entropy (...) or None), float32 (float64 for float64 inputs).
        Gradients flow to ``hidden``, ``weight`` and ``bias``.
    """
    tau = _checks.positive("temperature", temperature)
    h = _checks.floating("hidden", hidden)
    w = _checks.floating("weight", weight)
    if h.ndim < 1 or w.ndim != 2 or w.shape[1] != h.shape[-1]:
        raise ValueError(
            f"weight must have shape (V, H) with H = hidden.shape[-1]; got hidden "
            f"{tuple(h.shape)} and weight {tuple(w.shape)}"
        )
    if w.dtype != h.dtype:
        raise ValueError(f"hidden ({h.dtype}) and weight ({w.dtype}) must share a dtype")
    if bias is not None and tuple(bias.shape) != (w.shape[0],):
        raise ValueError(f"bias must have shape ({w.shape[0]},), got {tuple(bias.shape)}")
    vocab = w.shape[0]
    flat_y = flat_labels(labels, like=h, like_name="hidden", vocab=vocab)
    flat_h = h.reshape(-1, h.shape[-1])
    rows = _rows_per_chunk(vocab, chunk_elements, flat_h.device)
    lp, ent = _ChunkedLinearLogprobsEntropy.apply(flat_h, w, bias, flat_y, tau, rows, with_entropy)
    shape = h.shape[:-1]
    return lp.view(shape), (ent.view(shape) if with_entropy else None)
