"""Writing a transformers checkpoint of a role's full weights, whatever backend trained it."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

_SIDE_FILES = {"special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja"}


def write_hf_export(
    module: torch.nn.Module, state: Mapping[str, Tensor], *, source: str, directory: str
) -> None:
    """Save ``state`` (checkpoint names → full CPU tensors) as ``module``'s transformers
    checkpoint, with the source model's tokenizer files, into a staging directory that then
    replaces ``directory`` in one rename.

    Args:
        module: The role's model (a PEFT model is saved as its base model: ``state`` holds
            the merged weights).
        state: The full weights, e.g. ``Backend.state_dict_on_rank0()``.
        source: The model directory the role was built from (its tokenizer files are copied).
        directory: Where the export goes.
    """
    target = pathlib.Path(directory)
    staging = target.with_name(f".staging-{target.name}")
    shutil.rmtree(staging, ignore_errors=True)
    # A transformers model or a PEFT one around it, duck-typed: torch types a Module's
    # attributes as Tensor | Module, which hides their methods.
    model: Any = module
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "quantization_config", None) is None:
        base.save_pretrained(staging, state_dict=dict(state), safe_serialization=True)
    else:
        _save_dense(base, state, staging)
    for f in pathlib.Path(source).iterdir():
        wanted = f.name.startswith("tokenizer") or f.name in _SIDE_FILES
        if f.is_file() and wanted and not (staging / f.name).exists():
            shutil.copy2(f, staging / f.name)
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)


def _save_dense(base: Any, state: Mapping[str, Tensor], staging: pathlib.Path) -> None:
    """A quantised model's export as a plain one: transformers' ``save_pretrained`` would
    quantise ``state`` again, so the (dense, merged) tensors go to one safetensors file and the
    config loses its ``quantization_config``."""
    from safetensors.torch import save_file

    staging.mkdir(parents=True)
    base.config.save_pretrained(staging)
    config_file = staging / "config.json"
    config = json.loads(config_file.read_text())
    config.pop("quantization_config", None)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(staging)
    tensors = {name: tensor.contiguous() for name, tensor in state.items()}
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
