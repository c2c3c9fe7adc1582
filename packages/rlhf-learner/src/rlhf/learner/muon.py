"""Muon (Jordan et al., 2024: "Muon: MomentUm Orthogonalized by Newton-schulz") with AdamW
for what is not a hidden matrix, as each learner backend runs it (`OptimizerConfig.name`
``muon``).

- DeepSpeed: its built-in ``MuonWithAuxAdam`` (DeepSpeed 0.19), configured by the config's
  ``optimizer`` section (`muon_section`) over our parameter groups (`muon_arguments`: norms
  and biases keep no weight decay); DeepSpeed splits each group into its Muon and AdamW halves.
- molt (FSDP2): `MuonAdamW`, ours, built by `build_muon`. Each hidden matrix's Nesterov
  momentum stays sharded (element-wise); its update is orthogonalised on the whole matrix,
  gathered from the shards (``DTensor.full_tensor``), and every rank keeps its own shard of
  the result, which all ranks compute alike.

The hidden matrices are the parameters with two or more dimensions outside the embeddings and
the output head (`is_hidden_matrix`, DeepSpeed's rule). Muon's step of a ``rows × cols``
matrix (a stack of them, such as fused experts, matrix by matrix) with gradient ``g``,
momentum ``μ`` and learning rate ``η``::

    B ← μ·B + (1 − μ)·g;   U = (1 − μ)·g + μ·B   (Nesterov)
    W ← W·(1 − η·λ) − η·sqrt(max(1, rows/cols))·NS₅(U)

with ``NS₅`` five iterations of the quintic ``X ← a·X + (b·A + c·A²)·X``, ``A = X·Xᵀ``,
``(a, b, c) = (3.4445, −4.7750, 2.0315)``, from ``X = U / (‖U‖_F + 1e-7)`` (on the wide
orientation): each singular value σ of ``X`` goes to ``p(σ) = a·σ + b·σ³ + c·σ⁵``, five
times, which pushes every one towards 1 (`newton_schulz5`). One ``LambdaLR`` schedule scales
both halves' learning rates (Muon's ``muon_lr``, AdamW's ``lr``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlhf.learner.config import OptimizerConfig
from rlhf.learner.optim import lr_lambda, param_groups

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic's (a, b, c) of `newton_schulz5`."""

NS_STEPS = 5
NS_EPS = 1e-7


def is_hidden_matrix(name: str, param: Tensor) -> bool:
    """Whether Muon steps parameter ``name``: two or more dimensions (DeepSpeed's ZeRO-3
    ``ds_shape``, or the global shape of a DTensor), not an embedding or the output head."""
    dims = len(getattr(param, "ds_shape", None) or param.shape)
    lowered = name.lower()
    return dims >= 2 and "embed" not in lowered and "lm_head" not in lowered


def newton_schulz5(g: Tensor) -> Tensor:
    """``NS₅(g)`` of a ``[..., rows, cols]`` matrix (or stack of them) in float32:
    U·p⁵(Σ/‖g‖_F)·Vᵀ for each ``g = U·Σ·Vᵀ`` (the module docstring's quintic ``p``),
    returned in ``g``'s dtype."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    wide = x.size(-2) <= x.size(-1)
    x = x if wide else x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + NS_EPS)
    for _ in range(NS_STEPS):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return (x if wide else x.mT).to(g.dtype)


def orthogonalise(update: Tensor) -> Tensor:
    """`newton_schulz5` of a matrix update; a DTensor's whole matrix is gathered, and each
    rank keeps the shard of the result its placements give it (no communication: every rank
    computed the same whole result)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(update, DTensor):
        return newton_schulz5(update)
    whole = newton_schulz5(update.full_tensor())
    return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the groups marked ``use_muon`` (``lr``, ``momentum``, ``weight_decay``), AdamW
    on the others (``lr``, ``betas``, ``eps``, ``weight_decay``); plain tensors or FSDP2
    DTensors. State: ``momentum_buffer`` (Muon); ``step``, ``exp_avg``, ``exp_avg_sq``
    (AdamW, as torch's AdamW names them), so distributed checkpoints save and load it."""

    def __init__(self, groups: list[dict[str, Any]], *, lr: float, betas: tuple[float, float],
                 eps: float, momentum: float) -> None:  # fmt: skip
        defaults = {"lr": lr, "betas": betas, "eps": eps, "momentum": momentum,
                    "weight_decay": 0.0, "use_muon": False}  # fmt: skip
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # pyright: ignore[reportIncompatibleMethodOverride]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if group["use_muon"]:
                    self._muon(param, group)
                else:
                    self._adamw(param, group)
        return loss

    def _muon(self, param: Tensor, group: dict[str, Any]) -> None:
        grad, lr, momentum = param.grad, group["lr"], group["momentum"]
        assert grad is not None
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param)
        buffer = state["momentum_buffer"]
        buffer.lerp_(grad, 1 - momentum)
        update = orthogonalise(grad.lerp(buffer, momentum))
        rows, cols = param.shape[-2], param.shape[-1]
        param.mul_(1 - lr * group["weight_decay"])
        param.add_(update, alpha=-lr * math.sqrt(max(1.0, rows / cols)))

    def _adamw(self, param: Tensor, group: dict[str, Any]) -> None:
        grad, lr, (beta1, beta2) = param.grad, group["lr"], group["betas"]
        assert grad is not None
        state = self.state[param]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        state["step"] += 1
        step = float(state["step"])
        param.mul_(1 - lr * group["weight_decay"])
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
        param.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**step))


def muon_groups(model: torch.nn.Module, opt: OptimizerConfig) -> list[dict[str, Any]]:
    """`MuonAdamW`'s groups, Muon's first: the hidden matrices (``muon_lr``, decayed), then
    AdamW's: the embeddings and the output head (``lr``, decayed), the norms and biases
    (``lr``, no decay) — `param_groups`' decay rule within each half."""
    muon, adamw_decay, adamw_plain = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if is_hidden_matrix(name, param):
            muon.append(param)
        elif len(param.shape) >= 2:
            adamw_decay.append(param)
        else:
            adamw_plain.append(param)
    groups = [
        {"params": muon, "use_muon": True, "lr": opt.muon_lr, "weight_decay": opt.weight_decay},
        {"params": adamw_decay, "lr": opt.lr, "weight_decay": opt.weight_decay},
        {"params": adamw_plain, "lr": opt.lr, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_muon(
    model: torch.nn.Module, opt: OptimizerConfig
) -> tuple[MuonAdamW, torch.optim.lr_scheduler.LambdaLR]:
    """`MuonAdamW` over `muon_groups` and the schedule over both halves."""
    optimizer = MuonAdamW(
        muon_groups(model, opt), lr=opt.lr, betas=opt.betas, eps=opt.eps,
        momentum=opt.muon_momentum,
    )  # fmt: skip
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(opt))


def muon_section(opt: OptimizerConfig) -> dict[str, Any]:
    """DeepSpeed's ``optimizer`` section: ``muon_lr`` and ``momentum`` for the hidden
    matrices, ``adam_lr``, ``betas`` and ``eps`` for the rest; the groups' own
    ``weight_decay`` (`param_groups`) wins over the section's."""
    return {
        "type": "Muon",
        "params": {
            "muon_lr": opt.muon_lr,
            "adam_lr": opt.lr,
            "momentum": opt.muon_momentum,
            "betas": list(opt.betas),
            "eps": opt.eps,
            "weight_decay": opt.weight_decay,
        },
    }


def muon_arguments(model: torch.nn.Module, opt: OptimizerConfig) -> dict[str, Any]:
    """``deepspeed.initialize``'s keyword arguments that make it build Muon: our parameter
    groups (``model_parameters``) and a factory of the schedule over its optimizer."""
    schedule = lr_lambda(opt)
    return {
        "model_parameters": param_groups(model, opt.weight_decay),
        "lr_scheduler": lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
    }
