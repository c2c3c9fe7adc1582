"""The plan ``rlhf train`` prints before it starts anything (`plan`: what one step does and where
each role runs) and ``rlhf train … --dry_run``'s capacity plan (`capacity_plan`). The latter
reads only the models' ``config.json`` (no
weights, no GPU, no Ray), lays the roles out on GPUs as the run would, and prints each GPU's
estimated memory by role and what holds it (the memory models of `rlhf.learner.capacity`,
`rlhf.molt.capacity` and `rlhf.rollout.capacity`), and whether it fits.

Placement follows the run's: every learner rank and every engine GPU on a GPU of its own,
the reference beside actor rank 0 with ``--train.colocate_actor_ref`` and the reward model
beside critic rank 0 with ``--train.colocate_critic_reward``; under ``--train.colocate_all``
GPU ``k`` holds actor rank ``k``, critic rank ``k`` and engine GPU ``k`` (reference and reward
model on GPU 0) and the plan checks both phases: training (engines asleep unless
``--vllm.enable_sleep False``) and generation (learners' states offloaded unless
``--train.deepspeed_enable_sleep False``), and says which moves the fit needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from rlhf.cli.backends import backend_of
from rlhf.cli.config import RLConfig
from rlhf.cli.placement import describe, describe_nodes, plan_bundles
from rlhf.cli.sections import PlanConfig, RoleConfig, TrainConfig
from rlhf.learner.capacity import DTYPE_BYTES, GIB, LearnerLoad, Memory
from rlhf.learner.model_shape import ModelShape
from rlhf.rollout.capacity import EngineLoad

_LORA_SHAPES: dict[str, Callable[[ModelShape], tuple[int, int]]] = {
    "q_proj": lambda s: (s.hidden, s.heads * s.head_dim),
    "k_proj": lambda s: (s.hidden, s.kv_heads * s.head_dim),
    "v_proj": lambda s: (s.hidden, s.kv_heads * s.head_dim),
    "o_proj": lambda s: (s.heads * s.head_dim, s.hidden),
    "gate_proj": lambda s: (s.hidden, s.intermediate),
    "up_proj": lambda s: (s.hidden, s.intermediate),
    "down_proj": lambda s: (s.intermediate, s.hidden),
}
"""In and out widths of the linear layers LoRA adapts, by module name."""


@dataclass(frozen=True, kw_only=True)
class Process:
    """One process on a GPU: its label and its memory."""

    label: str
    memory: Memory


@dataclass(kw_only=True)
class Gpu:
    """One GPU: the processes on it (``learners``), and an engine share when one runs there."""

    index: int
    learners: list[Process] = field(default_factory=list)
    engine: Process | None = None
    engine_share: float = 0.0


def lora_params(shape: ModelShape, *, rank: int, targets: tuple[str, ...]) -> int:
    """Adapter parameters: ``rank * (in + out)`` per adapted linear layer."""
    per_layer = sum(rank * sum(_LORA_SHAPES[t](shape)) for t in targets if t in _LORA_SHAPES)
    return shape.layers * per_layer


def compute_bytes(role: RoleConfig) -> int:
    """Bytes per element of the role's compute dtype."""
    return backend_of(role).compute_bytes()


def learner_memory(
    role: RoleConfig, shape: ModelShape, *, tokens: int, trains: bool, outputs: int
) -> Memory:
    """One rank of ``role`` on its backend."""
    tp, cp = role.tensor_parallel, role.context_parallel
    model = role.model
    load = LearnerLoad(
        params=shape.params,
        layer_params=shape.layer_params,
        embedding_params=shape.embedding_params,
        vocab_matrix=shape.vocab * shape.hidden,
        hidden=shape.hidden,
        intermediate=shape.intermediate,
        layers=shape.layers,
        outputs=outputs,
        tokens=tokens,
        trains=trains,
        trainable=(
            lora_params(shape, rank=model.lora_rank, targets=model.lora_target_modules)
            if model.lora_rank
            else None
        ),
        tp=tp,
        cp=cp,
        dp=max(role.num_ranks // (tp * cp), 1),
        compute_bytes=compute_bytes(role),
        gradient_checkpointing=model.gradient_checkpointing,
        logits_held=not model.chunked_lm_head,
        layer_tensors=shape.layer_tensors,
        other_tensors=shape.other_tensors,
    )
    return backend_of(role).memory(load)


def micro_batch_tokens(*, rows: int, max_len: int, budget: int) -> int:
    """Tokens of the largest micro-batch: ``rows`` padded rows, or the token budget (a
    row longer than the budget still makes a micro-batch of its own)."""
    tokens = rows * max_len
    return min(tokens, max(budget, max_len)) if budget else tokens


def engine_load(config: RLConfig, shape: ModelShape) -> EngineLoad:
    """One GPU of one vLLM engine."""
    v = config.vllm
    weight_bytes = DTYPE_BYTES.get(v.dtype, shape.dtype_bytes)
    return EngineLoad(
        params=shape.params,
        weight_bytes=weight_bytes,
        kv_bytes_per_token=shape.kv_bytes_per_token(dtype_bytes=weight_bytes),
        tp=v.tensor_parallel_size,
        pp=v.pipeline_parallel_size,
        kv_heads=shape.kv_heads,
        gpu_memory_utilization=v.gpu_memory_utilization,
        vocab=shape.vocab,
        max_num_seqs=v.max_num_seqs,
        hidden=shape.hidden,
        intermediate=shape.intermediate,
        **(
            {"max_num_batched_tokens": v.max_num_batched_tokens} if v.max_num_batched_tokens else {}
        ),
    )


def _place(gpus: list[Gpu], first: int, count: int, label: str, memory: Memory) -> int:
    """Put ``count`` ranks of one role on GPUs ``first, first+1, …``; the next free index."""
    while len(gpus) < first + count:
        gpus.append(Gpu(index=len(gpus)))
    for k in range(count):
        gpus[first + k].learners.append(Process(label=f"{label} rank {k}", memory=memory))
    return first + count


def rl_layout(config: RLConfig) -> tuple[list[Gpu], list[str]]:
    """Every GPU of the RL run with its processes, and the lines describing the engines'
    KV caches."""
    plan = config.plan
    gpu_bytes = plan.gpu_memory_gib * GIB
    actor = ModelShape.read(config.actor.model.path, flag="--actor.model.path")
    r, t = config.rollout, config.train
    tokens = micro_batch_tokens(
        rows=t.micro_batch_size, max_len=r.max_len, budget=t.max_tokens_per_micro_batch
    )
    roles: list[tuple[str, int, Memory]] = [
        ("actor", config.actor.num_ranks,
         learner_memory(config.actor, actor, tokens=tokens, trains=True, outputs=actor.vocab)),
    ]  # fmt: skip
    side: list[tuple[str, int, Memory, str]] = []  # eval-only: (label, ranks, memory, beside)
    if config.uses_reference:
        ref = config.actor.eval_only(offload=t.ref_reward_offload)
        memory = learner_memory(ref, actor, tokens=tokens, trains=False, outputs=actor.vocab)
        beside = "actor" if t.colocate_actor_ref else ""
        side.append(("reference", ref.num_ranks, memory, beside))
    if config.uses_critic:
        path = config.critic.model.path or config.actor.model.path  # as the run starts it
        critic = ModelShape.read(path, flag="--critic.model.path")
        memory = learner_memory(config.critic, critic, tokens=tokens, trains=True, outputs=1)
        roles.append(("critic", config.critic.num_ranks, memory))
    if t.reward_model_path:
        rm_shape = ModelShape.read(t.reward_model_path, flag="--train.reward_model_path")
        rm = config.actor.eval_only(offload=t.ref_reward_offload)
        memory = learner_memory(rm, rm_shape, tokens=tokens, trains=False, outputs=1)
        beside = "critic" if t.colocate_critic_reward and config.uses_critic else ""
        side.append(("reward model", rm.num_ranks, memory, beside))
    for name, (_, path) in config.teacher_roles().items():
        shape = ModelShape.read(path, flag="--teacher.model.path")
        teacher = config.teacher_config(path)
        memory = learner_memory(teacher, shape, tokens=tokens, trains=False, outputs=shape.vocab)
        side.append((name, teacher.num_ranks, memory, ""))
    engine = engine_load(config, actor)
    per_engine = engine.tp * engine.pp
    gpus: list[Gpu] = []
    first = {}
    cursor = 0
    for label, count, memory in roles:
        start = 0 if t.colocate_all else cursor
        first[label] = start
        cursor = max(cursor, _place(gpus, start, count, label, memory))
    for label, count, memory, beside in side:  # one replica: tp x cp ranks
        at = 0 if t.colocate_all else first.get(beside, -1)
        if at < 0:
            at, cursor = cursor, cursor + count
        _place(gpus, at, count, label, memory)
    start = 0 if t.colocate_all else cursor
    engine_memory = Memory(parts={"weights": engine.weights, "workspace": engine.workspace})
    for e in range(config.vllm.num_engines):
        for k in range(per_engine):
            index = start + e * per_engine + k
            while len(gpus) <= index:
                gpus.append(Gpu(index=len(gpus)))
            gpus[index].engine = Process(label=f"vLLM engine {e}", memory=engine_memory)
            gpus[index].engine_share = engine.gpu_memory_utilization * gpu_bytes
    kv = engine.kv_tokens(gpu_bytes)
    samples = r.batch_size * r.n_samples_per_prompt
    per = -(-samples // config.vllm.num_engines)
    cache = max(engine.kv_cache_bytes(gpu_bytes), 0.0)
    lines = [
        f"vLLM engine GPU: weights {engine.weights / GIB:.1f} GiB, workspace "
        f"{engine.workspace / GIB:.1f} GiB, KV cache {cache / GIB:.1f} "
        f"GiB = {kv} tokens ({engine.kv_per_token / 1024:.0f} KiB each) = {kv // r.max_len} "
        f"sequences of --rollout.max_len {r.max_len} at once, of {per} per engine per step "
        f"(--vllm.gpu_memory_utilization {engine.gpu_memory_utilization})"
    ]
    if kv < r.max_len:
        lines.append(
            "does not fit: the engine's share of the GPU holds no KV cache for one sequence of "
            "--rollout.max_len; raise --vllm.gpu_memory_utilization or "
            "--vllm.tensor_parallel_size"
        )
    return gpus, lines


def _learners(gpu: Gpu, *, resident: bool) -> float:
    """Bytes the GPU's learner processes need: at their peak, or (``resident``) between
    steps (weights and optimizer states only)."""
    total = 0.0
    for process in gpu.learners:
        memory = process.memory
        if resident:
            kept = {k: memory.parts[k] for k in ("weights", "optimizer states")}
            memory = dataclasses.replace(memory, parts=kept)
        total += memory.total
    return total


def judge(gpu: Gpu, *, config: RLConfig | None, gpu_bytes: float) -> tuple[bool, str]:
    """Whether the GPU's processes fit, and the line that says how."""
    peak = _learners(gpu, resident=False)
    if gpu.engine is None:
        return peak <= gpu_bytes, f"{peak / GIB:.1f} GiB"
    if not gpu.learners:
        return gpu.engine_share <= gpu_bytes, f"{gpu.engine_share / GIB:.1f} GiB (engine share)"
    assert config is not None
    resident = _learners(gpu, resident=True)
    together = peak + gpu.engine_share
    if together <= gpu_bytes:
        return True, f"{together / GIB:.1f} GiB with every process resident (no moves)"
    sleeps = config.vllm.enable_sleep is not False
    # As the run decides: never when turned off, and only for stages whose states can move
    # (ZeRO-1/2/3, molt) unless forced.
    offloads = config.offloads_learners(gpu=True)
    training = peak + (0.0 if sleeps else gpu.engine_share)
    generation = gpu.engine_share + (0.0 if offloads else resident)
    ok = max(training, generation) <= gpu_bytes
    moves = [
        name
        for name, needed in (("engines sleep while learners train", training < together),
                             ("learners' states leave the GPU while engines generate",
                              generation < gpu.engine_share + resident))
        if needed
    ]  # fmt: skip
    return ok, (
        f"training {training / GIB:.1f} GiB, generation {generation / GIB:.1f} GiB"
        + (f" (needs: {'; '.join(moves)})" if moves and ok else "")
    )


def report(gpus: list[Gpu], *, plan: PlanConfig, config: RLConfig | None) -> tuple[bool, list[str]]:
    """The plan's lines and whether every GPU fits; GPUs with the same processes and
    memory are reported once (``GPU 0-63``)."""
    gpu_bytes = plan.gpu_memory_gib * GIB
    lines = [
        f"{len(gpus)} GPU(s) of {plan.gpu_memory_gib:g} GiB (--plan.gpu_memory_gib), "
        f"{-(-len(gpus) // plan.gpus_per_node)} node(s) of {plan.gpus_per_node} "
        "(--plan.gpus_per_node)"
    ]
    fits = True
    groups: list[tuple[list[int], str]] = []
    for gpu in gpus:
        ok, how = judge(gpu, config=config, gpu_bytes=gpu_bytes)
        fits &= ok
        body = "; ".join(
            [f"{p.label.split(' rank ')[0]} {p.memory.describe()}" for p in gpu.learners]
            + ([f"vLLM engine {gpu.engine_share / GIB:.1f} GiB share"] if gpu.engine else [])
        )
        text = f"{body} -> {how}: {'fits' if ok else 'DOES NOT FIT'}"
        if groups and groups[-1][1] == text:
            groups[-1][0].append(gpu.index)
        else:
            groups.append(([gpu.index], text))
    for indices, text in groups:
        name = f"GPU {indices[0]}" + (f"-{indices[-1]}" if len(indices) > 1 else "")
        lines.append(f"{name}: {text}")
    host = _host_per_node(gpus, plan.gpus_per_node)
    lines.append(
        f"host memory per node (offloaded states): up to {host / GIB:.1f} GiB"
        + (
            f" of {plan.host_memory_gib:g} GiB (--plan.host_memory_gib)"
            if plan.host_memory_gib
            else ""
        )
    )
    if plan.host_memory_gib and host > plan.host_memory_gib * GIB:
        fits = False
        lines.append("does not fit: the offloaded states exceed the host memory of a node")
    return fits, lines


def _host_per_node(gpus: list[Gpu], per_node: int) -> float:
    """The largest host memory any node's processes keep (GPUs numbered node by node)."""
    nodes: dict[int, float] = {}
    for gpu in gpus:
        node = gpu.index // per_node
        nodes[node] = nodes.get(node, 0.0) + sum(p.memory.host for p in gpu.learners)
    return max(nodes.values(), default=0.0)


def single_role_layout(
    role: RoleConfig, *, label: str, tokens: int, outputs_scalar: bool, flag: str
) -> list[Gpu]:
    """The GPUs of ``rlhf train sft|rm|dpo``: one role, a GPU per rank."""
    shape = ModelShape.read(role.model.path, flag=flag)
    memory = learner_memory(
        role, shape, tokens=tokens, trains=True, outputs=1 if outputs_scalar else shape.vocab
    )
    gpus: list[Gpu] = []
    _place(gpus, 0, role.num_ranks, label, memory)
    return gpus


def single_role_plan(
    role: RoleConfig, *, plan: PlanConfig, label: str, tokens: int, outputs_scalar: bool
) -> tuple[bool, list[str]]:
    """``rlhf train sft|rm|dpo --dry_run``: whether the run fits, and the plan's lines."""
    gpus = single_role_layout(
        role, label=label, tokens=tokens, outputs_scalar=outputs_scalar, flag="--model.model.path"
    )
    return report(gpus, plan=plan, config=None)


def capacity_plan(config: RLConfig) -> tuple[bool, list[str]]:
    """``rlhf train <algorithm> --dry_run``: whether the run fits, and the plan's lines."""
    gpus, engine_lines = rl_layout(config)
    fits, lines = report(gpus, plan=config.plan, config=config)
    fits &= not any(line.startswith("does not fit") for line in engine_lines)
    return fits, [lines[0], *engine_lines, *lines[1:]]


def show(fits: bool, lines: list[str]) -> int:
    """Print the plan (``[capacity] …`` lines) and the verdict; the exit status (0: fits, 1:
    does not)."""
    for line in lines:
        print(f"[capacity] {line}")
    print(f"[capacity] {'fits' if fits else 'DOES NOT FIT'} (estimates; see rlhf.learner.capacity)")
    return 0 if fits else 1


# -- the step plan every run prints ---------------------------------------------------------
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
        + "".join(
            f"; {name} {config.teacher_config(path).num_ranks} rank(s) ({path})"
            for name, (_, path) in config.teacher_roles().items()
        )
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
