"""The sections of ``rlhf train``'s run configuration, one frozen dataclass per flag prefix
(``--rollout.*``, ``--vllm.*``, ``--actor.*``/``--critic.*``/…, ``--train.*``, ``--reward.*``,
``--eval.*``, ``--ckpt.*``, ``--ray.*``, ``--plan.*``), composed by `rlhf.cli.config.RLConfig`
with the packages' own (``--data.*`` is `rlhf.learner.DataConfig`, ``--algo.*``
`rlhf.algos.AlgoConfig`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from rlhf.cli.backends import backend_of
from rlhf.learner import DeepSpeedConfig, LearnerConfig, ModelConfig, OptimizerConfig
from rlhf.molt import FSDPConfig
from rlhf.rollout import EngineOptions
from rlhf.weights import TRANSPORTS

VERIFY_SYNC = {"off": "off", "cheap": "cheap", "full": "full", "True": "full", "False": "off"}
"""``--vllm.verify_sync`` values and the mode each means (booleans from before the modes)."""

TURN_CREDIT = ("episode", "per_turn")
"""``--train.turn_credit`` values."""

WEIGHT_TRANSPORTS = ("auto", *TRANSPORTS)
"""``--train.weight_transport`` values: ``auto`` and every transport `rlhf.weights` registers."""


@dataclass(frozen=True)
class RolloutConfig:
    """Sampling (flags ``--rollout.*``).

    Attributes:
        batch_size: Prompts per RL step (OpenRLHF's ``rollout_batch_size``).
        n_samples_per_prompt: Samples per prompt (a group for group estimators).
        temperature: Sampling temperature (the learner's log-probs use the same).
        top_p: Nucleus mass.
        top_k: Top-k; -1 disables.
        max_new_tokens: Generation budget per sample.
        max_len: Prompt + response budget; prompts are left-truncated to fit.
        seed_requests: Seed every sampling request from ``--train.seed``, the step and the
            request's place in the batch (prompt, sample, turn; `rlhf.agents.request_seed`),
            so a resumed run samples exactly what the uninterrupted run sampled and two runs
            with one seed sample alike (on GPUs, as far as vLLM's numerics do not depend on
            the batch). Evaluation draws the same seeds at every evaluation. False: the
            engines' own random streams.
        dump_dir: Write every step's rollout (token ids, log-probs, rewards, weight
            versions, metrics) here as it trains (`rlhf.rollout.RolloutDump`: safetensors +
            JSON), beside a record of the policy and sampling settings that produced it.
        replay_dir: Train on the rollouts dumped there instead of sampling: the engines
            sample nothing for training (they still evaluate; with no evaluation, no
            ``--data.eval_data`` or ``--eval.steps 0``, no vLLM engine starts), and with the
            dump's seed the losses and weights equal the dumping run's bit for bit. Refused
            when the dump came from another starting policy, batch, group size or
            temperature, or holds fewer steps than the run.
        oversample_factor: Draw this many times the prompts a step needs and train on the
            first prompt groups to finish (in draw order), cancelling the rest in vLLM: the
            step stops waiting for its longest samples (`rlhf.rollout.sample_step`). The
            prompts drawn beyond the batch are used up; which groups finish first depends on
            timing, so a run with a factor above 1 is not reproducible sample for sample, and
            the batch leans to short responses (the cancelled groups are the long ones:
            benchmarks/README.md, ``bench_oversample``). 1 (default): every drawn prompt is
            trained on.
    """

    batch_size: int = 16
    n_samples_per_prompt: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    max_len: int = 1024
    seed_requests: bool = True
    dump_dir: str = ""
    replay_dir: str = ""
    oversample_factor: float = 1.0


@dataclass(frozen=True, kw_only=True)
class VllmConfig(EngineOptions):
    """Rollout engines (flags ``--vllm.*``): every engine's `rlhf.rollout.EngineOptions`
    (``--vllm.dtype``, ``--vllm.enforce_eager``, ``--vllm.gpu_memory_utilization``, …) and
    how many there are and how they are synced.

    Attributes:
        num_engines: vLLM engines (one Ray actor each).
        verify_sync: What each engine reads back after a sync and compares with what it
            received (bucket and tensor checksums are always checked on receipt): ``cheap``
            (the output head, tied or not, the input embedding and the first tensor of every
            bucket), ``full`` (every weight, through the engine's own kernels) or ``off``;
            ``True`` / ``False`` mean ``full`` / ``off``.
        num_cpus: CPUs each engine actor reserves in Ray.
        node: The Ray nodes the engines may run on (`rlhf.cli.nodes`: empty for any,
            ``spread``, node labels ``key=value[,key=value]`` or a node id).
        enable_sleep: Under ``--train.colocate_all`` on GPUs, the engines sleep while the
            learners work (vLLM sleep mode, level 1: weights to host memory, KV cache freed)
            and wake for the sync and generation (OpenRLHF's ``--vllm_enable_sleep``). True:
            every step; False: never; None (default): in the first step, and after it only
            if what training added to the learners' memory would not fit next to the awake
            engines (`rlhf.learner.hybrid.TrainingPeak`; also whenever the learners' states
            move). On CPUs vLLM has no sleep mode and the engines keep their memory.
    """

    num_engines: int = 1
    verify_sync: str = "cheap"
    num_cpus: float = 1.0
    node: str = ""
    enable_sleep: bool | None = None


@dataclass(frozen=True)
class RoleConfig:
    """One learner role (flags ``--actor.*``, ``--critic.*``).

    Attributes:
        model: The model (``--actor.model.path``); the critic defaults to the actor's path.
        optimizer: Learning rate and schedule.
        backend: What trains the role: ``deepspeed`` (ZeRO 0–3, the ``deepspeed`` options)
            or ``molt`` (PyTorch FSDP2, the ``fsdp`` options); `rlhf.cli.backends`.
        deepspeed: ZeRO stage, offload, bf16 (``--actor.backend deepspeed``).
        fsdp: FSDP2 options (``--actor.backend molt``; Molt's ``--fsdp.*`` names).
        num_ranks: Ranks (processes): data-parallel replicas x the tensor-parallel size
            (``fsdp.tp_size`` or ``deepspeed.tp_size``) x the context-parallel size.
        num_gpus_per_rank: GPUs per rank (0 on CPU).
        num_cpus_per_rank: CPUs each rank reserves in Ray.
        ring_attn_size: Context parallel (OpenRLHF's name): each row's sequence split over
            this many adjacent ranks, attention exact by ring attention; on either backend
            (the same as ``deepspeed.ring_attn_size`` or ``fsdp.cp_size``, which it sets).
        node: The Ray nodes the role's ranks may run on (`rlhf.cli.nodes`: empty for any,
            ``spread``, node labels ``key=value[,key=value]`` or a node id); the reference
            and the reward model follow the actor's.
    """

    model: ModelConfig = field(default_factory=lambda: ModelConfig(path=""))
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    backend: str = "deepspeed"
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    num_ranks: int = 1
    num_gpus_per_rank: float = 0.0
    num_cpus_per_rank: float = 1.0
    ring_attn_size: int = 1
    node: str = ""

    def context_parallel_sizes(self) -> set[int]:
        """The context-parallel sizes set on this role's backend (more than one: they
        conflict; none: 1)."""
        return {self.ring_attn_size, backend_of(self).own_context_parallel()} - {1}

    @property
    def context_parallel(self) -> int:
        """The context-parallel size (``ring_attn_size`` or the backend's own option)."""
        return max(self.context_parallel_sizes(), default=1)

    def learner(self, *, seed: int, total_steps: int, train: bool = True) -> LearnerConfig:
        """The role for `rlhf.learner` (``train`` False: eval-only, no optimizer)."""
        optimizer = dataclasses.replace(self.optimizer, total_steps=max(total_steps, 1))
        return LearnerConfig(model=self.model, optimizer=optimizer if train else None, seed=seed)

    def eval_only(self, *, offload: bool) -> RoleConfig:
        """A scoring role modelled on this one (the reference, the reward model): one rank;
        with ``offload``, DeepSpeed ZeRO-3 with its parameters on the CPU between uses (on
        the deepspeed backend whatever this role's is: parameter offload is DeepSpeed's; the
        logits path then, since ZeRO-3 shards the lm_head outside its forward; AutoTP off, as
        it does not combine with ZeRO-3: the replica's ranks are then data parallel). One
        data-parallel replica: the tensor-parallel × the context-parallel size ranks (it stays
        split as this role is)."""
        replica = self.tensor_parallel * self.context_parallel
        role = dataclasses.replace(self, num_ranks=replica)
        if not offload:
            return role
        ds = dataclasses.replace(role.deepspeed, zero_stage=3, offload_params=True, tp_size=1)
        model = dataclasses.replace(role.model, chunked_lm_head=False)
        return dataclasses.replace(role, deepspeed=ds, model=model, backend="deepspeed")

    @property
    def tensor_parallel(self) -> int:
        """The tensor-parallel size on the role's backend (``fsdp.tp_size`` or
        ``deepspeed.tp_size``)."""
        return backend_of(self).tensor_parallel()

    def with_model(self, **changes: object) -> RoleConfig:
        """This role with ``model`` fields changed."""
        return dataclasses.replace(self, model=dataclasses.replace(self.model, **changes))


@dataclass(frozen=True)
class LoggingConfig:
    """Where a run's metrics go besides ``run_dir/metrics.jsonl``: one set of fields for RL
    (``--train.use_wandb``, …, as `TrainConfig`'s) and for SFT, RM and DPO (``--use_wandb``,
    …, at the top level of theirs).

    Attributes:
        use_tensorboard: Also write the metrics as TensorBoard events into this directory
            (needs ``pip install 'rlhf-cli[tensorboard]'``); empty: JSONL only.
        use_wandb: Also log to Weights & Biases (needs ``pip install 'rlhf-cli[wandb]'``;
            credentials from ``wandb login`` or ``WANDB_API_KEY``, never a flag, so they stay
            out of config.json; ``WANDB_MODE=offline`` keeps the run under ``run_dir/wandb``).
            A resumed run continues the same W&B run.
        wandb_project: W&B project.
        wandb_org: W&B entity (team or user); empty: the account's default.
        wandb_group: W&B group of the run; empty: none.
        wandb_run_name: W&B display name; empty: the run directory's name.
    """

    use_tensorboard: str = ""
    use_wandb: bool = False
    wandb_project: str = "rlhf"
    wandb_org: str = ""
    wandb_group: str = ""
    wandb_run_name: str = ""


@dataclass(frozen=True)
class TrainConfig(LoggingConfig):
    """The RL loop (flags ``--train.*``).

    Attributes:
        num_steps: RL steps (rollout + update + sync).
        num_episodes: Passes over the prompts (OpenRLHF's ``--train.num_episodes``); > 0 sets
            ``num_steps`` to ``num_episodes · (prompts // rollout.batch_size)`` (at least 1).
        batch_size: Sequences per optimizer step (OpenRLHF's ``train_batch_size``); 0 uses
            the whole rollout batch for one step.
        ppo_epochs: Passes over each rollout batch.
        actor_freezing_steps: The first N steps update the critic alone, so it warms up
            before the policy follows its values (OpenRLHF's ``--critic.freezing_steps``,
            which counts from 0: its N is N + 1 here). Needs a critic.
        micro_batch_size: Rows per micro-batch (forward/backward unit).
        max_tokens_per_micro_batch: Token budget of a micro-batch (0: rows only): padded
            tokens, or real tokens when the role runs padding-free
            (``--actor.model.packing_samples``).
        reward_func: The older spelling of ``--reward.reward_func`` (still accepted).
        remote_url: The older spelling of ``--reward.remote_url`` (still accepted).
        reward_model_path: A reward model (``rlhf train rm`` export) scores the samples for
            training instead of the function; ``reward_func`` then only scores evaluations.
        agent_func_path: A Python file with a multi-turn environment class ``Environment``
            (``reset(prompt, label)``, ``step(action_text)`` -> feedback/reward/done) or an
            OpenAI-client agent ``agent(base_url, prompt, label)`` returning its reward; the
            episode's rewards replace ``reward_func`` for training (evaluations stay
            single-turn, scored by ``reward_func``).
        agent_max_turns: Most policy turns per episode (environment files).
        agent_step_timeout_s: Deadline of one environment ``reset()`` or ``step()`` call (also
            spelled ``--train.agent_timeout_s``); past it the run stops naming the file,
            prompt, sample and turn (synchronous methods run on a thread of their own, so one
            that never returns cannot stall the run).
        agent_failure_policy: What an episode whose environment fails (raises, passes
            ``agent_step_timeout_s``, returns something malformed) becomes: ``raise`` (the run
            stops naming it), ``skip`` (left out; its prompt group then drops out of the
            step) or ``fallback`` (ended where it failed with ``agent_fallback_value`` as its
            reward). ``env/failed``, ``env/skipped`` and ``env/fallback`` count them per step.
        agent_fallback_value: The reward of a failed episode under ``fallback``.
        turn_credit: How an environment's per-turn rewards reach the tokens: ``episode`` (their
            sum on the episode's last action token) or ``per_turn`` (each turn's reward on that
            turn's last action token, so discounted returns and GAE credit each turn with the
            rewards that follow it, by γ and λ). ``per_turn`` needs an estimator without a
            group baseline (``gae`` or ``reinforce``): a baseline compares one number per sample.
        async_enable: Sample later batches while the current one trains (`rlhf.rollout.schedule`):
            batch ``j`` is sampled with the weights of step ``j - async_queue_size``.
        async_queue_size: Most batches sampled ahead of training (the staleness bound).
        partial_rollout_enable: In async mode, sync without waiting for batches in flight:
            the engines pause, load and resume, and requests finish on the new weights.
        colocate_actor_ref: The reference runs in the actor's first placement bundle.
        colocate_critic_reward: The reward model runs in the critic's first bundle.
        colocate_all: Hybrid placement: bundle ``i`` holds actor rank ``i``, critic rank ``i``
            and engine ``i`` (reference and reward model in bundle 0), so generation and
            training take turns on the same resources (`rlhf.cli.placement`).
        deepspeed_enable_sleep: Under ``--train.colocate_all``, the actor's and critic's
            optimizer states, fp32 master weights and gradient partitions leave the device
            for the weight sync, and their model weights too while the engines generate
            (`rlhf.learner.hybrid`; OpenRLHF's ``--deepspeed_enable_sleep``). None (default):
            on GPUs when both roles run ZeRO-1/2/3 or molt and memory requires it (the GPU's free
            memory with every role started, less the optimizer states the first step adds,
            under 5 % of the device; the plan prints the numbers); True: always
            (needs ZeRO-1/2/3 or molt; on a CPU machine the states make the round trip in
            host memory, which frees nothing and costs time); False: never.
        ref_reward_offload: Build the reference and the reward model with ZeRO-3 and their
            parameters offloaded to the CPU between uses (OpenRLHF's ``--ref_reward_offload``).
        weight_transport: How the actor's weights reach the engines (`rlhf.weights`):
            ``auto`` (CUDA IPC when the one engine shares the actor's GPU, an NCCL broadcast
            to engines on other GPUs, shared memory on one CPU machine, the object store
            across CPU nodes), or a transport `rlhf.weights` registers: ``object_store``,
            ``shared_memory``, ``cuda_ipc``, ``broadcast`` (gloo on CPUs, NCCL on GPUs), and
            the delta syncs ``shared_memory_delta``, ``broadcast_delta`` (only the words
            that changed since the last sync travel; ``sync/bytes_sent``,
            ``sync/changed_fraction`` in the step's metrics).
        weight_bucket_mib: Bucket size of the weight stream, in MiB; 0 (default): the
            transport's (`rlhf.weights.TransportSpec.bucket_mib`: 512 for CUDA IPC, whose
            buckets all stay alive until the engines loaded them, so the size sets only how
            many buckets, handles and digest passes a sync has; 64 for the others, whose
            streaming sender holds one bucket beside the model).
        seed: Seed of prompt order, sampling and initialisation.
    """

    num_steps: int = 100
    num_episodes: int = 0
    batch_size: int = 0
    ppo_epochs: int = 1
    actor_freezing_steps: int = 0
    micro_batch_size: int = 8
    max_tokens_per_micro_batch: int = 0
    reward_func: str = "builtin:exact_match"
    remote_url: str = ""
    reward_model_path: str = ""
    agent_func_path: str = ""
    agent_max_turns: int = 4
    agent_step_timeout_s: float = 60.0
    agent_failure_policy: str = "raise"
    agent_fallback_value: float = 0.0
    turn_credit: str = "episode"
    async_enable: bool = False
    async_queue_size: int = 1
    partial_rollout_enable: bool = False
    colocate_actor_ref: bool = False
    colocate_critic_reward: bool = False
    colocate_all: bool = False
    deepspeed_enable_sleep: bool | None = None
    ref_reward_offload: bool = False
    weight_transport: str = "auto"
    weight_bucket_mib: int = 0
    seed: int = 42


FAILURE_POLICIES = ("raise", "skip", "fallback")
"""``--reward.failure_policy`` values (`rlhf.agents.FailurePolicy`)."""


def is_reward_file(remote_url: str) -> bool:
    """``--reward.remote_url`` names a Python reward file (OpenRLHF's use of the flag), not
    servers: it ends in ``.py`` and is not an http(s) URL."""
    text = remote_url.strip()
    return text.endswith(".py") and not text.startswith(("http://", "https://"))


@dataclass(frozen=True)
class RewardConfig:
    """Where rewards come from and what happens when one cannot be computed (flags
    ``--reward.*``; OpenRLHF's ``--reward.remote_url``).

    Attributes:
        reward_func: ``builtin:<name>`` (exact_match, math_answer, boxed_format) or a Python
            file defining ``reward_func(queries, prompts, labels, **kw)``. Empty:
            ``--train.reward_func`` (default ``builtin:exact_match``).
        remote_url: HTTP reward servers (OpenRLHF wire format), comma-separated, instead of a
            function; or, as in OpenRLHF, one ``.py`` reward file (then it is the reward
            function, like ``reward_func``). Empty: ``--train.remote_url``.
        timeout_s: Deadline of one reward-function call or one server request; past it, the
            failure policy applies (a function that never returns cannot stall the run).
        retries: Retries of a failed server request after the first attempt.
        failure_policy: For a sample without a reward (the function raised, returned NaN or
            timed out; the server failed for good): ``raise`` stops the run naming the sample,
            ``skip`` drops the sample (its prompt group then drops out of group estimators;
            ``reward/failed`` counts them), ``fallback`` gives it ``fallback_value``
            (``reward/fallback`` counts them).
        fallback_value: The reward under ``fallback``.
        api_key: Sent to the reward servers as ``Authorization: Bearer <key>`` (``rlhf serve-rm
            --api_key``). Empty: the ``RLHF_REWARD_API_KEY`` environment variable, if set
            (keeps the key out of process listings). Never written to ``config.json``.
    """

    reward_func: str = ""
    remote_url: str = ""
    timeout_s: float = 60.0
    retries: int = 3
    failure_policy: str = "raise"
    fallback_value: float = 0.0
    api_key: str = field(default="", repr=False)


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation (flags ``--eval.*``).

    Attributes:
        steps: Evaluate every this many RL steps (and before the first and after the last);
            0 disables.
        n_samples: Samples per prompt: pass@k with k = n_samples, and pass@1 (the fraction
            of a prompt's samples that solve it, averaged over prompts).
        temperature: Sampling temperature of the evaluation.
        max_prompts: Evaluate on at most this many prompts per data source.
        solved_threshold: A sample solves its prompt when its score is at least this (1.0:
            full marks of a 0/1 or graded reward; a graded reward's partial credit does not
            count as solved). ``eval/<source>/score_mean`` reports the mean score itself.
        best_metric: Keep the best evaluated policy (`rlhf.cli.best`): after an evaluation
            whose metric (``eval/<source>/pass@1``, ``…/pass@<n_samples>`` or
            ``…/score_mean``) beats the best so far, the actor is exported to
            ``run_dir/best`` with a ``best.json`` (step, value). Empty: off.
        best_mode: ``max`` (higher is better) or ``min``.
        eval_only: Evaluate the policy at ``--actor.model.path`` once on ``--data.eval_data``
            with these settings and stop: vLLM engines only, no learner, no training (the
            row goes to ``run_dir/metrics.jsonl`` at step 0).
    """

    steps: int = 10
    n_samples: int = 4
    temperature: float = 1.0
    max_prompts: int = 256
    solved_threshold: float = 1.0
    best_metric: str = ""
    best_mode: str = "max"
    eval_only: bool = False


@dataclass(frozen=True)
class CkptConfig:
    """Checkpoints (flags ``--ckpt.*``).

    Attributes:
        save_steps: Save every this many steps; 0 saves only at the end.
        keep: Keep this many newest checkpoints.
        load_enable: ``True``: resume from the newest checkpoint in the run directory (none
            there, or a damaged one, is an error naming what to do); ``auto``: resume from
            the newest intact checkpoint if there is one (damaged newer ones are skipped and
            named), else start a new run; ``False``: a new run.
        allow_config_change: Flags a resume may change although the checkpoint was written
            with other values (e.g. ``rollout.batch_size``), comma-separated; their meaning for
            the run changes with them (the prompt position and the schedule were counted in
            the old values).
        export_hf: Export the final policy as a transformers checkpoint (run_dir/final; with
            ``--actor.optimizer.ema_decay``, its exponential moving average beside it in
            run_dir/final_ema).
        save_state: Saves write the resumable state (learner and optimizer states, the run's
            position); False writes none (OpenRLHF's ``--ckpt.disable_ds``), leaving only
            what ``save_hf`` exports.
        save_hf: Every save also exports the policy (its EMA with ``ema_decay``) as a
            transformers folder, run_dir/hf_checkpoints/step_<N>, the ``keep`` newest kept
            (OpenRLHF's ``--ckpt.save_hf``).
    """

    save_steps: int = 0
    keep: int = 2
    load_enable: bool | Literal["auto"] = False
    allow_config_change: str = ""
    export_hf: bool = True
    save_state: bool = True
    save_hf: bool = False

    @property
    def allowed_changes(self) -> set[str]:
        """``allow_config_change`` as flag names without dashes."""
        return {f.strip().lstrip("-") for f in self.allow_config_change.split(",") if f.strip()}


@dataclass(frozen=True)
class RayConfig:
    """The Ray cluster the command runs on (flags ``--ray.*``).

    Attributes:
        address: Join the running Ray cluster at this address and never start one:
            ``host:port`` of its head (GCS), ``auto`` (the cluster ``ray start`` began on this
            machine) or ``ray://host:port`` (Ray client). Empty: ``RAY_ADDRESS`` when it is set
            (``ray job submit`` sets it for the job), otherwise a local cluster for this run.
            On a cluster every node needs the packages and sees the model paths and run
            directory at the same path.
    """

    address: str = ""


@dataclass(frozen=True)
class PlanConfig:
    """The machines ``--dry_run`` plans for (flags ``--plan.*``; `rlhf.cli.dry_run`).

    Attributes:
        gpu_memory_gib: Memory of one GPU in GiB (an H100 80GB has about 79, an H200 about
            140).
        gpus_per_node: GPUs per node.
        host_memory_gib: Host memory of one node in GiB, checked against the states
            offloaded to it; 0: not checked.
    """

    gpu_memory_gib: float = 80.0
    gpus_per_node: int = 8
    host_memory_gib: float = 0.0

    def problems(self) -> list[str]:
        """Values out of range, each naming its flag."""
        out = []
        if not self.gpu_memory_gib > 0:
            out.append(f"--plan.gpu_memory_gib must be > 0, got {self.gpu_memory_gib}")
        if self.gpus_per_node < 1:
            out.append(f"--plan.gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.host_memory_gib < 0:
            out.append(
                f"--plan.host_memory_gib must be >= 0 (0: unchecked), got {self.host_memory_gib}"
            )
        return out
