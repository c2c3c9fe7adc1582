"""The rows of OpenRLHF's ``train_ppo_ray`` (`ppo_rows`)."""

from __future__ import annotations

from collections.abc import Sequence

from rlhf.cli.openrlhf.entries import (
    IMAGES,
    MOE,
    NORMALIZE,
    SCORERS,
    Arity,
    Entry,
    Gathered,
    Notice,
    Row,
    Same,
    alias,
    best_metric,
    comma_list,
    never_at_minus_one,
    off,
    only,
    steps_from_zero,
)
from rlhf.cli.openrlhf.rows_common import common_rows, optimizer_rows


def _roles(*suffixes: str, roles: Sequence[str] = ("actor", "critic")) -> tuple[str, ...]:
    return tuple(f"{role}.{suffix}" for role in roles for suffix in suffixes)


def ppo_rows() -> list[Row]:
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
    # Rollout correction: level, mode, threshold and gating.
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
    rows += common_rows(
        deepspeed=lambda name: both(f"deepspeed.{name}"),
        model=lambda name: both(f"model.{name}"),
        lora=lambda name: (f"actor.model.{name}",),
        ring=both("ring_attn_size"),
        top="train.",
        run_default="runs/<preset> here",
        liger=True,
    )
    for role in ("actor", "critic"):
        rows += optimizer_rows(f"{role}.", f"{role}.optimizer")
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
