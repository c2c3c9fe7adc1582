"""Frozen configs of one learner role (flags ``--actor.*``, ``--critic.*``, …)."""

from __future__ import annotations

from dataclasses import dataclass, field

ROLE_KINDS = ("causal_lm", "scalar")
"""``causal_lm``: actor, reference, SFT/DPO policy. ``scalar``: critic and reward model (a
causal LM body with a one-output token head)."""


@dataclass(frozen=True)
class ModelConfig:
    """Which model a role holds and how it runs.

    Attributes:
        path: HF checkpoint directory (config, safetensors, tokenizer).
        kind: One of `ROLE_KINDS`.
        dtype: ``float32`` or ``bfloat16`` (training keeps fp32 master weights either way).
        gradient_checkpointing: Recompute activations in the backward pass.
        gradient_checkpointing_reentrant: Recompute with torch's reentrant checkpoint (the
            whole layer again, inputs made to require gradients) instead of the non-reentrant
            one (default; it stops once the saved tensors are back). The steps are the same.
        use_liger_kernel: Run the decoder's RMSNorm, SwiGLU MLP and rotary embedding as
            Liger's Triton kernels (CUDA GPUs, ``pip install liger-kernel``; OpenRLHF's
            ``--ds.use_liger_kernel``). The log-probs are computed from the logits as without
            it (Liger's fused cross-entropy is not used). Liger patches transformers' module
            of the model family in the rank's process.
        attn_implementation: transformers attention backend (``sdpa``, ``eager``,
            ``flash_attention_2``).
        packing_samples: Run micro-batches padding-free: the real tokens of all rows go end to
            end in one row, attention kept within each sequence through position ids
            (`rlhf.learner.forward`); token budgets of micro-batches then count real tokens.
            Checked on a probe when the role is built.
        chunked_lm_head: Compute action log-probs from the final hidden states and
            ``lm_head`` chunk by chunk, never holding the (tokens × vocabulary) logits (nor
            their gradient): less memory for one more ``lm_head`` matmul per chunk in the
            backward pass. ``causal_lm`` roles with ZeRO stage ≤ 2; checked on a probe when
            the role is built.
        init_value_head: For ``scalar`` roles loaded from a causal LM (no ``score`` head in the
            checkpoint): initialise the head to zero, so initial values and rewards are 0.
        lora_rank: LoRA rank r; 0 trains the full model. With LoRA only the adapters (and a
            scalar role's head) train; weight syncs and HF exports carry merged weights.
        lora_alpha: LoRA α (the update is scaled by α / r).
        lora_dropout: Dropout on the LoRA input.
        lora_target_modules: Module names that get adapters.
        load_in_4bit: The frozen base loads as 4-bit NF4 weights (bitsandbytes, double
            quantisation, computing in ``dtype``; the lm_head and a scalar head stay dense).
            A trained role is QLoRA: only the LoRA adapters train, so it needs ``lora_rank``
            (`LearnerConfig` checks), ZeRO stage <= 2 and no tensor parallelism; weight syncs
            and HF exports carry the dequantised base with the adapters merged. An eval-only
            model (a served reward model) just computes on the 4-bit weights (``pip install
            'rlhf-learner[qlora]'``; OpenRLHF's ``--ds.load_in_4bit``).
    """

    path: str
    kind: str = "causal_lm"
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    gradient_checkpointing_reentrant: bool = False
    use_liger_kernel: bool = False
    attn_implementation: str = "sdpa"
    packing_samples: bool = False
    chunked_lm_head: bool = False
    init_value_head: bool = True
    lora_rank: int = 0
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    load_in_4bit: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ROLE_KINDS:
            raise ValueError(f"model.kind must be one of {ROLE_KINDS}, got {self.kind!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"model.dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.lora_rank < 0 or (self.lora_rank and not self.lora_target_modules):
            raise ValueError("model.lora_rank must be >= 0 and needs model.lora_target_modules")
        if self.chunked_lm_head and self.kind != "causal_lm":
            raise ValueError("model.chunked_lm_head applies to causal_lm roles only")


OPTIMIZERS = ("adamw", "muon")
"""`OptimizerConfig.name` values."""


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (or Muon with AdamW beside it) with warmup and cosine/linear/constant decay to a
    floor.

    Attributes:
        lr: Peak learning rate (of AdamW; under Muon, of its AdamW half).
        min_lr_ratio: Floor of the schedule as a fraction of ``lr``.
        warmup_steps: Linear warmup from 0 over this many optimizer steps.
        warmup_ratio: Warmup as a fraction of ``total_steps`` (OpenRLHF's
            ``--lr_warmup_ratio``): ``ceil(warmup_ratio · total_steps)`` steps; 0 uses
            ``warmup_steps``. Give one of the two.
        schedule: ``cosine``, ``linear`` or ``constant`` after warmup.
        total_steps: Optimizer steps the schedule spans (decay ends there).
        weight_decay: Decoupled weight decay; never applied to biases and norm weights.
        betas: Adam betas.
        eps: Adam epsilon.
        grad_clip: Clip the global gradient norm to this; 0 disables.
        ema_decay: Keep an exponential moving average of the trainable weights, updated after
            every optimizer step as ``ema ← d·ema + (1 − d)·w``; None disables. Checkpoints
            carry it and ``export_hf(..., ema=True)`` writes it.
        name: ``adamw``, or ``muon``: the hidden weight matrices step by Muon (Nesterov
            momentum ``muon_momentum``, orthogonalised by 5 Newton–Schulz iterations, scaled by
            sqrt(max(1, rows/cols)), at ``muon_lr``) and every other parameter (embeddings,
            lm_head, norms, biases) by AdamW at ``lr`` (OpenRLHF's ``--actor.optim muon``).
            DeepSpeed's built-in Muon runs it (ZeRO 1–3), molt `rlhf.learner.muon.MuonAdamW`;
            both halves follow the schedule.
        muon_lr: Peak learning rate of the Muon half (OpenRLHF's ``--actor.muon.lr``).
        muon_momentum: Muon's momentum β (``--actor.muon.momentum``).
    """

    lr: float = 1e-6
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    schedule: str = "cosine"
    total_steps: int = 1000
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    ema_decay: float | None = None
    name: str = "adamw"
    muon_lr: float = 0.02
    muon_momentum: float = 0.95

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(
                f"optimizer.name must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}"
            )
        if not self.muon_lr > 0 or not 0 <= self.muon_momentum < 1:
            raise ValueError(
                f"optimizer.muon_lr must be > 0 and optimizer.muon_momentum in [0, 1), got "
                f"{self.muon_lr} and {self.muon_momentum}"
            )
        if self.ema_decay is not None and not 0 < self.ema_decay < 1:
            raise ValueError(f"optimizer.ema_decay must be in (0, 1), got {self.ema_decay}")
        if not self.lr > 0:
            raise ValueError(f"optimizer.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.schedule not in ("cosine", "linear", "constant"):
            raise ValueError(
                f"optimizer.schedule must be cosine, linear or constant, got {self.schedule!r}"
            )
        if not 0 <= self.warmup_ratio <= 1:
            raise ValueError(f"optimizer.warmup_ratio must be in [0, 1], got {self.warmup_ratio}")
        if self.warmup_ratio and self.warmup_steps:
            raise ValueError(
                "optimizer.warmup_steps and optimizer.warmup_ratio are both set: give one"
            )
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError("optimizer.warmup_steps must be >= 0 and optimizer.total_steps >= 1")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError("optimizer.grad_clip and optimizer.weight_decay must be >= 0")


@dataclass(frozen=True)
class DeepSpeedConfig:
    """DeepSpeed engine options.

    Attributes:
        zero_stage: 0 (data parallel), 1 (optimizer state sharded), 2 (+ gradients), 3 (+
            parameters).
        offload_optimizer: Keep optimizer state (and its step) on the CPU: ZeRO-Offload, ZeRO
            stage 1–3, stepping torch AdamW on the host (not DeepSpeed's compiled CPU Adam).
        offload_params: Keep parameters on the CPU between uses (ZeRO-3 only).
        bf16: Run the model in bfloat16 with fp32 master weights.
        ring_attn_size: Context-parallel group size: each row's sequence is split over this
            many adjacent ranks, attention exact by ring attention
            (`rlhf.learner.context_parallel`); it must divide the role's ranks (data
            parallel = ranks / ring_attn_size).
        tp_size: Tensor-parallel group size (DeepSpeed AutoTP training): the decoder's linear
            layers split over this many adjacent ranks as the model's transformers
            tensor-parallel plan says (`rlhf.learner.tensor_parallel`); it must divide the
            role's ranks (data parallel = ranks / tp_size) and the model's attention and
            key/value heads. ZeRO stage 0–2; not with ``ring_attn_size``, LoRA or the chunked
            lm_head. Weight syncs, HF exports and log-probs see whole tensors.
        deepcompile: Compile the model with DeepSpeed's DeepCompile (``engine.compile()``
            after initialisation), which schedules ZeRO's collectives inside the compiled
            graph. Training roles on CUDA GPUs, ZeRO stage 1–3 (stage 2 in bf16 only),
            ``tp_size`` 1, one micro-batch per rank and optimizer step (DeepCompile's
            accumulation over several was measured wrong); an eval-only role runs uncompiled.
        hpz_partition_size: ZeRO++ hierarchical partitioning (hpZ, DeepSpeed's
            ``zero_hpz_partition_size``; OpenRLHF's ``--ds.zpg``): ZeRO-3 keeps a secondary
            copy of the parameters partitioned over groups of this many ranks (on one node), so
            the forward/backward all-gathers stay inside a group; it must divide the ranks.
            1: off.
        overlap_comm: Overlap ZeRO's gradient reduction with the backward pass (DeepSpeed's
            ``zero_optimization.overlap_comm``; OpenRLHF's ``--ds.overlap_comm``): faster on
            GPUs for more memory. None: DeepSpeed's default (on for ZeRO-3, off below).
        grad_accum_dtype: The dtype DeepSpeed accumulates gradients in (``fp32``, ``bf16``,
            ``fp16``; DeepSpeed's ``data_types.grad_accum_dtype``, OpenRLHF's
            ``--ds.grad_accum_dtype``); None: DeepSpeed's default, the model's dtype.
    """

    zero_stage: int = 2
    offload_optimizer: bool = False
    offload_params: bool = False
    bf16: bool = False
    ring_attn_size: int = 1
    tp_size: int = 1
    deepcompile: bool = False
    hpz_partition_size: int = 1
    overlap_comm: bool | None = None
    grad_accum_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.hpz_partition_size < 1:
            raise ValueError(
                f"deepspeed.hpz_partition_size must be >= 1, got {self.hpz_partition_size}"
            )
        if self.hpz_partition_size > 1 and self.zero_stage != 3:
            raise ValueError(
                f"deepspeed.hpz_partition_size {self.hpz_partition_size} partitions ZeRO-3's "
                "parameters: set deepspeed.zero_stage 3, or hpz_partition_size 1"
            )
        if self.grad_accum_dtype not in (None, "fp32", "bf16", "fp16"):
            raise ValueError(
                f"deepspeed.grad_accum_dtype must be fp32, bf16 or fp16, got "
                f"{self.grad_accum_dtype!r}"
            )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"deepspeed.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError("deepspeed.offload_params needs deepspeed.zero_stage=3")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError(
                "deepspeed.offload_optimizer needs deepspeed.zero_stage 1, 2 or 3: DeepSpeed "
                "ignores it at ZeRO-0 (the optimizer states would stay on the device); set "
                "deepspeed.zero_stage 1 or 2, or deepspeed.offload_optimizer False"
            )
        if self.ring_attn_size < 1:
            raise ValueError(f"deepspeed.ring_attn_size must be >= 1, got {self.ring_attn_size}")
        if self.tp_size < 1:
            raise ValueError(f"deepspeed.tp_size must be >= 1, got {self.tp_size}")
        if self.tp_size > 1 and self.ring_attn_size > 1:
            raise ValueError(
                f"deepspeed.tp_size {self.tp_size} with deepspeed.ring_attn_size "
                f"{self.ring_attn_size}: not combined yet (DeepSpeed's tensor-parallel groups and "
                "the rings would split the same ranks); set one of them to 1"
            )
        if self.deepcompile and self.zero_stage == 0:
            raise ValueError(
                "deepspeed.deepcompile needs deepspeed.zero_stage 1, 2 or 3 (DeepSpeed "
                "compiles ZeRO's collectives into the graph; at stage 0 it would fall back to "
                "plain torch.compile)"
            )
        if self.deepcompile and self.zero_stage == 2 and not self.bf16:
            raise ValueError(
                "deepspeed.deepcompile with deepspeed.zero_stage 2 needs deepspeed.bf16 True: "
                "in float32 DeepSpeed 0.19.8's compiled ZeRO-2 step aborts the process "
                "(DeepCompile's reduce buckets, measured on an H100); set deepspeed.bf16 True, "
                "or zero_stage 1 or 3"
            )
        if self.deepcompile and self.tp_size > 1:
            raise ValueError(
                f"deepspeed.deepcompile with deepspeed.tp_size {self.tp_size}: not combined yet "
                "(untested); use one of the two"
            )

    def model_problems(self, model: ModelConfig, *, prefix: str = "") -> list[str]:
        """The model options these engine options cannot carry, each naming
        ``{prefix}model.*`` and ``{prefix}deepspeed.*``: 4-bit weights split by ZeRO-3 or
        tensor parallelism, the chunked lm_head under ZeRO-3."""
        problems = []
        if model.load_in_4bit and (self.zero_stage == 3 or self.tp_size > 1):
            problems.append(
                f"{prefix}model.load_in_4bit needs {prefix}deepspeed.zero_stage <= 2 and "
                f"{prefix}deepspeed.tp_size 1: ZeRO-3 and tensor parallelism split "
                "parameters, and 4-bit packed weights cannot be split"
            )
        if model.chunked_lm_head and self.zero_stage == 3:
            problems.append(
                f"{prefix}model.chunked_lm_head needs {prefix}deepspeed.zero_stage <= 2 (ZeRO-3 "
                "shards the lm_head weight outside its own forward)"
            )
        return problems


@dataclass(frozen=True)
class LearnerConfig:
    """One role, whatever its backend: its model, optimizer (None for eval-only roles) and
    seed. A backend's own options travel with its factory
    (``functools.partial(DeepSpeedBackend, deepspeed=DeepSpeedConfig(...))``, molt's
    ``functools.partial(FSDPBackend, fsdp=FSDPConfig(...))``).

    Attributes:
        model: The model.
        optimizer: None for eval-only roles (reference, reward model in RL).
        seed: Seed of parameter init (value heads) and of dropout RNGs.
    """

    model: ModelConfig
    optimizer: OptimizerConfig | None = field(default_factory=OptimizerConfig)
    seed: int = 42

    def __post_init__(self) -> None:
        if self.optimizer is not None and self.model.load_in_4bit and not self.model.lora_rank:
            raise ValueError(
                "model.load_in_4bit freezes the base in 4 bits, so a trained role trains LoRA "
                "adapters on it (QLoRA): set model.lora_rank > 0 too"
            )
