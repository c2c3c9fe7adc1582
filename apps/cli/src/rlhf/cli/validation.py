"""The checks of `rlhf.cli.config.RLConfig.validate`: every value out of range and every flag
combination that cannot run, each a message naming its flags, found before anything starts.

`problems` returns them all at once: the backends' refusals, the ranges, the node specs, then
(only when those hold, since they assume them) the combinations.
"""

from __future__ import annotations

import math
import pathlib
from typing import TYPE_CHECKING

from rlhf.cli.backends import role_problems
from rlhf.cli.nodes import NodeSpec, NodeSpecError
from rlhf.cli.sections import (
    FAILURE_POLICIES,
    TURN_CREDIT,
    VERIFY_SYNC,
    WEIGHT_TRANSPORTS,
    TrainConfig,
    is_reward_file,
)
from rlhf.learner.prompts import source_names

if TYPE_CHECKING:
    from rlhf.cli.config import RLConfig


def problems(config: RLConfig) -> list[str]:
    """Every problem of ``config``, each naming its flags."""
    found = backend_problems(config) + range_problems(config) + node_problems(config)
    if not found:  # the combinations below assume the ranges hold
        found = [message for bad, message in combination_checks(config) if bad]
    return found


def range_problems(config: RLConfig) -> list[str]:
    """Sizes, counts and sampling parameters out of their range (``ZeroDivisionError``s
    and silent no-op runs otherwise)."""
    r, t, e = config.rollout, config.train, config.eval
    at_least = {
        "--rollout.batch_size": (r.batch_size, 1),
        "--rollout.n_samples_per_prompt": (r.n_samples_per_prompt, 1),
        "--rollout.max_new_tokens": (r.max_new_tokens, 1),
        "--rollout.max_len": (r.max_len, 2),
        "--train.ppo_epochs": (t.ppo_epochs, 1),
        "--train.num_episodes": (t.num_episodes, 0),
        "--train.batch_size": (t.batch_size, 0),
        "--train.max_tokens_per_micro_batch": (t.max_tokens_per_micro_batch, 0),
        "--eval.steps": (e.steps, 0),
        "--eval.n_samples": (e.n_samples, 1),
        "--eval.max_prompts": (e.max_prompts, 1),
        "--actor.num_ranks": (config.actor.num_ranks, 1),
        "--critic.num_ranks": (config.critic.num_ranks, 1),
    }
    problems = [
        f"{flag} must be >= {low}, got {value}"
        for flag, (value, low) in at_least.items()
        if value < low
    ]
    if not r.temperature > 0:
        problems.append(
            f"--rollout.temperature must be > 0, got {r.temperature} (the learner scores "
            "samples at this temperature; for greedy evaluation use --eval.temperature 0)"
        )
    if e.temperature < 0:
        problems.append(f"--eval.temperature must be >= 0, got {e.temperature}")
    if not 0 < r.top_p <= 1:
        problems.append(f"--rollout.top_p must be in (0, 1], got {r.top_p}")
    if not r.oversample_factor >= 1:
        problems.append(
            f"--rollout.oversample_factor must be >= 1, got {r.oversample_factor} (1 trains on "
            "every prompt drawn; 1.5 draws half again as many and keeps the first to finish)"
        )
    if r.top_k != -1 and r.top_k < 1:
        problems.append(f"--rollout.top_k must be -1 (off) or >= 1, got {r.top_k}")
    return problems + reward_problems(config) + config.plan.problems()


def reward_problems(config: RLConfig) -> list[str]:
    w, t = config.reward, config.train
    problems = []
    if not w.timeout_s > 0:
        problems.append(f"--reward.timeout_s must be > 0, got {w.timeout_s}")
    if w.retries < 0:
        problems.append(f"--reward.retries must be >= 0, got {w.retries}")
    if w.failure_policy not in FAILURE_POLICIES:
        problems.append(
            f"--reward.failure_policy must be one of {', '.join(FAILURE_POLICIES)}, "
            f"got {w.failure_policy!r}"
        )
    if not math.isfinite(w.fallback_value):
        problems.append(f"--reward.fallback_value must be finite, got {w.fallback_value}")
    spellings = (
        ("reward_func", w.reward_func, t.reward_func, TrainConfig.reward_func),
        ("remote_url", w.remote_url, t.remote_url, TrainConfig.remote_url),
    )
    remote = w.remote_url or t.remote_url
    if is_reward_file(remote):
        if "," in remote:
            problems.append(
                f"--reward.remote_url {remote!r}: one reward file (.py), or http(s) reward "
                "servers comma-separated, not both or several files"
            )
        elif w.reward_func or t.reward_func != TrainConfig.reward_func:
            problems.append(
                f"--reward.remote_url {remote!r} is a reward file: it is the reward function, "
                "so leave --reward.reward_func out"
            )
        else:
            problems += reward_file_problems(remote.strip(), flag="--reward.remote_url")
    else:
        func = w.reward_func or t.reward_func
        if func and not func.startswith("builtin:"):
            problems += reward_file_problems(func, flag="--reward.reward_func")
    for name, new, old, default in spellings:
        if new and old != default and new != old:
            problems.append(
                f"--reward.{name} {new!r} and its older spelling --train.{name} {old!r} "
                "disagree: set one"
            )
    return problems


def reward_file_problems(path: str, *, flag: str) -> list[str]:
    """What is wrong with the reward file ``path`` before anything starts, read without
    running it: missing, not ``.py``, not valid Python, or without a top-level
    ``reward_func``."""
    import ast

    file = pathlib.Path(path)
    if file.suffix != ".py":
        from rlhf.agents.builtin_rewards import NAMES as BUILTIN_REWARDS

        if path in BUILTIN_REWARDS:
            return [f"{flag} {path}: the built-in reward is spelled builtin:{path}"]
        return [
            f"{flag} {path}: a reward file must be a .py file (or a built-in: "
            f"{', '.join(f'builtin:{n}' for n in BUILTIN_REWARDS)})"
        ]
    if not file.is_file():
        return [f"{flag} {path}: no such file"]
    try:
        tree = ast.parse(file.read_bytes(), filename=str(file))
    except (SyntaxError, ValueError) as exc:
        line = getattr(exc, "lineno", None)
        where = f" (line {line})" if line else ""
        return [f"{flag} {path}: not valid Python{where}: {getattr(exc, 'msg', exc)}"]
    defined: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom | ast.Import):
            defined |= {alias.asname or alias.name for alias in node.names}
    if "reward_func" not in defined:
        return [
            f"{flag} {path}: defines no reward_func; a reward file defines "
            "reward_func(queries, prompts, labels, **kwargs) returning one reward per query "
            "(or a dict with 'rewards')"
        ]
    return []


def node_problems(config: RLConfig) -> list[str]:
    """Node specs that do not parse, or that colocated roles contradict."""
    problems = []
    for flag, text in config.node_flags():
        try:
            NodeSpec.parse(text, flag=flag)
        except NodeSpecError as e:
            problems.append(str(e))
    if problems or not config.train.colocate_all:
        return problems
    nodes = config.role_nodes()
    actor = nodes["actor"][1]
    others = ["engines"] + (["critic"] if config.uses_critic else []) + list(config.teacher_roles())
    for role in others:
        flag, spec = nodes[role]
        if spec and actor and spec != actor:
            problems.append(
                f"--train.colocate_all puts every role's rank i in one bundle, on one node: "
                f"{flag} {spec.describe()} contradicts --actor.node {actor.describe()} "
                "(set one of them, or both alike)"
            )
    return problems


def combination_checks(config: RLConfig) -> list[tuple[bool, str]]:
    return [
        (not config.actor.model.path, "--actor.model.path is required"),
        (
            not config.data.prompt_data and not config.dry_run and not config.eval.eval_only,
            "--data.prompt_data is required",
        ),
        (
            config.eval.eval_only and not config.data.eval_data,
            "--eval.eval_only evaluates --data.eval_data: give it (name=path pairs or a path)",
        ),
        (
            config.eval.eval_only and bool(config.eval.best_metric),
            "--eval.best_metric keeps the best policy of a training run; --eval.eval_only "
            "trains none: drop one of them",
        ),
        *teacher_checks(config),
        (
            bool(config.rollout.dump_dir) and config.rollout.dump_dir == config.rollout.replay_dir,
            "--rollout.dump_dir and --rollout.replay_dir name the same directory: the replay "
            "would rewrite the dump it reads; dump into another one",
        ),
        (
            config.rollout.n_samples_per_prompt < 2 and config.algo.advantage.spec.needs_groups,
            f"--algo.advantage.estimator={config.algo.advantage.estimator} compares samples "
            "of a prompt: set --rollout.n_samples_per_prompt >= 2",
        ),
        (
            config.rollout.max_new_tokens >= config.rollout.max_len,
            "--rollout.max_new_tokens must be smaller than --rollout.max_len",
        ),
        (
            config.train.batch_size > 0
            and config.train.batch_size % config.rollout.n_samples_per_prompt != 0,
            "--train.batch_size must be a multiple of --rollout.n_samples_per_prompt "
            "(a prompt's samples stay in one optimizer step)",
        ),
        (
            config.train.batch_size
            > config.rollout.batch_size * config.rollout.n_samples_per_prompt,
            "--train.batch_size exceeds the samples of one rollout "
            "(--rollout.batch_size x --rollout.n_samples_per_prompt)",
        ),
        (
            bool(config.resolved_reward().remote_url)
            and config.resolved_reward().reward_func != TrainConfig.reward_func,
            "--reward.remote_url and --reward.reward_func are exclusive",
        ),
        (
            config.algo.dynamic_filtering_enable and config.rollout.n_samples_per_prompt < 2,
            "--algo.dynamic_filtering_enable needs --rollout.n_samples_per_prompt >= 2",
        ),
        (
            config.algo.overlong_buffer_len is not None
            and config.algo.overlong_buffer_len >= config.rollout.max_new_tokens,
            "--algo.overlong_buffer_len must be smaller than --rollout.max_new_tokens "
            "(the penalty ramps over the last buffer_len tokens of the budget)",
        ),
        (
            bool(config.train.reward_model_path) and bool(config.resolved_reward().remote_url),
            "--train.reward_model_path and --reward.remote_url are exclusive",
        ),
        (
            bool(config.train.agent_func_path)
            and bool(config.train.reward_model_path or config.resolved_reward().remote_url),
            "--train.agent_func_path returns its own rewards; drop "
            "--train.reward_model_path / --reward.remote_url",
        ),
        (config.train.agent_max_turns < 1, "--train.agent_max_turns must be >= 1"),
        (
            config.eval.best_mode not in ("max", "min"),
            f"--eval.best_mode must be max or min, got {config.eval.best_mode!r}",
        ),
        (
            bool(config.eval.best_metric) and not (config.data.eval_data and config.eval.steps),
            "--eval.best_metric compares evaluations: give --data.eval_data and --eval.steps > 0",
        ),
        (
            config.train.agent_failure_policy not in ("raise", "skip", "fallback"),
            "--train.agent_failure_policy must be raise, skip or fallback, got "
            f"{config.train.agent_failure_policy!r}",
        ),
        (
            not math.isfinite(config.train.agent_fallback_value),
            "--train.agent_fallback_value must be a finite number",
        ),
        (
            config.train.turn_credit not in TURN_CREDIT,
            f"--train.turn_credit must be one of {', '.join(TURN_CREDIT)}, got "
            f"{config.train.turn_credit!r}",
        ),
        (
            config.train.turn_credit == "per_turn"
            and config.algo.advantage.spec.subtracts_baseline,
            f"--train.turn_credit per_turn places rewards on tokens, but "
            f"--algo.advantage.estimator {config.algo.advantage.estimator} subtracts a "
            "baseline from one reward per sample: use gae or reinforce, or --train.turn_credit "
            "episode",
        ),
        (
            not config.train.agent_step_timeout_s > 0,
            "--train.agent_step_timeout_s must be > 0",
        ),
        (
            bool(config.train.agent_func_path)
            and not pathlib.Path(config.train.agent_func_path).is_file(),
            f"--train.agent_func_path {config.train.agent_func_path!r}: no such file",
        ),
        (config.train.num_steps < 1, "--train.num_steps must be >= 1"),
        (config.train.async_queue_size < 1, "--train.async_queue_size must be >= 1"),
        (
            config.train.partial_rollout_enable and not config.train.async_enable,
            "--train.partial_rollout_enable needs --train.async_enable (a synchronous run "
            "never syncs while sampling)",
        ),
        (config.vllm.num_engines < 1, "--vllm.num_engines must be >= 1"),
        (
            str(config.vllm.verify_sync) not in VERIFY_SYNC,
            f"--vllm.verify_sync must be one of {sorted(VERIFY_SYNC)}",
        ),
        (
            config.train.weight_transport not in WEIGHT_TRANSPORTS,
            f"--train.weight_transport must be one of {', '.join(WEIGHT_TRANSPORTS)}",
        ),
        (
            config.train.weight_bucket_mib < 0,
            "--train.weight_bucket_mib must be >= 1 (or 0: by the transport)",
        ),
        (
            config.train.colocate_all and config.train.async_enable,
            "--train.colocate_all makes generation and training take turns on the same "
            "resources; drop --train.async_enable (or colocate less)",
        ),
        (
            config.train.colocate_all and config.vllm.num_engines > config.actor.num_ranks,
            "--train.colocate_all puts engine i beside actor rank i: --vllm.num_engines "
            "must be <= --actor.num_ranks",
        ),
        (
            config.train.colocate_all
            and config.uses_critic
            and config.critic.num_ranks != config.actor.num_ranks,
            "--train.colocate_all puts critic rank i beside actor rank i: set "
            "--critic.num_ranks equal to --actor.num_ranks",
        ),
        (
            config.train.deepspeed_enable_sleep is True and not config.offloadable_stages,
            "--train.deepspeed_enable_sleep True offloads the learners' states between "
            "phases, which ZeRO-1/2/3 do (and the molt backend always), ZeRO-0 not: set "
            "--actor.deepspeed.zero_stage (and --critic.deepspeed.zero_stage) to 1, 2 or 3, "
            "or leave the flag unset",
        ),
        (
            config.train.deepspeed_enable_sleep is True and not config.train.colocate_all,
            "--train.deepspeed_enable_sleep moves the learners' states aside for colocated "
            "engines: it needs --train.colocate_all",
        ),
        (
            config.train.colocate_actor_ref and not config.uses_reference,
            "--train.colocate_actor_ref needs a reference model (--algo.kl.init_coef > 0)",
        ),
        (
            config.train.colocate_critic_reward
            and not (config.uses_critic and config.train.reward_model_path),
            "--train.colocate_critic_reward needs a critic (--algo.advantage.estimator gae) "
            "and a reward model (--train.reward_model_path)",
        ),
        (config.train.micro_batch_size < 1, "--train.micro_batch_size must be >= 1"),
        (
            config.actor.model.load_in_4bit and config.train.ref_reward_offload,
            "--actor.model.load_in_4bit with --train.ref_reward_offload: the reference shares "
            "the actor's 4-bit base, and offloading runs it under ZeRO-3, which cannot split "
            "4-bit weights; drop one of them",
        ),
        (
            config.train.actor_freezing_steps < 0,
            "--train.actor_freezing_steps must be >= 0 (0: the actor trains from the first step)",
        ),
        (
            config.train.actor_freezing_steps > 0 and not config.uses_critic,
            "--train.actor_freezing_steps (OpenRLHF's --critic.freezing_steps) lets a critic "
            "warm up: it needs one (--algo.advantage.estimator gae); without a critic nothing "
            "would train",
        ),
        (
            config.critic.model.chunked_lm_head,
            "--critic.model.chunked_lm_head: the critic has a value head, not an lm_head",
        ),
    ]


def teacher_checks(config: RLConfig) -> list[tuple[bool, str]]:
    """The teacher against the estimator and the prompt data: a distillation run has a
    teacher, a teacher is read, and teachers by data source name exactly the sources of
    ``--data.prompt_data``."""
    estimator = config.algo.advantage.estimator
    needs = config.algo.advantage.spec.needs_teacher and not config.eval.eval_only
    paths = config.teacher_paths()
    checks = [
        (
            needs and not paths,
            f"--algo.advantage.estimator={estimator} reads a teacher's log-probs of the "
            "sampled tokens: give --teacher.model.path (a model directory with the student's "
            "tokenizer, or source=path pairs, one per --data.prompt_data source)",
        ),
        (
            bool(paths) and not config.algo.advantage.spec.needs_teacher,
            f"--teacher.model.path is set, but --algo.advantage.estimator={estimator} reads no "
            "teacher: use `rlhf train distill` (or --algo.advantage.estimator distill), or drop "
            "--teacher.model.path",
        ),
        (
            config.teacher.num_ranks != 1,
            "--teacher.num_ranks: a teacher scores as one data-parallel replica; split a large "
            "one with --teacher.deepspeed.tp_size or --teacher.ring_attn_size instead",
        ),
    ]
    if set(paths) <= {""}:  # one teacher, or none
        return checks
    blank = [f"{name}={path}" for name, path in paths.items() if not name or not path]
    sources = {name for name, _ in source_names(config.data.prompt_data)}
    missing, unknown = sorted(sources - set(paths)), sorted(set(paths) - sources - {""})
    return [
        *checks,
        (
            bool(blank),
            f"--teacher.model.path: {', '.join(blank)}: each teacher is source=path with both "
            "parts, or give one path for every prompt",
        ),
        (
            bool(missing) and not config.eval.eval_only,
            f"--teacher.model.path names teachers by data source, and --data.prompt_data "
            f"source(s) {missing} have none (the sources are {sorted(sources)}: "
            "name=path, or the file's stem)",
        ),
        (
            bool(unknown) and not config.eval.eval_only,
            f"--teacher.model.path names teachers for {unknown}, which are no "
            f"--data.prompt_data source (the sources are {sorted(sources)})",
        ),
    ]


def teacher_vocabulary_problems(config: RLConfig) -> list[str]:
    """Teachers whose tokenizer is not the student's (read from their directories, so once
    the model directories are known to exist): their log-probs are of other token ids."""
    from rlhf.learner import vocabulary_mismatch

    problems = []
    for source, path in config.teacher_paths().items():
        why = vocabulary_mismatch(config.actor.model.path, path)
        if why:
            problems.append(
                f"--teacher.model.path {source + '=' if source else ''}{path}: {why} against "
                "--actor.model.path; on-policy distillation compares both models' log-probs of "
                "the same token ids, and distillation across tokenizers is not supported yet: "
                "choose a teacher with the student's tokenizer"
            )
    return problems


def backend_problems(config: RLConfig) -> list[str]:
    """What keeps the actor (and critic, and teachers) from building on their backends."""
    roles = [("actor", config.actor)] + ([("critic", config.critic)] if config.uses_critic else [])
    if config.teacher_paths():
        roles.append(("teacher", config.teacher))
    return [problem for flag, role in roles for problem in role_problems(role, flag=flag)]
