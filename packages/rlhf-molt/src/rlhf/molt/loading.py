"""Building a role's model without a whole copy on any rank: parameters on the meta device,
split and sharded there, then each rank reads only its slices of the checkpoint.

1. `build_on_meta`: the transformers model from its config.json, every parameter on the meta
   device (no memory, no initialisation cost); buffers are computed for real (rotary
   frequencies are not in checkpoints).
2. The caller applies tensor parallelism and FSDP2 to the meta model (shapes only).
3. `materialize_and_load`: storage for this rank's shards (``to_empty``), the buffers put back,
   and the checkpoint's ``*.safetensors`` read through DCP's Hugging Face reader into the
   sharded state dict: each rank reads the rows its shards hold, one tensor at a time.

It applies to causal language models whose checkpoint holds every parameter in safetensors;
a scalar model's new head and LoRA adapters are initialised, not loaded, so those load whole
(`rlhf.learner.load_model`) before sharding.
"""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Iterator

import torch

from rlhf.learner.config import ModelConfig
from rlhf.learner.models import ModelLoadError, check_model_dir, checkpoint_names


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """While open, every parameter a module registers moves to the meta device at once (its
    initialisation then costs nothing); buffers stay real."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            moved = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = moved

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def sharded_loading_refused(config: ModelConfig) -> str | None:
    """Why ``config``'s model must load whole before sharding, or None when it can be built
    on the meta device and loaded slice by slice."""
    if config.kind != "causal_lm":
        return "a scalar model's head is initialised, not loaded"
    if config.lora_rank:
        return "LoRA adapters are initialised, not loaded"
    root = check_model_dir(config.path)
    if not any(root.glob("*.safetensors")):
        return "the weights are not in safetensors"
    return None


def _stored_names(model: torch.nn.Module) -> set[str]:
    """The state-dict names a checkpoint provides: every parameter (a tied one once) and every
    persistent buffer."""
    params = {name for name, _ in model.named_parameters()}
    every_param = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return params | (set(model.state_dict()) - every_param)


def build_on_meta(config: ModelConfig, *, dtype: torch.dtype) -> torch.nn.Module | None:
    """The causal LM of ``config.path`` with its parameters on the meta device in ``dtype``,
    or None when the checkpoint does not hold every parameter and persistent buffer (then it
    must load whole)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(config.path)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(
            hf_config, dtype=dtype, attn_implementation=config.attn_implementation
        )
    stored = set(checkpoint_names(pathlib.Path(config.path)))
    if not _stored_names(model) <= stored:
        return None
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": config.gradient_checkpointing_reentrant}
        )
        model.config.use_cache = False
    return model


def materialize_and_load(
    model: torch.nn.Module, *, path: str, device: torch.device, buffers_on: torch.device
) -> None:
    """Allocate this rank's shards of the (split, sharded) meta ``model`` on ``device``, put
    its buffers on ``buffers_on`` and read its slices of the checkpoint at ``path``."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict_loader import load

    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    for name, value in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = value.to(buffers_on)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    names = _stored_names(model)
    state = {k: v for k, v in get_model_state_dict(model).items() if k in names}
    try:
        load(state, storage_reader=HuggingFaceStorageReader(path))
    except Exception as exc:  # the reader's errors name no flag
        raise ModelLoadError(
            f"model path {path!r}: reading its safetensors shard by shard failed ({exc}); "
            "check the checkpoint files"
        ) from exc
