"""Rows every OpenRLHF entry point shares: logging, checkpoints, DeepSpeed, models and each
optimizer's flags (`common_rows`, `optimizer_rows`)."""

from __future__ import annotations

from collections.abc import Callable

from rlhf.cli.openrlhf.entries import (
    DTYPE_BF16,
    HEAD_STRIDE,
    MOE,
    MUON_NESTEROV,
    MUON_NS_STEPS,
    SCHEDULES,
    Gathered,
    Notice,
    Row,
    Same,
    alias,
    all_linear,
    never_at_minus_one,
    off,
    only,
)


def common_rows(
    *,
    deepspeed: Callable[[str], tuple[str, ...]],
    model: Callable[[str], tuple[str, ...]],
    ring: tuple[str, ...],
    top: str,
    run_default: str,
    liger: bool,
    lora: Callable[[str], tuple[str, ...]] | None = None,
) -> list[Row]:
    """The checkpoint, logging and DeepSpeed flags every training entry point has, onto the
    fields ``deepspeed(name)`` / ``model(name)`` / ``lora(name)`` (of `DeepSpeedConfig` and
    `ModelConfig`; ``lora``, the policy's, also takes Liger, and defaults to ``model``), the
    ring-attention fields ``ring``, and the logging fields under ``top`` (``train.`` for RL,
    nothing for sft/rm/dpo)."""
    lora = lora or model
    wandb = "wandb_key" if top else "wandb_key_top"
    rows = [
        Row("ckpt.output_dir", "one", alias("run_dir", default=run_default)),
        Row("ckpt.path", "one", Notice(
            "checkpoints go to <--run_dir>/checkpoints (--ckpt.output_dir sets --run_dir)")),
        Row("ckpt.save_steps", "one", alias("ckpt.save_steps", values=never_at_minus_one,
            default="-1 (OpenRLHF's never) is 0 here: only the last step's checkpoint")),
        Row("ckpt.save_hf", "switch", Same(
            default="its exports go to <--run_dir>/hf_checkpoints/step_<N>, the "
            "--ckpt.max_num newest kept (OpenRLHF keeps every one)")),
        Row("ckpt.disable_ds", "switch", alias("ckpt.save_state",
            values={"True": "False", "False": "True"})),
        Row("ckpt.max_num", "one", alias("ckpt.keep", default="2 here (OpenRLHF 3)")),
        Row("ckpt.max_mem", "one", Notice(
            "checkpoints are bounded by count (--ckpt.max_num / --ckpt.keep), not by size")),
        Row("ds.use_universal_ckpt", "switch", Notice(
            "a resume may change the rank layout here; --ckpt.allow_config_change names what "
            "else may change")),
        Row("logger.logging_steps", "one", Notice(
            "every step's metrics are written (metrics.jsonl)")),
        Row("logger.tensorboard_dir", "one", alias(f"{top}use_tensorboard")),
        Row("logger.wandb.key", "one", Gathered(wandb)),
        *(
            Row(f"logger.wandb.{name}", "one", alias(f"{top}wandb_{name}",
                default="rlhf here" if name == "project" else ""))
            for name in ("org", "group", "project", "run_name")
        ),
        Row("local_rank", "one", Notice(
            "ranks are Ray actors here; no launcher passes --local_rank")),
        Row("ds.deepcompile", "switch", alias(*deepspeed("deepcompile"))),
        Row("ds.param_dtype", "one", alias(*deepspeed("bf16"), values=DTYPE_BF16,
            default="fp32 here (bf16 on CPUs is slow); --ds.param_dtype bf16 turns it on")),
        Row("ds.zpg", "one", alias(*deepspeed("hpz_partition_size"))),
        Row("ds.adam_offload", "switch", alias(*deepspeed("offload_optimizer"))),
        Row("ds.attn_implementation", "one", alias(*model("attn_implementation"),
            default="sdpa here (flash-attn is not installed with rlhf)")),
        Row("ds.experts_implementation", "one", MOE),
        Row("ds.grad_accum_dtype", "one", alias(*deepspeed("grad_accum_dtype"))),
        Row("ds.overlap_comm", "switch", alias(*deepspeed("overlap_comm"),
            default="DeepSpeed's own here when not given (on for ZeRO-3; OpenRLHF off)")),
        Row("ds.tensor_parallel_size", "one", alias(*deepspeed("tp_size"))),
        Row("ds.packing_samples", "switch", alias(*model("packing_samples"))),
        Row("ds.load_in_4bit", "switch", alias(*lora("load_in_4bit"))),
        Row("ds.lora.rank", "one", alias(*lora("lora_rank"))),
        Row("ds.lora.alpha", "one", alias(*lora("lora_alpha"))),
        Row("ds.lora.target_modules", "many", alias(*lora("lora_target_modules"),
            values=all_linear,
            default="all-linear is the seven projections of Llama/Qwen-shaped blocks here")),
        Row("ds.lora.dropout", "one", alias(*lora("lora_dropout"))),
        Row("ds.ring_attn_size", "one", alias(*ring)),
        Row("ds.ring_attn_head_stride", "one", Notice(HEAD_STRIDE)),
        Row("data.disable_fast_tokenizer", "switch", Notice(
            "the tokenizer's fast version is used")),
        Row("use_ms", "switch", off("use_ms", "models load from local folders or the HF hub")),
    ]  # fmt: skip
    if liger:  # the policy's (as OpenRLHF's actor; its critic and reward model have none)
        rows.append(Row("ds.use_liger_kernel", "switch", alias(*lora("use_liger_kernel"))))
    return rows


def optimizer_rows(prefix: str, target: str, *, lr_default: str = "") -> list[Row]:
    """OpenRLHF's optimizer flags under ``prefix`` (``actor.``, ``critic.`` or nothing) onto
    the `OptimizerConfig` at ``target``: AdamW's, and Muon's (``--actor.optim muon``; its
    AdamW half takes the ``adam.*`` flags, as in OpenRLHF)."""
    rows = [
        Row(f"{prefix}optim", "one",
            alias(f"{target}.name", values={"adam": "adamw", "muon": "muon"})),
        Row(f"{prefix}muon.lr", "one", alias(f"{target}.muon_lr")),
        Row(f"{prefix}muon.momentum", "one", alias(f"{target}.muon_momentum")),
        Row(f"{prefix}muon.ns_steps", "one", only(f"{prefix}muon.ns_steps", "5", MUON_NS_STEPS)),
        Row(f"{prefix}muon.nesterov", "switch", Notice(MUON_NESTEROV)),
        Row(f"{prefix}muon.no_nesterov", "switch", off(f"{prefix}muon.no_nesterov", MUON_NESTEROV)),
        Row(f"{prefix}adam.lr", "one", alias(f"{target}.lr", default=lr_default)),
        Row(f"{prefix}adam.betas", "two", alias(f"{target}.betas")),
        Row(f"{prefix}adam.eps", "one", alias(f"{target}.eps")),
        Row(f"{prefix}adam.weight_decay", "one", alias(f"{target}.weight_decay")),
        Row(f"{prefix}lr_scheduler", "one", alias(f"{target}.schedule", values=SCHEDULES)),
        Row(f"{prefix}lr_warmup_ratio", "one",
            alias(f"{target}.warmup_ratio", default="0 here (OpenRLHF 0.03)")),
        Row(f"{prefix}min_lr_ratio", "one", alias(f"{target}.min_lr_ratio")),
        Row(f"{prefix}max_norm", "one", alias(f"{target}.grad_clip")),
    ]  # fmt: skip
    return rows
