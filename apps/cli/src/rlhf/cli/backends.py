"""The learner backends a role can run on (``--<role>.backend``), by name.

Each backend's package declares its entry (`rlhf.learner.backend_entry.BackendEntry`:
`rlhf.learner.deepspeed_entry.DeepSpeedEntry`, `rlhf.molt.entry.MoltEntry`): how a role's
settings build on it (the factory `rlhf.learner.LearnerGroup.build` calls in every rank's
process), split (tensor and context parallel), compile, offload, plan and fail. `BACKENDS`
registers them; the CLI asks a role's entry through `backend_of` instead of comparing names,
and adds what is the same for every backend (PEFT, Liger, QLoRA, context parallelism, options
of another backend given to this one).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlhf.learner.backend_entry import BackendEntry, RoleTopology
from rlhf.learner.deepspeed_entry import DeepSpeedEntry
from rlhf.molt.entry import MoltEntry

if TYPE_CHECKING:
    from rlhf.cli.sections import RoleConfig
    from rlhf.learner import BackendFactory
    from rlhf.learner.capacity import LearnerLoad, Memory


BACKENDS: dict[str, BackendEntry[Any]] = {b.name: b for b in (DeepSpeedEntry(), MoltEntry())}
"""``--<role>.backend`` values: DeepSpeed ZeRO 0–3 (`rlhf.learner.DeepSpeedBackend`) or FSDP2
(`rlhf.molt.FSDPBackend`)."""


@dataclass(frozen=True)
class RoleBackend:
    """A role's backend entry bound to the role: each question asked with the role's own
    options (its ``entry.options_field`` section)."""

    entry: BackendEntry[Any]
    role: RoleConfig

    @property
    def options(self) -> Any:
        return getattr(self.role, self.entry.options_field)

    @property
    def features(self) -> frozenset[str]:
        return self.entry.features

    @property
    def context_parallel_flag(self) -> str:
        return self.entry.context_parallel_flag

    def factory(self) -> BackendFactory:
        return self.entry.factory(self.options, context_parallel=self.role.context_parallel)

    def tensor_parallel(self) -> int:
        return self.entry.tensor_parallel(self.options)

    def own_context_parallel(self) -> int:
        return self.entry.own_context_parallel(self.options)

    def compiles(self) -> bool:
        return self.entry.compiles(self.options)

    def compute_bytes(self) -> int:
        return self.entry.compute_bytes(self.options, self.role.model)

    def offloadable(self) -> bool:
        return self.entry.offloadable(self.options)

    def describe(self) -> str:
        r = self.role
        return self.entry.describe(
            self.options, num_ranks=r.num_ranks, context_parallel=r.context_parallel
        )

    def memory(self, load: LearnerLoad) -> Memory:
        return self.entry.memory(self.options, load)

    def problems(self, *, flag: str) -> list[str]:
        r = self.role
        topology = RoleTopology(
            model=r.model,
            num_ranks=r.num_ranks,
            gpus_per_rank=r.num_gpus_per_rank,
            ring_attn_size=r.ring_attn_size,
            context_parallel=r.context_parallel,
            optimizer=r.optimizer,
        )
        return self.entry.problems(self.options, topology, flag=flag)


def backend_of(role: RoleConfig) -> RoleBackend:
    """``role``'s backend entry, bound to it. A name not in `BACKENDS` is refused by
    `role_problems`; until then it reads as ``deepspeed``, the default."""
    return RoleBackend(BACKENDS.get(role.backend, BACKENDS["deepspeed"]), role)


def backend_factory(role: RoleConfig) -> BackendFactory:
    """The `rlhf.learner.BackendFactory` of ``role`` (validated: see `role_problems`)."""
    return RoleBackend(BACKENDS[role.backend], role).factory()


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
    compiles = gpu or backend_of(role).compiles()
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
    problems += _unread_options_problems(role, flag=flag)
    return problems + backend_of(role).problems(flag=flag)


def _unread_options_problems(role: RoleConfig, *, flag: str) -> list[str]:
    """Options of another backend (``--{flag}.fsdp.*`` on deepspeed, ``--{flag}.deepspeed.*``
    on molt) set away from their defaults: the role's backend never reads them."""
    mine = backend_of(role).entry
    problems = []
    for other in BACKENDS.values():
        if other.options_field == mine.options_field:
            continue
        options = getattr(role, other.options_field, None)
        if options is None:
            continue
        default = type(options)()
        given = [
            f"--{flag}.{other.options_field}.{f.name}"
            for f in dataclasses.fields(options)
            if getattr(options, f.name) != getattr(default, f.name)
        ]
        if given:
            problems.append(
                f"{', '.join(given)} configure the {other.name} backend, and --{flag}.backend "
                f"is {mine.name}, which does not read them: add --{flag}.backend {other.name}, "
                f"or drop them ({mine.name}'s own options are --{flag}.{mine.options_field}.*)"
            )
    return problems


def _qlora_problems(role: RoleConfig, *, flag: str) -> list[str]:
    """``--{flag}.model.load_in_4bit``: QLoRA on the DeepSpeed backend with bitsandbytes."""
    named = f"--{flag}.model.load_in_4bit"
    if not role.model.lora_rank:
        return [
            f"{named} freezes the base in 4 bits, so the role trains LoRA adapters on it "
            f"(QLoRA): set --{flag}.model.lora_rank > 0 too (OpenRLHF: --ds.lora.rank)"
        ]
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
