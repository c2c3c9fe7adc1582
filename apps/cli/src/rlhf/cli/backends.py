"""The learner backends a role can run on (``--<role>.backend``), by name.

Each entry (`LearnerBackend`) says, for a role's settings, the factory
`rlhf.learner.LearnerGroup.build` calls in every rank's process (the concrete backends are
imported only there and when chosen), how the role splits (tensor and context parallel),
whether it compiles, its memory for the planner, how the plan describes it and what keeps it
from building; the CLI asks the role's entry instead of comparing backend names.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import pathlib
from typing import TYPE_CHECKING, Protocol

from rlhf.learner.capacity import DTYPE_BYTES, LearnerLoad, Memory, deepspeed_memory

if TYPE_CHECKING:
    from rlhf.cli.sections import RoleConfig
    from rlhf.learner import BackendFactory


class LearnerBackend(Protocol):
    """One ``--<role>.backend``: how a role's settings build, split, compile, plan and fail on
    it. The CLI asks the role's entry (`backend_of`) instead of comparing names."""

    name: str
    context_parallel_flag: str
    """The backend's own context-parallel option (beside ``--<role>.ring_attn_size``)."""
    features: frozenset[str]
    """Model options built for this backend: ``qlora`` (``model.load_in_4bit``), ``liger``
    (``model.use_liger_kernel``)."""

    def factory(self, role: RoleConfig) -> BackendFactory:
        """The `rlhf.learner.BackendFactory` every rank calls."""
        ...

    def tensor_parallel(self, role: RoleConfig) -> int: ...

    def own_context_parallel(self, role: RoleConfig) -> int: ...

    def compiles(self, role: RoleConfig) -> bool:
        """The role compiles on CPUs too (TorchDynamo must stay on)."""
        ...

    def compute_bytes(self, role: RoleConfig) -> int: ...

    def offloadable(self, role: RoleConfig) -> bool:
        """Its states can leave the device between phases (hybrid placement)."""
        ...

    def describe(self, role: RoleConfig) -> str:
        """How it trains, for the plan."""
        ...

    def memory(self, role: RoleConfig, load: LearnerLoad) -> Memory:
        """One rank's memory for the planner (`rlhf.learner.capacity`)."""
        ...

    def problems(self, role: RoleConfig, *, flag: str) -> list[str]:
        """What keeps ``role`` from building on this backend, naming the flags."""
        ...


class DeepSpeed:
    """DeepSpeed ZeRO 0–3 (`rlhf.learner.DeepSpeedBackend`)."""

    name = "deepspeed"
    context_parallel_flag = "deepspeed.ring_attn_size"
    features = frozenset({"qlora", "liger"})

    def factory(self, role: RoleConfig) -> BackendFactory:
        from rlhf.learner import DeepSpeedBackend

        ring = dataclasses.replace(role.deepspeed, ring_attn_size=role.context_parallel)
        return functools.partial(DeepSpeedBackend, deepspeed=ring)

    def tensor_parallel(self, role: RoleConfig) -> int:
        return role.deepspeed.tp_size

    def own_context_parallel(self, role: RoleConfig) -> int:
        return role.deepspeed.ring_attn_size

    def compiles(self, role: RoleConfig) -> bool:
        return False  # DeepCompile and the fused log-prob chunks compile on CUDA only

    def compute_bytes(self, role: RoleConfig) -> int:
        return 2 if role.deepspeed.bf16 else DTYPE_BYTES.get(role.model.dtype, 4)

    def offloadable(self, role: RoleConfig) -> bool:
        return role.deepspeed.zero_stage in (1, 2)

    def describe(self, role: RoleConfig) -> str:
        cp, tp = role.context_parallel, role.deepspeed.tp_size
        mesh = f", dp {role.num_ranks // cp} x ring {cp}" if cp > 1 else ""
        mesh += f", dp {role.num_ranks // tp} x tp {tp} (AutoTP)" if tp > 1 else ""
        compiled = ", DeepCompile" if role.deepspeed.deepcompile else ""
        return f"ZeRO-{role.deepspeed.zero_stage}{mesh}{compiled}"

    def memory(self, role: RoleConfig, load: LearnerLoad) -> Memory:
        ds = role.deepspeed
        return deepspeed_memory(
            load,
            zero_stage=ds.zero_stage,
            offload_optimizer=ds.offload_optimizer,
            offload_params=ds.offload_params,
        )

    def problems(self, role: RoleConfig, *, flag: str) -> list[str]:
        return _deepspeed_problems(role, flag=flag) + _unread_fsdp_problems(role, flag=flag)


class Molt:
    """PyTorch FSDP2 over DTensor (`rlhf.molt.FSDPBackend`)."""

    name = "molt"
    context_parallel_flag = "fsdp.cp_size"
    features: frozenset[str] = frozenset()

    def factory(self, role: RoleConfig) -> BackendFactory:
        from rlhf.molt import FSDPBackend

        return functools.partial(FSDPBackend, fsdp=role.fsdp_options())

    def tensor_parallel(self, role: RoleConfig) -> int:
        return role.fsdp.tp_size

    def own_context_parallel(self, role: RoleConfig) -> int:
        return role.fsdp.cp_size

    def compiles(self, role: RoleConfig) -> bool:
        return role.fsdp.compile

    def compute_bytes(self, role: RoleConfig) -> int:
        return DTYPE_BYTES[role.fsdp.param_dtype]

    def offloadable(self, role: RoleConfig) -> bool:
        return True

    def describe(self, role: RoleConfig) -> str:
        tp, cp = role.fsdp.tp_size, role.context_parallel
        mesh = f", dp {role.num_ranks // tp} x tp {tp}" if tp > 1 else ""
        mesh += ", sequence parallel" if tp > 1 and role.fsdp.sequence_parallel else ""
        mesh += f", dp {role.num_ranks // cp} x cp {cp}" if cp > 1 else ""
        compiled = ", compiled" if role.fsdp.compile else ""
        return f"FSDP2 (molt, {role.fsdp.param_dtype}{mesh}{compiled})"

    def memory(self, role: RoleConfig, load: LearnerLoad) -> Memory:
        from rlhf.molt.capacity import molt_memory

        return molt_memory(
            load,
            offload=role.fsdp.offload,
            param_dtype_bytes=self.compute_bytes(role),
            reshard_after_forward=role.fsdp.reshard_after_forward,
        )

    def problems(self, role: RoleConfig, *, flag: str) -> list[str]:
        from rlhf.molt import FSDPConfigError

        problems = []
        try:
            role.fsdp_options().validate(flag=f"{flag}.fsdp")
        except FSDPConfigError as exc:
            problems.append(str(exc))
        problems += _tensor_parallel_problems(role, flag=flag)
        if role.model.lora_rank and role.fsdp.tp_size > 1:
            problems.append(
                f"--{flag}.model.lora_rank with --{flag}.fsdp.tp_size {role.fsdp.tp_size}: "
                "LoRA adapters are not split over tensor-parallel ranks yet; use tp_size 1 "
                "for LoRA"
            )
        if role.model.chunked_lm_head and role.fsdp.tp_size > 1:
            problems.append(
                f"--{flag}.model.chunked_lm_head with --{flag}.fsdp.tp_size "
                f"{role.fsdp.tp_size}: the chunked head reads the lm_head whole, which tensor "
                "parallelism splits by vocabulary; use one of the two"
            )
        return problems


BACKENDS: dict[str, LearnerBackend] = {b.name: b for b in (DeepSpeed(), Molt())}
"""``--<role>.backend`` values: DeepSpeed ZeRO 0–3 (`rlhf.learner.DeepSpeedBackend`) or FSDP2
(`rlhf.molt.FSDPBackend`)."""


def backend_of(role: RoleConfig) -> LearnerBackend:
    """``role``'s backend entry. A name not in `BACKENDS` is refused by `role_problems`;
    until then it reads as ``deepspeed``, the default."""
    return BACKENDS.get(role.backend, BACKENDS["deepspeed"])


def backend_factory(role: RoleConfig) -> BackendFactory:
    """The `rlhf.learner.BackendFactory` of ``role`` (validated: see `role_problems`)."""
    return BACKENDS[role.backend].factory(role)


def rank_env(role: RoleConfig, *, gpu: bool) -> dict[str, str]:
    """Environment variables of ``role``'s rank processes: on CPUs, TorchDynamo off
    (``TORCHDYNAMO_DISABLE=1``) unless the role compiles (``fsdp.compile``; DeepSpeed's
    deepcompile and the fused log-prob chunks compile on CUDA only) or this process's
    environment sets it. DeepSpeed's optimizer check imports its Muon optimizer, whose module
    wraps three functions in ``torch.compile`` at import: that alone imported Inductor, ~20 %
    of a CPU rank's start-up samples in the demo. A role with Liger's kernels is marked
    (``RLHF_LIGER_KERNEL=1``): Liger patches transformers' modules for the whole process, and
    the mark keeps a later run without it from taking such a process over (it is part of the
    warm-process key)."""
    env = {"RLHF_LIGER_KERNEL": "1"} if role.model.use_liger_kernel else {}
    compiles = gpu or backend_of(role).compiles(role)
    if not compiles and "TORCHDYNAMO_DISABLE" not in os.environ:
        env["TORCHDYNAMO_DISABLE"] = "1"
    return env


def compute_threads(*, num_ranks: int, gpu: bool, beside_engines: bool) -> int | None:
    """torch intra-op threads for each of a role's ``num_ranks`` CPU ranks while it trains or
    runs a forward (`rlhf.learner.LearnerGroup.compute_threads`): this machine's CPUs shared
    among them, since in a synchronous run the engines wait while the learners compute, and
    the roles take their turns one after another (as in ``rlhf train sft|rm|dpo``). None on
    GPUs and when the engines generate meanwhile (``beside_engines``: ``--train.async_enable``):
    the ranks keep what Ray gives them, one thread per CPU they reserve and at least one.
    Demo RL stage on 2 cores: training 58.6 -> 47.7 ms per step (median of 3 runs each)."""
    if gpu or beside_engines:
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cpus or 1) // num_ranks)


def role_problems(role: RoleConfig, *, flag: str) -> list[str]:
    """What keeps ``role`` (flags ``--{flag}.*``) from building on its backend, each message
    naming the flag and what to do; empty when it can."""
    if role.backend not in BACKENDS:
        return [f"--{flag}.backend must be one of {', '.join(BACKENDS)}, got {role.backend!r}"]
    problems = []
    if role.model.lora_rank and importlib.util.find_spec("peft") is None:
        problems.append(
            f"--{flag}.model.lora_rank {role.model.lora_rank} needs PEFT, which is not "
            "installed: pip install 'rlhf-cli[cpu]' (or 'rlhf-cli[gpu]', or peft itself)"
        )
    problems += _context_parallel_problems(role, flag=flag)
    if role.optimizer.total_steps != type(role.optimizer)().total_steps:
        problems.append(
            f"--{flag}.optimizer.total_steps is set by the run (the schedule spans its "
            f"optimizer steps); leave it out and shape the schedule with --{flag}.optimizer."
            "warmup_steps, warmup_ratio, schedule and min_lr_ratio"
        )
    if role.model.use_liger_kernel:
        problems += _liger_problems(role, flag=flag)
    if role.model.load_in_4bit:
        problems += _qlora_problems(role, flag=flag)
    return problems + BACKENDS[role.backend].problems(role, flag=flag)


def _unread_fsdp_problems(role: RoleConfig, *, flag: str) -> list[str]:
    """``--{flag}.fsdp.*`` set while the role runs on DeepSpeed, which never reads them."""
    default = type(role.fsdp)()
    given = [
        f"--{flag}.fsdp.{f.name}"
        for f in dataclasses.fields(role.fsdp)
        if getattr(role.fsdp, f.name) != getattr(default, f.name)
    ]
    if not given:
        return []
    return [
        f"{', '.join(given)} configure the molt backend, and --{flag}.backend is deepspeed, "
        f"which does not read them: add --{flag}.backend molt, or drop them (DeepSpeed's own "
        f"options are --{flag}.deepspeed.*)"
    ]


def _qlora_problems(role: RoleConfig, *, flag: str) -> list[str]:
    """``--{flag}.model.load_in_4bit``: QLoRA on the DeepSpeed backend with bitsandbytes."""
    named = f"--{flag}.model.load_in_4bit"
    if "qlora" not in backend_of(role).features:
        return [f"{named} is built for the deepspeed backend; leave it out with {role.backend}"]
    if importlib.util.find_spec("bitsandbytes") is None:
        return [
            f"{named} needs bitsandbytes, which is not installed: pip install 'rlhf-cli[qlora]'"
        ]
    return []


def _liger_problems(role: RoleConfig, *, flag: str) -> list[str]:
    """``--{flag}.model.use_liger_kernel``: Triton kernels for CUDA, on the DeepSpeed backend,
    with liger-kernel installed."""
    named = f"--{flag}.model.use_liger_kernel"
    if not role.num_gpus_per_rank:
        return [
            f"{named} needs GPUs (--{flag}.num_gpus_per_rank > 0): Liger's kernels are "
            "Triton kernels for CUDA; leave it out on CPUs"
        ]
    if "liger" not in backend_of(role).features:
        return [f"{named} is built for the deepspeed backend; leave it out with {role.backend}"]
    if importlib.util.find_spec("liger_kernel") is None:
        return [f"{named} needs liger-kernel, which is not installed: pip install liger-kernel"]
    return []


def _context_parallel_problems(role: RoleConfig, *, flag: str) -> list[str]:
    """``--{flag}.ring_attn_size`` (or the backend's ``deepspeed.ring_attn_size`` /
    ``fsdp.cp_size``): one size, dividing the ranks, not with LoRA or the chunked lm_head."""
    from rlhf.learner.context_parallel import check_group_size

    own = backend_of(role).context_parallel_flag
    if len(role.context_parallel_sizes()) > 1:
        return [
            f"--{flag}.ring_attn_size {role.ring_attn_size} and --{flag}.{own} disagree; "
            "set one of them"
        ]
    cp = role.context_parallel
    if cp == 1:
        return []
    problems = []
    named = f"{flag}.ring_attn_size" if role.ring_attn_size > 1 else f"{flag}.{own}"
    try:
        check_group_size(cp, world_size=role.num_ranks, flag=named)
    except ValueError as exc:
        problems.append(str(exc))
    if role.model.lora_rank or role.model.chunked_lm_head:
        problems.append(
            f"--{named} with --{flag}.model.lora_rank or --{flag}.model.chunked_lm_head: "
            "not combined yet; set it to 1 for those"
        )
    return problems


def _deepspeed_problems(role: RoleConfig, *, flag: str) -> list[str]:
    """``--{flag}.deepspeed.tp_size`` (AutoTP) against the ranks, the ZeRO stage, LoRA, the
    chunked lm_head, context parallelism and the model's heads, and
    ``--{flag}.deepspeed.deepcompile`` against ranks without GPUs (DeepSpeed compiles on
    CUDA only)."""
    from rlhf.learner.tensor_parallel import tensor_parallel_problems

    ds = role.deepspeed
    problems = tensor_parallel_problems(
        deepspeed=ds, model=role.model, world_size=role.num_ranks, prefix=f"{flag}."
    ) + [f"--{p}" for p in ds.model_problems(role.model, prefix=f"{flag}.")]
    if ds.tp_size > 1 and role.ring_attn_size > 1:
        problems.append(
            f"--{flag}.deepspeed.tp_size {ds.tp_size} with --{flag}.ring_attn_size "
            f"{role.ring_attn_size}: not combined yet; set one of them to 1"
        )
    if role.num_ranks % ds.hpz_partition_size:
        problems.append(
            f"--{flag}.deepspeed.hpz_partition_size {ds.hpz_partition_size} must divide the "
            f"role's {role.num_ranks} ranks (ZeRO++ partitions the parameters within groups "
            "of that many ranks)"
        )
    if ds.deepcompile and not role.num_gpus_per_rank:
        problems.append(
            f"--{flag}.deepspeed.deepcompile needs GPUs (--{flag}.num_gpus_per_rank > 0): "
            "DeepSpeed runs DeepCompile on CUDA only; set it to False on CPUs"
        )
    return problems


def _tensor_parallel_problems(role: RoleConfig, *, flag: str) -> list[str]:
    """``--{flag}.fsdp.tp_size`` against the role's ranks and its model's heads (read from the
    model's config.json only; a missing model is reported by the model checks)."""
    from rlhf.molt import FSDPConfigError
    from rlhf.molt.tensor_parallel import check_tensor_parallel

    if role.fsdp.tp_size <= 1:
        return []
    model_config = None
    if role.model.path and (pathlib.Path(role.model.path) / "config.json").is_file():
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(role.model.path)
    try:
        check_tensor_parallel(
            model_config, tp_size=role.fsdp.tp_size, world_size=role.num_ranks, flag=f"{flag}.fsdp"
        )
    except FSDPConfigError as exc:
        return [str(exc)]
    return []
