"""Log-probs of chosen tokens and entropy from logits, computed in row chunks.

For logits z ∈ R^V scaled by a temperature τ (z ← z/τ):
logp(y) = z_y − logsumexp(z) and H = −Σ_v p_v·log p_v with p = softmax(z).

The naive route, ``log_softmax(logits.float() / τ)``, materialises one or two float32 copies of
the whole (B, T, V) tensor (1 GiB each at B=4, T=2048, V=32768). Here rows are processed in
chunks of about ``chunk_elements`` logits, in float32, and a custom autograd function saves only
the input and one logsumexp per row; the backward pass recomputes the softmax chunk by chunk:

    ∂logp/∂z = onehot(y) − p,        ∂H/∂z = −p ⊙ (log p + H).

So neither the forward nor the backward pass holds more than a few chunk-sized float32 buffers
besides the gradient of the logits itself. On CUDA each chunk runs through ``torch.compile``
(the same algebra written functionally, fused into a few kernels instead of ~11 elementwise
passes; ``RLHF_FUSED_LOGPROBS=0`` turns it off): a 1.5B actor step on an H200 went from 0.87x
to 0.95x a plain DeepSpeed loop. Elsewhere the chunks run eagerly, in place.

The entropy uses the same temperature-scaled logits as the log-probs (OpenRLHF computes it on
unscaled logits). Half, bfloat16 and float32 logits are computed and returned in float32,
float64 logits in float64. Double backward is not supported.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from rlhf.algos import _checks

# On CUDA 64M logits: 256 MiB per float32 buffer. Each chunk costs ~15 kernel launches; with
# 4M-logit chunks a 152k vocabulary gave 27 rows per chunk and the launches made a 1.5B actor
# step on an H200 host-bound (ours 0.70x a plain loop). At 64M it is 441 rows per chunk.
# Elsewhere there are no launches to amortise and 4M logits (16 MiB buffers) keep the peak low.
DEFAULT_CHUNK_ELEMENTS = {"cuda": 1 << 26, "cpu": 1 << 22}


def default_chunk_elements(device: torch.device) -> int:
    """Logits per chunk when the caller passes none: `DEFAULT_CHUNK_ELEMENTS` of the device
    type (CUDA's for CUDA, the CPU's for anything else)."""
    return DEFAULT_CHUNK_ELEMENTS["cuda" if device.type == "cuda" else "cpu"]


def _compute_dtype(logits: Tensor) -> torch.dtype:
    """float32 for half/bfloat16/float32 logits, float64 for float64 logits."""
    return torch.promote_types(logits.dtype, torch.float32)


def _scaled(chunk: Tensor, temperature: float, *, owned: bool = False) -> Tensor:
    """Upcast logits of one chunk divided by τ; a copy whenever it will be written to."""
    dtype = _compute_dtype(chunk)
    if temperature == 1.0 and not owned:
        return chunk.to(dtype)
    out = chunk.to(dtype, copy=True)
    return out.div_(temperature) if temperature != 1.0 else out


def _fused_forward_chunk(
    x: Tensor, labels: Tensor | None, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(lse, logprobs, entropy) of one chunk, written functionally for torch.compile to fuse
    into a few kernels (the eager path below works in place instead)."""
    z = x.to(_compute_dtype(x)) / temperature
    lse = torch.logsumexp(z, dim=-1)
    lp = None if labels is None else z.gather(1, labels.unsqueeze(1)).squeeze(1) - lse
    ent = None
    if with_entropy:
        log_p = (z - lse.unsqueeze(1)).clamp(min=torch.finfo(z.dtype).min)
        ent = -(log_p.exp() * log_p).sum(dim=-1)
    return lse, lp, ent


def _fused_backward_chunk(
    x: Tensor,
    lse: Tensor,
    labels: Tensor | None,
    g_lp: Tensor | None,
    g_ent: Tensor | None,
    temperature: float,
) -> Tensor:
    """∂/∂x of one chunk in ``x.dtype``; the same algebra as the eager backward, functional."""
    z = x.to(lse.dtype) / temperature
    log_p = (z - lse.unsqueeze(1)).clamp(min=torch.finfo(z.dtype).min)
    p = log_p.exp()
    g = torch.zeros_like(z)
    if g_ent is not None:
        neg_entropy = (p * log_p).sum(dim=-1, keepdim=True)
        g = -(log_p - neg_entropy) * p * g_ent.unsqueeze(1)
    if g_lp is not None and labels is not None:
        g = (g - p * g_lp.unsqueeze(1)).scatter_add(1, labels.unsqueeze(1), g_lp.unsqueeze(1))
    return (g / temperature).to(x.dtype)


_COMPILED: dict[str, Any] = {}


def _fused_kernels(device: torch.device) -> tuple[Any, Any] | None:
    """torch.compile'd chunk functions on CUDA (one fused pass per chunk instead of ~11
    elementwise kernels), unless ``RLHF_FUSED_LOGPROBS=0``; None elsewhere (eager, in place)."""
    if device.type != "cuda" or os.environ.get("RLHF_FUSED_LOGPROBS", "1") == "0":
        return None
    if not _COMPILED:
        _COMPILED["forward"] = torch.compile(_fused_forward_chunk, dynamic=True)
        _COMPILED["backward"] = torch.compile(_fused_backward_chunk, dynamic=True)
    return _COMPILED["forward"], _COMPILED["backward"]


def _eager_forward_chunk(
    x: Tensor, labels: Tensor | None, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(lse, logprobs, entropy) of one chunk, eagerly, with as few float32 buffers as it can."""
    z = _scaled(x, temperature)
    lse = torch.logsumexp(z, dim=-1)
    lp = None if labels is None else z.gather(1, labels.unsqueeze(1)).squeeze(1) - lse
    ent = None
    if with_entropy:
        # −Σ p·logp rather than lse − Σ p·z: no cancellation for peaked distributions.
        # −inf logits (masked vocabulary) give p = 0: keep 0·log p at 0, not NaN.
        log_p = torch.sub(z, lse.unsqueeze(1)).clamp_(min=torch.finfo(z.dtype).min)
        ent = -torch.einsum("nv,nv->n", log_p.exp(), log_p)
    return lse, lp, ent


def _eager_backward_chunk(
    x: Tensor,
    lse: Tensor,
    labels: Tensor | None,
    g_lp: Tensor | None,
    g_ent: Tensor | None,
    temperature: float,
) -> Tensor:
    """∂/∂x of one chunk (in the compute dtype), in place on one owned copy of the chunk."""
    # An owned copy: the in-place steps below must never touch the input.
    z = _scaled(x, temperature, owned=True)
    log_p = z.sub_(lse.unsqueeze(1)).clamp_(min=torch.finfo(z.dtype).min)
    p = log_p.exp()
    if g_ent is not None:
        neg_entropy = torch.einsum("nv,nv->n", p, log_p).unsqueeze(1)
        g = log_p.sub_(neg_entropy).mul_(p).mul_(-g_ent.unsqueeze(1))
    else:
        g = log_p.zero_()
    if g_lp is not None and labels is not None:
        g.sub_(p.mul_(g_lp.unsqueeze(1)))
        g.scatter_add_(1, labels.unsqueeze(1), g_lp.unsqueeze(1))
    return g.div_(temperature) if temperature != 1.0 else g


def chunk_kernels(device: torch.device) -> tuple[Any, Any]:
    """(forward, backward) of one chunk on ``device``: compiled on CUDA (`_fused_kernels`),
    eager elsewhere. ``forward(x, labels, τ, with_entropy) -> (lse, logprobs, entropy)``;
    ``backward(x, lse, labels, g_logprobs, g_entropy, τ) -> ∂/∂x``."""
    return _fused_kernels(device) or (_eager_forward_chunk, _eager_backward_chunk)


class _ChunkedLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        labels: Tensor | None,
        temperature: float,
        rows_per_chunk: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        n = logits.shape[0]
        like = {"dtype": _compute_dtype(logits), "device": logits.device}
        lse = torch.empty(n, **like)
        logprobs = torch.empty(n if labels is not None else 0, **like)
        entropy = torch.empty(n if with_entropy else 0, **like)
        forward_chunk, _ = chunk_kernels(logits.device)
        for start in range(0, n, rows_per_chunk):
            end = min(start + rows_per_chunk, n)
            chunk_labels = labels[start:end] if labels is not None else None
            lse[start:end], lp, ent = forward_chunk(
                logits[start:end], chunk_labels, temperature, with_entropy
            )
            if lp is not None:
                logprobs[start:end] = lp
            if ent is not None:
                entropy[start:end] = ent
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, labels if labels is not None else torch.empty(0), lse)
        ctx.has_labels = labels is not None
        ctx.temperature = temperature
        ctx.rows_per_chunk = rows_per_chunk
        ctx.with_entropy = with_entropy
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(  # pyright: ignore[reportIncompatibleMethodOverride]
        ctx: Any, grad_logprobs: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        # Grads of unused outputs arrive as None (materialisation is off).
        g_lp = grad_logprobs if ctx.has_labels else None
        g_ent = grad_entropy if ctx.with_entropy else None
        _, backward_chunk = chunk_kernels(logits.device)
        for start in range(0, logits.shape[0], ctx.rows_per_chunk):
            end = min(start + ctx.rows_per_chunk, logits.shape[0])
            grad[start:end] = backward_chunk(
                logits[start:end],
                lse[start:end],
                labels[start:end] if ctx.has_labels else None,
                g_lp[start:end] if g_lp is not None else None,
                g_ent[start:end] if g_ent is not None else None,
                ctx.temperature,
            )
        return grad, None, None, None, None


def _flatten(logits: Tensor, labels: Tensor | None) -> tuple[Tensor, Tensor | None]:
    z = _checks.floating("logits", logits)
    if z.ndim < 2 or z.shape[-1] < 1:
        raise ValueError(f"logits must have shape (..., V) with V >= 1, got {tuple(z.shape)}")
    flat = z.reshape(-1, z.shape[-1])
    if labels is None:
        return flat, None
    return flat, flat_labels(labels, like=z, like_name="logits", vocab=z.shape[-1])


def flat_labels(labels: Tensor, *, like: Tensor, like_name: str, vocab: int) -> Tensor:
    """``labels`` checked (integer, shape ``like.shape[:-1]``, ids in [0, vocab)) and
    flattened to int64 (N,)."""
    y = _checks.tensor("labels", labels)
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got dtype {y.dtype}")
    if y.shape != like.shape[:-1]:
        raise ValueError(
            f"labels has shape {tuple(y.shape)} but must equal {like_name}.shape[:-1] = "
            f"{tuple(like.shape[:-1])}"
        )
    flat_y = y.reshape(-1).to(torch.int64)
    if flat_y.numel() and (int(flat_y.min()) < 0 or int(flat_y.max()) >= vocab):
        raise ValueError(
            f"labels must lie in [0, V={vocab}), got values in "
            f"[{int(flat_y.min())}, {int(flat_y.max())}]; replace ignore indices (e.g. -100) by "
            "a valid id and mask those positions instead"
        )
    return flat_y


def _rows_per_chunk(vocab: int, chunk_elements: int | None, device: torch.device) -> int:
    if chunk_elements is None:
        chunk_elements = default_chunk_elements(device)
    if (
        isinstance(chunk_elements, bool)
        or not isinstance(chunk_elements, int)
        or chunk_elements < 1
    ):
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    return max(1, chunk_elements // vocab)


def logprobs_and_entropy(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_elements: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``labels`` and (optionally) entropy, in one chunked pass.

    Args:
        logits: (..., V), e.g. (B, T, V), any float dtype; the chunks are upcast to float32.
        labels: (...) integer ids in [0, V), aligned with ``logits`` (shift them yourself: the
            logits at position t score the token at t + 1). Prefer shifting the labels of the
            full, contiguous logits (``torch.roll`` and mask the last position) over slicing
            ``logits[:, :-1]``: a non-contiguous slice is copied once to be flattened.
        temperature: τ > 0, the sampling temperature the rollout used.
        with_entropy: Also return the entropy.
        chunk_elements: Logits processed per chunk (memory knob, no effect on results); None:
            `default_chunk_elements` of the logits' device.

    Returns:
        (logprobs (...), entropy (...) or None), float32 (float64 for float64 logits).
    """
    tau = _checks.positive("temperature", temperature)
    flat, flat_y = _flatten(logits, labels)
    rows = _rows_per_chunk(flat.shape[1], chunk_elements, flat.device)
    lp, ent = _ChunkedLogprobsEntropy.apply(flat, flat_y, tau, rows, with_entropy)
    shape = logits.shape[:-1]
    return lp.view(shape), (ent.view(shape) if with_entropy else None)


def logprobs_from_logits(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    chunk_elements: int | None = None,
) -> Tensor:
    """logp(y) = z_y/τ − logsumexp(z/τ). Shapes: logits (..., V), labels (...) → (...)."""
    lp, _ = logprobs_and_entropy(
        logits, labels, temperature=temperature, with_entropy=False, chunk_elements=chunk_elements
    )
    return lp


def entropy_from_logits(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    chunk_elements: int | None = None,
) -> Tensor:
    """H = −Σ p·log p with p = softmax(z/τ). Shapes: logits (..., V) → (...)."""
    tau = _checks.positive("temperature", temperature)
    flat, _ = _flatten(logits, None)
    rows = _rows_per_chunk(flat.shape[1], chunk_elements, flat.device)
    _, ent = _ChunkedLogprobsEntropy.apply(flat, None, tau, rows, True)
    return ent.view(logits.shape[:-1])
