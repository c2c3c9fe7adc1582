"""The DeepSpeed implementation of `rlhf.learner.Backend`.

ZeRO 0–3, optimizer/parameter CPU offload, bf16 with fp32 master weights, gradient clipping,
hybrid placement's state moves at ZeRO 1–3 (`offload_states`),
torch AdamW with the schedule of `rlhf.learner.optim` (no compiled extension is needed).
At float32 ZeRO-0 DeepSpeed steps that optimizer unwrapped and keeps no gradient norm, so the
backend clips and measures it there (`_owns_clipping`).

Gradient accumulation is caller-owned (DeepSpeed's ``managed_gradient_accumulation=false``):
one `train_micro_batches` call runs every micro-batch of this rank, then one optimizer step,
whatever the number of micro-batches. DeepSpeed averages gradients over data-parallel ranks, so
each share is multiplied by the world size: the gradient is then exactly that of the global
loss the objectives' normaliser defines. ZeRO-2/3 reduce inside every backward (and ZeRO-3 gathers
parameters inside every forward), so all ranks must run the same number of passes: a rank with
fewer micro-batches repeats its first one with weight 0.

Under ZeRO-3 the model is built under ``transformers.integrations.HfDeepSpeedConfig`` (wrapping
``from_pretrained`` in ``deepspeed.zero.Init`` fails with transformers 5.19).

``deepspeed.tp_size`` > 1 runs DeepSpeed's AutoTP training (`rlhf.learner.tensor_parallel`):
the ranks of one tensor-parallel group share a data-parallel coordinate (``dp_rank``) and run
the same micro-batches; DeepSpeed averages gradients over the ``dp_size`` replicas only, so the
``dp_size`` loss scale above stays exact. An eval-only role at tp_size > 1 gets an engine too
(ZeRO stage 0: nothing else to partition without an optimizer). Everything that reads the
weights (weight streaming, HF export, the fingerprint) sees them whole.

``deepspeed.deepcompile`` compiles a training engine with DeepCompile. DeepSpeed refuses
caller-owned accumulation with it, so such an engine runs DeepSpeed's managed accumulation
over one micro-batch: a step of several micro-batches per rank is refused (see
`check_compiled_passes`).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import pathlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from rlhf.learner import checkpoint as ckpt
from rlhf.learner import rank as shared
from rlhf.learner import state_codec
from rlhf.learner.backend import Objective
from rlhf.learner.batch import Batch
from rlhf.learner.build_locks import naming_build_locks
from rlhf.learner.config import DeepSpeedConfig, LearnerConfig
from rlhf.learner.context_parallel import check_group_size, shard_sequence
from rlhf.learner.export import write_hf_export
from rlhf.learner.forward import check_chunked_lm_head, check_packing
from rlhf.learner.models import fingerprint, load_model, merged_parameters
from rlhf.learner.muon import muon_arguments, muon_section
from rlhf.learner.optim import build_optimizer
from rlhf.learner.tensor_parallel import (
    ShardLayout,
    autotp_section,
    check_saved_tp_size,
    tensor_parallel_group,
    tensor_parallel_problems,
    write_saved_tp_size,
)
from rlhf.learner.zero3_offload import MASTER, MOMENTS, MasterOffload

_BUILD_LOCK_NOTICE_S = float(os.environ.get("RLHF_BUILD_LOCK_NOTICE_S", "120"))

T = TypeVar("T")


def init_distributed() -> None:
    """Join the process group described by RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, or make a
    single-process group when none is set (gloo on CPU, NCCL on GPUs)."""
    import deepspeed

    if torch.distributed.is_initialized():
        return
    alone = shared.default_process_env()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # On CPU this compiles DeepSpeed's shared-memory op on first use, behind a lock file.
    with naming_build_locks(after_s=_BUILD_LOCK_NOTICE_S):
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
    if alone:
        shared.leave_group_at_exit()


def ds_config(config: LearnerConfig, ds: DeepSpeedConfig) -> dict[str, Any]:
    """The DeepSpeed JSON config of a role on engine options ``ds`` (an eval-only role's under
    tensor parallelism at ZeRO stage 0: DeepSpeed's stages 1–2 need an optimizer)."""
    stage = 0 if ds.tp_size > 1 and config.optimizer is None else ds.zero_stage
    zero: dict[str, Any] = {"stage": stage}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if ds.overlap_comm is not None:
        zero["overlap_comm"] = ds.overlap_comm
    if ds.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
        zero["zero_hpz_partition_size"] = ds.hpz_partition_size
    opt = config.optimizer
    clip = 0.0 if opt is None or _owns_clipping(config, ds) else opt.grad_clip
    compiled = _compiled(config, ds)
    extra: dict[str, Any] = {}
    if ds.tp_size > 1:
        extra["tensor_parallel"] = autotp_section(ds.tp_size)
    if compiled:
        extra["compile"] = {"deepcompile": True}
    if ds.grad_accum_dtype is not None:
        extra["data_types"] = {"grad_accum_dtype": ds.grad_accum_dtype}
    if opt is not None and opt.name == "muon":
        extra["optimizer"] = muon_section(opt)
        if stage == 3:  # ZeRO-3 orthogonalises whole gradients: no reduce-scatter of them
            zero["reduce_scatter"] = False
    return {
        **extra,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": compiled,
        "gradient_clipping": clip,
        "zero_optimization": zero,
        "bf16": {"enabled": ds.bf16},
        "zero_allow_untested_optimizer": True,
        # A torch optimizer with offload (DeepSpeed's CPUAdam would need a compiled op).
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def _owns_clipping(config: LearnerConfig, ds: DeepSpeedConfig) -> bool:
    """Whether the backend, not DeepSpeed, clips the gradients and measures their norm: a
    float32 training role at ZeRO-0, where DeepSpeed steps the torch optimizer unwrapped and
    keeps no norm (its ``get_global_grad_norm`` stays None; see `_clip_zero0_gradients`)."""
    return config.optimizer is not None and ds.zero_stage == 0 and not ds.bf16


def _compiled(config: LearnerConfig, ds: DeepSpeedConfig) -> bool:
    """Whether the role's engine runs DeepCompile (training roles with the option)."""
    return ds.deepcompile and config.optimizer is not None


def check_deepcompile(config: LearnerConfig, ds: DeepSpeedConfig) -> None:
    """Raise ValueError naming ``--deepspeed.deepcompile`` when this process cannot run it."""
    if not _compiled(config, ds):
        return
    from deepspeed.compile.util import is_deepcompile_supported

    if not is_deepcompile_supported():
        raise ValueError(
            "--deepspeed.deepcompile needs a CUDA GPU (and torch >= 2.6): DeepSpeed runs "
            "DeepCompile on its cuda accelerator only, and this rank has "
            f"{'none' if not torch.cuda.is_available() else 'an unsupported torch'}; set it "
            "to False on CPUs"
        )


def check_compiled_passes(passes: int) -> None:
    """Raise ValueError naming ``--deepspeed.deepcompile`` for a step of more than one
    micro-batch per rank: on an H200 (DeepSpeed 0.19.8, torch 2.11, float32) three
    micro-batches accumulated under DeepCompile (``set_gradient_accumulation_boundary`` on
    the last) gave the uncompiled step's loss but a gradient norm of 3.39 against 4.32 at
    ZeRO-1 and 0 at ZeRO-2, and bf16 at ZeRO-1 aborted in DeepCompile's reduce buckets."""
    if passes > 1:
        raise ValueError(
            f"--deepspeed.deepcompile: this step runs {passes} micro-batches on a rank, and "
            "DeepSpeed's compiled ZeRO passes were measured to lose gradients accumulated over "
            "several micro-batches; give each rank one micro-batch per optimizer step (a "
            "larger micro-batch or token budget) or turn deepcompile off"
        )


class DeepSpeedBackend:
    """One rank of one role on DeepSpeed.

    Args:
        config: The role. ``config.optimizer`` None makes it eval-only (reference, reward).
        deepspeed: The engine's options (ZeRO stage, offload, bf16, the context- and
            tensor-parallel sizes, …): a role of this backend is built by
            ``functools.partial(DeepSpeedBackend, deepspeed=DeepSpeedConfig(...))``.
    """

    def __init__(self, config: LearnerConfig, *, deepspeed: DeepSpeedConfig | None = None) -> None:
        ds = deepspeed if deepspeed is not None else DeepSpeedConfig()
        problems = ds.model_problems(config.model)
        if problems:
            raise ValueError("; ".join(problems))
        import deepspeed as deepspeed_lib

        init_distributed()
        self.config, self.deepspeed = config, ds
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()
        cp, tp = ds.ring_attn_size, ds.tp_size
        check_group_size(cp, world_size=self.world_size, flag="deepspeed.ring_attn_size")
        if cp > 1 and (config.model.lora_rank or config.model.chunked_lm_head):
            raise ValueError(
                "deepspeed.ring_attn_size with model.lora_rank or model.chunked_lm_head: not "
                "combined yet; use ring_attn_size 1 for those"
            )
        problems = tensor_parallel_problems(
            deepspeed=ds, model=config.model, world_size=self.world_size
        )
        if problems:
            raise ValueError("; ".join(problems))
        check_deepcompile(config, ds)
        self.dp_size = self.world_size // (cp * tp)
        """Data-parallel replicas: the ranks / (``ring_attn_size`` × ``tp_size``) (a ring's
        or a tensor-parallel group's adjacent ranks run the same rows)."""
        self.dp_rank = self.rank // (cp * tp)
        self.device = shared.rank_device()
        torch.manual_seed(config.seed)
        self._ds_config = ds_config(config, ds)
        self._hf_ds: Any = None
        self._master_offload: MasterOffload | None = None  # ZeRO-3 `offload_states`
        self._compile_hooks: _CompileHooks | None = None  # DeepCompile's, removed at close
        if ds.zero_stage == 3:
            from transformers.integrations.deepspeed import HfDeepSpeedConfig

            self._hf_ds = HfDeepSpeedConfig(self._ds_config)  # must outlive the model build
        model = load_model(config.model)
        if cp > 1:
            ring, _ = torch.distributed.new_subgroups(group_size=cp)
            model = shard_sequence(model, group=ring, flag="deepspeed.ring_attn_size")
        self.engine: Any = None
        self.scheduler: Any = None
        self._zero0_grad_norm: float | None = None
        if config.optimizer is not None:
            optimizer: torch.optim.Optimizer | None = None
            if config.optimizer.name == "muon":  # DeepSpeed builds it (`rlhf.learner.muon`)
                arguments = muon_arguments(model, config.optimizer)
            else:
                optimizer, scheduler = build_optimizer(model, config.optimizer)
                arguments = {"optimizer": optimizer, "lr_scheduler": scheduler}
            # DeepSpeed annotates model_parameters as a Module and lr_scheduler as the
            # deprecated `_LRScheduler`; it takes parameter groups and any `LRScheduler`.
            self.engine, _, _, self.scheduler = deepspeed_lib.initialize(
                model=model, config=self._ds_config, **arguments
            )
            self.engine.checkpoint_engine = SafetensorsEngineFiles(self.engine.checkpoint_engine)
            if optimizer is not None and _owns_clipping(config, ds):
                optimizer.register_step_pre_hook(self._clip_zero0_gradients)
            self._module: torch.nn.Module = self.engine.module
            if _compiled(config, ds):
                self._compile_hooks = _CompileHooks()
                self.engine.compile()
        elif ds.zero_stage == 3 or tp > 1:
            self.engine, *_ = deepspeed_lib.initialize(model=model, config=self._ds_config)
            self._module = self.engine.module
        else:
            dtype = torch.bfloat16 if ds.bf16 else None
            self._module = model.to(device=self.device, dtype=dtype)
        self._module.eval()
        self._tp: ShardLayout | None = None
        """Which parameters are tensor-parallel shards (None at tp_size 1)."""
        if tp > 1:
            group = tensor_parallel_group(tp_size=tp, rank=self.rank)
            self._tp = ShardLayout.of(self._module, group=group)
        if config.model.packing_samples:
            check_packing(self._runner(), device=self.device, flag="model.packing_samples")
        if config.model.chunked_lm_head:
            check_chunked_lm_head(self._runner(), device=self.device, flag="model.chunked_lm_head")
        self._ema: dict[str, Tensor] | None = None
        if config.optimizer is not None and config.optimizer.ema_decay is not None:
            self._ema = shared.ema_init((n, _local(p)) for n, p in self._trainable())

    def _trainable(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return ((n, p) for n, p in self._module.named_parameters() if p.requires_grad)

    def _placed(self, batch: Batch) -> Batch:
        return shared.place(batch, self.config.model, self.device)

    def _passes(self, count: int) -> int:
        return shared.most_passes(count, world_size=self.world_size, device=self.device)

    @property
    def module(self) -> torch.nn.Module:
        """The unwrapped transformers model (parameters sharded under ZeRO-3)."""
        return self._module

    def _runner(self) -> torch.nn.Module:
        return self.engine if self.engine is not None else self._module

    # -- training ------------------------------------------------------------------------
    def train_micro_batches(
        self,
        micro_batches: Sequence[Batch],
        objective: Objective,
        *,
        weights: Sequence[float] | None = None,
    ) -> dict[str, float]:
        """See `Backend.train_micro_batches`. ``weights`` (default 1 each) scale micro-batches;
        a driver pads ranks with weight-0 copies where it has to."""
        if self.engine is None or self.config.optimizer is None:
            raise RuntimeError("this role is eval-only (no optimizer); it cannot train")
        if not micro_batches:
            raise ValueError("train_micro_batches needs at least one micro-batch on every rank")
        engine = self.engine
        engine.train()
        passes = self._passes(len(micro_batches))
        if _compiled(self.config, self.deepspeed):
            check_compiled_passes(passes)
        out = shared.train_passes(
            micro_batches,
            objective,
            runner=engine,
            passes=passes,
            weights=weights,
            placed=self._placed,
            backward=lambda loss, w: engine.backward(
                loss * (w * self.dp_size), scale_wrt_gas=False
            ),
        )
        self._zero0_grad_norm = None
        engine.step()
        decay = self.config.optimizer.ema_decay
        if self._ema is not None and decay is not None:
            shared.ema_update(self._ema, ((n, _local(p)) for n, p in self._trainable()), decay)
        norm = (
            self._zero0_grad_norm
            if _owns_clipping(self.config, self.deepspeed)
            else self.engine.get_global_grad_norm()
        )
        out["grad_norm"] = float(norm) if norm is not None else float("nan")
        lrs = self.engine.get_lr()
        out["lr"] = float(lrs[0])  # under Muon its half's (DeepSpeed puts it first)
        if self.config.optimizer.name == "muon":
            out["lr_adamw"] = float(lrs[-1])  # the AdamW half's
        self._module.eval()
        return out

    def _clip_zero0_gradients(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The torch optimizer's step pre-hook at float32 ZeRO-0 (`_owns_clipping`): the
        gradients are all-reduced by then; clip them to ``optimizer.grad_clip`` (0: measure
        only) with DeepSpeed's ``clip_grad_norm_`` (what its engine runs at this stage, model
        parallel aware through the engine's ``mpu``) and keep the norm before clipping."""
        from deepspeed.runtime.utils import clip_grad_norm_

        assert self.config.optimizer is not None
        max_norm = self.config.optimizer.grad_clip or math.inf
        engine = self.engine
        norm = clip_grad_norm_(engine.module.parameters(), max_norm, mpu=engine.mpu)
        self._zero0_grad_norm = float(norm)

    def forward_micro_batches(
        self, micro_batches: Sequence[Batch], fn: Callable[[torch.nn.Module, Batch], T]
    ) -> list[T]:
        """``fn(model, batch)`` per micro-batch, no gradient, eval mode; results on the CPU."""
        if not micro_batches:
            raise ValueError("forward_micro_batches needs at least one micro-batch on every rank")
        self._module.eval()
        return shared.forward_passes(
            micro_batches,
            fn,
            runner=self._runner(),
            passes=self._passes(len(micro_batches)),
            placed=self._placed,
        )

    # -- hybrid placement: states off the GPU while colocated engines generate ----------
    def offload_states(self, *, weights: bool = True) -> dict[str, float]:
        """Move this rank's optimizer states, fp32 master weights and gradient partitions
        (with ``weights`` also the bf16/fp32 model weights) to host memory (pinned on CUDA),
        so colocated vLLM engines can use the GPU; `reload_states` brings them back before
        the next forward. ZeRO-1/2 move through DeepSpeed's ``offload_states``; ZeRO-3 moves
        its partitions and buffers there too, and its master weights and Adam moments through
        `rlhf.learner.zero3_offload` (DeepSpeed moves those only under its compiled FusedAdam).
        On a CPU rank the states stay in host memory while their storage is re-linked as on
        a GPU. Idempotent per state.

        Returns:
            ``allocated_gib_before`` / ``allocated_gib_after``: this process's CUDA
            allocations (0 on CPU).
        """
        from deepspeed.runtime.zero.offload_config import (
            OffloadDeviceEnum,
            OffloadStateTypeEnum,
        )

        engine = self._offloadable()
        pin = self.device.type == "cuda"
        moved_here = set() if self._master_offload is None else {MASTER, MOMENTS}
        include = [
            s
            for s in OffloadStateTypeEnum
            if (weights or s != OffloadStateTypeEnum.lp_params) and s.value not in moved_here
        ]
        before = shared.allocated_gib(self.device)
        engine.offload_states(include=include, device=OffloadDeviceEnum.cpu, pin_memory=pin)
        if self._master_offload is not None:
            self._master_offload.offload(device=self.device, pin_memory=pin)
            if pin:
                torch.cuda.empty_cache()  # the moved storage's blocks, for the engines
        return {
            "allocated_gib_before": before,
            "allocated_gib_after": shared.allocated_gib(self.device),
        }

    def reload_states(self) -> dict[str, float]:
        """Undo `offload_states` (every state it moved); same return value."""
        engine = self._offloadable()
        before = shared.allocated_gib(self.device)
        engine.reload_states()
        if self._master_offload is not None:
            self._master_offload.reload()
        return {
            "allocated_gib_before": before,
            "allocated_gib_after": shared.allocated_gib(self.device),
        }

    def offloaded_states(self) -> list[str]:
        """Names of the states now off the device (DeepSpeed's ``OffloadStateTypeEnum``)."""
        names = {s.value for s in self._offloadable().optimizer.offloaded_states}
        if self._master_offload is not None:
            names |= self._master_offload.offloaded
        return sorted(names)

    def _offloadable(self) -> Any:
        ds = self.deepspeed
        if self.engine is None or self.config.optimizer is None:
            raise RuntimeError(
                "offload_states needs a training role (an optimizer); an eval-only role keeps "
                "its weights or offloads them with deepspeed.offload_params under ZeRO-3"
            )
        if ds.zero_stage == 0:
            raise RuntimeError(
                "offload_states needs deepspeed.zero_stage 1, 2 or 3 (got 0): ZeRO-0 keeps no "
                "partitions for DeepSpeed to move"
            )
        if ds.zero_stage == 3 and self._master_offload is None:
            self._master_offload = MasterOffload(self.engine.optimizer)
        return self.engine

    # -- checkpoints and export ----------------------------------------------------------
    def fingerprint(self) -> dict[str, list[int]]:
        """Parameter names → full shapes (whole also where tensor parallelism splits them)."""
        shapes = fingerprint(self._module)
        if self._tp is not None:
            params = dict(self._module.named_parameters())
            shapes = {n: self._tp.full_shape(n, params[n].shape) for n in shapes}
        return shapes

    def save_checkpoint(self, directory: str, *, client_state: Mapping[str, object]) -> None:
        """Write engine state (model, optimizer, scheduler) and this rank's RNG states."""
        if self.engine is None or self.config.optimizer is None:
            return  # an eval-only role is rebuilt from its model path
        # A 4-bit base (QLoRA) is frozen and reloads from the model path: only the trained
        # parameters go into the checkpoint (bitsandbytes' quantisation state would not load).
        frozen_base = self.config.model.load_in_4bit
        self.engine.save_checkpoint(
            str(pathlib.Path(directory) / "backend"),
            tag="state",
            client_state=dict(client_state),
            exclude_frozen_parameters=frozen_base,
        )
        if self.rank == 0:
            write_saved_tp_size(directory, tp_size=self.deepspeed.tp_size)
        ckpt.write_rank_rng(directory, self.rank)
        if self._ema is not None:
            shared.save_ema(directory, self.rank, self._ema)

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        """Validate ``directory`` against this model, then restore everything
        `save_checkpoint` wrote; returns the driver's trainer state."""
        state = ckpt.validate(directory, self.fingerprint())
        if self.engine is None or self.config.optimizer is None:
            return state
        check_saved_tp_size(directory, tp_size=self.deepspeed.tp_size)
        path, _ = self.engine.load_checkpoint(
            str(pathlib.Path(directory) / "backend"),
            tag="state",
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
            # Without the frozen 4-bit base (see save_checkpoint); the fingerprint above has
            # checked every name and shape.
            load_module_strict=not self.config.model.load_in_4bit,
        )
        if path is None:
            raise ckpt.CheckpointError(f"DeepSpeed found no engine state in {directory}/backend")
        ckpt.restore_rank_rng(directory, self.rank)
        if self._ema is not None:
            self._ema = shared.load_ema(directory, self.rank)
        return state

    def named_full_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """Each parameter unsharded (gathered one at a time under ZeRO-3 and over the
        tensor-parallel group), in checkpoint names, LoRA adapters merged; a yielded tensor is
        valid until the next is requested."""
        if self._tp is not None:
            layout = self._tp
            for name, param in self._module.named_parameters():
                yield name, layout.full(name, param.detach())
            return
        gather = None
        if self.deepspeed.zero_stage == 3 and self.engine is not None:
            import deepspeed

            gather = functools.partial(deepspeed.zero.GatheredParameters, modifier_rank=None)
        yield from merged_parameters(self._module, gather)

    def state_dict_on_rank0(self, *, ema: bool = False) -> dict[str, Tensor] | None:
        """The full model state (or its EMA) on the CPU at rank 0 (None elsewhere); all ranks
        call it."""
        swapped = shared.ema_swapped(self._ema, self._trainable, local=_local, release=_release)
        with swapped if ema else contextlib.nullcontext():
            return shared.gather_on_rank0(self.named_full_parameters(), self.rank)

    def export_hf(self, directory: str, *, ema: bool = False) -> None:
        """A transformers checkpoint of the full model (its EMA with ``ema``) plus the
        source's tokenizer files, written to a staging directory and moved into place (rank
        0); all ranks call it."""
        state = self.state_dict_on_rank0(ema=ema)
        if state is not None:
            write_hf_export(self._module, state, source=self.config.model.path, directory=directory)

    def close(self) -> None:
        """Release the engine (the process group stays). Under ZeRO-3 this also ends
        transformers' global ZeRO-3 mode, so the next model builds unpartitioned."""
        self.engine = None
        self._module = None  # type: ignore[assignment]
        if self._compile_hooks is not None:
            self._compile_hooks.remove_new()
            self._compile_hooks = None
        if self._hf_ds is not None:
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            self._hf_ds = None
            unset_hf_deepspeed_config()
        gc.collect()


class _CompileHooks:
    """DeepCompile's backward hooks registered after this point, for removal when the engine
    that registered them is released. DeepSpeed keeps them in module-global lists
    (``deepspeed.compile.util.pre_backward_hooks`` / ``post_backward_hooks``) and never
    removes them, so a later compiled engine in the same process (a rebuilt role, a warm rank
    process reused by the next run) would also run the released engine's hooks against its
    own optimizer (probed on an H100: ZeRO-1 then ZeRO-3 in one process fails in the first
    backward with ``IndexError: unordered_map::at``). A rank process holds one engine at a
    time (`RankWorker.build` closes the old one first)."""

    def __init__(self) -> None:
        from deepspeed.compile import util

        self._lists = (util.pre_backward_hooks, util.post_backward_hooks)
        self._before = [list(hooks) for hooks in self._lists]

    def remove_new(self) -> None:
        for hooks, before in zip(self._lists, self._before, strict=True):
            hooks[:] = [h for h in hooks if any(h is b for b in before)]


def _local(param: torch.nn.Parameter) -> Tensor:
    """This rank's stored values of ``param``: its ZeRO-3 shard (kept current by the
    optimizer, also for small parameters that ZeRO-3 keeps gathered), else the parameter."""
    shard = getattr(param, "ds_tensor", None)
    return shard if shard is not None else param.data


def _release(param: torch.nn.Parameter) -> None:
    """Drop a ZeRO-3 parameter's gathered copy, so the next gather reads its shard."""
    if getattr(param, "ds_tensor", None) is not None and param.data.numel():
        zero3_param: Any = param  # DeepSpeed's ZeRO-3 attaches partition() to the parameter
        zero3_param.partition()


class SafetensorsEngineFiles:
    """DeepSpeed's checkpoint engine writing each of its state files (under DeepSpeed's own
    file names) as safetensors with a JSON skeleton (`rlhf.learner.state_codec`) instead of a
    pickle, and reading them back without unpickling: a checkpoint from elsewhere cannot run
    code on load. Everything else is the wrapped engine's."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def save(self, state_dict: Any, path: str) -> None:
        tensors, skeleton = state_codec.encode(state_dict, allowed=deepspeed_state_classes())
        ckpt.save_tensors(path, tensors, meta=skeleton)

    def load(self, path: str, map_location: Any = None) -> Any:
        """The state saved at ``path``, its tensors on the CPU (DeepSpeed copies them into
        place; ``map_location`` is not needed for that)."""
        what = "DeepSpeed engine state"
        tensors, skeleton = ckpt.load_tensors(path, what=what)
        try:
            return state_codec.decode(skeleton, tensors, allowed=deepspeed_state_classes())
        except state_codec.StateCodecError as exc:
            raise ckpt.CheckpointError(
                f"{path} ({what}) does not decode: {exc}; it is corrupt or was not written by "
                "this framework (nothing in it was executed)"
            ) from None


def deepspeed_state_classes() -> list[Any]:
    """The data classes DeepSpeed's own engine and ZeRO states hold (a loss scaler's settings,
    the ZeRO stage enum, fragment addresses): rebuilt from their fields, no code of theirs
    runs on load."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]
