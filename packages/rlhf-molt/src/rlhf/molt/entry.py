"""The molt backend's `rlhf.learner.backend_entry.BackendEntry`: how a role on FSDP2 builds,
splits, compiles, plans and fails, over its `FSDPConfig`."""

from __future__ import annotations

import dataclasses
import functools
import pathlib

from rlhf.learner.backend import BackendFactory
from rlhf.learner.backend_entry import RoleTopology
from rlhf.learner.capacity import DTYPE_BYTES, LearnerLoad, Memory
from rlhf.learner.config import ModelConfig
from rlhf.molt.capacity import molt_memory
from rlhf.molt.config import FSDPConfig, FSDPConfigError


class MoltEntry:
    """PyTorch FSDP2 over DTensor (`rlhf.molt.FSDPBackend`)."""

    name = "molt"
    options_field = "fsdp"
    context_parallel_flag = "fsdp.cp_size"
    features: frozenset[str] = frozenset()

    def factory(self, options: FSDPConfig, *, context_parallel: int) -> BackendFactory:
        from rlhf.molt.backend import FSDPBackend

        mesh = dataclasses.replace(options, cp_size=context_parallel)
        return functools.partial(FSDPBackend, fsdp=mesh)

    def tensor_parallel(self, options: FSDPConfig) -> int:
        return options.tp_size

    def own_context_parallel(self, options: FSDPConfig) -> int:
        return options.cp_size

    def compiles(self, options: FSDPConfig) -> bool:
        return options.compile

    def compute_bytes(self, options: FSDPConfig, model: ModelConfig) -> int:
        return DTYPE_BYTES[options.param_dtype]

    def offloadable(self, options: FSDPConfig) -> bool:
        return True

    def describe(self, options: FSDPConfig, *, num_ranks: int, context_parallel: int) -> str:
        tp, cp = options.tp_size, context_parallel
        mesh = f", dp {num_ranks // tp} x tp {tp}" if tp > 1 else ""
        mesh += ", sequence parallel" if tp > 1 and options.sequence_parallel else ""
        mesh += f", dp {num_ranks // cp} x cp {cp}" if cp > 1 else ""
        compiled = ", compiled" if options.compile else ""
        return f"FSDP2 (molt, {options.param_dtype}{mesh}{compiled})"

    def memory(self, options: FSDPConfig, load: LearnerLoad) -> Memory:
        return molt_memory(
            load,
            offload=options.offload,
            param_dtype_bytes=DTYPE_BYTES[options.param_dtype],
            reshard_after_forward=options.reshard_after_forward,
        )

    def problems(self, options: FSDPConfig, role: RoleTopology, *, flag: str) -> list[str]:
        """The options against each other and the ranks (`FSDPConfig.validate`, with the
        role's context-parallel size), ``tp_size`` against the model's heads, and what does
        not combine with tensor parallelism yet (LoRA, the chunked lm_head)."""
        problems = []
        try:
            mesh = dataclasses.replace(options, cp_size=role.context_parallel)
            mesh.validate(flag=f"{flag}.fsdp")
        except FSDPConfigError as exc:
            problems.append(str(exc))
        problems += _tensor_parallel_problems(options, role, flag=flag)
        if role.model.lora_rank and options.tp_size > 1:
            problems.append(
                f"--{flag}.model.lora_rank with --{flag}.fsdp.tp_size {options.tp_size}: "
                "LoRA adapters are not split over tensor-parallel ranks yet; use tp_size 1 "
                "for LoRA"
            )
        if role.optimizer is not None and role.optimizer.name == "muon":
            if options.offload == "optimizer":
                problems.append(
                    f"--{flag}.optimizer.name muon with --{flag}.fsdp.offload optimizer: the "
                    f"host-side optimizer is AdamW only; use --{flag}.fsdp.offload none or full"
                )
            if options.tp_size > 1:
                problems.append(
                    f"--{flag}.optimizer.name muon with --{flag}.fsdp.tp_size "
                    f"{options.tp_size}: Muon gathers each matrix from its FSDP shards, "
                    "not yet across tensor-parallel ones; use tp_size 1 for Muon"
                )
        if role.model.chunked_lm_head and options.tp_size > 1:
            problems.append(
                f"--{flag}.model.chunked_lm_head with --{flag}.fsdp.tp_size "
                f"{options.tp_size}: the chunked head reads the lm_head whole, which tensor "
                "parallelism splits by vocabulary; use one of the two"
            )
        return problems


def _tensor_parallel_problems(options: FSDPConfig, role: RoleTopology, *, flag: str) -> list[str]:
    """``--{flag}.fsdp.tp_size`` against the role's ranks and its model's heads (read from
    the model's config.json only; a missing model is reported by the model checks)."""
    from rlhf.molt.tensor_parallel import check_tensor_parallel

    if options.tp_size <= 1:
        return []
    model_config = None
    path = role.model.path
    if path and (pathlib.Path(path) / "config.json").is_file():
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(path)
    try:
        check_tensor_parallel(
            model_config, tp_size=options.tp_size, world_size=role.num_ranks, flag=f"{flag}.fsdp"
        )
    except FSDPConfigError as exc:
        return [str(exc)]
    return []
