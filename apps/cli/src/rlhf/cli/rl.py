"""``rlhf train <algorithm>``: the RL recipe.

One step, in the order the data flows::

    prompts ─► generate (engines, executor, reward; dynamic filtering)      rlhf.cli.sampling
            ─► make_experience (RM scores, shaping, π_old, π_ref, values,
                                advantages)                                   rlhf.learner
            ─► ppo_update (actor and critic epochs)                           rlhf.learner
            ─► weight sync (actor ─► every engine over the placement's
                            transport, verified)                              rlhf.cli.sync

`rlhf.rollout.schedule` decides when each part runs (synchronous, or asynchronous with a bounded
queue of rollouts), `rlhf.cli.roles` starts the processes where `rlhf.cli.placement` puts them,
and `rlhf.learner.hybrid` moves memory between engines and learners under ``--train.colocate_all``.
Every step appends a line to ``run_dir/metrics.jsonl``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
import time
from collections.abc import Callable
from typing import Any

import torch
from ray.exceptions import RayActorError

from rlhf.algos import make_kl_controller
from rlhf.cli.best import BestModel, check_metric
from rlhf.cli.cluster import start_ray, start_ray_early
from rlhf.cli.config import RLConfig, RunError, raise_problems
from rlhf.cli.dry_run import plan
from rlhf.cli.dumps import needs_engines, open_dumps
from rlhf.cli.faults import actor_died, resume_hint
from rlhf.cli.metrics import MetricsSink, Progress, open_sinks, plot_curves, summary_line
from rlhf.cli.resume import check_resume
from rlhf.cli.revive import enable_revival
from rlhf.cli.roles import Roles, start_roles
from rlhf.cli.sampling import Executors, check_user_files, group_filter
from rlhf.cli.sections import TrainConfig
from rlhf.cli.startup import Stopwatch
from rlhf.cli.stopping import Stopped, as_stopped
from rlhf.cli.sync import bucket_mib, choose_transport
from rlhf.cli.trainer_state import save_hf_at
from rlhf.cli.validation import teacher_vocabulary_problems
from rlhf.learner import MicroBatching, Samples, make_experience, ppo_update
from rlhf.learner.prompts import Prompt, PromptSampler, check_prompts, prompt_sources
from rlhf.rollout import EngineDiedError, RolloutDump
from rlhf.rollout.sampling import EmptyStepError, evaluate, sample_step, staleness
from rlhf.rollout.schedule import Rollout, run_asynchronous, run_synchronous
from rlhf.weights import Transport, engine_sync_parts, open_transport, sync_report


def steps_of_episodes(config: RLConfig, *, echo: Callable[[str], None] = print) -> RLConfig:
    """``config`` with ``--train.num_episodes E`` (> 0) turned into ``--train.num_steps``:
    ``E · (prompts // --rollout.batch_size)`` (at least 1), counted over the prompt sources
    as they load (``--data.max_samples`` each); the plan line says so."""
    episodes = config.train.num_episodes
    if not episodes:
        return config
    from rlhf.learner.datasets import count_rows

    prompts = count_rows(config.data.prompt_data, max_samples=config.data.max_samples)
    steps = max(1, episodes * (prompts // config.rollout.batch_size))
    echo(
        f"[plan] --train.num_episodes {episodes}: {prompts} prompts / --rollout.batch_size "
        f"{config.rollout.batch_size} -> {steps} steps"
    )
    train = dataclasses.replace(config.train, num_steps=steps, num_episodes=0)
    return dataclasses.replace(config, train=train)


def run_rl(
    config: RLConfig,
    *,
    echo: Callable[[str], None] = print,
    stopwatch: Stopwatch | None = None,
) -> dict[str, Any]:
    """Run ``rlhf train <algorithm>``; returns the last step's metrics and the evaluations.

    ``stopwatch`` times the start-up (`rlhf.cli.startup`; a fresh one from this call when
    None); its record goes to ``run_dir/startup.json`` after the first step."""
    from rlhf.learner import check_model_dir

    if config.eval.eval_only:
        return run_eval_only(config.validate().with_absolute_paths(), echo=echo)
    watch = stopwatch or Stopwatch(since_process_start=False)
    config = steps_of_episodes(config.validate().with_absolute_paths(), echo=echo)
    for path in config.model_dirs():
        check_model_dir(path)
    raise_problems(teacher_vocabulary_problems(config), where="the teachers")
    dump, replay = open_dumps(config)
    check_user_files(
        reward=config.resolved_reward(),
        agent_path=config.train.agent_func_path,
        policy_path=config.actor.model.path,
    )
    # Ray's processes start while this one imports and reads the tokenizer and prompts.
    start_ray_early(address=config.ray.address)
    from transformers import AutoTokenizer

    run_dir = pathlib.Path(config.run_dir)
    resolved = write_run_config(config)
    for line in plan(config):
        echo(f"[plan] {line}")
    if replay is not None:
        echo(f"[plan] replay: training on the rollouts of {replay.directory}, sampling none")
    if dump is not None:
        echo(f"[plan] dump: every step's rollout to {dump.directory}")
    resume_from = None
    if config.ckpt.load_enable:
        resume_from, line = check_resume(
            run_dir / "checkpoints",
            ckpt=config.ckpt,
            num_steps=config.train.num_steps,
            shape=config.shape(),
        )
        echo(f"[plan] resume: {line}")
    torch.manual_seed(config.train.seed)
    tokenizer = AutoTokenizer.from_pretrained(config.actor.model.path)
    sampler, eval_prompts = prompt_sources(config.data, tokenizer, seed=config.train.seed)
    named = [*zip(sampler.names, sampler.sources, strict=True), *eval_prompts.items()]
    data_metrics = check_prompts(named, config.data, tokenizer, echo=echo)
    best = None
    if config.eval.best_metric:
        check_metric(config.eval.best_metric, sources=eval_prompts, n_samples=config.eval.n_samples)
        best = BestModel.open(
            metric=config.eval.best_metric, mode=config.eval.best_mode, directory=run_dir / "best"
        )
    executors = Executors(
        tokenizer=tokenizer,
        rollout=config.rollout,
        train=config.train,
        reward=config.resolved_reward(),
    )
    log = open_sinks(
        config.train, run_dir=run_dir, run_config=resolved, resume=resume_from is not None
    )
    watch.lap("setup")
    cluster = start_ray(address=config.ray.address)
    watch.lap("ray")
    echo(f"[plan] ray: {cluster.describe()}")
    t = config.train
    with_engines = needs_engines(config)
    transport, why = choose_transport(
        t.weight_transport,
        gpu=cluster.gpu,
        colocated=t.colocate_all,
        num_engines=config.vllm.num_engines,
        nodes=cluster.nodes,
        nccl=cluster.nccl,
    )
    bucket = bucket_mib(t.weight_bucket_mib, transport)
    total_optimizer_steps = t.num_steps * config.optimizer_steps_per_rollout
    roles = start_roles(
        config,
        gpu=cluster.gpu,
        total_optimizer_steps=total_optimizer_steps,
        stopwatch=watch,
        echo=echo,
        with_engines=with_engines,
    )
    executors.generator = roles.pool
    if roles.turns is not None:
        echo(f"[plan] {roles.turns.describe()}")
    threads = {
        name: group.compute_threads
        for name, group in roles.learner_groups().items()
        if group.compute_threads is not None
    }
    if threads:
        each = ", ".join(f"{name} {n}" for name, n in threads.items())
        echo(f"[plan] CPU threads per learner rank while it computes (the engines wait): {each}")
    if with_engines:
        echo(
            f"[plan] weight sync: {transport} ({why}), {bucket} MiB buckets, "
            f"read-back {config.verify_mode}"
        )
    else:
        echo("[plan] no vLLM engine: the replay evaluates nothing, so nothing samples")
    finished = False
    try:
        driver = RLDriver(
            config=config,
            roles=roles,
            transport=open_transport(
                transport,
                actor=roles.actor,
                engines=roles.engines,
                verify=config.verify_mode,
                bucket_bytes=bucket << 20,
            )
            if with_engines
            else None,
            sampler=sampler,
            executors=executors,
            eval_prompts=eval_prompts,
            log=log,
            ckpt_root=run_dir / "checkpoints",
            echo=echo,
            stopwatch=watch,
            best=best,
            dump=dump,
            replay=replay,
        )
        driver.carried_metrics.update(data_metrics)
        if with_engines:
            enable_revival(driver, kind=transport, gpu=cluster.gpu, echo=echo)  # rlhf.cli.revive
        (run_dir / "placement.json").write_text(json.dumps(roles.report_placement(), indent=1))
        watch.lap("roles")
        start, queue = driver.resume(resume_from) if resume_from is not None else (0, [])
        driver.progress = Progress(total=config.train.num_steps, start=start, every_s=0, echo=echo)
        asyncio.run(driver.run(start, queue))
        driver.enter("training", record=False)  # the learners' states back on the device
        if config.ckpt.export_hf:
            exports = {"final": False}
            if config.actor.optimizer.ema_decay is not None:
                exports["final_ema"] = True
            for name, ema in exports.items():
                roles.actor.export_hf(str(run_dir / name), ema=ema)
                if (run_dir / name).is_dir():
                    tokenizer.save_pretrained(run_dir / name)
        plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
        if driver.transport is not None:
            driver.transport.close()
            (run_dir / "sync.json").write_text(
                json.dumps(sync_report(transport, why, roles.engines))
            )
        finished = True
        return {"last": driver.last, "evaluations": driver.evaluations}
    except (RayActorError, EngineDiedError) as exc:
        names = roles.process_names
        raise actor_died(exc, ckpt_root=run_dir / "checkpoints", names=names) from None
    except (KeyboardInterrupt, Stopped) as exc:  # the roles stop below, Ray in rlhf.cli.main
        raise as_stopped(exc, hint=resume_hint(run_dir / "checkpoints")) from None
    finally:
        log.close()
        roles.release(keep=finished)  # a later run may take them over (rlhf.cli.warm)


def write_run_config(config: RLConfig) -> dict[str, Any]:
    """``run_dir/config.json`` written (the run directory made); returns what it holds (a
    reward server's API key as ``<set>``: a secret goes to no file, W&B or TensorBoard)."""
    run_dir = pathlib.Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = dataclasses.asdict(config)
    if config.reward.api_key:
        resolved["reward"]["api_key"] = "<set>"
    (run_dir / "config.json").write_text(json.dumps(resolved, indent=1))
    return resolved


def run_eval_only(config: RLConfig, *, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """``--eval.eval_only``: the policy at ``--actor.model.path`` evaluated once on
    ``--data.eval_data`` as a training run evaluates it (``--eval.*``, the run's reward), by
    vLLM engines alone (no learner starts); the row goes to ``run_dir/metrics.jsonl`` at step
    0. Returns it as the run's last metrics and its one evaluation."""
    from transformers import AutoTokenizer

    from rlhf.learner import check_model_dir
    from rlhf.learner.prompts import load_prompts
    from rlhf.rollout import EngineConfig, EnginePool, spawn_engines

    check_model_dir(config.actor.model.path)
    reward = config.resolved_reward()
    check_user_files(reward=reward, agent_path="", policy_path=config.actor.model.path)
    start_ray_early(address=config.ray.address)
    resolved = write_run_config(config)
    tokenizer = AutoTokenizer.from_pretrained(config.actor.model.path)
    prompts = load_prompts(config.data.eval_data, config.data, tokenizer)
    data_metrics = check_prompts(list(prompts.items()), config.data, tokenizer, echo=echo)
    executors = Executors(tokenizer=tokenizer, rollout=config.rollout, train=config.train,
                          reward=reward)  # fmt: skip
    run_dir = pathlib.Path(config.run_dir)
    log = open_sinks(config.train, run_dir=run_dir, run_config=resolved, resume=False)
    engines = []
    try:
        cluster = start_ray(address=config.ray.address)
        echo(f"[eval] {config.vllm.num_engines} vLLM engine(s) serving {config.actor.model.path}")
        engines = spawn_engines(
            EngineConfig.of(
                config.vllm,
                model=config.actor.model.path,
                max_model_len=config.rollout.max_len,
                seed=config.train.seed,
            ),
            config.vllm.num_engines,
            num_cpus=config.vllm.num_cpus,
            num_gpus=float(config.vllm.world_size) if cluster.gpu else 0.0,
        )
        executors.generator = EnginePool(
            engines, max_in_flight_per_engine=2 * config.vllm.max_num_seqs
        )
        result = asyncio.run(evaluate_policy(config, executors, prompts))
        row = {"step": 0, **result, **data_metrics}
        log.write(row)
        echo(summary_line(row))
        return {"last": row, "evaluations": [{"step": 0, **result}]}
    finally:
        log.close()
        for engine in engines:
            engine.shutdown()


def request_seed_of(config: RLConfig) -> int | None:
    """The run seed sampling requests derive theirs from (None: unseeded requests)."""
    return config.train.seed if config.rollout.seed_requests else None


async def evaluate_policy(
    config: RLConfig, executors: Executors, prompts: dict[str, list[Prompt]]
) -> dict[str, float]:
    """One evaluation of the engines' weights as ``--eval.*`` sets it (single-turn at
    ``--eval.temperature``, at most ``--eval.max_prompts`` per source, seeded requests):
    what a training run logs at its evaluation steps and ``--eval.eval_only`` once."""
    e = config.eval
    return await evaluate(
        executors.single_turn(e.temperature),
        {name: items[: e.max_prompts] for name, items in prompts.items()},
        n_samples=e.n_samples,
        solved_threshold=e.solved_threshold,
        seed=request_seed_of(config),
    )


@dataclasses.dataclass
class RLDriver:
    """One run's state; the `rlhf.rollout.schedule.StepRunner` the schedules drive."""

    config: RLConfig
    roles: Roles
    transport: Transport | None
    """None without engines (`rlhf.cli.dumps.needs_engines`): nothing to sync."""
    sampler: PromptSampler
    executors: Executors
    eval_prompts: dict[str, list[Prompt]]
    log: MetricsSink
    ckpt_root: pathlib.Path
    echo: Callable[[str], None]
    progress: Progress | None = None
    stopwatch: Stopwatch | None = None
    best: BestModel | None = None
    dump: RolloutDump | None = None
    """``--rollout.dump_dir``: every rollout is written here before it trains."""
    replay: RolloutDump | None = None
    """``--rollout.replay_dir``: rollouts are read from here instead of sampled."""
    step_began: float = 0.0
    began: float = dataclasses.field(default_factory=time.perf_counter)
    """When the driver was made (every role started): evaluations count ``time/elapsed_s``
    from it."""
    last: dict[str, Any] = dataclasses.field(default_factory=dict)
    evaluations: list[dict[str, float]] = dataclasses.field(default_factory=list)
    trained_sampler_state: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Metrics that join the next step's row: the data checks', the hybrid phases'.
    carried_metrics: dict[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kl_ctl = make_kl_controller(self.config.algo.kl)
        t = self.config.train
        self.micro = MicroBatching(
            max_rows=t.micro_batch_size, max_tokens=t.max_tokens_per_micro_batch or None
        )

    @property
    def train(self) -> TrainConfig:
        """``--train.*`` (`rlhf.cli.revive.RevivableRun` reads the schedule from it)."""
        return self.config.train

    @property
    def request_seed(self) -> int | None:
        """The run seed sampling requests derive theirs from (None: unseeded requests)."""
        return request_seed_of(self.config)

    def enter(self, phase: str, *, record: bool = True, learning: bool = False) -> None:
        """Hybrid placement: move engines and learners to ``phase`` (`rlhf.learner.hybrid`);
        with ``record``, its metrics join the step's; ``learning``: a training phase that
        trains (`TurnTaking.enter`)."""
        turns = self.roles.turns
        if turns is not None:
            metrics = turns.enter(phase, learning=learning)
            if record:
                self.carried_metrics.update(metrics)
            while turns.notes:
                self.echo(turns.notes.pop(0))

    async def run(self, start: int, queue: list[Rollout]) -> None:
        t = self.config.train
        self.enter("generation")
        if self.eval_prompts and self.config.eval.steps and start == 0:
            await self.evaluate(0)
        if self.stopwatch is not None:
            self.stopwatch.lap("resume" if start else "eval")
        self.step_began = time.perf_counter()
        if t.async_enable:
            await run_asynchronous(
                self,
                start=start,
                end=t.num_steps,
                queue=queue,
                queue_size=t.async_queue_size,
                partial_rollouts=t.partial_rollout_enable,
            )
        else:
            await run_synchronous(self, start=start, end=t.num_steps, queue=queue)

    async def generate(self, step: int) -> Rollout:
        if self.replay is not None:
            return await asyncio.to_thread(self.replay.read, step)
        executor = self.executors.training()
        c = self.config
        try:
            return await sample_step(
                step,
                batch_size=c.rollout.batch_size,
                n_samples_per_prompt=c.rollout.n_samples_per_prompt,
                prompts=self.sampler,
                executor=executor,
                keep_groups=group_filter(
                    c.algo, n_samples_per_prompt=c.rollout.n_samples_per_prompt
                ),
                seed=self.request_seed,
                oversample=c.rollout.oversample_factor,
            )
        except EmptyStepError as exc:  # the run stops: exit 1, the causes in one message
            raise RunError(str(exc)) from None

    def learn(self, rollout: Rollout) -> dict[str, Any]:
        """Experience and PPO epochs of ``rollout.step`` (blocking). π_old is computed when
        more than one optimizer step follows or in async mode, where the batch may come from
        older weights (whose log-probs the rollout carries for ``--algo.rollout_correction``)."""
        self.trained_sampler_state = rollout.sampler_state
        if self.dump is not None:
            self.dump.write(rollout)
        self.enter("training", learning=True)
        c, roles, kl_coef = self.config, self.roles, self.kl_ctl.value
        tick = time.perf_counter()
        experience = make_experience(
            Samples.from_trajectories(
                rollout.trajectories, per_turn=c.train.turn_credit == "per_turn"
            ),
            actor=roles.actor,
            reference=roles.ref,
            critic=roles.critic,
            reward_model=roles.reward_model,
            teachers=roles.teachers,
            sources=rollout.sources or None,
            algo=c.algo,
            n_samples_per_prompt=c.rollout.n_samples_per_prompt,
            max_new_tokens=c.rollout.max_new_tokens,
            kl_coef=kl_coef,
            temperature=c.rollout.temperature,
            compute_old_logprobs=c.optimizer_steps_per_rollout > 1 or c.train.async_enable,
            check_reference=rollout.step == 0,
            micro=self.micro,
        )
        experience_s = time.perf_counter() - tick
        tick = time.perf_counter()
        update = ppo_update(
            experience,
            actor=roles.actor,
            critic=roles.critic,
            algo=c.algo,
            kl_coef=kl_coef,
            temperature=c.rollout.temperature,
            ppo_epochs=c.train.ppo_epochs,
            train_batch_size=c.train.batch_size,
            micro=self.micro,
            train_actor=rollout.step >= c.train.actor_freezing_steps,
        )
        training_s = time.perf_counter() - tick
        if experience.mean_kl is not None:
            self.kl_ctl.update(current_kl=experience.mean_kl, n_steps=experience.size)
            update["kl/coef"] = kl_coef
        return {
            **experience.metrics,
            **staleness(rollout.step, rollout.trajectories),
            **rollout.metrics,
            **update,
            "time/experience_s": experience_s,
            "time/training_s": training_s,
        }

    def sync(self, version: int, *, pause: bool) -> dict[str, Any]:
        if self.transport is None:
            return {}
        engines = self.roles.engines if pause else []
        paused = sum(e.pause() for e in engines)
        self.enter("sync")
        tick = time.perf_counter()
        try:
            self.transport.sync(version)
        finally:
            for e in engines:
                e.resume()
        out = {"time/weight_sync_s": time.perf_counter() - tick}
        out.update({f"sync/{k}_s": v for k, v in self.transport.parts.items()})
        out.update({f"sync/{k}": v for k, v in self.transport.stats.items()})
        out.update(engine_sync_parts(self.roles.engines))
        self.enter("generation")
        if pause:
            out["rollout/requests_paused_for_sync"] = float(paused)
        return out

    def saves_at(self, step: int) -> bool:
        every = self.config.ckpt.save_steps
        return bool(every and (step + 1) % every == 0) or step + 1 == self.config.train.num_steps

    async def evaluate(self, step: int) -> None:
        result = await evaluate_policy(self.config, self.executors, self.eval_prompts)
        elapsed = time.perf_counter() - self.began
        self.evaluations.append({"step": step, "time/elapsed_s": elapsed, **result})
        self.log.write(self.evaluations[-1])
        self.echo(summary_line(self.evaluations[-1]))
        if self.best is not None and self.best.improves(result):
            await asyncio.to_thread(self.export_best, step, result)

    def export_best(self, step: int, evaluation: dict[str, float]) -> None:
        """The actor, just evaluated best so far, to ``run_dir/best`` (`rlhf.cli.best`)."""
        best = self.best
        assert best is not None
        self.enter("training", record=False)  # the weights on the device to gather them
        self.roles.actor.export_hf(str(best.directory))
        self.enter("generation", record=False)
        best.record(step=step, evaluation=evaluation)
        self.echo(f"[best] step {step}: {best.metric} {best.value:.4f} -> {best.directory}")

    async def finish(self, step: int, metrics: dict[str, Any], queue: list[Rollout]) -> None:
        c = self.config
        metrics.update(self.carried_metrics)
        self.carried_metrics = {}
        metrics["step"] = step + 1
        # The step's wall time: since the previous step's row (after its evaluation and
        # checkpoint), so generation, learning, sync and what the driver adds between them.
        metrics["time/step_s"] = time.perf_counter() - self.step_began
        self.last = metrics
        self.log.write(metrics)
        if self.stopwatch is not None:
            self.stopwatch.lap("step 1")
            (self.ckpt_root.parent / "startup.json").write_text(
                json.dumps(self.stopwatch.report(), indent=1)
            )
            self.echo(f"[startup] {self.stopwatch.line()}")
            self.stopwatch = None
        self.echo(summary_line(metrics))
        if self.progress is not None:
            self.progress.show(step + 1, metrics)
        last = step + 1 == c.train.num_steps
        if self.eval_prompts and c.eval.steps and ((step + 1) % c.eval.steps == 0 or last):
            await self.evaluate(step + 1)
        if self.saves_at(step):
            await asyncio.to_thread(self.save, step, queue)
        self.step_began = time.perf_counter()

    def save(self, step: int, queue: list[Rollout]) -> None:
        """A checkpoint after ``step``: the learners' states and the run's (step, prompt
        sampler after the newest batch drawn, KL controller, batches sampled ahead)."""
        newest = queue[-1].sampler_state if queue else self.trained_sampler_state
        state = {
            "step": step + 1,
            "sampler": newest,
            "kl_controller": self.kl_ctl.state_dict(),
            "queue": [r.to_state() for r in queue],
            "shape": self.config.shape(),
        }
        ckpt, actor = self.config.ckpt, self.roles.actor
        self.enter("training", record=False)  # DeepSpeed saves the states from the device
        if ckpt.save_state:
            path = actor.save(str(self.ckpt_root), step + 1, client_state=state, keep=ckpt.keep)
            if self.roles.critic is not None:
                critic_root = str(self.ckpt_root / "critic")
                self.roles.critic.save(critic_root, step + 1, client_state=state, keep=ckpt.keep)
            self.echo(f"[ckpt] {path}")
        if ckpt.save_hf:
            ema = self.config.actor.optimizer.ema_decay is not None
            path = save_hf_at(
                lambda directory: actor.export_hf(directory, ema=ema),
                run_dir=self.ckpt_root.parent,
                step=step + 1,
                keep=ckpt.keep,
            )
            self.echo(f"[ckpt] {path}")
        self.enter("generation", record=False)

    def resume(self, latest: pathlib.Path) -> tuple[int, list[Rollout]]:
        """Restore the checkpoint ``latest`` (`rlhf.cli.resume.check_resume`'s choice): the
        step to start at and the rollouts it holds for later steps (async mode)."""
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
