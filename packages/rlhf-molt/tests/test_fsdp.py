"""The FSDP2 backend on 2 ranks (Ray actors, gloo): the same step as one process and as the
DeepSpeed backend, exact DCP resume, foreign checkpoints refused, HF export and weight streams
equal to the full state, options refused by flag name."""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import pathlib

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

from rlhf.algos import AlgoConfig, KLConfig, loss_normalizer
from rlhf.learner import (
    CheckpointError,
    DPOObjective,
    LearnerConfig,
    LearnerGroup,
    ModelConfig,
    OptimizerConfig,
    PPOActorObjective,
    RewardModelObjective,
    SFTObjective,
    collate,
    preference_row,
    sequence_logps,
    stream_weights,
)
from rlhf.learner import checkpoint as ckpt
from rlhf.learner.muon import build_muon
from rlhf.learner.optim import build_optimizer
from rlhf.molt import FSDPBackend, FSDPConfig, FSDPConfigError
from rlhf.weights import iter_tensors, validate_sync

from .molt_cases import ZERO2, config, critic_case, full_state, rl_batch, sft_batch

MOLT = functools.partial(FSDPBackend, fsdp=FSDPConfig())


@pytest.fixture(scope="module")
def group(ray_cluster):
    g = LearnerGroup(num_ranks=2)
    yield g
    g.shutdown()


@pytest.mark.parametrize("option", [None, "packing", "chunked"])
def test_ppo_actor_step_equals_one_process_and_deepspeed(group, tiny, option) -> None:
    """2 ranks × 3 uneven micro-batches (one rank pads with a weight-0 pass): the loss, the
    gradient norm and every updated parameter equal one full-batch step in this process, and
    the DeepSpeed ZeRO-2 backend's step on the same split — also padding-free, and with the
    chunked lm_head (log-probs from hidden states, the tied head's gradient reduced as in a
    plain forward)."""
    packing, chunked = option == "packing", option == "chunked"
    model = Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    batch = rl_batch(model, seed=2)
    algo = AlgoConfig(kl=KLConfig(use_loss=True, estimator="k3"), entropy_coef=0.01)
    norm = float(loss_normalizer(batch["action_mask"], mode="token-mean"))
    objective = PPOActorObjective(algo=algo, normalizer=norm, kl_coef=0.1)
    cfg = config(tiny, packing=packing, chunked=chunked)
    optimizer, scheduler = build_optimizer(model, cfg.optimizer)
    flags = {"packing_samples": packing, "chunked_lm_head": chunked}
    loss, _ = objective(model, dataclasses.replace(batch, **flags))
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters())).item()
    optimizer.step()
    scheduler.step()

    split = {"max_tokens": 16} if packing else {"max_rows": 2}
    results, states = {}, {}
    for name, backend in (("molt", MOLT), ("deepspeed", ZERO2)):
        group.build(cfg, backend=backend)
        assert [len(m) for m, _ in group.split(batch, **split)] == [2, 1]
        results[name] = group.train_step(batch, objective, **split)
        states[name] = full_state(group)
    out = results["molt"]
    assert out["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    assert out["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    assert out["lr"] == results["deepspeed"]["lr"]
    for name, param in model.named_parameters():
        torch.testing.assert_close(states["molt"][name], param.detach(), rtol=0, atol=2e-6)
        torch.testing.assert_close(
            states["molt"][name], states["deepspeed"][name], rtol=0, atol=2e-6
        )


def test_critic_step_equals_one_process(group, tiny, tmp_path) -> None:
    path, batch, objective, loss, grad_norm = critic_case(
        tiny, tmp_path, batch_seed=4, value_seed=3
    )
    group.build(config(path, kind="scalar"), backend=MOLT)
    out = group.train_step(batch, objective, max_rows=1)
    assert out["loss"] == pytest.approx(loss, rel=1e-5)
    assert out["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)


def test_bfloat16_compute_stays_close_to_float32(group, tiny, tokenizer) -> None:
    batch = sft_batch(tokenizer)
    objective = SFTObjective(normalizer=float(batch["loss_mask"].sum()))
    group.build(config(tiny), backend=MOLT)
    fp32 = group.train_step(batch, objective, max_rows=3)
    bf16 = functools.partial(FSDPBackend, fsdp=FSDPConfig(param_dtype="bfloat16"))
    group.build(config(tiny), backend=bf16)
    out = group.train_step(batch, objective, max_rows=3)
    assert out["loss"] == pytest.approx(fp32["loss"], rel=1e-2)
    assert out["loss"] != fp32["loss"]  # the forward did run in bfloat16
    # The masters stay float32.
    assert {t.dtype for t in full_state(group).values()} == {torch.float32}


def test_dcp_resume_continues_bit_for_bit(group, tiny, tokenizer, tmp_path) -> None:
    batch = sft_batch(tokenizer)
    objective = SFTObjective(normalizer=float(batch["loss_mask"].sum()))
    group.build(config(tiny), backend=MOLT)
    group.train_step(batch, objective, max_rows=3)
    path = group.save(str(tmp_path), 1, client_state={"step": 1, "data_position": 6}, keep=2)
    uninterrupted = [group.train_step(batch, objective, max_rows=3) for _ in range(2)]
    expected = full_state(group)
    group.build(config(tiny), backend=MOLT)  # a new run from the initial weights
    fresh = group.train_step(batch, objective, max_rows=3)
    assert fresh["loss"] != uninterrupted[0]["loss"]
    group.build(config(tiny), backend=MOLT)
    assert group.load(path) == {"step": 1, "data_position": 6}
    resumed = [group.train_step(batch, objective, max_rows=3) for _ in range(2)]
    for a, b in zip(resumed, uninterrupted, strict=True):
        assert (a["loss"], a["grad_norm"], a["lr"]) == (b["loss"], b["grad_norm"], b["lr"])
    state = full_state(group)
    assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_muon_step_equals_one_process_and_resumes_bit_for_bit(group, tiny, tokenizer, tmp_path):
    """Muon on 2 FSDP2 ranks: each hidden matrix's update orthogonalised whole (gathered from
    its shards) gives the weights one process's `MuonAdamW` step gives, clipped gradients
    included (molt clips before the optimizer); ``lr`` is Muon's half's, ``lr_adamw``
    AdamW's; and a checkpoint (momentum buffers and Adam moments in DCP shards) resumes
    exactly."""
    cfg = config(tiny)
    assert cfg.optimizer is not None
    opt = dataclasses.replace(
        cfg.optimizer, name="muon", muon_lr=0.02, muon_momentum=0.9, grad_clip=0.5
    )
    cfg = dataclasses.replace(cfg, optimizer=opt)
    batch = sft_batch(tokenizer)
    objective = SFTObjective(normalizer=float(batch["loss_mask"].sum()))
    model = Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    optimizer, scheduler = build_muon(model, opt)
    loss, _ = objective(model, batch)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    scheduler.step()
    group.build(cfg, backend=MOLT)
    out = group.train_step(batch, objective, max_rows=3)
    assert out["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert out["grad_norm"] == pytest.approx(float(norm), rel=1e-4)
    lrs = [g["lr"] for g in optimizer.param_groups]  # the schedule's next, one factor for both
    assert (out["lr"], out["lr_adamw"]) == (lrs[0], lrs[-1])
    assert out["lr"] / out["lr_adamw"] == pytest.approx(0.02 / 1e-3, rel=1e-12)
    state = full_state(group)
    for name, param in model.named_parameters():
        torch.testing.assert_close(state[name], param.detach(), rtol=0, atol=2e-6, msg=name)
    path = group.save(str(tmp_path), 1, client_state={"step": 1}, keep=2)
    uninterrupted = [group.train_step(batch, objective, max_rows=3) for _ in range(2)]
    expected = full_state(group)
    group.build(cfg, backend=MOLT)
    assert group.load(path) == {"step": 1}
    resumed = [group.train_step(batch, objective, max_rows=3) for _ in range(2)]
    for a, b in zip(resumed, uninterrupted, strict=True):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
    state = full_state(group)
    assert all(torch.equal(state[k], expected[k]) for k in expected)


class _Planted:
    """Unpickling it creates the file ``marker``: what a hostile checkpoint could do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _rewrite_manifest(path: str) -> None:
    """A hostile checkpoint comes with a manifest that matches it."""
    complete = pathlib.Path(path) / "COMPLETE"
    complete.write_text(json.dumps({"step": 1, "files": ckpt.manifest(path)}))


def test_dcp_files_hold_no_pickle_and_a_forged_one_is_refused_unread(group, tiny, tmp_path):
    """The DCP state is safetensors (tensor chunks) and JSON (the description, optimizer
    hyper-parameters); a pickled ``.metadata`` in its place, a forged class in a value and
    an unknown dtype are refused, naming the file, and nothing of them runs."""
    import pickle

    from safetensors import safe_open

    from rlhf.molt import dcp_files

    group.build(config(tiny), backend=MOLT)
    path = group.save(str(tmp_path / "ckpt"), 1, client_state={"step": 1}, keep=2)
    backend = pathlib.Path(path) / "backend"
    files = sorted(f.name for f in backend.iterdir())
    assert files == ["__0.safetensors", "__1.safetensors", "metadata.json", "schedule.json"]
    document = json.loads((backend / "metadata.json").read_text())
    values = {}
    for name in ("__0.safetensors", "__1.safetensors"):
        with safe_open(str(backend / name), framework="pt") as stored:  # parses: no pickle
            values.update(json.loads(stored.metadata()["rlhf.dcp.items"]))
    betas = next(v for k, v in values.items() if k.endswith(".betas@"))
    assert json.loads(betas) == {"$tuple": list(config(tiny).optimizer.betas)}  # still a tuple
    assert document["items"]["model.model.embed_tokens.weight"]["dtype"] == "float32"

    marker = tmp_path / "ran"
    original = (backend / "metadata.json").read_text()
    (backend / "metadata.json").unlink()
    (backend / ".metadata").write_bytes(pickle.dumps(_Planted(str(marker))))
    _rewrite_manifest(path)
    group.build(config(tiny), backend=MOLT)
    with pytest.raises(CheckpointError, match=r"DCP state in torch's pickle format"):
        group.load(path)
    (backend / ".metadata").unlink()

    forged = json.loads(original)
    forged["items"]["model.model.embed_tokens.weight"]["dtype"] = "system"
    (backend / "metadata.json").write_text(json.dumps(forged))
    _rewrite_manifest(path)
    with pytest.raises(CheckpointError, match=r"metadata.json names dtype 'system'"):
        group.load(path)
    (backend / "metadata.json").write_text(original)

    item = type("Item", (), {"dest_index": type("Index", (), {"fqn": "optim.param_groups"})})
    planted = json.dumps({"$object": "builtins.open", "fields": {"file": str(marker)}})
    with pytest.raises(CheckpointError, match=r"'optim.param_groups' is not a readable value"):
        dcp_files.JsonLoadPlanner().load_bytes(item, io.BytesIO(planted.encode()))
    assert not marker.exists()


def test_another_backends_checkpoint_is_refused(group, tiny, tmp_path) -> None:
    group.build(config(tiny), backend=ZERO2)
    written = group.save(str(tmp_path), 2, client_state={"step": 2})
    group.build(config(tiny), backend=MOLT)
    with pytest.raises(CheckpointError, match=r"no FSDP \(DCP\) state .* --actor.backend"):
        group.load(written)


def test_export_and_weight_stream_equal_the_full_state(group, tiny, tokenizer, tmp_path) -> None:
    group.build(config(tiny), backend=ZERO2)
    deepspeed_shapes = group.run(lambda backend: backend.fingerprint())[0]
    group.build(config(tiny), backend=MOLT)
    assert group.run(lambda backend: backend.fingerprint())[0] == deepspeed_shapes
    batch = sft_batch(tokenizer)
    group.train_step(batch, SFTObjective(normalizer=float(batch["loss_mask"].sum())), max_rows=3)
    state = full_state(group)
    group.export_hf(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    for name, param in exported.named_parameters():
        assert torch.equal(param.detach(), state[name]), name
    # The sharded model's own logits equal the export's.
    ours = group.forward(
        batch, lambda m, b: m(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
    )
    with torch.no_grad():
        theirs = exported(batch.input_ids, attention_mask=batch.attention_mask).logits
    for rows, logits in ours:
        torch.testing.assert_close(logits, theirs[rows, : logits.shape[1]], rtol=1e-5, atol=1e-5)

    def buckets(backend):
        return list(stream_weights(backend, version=3, bucket_bytes=16 * 1024))

    sync, other = group.run(buckets)
    assert other == [] and len(sync) > 1
    sync = [b.with_total(len(sync)) for b in sync]
    expected = {k: (tuple(v.shape), "float32") for k, v in state.items()}
    assert validate_sync(sync, expected=expected) == 3
    back = dict(iter_tensors(sync))
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_options_not_available_are_refused_by_flag(group, tiny) -> None:
    for options, flag in [
        ({"tp_size": 0}, "--actor.fsdp.tp_size must be >= 1"),
        (
            {"cp_size": 2, "tp_size": 2},
            "--actor.fsdp.cp_size 2 with --actor.fsdp.tp_size 2: context and tensor",
        ),
        ({"ep_size": 0}, "--actor.fsdp.ep_size must be >= 1"),
        ({"offload": "disk"}, "--actor.fsdp.offload must be one of"),
        ({"param_dtype": "float16"}, "--actor.fsdp.param_dtype must be one of"),
    ]:
        with pytest.raises(FSDPConfigError, match=flag):
            FSDPConfig(**options).validate(flag="actor.fsdp")
    lora = LearnerConfig(
        model=ModelConfig(path=str(tiny), lora_rank=4), optimizer=OptimizerConfig(lr=1e-3)
    )
    tp2 = functools.partial(FSDPBackend, fsdp=FSDPConfig(tp_size=2))
    with pytest.raises(FSDPConfigError, match="--fsdp.tp_size with model.lora_rank"):
        group.build(lora, backend=tp2)
    with pytest.raises(FSDPConfigError, match="--fsdp.tp_size with model.chunked_lm_head"):
        group.build(config(tiny, chunked=True), backend=tp2)


def test_ema_of_the_shards_follows_the_weights_and_survives_a_checkpoint(
    group, tiny, tokenizer, tmp_path
) -> None:
    cfg = LearnerConfig(
        model=ModelConfig(path=str(tiny)),
        optimizer=OptimizerConfig(lr=1e-2, grad_clip=0.0, ema_decay=0.5),
    )
    group.build(cfg, backend=MOLT)
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
    # Reading the EMA left the live weights as they were.
    assert all(torch.equal(full_state(group)[k], w[2][k]) for k in w[2])
    group.build(cfg, backend=MOLT)
    group.load(path)
    restored = group.run(lambda backend: backend.state_dict_on_rank0(ema=True))[0]
    assert all(torch.equal(restored[k], ema[k]) for k in ema)
    group.export_hf(str(tmp_path / "ema"), ema=True)
    exported = Qwen2ForCausalLM.from_pretrained(tmp_path / "ema", dtype=torch.float32)
    assert torch.equal(exported.model.norm.weight.detach(), ema["model.norm.weight"])


@pytest.mark.parametrize("kind", ["rm", "dpo"])
def test_preference_steps_equal_deepspeed(group, tiny, tokenizer, kind) -> None:
    """A reward-model step and a DPO step (pairs kept in one micro-batch, one rank padding)
    on FSDP2 equal DeepSpeed ZeRO-2's on the same split: loss, gradient norm, parameters."""
    rows = [
        preference_row(
            {"prompt": f"what is {i} plus 1?", "chosen": "the answer is yes", "rejected": "no"},
            i,
            tokenizer,
        )
        for i in range(6)
    ]
    chosen, rejected = [c for c, _ in rows], [r for _, r in rows]
    batch = collate(
        [r.input_ids for r in chosen + rejected],
        pad_token_id=tokenizer.pad_token_id,
        per_token={"loss_mask": [r.loss_mask for r in chosen + rejected]},
    )
    if kind == "dpo":
        reference = Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
        with torch.no_grad():
            batch.fields["ref_logps"] = sequence_logps(reference, batch)
        objective, cfg = DPOObjective(normalizer=6.0, beta=0.1), config(tiny)
    else:
        objective, cfg = RewardModelObjective(normalizer=6.0), config(tiny, kind="scalar")
    results, states = {}, {}
    for name, backend in (("molt", MOLT), ("deepspeed", ZERO2)):
        group.build(cfg, backend=backend)
        results[name] = group.train_step(batch, objective, max_rows=12)
        states[name] = full_state(group)
    assert results["molt"]["loss"] == pytest.approx(results["deepspeed"]["loss"], rel=1e-5)
    assert results["molt"]["grad_norm"] == pytest.approx(
        results["deepspeed"]["grad_norm"], rel=1e-4
    )
    for name, tensor in states["deepspeed"].items():
        torch.testing.assert_close(states["molt"][name], tensor, rtol=0, atol=2e-6)


def test_a_two_rank_checkpoint_resumes_on_one_rank(group, tiny, tokenizer, tmp_path) -> None:
    """DCP reshards on load: the step after a 2-rank checkpoint, taken by 1 rank, equals the
    2-rank run's (the same global batch; only the summation order differs)."""
    batch = sft_batch(tokenizer)
    objective = SFTObjective(normalizer=float(batch["loss_mask"].sum()))
    group.build(config(tiny), backend=MOLT)
    group.train_step(batch, objective, max_rows=3)
    path = group.save(str(tmp_path), 1, client_state={"step": 1})
    expected = group.train_step(batch, objective, max_rows=3)
    expected_state = full_state(group)
    single = LearnerGroup(num_ranks=1)
    try:
        single.build(config(tiny), backend=MOLT)
        assert single.load(path) == {"step": 1}
        got = single.train_step(batch, objective, max_rows=3)
        state = full_state(single)
    finally:
        single.shutdown()
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
    assert got["lr"] == expected["lr"]
    for name, tensor in expected_state.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=2e-6)


def test_lora_trains_adapters_only_like_deepspeed_and_exports_merged(
    group, tiny, tokenizer, tmp_path
) -> None:
    """LoRA on FSDP2: three steps equal DeepSpeed ZeRO-2's (losses, gradient norms, merged
    weights), only adapters change, and the merged export computes the sharded model's
    logits."""
    cfg = LearnerConfig(
        model=ModelConfig(path=str(tiny), lora_rank=4, lora_alpha=8),
        optimizer=OptimizerConfig(lr=1e-2, grad_clip=0.0),
    )
    batch = sft_batch(tokenizer)
    objective = SFTObjective(normalizer=float(batch["loss_mask"].sum()))

    def raw(backend):
        return {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in backend.module.named_parameters()
        }

    results, merged = {}, {}
    for name, backend in (("deepspeed", ZERO2), ("molt", MOLT)):
        fp = group.build(cfg, backend=backend)
        assert any(".lora_A." in n for n in fp)
        before = group.run(raw)[0]
        results[name] = [group.train_step(batch, objective, max_rows=3) for _ in range(3)]
        after = group.run(raw)[0]
        changed = {n for n in before if not torch.equal(before[n], after[n])}
        assert changed and all(".lora_" in n for n in changed), name  # the base stays frozen
        merged[name] = full_state(group)
    for a, b in zip(results["molt"], results["deepspeed"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert results["molt"][-1]["loss"] < results["molt"][0]["loss"]
    original = Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32).state_dict()
    assert merged["molt"].keys() == set(original) - {"lm_head.weight"}
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged["molt"][q], original[q])  # the adapters are merged in
    for name, tensor in merged["deepspeed"].items():
        torch.testing.assert_close(merged["molt"][name], tensor, rtol=0, atol=2e-6)
    group.export_hf(str(tmp_path / "merged"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    ours = group.forward(
        batch, lambda m, b: m(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
    )
    with torch.no_grad():
        theirs = exported.eval()(batch.input_ids, attention_mask=batch.attention_mask).logits
    for rows, logits in ours:
        torch.testing.assert_close(logits, theirs[rows, : logits.shape[1]], rtol=1e-4, atol=1e-4)


def test_compiled_layers_take_the_eager_step(group, tiny, tokenizer) -> None:
    """``compile``: each decoder layer's forward through torch.compile (two micro-batch
    shapes: a recompile). Two AdamW steps with eps 1 (an update is lr * g / (|g| + 1), so a
    gradient off by d moves a weight by at most lr * d) equal the eager run: losses to 1e-5,
    weights to lr * 1e-5; the parameter names stay those of the model."""
    batch = sft_batch(tokenizer)
    objective = SFTObjective(normalizer=float(batch["loss_mask"].sum()))
    cfg = config(tiny, lr=0.1, eps=1.0)
    runs = {}
    for compiled in (False, True):
        group.build(cfg, backend=functools.partial(FSDPBackend, fsdp=FSDPConfig(compile=compiled)))
        losses = [group.train_step(batch, objective, max_rows=4)["loss"] for _ in range(2)]
        runs[compiled] = (losses, full_state(group), group.run(lambda b: b.fingerprint())[0])
    graphs = group.run(lambda _b: torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert all(n > 0 for n in graphs), graphs  # dynamo did compile on every rank
    assert runs[True][2] == runs[False][2]
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-5)
    for name, tensor in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][name], tensor, rtol=0, atol=0.1 * 1e-5)
