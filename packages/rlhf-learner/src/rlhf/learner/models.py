"""Models of the learner roles, built from HF checkpoints.

- ``causal_lm`` (actor, reference, SFT/DPO policy): ``AutoModelForCausalLM``.
- ``scalar`` (critic, reward model): ``AutoModelForTokenClassification`` with one label, i.e. the
  causal LM body and a linear ``score`` head giving one number per position. It saves and loads
  as a plain transformers checkpoint, so a reward model trained here initialises a critic, and
  ``transformers`` reads an exported one back. Loaded from a causal LM checkpoint (no ``score``
  weight), the head starts at zero.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import operator
import pathlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from rlhf.learner.config import ModelConfig

if TYPE_CHECKING:
    from peft import PeftModel

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
    try:
        raw = json.loads((root / "config.json").read_bytes())
    except ValueError as exc:  # JSON or UTF-8
        raise ModelLoadError(
            f"model path {path!r}: config.json is not valid JSON ({exc}); cut short? restore it "
            "from the model's source"
        ) from None
    if not isinstance(raw, dict):
        raise ModelLoadError(
            f"model path {path!r}: config.json holds a JSON {type(raw).__name__}, not a "
            "transformers model config; restore it from the model's source"
        )
    if not any(root.glob("*.safetensors")) and not any(root.glob("*.bin")):
        raise ModelLoadError(f"model path {path!r} has no weights (*.safetensors)")
    return root


DIGEST_SPAN = 1 << 20
"""Bytes `checkpoint_digest` reads from each end of every weight file."""


def checkpoint_digest(path: str) -> str:
    """A SHA-256 hex digest telling one checkpoint's weights from another's without reading
    them all: each ``*.safetensors`` file's name and size, its first and its last
    `DIGEST_SPAN` bytes (the header, and tensors at both ends). Two fine-tunes of one model
    differ there; a 0.5B model is digested in milliseconds."""
    import hashlib

    digest = hashlib.sha256()
    for file in sorted(check_model_dir(path).glob("*.safetensors")):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            digest.update(f.read(DIGEST_SPAN))
            f.seek(max(size - DIGEST_SPAN, 0))
            digest.update(f.read(DIGEST_SPAN))
    return digest.hexdigest()


def vocabulary_mismatch(student: str, teacher: str) -> str | None:
    """Why a teacher's log-probs cannot be compared with a student's token by token, or None
    when they can: their tokenizers must map the same strings to the same ids and agree on
    the end-of-sequence token. The models' ``vocab_size`` (embedding rows) may differ: models
    of one family pad their embeddings to different sizes around one tokenizer."""
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(student)
    theirs = AutoTokenizer.from_pretrained(teacher)
    a, b = ours.get_vocab(), theirs.get_vocab()
    if a != b:
        only = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: (kv[1], kv[0]))
        token, index = only[0]
        side = "student" if (token, index) in a.items() else "teacher"
        return (
            f"the tokenizers differ ({len(a)} vs {len(b)} tokens; e.g. {token!r} is id {index} "
            f"in the {side}'s alone)"
        )
    if ours.eos_token_id != theirs.eos_token_id:
        return (
            f"the end-of-sequence tokens differ (id {ours.eos_token_id} vs {theirs.eos_token_id})"
        )
    return None


def load_model(config: ModelConfig) -> torch.nn.Module:
    """The role's model in train mode (call ``.eval()`` for eval-only roles)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    check_model_dir(config.path)
    kwargs: dict[str, Any] = {
        "dtype": DTYPES[config.dtype],
        "attn_implementation": config.attn_implementation,
    }
    if config.load_in_4bit:
        kwargs["quantization_config"] = _nf4(config)
    if config.kind == "causal_lm":
        model = AutoModelForCausalLM.from_pretrained(config.path, **kwargs)
    else:
        model = AutoModelForTokenClassification.from_pretrained(config.path, num_labels=1, **kwargs)
        has_head = any("score." in name for name in checkpoint_names(pathlib.Path(config.path)))
        if not has_head and config.init_value_head:
            with torch.no_grad():
                model.score.weight.zero_()
                if getattr(model.score, "bias", None) is not None:
                    model.score.bias.zero_()
        # A scalar head reads hidden states as they are: no dropout before it.
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    if config.load_in_4bit:
        # bitsandbytes repacks a 4-bit weight in place for its CPU inference kernel at the
        # first eval-mode, no-gradient forward, and training then fails on the repacked
        # weight; one layout and one kernel also keep eval log-probs equal to training's.
        for module in model.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                setattr(module, "support_avx512bf16_for_cpu", False)  # noqa: B010
    if config.use_liger_kernel:
        apply_liger_kernels(model)
    if config.lora_rank:
        model = _with_lora(model, config)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": config.gradient_checkpointing_reentrant}
        )
        model.config.use_cache = False
    return model


def _nf4(config: ModelConfig) -> Any:
    """transformers' bitsandbytes config for QLoRA's 4-bit NF4 base (double quantisation,
    computing in the model's dtype)."""
    from transformers import BitsAndBytesConfig

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError(
            "model.load_in_4bit needs bitsandbytes: pip install 'rlhf-learner[qlora]'"
        )
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=DTYPES[config.dtype],
        # The heads stay dense: a scalar role's value head is initialised and trained here.
        llm_int8_skip_modules=["lm_head", "score"],
    )


def dense(param: torch.Tensor) -> torch.Tensor:
    """A parameter's values as a dense tensor: a bitsandbytes 4-bit weight (one carrying a
    ``quant_state``) dequantised to its original dtype, any other as it is (detached)."""
    state = getattr(param, "quant_state", None)
    if state is None:
        return param.detach()
    from bitsandbytes.functional import dequantize_4bit  # pyright: ignore[reportMissingImports]

    return dequantize_4bit(param.data, state).to(state.dtype)


def apply_liger_kernels(model: torch.nn.Module) -> None:
    """Liger's RMSNorm, SwiGLU and rotary kernels in ``model`` (``model.use_liger_kernel``),
    its fused cross-entropy left out: the learner reads log-probs from the logits."""
    try:
        from liger_kernel.transformers.monkey_patch import (  # pyright: ignore[reportMissingImports]
            MODEL_TYPE_TO_APPLY_LIGER_FN,
            _apply_liger_kernel_to_instance,
        )
    except ImportError as exc:
        raise ImportError(
            f"model.use_liger_kernel needs Liger's kernels, which do not import here ({exc}): "
            "pip install 'rlhf-learner[liger]' (Triton kernels, CUDA GPUs)"
        ) from exc
    family = getattr(model.config, "model_type", None)
    if family not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ValueError(
            f"model.use_liger_kernel: Liger has no kernels for {family!r} models; it has them "
            f"for {', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}"
        )
    _apply_liger_kernel_to_instance(
        model=model, fused_linear_cross_entropy=False, cross_entropy=False
    )


def _with_lora(model: torch.nn.Module, config: ModelConfig) -> PeftModel:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ImportError(
            "model.lora_rank > 0 needs PEFT: pip install 'rlhf-learner[lora]'"
        ) from exc
    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=list(config.lora_target_modules),
        # A scalar role's head trains in full beside the adapters.
        modules_to_save=["score"] if config.kind == "scalar" else None,
    )
    return get_peft_model(model, lora)


def merged_parameters(
    model: torch.nn.Module,
    gather: Callable[[list[torch.nn.Parameter]], AbstractContextManager[Any]] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters in checkpoint names; for a PEFT LoRA model, the base weights with the
    adapters merged in (``W + scale · B A``), without changing the model; 4-bit base weights
    (QLoRA) dequantised first.

    Args:
        model: A transformers model, or a PEFT model around one.
        gather: Context manager that makes the listed parameters whole while open (ZeRO-3's
            ``GatheredParameters``); None when they already are.

    Yields:
        ``(name, tensor)``; a tensor is valid until the next one is requested.
    """
    whole = gather or (lambda _params: contextlib.nullcontext())
    # PEFT's API (a PEFT model's base, a LoRA layer's adapters) is duck-typed: torch types a
    # Module's attributes as Tensor | Module, which hides it.
    peft_model: Any = model
    base = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else model
    modules: dict[str, Any] = dict(base.named_modules())
    for name, param in base.named_parameters():
        if ".lora_" in name or ".original_module." in name:
            continue
        owner_name, _, leaf = name.rpartition(".")
        clean = name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        if owner_name.endswith(".base_layer") and leaf == "weight":
            lora_layer = modules[owner_name.removesuffix(".base_layer")]
            needed = [param]
            for adapter in lora_layer.active_adapters:
                needed += list(lora_layer.lora_A[adapter].parameters())
                needed += list(lora_layer.lora_B[adapter].parameters())
            with whole(needed):
                delta = functools.reduce(
                    operator.add,
                    (lora_layer.get_delta_weight(a) for a in lora_layer.active_adapters),
                )
                base_weight = dense(param)
                yield clean, (base_weight + delta.to(base_weight.dtype)).detach()
        else:
            with whole([param]):
                yield clean, dense(param)


def checkpoint_names(root: pathlib.Path) -> list[str]:
    """The tensor names a checkpoint directory's ``*.safetensors`` files hold (headers only)."""
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
