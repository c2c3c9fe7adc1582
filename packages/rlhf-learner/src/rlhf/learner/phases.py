"""The learner's two RL phases, as public functions over any `Role`: a custom loop, a test or
the ``rlhf`` command call the same code, whether the roles run in process (`InProcessRole`) or
as Ray rank groups (`LearnerGroup`).

- `make_experience`: samples → reward-model scores (if any) → reward shaping (DAPO's overlong
  penalty, the stop-properly penalty, overlong filtering) → forward passes of the actor (π_old,
  when more than one optimizer step follows), the reference (π_ref, KL), the teachers
  (π_T, on-policy distillation; one per data source, `teacher_logprobs`) and the critic
  (values) → advantages and returns (`rlhf.algos.compute_advantages`).
- `ppo_update`: ``ppo_epochs`` passes over the experience in mini-batches of
  ``train_batch_size`` samples, one optimizer step of the actor (and the critic) per
  mini-batch, each normalised exactly over its mini-batch (`rlhf.algos.loss_normalizer`).

The adaptive KL controller stays with the caller: it reads `Experience.mean_kl` after the
update and passes the next ``kl_coef`` in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf.algos import (
    AlgoConfig,
    compute_advantages,
    kl_penalty,
    loss_normalizer,
    overlong_filter_mask,
    overlong_penalty,
    stop_properly_penalty,
)
from rlhf.learner.batch import Batch
from rlhf.learner.experience import Experience, Samples, masked_mean
from rlhf.learner.forward import batch_logprobs, sequence_scores, token_values
from rlhf.learner.objectives import CriticObjective, PPOActorObjective
from rlhf.learner.role import ForwardFn, MicroBatching, Role

WHOLE_ROWS = MicroBatching()
"""No micro-batch limits: each role runs a batch in one micro-batch per rank."""


@dataclass(frozen=True)
class ActionLogprobs:
    """Forward function: log-probs of every token (B, L) at a sampling temperature."""

    temperature: float = 1.0

    def __call__(self, model: torch.nn.Module, batch: Batch) -> Tensor:
        return batch_logprobs(model, batch, temperature=self.temperature)[0]


def token_values_of(model: torch.nn.Module, batch: Batch) -> Tensor:
    """Forward function: critic values (B, L)."""
    return token_values(
        model, batch.input_ids, batch.attention_mask, packing_samples=batch.packing_samples
    )


def sequence_scores_of(model: torch.nn.Module, batch: Batch) -> Tensor:
    """Forward function: reward-model scores at each row's last real token (B,)."""
    return sequence_scores(
        model, batch.input_ids, batch.attention_mask, packing_samples=batch.packing_samples
    )


def per_token(role: Role, batch: Batch, fn: ForwardFn[Tensor], micro: MicroBatching) -> Tensor:
    """``fn`` over ``batch`` on ``role`` as one (B, L) float32 tensor in row order (each
    micro-batch's narrower result right-padded with 0)."""
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    for rows, values in role.forward(
        batch, fn, max_rows=micro.max_rows, max_tokens=micro.max_tokens
    ):
        out[rows, : values.shape[1]] = values.float()
    return out


def per_sequence(role: Role, batch: Batch, fn: ForwardFn[Tensor], micro: MicroBatching) -> Tensor:
    """``fn`` over ``batch`` on ``role`` as one (B,) tensor in row order."""
    out = torch.zeros(batch.size)
    for rows, values in role.forward(
        batch, fn, max_rows=micro.max_rows, max_tokens=micro.max_tokens
    ):
        out[rows] = values.float()
    return out


def teacher_logprobs(
    teachers: Mapping[str, Role],
    batch: Batch,
    *,
    sources: Sequence[str] | None = None,
    fn: ForwardFn[Tensor],
    micro: MicroBatching = WHOLE_ROWS,
) -> Tensor:
    """Each row's teacher's log-probs of its tokens, (B, L) float32 like `per_token`.

    One teacher under the name ``""`` scores every row. Otherwise the teachers are named by
    data source and row ``i`` goes to ``teachers[sources[i]]`` (several teachers, one per
    source: multi-teacher distillation); each teacher runs one forward pass over its rows.

    Raises:
        ValueError: named teachers without ``sources`` (one per row), or a row whose source
            has no teacher (naming the source and the teachers there are).
    """
    if set(teachers) == {""}:
        return per_token(teachers[""], batch, fn, micro)
    if sources is None or len(sources) != batch.size:
        got = "none" if sources is None else len(sources)
        raise ValueError(
            f"teachers by data source ({sorted(teachers)}) need each row's source: "
            f"{batch.size} rows, {got} sources"
        )
    missing = sorted(set(sources) - set(teachers))
    if missing:
        raise ValueError(
            f"rows from data source(s) {missing} have no teacher; the teachers are for "
            f"{sorted(teachers)}"
        )
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    for name, teacher in teachers.items():
        rows = [i for i, s in enumerate(sources) if s == name]
        if not rows:
            continue
        part = per_token(teacher, batch.select(rows), fn, micro)
        out[torch.as_tensor(rows), : part.shape[1]] = part
    return out


def shape_rewards(
    rewards: Tensor,
    *,
    action_mask: Tensor,
    truncated: Tensor,
    algo: AlgoConfig,
    max_new_tokens: int,
) -> tuple[Tensor, Tensor]:
    """Length-based reward shaping and filtering of ``algo``: (shaped rewards (B,), action
    mask (B, L) with truncated samples removed under ``algo.overlong_filtering``)."""
    shaped = rewards
    if algo.overlong_buffer_len is not None:
        shaped = shaped + overlong_penalty(
            response_lengths=action_mask.sum(dim=1),
            max_new_tokens=max_new_tokens,
            buffer_len=algo.overlong_buffer_len,
            penalty_factor=algo.overlong_penalty_factor,
        )
    if algo.stop_properly_penalty_coef is not None:
        shaped = stop_properly_penalty(
            shaped, truncated=truncated, coef=algo.stop_properly_penalty_coef
        )
    if algo.overlong_filtering:
        action_mask = overlong_filter_mask(action_mask, truncated=truncated)
    return shaped, action_mask


def make_experience(
    samples: Samples,
    *,
    actor: Role,
    algo: AlgoConfig,
    n_samples_per_prompt: int,
    max_new_tokens: int,
    kl_coef: float,
    reference: Role | None = None,
    critic: Role | None = None,
    reward_model: Role | None = None,
    teachers: Mapping[str, Role] | None = None,
    sources: Sequence[str] | None = None,
    temperature: float = 1.0,
    compute_old_logprobs: bool = False,
    check_reference: bool = False,
    micro: MicroBatching = WHOLE_ROWS,
) -> Experience:
    """Turn one step's samples into an `Experience`.

    Args:
        samples: The rollout, collated (B samples in prompt groups of
            ``n_samples_per_prompt``).
        actor: The policy; it runs a forward pass only for ``compute_old_logprobs`` or
            ``check_reference``.
        algo: Estimator, KL, shaping and filtering settings.
        n_samples_per_prompt: Group size n.
        max_new_tokens: The generation budget (DAPO's overlong penalty ramps towards it).
        kl_coef: β for KL in the reward (ignored when ``algo.kl.use_loss``).
        reference: π_ref; None skips the KL.
        critic: Value model for GAE; None for critic-free estimators.
        reward_model: Scores prompt + response at the last token; its scores replace
            ``samples.rewards``.
        teachers: Frozen teachers for on-policy distillation (estimators whose token step
            reads ``teacher_logprobs``): one under ``""`` for every row, or one per data
            source (`teacher_logprobs`). The student's side of the reverse KL is π_old when
            computed, else the sampler's log-probs.
        sources: Each sample's data source (`rlhf.rollout.Rollout.sources`), for teachers
            by source.
        temperature: The rollout's sampling temperature (log-probs are taken at it).
        compute_old_logprobs: Compute π_old with the actor (needed when more than one
            optimizer step follows a rollout, or the samples came from older weights).
        check_reference: Also report ``check/step0_policy_ref_logprob_gap_max``, the largest
            |log π − log π_ref| over action tokens (0 up to numerics before any update).
        micro: How the roles split the batch for their forward passes.

    Returns:
        The experience; ``metrics`` hold ``reward/mean``, ``reward/std``,
        ``reward/shaped_mean``, ``rollout/response_length_mean``, ``rollout/samples``,
        ``rollout/truncated_frac``, the estimator's metrics, with a reference ``kl/mean``,
        and with teachers by source ``distill/reverse_kl/<source>`` (the mean over that
        source's action tokens).
    """
    batch = samples.batch()
    if reward_model is not None:
        rewards = per_sequence(reward_model, batch, sequence_scores_of, micro)
    else:
        rewards = samples.rewards
    lengths = samples.action_mask.sum(dim=1)
    shaped, mask = shape_rewards(
        rewards,
        action_mask=samples.action_mask,
        truncated=samples.truncated,
        algo=algo,
        max_new_tokens=max_new_tokens,
    )
    logprobs = ActionLogprobs(temperature)
    old = per_token(actor, batch, logprobs, micro) if compute_old_logprobs else None
    metrics: dict[str, float] = {}
    ref = kl = None
    if reference is not None:
        ref = per_token(reference, batch, logprobs, micro)
        if check_reference:
            policy = old if old is not None else per_token(actor, batch, logprobs, micro)
            metrics["check/step0_policy_ref_logprob_gap_max"] = float(
                ((policy - ref).abs() * mask).max()
            )
        kl = kl_penalty(
            logprobs=old if old is not None else samples.rollout_logprobs,
            ref_logprobs=ref,
            action_mask=mask,
            estimator=algo.kl.estimator,
        )
    values = per_token(critic, batch, token_values_of, micro) if critic is not None else None
    student = old if old is not None else samples.rollout_logprobs
    teacher = None
    if teachers:
        teacher = teacher_logprobs(teachers, batch, sources=sources, fn=logprobs, micro=micro)
        if set(teachers) != {""}:
            assert sources is not None  # teacher_logprobs checked them
            gap = student - teacher
            for name in sorted(set(sources)):
                rows = torch.as_tensor([i for i, s in enumerate(sources) if s == name])
                metrics[f"distill/reverse_kl/{name}"] = masked_mean(gap[rows], mask[rows])
    adv = compute_advantages(
        config=algo.advantage,
        rewards=shaped,
        action_mask=mask,
        n_samples_per_prompt=n_samples_per_prompt,
        values=values,
        kl=None if algo.kl.use_loss else kl,
        kl_coef=0.0 if algo.kl.use_loss else kl_coef,
        token_rewards=samples.token_rewards,
        logprobs=student,
        teacher_logprobs=teacher,
    )
    episode = rewards if samples.token_rewards is None else rewards + samples.token_rewards.sum(1)
    metrics.update(
        {
            "reward/mean": float(episode.mean()),
            "reward/std": float(episode.std()) if episode.numel() > 1 else 0.0,
            "reward/shaped_mean": float(shaped.mean()),
            "rollout/response_length_mean": float(lengths.float().mean()),
            "rollout/samples": float(samples.size),
            "rollout/truncated_frac": float(samples.truncated.float().mean()),
            **{k: float(v) for k, v in adv.metrics.items()},
        }
    )
    if kl is not None:
        metrics["kl/mean"] = masked_mean(kl, mask)
    return Experience(
        sequences=samples.sequences,
        attention_mask=samples.attention_mask,
        action_mask=mask,
        rollout_logprobs=samples.rollout_logprobs,
        old_logprobs=old,
        ref_logprobs=ref,
        values=values,
        kl=kl,
        rewards=rewards,
        shaped_rewards=shaped,
        advantages=adv.advantages,
        returns=adv.returns,
        truncated=samples.truncated,
        metrics=metrics,
        teacher_logprobs=teacher,
    )


def ppo_update(
    experience: Experience,
    *,
    actor: Role,
    algo: AlgoConfig,
    kl_coef: float,
    critic: Role | None = None,
    temperature: float = 1.0,
    ppo_epochs: int = 1,
    train_batch_size: int = 0,
    micro: MicroBatching = WHOLE_ROWS,
    train_actor: bool = True,
) -> dict[str, float]:
    """PPO epochs over ``experience``: per mini-batch one actor step
    (`PPOActorObjective`) and, with a ``critic``, one critic step (`CriticObjective`).

    Args:
        experience: From `make_experience`.
        actor: The policy.
        algo: Policy loss, aggregation, KL-as-loss, entropy, value clipping.
        kl_coef: β of the KL loss (``algo.kl.use_loss``).
        critic: The value model, or None.
        temperature: The rollout's sampling temperature.
        ppo_epochs: Passes over the experience.
        train_batch_size: Samples per optimizer step (a multiple of the group size keeps
            groups whole); 0 takes the whole experience in one step.
        micro: How the roles split each mini-batch.
        train_actor: False updates the critic alone (the actor is frozen while the critic
            warms up); needs a critic.

    Returns:
        The last step's metrics: ``actor/*`` (``actor/loss``, ``actor/grad_norm``,
        ``actor/lr``, the objective's) when the actor trains, ``critic/*`` with a critic.
    """
    if ppo_epochs < 1:
        raise ValueError(f"ppo_epochs must be >= 1, got {ppo_epochs}")
    if not train_actor and critic is None:
        raise ValueError("train_actor=False needs a critic: nothing would train")
    batch = experience.batch()
    per_step = train_batch_size or batch.size
    split = {"max_rows": micro.max_rows, "max_tokens": micro.max_tokens}
    metrics: dict[str, float] = {}
    for _ in range(ppo_epochs):
        for start in range(0, batch.size, per_step):
            part = batch.select(range(start, min(start + per_step, batch.size)))
            norm = float(
                loss_normalizer(
                    part["action_mask"], mode=algo.loss_agg_mode, max_len=algo.loss_agg_max_len
                )
            )
            if train_actor:
                objective = PPOActorObjective(
                    algo=algo, normalizer=norm, kl_coef=kl_coef, temperature=temperature
                )
                out = actor.train_step(part, objective, **split)
                metrics.update({f"actor/{k}" if "/" not in k else k: v for k, v in out.items()})
            if critic is not None:
                out = critic.train_step(part, CriticObjective(algo=algo, normalizer=norm), **split)
                metrics.update({f"critic/{k}" if "/" not in k else k: v for k, v in out.items()})
    return metrics
