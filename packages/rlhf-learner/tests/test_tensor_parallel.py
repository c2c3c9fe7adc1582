"""``deepspeed.tp_size``: DeepSpeed AutoTP training on 2 (and 2 x 2) ranks over gloo against the
same role at tp_size 1 on one rank: the step, whole weights out (buckets, HF export), log-probs
of an eval-only role and an exact resume; and the refused combinations, ``deepcompile``'s
among them."""

from __future__ import annotations

import functools
import json
import pathlib

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlhf.algos import AlgoConfig, KLConfig, loss_normalizer
from rlhf.learner import (
    CheckpointError,
    DeepSpeedBackend,
    DeepSpeedConfig,
    LearnerConfig,
    LearnerGroup,
    ModelConfig,
    OptimizerConfig,
    PPOActorObjective,
    stream_weights,
    token_logprobs,
)
from rlhf.learner.deepspeed_backend import check_compiled_passes
from rlhf.learner.tensor_parallel import check_saved_tp_size, tensor_parallel_problems
from rlhf.weights import iter_tensors, validate_sync

from .test_units import _rl_batch

LR = 1e-3
EPS = 1.0
"""AdamW's ``eps``: its first step moves a weight by ``lr * g / (|g| + eps)``, so with
``eps`` 1 a gradient off by ``d`` moves the weight by at most ``lr * d`` more (the derivative
of ``g / (|g| + 1)`` is at most 1), whatever the gradient's size. With a tiny ``eps`` the
step is ``lr * sign(g)``: exact for the gradients far from 0, but a tied embedding row's
~1e-10 gradient would turn float32 rounding into lr-sized differences."""


@pytest.fixture(scope="module")
def tiny_tp(tiny, tmp_path_factory) -> pathlib.Path:
    """The conftest model's tokenizer with a Qwen2 that 2 ranks can split: 4 attention heads,
    2 key/value heads, an untied lm_head (AutoTP splits it by vocabulary and gathers its
    logits), q/k/v biases."""
    path = tmp_path_factory.mktemp("tiny-qwen2-tp")
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            (path / f.name).write_bytes(f.read_bytes())
    base = Qwen2Config.from_pretrained(tiny)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=base.vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, eos_token_id=base.eos_token_id, pad_token_id=base.pad_token_id,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def learner(
    path: pathlib.Path, *, tp: int, train: bool = True, stage: int = 1, **model
) -> dict[str, object]:
    """``build``'s arguments for a role at ``tp_size`` ``tp`` (``model``: further
    `ModelConfig` fields)."""
    config = LearnerConfig(
        model=ModelConfig(path=str(path), **model),
        optimizer=OptimizerConfig(lr=LR, grad_clip=0.0, eps=EPS) if train else None,
    )
    deepspeed = DeepSpeedConfig(zero_stage=stage, tp_size=tp)
    return {"config": config, "backend": functools.partial(DeepSpeedBackend, deepspeed=deepspeed)}


def ppo(path: pathlib.Path) -> tuple[object, PPOActorObjective]:
    model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = _rl_batch(model, seed=2)
    algo = AlgoConfig(kl=KLConfig(use_loss=True, estimator="k3"), entropy_coef=0.01)
    norm = float(loss_normalizer(batch["action_mask"], mode="token-mean"))
    return batch, PPOActorObjective(algo=algo, normalizer=norm, kl_coef=0.1)


def full_state(group: LearnerGroup) -> dict[str, torch.Tensor]:
    return group.run(lambda backend: backend.state_dict_on_rank0())[0]


def buckets(backend, bucket_bytes: int) -> list:
    """Every rank drives the gathers; rank 0 gets the buckets."""
    return list(stream_weights(backend, version=3, bucket_bytes=bucket_bytes))


def reference_step(path: pathlib.Path, batch, objective, **options) -> dict[str, object]:
    """tp_size 1 on one rank (``options``: `learner`'s, ``split``: `LearnerGroup.train_step`'s
    budget): the initial full state, the step's metrics, the state after."""
    split = options.pop("split")
    single = LearnerGroup(num_ranks=1, num_cpus_per_rank=0.5)
    try:
        single.build(**learner(path, tp=1, **options))
        before = full_state(single)
        fingerprint = single.run(lambda backend: backend.fingerprint())[0]
        out = single.train_step(batch, objective, **split)
        after = full_state(single)
    finally:
        single.shutdown()
    return {"before": before, "fingerprint": fingerprint, "out": out, "after": after}


@pytest.mark.parametrize(
    ("ranks", "stage", "packing"),
    [(2, 1, False), (2, 2, False), (2, 2, True), (4, 1, False)],
    ids=["tp2-zero1", "tp2-zero2", "tp2-zero2-packed", "dp2xtp2-zero1"],
)
def test_tp_step_and_whole_weights_equal_one_rank(
    ray_cluster, tiny_tp, tmp_path, ranks, stage, packing
) -> None:
    """tp_size 2 (dp 1 or 2) against tp_size 1 on one rank, the same batch in micro-batches
    of 2 rows (3 of them: at dp 2 one coordinate pads with a weight-0 pass), or padding-free
    in 16-token micro-batches:

    - before training the streamed buckets and the full state are the whole weights exactly
      (a gathered shard is a copy of the loaded rows or columns);
    - the step's loss and gradient norm agree to float32 rounding (rtol 1e-5): the row-wise
      layers sum their halves over the group, so sums run in another order;
    - every parameter after AdamW's first step agrees within ``LR * 1e-5`` plus 2 float32
      ulps: a gradient off by ``d`` (≲ 1e-5 here, gradients are O(1) and a few reassociated
      sums deep) moves the weight by at most ``LR * d`` more (see `EPS`), and the update
      itself rounds at the weight's last bit;
    - the HF export is the full state the group reports, bit for bit.
    """
    batch, objective = ppo(tiny_tp)
    split = {"max_tokens": 16} if packing else {"max_rows": 2}
    ref = reference_step(
        tiny_tp, batch, objective, stage=stage, packing_samples=packing, split=split
    )
    group = LearnerGroup(num_ranks=ranks, num_cpus_per_rank=0.5)
    try:
        group.build(**learner(tiny_tp, tp=2, stage=stage, packing_samples=packing))
        coords = group.run(lambda backend: (backend.dp_rank, backend.dp_size))
        assert coords == [(r // 2, ranks // 2) for r in range(ranks)]
        rows = group.run(lambda b: dict(b.module.named_parameters())["lm_head.weight"].shape[0])
        vocab = ref["before"]["lm_head.weight"].shape[0]
        assert rows[0] + rows[1] == vocab and max(rows) < vocab  # each rank holds its part
        assert group.run(lambda backend: backend.fingerprint())[0] == ref["fingerprint"]
        sync = group.run(buckets, 8 * 1024)
        before = full_state(group)
        out = group.train_step(batch, objective, **split)
        after = full_state(group)
        group.export_hf(str(tmp_path / "hf"))
    finally:
        group.shutdown()
    assert all(per_rank == [] for per_rank in sync[1:])
    sync = [b.with_total(len(sync[0])) for b in sync[0]]
    whole = {k: (tuple(v.shape), "float32") for k, v in ref["before"].items()}
    assert validate_sync(sync, expected=whole) == 3
    streamed = dict(iter_tensors(sync))
    assert streamed.keys() == before.keys() == ref["before"].keys()
    for name, tensor in ref["before"].items():
        assert torch.equal(streamed[name], tensor), name
        assert torch.equal(before[name], tensor), name
    assert out["loss"] == pytest.approx(ref["out"]["loss"], rel=1e-5)
    assert out["grad_norm"] == pytest.approx(ref["out"]["grad_norm"], rel=1e-5)
    changed = [n for n in after if not torch.equal(after[n], before[n])]
    assert len(changed) == len(after)  # every parameter trained (so the comparison can fail)
    ulp = torch.finfo(torch.float32).eps
    for name, tensor in ref["after"].items():
        torch.testing.assert_close(after[name], tensor, rtol=2 * ulp, atol=LR * 1e-5, msg=name)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    for name, param in exported.named_parameters():
        assert torch.equal(param.detach(), after[name]), name


@pytest.mark.parametrize("kind", ["causal_lm", "scalar"])
def test_eval_only_tp_role_gives_the_local_forward(ray_cluster, tiny_tp, tmp_path, kind) -> None:
    """An eval-only role split over 2 ranks (an engine at ZeRO stage 0, no optimizer) gives
    what the checkpoint computes whole in this process: a reference's log-probs, a reward
    model's scores (random score head, which stays whole on every rank). To float32 rounding
    of the row-wise layers' summed halves: log-probs ≈ −6, so 1e-5 is a few hundred ulps."""
    from transformers import AutoModelForTokenClassification

    from rlhf.learner import load_model, sequence_scores

    batch, _ = ppo(tiny_tp)
    path = tiny_tp
    if kind == "scalar":
        path = tmp_path / "rm"
        rm = load_model(ModelConfig(path=str(tiny_tp), kind="scalar"))
        with torch.no_grad():
            rm.score.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(5))
        rm.save_pretrained(path)
        local = AutoModelForTokenClassification.from_pretrained(path, num_labels=1).eval()

        def fn(model, b):
            return sequence_scores(model, b.input_ids, b.attention_mask)

    else:
        local = Qwen2ForCausalLM.from_pretrained(tiny_tp, dtype=torch.float32).eval()

        def fn(model, b):
            return token_logprobs(model, b.input_ids, b.attention_mask, temperature=0.7)[0]

    group = LearnerGroup(num_ranks=2, num_cpus_per_rank=0.5)
    try:
        group.build(**learner(path, tp=2, train=False, kind=kind))
        split = group.run(lambda b: type(b.module.model.layers[0].self_attn.o_proj).__name__)
        assert split == ["LinearAllreduce"] * 2
        ours = group.forward(batch, fn, max_rows=4)
    finally:
        group.shutdown()
    with torch.no_grad():
        theirs = fn(local, batch)
    assert sorted(r for rows, _ in ours for r in rows) == list(range(batch.size))
    for rows, values in ours:
        expected = theirs[rows] if kind == "scalar" else theirs[rows, : values.shape[1]]
        assert values.abs().max() > 0.1  # not a head of zeros
        torch.testing.assert_close(values, expected, rtol=1e-5, atol=1e-5)


def test_tp_checkpoint_resumes_exactly(ray_cluster, tiny_tp, tmp_path) -> None:
    """Saved at tp_size 2 after one step and loaded into a fresh tp_size-2 role: every
    parameter is the saved one bit for bit, and the next step (loss, gradient norm, the
    parameters after it) is the uninterrupted run's exactly (same ranks, same arithmetic)."""
    batch, objective = ppo(tiny_tp)
    group = LearnerGroup(num_ranks=2, num_cpus_per_rank=0.5)
    try:
        group.build(**learner(tiny_tp, tp=2))
        group.train_step(batch, objective, max_rows=2)
        saved = full_state(group)
        path = group.save(str(tmp_path), 1, client_state={"step": 1})
        uninterrupted = group.train_step(batch, objective, max_rows=2)
        expected = full_state(group)
        group.build(**learner(tiny_tp, tp=2))
        fresh = full_state(group)
        assert any(not torch.equal(fresh[k], saved[k]) for k in saved)
        assert group.load(path) == {"step": 1}
        loaded = full_state(group)
        resumed = group.train_step(batch, objective, max_rows=2)
        after = full_state(group)
    finally:
        group.shutdown()
    assert json.loads((pathlib.Path(path) / "backend" / "parallel.json").read_text()) == {
        "tp_size": 2
    }
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
    assert (resumed["loss"], resumed["grad_norm"]) == (
        uninterrupted["loss"],
        uninterrupted["grad_norm"],
    )
    for name, tensor in expected.items():
        assert torch.equal(after[name], tensor), name


def test_a_checkpoint_of_another_tp_size_is_refused(tmp_path) -> None:
    (tmp_path / "backend").mkdir()
    check_saved_tp_size(str(tmp_path), tp_size=1)  # no file: written before the option
    with pytest.raises(CheckpointError, match="written with deepspeed.tp_size 1, this role runs"):
        check_saved_tp_size(str(tmp_path), tp_size=2)
    (tmp_path / "backend" / "parallel.json").write_text(json.dumps({"tp_size": 2}))
    check_saved_tp_size(str(tmp_path), tp_size=2)
    with pytest.raises(CheckpointError, match=r"resume with --deepspeed.tp_size 2"):
        check_saved_tp_size(str(tmp_path), tp_size=1)


def test_options_that_cannot_combine_are_refused_in_the_config() -> None:
    with pytest.raises(ValueError, match="deepspeed.tp_size must be >= 1, got 0"):
        DeepSpeedConfig(tp_size=0)
    with pytest.raises(ValueError, match="deepspeed.tp_size 2 with deepspeed.ring_attn_size 2"):
        DeepSpeedConfig(tp_size=2, ring_attn_size=2)
    with pytest.raises(ValueError, match="deepspeed.deepcompile needs deepspeed.zero_stage 1, 2"):
        DeepSpeedConfig(deepcompile=True, zero_stage=0)
    with pytest.raises(ValueError, match="deepspeed.deepcompile with deepspeed.tp_size 2"):
        DeepSpeedConfig(deepcompile=True, tp_size=2, bf16=True)
    with pytest.raises(
        ValueError, match="deepcompile with deepspeed.zero_stage 2 needs deepspeed.bf16"
    ):
        DeepSpeedConfig(deepcompile=True, zero_stage=2)
    for stage in (1, 2, 3):
        assert DeepSpeedConfig(deepcompile=True, zero_stage=stage, bf16=True).deepcompile
    for stage in (1, 3):
        assert DeepSpeedConfig(deepcompile=True, zero_stage=stage).deepcompile
    check_compiled_passes(1)
    with pytest.raises(ValueError, match=r"deepcompile: this step runs 3 micro-batches on a"):
        check_compiled_passes(3)


def test_tensor_parallel_problems_name_the_flags(tiny, tiny_tp, tmp_path) -> None:
    def problems(path, *, world: int = 2, **options) -> list[str]:
        model = {k: options.pop(k) for k in ("lora_rank", "chunked_lm_head") if k in options}
        return tensor_parallel_problems(
            deepspeed=DeepSpeedConfig(**options),
            model=ModelConfig(path=str(path), **model),
            world_size=world,
            prefix="actor.",
        )

    assert problems(tiny_tp, tp_size=1, world=3) == []
    assert problems(tiny_tp, tp_size=2) == []
    assert problems(tiny_tp, tp_size=2, world=3) == [
        "--actor.deepspeed.tp_size 2 must divide the role's 3 rank(s) (ranks = data parallel x "
        "tensor parallel); change the rank count or tp_size"
    ]
    (zero3,) = problems(tiny_tp, tp_size=2, zero_stage=3)
    assert zero3.startswith("--actor.deepspeed.tp_size 2 with --actor.deepspeed.zero_stage 3:")
    (lora,) = problems(tiny_tp, tp_size=2, lora_rank=4)
    assert lora.startswith("--actor.deepspeed.tp_size 2 with --actor.model.lora_rank 4: LoRA")
    (chunked,) = problems(tiny_tp, tp_size=2, chunked_lm_head=True)
    assert chunked.startswith("--actor.deepspeed.tp_size 2 with --actor.model.chunked_lm_head")
    # The conftest model has one key/value head and two attention heads.
    assert problems(tiny, tp_size=2) == [
        "--actor.deepspeed.tp_size 2 must divide the model's num_key_value_heads (1); choose a "
        "tp_size that divides 1"
    ]
    assert any("num_attention_heads (4)" in p for p in problems(tiny_tp, tp_size=8, world=8))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    (no_plan,) = problems(tmp_path, tp_size=2)
    assert "no-such-model model carries no tensor-parallel plan" in no_plan
    assert problems(tmp_path / "missing", tp_size=2) == []  # the model checks report it


def test_the_backend_refuses_what_it_cannot_run(ray_cluster, tiny_tp) -> None:
    """On this CPU rank: a tp_size that does not divide the ranks, and DeepCompile, which
    DeepSpeed runs on CUDA only (an eval-only role ignores it and builds)."""
    group = LearnerGroup(num_ranks=1, num_cpus_per_rank=0.5)
    try:
        with pytest.raises(Exception, match=r"--deepspeed.tp_size 2 must divide the role's 1"):
            group.build(**learner(tiny_tp, tp=2))
        compiled = LearnerConfig(
            model=ModelConfig(path=str(tiny_tp)), optimizer=OptimizerConfig(lr=LR)
        )
        deepcompile = functools.partial(
            DeepSpeedBackend, deepspeed=DeepSpeedConfig(zero_stage=1, deepcompile=True)
        )
        with pytest.raises(Exception, match=r"--deepspeed.deepcompile needs a CUDA GPU"):
            group.build(compiled, backend=deepcompile)
        eval_only = LearnerConfig(model=compiled.model, optimizer=None)
        assert group.build(eval_only, backend=deepcompile)
    finally:
        group.shutdown()
