"""The RL driver: rollout → experience → advantages → PPO epochs → verified weight sync.

One step (synchronous: generation and training alternate):

1. ``rollout.batch_size`` prompts → the engine pool, ``n_samples_per_prompt`` samples each,
   scored by the reward function (`rlhf.agents.SingleTurnExecutor`); with dynamic filtering,
   prompt groups whose mean score is outside the range are dropped and replaced from further
   prompts (three extra draws at most).
2. Experience: the reference's log-probs (KL), the critic's values (GAE), and the actor's own
   log-probs when more than one optimizer step follows a rollout (otherwise π_old is the
   policy itself and that forward pass is skipped).
3. Advantages (`rlhf.algos.compute_advantages`), then ``ppo_epochs`` passes of optimizer
   steps over mini-batches of ``train.batch_size`` samples, normalised exactly per step.
4. The actor's weights stream as buckets into Ray's object store and every engine loads and
   (``vllm.verify_sync``) verifies them.

``--train.async_enable`` overlaps generation of later batches with training through a bounded
queue (`rlhf.cli.schedule`); ``--train.colocate_all`` makes the engines and learners take turns
on the same devices (`rlhf.cli.hybrid`: engines asleep while training, learner states off the
device while generating). Every step appends a line to ``run_dir/metrics.jsonl``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import pathlib
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from rlhf.algos import (
    compute_advantages,
    dynamic_filter,
    kl_penalty,
    loss_normalizer,
    make_kl_controller,
    overlong_filter_mask,
    overlong_penalty,
    stop_properly_penalty,
)
from rlhf.cli.config import ConfigError, RLConfig
from rlhf.cli.data import PromptSampler, load_prompts
from rlhf.cli.hybrid import TurnTaking
from rlhf.cli.metrics import (
    MetricsLog,
    MetricsSink,
    Progress,
    Sinks,
    TensorBoardLog,
    WandbLog,
    plot_curves,
)
from rlhf.cli.placement import (
    Placement,
    describe,
    place,
    placement_group_of_this_process,
    plan_bundles,
)
from rlhf.cli.schedule import Rollout, run_asynchronous, run_synchronous
from rlhf.learner import (
    Batch,
    CriticObjective,
    LearnerConfig,
    PPOActorObjective,
    batch_logprobs,
    collate,
    iter_buckets,
    latest_checkpoint,
    sequence_scores,
    token_values,
)


def to_object_store(backend: Any, *, version: int, bucket_bytes: int) -> list[Any] | None:
    """On every actor rank (ZeRO-3 gathers are collective): rank 0 streams the sync's buckets
    into Ray's object store and returns ``(header, buffer_ref)`` pairs; other ranks None."""
    import ray

    pairs = []
    for header, buffer in iter_buckets(
        backend.named_full_parameters(), version=version, bucket_bytes=bucket_bytes, total=None
    ):
        if backend.rank == 0:
            pairs.append((header, ray.put(buffer.cpu().numpy())))
    for header, _ in pairs:
        header["total"] = len(pairs)
    return pairs if backend.rank == 0 else None


def _reward_scorer(config: RLConfig) -> Any:
    from rlhf.agents import FunctionReward, RemoteReward, RemoteRewardConfig, builtin_rewards

    train = config.train
    if train.remote_url:
        urls = tuple(u.strip() for u in train.remote_url.split(",") if u.strip())
        return RemoteReward(RemoteRewardConfig(urls=urls))
    if train.reward_func.startswith("builtin:"):
        name = train.reward_func.removeprefix("builtin:")
        func = getattr(builtin_rewards, name, None)
        if func is None or name.startswith("_"):
            raise ValueError(
                f"--train.reward_func={train.reward_func}: no such builtin; use exact_match, "
                "math_answer or boxed_format, or a Python file"
            )
        return FunctionReward(func, source=train.reward_func)
    return FunctionReward.from_file(train.reward_func)


def _engine_config(config: RLConfig, *, sleep: bool = False) -> Any:
    from rlhf.rollout import EngineConfig

    v = config.vllm
    return EngineConfig(
        model=config.actor.model.path,
        dtype=v.dtype,
        max_model_len=config.rollout.max_len,
        seed=config.train.seed,
        enforce_eager=v.enforce_eager,
        enable_prefix_caching=v.enable_prefix_caching,
        tensor_parallel_size=v.tensor_parallel_size,
        gpu_memory_utilization=v.gpu_memory_utilization,
        cpu_kv_cache_gib=v.cpu_kv_cache_gib,
        max_num_seqs=v.max_num_seqs,
        enable_sleep_mode=sleep,
    )


def _learner(role: Any, *, seed: int, total_steps: int, train: bool = True) -> LearnerConfig:
    optimizer = dataclasses.replace(role.optimizer, total_steps=max(total_steps, 1))
    return LearnerConfig(
        model=role.model,
        optimizer=optimizer if train else None,
        deepspeed=role.deepspeed,
        seed=seed,
    )


def plan(config: RLConfig) -> list[str]:
    """The derived plan printed before training."""
    r, t = config.rollout, config.train
    samples = r.batch_size * r.n_samples_per_prompt
    lines = [
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
        f"{config.vllm.tensor_parallel_size}; actor {config.actor.num_ranks} rank(s) "
        f"ZeRO-{config.actor.deepspeed.zero_stage}"
        + ("; reference 1 rank" if config.uses_reference else "")
        + ("; reward model 1 rank" if config.train.reward_model_path else "")
        + (
            " (reference/reward model: ZeRO-3, parameters offloaded to CPU)"
            if config.train.ref_reward_offload
            else ""
        )
        + (f"; critic {config.critic.num_ranks} rank(s)" if config.uses_critic else ""),
        describe(plan_bundles(config)),
        _mode(t),
    ]
    return lines


def _mode(t: Any) -> str:
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


@dataclasses.dataclass
class _Roles:
    engines: list[Any]
    pool: Any
    actor: Any
    ref: Any | None
    critic: Any | None
    reward_model: Any | None = None
    placement: Placement | None = None
    turns: TurnTaking | None = None

    def learner_groups(self) -> dict[str, Any]:
        groups = {
            "actor": self.actor,
            "ref": self.ref,
            "critic": self.critic,
            "reward_model": self.reward_model,
        }
        return {name: g for name, g in groups.items() if g is not None}

    def report_placement(self) -> dict[str, Any]:
        """Per role: the bundle each process was given and the placement group its process
        reports running in (None: resources of its own)."""
        import ray

        seen: dict[str, list[str | None]] = {
            name: group.run(placement_group_of_this_process)
            for name, group in self.learner_groups().items()
        }
        seen["engines"] = ray.get([e.handle.run.remote(_placement_in_engine) for e in self.engines])
        planned = self.placement
        return {
            name: {"bundles": planned.where(name) if planned else None, "placement_group": ids}
            for name, ids in seen.items()
        }

    def shutdown(self) -> None:
        for e in self.engines:
            e.shutdown()
        for g in self.learner_groups().values():
            g.shutdown()
        if self.placement is not None:
            self.placement.remove()


async def _placement_in_engine(engine: Any) -> str | None:
    return placement_group_of_this_process()


def _start(config: RLConfig, total_optimizer_steps: int) -> _Roles:
    import ray

    from rlhf.learner import LearnerGroup
    from rlhf.rollout import EnginePool, spawn_engines

    if not ray.is_initialized():
        ray.init(
            num_cpus=max(os.cpu_count() or 1, 8),
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": str(config.vllm.cpu_kv_cache_gib)}},
        )
    gpu = bool(ray.cluster_resources().get("GPU"))
    sleep = gpu and config.train.colocate_all and config.vllm.enable_sleep
    placement = place(config, gpu=gpu)
    engines = spawn_engines(
        _engine_config(config, sleep=sleep),
        config.vllm.num_engines,
        num_cpus=config.vllm.num_cpus,
        num_gpus=placement.gpus.get(
            "engines", float(config.vllm.tensor_parallel_size) if gpu else 0.0
        ),
        scheduling=placement.scheduling.get("engines"),
    )
    pool = EnginePool(engines, max_in_flight_per_engine=2 * config.vllm.max_num_seqs)

    def group(role: Any, name: str) -> Any:
        return LearnerGroup(
            num_ranks=role.num_ranks,
            num_cpus_per_rank=role.num_cpus_per_rank,
            num_gpus_per_rank=placement.gpus.get(name, role.num_gpus_per_rank) if gpu else 0.0,
            scheduling=placement.scheduling.get(name),
        )

    seed = config.train.seed
    actor = group(config.actor, "actor")
    actor.build(_learner(config.actor, seed=seed, total_steps=total_optimizer_steps))
    ref = None
    if config.uses_reference:
        role = _eval_only(config.actor, config)
        ref = group(role, "ref")
        ref.build(_learner(role, seed=seed, total_steps=1, train=False))
    critic = None
    if config.uses_critic:
        role = config.critic
        if not role.model.path:
            role = dataclasses.replace(
                role, model=dataclasses.replace(role.model, path=config.actor.model.path)
            )
        role = dataclasses.replace(role, model=dataclasses.replace(role.model, kind="scalar"))
        critic = group(role, "critic")
        critic.build(_learner(role, seed=seed, total_steps=total_optimizer_steps))
    reward_model = None
    if config.train.reward_model_path:
        from rlhf.learner import ModelConfig

        scorer = dataclasses.replace(
            _eval_only(config.actor, config),
            model=ModelConfig(
                path=config.train.reward_model_path,
                kind="scalar",
                packing_samples=config.actor.model.packing_samples,
            ),
        )
        reward_model = group(scorer, "reward_model")
        reward_model.build(_learner(scorer, seed=seed, total_steps=1, train=False))
    turns = None
    if config.train.colocate_all:
        turns = TurnTaking(
            engines=engines,
            learners=[g for g in (actor, critic) if g is not None],
            sleep_engines=sleep,
            offload_learners=config.offloads_learners(gpu=gpu),
        )
    return _Roles(engines, pool, actor, ref, critic, reward_model, placement, turns)


def _eval_only(role: Any, config: RLConfig) -> Any:
    """The reference's / reward model's role: one rank like the actor's, with ZeRO-3 and its
    parameters offloaded to the CPU between uses under ``--train.ref_reward_offload``."""
    role = dataclasses.replace(role, num_ranks=1)
    if not config.train.ref_reward_offload:
        return role
    ds = dataclasses.replace(role.deepspeed, zero_stage=3, offload_params=True)
    # ZeRO-3 shards lm_head outside its forward: the offloaded reference takes the logits path.
    model = dataclasses.replace(role.model, chunked_lm_head=False)
    return dataclasses.replace(role, deepspeed=ds, model=model)


def _assemble(pairs: list[tuple[list[int], torch.Tensor]], batch: Batch) -> torch.Tensor:
    """Per-micro-batch (rows, (b, l) tensor) results → one (B, L) tensor in row order."""
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    for rows, values in pairs:
        out[rows, : values.shape[1]] = values.float()
    return out


def _forward(group: Any, batch: Batch, fn: Callable[..., Any], config: RLConfig) -> torch.Tensor:
    t = config.train
    return _assemble(
        group.forward(
            batch,
            fn,
            max_rows=t.micro_batch_size,
            max_tokens=t.max_tokens_per_micro_batch or None,
        ),
        batch,
    )


def _logprob_fn(temperature: float) -> Callable[..., torch.Tensor]:
    def fn(model: Any, b: Batch) -> torch.Tensor:
        return batch_logprobs(model, b, temperature=temperature)[0]

    return fn


def _values(model: Any, b: Batch) -> torch.Tensor:
    return token_values(model, b.input_ids, b.attention_mask, packing_samples=b.packing_samples)


def _scores(model: Any, b: Batch) -> torch.Tensor:
    return sequence_scores(model, b.input_ids, b.attention_mask, packing_samples=b.packing_samples)


def _row_scores(group: Any, batch: Batch, config: RLConfig) -> torch.Tensor:
    out = torch.zeros(batch.size)
    t = config.train
    for rows, scores in group.forward(
        batch, _scores, max_rows=t.micro_batch_size, max_tokens=t.max_tokens_per_micro_batch or None
    ):
        out[rows] = scores
    return out


async def _evaluate(
    executor_for: Callable[..., Any], prompts: dict[str, list[Any]], config: RLConfig
) -> dict[str, float]:
    out: dict[str, float] = {}
    k = config.eval.n_samples
    for name, items in prompts.items():
        items = items[: config.eval.max_prompts]
        executor = executor_for(config.eval.temperature)
        result = await executor.run(
            prompts=[p.text for p in items], labels=[p.label for p in items], n_samples_per_prompt=k
        )
        scores: dict[int, list[float]] = {}
        for t in result.trajectories:
            scores.setdefault(t.prompt_index, []).append(float(t.score))
        per_prompt = [scores.get(i, [0.0]) for i in range(len(items))]
        out[f"eval/{name}/pass@1"] = sum(sum(s) / len(s) for s in per_prompt) / len(per_prompt)
        out[f"eval/{name}/pass@{k}"] = sum(max(s) > 0 for s in per_prompt) / len(per_prompt)
    return out


def run_rl(config: RLConfig, *, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``rlhf train <algorithm>``; returns the last step's metrics and the evaluations."""
    from transformers import AutoTokenizer

    from rlhf.agents import SamplingParams, SingleTurnExecutor
    from rlhf.learner import check_model_dir

    config.validate()
    check_model_dir(config.actor.model.path)
    if config.uses_critic and config.critic.model.path:
        check_model_dir(config.critic.model.path)
    if config.train.reward_model_path:
        check_model_dir(config.train.reward_model_path)
    run_dir = pathlib.Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=1))
    for line in plan(config):
        echo(f"[plan] {line}")
    torch.manual_seed(config.train.seed)
    tokenizer = AutoTokenizer.from_pretrained(config.actor.model.path)
    train_prompts = load_prompts(config.data.prompt_data, config.data, tokenizer)
    eval_prompts = (
        load_prompts(config.data.eval_data, config.data, tokenizer) if config.data.eval_data else {}
    )
    sampler = PromptSampler(
        train_prompts, probs=config.data.prompt_data_probs, seed=config.train.seed
    )
    reward = _reward_scorer(config)
    user_agent = agent_module(config) if config.train.agent_func_path else None
    sinks: list[MetricsSink] = [MetricsLog(run_dir / "metrics.jsonl")]
    t = config.train
    try:
        if t.use_tensorboard:
            sinks.append(TensorBoardLog(pathlib.Path(t.use_tensorboard)))
        if t.use_wandb:
            sinks.append(
                WandbLog(
                    run_dir,
                    config=dataclasses.asdict(config),
                    project=t.wandb_project,
                    group=t.wandb_group,
                    name=t.wandb_run_name,
                    entity=t.wandb_org,
                    resume=config.ckpt.load_enable,
                )
            )
    except (ImportError, RuntimeError) as exc:
        raise ConfigError(str(exc)) from exc
    log = Sinks(sinks)
    r = config.rollout
    total_opt_steps = config.train.num_steps * config.optimizer_steps_per_rollout
    roles = _start(config, total_opt_steps)
    if roles.turns is not None:
        echo(f"[plan] {roles.turns.describe()}")
    kl_ctl = make_kl_controller(config.algo.kl)

    agents: dict[float, Any] = {}

    def executor_for(temperature: float, *, train: bool = False) -> Any:
        sampling = SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            stop_token_ids=(tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else (),
        )
        if train and config.train.agent_func_path:
            if temperature not in agents:  # the user's file is imported once
                agents[temperature] = agent_executor(
                    config, user_agent, tokenizer=tokenizer, generator=roles.pool, sampling=sampling
                )
            return agents[temperature]
        return SingleTurnExecutor(
            tokenizer=tokenizer,
            generator=roles.pool,
            reward=reward,
            sampling=sampling,
            max_len=r.max_len,
        )

    driver = _Driver(
        config=config,
        roles=roles,
        sampler=sampler,
        executor_for=executor_for,
        kl_ctl=kl_ctl,
        log=log,
        eval_prompts=eval_prompts,
        ckpt_root=run_dir / "checkpoints",
        echo=echo,
    )
    try:
        (run_dir / "placement.json").write_text(json.dumps(roles.report_placement(), indent=1))
        start, queue = driver.resume() if config.ckpt.load_enable else (0, [])
        driver.progress = Progress(total=config.train.num_steps, start=start)
        asyncio.run(driver.run(start, queue))
        driver.enter("training", record=False)  # the learners' states back on the device
        if config.ckpt.export_hf:
            roles.actor.export_hf(str(run_dir / "final"))
            _copy_tokenizer(tokenizer, run_dir / "final")
        plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
        return {"last": driver.last, "evaluations": driver.evaluations}
    finally:
        log.close()
        roles.shutdown()


@dataclasses.dataclass
class _Driver:
    """One run's state; implements `rlhf.cli.schedule.StepRunner`."""

    config: RLConfig
    roles: _Roles
    sampler: PromptSampler
    executor_for: Callable[..., Any]
    kl_ctl: Any
    log: MetricsSink
    eval_prompts: dict[str, list[Any]]
    ckpt_root: pathlib.Path
    echo: Callable[[str], None]
    progress: Progress | None = None
    last: dict[str, Any] = dataclasses.field(default_factory=dict)
    evaluations: list[dict[str, float]] = dataclasses.field(default_factory=list)
    trained_sampler_state: dict[str, Any] = dataclasses.field(default_factory=dict)
    hybrid_metrics: dict[str, float] = dataclasses.field(default_factory=dict)

    def enter(self, phase: str, *, record: bool = True) -> None:
        """Hybrid placement: move engines and learners to ``phase`` (`rlhf.cli.hybrid`);
        with ``record``, its metrics join the step's."""
        if self.roles.turns is not None:
            metrics = self.roles.turns.enter(phase)
            if record:
                self.hybrid_metrics.update(metrics)

    def resume(self) -> tuple[int, list[Rollout]]:
        """Restore the newest checkpoint, if any: the step to start at and the rollouts it
        holds for later steps (async mode)."""
        latest = latest_checkpoint(self.ckpt_root)
        if latest is None:
            return 0, []
        state = self.roles.actor.load(str(latest))
        if self.roles.critic is not None:
            self.roles.critic.load(str(self.ckpt_root / "critic" / latest.name))
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctl.load_state_dict(state["kl_controller"])
        start = int(state["step"])
        self.sync(start, pause=False)
        queue = [Rollout.from_state(q) for q in state.get("queue", [])]
        self.echo(
            f"[resume] from {latest} at step {start}"
            + (f", {len(queue)} sampled batch(es) restored" if queue else "")
        )
        return start, queue

    async def run(self, start: int, queue: list[Rollout]) -> None:
        c = self.config
        self.enter("generation")
        if self.eval_prompts and c.eval.steps and start == 0:
            await self.evaluate(0)
        if c.train.async_enable:
            await run_asynchronous(
                self,
                start=start,
                end=c.train.num_steps,
                queue=queue,
                queue_size=c.train.async_queue_size,
                partial_rollouts=c.train.partial_rollout_enable,
            )
        else:
            await run_synchronous(self, start=start, end=c.train.num_steps, queue=queue)

    def generate(self, step: int) -> Awaitable[Rollout]:
        executor = self.executor_for(self.config.rollout.temperature, train=True)
        return _generate(step, self.config, self.sampler, executor)

    def learn(self, rollout: Rollout) -> dict[str, Any]:
        self.trained_sampler_state = rollout.sampler_state
        self.enter("training")
        return _learn(rollout.step, rollout, self.config, self.roles, self.kl_ctl)

    def sync(self, version: int, *, pause: bool) -> dict[str, Any]:
        engines = self.roles.engines
        paused = sum(int(e.call("pause")) for e in engines) if pause else 0
        self.enter("sync")
        try:
            _sync(self.roles, self.config, version=version)
        finally:
            for e in engines if pause else ():
                e.call("resume")
        self.enter("generation")
        return {"rollout/requests_paused_for_sync": float(paused)} if pause else {}

    def saves_at(self, step: int) -> bool:
        every = self.config.ckpt.save_steps
        return bool(every and (step + 1) % every == 0) or step + 1 == self.config.train.num_steps

    async def evaluate(self, step: int) -> None:
        result = await _evaluate(self.executor_for, self.eval_prompts, self.config)
        self.evaluations.append({"step": step, **result})
        self.log.write(self.evaluations[-1])
        self.echo(_line(self.evaluations[-1]))

    async def finish(self, step: int, metrics: dict[str, Any], queue: list[Rollout]) -> None:
        c = self.config
        metrics.update(self.hybrid_metrics)
        self.hybrid_metrics = {}
        metrics["step"] = step + 1
        self.last = metrics
        self.log.write(metrics)
        if self.progress is not None:
            self.echo(self.progress.line(step + 1, metrics))
        self.echo(_line(metrics))
        last = step + 1 == c.train.num_steps
        if self.eval_prompts and c.eval.steps and ((step + 1) % c.eval.steps == 0 or last):
            await self.evaluate(step + 1)
        if self.saves_at(step):
            await asyncio.to_thread(self.save, step, queue)

    def save(self, step: int, queue: list[Rollout]) -> None:
        # The sampler resumes after the newest batch already drawn, trained or queued.
        newest = queue[-1].sampler_state if queue else self.trained_sampler_state
        state = {
            "step": step + 1,
            "sampler": newest,
            "kl_controller": self.kl_ctl.state_dict(),
            "queue": [r.to_state() for r in queue],
        }
        keep = self.config.ckpt.keep
        self.enter("training", record=False)  # DeepSpeed saves the states from the device
        path = self.roles.actor.save(str(self.ckpt_root), step + 1, client_state=state, keep=keep)
        if self.roles.critic is not None:
            self.roles.critic.save(
                str(self.ckpt_root / "critic"), step + 1, client_state=state, keep=keep
            )
        self.enter("generation", record=False)
        self.echo(f"[ckpt] {path}")


def _copy_tokenizer(tokenizer: Any, directory: pathlib.Path) -> None:
    if directory.is_dir():
        tokenizer.save_pretrained(directory)


def _line(metrics: dict[str, Any]) -> str:
    keys = [
        k
        for k in metrics
        if k == "step"
        or k.startswith(("reward/", "eval/", "time/"))
        or k in ("rollout/response_length_mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy")
    ]
    return "  ".join(
        f"{k}={metrics[k]:.4g}" if isinstance(metrics[k], float) else f"{k}={metrics[k]}"
        for k in keys
    )


def _sync(roles: _Roles, config: RLConfig, *, version: int) -> None:
    refs = roles.actor.run(
        functools.partial(to_object_store, version=version, bucket_bytes=64 << 20)
    )[0]
    for engine in roles.engines:
        engine.update_weights(refs, verify=config.vllm.verify_sync)


async def _generate(step: int, config: RLConfig, sampler: PromptSampler, executor: Any) -> Rollout:
    """Draw the prompts of ``step`` and sample them (with dynamic filtering's replacement
    draws); the engines serve whatever weights they hold."""
    r, algo = config.rollout, config.algo
    tick = time.perf_counter()
    trajectories: list[Any] = []
    gen_metrics: dict[str, float] = {}
    dropped_groups = 0
    digest = 0
    for attempt in range(4 if algo.dynamic_filtering_enable else 1):
        need = r.batch_size - len(trajectories) // r.n_samples_per_prompt
        if need <= 0:
            break
        prompts = sampler.next(need)
        digest = zlib.crc32("\x00".join(p.text for p in prompts).encode(), digest)
        result = await executor.run(
            prompts=[p.text for p in prompts],
            labels=[p.label for p in prompts],
            n_samples_per_prompt=r.n_samples_per_prompt,
        )
        gen_metrics = result.metrics if attempt == 0 else gen_metrics
        groups = _complete_groups(result.trajectories, r.n_samples_per_prompt)
        if algo.dynamic_filtering_enable:
            scores = torch.tensor([float(tr.score) for g in groups for tr in g])
            keep = (
                dynamic_filter(
                    scores,
                    n_samples_per_prompt=r.n_samples_per_prompt,
                    score_range=algo.dynamic_filtering_range,
                ).keep_groups.tolist()
                if groups
                else []
            )
            dropped_groups += len(groups) - sum(keep)
            groups = [g for g, k in zip(groups, keep, strict=True) if k]
        trajectories += [tr for g in groups for tr in g]
    trajectories = trajectories[: r.batch_size * r.n_samples_per_prompt]
    if not trajectories:
        raise RuntimeError(
            "every prompt group was dropped (dynamic filtering or the reward's skip policy); "
            "widen --algo.dynamic_filtering_range or check the reward function"
        )
    metrics: dict[str, Any] = {
        "rollout/dropped_groups": float(dropped_groups),
        "data/prompts_crc32": digest,
        **{
            k: float(v)
            for k, v in gen_metrics.items()
            if k.startswith(("rollout/truncated", "reward/", "env/"))
        },
        "time/generation_s": time.perf_counter() - tick,
    }
    return Rollout(
        step=step,
        trajectories=trajectories,
        metrics=metrics,
        sampler_state=sampler.state_dict(),
    )


def _learn(
    step: int, rollout: Rollout, config: RLConfig, roles: _Roles, kl_ctl: Any
) -> dict[str, Any]:
    """Experience, advantages and the PPO epochs of ``step`` on ``rollout`` (blocking).

    In async mode π_old is the actor before this step's update (a forward pass), not the
    sampler: the batch may come from older weights, whose log-probs the rollout carries for
    the importance correction (``--algo.rollout_correction``)."""
    r, algo, t = config.rollout, config.algo, config.train
    timings: dict[str, float] = {}
    trajectories = rollout.trajectories

    tick = time.perf_counter()
    batch = collate(
        [tr.token_ids for tr in trajectories],
        pad_token_id=0,
        per_token={
            "action_mask": [tr.action_mask for tr in trajectories],
            "rollout_logprobs": [tr.rollout_logprobs for tr in trajectories],
        },
    )
    if roles.reward_model is not None:  # the reward model scores prompt + response
        raw_rewards = _row_scores(roles.reward_model, batch, config)
    else:
        raw_rewards = torch.tensor([float(tr.reward) for tr in trajectories])
    rewards = raw_rewards
    truncated = torch.tensor([bool(tr.truncated) for tr in trajectories])
    lengths = batch["action_mask"].sum(dim=1)
    if algo.overlong_buffer_len is not None:
        rewards = rewards + overlong_penalty(
            response_lengths=lengths,
            max_new_tokens=r.max_new_tokens,
            buffer_len=algo.overlong_buffer_len,
            penalty_factor=algo.overlong_penalty_factor,
        )
    if algo.stop_properly_penalty_coef is not None:
        rewards = stop_properly_penalty(
            rewards, truncated=truncated, coef=algo.stop_properly_penalty_coef
        )
    if algo.overlong_filtering:
        batch.fields["action_mask"] = overlong_filter_mask(
            batch["action_mask"], truncated=truncated
        )
    mask = batch["action_mask"]
    kl_coef = kl_ctl.value
    multi_step = config.optimizer_steps_per_rollout > 1 or t.async_enable
    if multi_step:
        batch.fields["old_logprobs"] = _forward(
            roles.actor, batch, _logprob_fn(r.temperature), config
        )
    kl = None
    step0_gap = float("nan")
    if roles.ref is not None:
        batch.fields["ref_logprobs"] = _forward(
            roles.ref, batch, _logprob_fn(r.temperature), config
        )
        if step == 0:
            # Before any update the trainer's policy is the reference: their log-probs must
            # agree (the rollout's differ by the engine's numerics; actor/rollout_* reports that).
            policy = batch.fields.get("old_logprobs")
            if policy is None:
                policy = _forward(roles.actor, batch, _logprob_fn(r.temperature), config)
            step0_gap = float(((policy - batch["ref_logprobs"]).abs() * mask).max())
        current = batch.fields.get("old_logprobs", batch["rollout_logprobs"])
        kl = kl_penalty(
            logprobs=current,
            ref_logprobs=batch["ref_logprobs"],
            action_mask=mask,
            estimator=algo.kl.estimator,
        )
    values = None
    if roles.critic is not None:
        values = _forward(roles.critic, batch, _values, config)
        batch.fields["old_values"] = values
    adv = compute_advantages(
        config=algo.advantage,
        rewards=rewards,
        action_mask=mask,
        n_samples_per_prompt=r.n_samples_per_prompt,
        values=values,
        kl=None if algo.kl.use_loss else kl,
        kl_coef=0.0 if algo.kl.use_loss else kl_coef,
    )
    batch.fields["advantages"] = adv.advantages
    batch.fields["returns"] = adv.returns
    timings["time/experience_s"] = time.perf_counter() - tick

    tick = time.perf_counter()
    per_step = t.batch_size or batch.size
    train_metrics: dict[str, float] = {}
    for _ in range(t.ppo_epochs):
        for start in range(0, batch.size, per_step):
            part = batch.select(range(start, min(start + per_step, batch.size)))
            m = part["action_mask"]
            norm = float(loss_normalizer(m, mode=algo.loss_agg_mode, max_len=algo.loss_agg_max_len))
            split = {
                "max_rows": t.micro_batch_size,
                "max_tokens": t.max_tokens_per_micro_batch or None,
            }
            out = roles.actor.train_step(
                part,
                PPOActorObjective(
                    algo=algo, normalizer=norm, kl_coef=kl_coef, temperature=r.temperature
                ),
                **split,
            )
            train_metrics.update({f"actor/{k}" if "/" not in k else k: v for k, v in out.items()})
            if roles.critic is not None:
                out = roles.critic.train_step(
                    part, CriticObjective(algo=algo, normalizer=norm), **split
                )
                train_metrics.update(
                    {f"critic/{k}" if "/" not in k else k: v for k, v in out.items()}
                )
    timings["time/training_s"] = time.perf_counter() - tick

    if kl is not None:
        mean_kl = float((kl * mask).sum() / mask.sum().clamp(min=1))
        if step == 0:
            train_metrics["check/step0_policy_ref_logprob_gap_max"] = step0_gap
        kl_ctl.update(current_kl=mean_kl, n_steps=batch.size)
        train_metrics["kl/mean"] = mean_kl
        train_metrics["kl/coef"] = kl_coef
    return {
        "reward/mean": float(raw_rewards.mean()),
        "reward/std": float(raw_rewards.std()) if raw_rewards.numel() > 1 else 0.0,
        "reward/shaped_mean": float(rewards.mean()),
        "rollout/response_length_mean": float(lengths.float().mean()),
        "rollout/samples": float(batch.size),
        "rollout/truncated_frac": float(truncated.float().mean()),
        **_staleness(step, trajectories),
        **rollout.metrics,
        **{k: float(v) for k, v in adv.metrics.items()},
        **train_metrics,
        **timings,
    }


def agent_module(config: RLConfig) -> Any:
    """The imported ``--train.agent_func_path`` file, or a `ConfigError` when it defines
    neither an ``Environment`` class nor an ``agent`` function."""
    from rlhf.agents.loading import load_module

    path = config.train.agent_func_path
    try:
        module = load_module(path, purpose="--train.agent_func_path")
    except (OSError, ValueError, ImportError) as exc:
        raise ConfigError(str(exc)) from exc
    if not hasattr(module, "Environment") and not callable(getattr(module, "agent", None)):
        raise ConfigError(
            f"--train.agent_func_path {path!r} defines neither an `Environment` class "
            "(multi-turn environment) nor an `agent` function (OpenAI-client agent)"
        )
    return module


def agent_executor(
    config: RLConfig, module: Any, *, tokenizer: Any, generator: Any, sampling: Any
) -> Any:
    """The executor of ``--train.agent_func_path``: an ``Environment`` class runs token-in,
    token-out multi-turn episodes; an ``agent`` function talks to the policy through an
    OpenAI-compatible server on 127.0.0.1."""
    from rlhf.agents import EnvironmentFactory, MultiTurnExecutor, OpenAIAgentExecutor

    path = config.train.agent_func_path
    if hasattr(module, "Environment"):
        return MultiTurnExecutor(
            tokenizer=tokenizer,
            generator=generator,
            environments=EnvironmentFactory(
                module.Environment, source=f"environment Environment in {path}"
            ),
            sampling=sampling,
            max_len=config.rollout.max_len,
            max_turns=config.train.agent_max_turns,
        )
    return OpenAIAgentExecutor(
        agent=module.agent,
        source=f"agent in {path}",
        tokenizer=tokenizer,
        generator=generator,
        sampling=sampling,
        max_len=config.rollout.max_len,
    )


def _staleness(step: int, trajectories: list[Any]) -> dict[str, float]:
    """How many updates behind the trained policy (version ``step``) each sample's weights
    were: mean and max over the samples whose engine reported a version."""
    behind = [step - t.weight_version for t in trajectories if t.weight_version is not None]
    if not behind:
        return {}
    return {
        "rollout/staleness_mean": sum(behind) / len(behind),
        "rollout/staleness_max": float(max(behind)),
    }


def _complete_groups(trajectories: list[Any], n: int) -> list[list[Any]]:
    """Trajectories grouped by prompt, keeping only groups with all ``n`` samples (a reward's
    skip policy can drop samples)."""
    groups: dict[int, list[Any]] = {}
    for tr in trajectories:
        groups.setdefault(tr.prompt_index, []).append(tr)
    return [g for _, g in sorted(groups.items()) if len(g) == n]
