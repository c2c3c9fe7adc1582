"""DeepSpeed's `rlhf.learner.backend_entry.BackendEntry`: how a role on DeepSpeed ZeRO builds,
splits, plans and fails, over its `DeepSpeedConfig` (DeepSpeed itself is imported only in the
rank that builds the backend)."""

from __future__ import annotations

import functools

from rlhf.learner.backend import BackendFactory
from rlhf.learner.backend_entry import RoleTopology
from rlhf.learner.capacity import DTYPE_BYTES, LearnerLoad, Memory, deepspeed_memory
from rlhf.learner.config import DeepSpeedConfig, ModelConfig


class DeepSpeedEntry:
    """DeepSpeed ZeRO 0–3 (`rlhf.learner.DeepSpeedBackend`)."""

    name = "deepspeed"
    options_field = "deepspeed"
    context_parallel_flag = "deepspeed.ring_attn_size"
    features = frozenset({"qlora", "liger"})

    def factory(self, options: DeepSpeedConfig, *, context_parallel: int) -> BackendFactory:
        from dataclasses import replace

        from rlhf.learner.deepspeed_backend import DeepSpeedBackend

        ring = replace(options, ring_attn_size=context_parallel)
        return functools.partial(DeepSpeedBackend, deepspeed=ring)

    def tensor_parallel(self, options: DeepSpeedConfig) -> int:
        return options.tp_size

    def own_context_parallel(self, options: DeepSpeedConfig) -> int:
        return options.ring_attn_size

    def compiles(self, options: DeepSpeedConfig) -> bool:
        return False  # DeepCompile and the fused log-prob chunks compile on CUDA only

    def compute_bytes(self, options: DeepSpeedConfig, model: ModelConfig) -> int:
        return 2 if options.bf16 else DTYPE_BYTES.get(model.dtype, 4)

    def offloadable(self, options: DeepSpeedConfig) -> bool:
        return options.zero_stage in (1, 2, 3)

    def describe(self, options: DeepSpeedConfig, *, num_ranks: int, context_parallel: int) -> str:
        cp, tp = context_parallel, options.tp_size
        mesh = f", dp {num_ranks // cp} x ring {cp}" if cp > 1 else ""
        mesh += f", dp {num_ranks // tp} x tp {tp} (AutoTP)" if tp > 1 else ""
        compiled = ", DeepCompile" if options.deepcompile else ""
        return f"ZeRO-{options.zero_stage}{mesh}{compiled}"

    def memory(self, options: DeepSpeedConfig, load: LearnerLoad) -> Memory:
        return deepspeed_memory(
            load,
            zero_stage=options.zero_stage,
            offload_optimizer=options.offload_optimizer,
            offload_params=options.offload_params,
        )

    def problems(self, options: DeepSpeedConfig, role: RoleTopology, *, flag: str) -> list[str]:
        """``--{flag}.deepspeed.tp_size`` (AutoTP) against the ranks, the ZeRO stage, LoRA,
        the chunked lm_head, context parallelism and the model's heads; the model options
        ZeRO-3 cannot carry; ZeRO++'s partition size; DeepCompile without GPUs."""
        from rlhf.learner.tensor_parallel import tensor_parallel_problems

        ds = options
        problems = tensor_parallel_problems(
            deepspeed=ds, model=role.model, world_size=role.num_ranks, prefix=f"{flag}."
        )
        problems += ds.model_problems(role.model, prefix=f"--{flag}.")
        if ds.tp_size > 1 and role.ring_attn_size > 1:
            problems.append(
                f"--{flag}.deepspeed.tp_size {ds.tp_size} with --{flag}.ring_attn_size "
                f"{role.ring_attn_size}: not combined yet; set one of them to 1"
            )
        if role.num_ranks % ds.hpz_partition_size:
            problems.append(
                f"--{flag}.deepspeed.hpz_partition_size {ds.hpz_partition_size} must divide "
                f"the role's {role.num_ranks} ranks (ZeRO++ partitions the parameters within "
                "groups of that many ranks)"
            )
        if role.optimizer is not None and role.optimizer.name == "muon":
            problems += _muon_problems(ds, grad_clip=role.optimizer.grad_clip, flag=flag)
        if ds.deepcompile and not role.gpus_per_rank:
            problems.append(
                f"--{flag}.deepspeed.deepcompile needs GPUs (--{flag}.num_gpus_per_rank > 0): "
                "DeepSpeed runs DeepCompile on CUDA only; set it to False on CPUs"
            )
        return problems


def _muon_problems(ds: DeepSpeedConfig, *, grad_clip: float, flag: str) -> list[str]:
    """What DeepSpeed's Muon does not run with: ZeRO-0 (its Muon is built into the ZeRO
    optimizers' gradient partitioning), AutoTP (each rank holds a slice of a matrix),
    DeepCompile (which replaces those optimizers' gradient path), and a gradient clip (DeepSpeed
    0.19.8 measures the norm after the Newton-Schulz step, over the orthogonalised updates)."""
    problems = []
    if grad_clip > 0:
        problems.append(
            f"--{flag}.optimizer.name muon with --{flag}.optimizer.grad_clip {grad_clip} "
            "(OpenRLHF's --actor.max_norm): DeepSpeed's Muon clips after its Newton-Schulz "
            "step, so the bound would measure the orthogonalised updates (about "
            "sqrt(sum of min(rows, cols)) over the matrices) and shrink every step; set "
            f"--{flag}.optimizer.grad_clip 0 with Muon, or train with --{flag}.backend molt, "
            "whose Muon clips the gradients before it"
        )
    if ds.zero_stage == 0:
        problems.append(
            f"--{flag}.optimizer.name muon needs --{flag}.deepspeed.zero_stage 1, 2 or 3: "
            "DeepSpeed orthogonalises Muon's matrices inside its ZeRO optimizers"
        )
    if ds.tp_size > 1:
        problems.append(
            f"--{flag}.optimizer.name muon with --{flag}.deepspeed.tp_size {ds.tp_size}: each "
            "rank holds a slice of every matrix and Muon orthogonalises whole ones; use "
            "tp_size 1"
        )
    if ds.deepcompile:
        problems.append(
            f"--{flag}.optimizer.name muon with --{flag}.deepspeed.deepcompile: not combined; "
            "set one of them"
        )
    return problems
