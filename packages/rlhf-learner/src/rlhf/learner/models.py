"""Models of the learner roles, built from HF checkpoints.

- ``causal_lm`` (actor, reference, SFT/DPO policy): ``AutoModelForCausalLM``.
- ``scalar`` (critic, reward model): ``AutoModelForTokenClassification`` with one label, i.e. the
  causal LM body and a linear ``score`` head giving one number per position. It saves and loads
  as a plain transformers checkpoint, so a reward model trained here initialises a critic, and
  ``transformers`` reads an exported one back. Loaded from a causal LM checkpoint (no ``score``
  weight), the head starts at zero.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch

from rlhf.learner.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ModelLoadError(ValueError):
    """A model directory is missing or unusable; the message names the path and the fix."""


def check_model_dir(path: str) -> pathlib.Path:
    """The checkpoint directory, or a `ModelLoadError` saying what is missing."""
    root = pathlib.Path(path)
    if not root.is_dir():
        raise ModelLoadError(
            f"model path {path!r} does not exist or is not a directory; pass a local HF "
            "checkpoint directory (config.json + *.safetensors) with --*.model.path"
        )
    if not (root / "config.json").is_file():
        raise ModelLoadError(f"model path {path!r} has no config.json: not an HF checkpoint")
    if not any(root.glob("*.safetensors")) and not any(root.glob("*.bin")):
        raise ModelLoadError(f"model path {path!r} has no weights (*.safetensors)")
    return root


def load_model(config: ModelConfig) -> torch.nn.Module:
    """The role's model in train mode (call ``.eval()`` for eval-only roles)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    check_model_dir(config.path)
    kwargs: dict[str, Any] = {
        "dtype": DTYPES[config.dtype],
        "attn_implementation": config.attn_implementation,
    }
    if config.kind == "causal_lm":
        model = AutoModelForCausalLM.from_pretrained(config.path, **kwargs)
    else:
        model = AutoModelForTokenClassification.from_pretrained(config.path, num_labels=1, **kwargs)
        has_head = any("score." in name for name in _checkpoint_names(pathlib.Path(config.path)))
        if not has_head and config.init_value_head:
            with torch.no_grad():
                model.score.weight.zero_()
                if getattr(model.score, "bias", None) is not None:
                    model.score.bias.zero_()
        # A scalar head reads hidden states as they are: no dropout before it.
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


def _checkpoint_names(root: pathlib.Path) -> list[str]:
    import json
    import struct

    names: list[str] = []
    for file in root.glob("*.safetensors"):
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            names += [k for k in json.loads(f.read(size)) if k != "__metadata__"]
    return names


def fingerprint(model: torch.nn.Module) -> dict[str, list[int]]:
    """Parameter names → shapes (unsharded): what a checkpoint must match to be loaded."""
    out = {}
    for name, param in model.named_parameters():
        shape = getattr(param, "ds_shape", None) or param.shape  # ZeRO-3 keeps the full shape
        out[name] = [int(d) for d in shape]
    return out
