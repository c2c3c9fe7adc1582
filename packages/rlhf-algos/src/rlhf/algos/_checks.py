"""Input validation shared by the public functions: every failure names the argument."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def tensor(name: str, value: object) -> Tensor:
    """``value`` as a tensor, or `ValueError` naming ``name``."""
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def floating(name: str, value: object, *, ndim: int | None = None) -> Tensor:
    """A floating-point tensor with ``ndim`` dimensions."""
    t = tensor(name, value)
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    return t


def same_shape(reference: str, ref: Tensor, **others: Tensor | None) -> None:
    """Every tensor in ``others`` (None skipped) has the shape of ``ref``."""
    for name, value in others.items():
        if value is None:
            continue
        t = tensor(name, value)
        if t.shape != ref.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but must match {reference} "
                f"with shape {tuple(ref.shape)}"
            )


def mask(name: str, value: object, *, like: Tensor, like_name: str) -> Tensor:
    """A mask with the shape of ``like`` as exact 0/1 values of ``like``'s dtype.

    Bool, integer or float masks are accepted; an entry counts as valid iff it is > 0, the same
    rule for numerators and counts (checking for exact 0/1 would cost a device sync).
    """
    m = tensor(name, value)
    if m.shape != like.shape:
        raise ValueError(
            f"{name} has shape {tuple(m.shape)} but must match {like_name} "
            f"with shape {tuple(like.shape)}"
        )
    if m.is_complex():
        raise ValueError(f"{name} must be bool, integer or float 0/1, got dtype {m.dtype}")
    return (m > 0).to(like.dtype)


def upcast(x: Tensor) -> Tensor:
    """float16/bfloat16 → float32 (ratios and exponentials overflow float16 near exp(11))."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def zero_masked(x: Tensor, m: Tensor) -> Tensor:
    """``x`` with masked entries replaced by 0, so NaN/inf there cannot reach any gradient."""
    return torch.where(m > 0, x, torch.zeros_like(x))


def count(name: str, value: object) -> int:
    """A non-negative int (not bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def group_size(name: str, n: int, *, batch: int) -> None:
    """``n`` samples per prompt divide a batch of ``batch`` sequences."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{name} must be a positive int, got {n!r}")
    if batch % n != 0:
        raise ValueError(
            f"{name}={n} does not divide the batch of {batch} sequences; the batch must hold "
            f"whole prompt groups with the {n} samples of each prompt contiguous"
        )


def interval(name: str, value: Sequence[float], *, strict: bool = False) -> tuple[float, float]:
    """A (low, high) pair with low <= high (low < high when ``strict``)."""
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a (low, high) pair, got {value!r}") from None
    if math.isnan(low) or math.isnan(high):
        raise ValueError(f"{name} must not contain NaN, got {value!r}")
    if low > high or (strict and low == high):
        raise ValueError(f"{name} must satisfy low {'<' if strict else '<='} high, got {value!r}")
    return low, high


def positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    """A finite positive number (or non-negative when ``allow_zero``)."""
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return v
