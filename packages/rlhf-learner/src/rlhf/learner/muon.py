"""Muon in the DeepSpeed backend (`OptimizerConfig.name` ``muon``): DeepSpeed 0.19's built-in
``MuonWithAuxAdam`` orthogonalises the update of every hidden matrix (Newton–Schulz, 5 steps,
Nesterov momentum) and runs AdamW on the rest (embeddings, output head, norms, biases).

DeepSpeed builds the optimizer itself from the config's ``optimizer`` section (`muon_section`)
over the parameter groups it is given (`muon_arguments`: ours, so norms and biases keep no
weight decay), splitting each group into its Muon and AdamW halves (Muon's first); one
``LambdaLR`` schedule scales both halves' learning rates.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf.learner.config import OptimizerConfig
from rlhf.learner.optim import lr_lambda, param_groups


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
