"""The RL phases as a library: one GRPO and one PPO step through `make_experience` and
`ppo_update` with every role in this process (`InProcessRole`, no Ray) equal the same step
with the roles as Ray rank groups (`LearnerGroup`): the experience, the losses and every
parameter after the update (fp32, CPU, DeepSpeed ZeRO-2 on gloo)."""

from __future__ import annotations

import functools

import pytest
import torch

from rlhf.algos import AdvantageConfig, AlgoConfig, KLConfig
from rlhf.learner import (
    DeepSpeedBackend,
    DeepSpeedConfig,
    InProcessRole,
    LearnerConfig,
    LearnerGroup,
    MicroBatching,
    ModelConfig,
    OptimizerConfig,
    Role,
    Samples,
    make_experience,
    ppo_update,
)

N = 4  # samples per prompt


def samples(seed: int) -> Samples:
    """Two prompt groups of 4 samples: prompts of 3–5 tokens, responses of 1–6, rewards in
    {0, 1} with at least one of each per group, one truncated sample."""
    gen = torch.Generator().manual_seed(seed)
    tokens, masks, logps, rewards = [], [], [], []
    for i in range(2 * N):
        n_prompt, n_resp = 3 + i % 3, 1 + (5 * i) % 6
        tokens.append(torch.randint(3, 200, (n_prompt + n_resp,), generator=gen).tolist())
        masks.append([0] * n_prompt + [1] * n_resp)
        logps.append([0.0] * n_prompt + (-torch.rand(n_resp, generator=gen)).tolist())
        rewards.append(float(i % 2 == 0 or i == 3))
    return Samples.collate(
        token_ids=tokens,
        action_mask=masks,
        rollout_logprobs=logps,
        rewards=rewards,
        truncated=[i == 5 for i in range(2 * N)],
    )


def learner(path, *, kind: str = "causal_lm", train: bool = True) -> LearnerConfig:
    return LearnerConfig(
        model=ModelConfig(path=str(path), kind=kind),
        optimizer=OptimizerConfig(lr=1e-3, grad_clip=1.0, warmup_steps=0) if train else None,
    )


ZERO2 = functools.partial(DeepSpeedBackend, deepspeed=DeepSpeedConfig(zero_stage=2))
"""The roles' backend: DeepSpeed ZeRO-2."""


def in_process(config: LearnerConfig) -> InProcessRole:
    role = InProcessRole()
    role.build(config, backend=ZERO2)
    return role


def on_ray(config: LearnerConfig, ranks: int) -> LearnerGroup:
    group = LearnerGroup(num_ranks=ranks)
    group.build(config, backend=ZERO2)
    return group


def state_of(role) -> dict[str, torch.Tensor]:
    if isinstance(role, InProcessRole):
        return role.backend.state_dict_on_rank0()
    return role.run(lambda backend: backend.state_dict_on_rank0())[0]


def one_step(*, actor: Role, reference: Role | None, critic: Role | None, algo, **options):
    """One RL step's learner part, as a custom loop writes it."""
    micro = MicroBatching(max_rows=3)
    experience = make_experience(
        samples(seed=1),
        actor=actor,
        reference=reference,
        critic=critic,
        algo=algo,
        n_samples_per_prompt=N,
        max_new_tokens=6,
        kl_coef=algo.kl.init_coef,
        micro=micro,
        **options.get("experience", {}),
    )
    metrics = ppo_update(
        experience,
        actor=actor,
        critic=critic,
        algo=algo,
        kl_coef=algo.kl.init_coef,
        micro=micro,
        **options.get("update", {}),
    )
    return experience, metrics


def assert_same_step(local, remote, roles: list[tuple[object, object]]) -> None:
    (exp_l, m_l), (exp_r, m_r) = local, remote
    for name in ("ref_logprobs", "old_logprobs", "values", "advantages", "returns"):
        a, b = getattr(exp_l, name), getattr(exp_r, name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert set(m_l) == set(m_r)
    for key in ("actor/loss", "actor/grad_norm", "critic/loss"):
        if key in m_l:
            assert m_r[key] == pytest.approx(m_l[key], rel=1e-5, abs=1e-7), key
    for here, there in roles:
        a, b = state_of(here), state_of(there)
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=2e-6, msg=k)


def test_grpo_step_in_process_equals_ray_groups(ray_cluster, tiny) -> None:
    """GRPO: group-normalised advantages, k3 KL as a loss against the reference; the actor
    on 2 Ray ranks (micro-batches dealt unevenly) against 1 rank here."""
    algo = AlgoConfig(
        advantage=AdvantageConfig(estimator="group_norm"),
        kl=KLConfig(init_coef=0.05, estimator="k3", use_loss=True),
    )
    local_actor, local_ref = in_process(learner(tiny)), in_process(learner(tiny, train=False))
    groups = [on_ray(learner(tiny), 2), on_ray(learner(tiny, train=False), 1)]
    try:
        local = one_step(actor=local_actor, reference=local_ref, critic=None, algo=algo)
        remote = one_step(actor=groups[0], reference=groups[1], critic=None, algo=algo)
        exp = local[0]
        # Group-normalised rewards: every group of 4 holds both rewards, so every action token
        # gets a non-zero advantage. Before the update the policy is the reference: k3 is 0.
        assert bool((exp.advantages.abs() > 0)[exp.action_mask > 0].all())
        assert local[1]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
        assert_same_step(local, remote, [(local_actor, groups[0])])
    finally:
        for g in groups:
            g.shutdown()
        local_actor.close()
        local_ref.close()


def test_ppo_step_in_process_equals_ray_groups(ray_cluster, tiny) -> None:
    """PPO: a critic with GAE, k1 KL in the reward, π_old computed, two optimizer steps of 4
    samples each, DAPO's overlong filtering of the truncated sample."""
    algo = AlgoConfig(
        advantage=AdvantageConfig(estimator="gae", gamma=1.0, lam=0.95),
        kl=KLConfig(init_coef=0.01),
        overlong_filtering=True,
    )
    roles = {
        "actor": learner(tiny),
        "reference": learner(tiny, train=False),
        "critic": learner(tiny, kind="scalar"),
    }
    local = {k: in_process(c) for k, c in roles.items()}
    remote = {k: on_ray(c, 1) for k, c in roles.items()}
    options = {
        "experience": {"compute_old_logprobs": True, "check_reference": True},
        "update": {"train_batch_size": 4},
    }
    try:
        ours = one_step(**local, algo=algo, **options)
        theirs = one_step(**remote, algo=algo, **options)
        exp = ours[0]
        assert not bool(exp.action_mask[5].any())  # the truncated sample does not train
        # Before any update the policy is the reference: π_old equals π_ref.
        assert exp.metrics["check/step0_policy_ref_logprob_gap_max"] < 1e-5
        assert exp.values is not None and exp.mean_kl == pytest.approx(0.0, abs=1e-6)
        assert ours[1]["critic/value_loss"] > 0
        assert_same_step(
            ours, theirs, [(local["actor"], remote["actor"]), (local["critic"], remote["critic"])]
        )
    finally:
        for g in remote.values():
            g.shutdown()
        for r in local.values():
            r.close()


def test_in_process_role_refuses_several_ranks() -> None:
    class TwoRanks:
        world_size = 2

    with pytest.raises(ValueError, match="InProcessRole runs one rank"):
        InProcessRole(TwoRanks())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="build"):
        InProcessRole().train_step(samples(0).batch(), lambda m, b: None)  # type: ignore[arg-type]


def test_token_rewards_reach_the_advantages(tiny) -> None:
    """`Samples.token_rewards` (per-turn credit) join the per-token rewards: REINFORCE's
    advantages equal `compute_advantages` given them, and ``reward/mean`` is the episode
    total (the scalar plus the tokens' rewards)."""
    import dataclasses

    from rlhf.algos import compute_advantages

    base = samples(seed=1)
    extra = torch.zeros_like(base.action_mask)
    first_action = base.action_mask.argmax(dim=1)
    rows = torch.arange(base.size)
    extra[rows, first_action] = 0.5  # every sample: half a reward on its first action token
    with_turns = dataclasses.replace(base, token_rewards=extra)
    algo = AlgoConfig(
        advantage=AdvantageConfig(estimator="reinforce", gamma=0.9, whiten=False),
        kl=KLConfig(init_coef=0.0),
    )
    actor = in_process(learner(tiny, train=False))
    try:
        exp = make_experience(
            with_turns,
            actor=actor,
            algo=algo,
            n_samples_per_prompt=N,
            max_new_tokens=6,
            kl_coef=0.0,
        )
    finally:
        actor.close()
    expected = compute_advantages(
        config=algo.advantage,
        rewards=base.rewards,
        action_mask=base.action_mask,
        token_rewards=extra,
    ).advantages
    torch.testing.assert_close(exp.advantages, expected)
    without = compute_advantages(
        config=algo.advantage, rewards=base.rewards, action_mask=base.action_mask
    ).advantages
    assert not torch.allclose(exp.advantages, without)
    assert exp.metrics["reward/mean"] == pytest.approx(float(base.rewards.mean()) + 0.5)


@pytest.fixture(scope="module")
def teacher(tiny, tmp_path_factory):
    """A second tiny model with the student's tokenizer and other weights."""
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("teacher")
    PreTrainedTokenizerFast.from_pretrained(tiny).save_pretrained(path)
    torch.manual_seed(1)
    Qwen2ForCausalLM(Qwen2Config.from_pretrained(tiny)).save_pretrained(path)
    return path


def direct_logprobs(path, batch: Samples) -> torch.Tensor:
    """log p(x_t | x_<t) of every real token after the first, by a plain transformers
    forward pass over each row alone (no padding, no learner code)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = torch.zeros_like(batch.rollout_logprobs)
    for i in range(batch.size):
        n = int(batch.attention_mask[i].sum())
        ids = batch.sequences[i, :n]
        with torch.no_grad():
            logp = torch.log_softmax(model(ids[None]).logits[0].float(), dim=-1)
        out[i, 1:n] = logp[:-1].gather(1, ids[1:, None])[:, 0]
    return out


DISTILL = AlgoConfig(advantage=AdvantageConfig(estimator="distill"), kl=KLConfig(init_coef=0.0))


def test_distill_advantages_are_the_teachers_logprobs_minus_the_samplers(tiny, teacher) -> None:
    """One teacher scores every row: A_t = log π_T(y_t) − log π_sampler(y_t) on action tokens
    and 0 elsewhere, and ``distill/reverse_kl`` is the mean of −A_t over action tokens."""
    base = samples(seed=1)
    actor, frozen = in_process(learner(tiny)), in_process(learner(teacher, train=False))
    try:
        exp = make_experience(
            base, actor=actor, teachers={"": frozen}, algo=DISTILL, n_samples_per_prompt=N,
            max_new_tokens=6, kl_coef=0.0, micro=MicroBatching(max_rows=3),
        )  # fmt: skip
    finally:
        actor.close()
        frozen.close()
    mask = base.action_mask
    expected_teacher = direct_logprobs(teacher, base)
    assert exp.teacher_logprobs is not None
    torch.testing.assert_close(exp.teacher_logprobs * mask, expected_teacher * mask)
    gap = (expected_teacher - base.rollout_logprobs) * mask
    torch.testing.assert_close(exp.advantages, gap)
    assert exp.metrics["distill/reverse_kl"] == pytest.approx(
        float(-gap.sum() / mask.sum()), rel=1e-5
    )


def test_teachers_by_data_source_score_their_own_rows(tiny, teacher) -> None:
    """Two teachers named by data source: rows of source ``a`` take the teacher's log-probs,
    rows of ``b`` the student's own model's (reverse KL 0 up to the sampler's numbers), each
    reported per source; a row whose source has no teacher is refused by name."""
    base = samples(seed=2)
    sources = ["a"] * N + ["b"] * N
    frozen_a = in_process(learner(teacher, train=False))
    frozen_b = in_process(learner(tiny, train=False))
    actor = in_process(learner(tiny))
    teachers = {"a": frozen_a, "b": frozen_b}
    common = {
        "actor": actor, "algo": DISTILL, "n_samples_per_prompt": N, "max_new_tokens": 6,
        "kl_coef": 0.0, "compute_old_logprobs": True,
    }  # fmt: skip
    try:
        exp = make_experience(base, teachers=teachers, sources=sources, **common)
        with pytest.raises(ValueError, match=r"\['c'\] have no teacher"):
            make_experience(base, teachers=teachers, sources=["a"] * N + ["c"] * N, **common)
        with pytest.raises(ValueError, match="need each row's source"):
            make_experience(base, teachers=teachers, **common)
    finally:
        for role in (actor, frozen_a, frozen_b):
            role.close()
    mask = base.action_mask
    expected = torch.cat([direct_logprobs(teacher, base)[:N], direct_logprobs(tiny, base)[N:]])
    assert exp.teacher_logprobs is not None
    torch.testing.assert_close(exp.teacher_logprobs * mask, expected * mask)
    # π_old was computed: it is the student's side, and on rows of ``b`` it is the teacher.
    assert exp.old_logprobs is not None
    torch.testing.assert_close(exp.advantages, (expected - exp.old_logprobs) * mask)
    assert exp.metrics["distill/reverse_kl/b"] == pytest.approx(0.0, abs=1e-6)
    gap_a = ((exp.old_logprobs - expected) * mask)[:N]
    assert exp.metrics["distill/reverse_kl/a"] == pytest.approx(
        float(gap_a.sum() / mask[:N].sum()), rel=1e-5
    )
    assert abs(exp.metrics["distill/reverse_kl/a"]) > 1e-3


def test_vocabulary_mismatch_names_what_differs(tiny, teacher, tmp_path) -> None:
    from transformers import PreTrainedTokenizerFast

    from rlhf.learner import vocabulary_mismatch

    assert vocabulary_mismatch(str(tiny), str(teacher)) is None
    tok = PreTrainedTokenizerFast.from_pretrained(tiny)
    other_eos = tmp_path / "other-eos"
    tok.eos_token = "<|endoftext|>"
    tok.save_pretrained(other_eos)
    message = vocabulary_mismatch(str(tiny), str(other_eos))
    assert message is not None and "end-of-sequence" in message
    tok.add_tokens(["<extra>"])
    other_vocab = tmp_path / "other-vocab"
    tok.save_pretrained(other_vocab)
    message = vocabulary_mismatch(str(tiny), str(other_vocab))
    assert message is not None
    assert f"{len(tok) - 1} vs {len(tok)} tokens" in message and "'<extra>'" in message
    assert "teacher's alone" in message
