"""The FSDP2 options of one role (``--actor.fsdp.*`` and the other roles' equivalents)."""

from __future__ import annotations

from dataclasses import dataclass

PARAM_DTYPES = ("float32", "bfloat16")
OFFLOAD_LEVELS = ("none", "optimizer", "full")


class FSDPConfigError(ValueError):
    """An FSDP option this backend cannot honour; the message names the flag."""


@dataclass(frozen=True)
class FSDPConfig:
    """How a role is sharded and computed with FSDP2 (names as Molt's ``--fsdp.*`` flags).

    Attributes:
        tp_size: Tensor-parallel degree: the model's linear layers split over this many
            adjacent ranks by its own plan (``base_model_tp_plan``); it must divide the
            role's ranks and the model's attention and key/value heads. The data-parallel
            degree is ranks / tp_size.
        cp_size: Context-parallel degree: each row's sequence is split over this many
            adjacent ranks, attention exact through `rlhf.learner.ring_attention`
            (`rlhf.learner.context_parallel`); it must divide the role's ranks (data parallel
            = ranks / cp_size). Not combined with ``tp_size`` > 1 yet.
        ep_size: Expert-parallel degree (reserved for MoE models; only 1).
        offload: ``none`` (everything on the device); ``optimizer`` (AdamW and float32
            masters on the host, `rlhf.molt.offload`); ``full`` (FSDP2's CPU offload: the
            shards, their gradients and the optimizer on the host, gathered onto the device
            per layer for compute).
        param_dtype: Dtype of the gathered parameters a forward computes with; master
            weights, gradients' reduction and the optimizer stay float32.
        reshard_after_forward: Free each layer's gathered parameters after its forward (less
            memory; the backward gathers them again). With one data-parallel rank it saves
            only the compute-dtype copy: there ``false`` is faster (H200, one rank, bf16:
            tokens/s 0.86 → 0.98 of DeepSpeed ZeRO-2 at 0.5B, 1.22 with ``compile``;
            ``benchmarks/bench_molt.py``).
        sequence_parallel: With ``tp_size`` > 1, split the residual stream (norms, the
            activations between blocks) along the sequence over the tensor-parallel ranks
            too: row-wise layers reduce-scatter instead of all-reducing and each block
            all-gathers its input, so activations there shrink ``tp_size``-fold.
        compile: ``torch.compile`` each decoder layer's forward in place (parameter names
            unchanged; the analogue of DeepSpeed's deepcompile). The first step of each new
            shape pays the compilation (seconds per layer class), later ones run the fused
            kernels.
    """

    tp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    offload: str = "none"
    param_dtype: str = "float32"
    reshard_after_forward: bool = True
    sequence_parallel: bool = False
    compile: bool = False

    def validate(self, *, flag: str = "fsdp") -> FSDPConfig:
        """Raise `FSDPConfigError` naming ``{flag}.<field>`` for an option not supported."""
        if self.param_dtype not in PARAM_DTYPES:
            raise FSDPConfigError(
                f"--{flag}.param_dtype must be one of {PARAM_DTYPES}, got {self.param_dtype!r}"
            )
        if self.offload not in OFFLOAD_LEVELS:
            raise FSDPConfigError(
                f"--{flag}.offload must be one of {OFFLOAD_LEVELS}, got {self.offload!r}"
            )
        for name in ("tp_size", "cp_size", "ep_size"):
            value = getattr(self, name)
            if value < 1:
                raise FSDPConfigError(f"--{flag}.{name} must be >= 1, got {value}")
        if self.sequence_parallel and self.tp_size == 1:
            raise FSDPConfigError(
                f"--{flag}.sequence_parallel splits the sequence over the tensor-parallel "
                f"ranks: it needs --{flag}.tp_size > 1 (set it, or drop sequence_parallel)"
            )
        if self.cp_size > 1 and self.tp_size > 1:
            raise FSDPConfigError(
                f"--{flag}.cp_size {self.cp_size} with --{flag}.tp_size {self.tp_size}: context "
                "and tensor parallelism are not combined yet; use one of the two"
            )
        if self.ep_size != 1:
            raise FSDPConfigError(
                f"--{flag}.ep_size {self.ep_size} is reserved for mixture-of-experts models, "
                "which the molt backend does not train yet; set it to 1"
            )
        return self


def check_context_parallel(*, cp_size: int, world_size: int, flag: str) -> None:
    """Raise `FSDPConfigError` naming ``--{flag}.cp_size`` unless it divides the ranks."""
    from rlhf.learner.context_parallel import check_group_size

    try:
        check_group_size(cp_size, world_size=world_size, flag=f"{flag}.cp_size")
    except ValueError as exc:
        raise FSDPConfigError(str(exc)) from None
