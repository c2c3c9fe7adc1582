"""OpenRLHF 0.11.2's command lines, read by ``rlhf``: every flag of its five entry points and
what it means here.

One table per entry point (`TABLES`): ``train_ppo_ray`` → ``rlhf train <rl preset>``,
``train_sft`` → ``rlhf train sft``, ``train_rm`` / ``train_dpo`` → ``rlhf train rm|dpo``,
``serve_rm`` → ``rlhf serve-rm``. Each row is one OpenRLHF flag with how many values it takes
(`Arity`) and one of:

- `Same`: the flag is our field's own spelling;
- `Alias`: it sets one or more of our fields, its values translated where the two spell them
  differently (``--ds.param_dtype bf16`` → ``--actor.deepspeed.bf16 True``);
- `Gathered`: it joins other flags into one setting (``--actor.num_nodes`` ×
  ``--actor.num_gpus_per_node`` ranks), finished after the whole line was read;
- `Notice`: accepted, with nothing to do here; a line on stderr says why;
- `Refused`: an error naming the flag and what to use instead (what cannot mean anything here,
  or a behaviour another issue builds).

`translate` rewrites a command line in our spelling before it is parsed; the README's migration
section is `migration_markdown()` (a test keeps them equal).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from rlhf.cli.config import ConfigError

Arity = Literal["switch", "one", "two", "many"]
"""Values an OpenRLHF flag takes: ``switch`` (bare, or one of True/False), ``one``, ``two``
or ``many`` (one or more, up to the next ``--flag``)."""

SWITCH_VALUES = {"true": "True", "1": "True", "yes": "True", "false": "False", "0": "False"}
"""A switch's optional value (any case) → the boolean it means."""


@dataclass(frozen=True)
class Same:
    """OpenRLHF's spelling is our field's; ``default`` says where its default differs."""

    default: str = ""


@dataclass(frozen=True)
class Alias:
    """The flag sets ``fields`` (each to the same values).

    ``values`` translates OpenRLHF's values into ours: a mapping of the accepted values (any
    other is refused, naming them), or a function of the value list. ``default`` says where
    our default differs from OpenRLHF's, and why."""

    fields: tuple[str, ...]
    values: Mapping[str, str] | Callable[[list[str]], list[str]] | None = None
    default: str = ""


@dataclass(frozen=True)
class Gathered:
    """The flag is one input of ``group`` (a setting several flags make together; see
    `FINISHERS`)."""

    group: str
    default: str = ""


@dataclass(frozen=True)
class Notice:
    """Accepted; ``message`` (printed to stderr) says why nothing needs to happen here."""

    message: str


@dataclass(frozen=True)
class Refused:
    """An error: ``message`` says what to use instead."""

    message: str


Entry = Same | Alias | Gathered | Notice | Refused


@dataclass(frozen=True)
class Row:
    """One OpenRLHF flag (``name`` without its ``--``)."""

    name: str
    arity: Arity
    entry: Entry


@dataclass(frozen=True)
class Translated:
    """A command line in our spelling, the notices its OpenRLHF flags earned, and the rank
    counts given for the reference / reward model (``role`` → ranks; see `check_ranks`)."""

    args: list[str]
    notices: list[str] = field(default_factory=list)
    follow_ranks: dict[str, int] = field(default_factory=dict)


_FOLLOW = "\0follow:"
_NOTE = "\0note:"
"""Prefix of the internal token a ``ranks:ref|reward`` finisher returns (never a flag)."""


def _alias(
    *fields: str,
    values: Mapping[str, str] | Callable[[list[str]], list[str]] | None = None,
    default: str = "",
) -> Alias:
    return Alias(tuple(fields), values, default)


def _comma_list(values: list[str]) -> list[str]:
    """``"0.5,0.5"`` (OpenRLHF's comma-separated weights) → ``["0.5", "0.5"]``."""
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def _join_comma(values: list[str]) -> list[str]:
    return [",".join(values)]


def _never_at_minus_one(values: list[str]) -> list[str]:
    """OpenRLHF's ``-1`` (never) → ``0``."""
    return ["0"] if values == ["-1"] else values


def _all_linear(values: list[str]) -> list[str]:
    """peft's ``all-linear`` → the projections of a Llama/Qwen-shaped block (our default)."""
    if values == ["all-linear"]:
        return ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return values


def _pair_from_one_or_two(values: list[str]) -> list[str]:
    """OpenRLHF's ``LOW HIGH`` or a single ``HIGH`` (lower bound 0) → ``LOW HIGH``."""
    if len(values) == 1:
        return ["0", values[0]]
    if len(values) == 2:
        return values
    raise ConfigError(f"takes LOW HIGH or a single HIGH, got {' '.join(values)}")


_DTYPE_BF16 = {"bf16": "True"}
_UPSTREAM = "OpenRLHF's default"


_MUON = Refused("Muon is not built yet (issue 44 builds --actor.optim muon); use AdamW")


_IMAGES = Refused(
    "vision-language training is not built yet (issue 45 builds the image flags); "
    "prompts are text here"
)
_HEAD_STRIDE = (
    "ring attention here passes every head at once (the stride trades memory for "
    "communication; the results are the same)"
)
_NORMALIZE = (
    "OpenRLHF normalises with the mean and std a reward model stored when it was trained "
    "with --reward.normalize_enable; rlhf train rm stores none, so the scores are used as "
    "they are (what OpenRLHF does for such a model)"
)
_MOE = Refused("MoE training is not built yet (issue 45 builds it); leave the flag out")


def _roles(*suffixes: str, roles: Sequence[str] = ("actor", "critic")) -> tuple[str, ...]:
    return tuple(f"{role}.{suffix}" for role in roles for suffix in suffixes)


def _ppo_rows() -> list[Row]:
    both = _roles
    rows: list[Row] = []

    def add(name: str, arity: Arity, entry: Entry) -> None:
        rows.append(Row(name, arity, entry))

    # Placement: OpenRLHF counts GPUs per node; a rank here is one process (one GPU on GPUs).
    for role in ("actor", "critic", "ref", "reward"):
        add(f"{role}.num_nodes", "one", Gathered(f"ranks:{role}"))
        add(f"{role}.num_gpus_per_node", "one", Gathered(f"ranks:{role}"))
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
        _alias(
            "eval.steps",
            values=_never_at_minus_one,
            default="10 here (OpenRLHF -1: never); -1 means never here too",
        ),
    )
    add(
        "ckpt.save_steps",
        "one",
        _alias(
            "ckpt.save_steps",
            values=_never_at_minus_one,
            default="-1 (OpenRLHF's never) is 0 here: only the last step's checkpoint",
        ),
    )
    # Weight sync.
    add(
        "vllm.sync_backend",
        "one",
        _alias(
            "train.weight_transport",
            values={"nccl": "broadcast", "gloo": "broadcast"},
            default="auto here: the transport follows the placement (CUDA IPC, NCCL broadcast, "
            "shared memory); nccl/gloo pick the broadcast",
        ),
    )
    add(
        "vllm.sync_with_ray",
        "switch",
        _alias("train.weight_transport", values={"True": "object_store", "False": "auto"}),
    )
    # Rollout correction (gating other than on the ratio is issue 44's).
    add("algo.advantage.is_correction_level", "one", Gathered("correction"))
    add("algo.advantage.is_correction_mode", "one", Gathered("correction"))
    add("algo.advantage.is_correction_threshold", "many", Gathered("correction"))
    add("algo.advantage.is_correction_gating", "one", Gathered("correction"))
    # Logging.
    add("logger.logging_steps", "one", Notice("every step's metrics are written (metrics.jsonl)"))
    add("logger.tensorboard_dir", "one", _alias("train.use_tensorboard"))
    add("logger.wandb.key", "one", Gathered("wandb_key"))
    add("logger.wandb.org", "one", _alias("train.wandb_org"))
    add("logger.wandb.group", "one", _alias("train.wandb_group"))
    add("logger.wandb.project", "one", _alias("train.wandb_project", default="rlhf here"))
    add("logger.wandb.run_name", "one", _alias("train.wandb_run_name"))
    # Checkpoints.
    add("ckpt.output_dir", "one", _alias("run_dir", default="runs/<preset> here"))
    add(
        "ckpt.path",
        "one",
        Notice("checkpoints go to <--run_dir>/checkpoints (--ckpt.output_dir sets --run_dir)"),
    )
    add(
        "ckpt.save_hf",
        "switch",
        _alias(
            "ckpt.export_hf",
            default="on here (OpenRLHF off): the final policy is exported as a transformers folder",
        ),
    )
    add(
        "ckpt.disable_ds",
        "switch",
        Refused(
            "checkpoints here always carry the optimizer and the run's state "
            "(that is what --ckpt.load_enable resumes); --ckpt.save_hf adds the HF export"
        ),
    )
    add("ckpt.max_num", "one", _alias("ckpt.keep", default="2 here (OpenRLHF 3)"))
    add(
        "ckpt.max_mem",
        "one",
        Notice("checkpoints are bounded by count (--ckpt.max_num / --ckpt.keep), not by size"),
    )
    add("ckpt.best_metric_key", "one", _alias("eval.best_metric", values=_best_metric))
    add(
        "ds.use_universal_ckpt",
        "switch",
        Notice(
            "a resume may change the rank layout here; --ckpt.allow_config_change names what "
            "else may change"
        ),
    )
    add("local_rank", "one", Notice("ranks are Ray actors here; no launcher passes --local_rank"))
    # DeepSpeed, for the actor and the critic alike.
    add("ds.zero_stage", "one", Gathered("sleep"))
    add("ds.deepcompile", "switch", _alias(*both("deepspeed.deepcompile")))
    add(
        "ds.param_dtype",
        "one",
        _alias(
            *both("deepspeed.bf16"),
            values=_DTYPE_BF16,
            default="fp32 here (bf16 on CPUs is slow); --ds.param_dtype bf16 turns it on",
        ),
    )
    add("ds.zpg", "one", _only("ds.zpg", "1", "ZeRO++ partitions are not built"))
    add("ds.adam_offload", "switch", _alias(*both("deepspeed.offload_optimizer")))
    add(
        "ds.attn_implementation",
        "one",
        _alias(
            *both("model.attn_implementation"),
            default="sdpa here (flash-attn is not installed with rlhf)",
        ),
    )
    add("ds.experts_implementation", "one", _MOE)
    add("ds.use_liger_kernel", "switch", _off("ds.use_liger_kernel", "Liger kernels are not built"))
    add(
        "ds.grad_accum_dtype",
        "one",
        Refused("gradients accumulate in the master weights' fp32 here"),
    )
    add("ds.overlap_comm", "switch", Notice("DeepSpeed's default communication overlap is kept"))
    add("ds.enable_sleep", "switch", Gathered("sleep"))
    add("ds.tensor_parallel_size", "one", _alias(*both("deepspeed.tp_size")))
    add("ds.packing_samples", "switch", _alias(*both("model.packing_samples")))
    add("ds.load_in_4bit", "switch", _off("ds.load_in_4bit", "4-bit loading is not built"))
    add("ds.lora.rank", "one", _alias("actor.model.lora_rank"))
    add("ds.lora.alpha", "one", _alias("actor.model.lora_alpha"))
    add(
        "ds.lora.target_modules",
        "many",
        _alias(
            "actor.model.lora_target_modules",
            values=_all_linear,
            default="all-linear is the seven projections of Llama/Qwen-shaped blocks here",
        ),
    )
    add("ds.lora.dropout", "one", _alias("actor.model.lora_dropout"))
    add("ds.ring_attn_size", "one", _alias("actor.ring_attn_size", "critic.ring_attn_size"))
    add("ds.ring_attn_head_stride", "one", Notice(_HEAD_STRIDE))
    add(
        "ds.value_head_prefix",
        "one",
        _only("ds.value_head_prefix", "score", "value and reward heads are named score here"),
    )
    add(
        "actor.gradient_checkpointing_enable",
        "switch",
        _alias(*both("model.gradient_checkpointing")),
    )
    add(
        "actor.gradient_checkpointing_reentrant",
        "switch",
        _off("actor.gradient_checkpointing_reentrant", "checkpointing here is non-reentrant"),
    )
    # Data.
    add("data.prompt_dataset", "one", _alias("data.prompt_data"))
    add("data.prompt_probs", "one", _alias("data.prompt_data_probs", values=_comma_list))
    add(
        "data.prompt_split",
        "one",
        _only("data.prompt_split", "train", "a saved dataset directory's train split is read"),
    )
    add("data.max_len", "one", _alias("rollout.max_len", default="1024 here (OpenRLHF 2048)"))
    add("data.disable_fast_tokenizer", "switch", Notice("the tokenizer's fast version is used"))
    add("data.dataloader_num_workers", "one", Notice("prompts are read in the driver process"))
    add("data.image_key", "one", _IMAGES)
    add(
        "data.max_images_per_prompt",
        "one",
        _only("data.max_images_per_prompt", "0", _IMAGES.message),
    )
    add("eval.dataset", "one", _alias("data.eval_data"))
    add("eval.split", "one", _only("eval.split", "train", "a saved dataset's train split is read"))
    add("eval.n_samples_per_prompt", "one", _alias("eval.n_samples"))
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
            "every request of a step goes to the engines at once; "
            "--vllm.max_num_seqs bounds a batch"
        ),
    )
    add(
        "rollout.micro_batch_size",
        "one",
        Notice("log-prob passes use --train.micro_batch_size too"),
    )
    add("train.max_epochs", "one", _alias("train.ppo_epochs"))
    add(
        "train.num_episodes",
        "one",
        _alias(
            "train.num_episodes",
            default="0 here: --train.num_steps (100) counts the steps (OpenRLHF 1 episode)",
        ),
    )
    # Losses.
    add(
        "actor.eps_clip",
        "one",
        _alias("algo.policy_loss.clip_eps_low", "algo.policy_loss.clip_eps_high"),
    )
    add("actor.eps_clip_low_high", "two", Gathered("clip"))
    add("actor.dual_clip", "one", _alias("algo.policy_loss.dual_clip"))
    add("actor.policy_loss_type", "one", _alias("algo.policy_loss.name"))
    add("actor.loss_agg_mode", "one", _alias("algo.loss_agg_mode"))
    add("actor.entropy_coef", "one", _alias("algo.entropy_coef"))
    add("actor.aux_loss_coef", "one", _only("actor.aux_loss_coef", "0", _MOE.message))
    add("critic.value_clip", "one", _alias("algo.value_clip", default="0.2 here (OpenRLHF 0.5)"))
    add(
        "critic.freezing_steps",
        "one",
        _only(
            "critic.freezing_steps",
            "-1",
            "freezing the actor while the critic warms up is not built",
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
        _alias(
            "algo.advantage.lam", default="0.95 here (OpenRLHF 1): GAE's usual bias/variance trade"
        ),
    )
    add(
        "algo.advantage.no_std_norm",
        "switch",
        _off(
            "algo.advantage.no_std_norm",
            "mean-only advantage normalisation is not built "
            "(--algo.advantage.estimator dr_grpo centres without dividing by the std)",
        ),
    )
    add(
        "algo.kl.unbiased_gradient",
        "switch",
        _off("algo.kl.unbiased_gradient", "the unbiased KL-loss gradient is not built"),
    )
    add(
        "reward.clip_range",
        "two",
        _alias("algo.advantage.reward_clip", default="no clipping here (OpenRLHF clips to -10 10)"),
    )
    add("reward.normalize_enable", "switch", Notice(_NORMALIZE))
    add("reward.overlong_buffer_len", "one", _alias("algo.overlong_buffer_len"))
    add("reward.overlong_penalty_factor", "one", _alias("algo.overlong_penalty_factor"))
    add("reward.stop_properly_penalty_coef", "one", _alias("algo.stop_properly_penalty_coef"))
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
    add("actor.model_name_or_path", "one", _alias("actor.model.path"))
    add("critic.model_name_or_path", "one", _alias("critic.model.path"))
    add("reward.model_name_or_path", "one", _alias("train.reward_model_path"))
    add("ref.offload", "switch", _alias("train.ref_reward_offload"))
    add("reward.offload", "switch", _alias("train.ref_reward_offload"))
    add(
        "actor.freeze_visual_encoder",
        "switch",
        _off("actor.freeze_visual_encoder", _IMAGES.message),
    )
    add("use_ms", "switch", _off("use_ms", "models load from local folders or the HF hub"))
    # Optimizers.
    for role in ("actor", "critic"):
        add(f"{role}.optim", "one", _only(f"{role}.optim", "adam", _MUON.message))
        for name in ("lr", "momentum", "ns_steps"):
            add(f"{role}.muon.{name}", "one", _MUON)
        add(f"{role}.muon.nesterov", "switch", _MUON)
        add(f"{role}.muon.no_nesterov", "switch", _MUON)
        add(f"{role}.adam.lr", "one", _alias(f"{role}.optimizer.lr"))
        add(f"{role}.adam.betas", "two", _alias(f"{role}.optimizer.betas"))
        add(f"{role}.adam.eps", "one", _alias(f"{role}.optimizer.eps"))
        add(f"{role}.adam.weight_decay", "one", _alias(f"{role}.optimizer.weight_decay"))
        add(f"{role}.lr_scheduler", "one", _alias(f"{role}.optimizer.schedule", values=_SCHEDULES))
        add(
            f"{role}.lr_warmup_ratio",
            "one",
            _alias(f"{role}.optimizer.warmup_ratio", default="0 here (OpenRLHF 0.03)"),
        )
        add(f"{role}.min_lr_ratio", "one", _alias(f"{role}.optimizer.min_lr_ratio"))
        add(f"{role}.max_norm", "one", _alias(f"{role}.optimizer.grad_clip"))
    return rows


def _trainer_rows(kind: Literal["sft", "rm", "dpo"]) -> list[Row]:
    """``train_sft`` / ``train_rm`` / ``train_dpo`` → ``rlhf train sft|rm|dpo``."""
    rows: list[Row] = []

    def add(name: str, arity: Arity, entry: Entry) -> None:
        rows.append(Row(name, arity, entry))

    model = "model.model"
    add("ckpt.output_dir", "one", _alias("run_dir", default=f"runs/{kind} here"))
    add(
        "ckpt.path",
        "one",
        Notice("checkpoints go to <--run_dir>/checkpoints (--ckpt.output_dir sets --run_dir)"),
    )
    add(
        "ckpt.save_steps",
        "one",
        _alias(
            "ckpt.save_steps",
            values=_never_at_minus_one,
            default="-1 (OpenRLHF's never) is 0 here: only the last step's checkpoint",
        ),
    )
    add(
        "ckpt.save_hf",
        "switch",
        _alias(
            "ckpt.export_hf",
            default="on here (OpenRLHF off): the model is exported as a transformers folder",
        ),
    )
    add(
        "ckpt.disable_ds",
        "switch",
        Refused(
            "checkpoints here always carry the optimizer and the data order (that is what "
            "--ckpt.load_enable resumes); --ckpt.save_hf adds the HF export"
        ),
    )
    add("ckpt.max_num", "one", _alias("ckpt.keep", default="2 here (OpenRLHF 3)"))
    add(
        "ckpt.max_mem",
        "one",
        Notice("checkpoints are bounded by count (--ckpt.max_num / --ckpt.keep), not by size"),
    )
    add("ckpt.load_enable", "switch", Same())
    add(
        "ds.use_universal_ckpt",
        "switch",
        Notice(
            "a resume may change the rank layout here; --ckpt.allow_config_change names what "
            "else may change"
        ),
    )
    add("logger.logging_steps", "one", Notice("every step's metrics are written (metrics.jsonl)"))
    if kind == "sft":
        add(
            "eval.steps",
            "one",
            _only("eval.steps", "-1", "rlhf train sft has no evaluation set yet"),
        )
        add("eval.dataset", "one", Refused("rlhf train sft has no evaluation set yet"))
    else:
        add(
            "eval.steps",
            "one",
            Notice(
                "the held-out pairs (--eval.dataset) are scored at every checkpoint and at the end"
            ),
        )
        add("eval.dataset", "one", _alias("eval_dataset"))
    add("eval.split", "one", _only("eval.split", "train", "a saved dataset's train split is read"))
    add(
        "train.micro_batch_size",
        "one",
        _alias("micro_batch_size", default="8 here (OpenRLHF 1 for rm)" if kind == "rm" else ""),
    )
    add(
        "train.batch_size",
        "one",
        _alias(
            "batch_size",
            default=("32 here (OpenRLHF 128)" if kind == "sft" else "16 here (OpenRLHF 128)"),
        ),
    )
    add("train.seed", "one", _alias("seed"))
    add(
        "train.max_epochs",
        "one",
        _alias(
            "num_epochs",
            default="0 here: --num_steps (100) counts the steps (OpenRLHF: 2 epochs sft, 1 rm/dpo)",
        ),
    )
    add(
        "train.full_determinism_enable",
        "switch",
        Notice("runs here are seeded (--seed); see the README on determinism"),
    )
    add("local_rank", "one", Notice("ranks are Ray actors here; no launcher passes --local_rank"))
    add(
        "model.model_name_or_path",
        "one",
        Gathered("ref_model") if kind == "dpo" else _alias(f"{model}.path"),
    )
    add("model.gradient_checkpointing_enable", "switch", _alias(f"{model}.gradient_checkpointing"))
    add(
        "model.gradient_checkpointing_reentrant",
        "switch",
        _off("model.gradient_checkpointing_reentrant", "checkpointing here is non-reentrant"),
    )
    add("model.aux_loss_coef", "one", _only("model.aux_loss_coef", "0", _MOE.message))
    add("ds.zero_stage", "one", _alias("model.deepspeed.zero_stage"))
    add("ds.deepcompile", "switch", _alias("model.deepspeed.deepcompile"))
    add(
        "ds.param_dtype",
        "one",
        _alias(
            "model.deepspeed.bf16",
            values=_DTYPE_BF16,
            default="fp32 here (bf16 on CPUs is slow); --ds.param_dtype bf16 turns it on",
        ),
    )
    add("ds.zpg", "one", _only("ds.zpg", "1", "ZeRO++ partitions are not built"))
    add("ds.adam_offload", "switch", _alias("model.deepspeed.offload_optimizer"))
    add(
        "ds.attn_implementation",
        "one",
        _alias(
            f"{model}.attn_implementation",
            default="sdpa here (flash-attn is not installed with rlhf)",
        ),
    )
    add("ds.experts_implementation", "one", _MOE)
    if kind != "rm":
        add(
            "ds.use_liger_kernel",
            "switch",
            _off("ds.use_liger_kernel", "Liger kernels are not built"),
        )
    add(
        "ds.grad_accum_dtype",
        "one",
        Refused("gradients accumulate in the master weights' fp32 here"),
    )
    add("ds.overlap_comm", "switch", Notice("DeepSpeed's default communication overlap is kept"))
    add("ds.tensor_parallel_size", "one", _alias("model.deepspeed.tp_size"))
    add("ds.ring_attn_size", "one", _alias("model.ring_attn_size"))
    add("ds.ring_attn_head_stride", "one", Notice(_HEAD_STRIDE))
    add("ds.load_in_4bit", "switch", _off("ds.load_in_4bit", "4-bit loading is not built"))
    add("ds.lora.rank", "one", _alias(f"{model}.lora_rank"))
    add("ds.lora.alpha", "one", _alias(f"{model}.lora_alpha"))
    add(
        "ds.lora.target_modules",
        "many",
        _alias(
            f"{model}.lora_target_modules",
            values=_all_linear,
            default="all-linear is the seven projections of Llama/Qwen-shaped blocks here",
        ),
    )
    add("ds.lora.dropout", "one", _alias(f"{model}.lora_dropout"))
    add("ds.packing_samples", "switch", _alias(f"{model}.packing_samples"))
    add("data.disable_fast_tokenizer", "switch", Notice("the tokenizer's fast version is used"))
    add("data.dataloader_num_workers", "one", Notice("rows are read in the driver process"))
    add("data.dataset", "one", _alias("dataset"))
    add(
        "data.dataset_probs",
        "one",
        _only("data.dataset_probs", "1.0", "one dataset per run here (blend it beforehand)"),
    )
    add(
        "data.dataset_split",
        "one",
        _only("data.dataset_split", "train", "a saved dataset directory's train split is read"),
    )
    add(
        "data.max_samples",
        "one",
        _alias("max_samples", default="every row here (OpenRLHF 1000000)"),
    )
    add(
        "data.input_template",
        "one",
        _alias(
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
    add(
        "data.tokenizer_chat_template",
        "one",
        Refused("put the template in the model folder's tokenizer_config.json (chat_template)"),
    )
    add("data.max_len", "one", _alias("max_len", default="1024 here (OpenRLHF 2048)"))
    for name in ("org", "group", "project", "run_name"):
        add(
            f"logger.wandb.{name}",
            "one",
            _alias(f"wandb_{name}", default="rlhf here" if name == "project" else ""),
        )
    add("logger.wandb.key", "one", Gathered("wandb_key_top"))
    add("logger.tensorboard_dir", "one", _alias("use_tensorboard"))
    add("use_ms", "switch", _off("use_ms", "models load from local folders or the HF hub"))
    add("optim", "one", _only("optim", "adam", _MUON.message))
    for name in ("lr", "momentum", "ns_steps"):
        add(f"muon.{name}", "one", _MUON)
    add("muon.nesterov", "switch", _MUON)
    add("muon.no_nesterov", "switch", _MUON)
    add("adam.lr", "one", _alias("model.optimizer.lr", default="1e-6 here (OpenRLHF 5e-6)"))
    add("adam.betas", "two", _alias("model.optimizer.betas"))
    add("adam.eps", "one", _alias("model.optimizer.eps"))
    add("adam.weight_decay", "one", _alias("model.optimizer.weight_decay"))
    add("lr_scheduler", "one", _alias("model.optimizer.schedule", values=_SCHEDULES))
    add(
        "lr_warmup_ratio",
        "one",
        _alias("model.optimizer.warmup_ratio", default="0 here (OpenRLHF 0.03)"),
    )
    add("min_lr_ratio", "one", _alias("model.optimizer.min_lr_ratio"))
    add("max_norm", "one", _alias("model.optimizer.grad_clip"))
    if kind == "sft":
        add("model.pretrain_mode_enable", "switch", _alias("pretrain"))
        add("data.multiturn", "switch", Gathered("multiturn"))
        add("data.input_key", "one", Gathered("multiturn"))
        add("data.output_key", "one", _alias("output_key", default="output here (OpenRLHF none)"))
    else:
        add(
            "data.prompt_key",
            "one",
            _alias("prompt_key", default="prompt here (OpenRLHF none: no prompt field)"),
        )
        add("data.chosen_key", "one", _alias("chosen_key"))
        add("data.rejected_key", "one", _alias("rejected_key"))
    if kind == "rm":
        add(
            "ds.value_head_prefix",
            "one",
            _only("ds.value_head_prefix", "score", "value and reward heads are named score here"),
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
            _alias(
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
        add("model.beta", "one", _alias("beta"))
        add("model.ipo_enable", "switch", Gathered("ipo"))
        add("model.label_smoothing", "one", _alias("label_smoothing"))
        add("model.nll_loss_coef", "one", _alias("nll_loss_coef"))
    return rows


def _serve_rm_rows() -> list[Row]:
    """``serve_rm`` → ``rlhf serve-rm``."""
    return [
        Row("reward.model_name_or_path", "one", _alias("model_path")),
        Row("reward.normalize_enable", "switch", Notice(_NORMALIZE)),
        Row(
            "ds.value_head_prefix",
            "one",
            _only("ds.value_head_prefix", "score", "value and reward heads are named score here"),
        ),
        Row("data.max_len", "one", _alias("max_len")),
        Row("port", "one", Same()),
        Row(
            "host",
            "one",
            Same(
                default="127.0.0.1 here (OpenRLHF 0.0.0.0): reachable only "
                "from this machine unless you say so"
            ),
        ),
        Row("ds.load_in_4bit", "switch", _off("ds.load_in_4bit", "4-bit loading is not built")),
        Row(
            "ds.param_dtype",
            "one",
            _alias("dtype", values={"bf16": "bfloat16"}, default="float32 here (OpenRLHF bf16)"),
        ),
        Row("ds.attn_implementation", "one", Notice("the model's default attention is used")),
        Row("ds.experts_implementation", "one", _MOE),
        Row(
            "data.disable_fast_tokenizer", "switch", Notice("the tokenizer's fast version is used")
        ),
        Row(
            "ds.packing_samples",
            "switch",
            Notice("each request's texts are scored as a padded batch"),
        ),
        Row("batch_size", "one", Same()),
        Row("use_ms", "switch", _off("use_ms", "models load from local folders or the HF hub")),
    ]


_SCHEDULES = {
    "cosine_with_min_lr": "cosine",
    "cosine": "cosine",
    "linear": "linear",
    "constant": "constant",
    "constant_with_warmup": "constant",
}
"""OpenRLHF's (transformers') scheduler names → ours (warmup is separate here)."""

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


def _best_metric(values: list[str]) -> list[str]:
    """OpenRLHF's ``eval_<source>_pass1`` → ``eval/<source>/pass@1`` (others unchanged)."""
    (value,) = values
    if value.startswith("eval_") and value.endswith(("_pass1", "_pass@1")):
        source = value[len("eval_") :].rsplit("_pass", 1)[0]
        return [f"eval/{source}/pass@1"]
    return [value]


def _only(flag: str, value: str, why: str) -> Alias:
    """A flag accepted only at ``value`` (OpenRLHF's default): anything else is refused."""
    return Alias((), values=_OnlyValue(flag, value, why))


def _off(flag: str, why: str) -> Alias:
    """A switch accepted only when off."""
    return _only(flag, "False", why)


@dataclass(frozen=True)
class _OnlyValue:
    flag: str
    value: str
    why: str

    def __call__(self, values: list[str]) -> list[str]:
        given = " ".join(values)
        number = _number(given)
        same = given.lower() == self.value.lower() or (
            number is not None and number == _number(self.value)
        )
        if not same:
            raise ConfigError(f"--{self.flag} {given}: {self.why}; leave the flag out")
        return []


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


# Finishers: a group's flags (name → values) → our tokens.


def _ranks(role: str) -> Callable[[dict[str, list[str]]], list[str]]:
    def finish(given: dict[str, list[str]]) -> list[str]:
        nodes = int(given.get(f"{role}.num_nodes", ["1"])[0])
        per_node = int(given.get(f"{role}.num_gpus_per_node", ["8"])[0])
        if role in ("actor", "critic"):
            return [f"--{role}.num_ranks", str(nodes * per_node)]
        # The reference runs on the actor's ranks, the reward model on the critic's (or the
        # actor's); a count of its own is only accepted when it is that one (`check_ranks`).
        return [f"{_FOLLOW}{role}={nodes * per_node}"]

    return finish


_CORRECTION_TYPES = {
    "tis": ("token", "clip"),
    "icepop": ("token", "mask"),
    "seq-mask-tis": ("seq", "mask"),
}
"""OpenRLHF 0.11.0's ``--algo.advantage.is_correction_type`` → 0.11.2's level and mode."""


def _correction(given: dict[str, list[str]]) -> list[str]:
    if (
        "algo.advantage.is_correction_enable" in given
        or "algo.advantage.is_correction_type" in given
    ):
        given = _correction_of_0_11_0(given)
    level = given.get("algo.advantage.is_correction_level", ["off"])[0]
    gating = given.get("algo.advantage.is_correction_gating", ["ratio"])[0]
    if gating != "ratio":
        raise ConfigError(
            f"--algo.advantage.is_correction_gating {gating}: only ratio gating is built "
            "(issue 44 builds binary_kl and tv)"
        )
    if level == "off":
        return []
    levels = {"token": "token", "seq": "sequence", "geometric": "geometric"}
    if level not in levels:
        raise ConfigError(f"--algo.advantage.is_correction_level {level}: choose off, token or seq")
    modes = {"mask": "mask", "clip": "truncate"}
    mode = given.get("algo.advantage.is_correction_mode", ["mask"])[0]
    if mode not in modes:
        raise ConfigError(f"--algo.advantage.is_correction_mode {mode}: choose mask or clip")
    threshold = _pair_from_one_or_two(
        given.get("algo.advantage.is_correction_threshold", ["0.5", "5.0"])
    )
    return [
        "algo.rollout_correction:rollout_correction_config",
        "--algo.rollout_correction.level", levels[level],
        "--algo.rollout_correction.mode", modes[mode],
        "--algo.rollout_correction.threshold", *threshold,
    ]  # fmt: skip


def _correction_of_0_11_0(given: dict[str, list[str]]) -> dict[str, list[str]]:
    """0.11.0's switch and type in 0.11.2's terms (seq-mask-tis: the geometric mean of the
    sequence's ratios, masked)."""
    renamed = {"algo.advantage.is_correction_level", "algo.advantage.is_correction_mode"}
    if renamed & set(given):
        raise ConfigError(
            "--algo.advantage.is_correction_enable/_type (OpenRLHF 0.11.0) and "
            "--algo.advantage.is_correction_level/_mode (0.11.2) both given: use one spelling"
        )
    if _switch(given.get("algo.advantage.is_correction_enable", ["False"])) != "True":
        return {k: v for k, v in given.items() if k == "algo.advantage.is_correction_gating"}
    kind = given.get("algo.advantage.is_correction_type", ["tis"])[0]
    if kind not in _CORRECTION_TYPES:
        raise ConfigError(
            f"--algo.advantage.is_correction_type {kind}: choose {', '.join(_CORRECTION_TYPES)}"
        )
    level, mode = _CORRECTION_TYPES[kind]
    level = "geometric" if kind == "seq-mask-tis" else level
    return {
        **given,
        "algo.advantage.is_correction_level": [level],
        "algo.advantage.is_correction_mode": [mode],
    }


def _sleep(given: dict[str, list[str]]) -> list[str]:
    """``--ds.zero_stage`` for the actor and the critic, and ``--ds.enable_sleep``: the
    learners' states leave the GPU between phases (``--train.deepspeed_enable_sleep``), which
    is built for ZeRO-1/2; under ZeRO-3 they stay (a note says so; the plan shows whether the
    run fits)."""
    tokens = []
    stage = given.get("ds.zero_stage", [None])[0]
    if stage is not None:
        tokens += [t for role in ("actor", "critic")
                   for t in (f"--{role}.deepspeed.zero_stage", stage)]  # fmt: skip
    if _switch(given.get("ds.enable_sleep", ["False"])) == "True":
        if stage == "3":
            tokens.append(
                f"{_NOTE}--ds.enable_sleep under --ds.zero_stage 3 is accepted and has no "
                "effect here: the learners' states stay on the GPU (their offload is built for "
                "ZeRO-1/2); the engines still sleep with --vllm.enable_sleep"
            )
        else:
            tokens += ["--train.deepspeed_enable_sleep", "True"]
    return tokens


def _colocate(given: dict[str, list[str]]) -> list[str]:
    """``--train.colocate_all`` and ``--train.async_enable``: together they colocate the
    learner models only (OpenRLHF's meaning: the engines keep their own resources so that
    sampling runs ahead), here the reference beside the actor; alone, each is itself."""
    colocate = _switch(given.get("train.colocate_all", ["False"]))
    asynchronous = _switch(given.get("train.async_enable", ["False"]))
    tokens = []
    if "train.async_enable" in given:
        tokens += ["--train.async_enable", asynchronous]
    if colocate == "True" and asynchronous == "True":
        return [
            *tokens,
            "--train.colocate_actor_ref", "True",
            f"{_NOTE}--train.colocate_all with --train.async_enable colocates the learner "
            "models only, as in OpenRLHF: here the reference beside the actor (add "
            "--train.colocate_critic_reward for the reward model beside the critic); the "
            "engines keep their own resources",
        ]  # fmt: skip
    if "train.colocate_all" in given:
        tokens += ["--train.colocate_all", colocate]
    return tokens


def _ema(given: dict[str, list[str]]) -> list[str]:
    if _switch(given.get("train.enable_ema", ["False"])) != "True":
        return []
    beta = given.get("train.ema_beta", ["0.992"])[0]
    return ["--actor.optimizer.ema_decay", beta]


def _dynamic_batch(given: dict[str, list[str]]) -> list[str]:
    if _switch(given.get("train.dynamic_batch_enable", ["False"])) != "True":
        return []
    return [
        "--train.max_tokens_per_micro_batch",
        given.get("train.max_tokens_per_gpu", ["16192"])[0],
    ]


def _clip(given: dict[str, list[str]]) -> list[str]:
    low, high = given["actor.eps_clip_low_high"]
    return ["--algo.policy_loss.clip_eps_low", low, "--algo.policy_loss.clip_eps_high", high]


def _wandb_key(given: dict[str, list[str]]) -> list[str]:
    # The key is a credential: it goes to the environment W&B reads, never into config.json.
    import os

    os.environ["WANDB_API_KEY"] = given["logger.wandb.key"][0]
    return ["--train.use_wandb", "True"]


def _wandb_key_top(given: dict[str, list[str]]) -> list[str]:
    _wandb_key(given)
    return ["--use_wandb", "True"]


def _multiturn(given: dict[str, list[str]]) -> list[str]:
    key = given.get("data.input_key", ["input"])[0]
    if _switch(given.get("data.multiturn", ["False"])) == "True":
        return ["--messages_key", key]
    return ["--input_key", key]


def _margin(given: dict[str, list[str]]) -> list[str]:
    # OpenRLHF's reward dataset reads the margin from each row's "margin" field.
    on = _switch(given["model.margin_loss_enable"]) == "True"
    return ["--margin_key", "margin"] if on else []


def _ipo(given: dict[str, list[str]]) -> list[str]:
    return ["--loss_type", "ipo"] if _switch(given["model.ipo_enable"]) == "True" else []


def _ref_model(given: dict[str, list[str]]) -> list[str]:
    model = given.get("model.model_name_or_path", [""])[0]
    ref = given.get("ref.model_name_or_path", [model])[0]
    if ref != model:
        raise ConfigError(
            f"--ref.model_name_or_path {ref}: the DPO reference here is the initial model "
            f"(--model.model_name_or_path {model or '<not given>'}); give the same path or "
            "leave --ref.model_name_or_path out"
        )
    return ["--model.model.path", model] if model else []


FINISHERS: dict[str, Callable[[dict[str, list[str]]], list[str]]] = {
    **{f"ranks:{role}": _ranks(role) for role in ("actor", "critic", "ref", "reward")},
    "correction": _correction,
    "ema": _ema,
    "dynamic_batch": _dynamic_batch,
    "clip": _clip,
    "wandb_key": _wandb_key,
    "sleep": _sleep,
    "colocate": _colocate,
    "wandb_key_top": _wandb_key_top,
    "multiturn": _multiturn,
    "margin": _margin,
    "ipo": _ipo,
    "ref_model": _ref_model,
}
"""Each group of `Gathered` flags → the tokens it becomes once the line was read."""


def _switch(values: list[str]) -> str:
    return SWITCH_VALUES.get(values[0].lower(), values[0]) if values else "True"


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


def _take(args: Sequence[str], i: int, arity: Arity, inline: str | None) -> tuple[list[str], int]:
    """The values of the flag at ``args[i]`` and the index after them."""
    if inline is not None:
        return [inline], i + 1
    rest = list(args[i + 1 :])
    if arity == "switch":
        if rest and rest[0].lower() in SWITCH_VALUES:
            return [SWITCH_VALUES[rest[0].lower()]], i + 2
        return ["True"], i + 1
    if arity == "one":
        return rest[:1], i + 1 + len(rest[:1])
    if arity == "two":
        return rest[:2], i + 1 + len(rest[:2])
    values = []
    for token in rest:
        if token.startswith("--"):
            break
        values.append(token)
    return values, i + 1 + len(values)


def translate(args: Sequence[str], *, entry_point: str) -> Translated:
    """``args`` with the OpenRLHF flags of ``entry_point`` rewritten in our spelling.

    Raises `ConfigError` for a refused flag or value (naming the flag and what to use)."""
    table = TABLES[entry_point]
    out: list[str] = []
    tail: list[str] = []
    notices: list[str] = []
    gathered: dict[str, dict[str, list[str]]] = {}
    i = 0
    while i < len(args):
        token = args[i]
        name, eq, inline_value = (
            token[2:].partition("=") if token.startswith("--") else ("", "", "")
        )
        row = table.get(name) or EARLIER.get(entry_point, {}).get(name)
        if row is None or isinstance(row.entry, Same):
            out.append(token)
            i += 1
            continue
        values, i = _take(args, i, row.arity, inline_value if eq else None)
        wanted = {"one": 1, "two": 2}.get(row.arity)
        if (wanted and len(values) != wanted) or not values:
            raise ConfigError(f"--{name} takes {wanted or 'one or more'} value(s)")
        entry = row.entry
        if isinstance(entry, Refused):
            raise ConfigError(f"--{name}: {entry.message}")
        if isinstance(entry, Notice):
            notices.append(f"--{name} is accepted and has no effect here: {entry.message}")
        elif isinstance(entry, Gathered):
            gathered.setdefault(entry.group, {})[name] = values
        else:
            out += _aliased(name, entry, values)
    follow: dict[str, int] = {}
    for group, given in gathered.items():
        for token in FINISHERS[group](given):
            if token.startswith(_FOLLOW):
                role, _, count = token[len(_FOLLOW) :].partition("=")
                follow[role] = int(count)
            elif token.startswith(_NOTE):
                notices.append(token[len(_NOTE) :])
            else:
                (tail if group == "correction" else out).append(token)
    return Translated(out + tail, notices, follow)


def unknown_flag_problems(
    args: Sequence[str], *, entry_point: str, ours: frozenset[str]
) -> list[str]:
    """A message for each ``--flag`` of ``args`` that is neither ours (``ours``: the command's
    dotted fields) nor OpenRLHF's, with the nearest spellings of both."""
    import difflib

    theirs = set(TABLES[entry_point]) | set(EARLIER.get(entry_point, {}))
    problems = []
    for token in args:
        if not token.startswith("--") or token in ("--config", "--help", "--debug"):
            continue
        name = token[2:].partition("=")[0]
        if name in ours or name in theirs:
            continue
        near_ours = difflib.get_close_matches(name, sorted(ours), n=2, cutoff=0.75)
        near_theirs = difflib.get_close_matches(name, sorted(theirs), n=2, cutoff=0.75)
        rows = {**EARLIER.get(entry_point, {}), **TABLES[entry_point]}
        hints = [f"--{n}" for n in near_ours] + [
            f"--{n} (OpenRLHF's: {_meaning(rows[n])[0]})".replace("`", "") for n in near_theirs
        ]
        hint = f"; did you mean {' or '.join(hints)}?" if hints else ""
        problems.append(f"unknown flag --{name}{hint}")
    return problems


def check_ranks(follow: Mapping[str, int], *, actor: int, critic: int | None) -> None:
    """The reference runs on the actor's ranks and the reward model on the critic's (the
    actor's without a critic): a rank count given for them must be that one."""
    runs_on = {
        "ref": ("actor", actor),
        "reward": ("critic", critic) if critic else ("actor", actor),
    }
    for role, count in follow.items():
        owner, ranks = runs_on[role]
        if count != ranks:
            raise ConfigError(
                f"--{role}.num_nodes × --{role}.num_gpus_per_node = {count}, but the {role} runs "
                f"on the {owner}'s {ranks} rank(s) here: give the {owner} {count} ranks "
                f"(--{owner}.num_nodes/--{owner}.num_gpus_per_node) or leave the {role}'s out"
            )


def _aliased(name: str, entry: Alias, values: list[str]) -> list[str]:
    if isinstance(entry.values, Mapping):
        if values[0] not in entry.values:
            accepted = ", ".join(entry.values)
            raise ConfigError(f"--{name} {values[0]}: accepted here: {accepted}")
        values = [entry.values[values[0]]]
    elif entry.values is not None:
        values = entry.values(values)
    tokens: list[str] = []
    for target in entry.fields:
        tokens += [f"--{target}", *values]
    return tokens


def openrlhf_help(entry_point: str) -> str:
    """What ``--help`` lists after our flags: each OpenRLHF flag of ``entry_point`` and what
    it is here, one line each."""
    table = TABLES[entry_point]
    other = sorted(name for name, row in table.items() if not isinstance(row.entry, Same))
    lines = [
        f"OpenRLHF 0.11 {entry_point} flags read by this command ({len(table)}; the "
        f"{len(table) - len(other)} not listed are spelled as ours):"
    ]
    for name in other:
        lines.append(f"  --{name}  {_meaning(table[name])[0].replace('`', '')}")
    return "\n".join(lines)


def migration_markdown() -> str:
    """The README's migration section: every OpenRLHF flag and what it is here."""
    lines = []
    for entry_point, table in TABLES.items():
        lines += [
            f"#### `{entry_point}` → `{COMMANDS[entry_point]}` ({len(table)} flags)",
            "",
            "| OpenRLHF flag | here | default differs |",
            "|---|---|---|",
        ]
        for name in sorted(table):
            lines.append(_markdown_row(table[name]))
        lines.append("")
        earlier = EARLIER.get(entry_point, {})
        if earlier:
            names = ", ".join(f"`--{n}`" for n in sorted(earlier))
            lines += [f"Also read, as OpenRLHF 0.11.0 spelled them: {names}.", ""]
    return "\n".join(lines)


def _markdown_row(row: Row) -> str:
    here, default = _meaning(row)
    return f"| `--{row.name}` | {here.replace('|', '/')} | {default} |"


def _meaning(row: Row) -> tuple[str, str]:
    """What ``row``'s flag is here, and how its default differs ("" when it does not)."""
    entry = row.entry
    if isinstance(entry, Same):
        return "same", entry.default
    if isinstance(entry, Alias) and entry.fields:
        return ", ".join(f"`--{f}`" for f in entry.fields), entry.default
    if isinstance(entry, Alias):
        assert isinstance(entry.values, _OnlyValue)
        return f"only `{entry.values.value}`: {entry.values.why}", ""
    if isinstance(entry, Gathered):
        return f"with the other `{entry.group}` flags ({_GROUP_DOCS[entry.group]})", entry.default
    if isinstance(entry, Notice):
        return f"accepted, no effect: {entry.message}", ""
    return f"refused: {entry.message}", ""


_GROUP_DOCS = {
    **{f"ranks:{r}": f"`{r}` ranks = nodes × GPUs per node" for r in ("actor", "critic")},
    **{
        f"ranks:{r}": f"must equal the {f} ranks: the {r} runs on them"
        for r, f in (("ref", "actor's"), ("reward", "critic's"))
    },
    "correction": "`--algo.rollout_correction.*`: seq → sequence, clip → truncate",
    "ema": "`--actor.optimizer.ema_decay` = `--train.ema_beta` when enabled",
    "dynamic_batch": "`--train.max_tokens_per_micro_batch` when enabled",
    "clip": "`--algo.policy_loss.clip_eps_low`, `…_high`",
    "wandb_key": "sets `WANDB_API_KEY` (never written to config.json) and `--train.use_wandb`",
    "wandb_key_top": "sets `WANDB_API_KEY` (never written to config.json) and `--use_wandb`",
    "multiturn": "`--input_key`, or `--messages_key` with `--data.multiturn`",
    "margin": "`--margin_key margin` (OpenRLHF's margin field)",
    "ipo": "`--loss_type ipo`",
    "colocate": "each itself; together, the learner models only are colocated (OpenRLHF's "
    "meaning): `--train.colocate_actor_ref`",
    "sleep": "`--actor.deepspeed.zero_stage`, `--critic.deepspeed.zero_stage`; "
    "`--train.deepspeed_enable_sleep` under ZeRO-1/2 (under ZeRO-3 the learners' states stay, "
    "with a note)",
    "ref_model": "`--model.model.path`; the reference is the initial model, so a "
    "`--ref.model_name_or_path` must be the same path",
}


__all__ = [
    "COMMANDS",
    "FINISHERS",
    "TABLES",
    "Alias",
    "Gathered",
    "Notice",
    "Refused",
    "Row",
    "Same",
    "Translated",
    "check_ranks",
    "migration_markdown",
    "openrlhf_help",
    "translate",
    "unknown_flag_problems",
]


if __name__ == "__main__":  # python -m rlhf.cli.openrlhf: the README's migration section
    print(migration_markdown(), end="")
