"""The processes of an RL run: vLLM engines and learner rank groups on Ray, where the
placement (`rlhf.cli.placement`) puts them, and the hybrid turn-taking between them.

Every role starts at once and the run waits for all of them (their imports, model loads and
DeepSpeed or vLLM initialisation overlap), except where engines share GPUs with learners:
vLLM sizes its KV cache from the memory free while it starts, so there the engines start
first and the learners after them.

Which learner roles run, and with which settings, is `role_configs` (pure, from the config);
`start_roles` builds them: the reference when ``--algo.kl.init_coef > 0``, the critic when the
estimator needs one (``rlhf.algos``), the reward model for ``--train.reward_model_path``, a
frozen teacher per ``--teacher.model.path`` entry (on-policy distillation).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlhf.cli.backends import backend_factory, compute_threads, rank_env
from rlhf.cli.config import RLConfig, teacher_role
from rlhf.cli.placement import Placement, place, processes, where_this_process_runs
from rlhf.cli.sections import RoleConfig, VllmConfig
from rlhf.cli.startup import Stopwatch
from rlhf.cli.warm import WarmRoles, warm_roles
from rlhf.learner import LearnerConfig, LearnerGroup, ModelConfig
from rlhf.learner.hybrid import TurnTaking, measure_headroom
from rlhf.rollout import EngineConfig, EnginePool, RayEngine


def role_configs(
    config: RLConfig, *, total_optimizer_steps: int
) -> dict[str, tuple[RoleConfig, LearnerConfig]]:
    """Every learner role the run starts: its ``--<role>.*`` settings (ranks, resources) and
    its `rlhf.learner` config. The reference and the reward model score only: one
    data-parallel replica (`RoleConfig.eval_only`), no optimizer, ZeRO-3 with offloaded
    parameters under ``--train.ref_reward_offload``."""
    seed, train = config.train.seed, config.train
    offload = train.ref_reward_offload
    roles = {"actor": (config.actor, total_optimizer_steps, True)}
    if config.uses_reference:
        roles["ref"] = (config.actor.eval_only(offload=offload), 1, False)
    if config.uses_critic:
        critic = config.critic.with_model(
            path=config.critic.model.path or config.actor.model.path, kind="scalar"
        )
        roles["critic"] = (critic, total_optimizer_steps, True)
    if train.reward_model_path:
        scorer = dataclasses.replace(
            config.actor.eval_only(offload=offload),
            model=ModelConfig(
                path=train.reward_model_path,
                kind="scalar",
                packing_samples=config.actor.model.packing_samples,
            ),
        )
        roles["reward_model"] = (scorer, 1, False)
    for name, (_, path) in config.teacher_roles().items():
        roles[name] = (config.teacher_config(path), 1, False)
    return {
        name: (role, role.learner(seed=seed, total_steps=steps, train=trains))
        for name, (role, steps, trains) in roles.items()
    }


@dataclasses.dataclass
class Roles:
    """A run's processes.

    Attributes:
        engines: The vLLM engine actors (none in a run that samples nothing:
            `rlhf.cli.dumps.needs_engines`).
        pool: Load-aware dispatch over them (the executors' generator); None without
            engines.
        actor: The policy's ranks.
        ref: The reference (KL), or None.
        critic: The value model (GAE), or None.
        reward_model: The reward model, or None.
        placement: Where each process runs.
        turns: Hybrid placement's turn-taking (``--train.colocate_all``), or None.
        teachers: On-policy distillation's frozen teachers by data source (``""``: one
            teacher of every prompt); empty without.
    """

    engines: list[RayEngine]
    pool: EnginePool | None
    actor: LearnerGroup
    ref: LearnerGroup | None
    critic: LearnerGroup | None
    reward_model: LearnerGroup | None
    placement: Placement
    turns: TurnTaking | None
    teachers: dict[str, LearnerGroup] = dataclasses.field(default_factory=dict)
    process_names: dict[str, str] = dataclasses.field(default_factory=dict)
    """Ray actor id -> "actor rank 0", "vLLM engine 1", …: filled by `report_placement`."""
    launch: EngineLaunch | None = None
    """How the engines started, to start one in place of a dead one (`EngineLaunch.restart`)."""
    warm_keys: dict[str, str] = dataclasses.field(default_factory=dict)
    """Role ("engines", "actor", …) -> the options its processes started with, for the roles
    a later run may take over (`rlhf.cli.warm`): those on Ray's own resources."""

    def replace_engine(self, index: int, engine: RayEngine) -> None:
        """``engine`` takes the place of engine ``index`` (one that died) in `engines`; the
        pool's slot is the pool's to swap."""
        self.engines[index] = engine
        self.process_names[engine.actor_id] = f"vLLM engine {index}"

    def learner_groups(self) -> dict[str, LearnerGroup]:
        groups = {
            "actor": self.actor,
            "ref": self.ref,
            "critic": self.critic,
            "reward_model": self.reward_model,
            **{teacher_role(source): g for source, g in self.teachers.items()},
        }
        return {name: g for name, g in groups.items() if g is not None}

    def report_placement(self) -> dict[str, Any]:
        """Per role: the node spec it was given, the bundle each process was given, and the
        Ray node and placement group (None: resources of its own) each process reports
        running on."""
        seen: dict[str, list[dict[str, str | None]]] = {
            name: group.run(where_this_process_runs)
            for name, group in self.learner_groups().items()
        }
        import asyncio

        async def engines() -> list[dict[str, str | None]]:
            return list(await asyncio.gather(*(e.run(_where_engine_runs) for e in self.engines)))

        seen["engines"] = asyncio.run(engines())
        self.process_names = {
            str(w["actor_id"]): f"{'vLLM engine' if name == 'engines' else name + ' rank'} {k}"
            for name, where in seen.items()
            for k, w in enumerate(where)
        }
        nodes = self.placement.nodes
        return {
            name: {
                "bundles": self.placement.where(name),
                "node_spec": nodes[name].describe() if name in nodes else None,
                **processes(where),
            }
            for name, where in seen.items()
        }

    def shutdown(self) -> None:
        for e in self.engines:
            e.shutdown()
        for g in self.learner_groups().values():
            g.shutdown()
        self.placement.remove()

    def release(self, *, keep: bool) -> None:
        """The run is over: stop its processes, or (``keep``, inside
        `rlhf.cli.warm.keep_roles_warm`) park those a later run may take over and stop the
        rest."""
        warm = warm_roles() if keep else None
        if warm is None:
            self.shutdown()
            return
        groups = []
        for name, group in self.learner_groups().items():
            if name in self.warm_keys:
                groups.append((self.warm_keys[name], group))
            else:
                group.shutdown()
        engines = None
        if "engines" in self.warm_keys:
            engines = (self.warm_keys["engines"], self.engines)
        else:
            for e in self.engines:
                e.shutdown()
        warm.park(engines=engines, groups=groups)
        self.placement.remove()


async def _where_engine_runs(engine: Any) -> dict[str, str | None]:
    return where_this_process_runs()


@dataclasses.dataclass(frozen=True)
class EngineLaunch:
    """How the run's engines start (`rlhf.rollout.spawn_engines` arguments): all of them at
    once, or one in place of engine ``index`` after it died.

    Attributes:
        config: Engine ``i`` runs ``config`` with seed ``config.seed + i``.
        num_engines: ``--vllm.num_engines``.
        num_cpus: CPUs per engine actor.
        num_gpus: GPUs per engine actor.
        scheduling: Each engine's Ray scheduling strategy (its placement-group bundle), or
            None (Ray's default).
    """

    config: EngineConfig
    num_engines: int
    num_cpus: float
    num_gpus: float
    scheduling: list[Any] | None

    def start(self, *, wait: bool = True) -> list[RayEngine]:
        """Every engine (``wait``: until they have started; else wait on `RayEngine.ready`)."""
        from rlhf.rollout import spawn_engines

        return spawn_engines(
            self.config,
            self.num_engines,
            num_cpus=self.num_cpus,
            num_gpus=self.num_gpus,
            scheduling=self.scheduling,
            wait=wait,
        )

    def restart(self, index: int) -> RayEngine:
        """A new engine ``index``, started: its seed, its resources and its bundle (which the
        dead engine's process freed)."""
        from rlhf.rollout import spawn_engines

        (engine,) = spawn_engines(
            dataclasses.replace(self.config, seed=self.config.seed + index),
            1,
            num_cpus=self.num_cpus,
            num_gpus=self.num_gpus,
            scheduling=None if self.scheduling is None else [self.scheduling[index]],
        )
        return engine


def engine_launch(
    vllm: VllmConfig,
    *,
    model: str,
    max_model_len: int,
    seed: int,
    sleep: bool,
    placement: Placement,
    gpu: bool,
) -> EngineLaunch:
    """How ``--vllm.num_engines`` engine actors serving ``model`` start."""
    scheduling = placement.strategies("engines", vllm.num_engines)
    return EngineLaunch(
        config=EngineConfig.of(
            vllm, model=model, max_model_len=max_model_len, seed=seed, enable_sleep_mode=sleep
        ),
        num_engines=vllm.num_engines,
        num_cpus=vllm.num_cpus,
        num_gpus=placement.gpus.get("engines", float(vllm.world_size) if gpu else 0.0),
        scheduling=None if scheduling is None else list(scheduling),
    )


def start_learner(
    name: str,
    role: RoleConfig,
    learner: LearnerConfig,
    *,
    placement: Placement,
    gpu: bool,
    warm: WarmRoles | None = None,
) -> tuple[LearnerGroup, list[Any], str | None]:
    """The ranks of one role, building with the role's backend (``--<role>.backend``): the
    group, one object ref per rank that resolves when its rank is built, and the key under
    which a later run may take the group over (None: it cannot, being placed). A parked
    group of ``warm`` started with the same options builds anew instead of new ranks."""
    group, key = rank_group(
        role,
        gpus=placement.gpus.get(name, role.num_gpus_per_rank) if gpu else 0.0,
        env=rank_env(role, gpu=gpu),
        scheduling=placement.strategies(name, role.num_ranks),
        warm=warm,
    )
    return group, group.start_build(learner, backend=backend_factory(role)), key


def rank_group(
    role: RoleConfig,
    *,
    gpus: float,
    env: Mapping[str, str],
    scheduling: Sequence[Any] | None,
    warm: WarmRoles | None,
) -> tuple[LearnerGroup, str | None]:
    """The rank processes of ``role`` (to be built): a group of ``warm`` parked with the same
    options, else new ones; and the key under which a later run may take the group over
    (None for ranks that are placed: in a placement group or on named nodes)."""
    key = None
    if scheduling is None:
        # What shapes a rank's process: its resources and environment, and the backend's
        # process-wide state (torch.distributed's groups, DeepSpeed's ZeRO-3 and TP set-up).
        key = repr((role.backend, role.deepspeed, role.fsdp, role.ring_attn_size,
                    role.num_ranks, role.num_cpus_per_rank, gpus, sorted(env.items())))  # fmt: skip
    group = warm.take_group(key) if warm is not None and key is not None else None
    if group is None:
        group = LearnerGroup(
            num_ranks=role.num_ranks,
            num_cpus_per_rank=role.num_cpus_per_rank,
            num_gpus_per_rank=gpus,
            env=env,
            scheduling=scheduling,
        )
    return group, key


def wait_ready(
    pending: Mapping[str, Sequence[Any]], *, report: Callable[[str, float], None] | None = None
) -> dict[str, float]:
    """Wait until every role's object refs resolve; returns the seconds each role took from
    this call (each also told to ``report`` as it becomes ready), and raises the first
    failure a role reports."""
    import ray

    start = time.perf_counter()
    owner = {ref: name for name, refs in pending.items() for ref in refs}
    left = {name: len(refs) for name, refs in pending.items()}
    ready: dict[str, float] = {}
    remaining = list(owner)
    while remaining:
        done, remaining = ray.wait(remaining, num_returns=1)
        ray.get(done)  # raises the role's error (e.g. a model that does not load)
        name = owner[done[0]]
        left[name] -= 1
        if not left[name]:
            ready[name] = time.perf_counter() - start
            if report is not None:
                report(name, ready[name])
    return ready


def start_roles(
    config: RLConfig,
    *,
    gpu: bool,
    total_optimizer_steps: int,
    stopwatch: Stopwatch | None = None,
    echo: Callable[[str], None] | None = None,
    with_engines: bool = True,
) -> Roles:
    """Place and start every process of the run; they are ready when this returns (when
    each became ready goes to ``stopwatch``, and as ``[startup]`` lines to ``echo``).
    ``with_engines`` False: the learners alone (a run that samples nothing)."""
    learners = role_configs(config, total_optimizer_steps=total_optimizer_steps)
    say = echo or (lambda _line: None)
    num_engines = config.vllm.num_engines if with_engines else 0
    say(
        f"[startup] starting {num_engines} vLLM engine(s) and the "
        + ", ".join(f"{name} ({role.num_ranks} rank{'s' * (role.num_ranks > 1)})"
                    for name, (role, _) in learners.items())
        + "…"
    )  # fmt: skip
    sleep = gpu and config.train.colocate_all and config.vllm.enable_sleep is not False
    side_by_side = not (gpu and config.train.colocate_all)
    start = time.perf_counter()
    engines: list[RayEngine] = []
    groups: dict[str, LearnerGroup] = {}
    placement = place(config.processes(), gpu=gpu)
    try:  # nothing started may outlive a run that could not start (the except below)
        launch = engine_launch(
            config.vllm,
            model=config.actor.model.path,
            max_model_len=config.rollout.max_len,
            seed=config.train.seed,
            sleep=sleep,
            placement=placement,
            gpu=gpu,
        )
        warm = warm_roles()
        keys: dict[str, str] = {}
        if with_engines and launch.scheduling is None:
            keys["engines"] = repr(launch)
        # Warm engines are taken over once the learners build (their reset overlaps the
        # builds); new ones start first, the slowest role (and on shared GPUs, before the
        # learners).
        warm_engines = warm is not None and "engines" in keys
        ready: dict[str, float] = {}
        pending: dict[str, Sequence[Any]] = {}
        if with_engines and not warm_engines:
            engines = launch.start(wait=not side_by_side)
            if side_by_side:
                pending["engines"] = [e.ready() for e in engines]
            else:
                ready["engines"] = time.perf_counter() - start
        for name, (role, learner) in learners.items():
            groups[name], pending[name], key = start_learner(
                name, role, learner, placement=placement, gpu=gpu, warm=warm
            )
            if key is not None:
                keys[name] = key
        if warm is not None and warm_engines:
            engines = warm.take_engines(keys["engines"]) or []
            if engines:
                ready["engines"] = time.perf_counter() - start
            else:
                engines = launch.start(wait=False)
                pending["engines"] = [e.ready() for e in engines]
        if warm is not None:
            warm.stop_unclaimed()
        for group in groups.values():
            group.compute_threads = compute_threads(
                num_ranks=group.world_size, gpu=gpu, beside_engines=config.train.async_enable
            )
        waited_from = time.perf_counter() - start
        for name, seconds in ready.items():
            say(f"[startup] {name} ready after {seconds:.1f} s")

        def announce(name: str, seconds: float) -> None:
            say(f"[startup] {name} ready after {waited_from + seconds:.1f} s")

        ready.update({n: waited_from + s for n, s in wait_ready(pending, report=announce).items()})
        if stopwatch is not None:
            for name, seconds in ready.items():
                stopwatch.ready(name, seconds)
        turns = None
        if config.train.colocate_all:
            trained = [g for name, g in groups.items() if name in ("actor", "critic")]
            offload, why = config.offloads_learners(gpu=gpu), ""
            if offload and config.train.deepspeed_enable_sleep is None:
                headroom = measure_headroom(trained)  # only when memory requires it
                if headroom is not None:
                    offload, why = not headroom.learners_fit, headroom.describe()
            if not offload and not why:
                why = (
                    "--train.deepspeed_enable_sleep: by default on GPUs with ZeRO-1/2/3 or "
                    "molt when memory requires it"
                )
            if not sleep:
                why = "; ".join(w for w in ("--vllm.enable_sleep: GPUs only", why) if w)
            turns = TurnTaking(
                engines=engines,
                learners=trained,
                sleep_engines=sleep,
                offload_learners=offload,
                # Unset: the first step measures whether training fits next to awake engines
                # (when the learners move, memory is tight: the engines keep sleeping).
                settle_sleep=sleep and config.vllm.enable_sleep is None and not offload,
                others=[g for name, g in groups.items() if name not in ("actor", "critic")],
                why=why,
            )
        return Roles(
            engines=engines,
            pool=(
                EnginePool(engines, max_in_flight_per_engine=2 * config.vllm.max_num_seqs)
                if engines
                else None
            ),
            actor=groups["actor"],
            ref=groups.get("ref"),
            critic=groups.get("critic"),
            reward_model=groups.get("reward_model"),
            teachers={source: groups[name] for name, (source, _) in config.teacher_roles().items()},
            placement=placement,
            turns=turns,
            launch=launch if with_engines else None,
            warm_keys=keys,
        )
    except BaseException:
        for e in engines:
            e.shutdown()
        for g in groups.values():
            g.shutdown()
        placement.remove()
        raise
