"""The run configuration of ``rlhf train <algorithm>``: the packages' frozen configs composed
under OpenRLHF-style dotted flags (``--rollout.n_samples_per_prompt``, ``--algo.kl.init_coef``,
``--vllm.num_engines``, …), with cross-field validation that names the flags. The sections
themselves are in `rlhf.cli.sections` (and importable from here)."""

from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import dataclass, field

from rlhf.algos import AlgoConfig
from rlhf.cli.backends import backend_of
from rlhf.cli.nodes import NodeSpec, Processes
from rlhf.cli.sections import (
    VERIFY_SYNC,
    CkptConfig,
    EvalConfig,
    PlanConfig,
    RayConfig,
    RewardConfig,
    RoleConfig,
    RolloutConfig,
    TrainConfig,
    VllmConfig,
    is_reward_file,
)
from rlhf.cli.validation import problems
from rlhf.learner import DataConfig
from rlhf.learner.prompts import named_items


class ConfigError(ValueError):
    """An invalid combination of flags; the message names them."""


FLAG_ALIASES: dict[str, str] = {
    "train.agent_timeout_s": "train.agent_step_timeout_s",
}
"""Other spellings of a flag (and of its ``--config`` key) → the field it sets; an alias stays
in its field's section."""


def canonical_flag(dotted: str) -> str:
    """The field ``dotted`` (a flag's name without ``--``) sets: itself, or its alias's field."""
    return FLAG_ALIASES.get(dotted, dotted)


class RunError(RuntimeError):
    """A run that cannot go on for a reason the user can act on (every sample's reward
    failed under the skip policy, say); the message says what to do. ``rlhf`` prints it
    without a traceback and exits 1."""


def raise_problems(problems: list[str], *, where: str) -> None:
    """Raise one `ConfigError` for ``problems``: the message itself when there is one, else
    "N problems in <where>:" and one line each; nothing when the list is empty."""
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        listed = "\n".join(f"  - {message}" for message in problems)
        raise ConfigError(f"{len(problems)} problems in {where}:\n{listed}")


@dataclass(frozen=True)
class RLConfig:
    """``rlhf train <algorithm>``.

    Attributes:
        run_dir: Where metrics, the resolved config, checkpoints and exports go.
        data: Prompt data.
        rollout: Sampling.
        vllm: Engines.
        actor: The policy.
        critic: The value model (used by the ``gae`` estimator).
        teacher: The frozen teacher of on-policy distillation (``rlhf train distill``):
            ``--teacher.model.path`` one model directory, or comma-separated ``source=path``
            pairs naming one teacher per data source of ``--data.prompt_data``; it scores
            with its own backend, resources and ``--teacher.node`` (`teacher_paths`).
        algo: Estimator, losses, KL, filtering (``rlhf.algos``).
        train: The loop.
        eval: Evaluation.
        ckpt: Checkpoints.
        ray: The Ray cluster (a local one, or one to join).
        reward: Reward sources and their failure policy.
        dry_run: Print the capacity plan (each GPU's estimated memory by role, and whether
            it fits) from the models' config.json alone, and exit: 0 when it fits, 1 when
            not. Nothing starts (no Ray, no GPU, no weights read).
        plan: The machines the capacity plan is for.
    """

    run_dir: str = "runs/rl"
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    actor: RoleConfig = field(default_factory=RoleConfig)
    critic: RoleConfig = field(default_factory=RoleConfig)
    teacher: RoleConfig = field(default_factory=RoleConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    dry_run: bool = False
    plan: PlanConfig = field(default_factory=PlanConfig)

    @property
    def uses_critic(self) -> bool:
        """The estimator reads critic values (`rlhf.algos.EstimatorSpec.needs_critic`)."""
        return self.algo.advantage.spec.needs_critic

    def resolved_reward(self) -> RewardConfig:
        """``--reward.*`` with the older ``--train.reward_func`` / ``--train.remote_url``
        spellings filled in where the new ones are unset."""
        r, t = self.reward, self.train
        remote = r.remote_url or t.remote_url
        if is_reward_file(remote):  # OpenRLHF's --reward.remote_url reward.py
            return dataclasses.replace(r, reward_func=remote.strip(), remote_url="")
        return dataclasses.replace(r, reward_func=r.reward_func or t.reward_func, remote_url=remote)

    @property
    def uses_reference(self) -> bool:
        return self.algo.kl.init_coef > 0

    def teacher_paths(self) -> dict[str, str]:
        """``--teacher.model.path`` read: ``{"": path}`` for one teacher of every prompt, or
        ``{source: path}`` for teachers by data source (``source=path`` pairs, split as
        ``--data.prompt_data`` is: `rlhf.learner.prompts.named_items`); empty without a
        teacher. Entries without a name or a path are kept for `rlhf.cli.validation` to name."""
        items = named_items(self.teacher.model.path)
        if len(items) == 1 and not items[0][0]:
            return {"": items[0][1]}
        return dict(items)

    def teacher_roles(self) -> dict[str, tuple[str, str]]:
        """Each teacher's role name (`teacher_role`) → (data source, model path)."""
        return {
            teacher_role(source): (source, path) for source, path in self.teacher_paths().items()
        }

    def teacher_config(self, path: str) -> RoleConfig:
        """The scoring role of the teacher at ``path``: ``--teacher.*`` as one data-parallel
        replica, offloaded like the reference under ``--train.ref_reward_offload``."""
        role = self.teacher.eval_only(offload=self.train.ref_reward_offload)
        return dataclasses.replace(role, model=dataclasses.replace(role.model, path=path))

    def processes(self) -> Processes:
        """What placement reads of the run: every role it starts (processes, CPUs each), the
        roles' node specs and the colocation flags."""
        actor_cpus = self.actor.num_cpus_per_rank
        ranks = {"actor": (self.actor.num_ranks, actor_cpus)}
        if self.uses_reference:
            ranks["ref"] = (1, actor_cpus)
        if self.uses_critic:
            ranks["critic"] = (self.critic.num_ranks, self.critic.num_cpus_per_rank)
        if self.train.reward_model_path:
            ranks["reward_model"] = (1, actor_cpus)
        for name, (_, path) in self.teacher_roles().items():
            teacher = self.teacher_config(path)
            ranks[name] = (teacher.num_ranks, teacher.num_cpus_per_rank)
        ranks["engines"] = (self.vllm.num_engines, self.vllm.num_cpus)
        t = self.train
        return Processes(
            ranks=ranks,
            nodes=self.role_nodes(),
            colocate_all=t.colocate_all,
            colocate_actor_ref=t.colocate_actor_ref,
            colocate_critic_reward=t.colocate_critic_reward,
        )

    def validate(self) -> RLConfig:
        """Raise `ConfigError` listing every invalid value and combination, each naming its
        flags (checked before anything starts)."""
        raise_problems(problems(self), where="the configuration")
        return self

    def role_nodes(self) -> dict[str, tuple[str, NodeSpec]]:
        """Per role, the flag whose node spec it follows and that spec: the reference and
        the reward model follow ``--actor.node`` (the reward model ``--critic.node`` when
        ``--train.colocate_critic_reward`` puts it beside the critic), the teachers
        ``--teacher.node`` when it is set, else the actor's.

        Raises:
            NodeSpecError: a spec that does not parse, naming its flag.
        """
        parse = {flag: (flag, NodeSpec.parse(text, flag=flag)) for flag, text in self.node_flags()}
        actor, critic = parse["--actor.node"], parse["--critic.node"]
        teacher = parse["--teacher.node"] if self.teacher.node else actor
        return {
            "actor": actor,
            "ref": actor,
            "critic": critic,
            "reward_model": critic if self.train.colocate_critic_reward else actor,
            "engines": parse["--vllm.node"],
            **dict.fromkeys(self.teacher_roles(), teacher),
        }

    def node_flags(self) -> tuple[tuple[str, str], ...]:
        """(flag, node spec text) of the roles that take one."""
        return (
            ("--actor.node", self.actor.node),
            ("--critic.node", self.critic.node),
            ("--vllm.node", self.vllm.node),
            ("--teacher.node", self.teacher.node),
        )

    def with_absolute_paths(self) -> RLConfig:
        """This config with ``run_dir`` and the model directories that exist here made
        absolute: Ray workers (on another node, or started by a cluster this run joined)
        do not share this process's working directory."""
        return replace(
            self,
            **{
                "run_dir": str(pathlib.Path(self.run_dir).resolve()),
                "actor.model.path": absolute_path(self.actor.model.path),
                "critic.model.path": absolute_path(self.critic.model.path),
                "train.reward_model_path": absolute_path(self.train.reward_model_path),
                "teacher.model.path": ",".join(
                    f"{source}={absolute_path(path)}" if source else absolute_path(path)
                    for source, path in self.teacher_paths().items()
                ),
            },
        )

    def model_dirs(self) -> list[str]:
        """Every model directory the run loads (checked before anything starts)."""
        paths = [self.actor.model.path, self.train.reward_model_path]
        if self.uses_critic:
            paths.append(self.critic.model.path)
        paths += self.teacher_paths().values()
        return [p for p in paths if p]

    @property
    def verify_mode(self) -> str:
        """``--vllm.verify_sync`` as one of ``off``, ``cheap``, ``full``."""
        return VERIFY_SYNC[str(self.vllm.verify_sync)]

    @property
    def trained_roles(self) -> tuple[RoleConfig, ...]:
        """The roles with an optimizer: the actor, and the critic when one is used."""
        return (self.actor, self.critic) if self.uses_critic else (self.actor,)

    @property
    def offloadable_stages(self) -> bool:
        """Every trained role's states can leave the device between phases (ZeRO-1/2/3, or
        the molt backend)."""
        return all(backend_of(role).offloadable() for role in self.trained_roles)

    def offloads_learners(self, *, gpu: bool) -> bool:
        """Whether hybrid placement may move the actor's (and critic's) states between phases
        (``--train.deepspeed_enable_sleep``; unset: on GPUs, for ZeRO-1/2/3, and then only
        when `rlhf.learner.hybrid.Headroom` says memory requires it)."""
        flag = self.train.deepspeed_enable_sleep
        if not self.train.colocate_all or flag is False:
            return False
        return flag is True or (gpu and self.offloadable_stages)

    @property
    def optimizer_steps_per_rollout(self) -> int:
        samples = self.rollout.batch_size * self.rollout.n_samples_per_prompt
        per_step = self.train.batch_size or samples
        return self.train.ppo_epochs * -(-samples // per_step)

    def shape(self) -> dict[str, int]:
        """What a checkpoint records (``trainer_state.json``'s ``shape``) and a resume must
        keep: the `RL_SHAPE` flags' values."""
        out = {}
        for flag in RL_SHAPE:
            section, name = flag.split(".")
            out[flag] = int(getattr(getattr(self, section), name))
        return out


def teacher_role(source: str) -> str:
    """The role name of the teacher of data source ``source``: ``teacher`` for the one
    teacher of every prompt (``source`` empty), else ``teacher:<source>``."""
    return f"teacher:{source}" if source else "teacher"


RL_SHAPE = (
    "rollout.batch_size",
    "rollout.n_samples_per_prompt",
    "train.batch_size",
    "train.ppo_epochs",
)
"""The flags an RL checkpoint records and a resume must keep (`RLConfig.shape`)."""


def absolute_path(path: str) -> str:
    """``path`` made absolute when it names something here (else as given: a hub id)."""
    return str(pathlib.Path(path).resolve()) if path and pathlib.Path(path).exists() else path


def replace(config: RLConfig, **changes: object) -> RLConfig:
    """``dataclasses.replace`` that reaches nested fields by dotted name:
    ``replace(c, **{"rollout.batch_size": 8, "algo.kl.init_coef": 0.0})``."""
    return _replace_any(config, changes)  # type: ignore[return-value]


def _replace_any(obj: object, changes: dict[str, object]) -> object:
    nested: dict[str, dict[str, object]] = {}
    flat: dict[str, object] = {}
    for key, value in changes.items():
        head, _, rest = key.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            flat[key] = value
    for head, inner in nested.items():
        flat[head] = _replace_any(getattr(obj, head), inner)
    return dataclasses.replace(obj, **flat)  # type: ignore[type-var]
