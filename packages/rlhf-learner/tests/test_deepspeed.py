"""The DeepSpeed backend on 2 ranks (Ray actors, gloo): exactness across the data-parallel
split, learning, checkpoints, HF export and weight buckets, with ZeRO-2 and ZeRO-3."""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

from rlhf.algos import AlgoConfig, KLConfig, loss_normalizer
from rlhf.learner import (
    CheckpointError,
    CriticObjective,
    DeepSpeedBackend,
    DeepSpeedConfig,
    DPOObjective,
    LearnerConfig,
    LearnerGroup,
    ModelConfig,
    ModelLoadError,
    OptimizerConfig,
    PPOActorObjective,
    RewardModelObjective,
    SFTObjective,
    collate,
    load_model,
    preference_row,
    sequence_logps,
    sequence_scores,
    sft_row,
    stream_weights,
)
from rlhf.learner.optim import build_optimizer
from rlhf.weights import count_buckets, iter_tensors, validate_sync

from .test_units import _rl_batch


@pytest.fixture(scope="module")
def group(ray_cluster):
    g = LearnerGroup(num_ranks=2)
    yield g
    g.shutdown()


GRAD_FLOOR = 1e-6
"""AdamW's first step moves an element by ``lr * g / (|g| + eps)`` (eps 1e-8), whose slope
``lr * eps / (|g| + eps)**2`` is 1e-5 at ``|g|`` = 1e-6 but 3e-2 at ``|g|`` = 7e-9 (seen on a
key bias): there a gradient whose last bits differ between the split's reduction order and one
process's moves the update by more than float32's tolerance. Elements below this floor are
held to the first step's bound only."""


def zero(stage: int, **options):
    """The DeepSpeed backend at ZeRO stage ``stage`` (``options``: further `DeepSpeedConfig`
    fields), as a factory for ``build``."""
    return functools.partial(
        DeepSpeedBackend, deepspeed=DeepSpeedConfig(zero_stage=stage, **options)
    )


def config(
    path,
    *,
    lr: float = 1e-3,
    kind: str = "causal_lm",
    optimizer=True,
    packing: bool = False,
    chunked: bool = False,
):
    return LearnerConfig(
        model=ModelConfig(
            path=str(path), kind=kind, packing_samples=packing, chunked_lm_head=chunked
        ),
        optimizer=OptimizerConfig(lr=lr, grad_clip=0.0, betas=(0.9, 0.95)) if optimizer else None,
    )


def state_shapes(state: dict[str, torch.Tensor]) -> list[tuple[int, ...]]:
    return [tuple(v.shape) for v in state.values()]


def full_state(group) -> dict[str, torch.Tensor]:
    return group.run(lambda backend: backend.state_dict_on_rank0())[0]


def sft_batch(tokenizer, n: int = 6):
    rows = [
        sft_row({"input": f"what is {i} plus {i}?", "output": str(2 * i)}, i, tokenizer)
        for i in range(n)
    ]
    return collate(
        [r.input_ids for r in rows],
        pad_token_id=tokenizer.pad_token_id,
        per_token={"loss_mask": [r.loss_mask for r in rows]},
    )


@pytest.mark.parametrize("stage", [2, 3])
def test_sft_steps_lower_the_loss_and_change_every_parameter(group, tiny, tokenizer, stage) -> None:
    group.build(config(tiny), backend=zero(stage))
    before = full_state(group)
    batch = sft_batch(tokenizer)
    objective = SFTObjective(normalizer=float(batch["loss_mask"].sum()))
    losses = [group.train_step(batch, objective, max_rows=2)["loss"] for _ in range(5)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.5
    after = full_state(group)
    assert set(after) == set(before)
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert not unchanged


@pytest.mark.parametrize(
    ("stage", "option"), [(2, None), (3, None), (2, "packing"), (2, "chunked_lm_head")]
)
def test_ppo_actor_step_is_exact_across_the_split(group, tiny, stage, option) -> None:
    """2 ranks x uneven micro-batches (one rank pads with a weight-0 pass) give the loss,
    gradient norm and update of one full-batch step in this process — also padding-free,
    where a 16-token budget packs the rows (7+7, 8+7, 4+11 real tokens) into 3 micro-batches
    and the reference runs the whole batch as one packed row, and with the chunked lm_head
    (the reference takes the logits path)."""
    packing = option == "packing"
    model = Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    batch = _rl_batch(model, seed=2)
    algo = AlgoConfig(kl=KLConfig(use_loss=True, estimator="k3"), entropy_coef=0.01)
    norm = float(loss_normalizer(batch["action_mask"], mode="token-mean"))
    objective = PPOActorObjective(algo=algo, normalizer=norm, kl_coef=0.1)
    cfg = config(tiny, lr=1e-3, packing=packing, chunked=option == "chunked_lm_head")
    # Reference: one process, one micro-batch, torch AdamW with the same groups and schedule.
    optimizer, scheduler = build_optimizer(model, cfg.optimizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss, _ = objective(model, dataclasses.replace(batch, packing_samples=packing))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    grad_norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters())).item()
    optimizer.step()
    scheduler.step()

    group.build(cfg, backend=zero(stage))
    split = {"max_tokens": 16} if packing else {"max_rows": 2}
    assert [len(m) for m, _ in group.split(batch, **split)] == [2, 1]  # 3 micro-batches
    out = group.train_step(batch, objective, **split)
    assert out["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    assert out["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    after = full_state(group)
    for name, param in model.named_parameters():
        clear = grads[name].abs() >= GRAD_FLOOR
        torch.testing.assert_close(
            after[name][clear], param.detach()[clear], rtol=0, atol=2e-6, msg=name
        )
        # Adam's first step moves every element by at most lr (no weight decay here).
        moved = (after[name][~clear] - before[name][~clear]).abs()
        assert moved.numel() == 0 or moved.max() <= cfg.optimizer.lr * (1 + 1e-5), name


@pytest.mark.parametrize("packing", [False, True])
def test_critic_step_is_exact_across_the_split(group, tiny, packing, tmp_path) -> None:
    """A critic with a random score head (from a causal LM it would start at zero, leaving
    the decoder's gradient zero and the values independent of it) takes the same step
    split over 2 ranks as in one process."""
    from transformers import AutoModelForTokenClassification

    critic = load_model(ModelConfig(path=str(tiny), kind="scalar"))
    with torch.no_grad():
        critic.score.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(5))
    critic.save_pretrained(tmp_path)
    ref = load_model(ModelConfig(path=str(tmp_path), kind="scalar"))
    assert isinstance(ref, AutoModelForTokenClassification._model_mapping[type(ref.config)])
    gen = torch.Generator().manual_seed(3)
    lm = Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    batch = _rl_batch(lm, seed=4)
    m = batch["action_mask"]
    batch.fields["old_values"] = torch.randn(m.shape, generator=gen) * m * 0.5
    batch.fields["returns"] = torch.randn(m.shape, generator=gen) * m
    algo = AlgoConfig(value_clip=0.2, loss_agg_mode="seq-mean-token-mean")
    objective = CriticObjective(
        algo=algo, normalizer=float(loss_normalizer(m, mode="seq-mean-token-mean"))
    )
    loss, _ = objective(ref, dataclasses.replace(batch, packing_samples=packing))
    loss.backward()
    grads = [p.grad for p in ref.parameters() if p.grad is not None]
    assert all(float(g.abs().max()) > 0 for g in grads)  # the decoder learns too
    grad_norm = torch.sqrt(sum((g**2).sum() for g in grads))
    group.build(config(tmp_path, kind="scalar", packing=packing), backend=zero(2))
    out = group.train_step(batch, objective, max_rows=3 if packing else 1)
    assert out["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert out["grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-4)


def muon(path, *, stage_lr: float = 1e-3) -> LearnerConfig:
    """The tiny model trained with Muon (its AdamW half at ``stage_lr``), no clipping."""
    return dataclasses.replace(
        config(path, lr=stage_lr),
        optimizer=OptimizerConfig(
            lr=stage_lr, grad_clip=0.0, betas=(0.9, 0.95), name="muon", muon_lr=0.02,
            muon_momentum=0.9, schedule="constant",
        ),
    )  # fmt: skip


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_save_load_resumes_the_next_step_exactly(
    group, tiny, tokenizer, tmp_path, optimizer
) -> None:
    """A checkpoint after step 1 resumes steps 2 and 3 as the run that went on did: the
    losses and the weights bit for bit (Muon's momentum buffers travel with it)."""
    cfg = config(tiny) if optimizer == "adamw" else muon(tiny)
    batch = sft_batch(tokenizer)
    objective = SFTObjective(normalizer=float(batch["loss_mask"].sum()))
    group.build(cfg, backend=zero(2))
    group.train_step(batch, objective, max_rows=3)
    path = group.save(str(tmp_path), 1, client_state={"step": 1, "data_position": 6}, keep=2)
    uninterrupted = [group.train_step(batch, objective, max_rows=3) for _ in range(2)]
    went_on = full_state(group)
    group.build(cfg, backend=zero(2))  # a new run from the initial weights
    fresh = group.train_step(batch, objective, max_rows=3)
    assert fresh["loss"] != pytest.approx(uninterrupted[0]["loss"])
    group.build(cfg, backend=zero(2))
    assert group.load(path) == {"step": 1, "data_position": 6}
    resumed = [group.train_step(batch, objective, max_rows=3) for _ in range(2)]
    for a, b in zip(resumed, uninterrupted, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-9)
    after = full_state(group)
    assert all(torch.equal(after[k], went_on[k]) for k in went_on)


def newton_schulz5(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's orthogonalisation, written from its definition in float64: X = G / ‖G‖_F
    (transposed to the wide side), then ``steps`` times X ← aX + (bA + cA²)X with A = XXᵀ and
    (a, b, c) = (3.4445, −4.7750, 2.0315)."""
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return (x.T if tall else x).float()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_muon_orthogonalises_the_matrices_and_steps_the_rest_by_adamw(
    group, tiny, tokenizer, stage
) -> None:
    """One Muon step over 2 ranks against the math on one process's gradient g: each hidden
    matrix moves by −muon_lr · sqrt(max(1, rows/cols)) · NS₅(g) (the first step's Nesterov
    momentum is (1 − β²)·g, which NS's normalisation removes); the embeddings and the norms
    move by AdamW's first step −lr · g / (|g| + eps). DeepSpeed iterates NS in float16 where
    the device has it (`ns_compute_dtype`, CPUs too): its elements, O(0.1), agree with the
    float64 iteration to 3e-2 and the whole matrix to a cosine of 0.999 (AdamW's sign-like
    step, or plain SGD on g, is nowhere near either)."""
    model = Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    batch = sft_batch(tokenizer)
    objective = SFTObjective(normalizer=float(batch["loss_mask"].sum()))
    loss, _ = objective(model, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = muon(tiny)
    group.build(cfg, backend=zero(stage))
    group.train_step(batch, objective, max_rows=2)
    after = full_state(group)
    opt = cfg.optimizer
    assert opt is not None
    matrices = [n for n, p in before.items() if p.dim() == 2 and "embed" not in n]
    assert len(matrices) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    for name in matrices:
        rows, cols = before[name].shape
        step = (after[name] - before[name]) / -opt.muon_lr
        expected = newton_schulz5(grads[name]) * max(1.0, rows / cols) ** 0.5
        torch.testing.assert_close(step, expected, rtol=0, atol=3e-2, msg=name)
        cosine = torch.nn.functional.cosine_similarity(step.flatten(), expected.flatten(), dim=0)
        assert float(cosine) > 0.999, (name, float(cosine))
        assert float(step.norm() / expected.norm()) == pytest.approx(1.0, abs=5e-3), name
    others = [n for n in before if n not in matrices]
    assert "model.embed_tokens.weight" in others and "model.norm.weight" in others
    for name in others:
        g = grads[name]
        clear = g.abs() >= GRAD_FLOOR
        adamw = -opt.lr * g / (g.abs() + opt.eps)
        moved = after[name] - before[name]
        torch.testing.assert_close(moved[clear], adamw[clear], rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_states_come_back_and_training_continues_exactly(
    group, tiny, tokenizer, stage
) -> None:
    """The hybrid schedule's round trip (optimizer states and master weights off the device
    for the sync, then the model weights too while engines generate, then everything back)
    leaves the next steps bit-identical to steps without it. ZeRO-3 moves its master weights
    and Adam moments through `rlhf.learner.zero3_offload` (DeepSpeed moves them only under its
    compiled FusedAdam) and its reduce buckets through DeepSpeed."""
    batch = sft_batch(tokenizer)
    objective = SFTObjective(normalizer=float(batch["loss_mask"].sum()))
    group.build(config(tiny), backend=zero(stage))
    group.train_step(batch, objective, max_rows=3)
    expected = [group.train_step(batch, objective, max_rows=3) for _ in range(2)]
    expected_state = full_state(group)

    group.build(config(tiny), backend=zero(stage))
    group.train_step(batch, objective, max_rows=3)
    group.offload_states(weights=False)
    offloaded = group.run(lambda backend: backend.offloaded_states())
    buckets = ["contiguous_grad_buffer"] if stage == 3 else []
    assert offloaded == [sorted(["hp_params", "lp_grads", "optim_states", *buckets])] * 2
    group.offload_states()
    offloaded = group.run(lambda backend: backend.offloaded_states())
    assert (
        offloaded == [sorted(["hp_params", "lp_grads", "lp_params", "optim_states", *buckets])] * 2
    )
    group.reload_states()
    assert group.run(lambda backend: backend.offloaded_states()) == [[], []]
    got = [group.train_step(batch, objective, max_rows=3) for _ in range(2)]
    for a, b in zip(got, expected, strict=True):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
    state = full_state(group)
    for name, tensor in expected_state.items():
        assert torch.equal(state[name], tensor), name


def _slow_mark(backend, label: str) -> int:
    time.sleep(0.5)  # a later call that overtook this one would find no mark
    backend.order_mark = label
    return backend.rank


def _raise(backend) -> None:
    raise ValueError(f"rank {backend.rank} refused")


def test_started_runs_answer_per_rank_in_the_order_they_were_made(group, tiny) -> None:
    """`LearnerGroup.start_run` returns at once; each rank runs its calls in order, so a call
    made after it sees its effect, and its refs give each rank's result or error."""
    import ray

    group.build(config(tiny), backend=zero(2))
    refs = group.start_run(_slow_mark, "released")
    assert group.run(lambda backend: backend.order_mark) == ["released", "released"]
    assert ray.get(refs) == [0, 1]
    failing = group.start_run(_raise)
    with pytest.raises(ValueError, match="rank 0 refused"):
        ray.get(failing[0])


def _refuse_or_end_late(backend, marker: str) -> int:
    if backend.rank == 1:
        raise ValueError("rank 1 refused")
    time.sleep(1.0)
    pathlib.Path(marker).write_text("rank 0 ended")
    return backend.rank


def test_a_ranks_error_comes_once_every_rank_ended_the_call(group, tiny, tmp_path) -> None:
    """Rank 1 refuses at once while rank 0 is still busy: the driver hears of the error only
    after rank 0's call ended, so it cannot start the next call (or change the files the call
    reads) while a rank is still inside this one."""
    group.build(config(tiny), backend=zero(2))
    marker = tmp_path / "ended"
    with pytest.raises(ValueError, match="rank 1 refused"):
        group.run(_refuse_or_end_late, str(marker))
    assert marker.read_text() == "rank 0 ended"


def test_offload_states_is_refused_where_deepspeed_cannot_move_partitions(group, tiny) -> None:
    group.build(config(tiny), backend=zero(0))
    with pytest.raises(RuntimeError, match="zero_stage 1, 2 or 3 \\(got 0\\)"):
        group.offload_states()
    group.build(config(tiny, optimizer=False), backend=zero(2))
    with pytest.raises(RuntimeError, match="needs a training role"):
        group.offload_states()


def test_foreign_and_partial_checkpoints_are_refused(group, tiny, tmp_path) -> None:
    group.build(config(tiny), backend=zero(2))
    good = group.save(str(tmp_path), 3, client_state={"step": 3})
    # Another model: a score head, no lm_head.
    group.build(config(tiny, kind="scalar"), backend=zero(2))
    with pytest.raises(
        CheckpointError,
        match=r"written for another model \(parameters it lacks: \['score.bias', 'score.weight'\]",
    ):
        group.load(good)
    (tmp_path / ".staging-step-00000004").mkdir()
    with pytest.raises(CheckpointError, match=r"incomplete \(no COMPLETE marker\)"):
        group.load(str(tmp_path / ".staging-step-00000004"))
    with pytest.raises(CheckpointError, match="does not exist"):
        group.load(str(tmp_path / "step-00000009"))


class _TouchOnLoad:
    """Unpickled without restriction, this creates ``marker``: a stand-in for code a
    checkpoint from elsewhere could run."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def _forge_manifest(path: pathlib.Path) -> None:
    """What a hostile or hand-edited checkpoint would carry: a manifest matching its files."""
    from rlhf.learner import checkpoint as ckpt

    (path / "COMPLETE").write_text(json.dumps({"step": 1, "files": ckpt.manifest(path)}))


def test_checkpoint_files_are_read_without_running_code(group, tiny, tmp_path) -> None:
    group.build(config(tiny), backend=zero(2))
    path = pathlib.Path(group.save(str(tmp_path / "ckpt"), 1, client_state={"step": 1}))
    marker = tmp_path / "code-ran"
    rng = path / "rng" / "rank-0.safetensors"
    good_rng = rng.read_bytes()
    torch.save({"python": _TouchOnLoad(marker)}, rng)
    # The manifest notices the change first; with a forged one the reader still refuses.
    with pytest.raises(CheckpointError, match=r"damaged .*rng/rank-0\.safetensors (has|differs)"):
        group.load(str(path))
    _forge_manifest(path)
    with pytest.raises(
        CheckpointError, match=r"rank-0\.safetensors \(the RNG state of rank 0\) does not"
    ):
        group.load(str(path))
    rng.write_bytes(good_rng)
    (optim,) = (path / "backend" / "state").glob("zero_pp_rank_0_*optim_states.pt")
    torch.save({"optimizer_state_dict": _TouchOnLoad(marker)}, optim)
    _forge_manifest(path)
    with pytest.raises(CheckpointError, match=r"optim_states\.pt \(DeepSpeed engine state\)"):
        group.load(str(path))
    assert not marker.exists()
    group.build(config(tiny), backend=zero(2))
    fresh = pathlib.Path(group.save(str(tmp_path / "fresh"), 1, client_state={"step": 1}))
    (
        fresh / "rng" / "rank-0.safetensors"
    ).unlink()  # rank 1's is there: not a checkpoint of fewer ranks
    with pytest.raises(CheckpointError, match=r"damaged .*rng/rank-0\.safetensors is missing"):
        group.load(str(fresh))
    _forge_manifest(fresh)
    with pytest.raises(
        CheckpointError, match=r"is missing rng/rank-0\.safetensors \(deleted, or an incomp"
    ):
        group.load(str(fresh))


def test_missing_model_path_fails_the_build_clearly(group, tmp_path) -> None:
    with pytest.raises(ModelLoadError, match=r"model path '.*missing' does not exist"):
        group.build(config(tmp_path / "missing"), backend=zero(2))


def test_zero3_export_round_trips_and_buckets_reassemble(group, tiny, tokenizer, tmp_path) -> None:
    group.build(config(tiny), backend=zero(3))
    batch = sft_batch(tokenizer)
    group.train_step(batch, SFTObjective(normalizer=float(batch["loss_mask"].sum())), max_rows=3)
    state = full_state(group)
    group.export_hf(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    for name, param in exported.named_parameters():
        if name in state:
            assert torch.equal(param.detach(), state[name]), name
    # Same logits as the trained sharded model computes itself.
    ours = group.forward(
        batch, lambda m, b: m(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
    )
    with torch.no_grad():
        theirs = exported(batch.input_ids, attention_mask=batch.attention_mask).logits
    for rows, logits in ours:
        width = logits.shape[1]
        torch.testing.assert_close(logits, theirs[rows, :width], rtol=1e-5, atol=1e-5)

    def buckets(backend, bucket_bytes):
        """On both ranks (the gathers are collective); only rank 0 gets buckets."""
        return list(stream_weights(backend, version=7, bucket_bytes=bucket_bytes))

    per_rank = group.run(buckets, 16 * 1024)
    sync, other = per_rank
    assert other == []
    sizes = [int(torch.tensor(shape).prod()) * 4 for shape in state_shapes(state)]
    assert len(sync) == count_buckets(sizes, 16 * 1024) > 1
    sync = [b.with_total(len(sync)) for b in sync]
    expected = {k: (tuple(v.shape), "float32") for k, v in state.items()}
    assert validate_sync(sync, expected=expected) == 7
    back = dict(iter_tensors(sync))
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_reward_model_learns_a_separable_preference(group, tiny, tokenizer, tmp_path) -> None:
    def pairs(indices):
        rows = [
            preference_row(
                {"prompt": f"what is {i} plus {i}?", "chosen": "yes good", "rejected": "no bad"},
                i,
                tokenizer,
            )
            for i in indices
        ]
        chosen, rejected = [c for c, _ in rows], [r for _, r in rows]
        return collate(
            [r.input_ids for r in chosen + rejected], pad_token_id=tokenizer.pad_token_id
        )

    train, held_out = pairs(range(8)), pairs(range(10, 16))
    group.build(config(tiny, kind="scalar", lr=3e-3), backend=zero(2))

    def score(model, batch):
        return sequence_scores(model, batch.input_ids, batch.attention_mask)

    def accuracy() -> float:
        scores = torch.cat([s for _, s in group.forward(held_out, score)])
        return (scores[:6] > scores[6:]).float().mean().item()

    objective = RewardModelObjective(normalizer=8.0)
    for _ in range(15):
        group.train_step(train, objective, max_rows=16)  # a pair stays in one micro-batch
    assert accuracy() >= 0.9
    # The exported reward model initialises a critic: same head, same numbers.
    group.export_hf(str(tmp_path / "rm"))
    critic = load_model(ModelConfig(path=str(tmp_path / "rm"), kind="scalar")).eval()
    assert critic.score.weight.abs().sum() > 0
    with torch.no_grad():
        local = sequence_scores(critic, held_out.input_ids, held_out.attention_mask)
    remote = torch.cat([s for _, s in group.forward(held_out, score)])
    torch.testing.assert_close(local, remote, rtol=1e-5, atol=1e-5)


def test_dpo_raises_preference_accuracy(group, tiny, tokenizer) -> None:
    rows = [
        preference_row(
            {"prompt": f"what is {i} plus 1?", "chosen": "the answer is yes", "rejected": "no"},
            i,
            tokenizer,
        )
        for i in range(8)
    ]
    chosen, rejected = [c for c, _ in rows], [r for _, r in rows]
    batch = collate(
        [r.input_ids for r in chosen + rejected],
        pad_token_id=tokenizer.pad_token_id,
        per_token={"loss_mask": [r.loss_mask for r in chosen + rejected]},
    )
    reference = Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        batch.fields["ref_logps"] = sequence_logps(reference, batch)
    group.build(config(tiny, lr=2e-3), backend=zero(2))
    objective = DPOObjective(normalizer=8.0, beta=0.1)
    first = group.train_step(batch, objective, max_rows=16)
    for _ in range(10):
        last = group.train_step(batch, objective, max_rows=16)
    assert first["dpo/accuracy"] <= 0.5  # at the reference, every margin is 0
    assert last["dpo/accuracy"] == 1.0
    assert last["loss"] < first["loss"]
    logps = torch.cat([lp for _, lp in group.forward(batch, sequence_logps)])
    margins = (logps[:8] - batch["ref_logps"][:8]) - (logps[8:] - batch["ref_logps"][8:])
    assert (margins > 0).all()


def test_offloaded_eval_only_reference_matches_a_local_forward(group, tiny, tokenizer) -> None:
    """A reference built eval-only with ZeRO-3 and its parameters offloaded to the CPU gives
    the log-probs of the same checkpoint run locally."""
    from rlhf.learner import token_logprobs

    cfg = LearnerConfig(
        model=ModelConfig(path=str(tiny)),
        optimizer=None,
    )
    group.build(cfg, backend=zero(3, offload_params=True))
    batch = sft_batch(tokenizer)

    def logprobs(model, b):
        return token_logprobs(model, b.input_ids, b.attention_mask, temperature=0.7)[0]

    ours = group.forward(batch, logprobs, max_rows=2)
    local = Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = logprobs(local, batch)
    assert sorted(r for rows, _ in ours for r in rows) == list(range(batch.size))
    for rows, values in ours:
        width = values.shape[1]
        torch.testing.assert_close(values, theirs[rows, :width], rtol=1e-5, atol=1e-5)


def _pairs(batch, pairs):
    """Rows of whole preference pairs (chosen first), as the CLI deals them."""
    n = batch.size // 2
    return batch.select([*pairs, *(n + i for i in pairs)])


@pytest.mark.parametrize("chunks", [[[0, 1], [2], [3, 4]], [[0, 1, 2, 3, 4]]])
def test_caller_made_micro_batches_are_exact_across_ranks(group, tiny, tokenizer, chunks) -> None:
    """train_micro_batches deals whole-pair micro-batches round-robin (3 on 2 ranks: one rank
    takes two; 1 on 2 ranks: the idle rank runs a weight-0 copy) and matches one full-batch DPO
    step in this process: loss, gradient norm and every updated parameter."""
    rows = [
        preference_row(
            {"prompt": f"is {i} even?", "chosen": "yes" if i % 2 == 0 else "no", "rejected": "x"},
            i,
            tokenizer,
        )
        for i in range(5)
    ]
    chosen, rejected = [c for c, _ in rows], [r for _, r in rows]
    batch = collate(
        [r.input_ids for r in chosen + rejected],
        pad_token_id=tokenizer.pad_token_id,
        per_token={"loss_mask": [r.loss_mask for r in chosen + rejected]},
    )
    gen = torch.Generator().manual_seed(7)
    batch.fields["ref_logps"] = -5.0 + torch.randn(batch.size, generator=gen)
    objective = DPOObjective(normalizer=5.0, beta=0.5)
    # eps = 1 makes Adam's first step linear in the gradient (lr * g / (|g| + 1)); with the
    # usual 1e-8 it is lr * sign(g), which turns fp32 summation-order noise on gradients near
    # zero into lr-sized differences (seen: 1 element of 8192 off by 1.3e-5 at lr 1e-3).
    cfg = dataclasses.replace(
        config(tiny),
        optimizer=OptimizerConfig(lr=0.1, grad_clip=0.0, betas=(0.9, 0.95), eps=1.0),
    )
    model = Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    optimizer, scheduler = build_optimizer(model, cfg.optimizer)
    loss, _ = objective(model, batch)
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters())).item()
    optimizer.step()
    scheduler.step()

    group.build(cfg, backend=zero(2))
    out = group.train_micro_batches([_pairs(batch, c) for c in chunks], objective)
    assert out["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    assert out["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    after = full_state(group)
    for name, param in model.named_parameters():
        torch.testing.assert_close(after[name], param.detach(), rtol=0, atol=2e-6, msg=name)


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_trains_adapters_only_and_exports_merged_weights(
    group, tiny, tokenizer, tmp_path, stage
) -> None:
    cfg = LearnerConfig(
        model=ModelConfig(path=str(tiny), lora_rank=4, lora_alpha=8),
        optimizer=OptimizerConfig(lr=1e-2, grad_clip=0.0),
    )
    fp = group.build(cfg, backend=zero(stage))
    assert any(".lora_A." in name for name in fp)

    def raw(backend):
        return (
            {n: p.detach().clone() for n, p in backend.module.named_parameters()}
            if stage != 3
            else None
        )

    before = group.run(raw)[0]
    batch = sft_batch(tokenizer)
    objective = SFTObjective(normalizer=float(batch["loss_mask"].sum()))
    losses = [group.train_step(batch, objective, max_rows=3)["loss"] for _ in range(6)]
    assert losses[-1] < losses[0] - 0.1
    if before is not None:
        after = group.run(raw)[0]
        changed = {n for n in before if not torch.equal(before[n], after[n])}
        assert changed and all(".lora_" in n for n in changed)  # the base stays frozen
    merged = full_state(group)
    base_names = set(Qwen2ForCausalLM.from_pretrained(tiny).state_dict()) - {"lm_head.weight"}
    assert set(merged) == base_names
    original = Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32).state_dict()
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           original["model.layers.0.self_attn.q_proj.weight"])  # fmt: skip
    assert torch.equal(merged["model.norm.weight"], original["model.norm.weight"])
    group.export_hf(str(tmp_path / "merged"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    ours = group.forward(
        batch, lambda m, b: m(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
    )
    with torch.no_grad():
        theirs = exported.eval()(batch.input_ids, attention_mask=batch.attention_mask).logits
    for rows, logits in ours:
        torch.testing.assert_close(logits, theirs[rows, : logits.shape[1]], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stage", [2, 3])
def test_ema_follows_the_weights_and_survives_a_checkpoint(
    group, tiny, tokenizer, tmp_path, stage
) -> None:
    cfg = LearnerConfig(
        model=ModelConfig(path=str(tiny)),
        optimizer=OptimizerConfig(lr=1e-2, grad_clip=0.0, ema_decay=0.5),
    )
    group.build(cfg, backend=zero(stage))
    batch = sft_batch(tokenizer)
    objective = SFTObjective(normalizer=float(batch["loss_mask"].sum()))
    w = [full_state(group)]
    for _ in range(2):
        group.train_step(batch, objective, max_rows=3)
        w.append(full_state(group))
    path = group.save(str(tmp_path), 2, client_state={"step": 2})
    ema = group.run(lambda backend: backend.state_dict_on_rank0(ema=True))[0]
    # ema0 = w0; ema1 = (w0 + w1) / 2; ema2 = ema1 / 2 + w2 / 2 = w0/4 + w1/4 + w2/2.
    for name in w[0]:
        expected = 0.25 * w[0][name] + 0.25 * w[1][name] + 0.5 * w[2][name]
        torch.testing.assert_close(ema[name], expected, rtol=1e-5, atol=1e-6, msg=name)
    assert torch.equal(full_state(group)["model.norm.weight"], w[2]["model.norm.weight"])
    # Reading the EMA left the live weights as they were: the next step starts from w2.
    live = Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    live.load_state_dict(w[2], strict=False)
    live.tie_weights()
    expected_loss = objective(live, batch)[0].item()
    assert group.train_step(batch, objective, max_rows=3)["loss"] == pytest.approx(
        expected_loss, rel=1e-5
    )
    group.build(cfg, backend=zero(stage))
    group.load(path)
    restored = group.run(lambda backend: backend.state_dict_on_rank0(ema=True))[0]
    assert all(torch.equal(restored[k], ema[k]) for k in ema)
    group.export_hf(str(tmp_path / "ema"), ema=True)
    exported = Qwen2ForCausalLM.from_pretrained(tmp_path / "ema", dtype=torch.float32)
    assert torch.equal(exported.model.norm.weight.detach(), ema["model.norm.weight"])


def test_qlora_trains_adapters_on_a_4bit_base_and_exports_dense_merged_weights(
    group, tiny, tokenizer, tmp_path
) -> None:
    """OpenRLHF's ``--ds.load_in_4bit``: the base loads as bitsandbytes NF4 (on the CPU too),
    only the LoRA adapters train, and the merged export is a plain dense checkpoint whose
    logits are the 4-bit model's (its base dequantised); a checkpoint restores the adapters."""
    cfg = LearnerConfig(
        model=ModelConfig(path=str(tiny), lora_rank=4, lora_alpha=8, load_in_4bit=True),
        optimizer=OptimizerConfig(lr=1e-2, grad_clip=0.0),
    )
    group.build(cfg, backend=zero(2))

    def packed(backend):
        proj = backend.module.get_base_model().model.layers[0].mlp.up_proj.base_layer
        return type(proj).__name__, proj.weight.dtype, proj.weight.detach().clone()

    kind, dtype, before = group.run(packed)[0]
    assert (kind, dtype) == ("Linear4bit", torch.uint8)
    batch = sft_batch(tokenizer)
    objective = SFTObjective(normalizer=float(batch["loss_mask"].sum()))
    losses = [group.train_step(batch, objective, max_rows=3)["loss"] for _ in range(6)]
    assert losses[-1] < losses[0] - 0.1
    assert torch.equal(group.run(packed)[0][2], before)  # the 4-bit base stays frozen
    merged = full_state(group)
    original = Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32).state_dict()
    assert set(merged) == set(original) - {"lm_head.weight"}
    assert all(t.dtype == torch.float32 for t in merged.values())
    # NF4 keeps 16 levels per 64-value block: the dequantised base is near the original.
    gap = (
        merged["model.layers.0.mlp.up_proj.weight"] - original["model.layers.0.mlp.up_proj.weight"]
    )
    assert 0 < gap.abs().max() < 0.1
    group.export_hf(str(tmp_path / "merged"))
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in config
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)

    def logits(m, b):
        return m(input_ids=b.input_ids, attention_mask=b.attention_mask).logits

    # Each exported projection is bitsandbytes' dequantised base plus PEFT's scaling · B A.
    from safetensors.torch import load_file

    def by_hand(backend):
        from bitsandbytes.functional import dequantize_4bit

        layer = backend.module.get_base_model().model.layers[0].self_attn.q_proj
        weight = layer.base_layer.weight
        base = dequantize_4bit(weight.data, weight.quant_state)
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        return (base + layer.scaling["default"] * (b @ a)).detach()

    exported_q = load_file(tmp_path / "merged" / "model.safetensors")
    torch.testing.assert_close(
        exported_q["model.layers.0.self_attn.q_proj.weight"], group.run(by_hand)[0]
    )
    # The dense model computes what the 4-bit one does, up to bitsandbytes' CPU kernel, which
    # multiplies in lower precision than float32 (about 0.4 % of a layer's output, probed).
    with torch.no_grad():
        theirs = exported.eval()(batch.input_ids, attention_mask=batch.attention_mask).logits
    for rows, ours in group.forward(batch, logits):
        torch.testing.assert_close(ours, theirs[rows, : ours.shape[1]], rtol=0, atol=1e-2)
    saved = group.save(str(tmp_path / "ckpt"), 6, client_state={"step": 6})
    trained = [out for _, out in group.forward(batch, logits)]
    group.train_step(batch, objective, max_rows=3)
    group.load(saved)
    for (_, out), want in zip(group.forward(batch, logits), trained, strict=True):
        torch.testing.assert_close(out, want)
