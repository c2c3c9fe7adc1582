"""The rows: every flag of OpenRLHF 0.11.2's ``train_ppo_ray``, ``train_sft``, ``train_rm``,
``train_dpo`` and ``serve_rm`` (`TABLES`), and what 0.11.0 spelled otherwise (`EARLIER`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from rlhf.cli.openrlhf.entries import (
    DTYPE_BF16,
    HEAD_STRIDE,
    IMAGES,
    MOE,
    MUON_NESTEROV,
    MUON_NS_STEPS,
    NORMALIZE,
    SCHEDULES,
    SCORERS,
    Arity,
    Entry,
    Gathered,
    Notice,
    Row,
    Same,
    alias,
    all_linear,
    best_metric,
    comma_list,
    never_at_minus_one,
    off,
    only,
    steps_from_zero,
)


def _roles(*suffixes: str, roles: Sequence[str] = ("actor", "critic")) -> tuple[str, ...]:
    return tuple(f"{role}.{suffix}" for role in roles for suffix in suffixes)


def _common_rows(
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


def _optimizer_rows(prefix: str, target: str, *, lr_default: str = "") -> list[Row]:
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


def _ppo_rows() -> list[Row]:
    both = _roles
    rows: list[Row] = []

    def add(name: str, arity: Arity, entry: Entry) -> None:
        rows.append(Row(name, arity, entry))

    # Placement: OpenRLHF counts GPUs per node; a rank here is one process (one GPU on GPUs).
    for role in ("actor", "critic"):
        add(f"{role}.num_nodes", "one", Gathered(f"ranks:{role}"))
        add(f"{role}.num_gpus_per_node", "one", Gathered(f"ranks:{role}"))
    for role in ("ref", "reward"):
        add(f"{role}.num_nodes", "one", Notice(SCORERS))
        add(f"{role}.num_gpus_per_node", "one", Notice(SCORERS))
    for name in (
        "vllm.num_engines", "vllm.tensor_parallel_size", "vllm.gpu_memory_utilization",
        "vllm.enable_prefix_caching", "vllm.enforce_eager", "vllm.enable_sleep",
        "train.colocate_actor_ref", "train.colocate_critic_reward", "train.async_queue_size",
        "train.partial_rollout_enable",
        "train.seed", "train.batch_size", "train.micro_batch_size", "train.agent_func_path",
        "rollout.batch_size", "rollout.n_samples_per_prompt", "rollout.temperature",
        "rollout.top_p", "rollout.max_new_tokens", "data.input_key", "data.label_key",
        "data.input_template", "data.apply_chat_template", "data.max_samples",
        "algo.kl.init_coef", "algo.kl.estimator", "algo.kl.use_loss", "algo.kl.target",
        "algo.kl.horizon", "algo.advantage.estimator", "algo.advantage.gamma",
        "algo.dynamic_filtering_enable", "ckpt.load_enable",
        "reward.remote_url",
        "eval.temperature",
    ):  # fmt: skip
        arity: Arity = "switch" if _is_switch(name) else "two" if name in _TWO else "one"
        add(name, arity, Same(_PPO_DEFAULTS.get(name, "")))
    add("algo.dynamic_filtering_range", "two", Same())
    add("train.colocate_all", "switch", Gathered("colocate"))
    add("train.async_enable", "switch", Gathered("colocate"))
    add(
        "eval.steps",
        "one",
        alias(
            "eval.steps",
            values=never_at_minus_one,
            default="10 here (OpenRLHF -1: never); -1 means never here too",
        ),
    )
    # Weight sync.
    add(
        "vllm.sync_backend",
        "one",
        alias(
            "train.weight_transport",
            values={"nccl": "broadcast", "gloo": "broadcast"},
            default="auto here: the transport follows the placement (CUDA IPC, NCCL broadcast, "
            "shared memory); nccl/gloo pick the broadcast",
        ),
    )
    add(
        "vllm.sync_with_ray",
        "switch",
        alias("train.weight_transport", values={"True": "object_store", "False": "auto"}),
    )
    # Rollout correction (gating other than on the ratio is issue 44's).
    add("algo.advantage.is_correction_level", "one", Gathered("correction"))
    add("algo.advantage.is_correction_mode", "one", Gathered("correction"))
    add("algo.advantage.is_correction_threshold", "many", Gathered("correction"))
    add("algo.advantage.is_correction_gating", "one", Gathered("correction"))
    # Logging.
    # Checkpoints.
    add("ckpt.best_metric_key", "one", alias("eval.best_metric", values=best_metric))
    # DeepSpeed, for the actor and the critic alike.
    add("ds.zero_stage", "one", Gathered("zero_stage"))
    add("ds.enable_sleep", "switch", Gathered("colocate"))
    rows += _common_rows(
        deepspeed=lambda name: both(f"deepspeed.{name}"),
        model=lambda name: both(f"model.{name}"),
        lora=lambda name: (f"actor.model.{name}",),
        ring=both("ring_attn_size"),
        top="train.",
        run_default="runs/<preset> here",
        liger=True,
    )
    for role in ("actor", "critic"):
        rows += _optimizer_rows(f"{role}.", f"{role}.optimizer")
    add(
        "ds.value_head_prefix",
        "one",
        only("ds.value_head_prefix", "score", "value and reward heads are named score here"),
    )
    add(
        "actor.gradient_checkpointing_enable",
        "switch",
        alias(*both("model.gradient_checkpointing")),
    )
    add(
        "actor.gradient_checkpointing_reentrant",
        "switch",
        alias(*both("model.gradient_checkpointing_reentrant")),
    )
    # Data.
    add("data.prompt_dataset", "one", alias("data.prompt_data"))
    add("data.prompt_probs", "one", alias("data.prompt_data_probs", values=comma_list))
    add(
        "data.prompt_split",
        "one",
        only("data.prompt_split", "train", "a saved dataset directory's train split is read"),
    )
    add("data.max_len", "one", alias("rollout.max_len", default="1024 here (OpenRLHF 2048)"))
    add("data.dataloader_num_workers", "one", Notice("prompts are read in the driver process"))
    add("data.image_key", "one", IMAGES)
    add(
        "data.max_images_per_prompt",
        "one",
        only("data.max_images_per_prompt", "0", IMAGES.message),
    )
    add("eval.dataset", "one", alias("data.eval_data"))
    add("eval.split", "one", only("eval.split", "train", "a saved dataset's train split is read"))
    add("eval.n_samples_per_prompt", "one", alias("eval.n_samples"))
    # Batching.
    add("train.dynamic_batch_enable", "switch", Gathered("dynamic_batch"))
    add("train.max_tokens_per_gpu", "one", Gathered("dynamic_batch"))
    add(
        "rollout.max_tokens_per_gpu",
        "one",
        Notice("log-prob passes use --train.max_tokens_per_micro_batch too"),
    )
    add(
        "rollout.vllm_generate_batch_size",
        "one",
        Notice(
            "every request of a step goes to the engines at once (--vllm.max_num_seqs bounds "
            "a batch) and no samples are kept for later steps; --rollout.oversample_factor "
            "draws extra prompts and trains on the first groups to finish"
        ),
    )
    add(
        "rollout.micro_batch_size",
        "one",
        Notice("log-prob passes use --train.micro_batch_size too"),
    )
    add("train.max_epochs", "one", alias("train.ppo_epochs"))
    add(
        "train.num_episodes",
        "one",
        alias(
            "train.num_episodes",
            default="0 here: --train.num_steps (100) counts the steps (OpenRLHF 1 episode)",
        ),
    )
    # Losses.
    add(
        "actor.eps_clip",
        "one",
        alias("algo.policy_loss.clip_eps_low", "algo.policy_loss.clip_eps_high"),
    )
    add("actor.eps_clip_low_high", "two", Gathered("clip"))
    add("actor.dual_clip", "one", alias("algo.policy_loss.dual_clip"))
    add("actor.policy_loss_type", "one", alias("algo.policy_loss.name"))
    add("actor.loss_agg_mode", "one", alias("algo.loss_agg_mode"))
    add("actor.entropy_coef", "one", alias("algo.entropy_coef"))
    add("actor.aux_loss_coef", "one", only("actor.aux_loss_coef", "0", MOE.message))
    add("critic.value_clip", "one", alias("algo.value_clip", default="0.2 here (OpenRLHF 0.5)"))
    add(
        "critic.freezing_steps",
        "one",
        alias(
            "train.actor_freezing_steps",
            values=steps_from_zero,
            default="OpenRLHF counts steps from 0: its N freezes N + 1 steps, N + 1 here",
        ),
    )
    add(
        "critic.save_value_network",
        "switch",
        Notice("the critic is in every checkpoint; its export is not written"),
    )
    add(
        "algo.advantage.lambd",
        "one",
        alias(
            "algo.advantage.lam", default="0.95 here (OpenRLHF 1): GAE's usual bias/variance trade"
        ),
    )
    add(
        "algo.advantage.no_std_norm",
        "switch",
        alias("algo.advantage.std_norm", values={"True": "False", "False": "True"}),
    )
    add("algo.kl.unbiased_gradient", "switch", Same())
    add(
        "reward.clip_range",
        "two",
        alias("algo.advantage.reward_clip", default="no clipping here (OpenRLHF clips to -10 10)"),
    )
    add("reward.normalize_enable", "switch", Notice(NORMALIZE))
    add("reward.overlong_buffer_len", "one", alias("algo.overlong_buffer_len"))
    add("reward.overlong_penalty_factor", "one", alias("algo.overlong_penalty_factor"))
    add("reward.stop_properly_penalty_coef", "one", alias("algo.stop_properly_penalty_coef"))
    add(
        "train.full_determinism_enable",
        "switch",
        Notice(
            "runs here are seeded (--train.seed, --rollout.seed_requests); see the README on "
            "determinism"
        ),
    )
    add("train.enable_ema", "switch", Gathered("ema"))
    add("train.ema_beta", "one", Gathered("ema"))
    # Models.
    add("actor.model_name_or_path", "one", alias("actor.model.path"))
    add("critic.model_name_or_path", "one", alias("critic.model.path"))
    add("reward.model_name_or_path", "one", alias("train.reward_model_path"))
    add("ref.offload", "switch", alias("train.ref_reward_offload"))
    add("reward.offload", "switch", alias("train.ref_reward_offload"))
    add(
        "actor.freeze_visual_encoder",
        "switch",
        off("actor.freeze_visual_encoder", IMAGES.message),
    )
    # Optimizers.
    return rows


def _trainer_rows(kind: Literal["sft", "rm", "dpo"]) -> list[Row]:
    """``train_sft`` / ``train_rm`` / ``train_dpo`` → ``rlhf train sft|rm|dpo``."""
    rows: list[Row] = []

    def add(name: str, arity: Arity, entry: Entry) -> None:
        rows.append(Row(name, arity, entry))

    model = "model.model"
    add("ckpt.load_enable", "switch", Same())
    add(
        "eval.steps",
        "one",
        alias(
            "eval_steps",
            values=never_at_minus_one,
            default="-1 (OpenRLHF's never) is 0 here: "
            "the held-out set is scored before training and at the end",
        ),
    )
    add("eval.dataset", "one", alias("eval_dataset"))
    add("eval.split", "one", only("eval.split", "train", "a saved dataset's train split is read"))
    add(
        "train.micro_batch_size",
        "one",
        alias("micro_batch_size", default="8 here (OpenRLHF 1 for rm)" if kind == "rm" else ""),
    )
    add(
        "train.batch_size",
        "one",
        alias(
            "batch_size",
            default=("32 here (OpenRLHF 128)" if kind == "sft" else "16 here (OpenRLHF 128)"),
        ),
    )
    add("train.seed", "one", alias("seed"))
    add(
        "train.max_epochs",
        "one",
        alias(
            "num_epochs",
            default="0 here: --num_steps (100) counts the steps (OpenRLHF: 2 epochs sft, 1 rm/dpo)",
        ),
    )
    add(
        "train.full_determinism_enable",
        "switch",
        Notice("runs here are seeded (--seed); see the README on determinism"),
    )
    add(
        "model.model_name_or_path",
        "one",
        Gathered("ref_model") if kind == "dpo" else alias(f"{model}.path"),
    )
    add("model.gradient_checkpointing_enable", "switch", alias(f"{model}.gradient_checkpointing"))
    add(
        "model.gradient_checkpointing_reentrant",
        "switch",
        alias(f"{model}.gradient_checkpointing_reentrant"),
    )
    add("model.aux_loss_coef", "one", only("model.aux_loss_coef", "0", MOE.message))
    add("ds.zero_stage", "one", alias("model.deepspeed.zero_stage"))
    rows += _common_rows(
        deepspeed=lambda name: (f"model.deepspeed.{name}",),
        model=lambda name: (f"{model}.{name}",),
        ring=("model.ring_attn_size",),
        top="",
        run_default=f"runs/{kind} here",
        liger=kind != "rm",
    )
    rows += _optimizer_rows("", "model.optimizer", lr_default="1e-6 here (OpenRLHF 5e-6)")
    add("data.dataloader_num_workers", "one", Notice("rows are read in the driver process"))
    add("data.dataset", "one", alias("dataset"))
    add("data.dataset_probs", "one", alias("dataset_probs", values=comma_list))
    add(
        "data.dataset_split",
        "one",
        only("data.dataset_split", "train", "a saved dataset directory's train split is read"),
    )
    add(
        "data.max_samples",
        "one",
        alias("max_samples", default="every row here (OpenRLHF 1000000)"),
    )
    add(
        "data.input_template",
        "one",
        alias(
            "input_template",
            default="none here: the tokenizer's chat template when it has one (OpenRLHF "
            "'User: {}\\nAssistant: ')",
        ),
    )
    add(
        "data.apply_chat_template",
        "switch",
        Notice(
            "the tokenizer's chat template is applied whenever it has one and no "
            "--data.input_template is given"
        ),
    )
    add("data.tokenizer_chat_template", "one", alias("chat_template"))
    add("data.max_len", "one", alias("max_len", default="1024 here (OpenRLHF 2048)"))
    if kind == "sft":
        add("model.pretrain_mode_enable", "switch", alias("pretrain"))
        add("data.multiturn", "switch", Gathered("multiturn"))
        add("data.input_key", "one", Gathered("multiturn"))
        add("data.output_key", "one", alias("output_key", default="output here (OpenRLHF none)"))
    else:
        add(
            "data.prompt_key",
            "one",
            alias("prompt_key", default="prompt here (OpenRLHF none: no prompt field)"),
        )
        add("data.chosen_key", "one", alias("chosen_key"))
        add("data.rejected_key", "one", alias("rejected_key"))
    if kind == "rm":
        add(
            "ds.value_head_prefix",
            "one",
            only("ds.value_head_prefix", "score", "value and reward heads are named score here"),
        )
        add(
            "model.compute_fp32_loss_enable",
            "switch",
            Notice("the pairwise loss is computed in fp32 here"),
        )
        add("model.margin_loss_enable", "switch", Gathered("margin"))
        add(
            "model.loss_type",
            "one",
            alias(
                "loss_type",
                values={"sigmoid": "sigmoid", "logexp": "log_exp", "log_exp": "log_exp"},
            ),
        )
    if kind == "dpo":
        add(
            "ref.offload",
            "switch",
            Notice(
                "the reference log-probs are computed once before training; no reference model "
                "stays loaded"
            ),
        )
        add("ref.model_name_or_path", "one", Gathered("ref_model"))
        add("model.beta", "one", alias("beta"))
        add("model.ipo_enable", "switch", Gathered("ipo"))
        add("model.label_smoothing", "one", alias("label_smoothing"))
        add("model.nll_loss_coef", "one", alias("nll_loss_coef"))
    return rows


def _serve_rm_rows() -> list[Row]:
    """``serve_rm`` → ``rlhf serve-rm``."""
    return [
        Row("reward.model_name_or_path", "one", alias("model_path")),
        Row("reward.normalize_enable", "switch", Notice(NORMALIZE)),
        Row(
            "ds.value_head_prefix",
            "one",
            only("ds.value_head_prefix", "score", "value and reward heads are named score here"),
        ),
        Row("data.max_len", "one", alias("max_len")),
        Row("port", "one", Same()),
        Row(
            "host",
            "one",
            Same(
                default="127.0.0.1 here (OpenRLHF 0.0.0.0): reachable only "
                "from this machine unless you say so"
            ),
        ),
        Row("ds.load_in_4bit", "switch", alias("load_in_4bit")),
        Row(
            "ds.param_dtype",
            "one",
            alias("dtype", values={"bf16": "bfloat16"}, default="float32 here (OpenRLHF bf16)"),
        ),
        Row("ds.attn_implementation", "one", Notice("the model's default attention is used")),
        Row("ds.experts_implementation", "one", MOE),
        Row(
            "data.disable_fast_tokenizer", "switch", Notice("the tokenizer's fast version is used")
        ),
        Row(
            "ds.packing_samples",
            "switch",
            Notice("each request's texts are scored as a padded batch"),
        ),
        Row("batch_size", "one", Same()),
        Row("use_ms", "switch", off("use_ms", "models load from local folders or the HF hub")),
    ]


_TWO = {"algo.dynamic_filtering_range"}

_PPO_DEFAULTS = {
    "rollout.batch_size": "16 here (OpenRLHF 1024)",
    "rollout.n_samples_per_prompt": "8 here (OpenRLHF 1)",
    "rollout.max_new_tokens": "256 here (OpenRLHF 1024)",
    "train.batch_size": "0 here: the whole rollout batch is one optimizer step (OpenRLHF 128)",
    "train.micro_batch_size": "8 here (OpenRLHF 1)",
    "algo.advantage.estimator": "the preset's (ppo: gae)",
    "algo.kl.init_coef": "the preset's (OpenRLHF 0.01)",
    "eval.temperature": "1.0 here (OpenRLHF 0.6)",
    "vllm.gpu_memory_utilization": "0.6 here (OpenRLHF 0.95): room for the learner on a shared GPU",
    "vllm.enable_prefix_caching": "on here (OpenRLHF off): a prompt's samples share its prefix",
    "vllm.enforce_eager": "None here: eager on CPUs, CUDA graphs on GPUs (OpenRLHF off)",
    "vllm.enable_sleep": "None here: on under --train.colocate_all when memory needs it",
}


def _is_switch(name: str) -> bool:
    return name in {
        "vllm.enable_prefix_caching", "vllm.enforce_eager", "vllm.enable_sleep",
        "train.colocate_actor_ref", "train.colocate_critic_reward", "train.colocate_all",
        "train.async_enable", "train.partial_rollout_enable", "data.apply_chat_template",
        "algo.kl.use_loss", "algo.dynamic_filtering_enable", "ckpt.load_enable",
    }  # fmt: skip


def _table(rows: list[Row]) -> dict[str, Row]:
    table = {row.name: row for row in rows}
    if len(table) != len(rows):
        raise AssertionError("a flag is listed twice")
    return table


TABLES: dict[str, dict[str, Row]] = {
    "train_ppo_ray": _table(_ppo_rows()),
    "train_sft": _table(_trainer_rows("sft")),
    "train_rm": _table(_trainer_rows("rm")),
    "train_dpo": _table(_trainer_rows("dpo")),
    "serve_rm": _table(_serve_rm_rows()),
}
"""OpenRLHF entry point → its flags (name without ``--``) → `Row`."""

EARLIER: dict[str, dict[str, Row]] = {
    "train_ppo_ray": _table(
        [
            Row("algo.advantage.is_correction_enable", "switch", Gathered("correction")),
            Row("algo.advantage.is_correction_type", "one", Gathered("correction")),
        ]
    )
}
"""Flags of OpenRLHF 0.11.0 that 0.11.2 renamed, still read (its repository's example scripts
use them): the rollout correction's switch and type (tis, icepop, seq-mask-tis)."""

COMMANDS = {
    "train_ppo_ray": "rlhf train <rl preset>",
    "train_sft": "rlhf train sft",
    "train_rm": "rlhf train rm",
    "train_dpo": "rlhf train dpo",
    "serve_rm": "rlhf serve-rm",
}
"""OpenRLHF entry point → the ``rlhf`` command that reads its flags."""
