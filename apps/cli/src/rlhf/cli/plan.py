"""The plan ``rlhf train`` prints before it starts anything: what one step does and where
each role runs."""

from __future__ import annotations

from rlhf.cli.backends import backend_of
from rlhf.cli.config import RLConfig
from rlhf.cli.placement import describe, describe_nodes, plan_bundles
from rlhf.cli.sections import RoleConfig, TrainConfig


def plan(config: RLConfig) -> list[str]:
    """The derived plan, one line per topic."""
    r, t = config.rollout, config.train
    samples = r.batch_size * r.n_samples_per_prompt
    processes = config.processes()
    return [
        f"prompts/step {r.batch_size}, samples/step {samples} "
        f"({r.n_samples_per_prompt} per prompt), max new tokens {r.max_new_tokens}",
        f"optimizer steps/rollout {config.optimizer_steps_per_rollout} "
        f"(train.batch_size {t.batch_size or samples}, ppo_epochs {t.ppo_epochs}), "
        f"micro-batches of {t.micro_batch_size} rows"
        + (f" / {t.max_tokens_per_micro_batch} tokens" if t.max_tokens_per_micro_batch else "")
        + (", padding-free (packed)" if config.actor.model.packing_samples else ""),
        f"estimator {config.algo.advantage.estimator}, policy loss {config.algo.policy_loss.name}, "
        f"aggregation {config.algo.loss_agg_mode}, KL β {config.algo.kl.init_coef} "
        f"({'loss' if config.algo.kl.use_loss else 'reward'}, {config.algo.kl.estimator})",
        f"placement: {config.vllm.num_engines} vLLM engine(s) x TP "
        f"{config.vllm.tensor_parallel_size}"
        + (
            f" x PP {config.vllm.pipeline_parallel_size}"
            if config.vllm.pipeline_parallel_size > 1
            else ""
        )
        + f"; actor {config.actor.num_ranks} rank(s) "
        f"{trains_on(config.actor)}"
        + ("; reference 1 rank" if config.uses_reference else "")
        + ("; reward model 1 rank" if config.train.reward_model_path else "")
        + (
            " (reference/reward model: ZeRO-3, parameters offloaded to CPU)"
            if config.train.ref_reward_offload
            else ""
        )
        + (
            f"; critic {config.critic.num_ranks} rank(s) {trains_on(config.critic)}"
            if config.uses_critic
            else ""
        ),
        describe(plan_bundles(processes)),
        *filter(None, [describe_nodes(processes)]),
        mode(t),
    ]


def trains_on(role: RoleConfig) -> str:
    """``ZeRO-<stage>`` (the deepspeed backend) or ``FSDP2 (molt, <param dtype>)``, with
    ``, dp <n> x tp <m>`` when the model is split over tensor-parallel ranks (``, sequence
    parallel`` when the sequence is split too), ``, dp <n> x cp <m>`` when each row's sequence
    is split over context-parallel ranks, and ``, compiled`` with ``fsdp.compile``; on
    DeepSpeed ``, dp <n> x ring <m>`` with ring attention, ``, dp <n> x tp <m> (AutoTP)`` with
    ``deepspeed.tp_size`` and ``, DeepCompile`` with ``deepspeed.deepcompile``."""
    return backend_of(role).describe()


def mode(t: TrainConfig) -> str:
    """Synchronous or asynchronous, and the staleness that follows."""
    if not t.async_enable:
        return "mode: synchronous (generation and training alternate), expected staleness 0"
    q = t.async_queue_size
    if t.partial_rollout_enable:
        return (
            f"mode: asynchronous, up to {q} batch(es) sampled ahead; partial rollouts (syncs "
            f"pause the engines, requests in flight finish on new weights): staleness <= {q}"
        )
    return (
        f"mode: asynchronous, up to {q} batch(es) sampled ahead of training; staleness "
        f"exactly {q} from step {q} on (batch j is sampled with the weights of step j-{q})"
    )
