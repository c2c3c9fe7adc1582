"""The FSDP2 implementation of `rlhf.learner.Backend` (data, tensor and context parallel).

The role's ranks form a (dp, tp) mesh, tensor-parallel peers adjacent (ranks ``2k, 2k+1`` at
``tp_size`` 2): with ``tp_size`` > 1 the model is first split by its own plan
(`rlhf.molt.tensor_parallel`), then sharded over ``dp``; tensor-parallel peers run the same
rows (the driver deals micro-batches per data-parallel coordinate, `dp_rank`). With
``cp_size`` > 1 (and ``tp_size`` 1) adjacent ranks split each row's sequence instead
(`rlhf.learner.context_parallel`) and FSDP2 shards over all ranks.

Each decoder layer (the classes a transformers model names in ``_no_split_modules``) is one
FSDP2 unit, the rest of the model the root unit: a rank holds 1/dp of every parameter,
gradient and AdamW state it keeps (float32 masters; ``param_dtype`` is what a forward computes
with, gradients are reduced in float32). The semantics are the DeepSpeed backend's, so the two
are interchangeable step for step:

- one `train_micro_batches` call runs every micro-batch of this rank, then one optimizer step;
  FSDP2 averages gradients over the data-parallel ranks, so each share is multiplied by
  ``dp_size`` and the gradient is that of the global loss the objectives' normaliser defines;
- every forward gathers and every backward reduces collectively, so all ranks run the same
  number of passes: a rank with fewer micro-batches repeats its first one with weight 0;
- the gradient norm is taken over the whole model before clipping (no clipping at
  ``grad_clip`` 0; one norm per mesh, combined), then AdamW and the schedule of
  `rlhf.learner.optim` step.

Checkpoints are torch.distributed.checkpoint (DCP) directories in the shared checkpoint layout
(``backend/`` beside the metadata `rlhf.learner.checkpoint` writes), the schedule as JSON, the
RNG per rank; exports and weight streams gather one parameter at a time (``full_tensor``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import pathlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

# Submodules, not the package's namespace: rlhf.learner also offers the DeepSpeed backend.
from rlhf.learner import checkpoint as ckpt
from rlhf.learner import rank as shared
from rlhf.learner.backend import Objective
from rlhf.learner.batch import Batch
from rlhf.learner.checkpoint import CheckpointError
from rlhf.learner.config import LearnerConfig
from rlhf.learner.context_parallel import shard_sequence
from rlhf.learner.export import write_hf_export
from rlhf.learner.forward import (
    FORWARD_WITH_HEAD,
    check_chunked_lm_head,
    check_packing,
    lm_head_parts,
)
from rlhf.learner.models import fingerprint, load_model, merged_parameters
from rlhf.learner.muon import build_muon
from rlhf.learner.optim import build_optimizer
from rlhf.molt.config import FSDPConfig, FSDPConfigError, check_context_parallel
from rlhf.molt.loading import build_on_meta, materialize_and_load, sharded_loading_refused
from rlhf.molt.offload import HostAdamW
from rlhf.molt.tensor_parallel import check_tensor_parallel, grad_norm_and_clip, parallelize

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_SCHEDULE_FILE = "schedule.json"

T = TypeVar("T")


def init_distributed() -> None:
    """Join the process group that RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT describe, or make a
    single-process one when none is set (gloo on CPU, NCCL on GPUs)."""
    if torch.distributed.is_initialized():
        return
    alone = shared.default_process_env()
    torch.distributed.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    if alone:
        shared.leave_group_at_exit()


def _local(tensor: Tensor) -> Tensor:
    """This rank's shard of a DTensor, else the tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _full(tensor: Tensor) -> Tensor:
    """The whole tensor of a DTensor (a collective), else the tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _offer_forward_with_head(model: torch.nn.Module) -> None:
    """Give the root FSDP2 module ``forward_with_head(fn)`` → ``fn(body, lm_head)``, registered
    as a forward: the root's parameters (embedding, final norm, lm_head) are gathered while it
    runs and their gradients reduced after its backward, as for ``model(...)``. The chunked
    lm_head path of `rlhf.learner.forward.token_logprobs` runs through it."""
    import types

    from torch.distributed.fsdp import register_fsdp_forward_method

    def forward_with_head(self: torch.nn.Module, fn: Any) -> Any:
        return fn(*lm_head_parts(self))

    setattr(model, FORWARD_WITH_HEAD, types.MethodType(forward_with_head, model))
    register_fsdp_forward_method(model, FORWARD_WITH_HEAD)


def _layer_classes(model: torch.nn.Module) -> set[str]:
    """The decoder-layer classes a transformers model names (its ``_no_split_modules``)."""
    get_base_model = getattr(model, "get_base_model", None)
    base = get_base_model() if callable(get_base_model) else model
    return set(getattr(base, "_no_split_modules", None) or ())


class FSDPBackend:
    """One rank of one role on FSDP2.

    Args:
        config: The role. ``config.optimizer`` None makes it eval-only (reference, reward).
        fsdp: Sharding options (`FSDPConfig`; validated here).

    ``rank``/``world_size`` are the process coordinates in the role's group, ``dp_rank``/
    ``dp_size`` the data-parallel ones (``world_size / tp_size`` replicas).
    """

    def __init__(self, config: LearnerConfig, fsdp: FSDPConfig | None = None) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        self.fsdp = (fsdp or FSDPConfig()).validate()
        if config.model.lora_rank and self.fsdp.tp_size > 1:
            raise FSDPConfigError(
                "--fsdp.tp_size with model.lora_rank: LoRA adapters are not split over "
                "tensor-parallel ranks yet; use tp_size 1 (data parallel) for LoRA"
            )
        if self.fsdp.cp_size > 1 and (config.model.lora_rank or config.model.chunked_lm_head):
            raise FSDPConfigError(
                "--fsdp.cp_size with model.lora_rank or model.chunked_lm_head: not combined "
                "yet; use cp_size 1 for LoRA and the chunked lm_head"
            )
        if config.model.chunked_lm_head and self.fsdp.tp_size > 1:
            raise FSDPConfigError(
                "--fsdp.tp_size with model.chunked_lm_head: the chunked head reads the lm_head "
                "whole, which tensor parallelism splits by vocabulary; use one of the two"
            )
        init_distributed()
        self.config = config
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()
        self.device = shared.rank_device()
        torch.manual_seed(config.seed)
        compute = _DTYPES[self.fsdp.param_dtype]
        # A training role keeps float32 masters (forwards compute in param_dtype); an eval-only
        # role holds its weights in param_dtype.
        dtype = torch.float32 if config.optimizer is not None else compute
        # Fully offloaded shards live on the host; FSDP2 gathers them onto the device.
        shard_device = torch.device("cpu") if self.fsdp.offload == "full" else self.device
        refused = sharded_loading_refused(config.model)
        model = None if refused else build_on_meta(config.model, dtype=dtype)
        self.loading = "sharded" if model is not None else "whole"
        """How the weights were read: ``sharded`` (meta-device build, each rank reads its
        slices) or ``whole`` (the full model in every rank's memory, then sharded)."""
        if model is None:
            model = load_model(config.model).to(shard_device, dtype=dtype)
        tp, cp = self.fsdp.tp_size, self.fsdp.cp_size
        check_tensor_parallel(model.config, tp_size=tp, world_size=self.world_size, flag="fsdp")
        check_context_parallel(cp_size=cp, world_size=self.world_size, flag="fsdp")
        self.dp_size = self.world_size // (tp * cp)
        self.dp_rank = self.rank // (tp * cp)
        if cp > 1:  # tp is 1 (validated): FSDP over every rank, the ring over cp neighbours
            groups = init_device_mesh(
                self.device.type, (self.dp_size, cp), mesh_dim_names=("dp", "cp")
            )
            model = shard_sequence(model, group=groups["cp"].get_group(), flag="fsdp.cp_size")
            mesh = init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("dp",))
        else:
            mesh = init_device_mesh(
                self.device.type, (self.dp_size, tp), mesh_dim_names=("dp", "tp")
            )
        if tp > 1:
            model = parallelize(
                model, mesh["tp"], flag="fsdp", sequence_parallel=self.fsdp.sequence_parallel
            )
        policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
        options = {
            "mesh": mesh["dp"],
            "mp_policy": policy,
            "reshard_after_forward": self.fsdp.reshard_after_forward,
        }
        if self.fsdp.offload == "full":
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        layers = [m for m in model.modules() if type(m).__name__ in _layer_classes(model)]
        for module in layers:
            fully_shard(module, **options)
        fully_shard(model, **options)
        if self.fsdp.compile:
            for module in layers:
                module.compile()
        if self.loading == "sharded":
            materialize_and_load(
                model, path=config.model.path, device=shard_device, buffers_on=self.device
            )
        elif shard_device != self.device:  # fully offloaded: buffers still compute on device
            for module in model.modules():
                for name, buffer in module._buffers.items():
                    if buffer is not None:
                        module._buffers[name] = buffer.to(self.device)
        self._module: torch.nn.Module = model
        self.optimizer: Any = None
        self.scheduler: Any = None
        if config.optimizer is not None and self.fsdp.offload == "optimizer":
            self.optimizer = HostAdamW(list(self._trainable()), config.optimizer)
            self.scheduler = self.optimizer.scheduler
        elif config.optimizer is not None:
            build = build_muon if config.optimizer.name == "muon" else build_optimizer
            self.optimizer, self.scheduler = build(model, config.optimizer)
        model.eval()
        if config.model.chunked_lm_head:
            _offer_forward_with_head(model)
            check_chunked_lm_head(model, device=self.device, flag="model.chunked_lm_head")
        if config.model.packing_samples:
            check_packing(model, device=self.device, flag="model.packing_samples")
        self._offloaded: set[str] = set()  # states offload_states moved to the host
        self._ema: dict[str, Tensor] | None = None
        if config.optimizer is not None and config.optimizer.ema_decay is not None:
            self._ema = shared.ema_init((n, _local(p)) for n, p in self._trainable())

    def _trainable(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return ((n, p) for n, p in self._module.named_parameters() if p.requires_grad)

    @property
    def module(self) -> torch.nn.Module:
        """The transformers model, its parameters DTensors sharded over the ranks."""
        return self._module

    def _placed(self, batch: Batch) -> Batch:
        return shared.place(batch, self.config.model, self.device)

    def _passes(self, count: int) -> int:
        return shared.most_passes(count, world_size=self.world_size, device=self.device)

    # -- training ------------------------------------------------------------------------
    def train_micro_batches(
        self,
        micro_batches: Sequence[Batch],
        objective: Objective,
        *,
        weights: Sequence[float] | None = None,
    ) -> dict[str, float]:
        """See `rlhf.learner.Backend.train_micro_batches`."""
        if self.optimizer is None or self.config.optimizer is None:
            raise RuntimeError("this role is eval-only (no optimizer); it cannot train")
        if not micro_batches:
            raise ValueError("train_micro_batches needs at least one micro-batch on every rank")
        self._module.train()
        out = shared.train_passes(
            micro_batches,
            objective,
            runner=self._module,
            passes=self._passes(len(micro_batches)),
            weights=weights,
            placed=self._placed,
            backward=lambda loss, w: (loss * (w * self.dp_size)).backward(),
        )
        norm = grad_norm_and_clip(
            (p for _, p in self._trainable()), self.config.optimizer.grad_clip
        )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        decay = self.config.optimizer.ema_decay
        if self._ema is not None and decay is not None:
            shared.ema_update(self._ema, ((n, _local(p)) for n, p in self._trainable()), decay)
        out["grad_norm"] = float(norm)
        out["lr"] = float(self.optimizer.param_groups[0]["lr"])  # Muon's half's under Muon
        if self.config.optimizer.name == "muon":
            out["lr_adamw"] = float(self.optimizer.param_groups[-1]["lr"])
        self._module.eval()
        return out

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
            runner=self._module,
            passes=self._passes(len(micro_batches)),
            placed=self._placed,
        )

    # -- hybrid placement ----------------------------------------------------------------
    def offload_states(self, *, weights: bool = True) -> dict[str, float]:
        """Move this rank's AdamW moments (and with ``weights`` its parameter shards) to host
        memory, so colocated vLLM engines can use the device; `reload_states` brings them
        back before the next forward. What already lives on the host stays (the optimizer
        under ``offload optimizer``, everything under ``offload full``); gradients are
        already freed after each step. Idempotent per state.

        Returns:
            ``allocated_gib_before`` / ``allocated_gib_after``: this process's CUDA
            allocations (0 on CPU).
        """
        if self.optimizer is None:
            raise RuntimeError(
                "offload_states needs a training role (an optimizer); an eval-only role keeps "
                "its weights"
            )
        before = shared.allocated_gib(self.device)
        on_device = self.fsdp.offload == "none"  # the optimizer state; the weights unless full
        if on_device and "optimizer" not in self._offloaded:
            self._move_optimizer_state(torch.device("cpu"))
            self._offloaded.add("optimizer")
        if weights and "weights" not in self._offloaded and self.fsdp.offload != "full":
            self._module.to("cpu")
            self._offloaded.add("weights")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return {
            "allocated_gib_before": before,
            "allocated_gib_after": shared.allocated_gib(self.device),
        }

    def reload_states(self) -> dict[str, float]:
        """Undo `offload_states` (every state it moved); same return value."""
        before = shared.allocated_gib(self.device)
        if "weights" in self._offloaded:
            self._module.to(self.device)
        if "optimizer" in self._offloaded:
            self._move_optimizer_state(self.device)
        self._offloaded.clear()
        return {
            "allocated_gib_before": before,
            "allocated_gib_after": shared.allocated_gib(self.device),
        }

    def offloaded_states(self) -> list[str]:
        """The states now off the device (``optimizer``, ``weights``)."""
        return sorted(self._offloaded)

    def _move_optimizer_state(self, device: torch.device) -> None:
        for state in self.optimizer.state.values():
            for key, value in state.items():
                # AdamW's step counters live on the host already.
                if isinstance(value, Tensor) and key != "step":
                    state[key] = value.to(device)

    # -- checkpoints and export ----------------------------------------------------------
    def fingerprint(self) -> dict[str, list[int]]:
        """Parameter names → full shapes (a DTensor's shape is the global one)."""
        return fingerprint(self._module)

    def _dcp_state(self, *, to_load: bool = False) -> dict[str, Any]:
        """The DCP state: model and optimizer shards in `get_state_dict`'s layout (also with
        the optimizer on the host; ``to_load``: the parts a load fills)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if isinstance(self.optimizer, HostAdamW):
            host = self.optimizer
            optim = host.empty_state() if to_load else host.state_dict()
            return {"model": get_model_state_dict(self._module), "optim": optim}
        model, optim = get_state_dict(self._module, self.optimizer)
        return {"model": model, "optim": optim}

    def save_checkpoint(self, directory: str, *, client_state: Mapping[str, object]) -> None:
        """Write the DCP state (model and optimizer shards), the schedule and this rank's RNG
        (all ranks call it)."""
        from rlhf.molt import dcp_files

        if self.optimizer is None:
            return  # an eval-only role is rebuilt from its model path
        backend = pathlib.Path(directory) / "backend"
        dcp_files.save(self._dcp_state(), directory=str(backend))
        if self.rank == 0:  # the driver's client_state goes to trainer_state.json (finalize)
            schedule = {"scheduler": self.scheduler.state_dict()}
            (backend / _SCHEDULE_FILE).write_text(json.dumps(schedule))
        ckpt.write_rank_rng(directory, self.rank)
        if self._ema is not None:
            shared.save_ema(directory, self.rank, self._ema)

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        """Validate ``directory`` against this model, then restore everything
        `save_checkpoint` wrote; returns the driver's trainer state."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        from rlhf.molt import dcp_files

        state = ckpt.validate(directory, self.fingerprint())
        if self.optimizer is None:
            return state
        backend = pathlib.Path(directory) / "backend"
        if (backend / ".metadata").is_file() and not (backend / dcp_files.METADATA_FILE).exists():
            raise CheckpointError(
                f"checkpoint {directory} holds DCP state in torch's pickle format (backend/"
                ".metadata), which this version does not read: a checkpoint from elsewhere "
                "could run code on load. Resume only from checkpoints this project wrote"
            )
        if (
            not (backend / dcp_files.METADATA_FILE).is_file()
            or not (backend / _SCHEDULE_FILE).is_file()
        ):
            raise CheckpointError(
                f"checkpoint {directory} holds no FSDP (DCP) state in backend/: it was written "
                "by another backend (resume it with that backend, e.g. --actor.backend "
                "deepspeed) or is incomplete"
            )
        loaded = self._dcp_state(to_load=True)
        dcp_files.load(loaded, directory=str(backend))
        schedule = json.loads((backend / _SCHEDULE_FILE).read_text())
        if isinstance(self.optimizer, HostAdamW):
            set_model_state_dict(self._module, loaded["model"])
            self.scheduler.load_state_dict(schedule["scheduler"])
            self.optimizer.load(loaded["optim"])
        else:
            set_state_dict(
                self._module,
                self.optimizer,
                model_state_dict=loaded["model"],
                optim_state_dict=loaded["optim"],
            )
            self.scheduler.load_state_dict(schedule["scheduler"])
        ckpt.restore_rank_rng(directory, self.rank)
        if self._ema is not None:
            self._ema = shared.load_ema(directory, self.rank)
        return state

    def named_full_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """Each parameter gathered whole (one at a time, a collective), in checkpoint names; a
        yielded tensor is valid until the next is requested."""
        for name, tensor in merged_parameters(self._module):
            yield name, _full(tensor)

    def state_dict_on_rank0(self, *, ema: bool = False) -> dict[str, Tensor] | None:
        """The full model state (or its EMA) on the CPU at rank 0 (None elsewhere); all ranks
        call it."""
        swapped = shared.ema_swapped(self._ema, self._trainable, local=_local)
        with swapped if ema else contextlib.nullcontext():
            return shared.gather_on_rank0(self.named_full_parameters(), self.rank)

    def export_hf(self, directory: str, *, ema: bool = False) -> None:
        """A transformers checkpoint of the full model (its EMA with ``ema``), written by rank
        0 through a staging directory; all ranks call it."""
        state = self.state_dict_on_rank0(ema=ema)
        if state is not None:
            write_hf_export(self._module, state, source=self.config.model.path, directory=directory)

    def close(self) -> None:
        """Release the model and optimizer (the process group stays)."""
        self.optimizer = None
        self.scheduler = None
        self._module = None  # type: ignore[assignment]
        gc.collect()
