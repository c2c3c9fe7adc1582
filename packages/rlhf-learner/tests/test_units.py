"""Backend-neutral parts: schedule, parameter groups, batching, data rows, checkpoint layout,
and the objectives against rlhf.algos on a real model in one process."""

import json
import math
import pathlib

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rlhf.algos import AlgoConfig, KLConfig, loss_normalizer, policy_loss
from rlhf.learner import (
    CheckpointError,
    DataError,
    ModelConfig,
    ModelLoadError,
    OptimizerConfig,
    PPOActorObjective,
    SFTObjective,
    collate,
    latest_checkpoint,
    load_model,
    lr_lambda,
    micro_batches,
    param_groups,
    preference_row,
    sft_row,
    shard,
    staging_dir,
    token_logprobs,
)
from rlhf.learner import checkpoint as ckpt


def test_schedule_by_hand() -> None:
    f = lr_lambda(OptimizerConfig(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1))
    # Warmup: (s + 1) / 4; then cosine from 1 to 0.1 over 10 steps: p = (s − 4) / 10.
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # 0.55
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    lin = lr_lambda(OptimizerConfig(lr=1.0, schedule="linear", total_steps=10, min_lr_ratio=0.0))
    assert lin(5) == pytest.approx(0.5)
    assert lr_lambda(OptimizerConfig(lr=1.0, schedule="constant"))(500) == 1.0
    with pytest.raises(ValueError, match="optimizer.schedule"):
        OptimizerConfig(schedule="step")


def test_a_4bit_base_trains_only_through_lora_adapters() -> None:
    """A trained role on a frozen 4-bit base has nothing to train without LoRA; an eval-only
    role (a served reward model, a reference) computes on the 4-bit weights as they are."""
    from rlhf.learner import LearnerConfig, ModelConfig

    four_bit = ModelConfig(path="m", load_in_4bit=True)
    with pytest.raises(ValueError, match=r"set model.lora_rank > 0 too"):
        LearnerConfig(model=four_bit)
    assert LearnerConfig(model=four_bit, optimizer=None).optimizer is None
    qlora = ModelConfig(path="m", load_in_4bit=True, lora_rank=4)
    assert LearnerConfig(model=qlora).model.lora_rank == 4


def test_warmup_ratio_by_hand() -> None:
    # ceil(0.03 · 100) = 3 warmup steps: (s + 1) / 3; then cosine over 97 steps to 0.1.
    f = lr_lambda(OptimizerConfig(lr=1.0, warmup_ratio=0.03, total_steps=100, min_lr_ratio=0.1))
    assert [f(s) for s in range(3)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert f(3) == 1.0 and f(100) == pytest.approx(0.1)
    # ceil(0.25 · 10) = 3, not round(2.5) = 2.
    assert lr_lambda(OptimizerConfig(lr=1.0, warmup_ratio=0.25, total_steps=10))(1) == 2 / 3
    with pytest.raises(ValueError, match="give one"):
        OptimizerConfig(warmup_steps=2, warmup_ratio=0.1)
    with pytest.raises(ValueError, match="warmup_ratio"):
        OptimizerConfig(warmup_ratio=1.5)


def test_no_weight_decay_on_biases_and_norms(tiny) -> None:
    model = load_model(ModelConfig(path=str(tiny)))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(names[id(p)].endswith("weight") for p in decay["params"])
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert "model.norm.weight" in skipped and "model.layers.0.self_attn.q_proj.bias" in skipped
    assert "model.layers.0.mlp.up_proj.weight" not in skipped


def test_collate_micro_batches_and_shard() -> None:
    batch = collate(
        [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11]],
        pad_token_id=0,
        per_token={"action_mask": [[0, 1, 1], [0, 1], [0, 0, 1, 1, 1], [0]]},
        per_sequence={"score": [1, 0, 1, 0]},
    )
    assert batch.input_ids.tolist()[1] == [4, 5, 0, 0, 0]
    assert batch.attention_mask.sum(dim=1).tolist() == [3, 2, 5, 1]
    # Padded size = longest row x rows: [3,2] → 6; adding 5 → 15 > 8: new group; 5 then 1 → 10.
    assert micro_batches(batch, max_tokens=8) == [[0, 1], [2], [3]]
    assert micro_batches(batch, max_rows=3) == [[0, 1, 2], [3]]
    assert shard([[0, 1], [2], [3]], 2) == [[[0, 1], [3]], [[2]]]
    part = batch.select([1, 3])
    assert part.input_ids.tolist() == [[4, 5], [11, 0]]
    assert part["action_mask"].tolist() == [[0, 1], [0, 0]] and part["score"].tolist() == [0, 0]
    with pytest.raises(KeyError, match="needs batch field 'advantages'"):
        part["advantages"]
    with pytest.raises(ValueError, match=r"per_token\['m'\] row 0 has 2 values for 3 tokens"):
        collate([[1, 2, 3]], pad_token_id=0, per_token={"m": [[1, 1]]})


def test_objectives_read_typed_views_whose_names_are_field_names() -> None:
    """Every objective reads its batch through a fields dataclass: each attribute is a
    `FieldName`, the required ones are exactly what its ``fields()`` declares (they cannot
    drift apart), and a view gives the batch's tensors themselves, None for absent optional
    ones."""
    import dataclasses
    import typing

    from rlhf.learner import (
        ActorFields,
        CriticFields,
        CriticObjective,
        DPOFields,
        DPOObjective,
        FieldName,
        LossMaskFields,
        MissingFieldsError,
        RewardModelFields,
        RewardModelObjective,
        required_fields,
        view,
    )
    from rlhf.learner.batch import field_names

    known = set(typing.get_args(FieldName))
    algo = AlgoConfig()
    pairs = [
        (ActorFields, PPOActorObjective(algo=algo, normalizer=1.0)),
        (CriticFields, CriticObjective(algo=algo, normalizer=1.0)),
        (LossMaskFields, SFTObjective(normalizer=1.0)),
        (RewardModelFields, RewardModelObjective(normalizer=1.0)),
        (DPOFields, DPOObjective(normalizer=1.0)),
    ]
    for fields, objective in pairs:
        assert field_names(fields) <= known
        assert objective.fields() == required_fields(fields), fields
    assert required_fields(ActorFields) == {"action_mask", "advantages"}
    assert required_fields(RewardModelFields) == frozenset()

    batch = collate(
        [[1, 2, 3], [4, 5]],
        pad_token_id=0,
        per_token={"action_mask": [[0, 1, 1], [0, 1]], "advantages": [[0, 1, 1], [0, 2]]},
    )
    actor = view(batch, ActorFields)
    assert actor.action_mask is batch.fields["action_mask"]
    assert actor.advantages is batch.fields["advantages"]
    assert actor.old_logprobs is None and actor.ref_logprobs is None
    with pytest.raises(
        MissingFieldsError, match=r"ActorFields needs batch fields \['ref_logprobs'\]"
    ):
        view(batch, ActorFields, need=frozenset({"ref_logprobs"}))
    with pytest.raises(
        MissingFieldsError, match=r"CriticFields needs batch fields \['old_values', 'returns'\]"
    ):
        view(batch, CriticFields)

    @dataclasses.dataclass(frozen=True)
    class Misspelt:
        advantage: torch.Tensor

    with pytest.raises(
        TypeError, match=r"Misspelt: attributes that are no FieldName: \['advantage'\]"
    ):
        field_names(Misspelt)


def test_a_missing_field_stops_the_step_in_the_calling_process() -> None:
    """An objective's declared fields are checked before anything reaches a rank: the role
    here is not even built, so only the check can answer."""
    from rlhf.learner import (
        CriticObjective,
        DPOObjective,
        InProcessRole,
        MissingFieldsError,
        PPOActorObjective,
        check_fields,
    )

    batch = collate(
        [[1, 2, 3], [4, 5]],
        pad_token_id=0,
        per_token={"action_mask": [[0, 1, 1], [0, 1]], "advantages": [[0, 1, 1], [0, 2]]},
    )
    kl = AlgoConfig(kl=KLConfig(use_loss=True, init_coef=0.1))
    role = InProcessRole()
    with pytest.raises(
        MissingFieldsError,
        match=r"PPOActorObjective reads batch fields "
        r"\['ref_logprobs'\], and the batch has \['action_mask', 'advantages'\]",
    ):
        role.train_step(batch, PPOActorObjective(algo=kl, normalizer=1.0, kl_coef=0.1))
    # β = 0: no KL term, nothing missing; the unbuilt role answers instead.
    with pytest.raises(RuntimeError, match="build"):
        role.train_step(batch, PPOActorObjective(algo=kl, normalizer=1.0, kl_coef=0.0))
    with pytest.raises(MissingFieldsError, match=r"\['old_values', 'returns'\]"):
        check_fields(batch, CriticObjective(algo=kl, normalizer=1.0))
    with pytest.raises(MissingFieldsError, match=r"\['loss_mask', 'ref_logps'\]"):
        check_fields(batch, DPOObjective(normalizer=1.0))
    check_fields(batch, lambda model, b: (model, b))  # declares nothing: not checked


def test_sft_rows_mask_the_response_and_name_bad_rows(tokenizer) -> None:
    row = sft_row({"q": "what is 1 plus 2?", "a": "3"}, 0, tokenizer, input_key="q", output_key="a")
    assert len(row.input_ids) == len(row.loss_mask)
    learned = [t for t, m in zip(row.input_ids, row.loss_mask, strict=True) if m]
    # The response and the end-of-turn token, nothing of the prompt.
    assert tokenizer.decode(learned) == "3<|im_end|>\n"
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": "what is 1 plus 2?"}, {"role": "assistant", "content": "3"}],
        tokenize=False,
    )
    assert tokenizer.decode(row.input_ids) == full
    with pytest.raises(DataError, match=r"row 7 has no 'a'"):
        sft_row({"q": "x"}, 7, tokenizer, input_key="q", output_key="a")
    pre = sft_row({"text": "the answer is yes"}, 0, tokenizer, input_key="text", pretrain=True)
    assert all(pre.loss_mask)


def test_multi_turn_rows_learn_every_assistant_turn(tokenizer) -> None:
    messages = [
        {"role": "user", "content": "what is 1 plus 1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "and 2 plus 2?"},
        {"role": "assistant", "content": "4"},
    ]
    row = sft_row({"messages": messages}, 0, tokenizer, messages_key="messages")
    assert tokenizer.decode(row.input_ids) == tokenizer.apply_chat_template(
        messages, tokenize=False
    )
    spans, current = [], []
    for t, m in zip(row.input_ids, row.loss_mask, strict=True):
        if m:
            current.append(t)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    spans += [tokenizer.decode(current)] if current else []
    assert spans == ["2<|im_end|>\n", "4<|im_end|>\n"]
    with pytest.raises(DataError, match=r"row 3: message 0 of 'messages' needs 'role'"):
        sft_row({"messages": [{"content": "x"}]}, 3, tokenizer, messages_key="messages")


def test_preference_rows(tokenizer) -> None:
    chosen, rejected = preference_row(
        {"prompt": "what is 1 plus 1?", "chosen": "2", "rejected": "3"}, 0, tokenizer
    )
    assert chosen.loss_mask.index(1) == rejected.loss_mask.index(1)  # same prompt
    with pytest.raises(DataError, match=r"row 2 has no 'rejected'"):
        preference_row({"prompt": "p", "chosen": "c"}, 2, tokenizer)


def test_checkpoint_layout_finalize_rotate_and_refuse(tmp_path) -> None:
    fp = {"w": [2, 3]}
    for step in (1, 2, 3):
        staging_dir(tmp_path, step).mkdir()
        ckpt.finalize(tmp_path, step, fingerprint=fp, client_state={"step": step}, keep=2)
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == [
        "step-00000002",
        "step-00000003",
    ]
    assert ckpt.validate(latest_checkpoint(tmp_path), fp) == {"step": 3}
    staging_dir(tmp_path, 4).mkdir()  # a save that was killed
    assert latest_checkpoint(tmp_path).name == "step-00000003"
    with pytest.raises(
        CheckpointError, match=r"incomplete .* the latest complete one is .*step-00000003"
    ):
        ckpt.validate(staging_dir(tmp_path, 4), fp)
    with pytest.raises(
        CheckpointError,
        match=r"another model .*parameters it lacks: \['v'\].*different shapes: \['w'\]",
    ):
        ckpt.validate(latest_checkpoint(tmp_path), {"w": [3, 3], "v": [1]})
    with pytest.raises(CheckpointError, match="does not exist"):
        ckpt.validate(tmp_path / "nope", fp)


def test_a_checkpoint_damaged_after_writing_is_named_and_skipped(tmp_path) -> None:
    import zlib

    fp = {"w": [2, 3]}
    for step in (1, 2):
        staging = staging_dir(tmp_path, step)
        (staging / "backend").mkdir(parents=True)
        (staging / "backend" / "shard.bin").write_bytes(bytes(range(256)) * step)
        ckpt.finalize(tmp_path, step, fingerprint=fp, client_state={"step": step}, keep=None)
    newest = latest_checkpoint(tmp_path)
    marker = json.loads((newest / "COMPLETE").read_text())
    data = bytes(range(256)) * 2
    assert marker["files"]["backend/shard.bin"] == [len(data), zlib.crc32(data)]
    assert set(marker["files"]) == {"backend/shard.bin", "model.json", "trainer_state.json"}
    assert ckpt.verify_checkpoint(newest) == []
    shard = newest / "backend" / "shard.bin"
    shard.write_bytes(data[:-1] + b"\x00")  # same size, one byte changed
    assert ckpt.verify_checkpoint(newest) == [
        "backend/shard.bin differs from what was written (CRC-32)"
    ]
    shard.write_bytes(data[:100])
    assert ckpt.verify_checkpoint(newest) == [
        f"backend/shard.bin has 100 bytes, {len(data)} were written"
    ]
    intact, damaged = ckpt.latest_intact_checkpoint(tmp_path)
    assert intact == ckpt.final_dir(tmp_path, 1) and [d for d, _ in damaged] == [newest]
    with pytest.raises(
        CheckpointError,
        match=r"step-00000002 is damaged .*shard.bin has 100 bytes.*intact one is .*step-00000001",
    ):
        ckpt.validate(newest, fp)
    shard.unlink()
    assert ckpt.verify_checkpoint(newest) == ["backend/shard.bin is missing"]
    # A checkpoint from before manifests (a marker with the step only) is not checked.
    (newest / "COMPLETE").write_text(json.dumps({"step": 2}))
    assert ckpt.verify_checkpoint(newest) == []
    # A marker edited by hand names the entry, not a TypeError.
    (newest / "COMPLETE").write_text(json.dumps({"step": 2, "files": {"model.json": "big"}}))
    assert ckpt.verify_checkpoint(newest) == [
        "COMPLETE's entry for model.json is 'big', not [size, CRC-32]"
    ]
    (newest / "COMPLETE").write_text(json.dumps({"step": 2, "files": ["model.json"]}))
    assert ckpt.verify_checkpoint(newest) == [
        "COMPLETE's manifest is a list, not an object of files"
    ]
    # The files a resume reads: unreadable or of the wrong shape, each is named.
    (newest / "COMPLETE").write_text(json.dumps({"step": 2}))
    (newest / "model.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"model\.json holds a JSON list"):
        ckpt.validate(newest, fp)
    (newest / "model.json").write_text(json.dumps(fp))
    (newest / "trainer_state.json").write_text('{"step": ')
    with pytest.raises(CheckpointError, match=r"trainer_state\.json does not read"):
        ckpt.validate(newest, fp)


def test_rank_state_is_safetensors_and_json_restored_exactly(tmp_path) -> None:
    """RNG states and EMA weights are written as safetensors (Python's RNG as JSON in the
    header) and read back without unpickling: the draws after a restore repeat the draws after
    the save, and a pickle put in their place is refused, not run."""
    import random

    from rlhf.learner.rank import load_ema, save_ema

    random.seed(7)
    torch.manual_seed(7)
    random.random()  # leave the generators mid-stream
    ckpt.write_rank_rng(tmp_path, 1)
    after = (random.random(), random.getrandbits(64), torch.rand(3))
    random.seed(0)
    torch.manual_seed(0)
    ckpt.restore_rank_rng(tmp_path, 1)
    again = (random.random(), random.getrandbits(64), torch.rand(3))
    assert after[:2] == again[:2] and torch.equal(after[2], again[2])
    raw = (tmp_path / "rng" / "rank-1.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert json.loads(header["__metadata__"]["json"])["python"][0] == 3  # plain JSON

    ema = {"w": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.float32)}
    save_ema(str(tmp_path), 0, ema)
    loaded = load_ema(str(tmp_path), 0)
    assert loaded.keys() == ema.keys() and all(torch.equal(loaded[k], ema[k]) for k in ema)
    assert not list(tmp_path.rglob("*.pt"))

    marker = tmp_path / "ran"
    torch.save({"x": _RunsOnLoad(str(marker))}, tmp_path / "rng" / "rank-1.safetensors")
    with pytest.raises(CheckpointError, match=r"rank-1\.safetensors \(the RNG state of rank 1\)"):
        ckpt.restore_rank_rng(tmp_path, 1)
    with pytest.raises(CheckpointError, match=r"written with 2 ranks; resume with that many"):
        ckpt.restore_rank_rng(tmp_path, 2)
    assert not marker.exists()


class _RunsOnLoad:
    """Unpickling it would create ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def test_missing_model_path_is_named(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match=r"model path '.*nope' does not exist"):
        load_model(ModelConfig(path=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model(ModelConfig(path=str(tmp_path / "empty")))


def _rl_batch(model, *, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows, masks = [], []
    for n_prompt, n_resp in [(3, 4), (5, 2), (2, 6), (4, 3), (3, 1), (6, 5)]:
        rows.append(torch.randint(3, 200, (n_prompt + n_resp,), generator=gen).tolist())
        masks.append([0] * n_prompt + [1] * n_resp)
    batch = collate(rows, pad_token_id=0, per_token={"action_mask": masks})
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
    m = batch["action_mask"]
    noise = lambda s: torch.randn(lp.shape, generator=gen) * s * m  # noqa: E731
    batch.fields["old_logprobs"] = lp + noise(0.3)
    batch.fields["ref_logprobs"] = lp + noise(0.2)
    batch.fields["advantages"] = noise(1.0)
    return batch


def test_ppo_objective_equals_rlhf_algos_on_the_full_batch(tiny) -> None:
    model = Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    batch = _rl_batch(model, seed=1)
    algo = AlgoConfig(kl=KLConfig(use_loss=True, estimator="k3"), entropy_coef=0.01)
    m = batch["action_mask"]
    norm = float(loss_normalizer(m, mode="token-mean"))
    objective = PPOActorObjective(algo=algo, normalizer=norm, kl_coef=0.1)
    loss, metrics = objective(model, batch)
    # The same from the pieces: token-mean of the clipped surrogate + 0.1·k3 − 0.01·entropy.
    lp, ent = token_logprobs(model, batch.input_ids, batch.attention_mask, with_entropy=True)
    pg, _ = policy_loss(
        logprobs=lp, old_logprobs=batch["old_logprobs"], advantages=batch["advantages"],
        action_mask=m, config=algo.policy_loss,
    )  # fmt: skip
    x = (lp - batch["ref_logprobs"]) * m
    k3 = ((torch.exp(-x) - 1 + x) * m).sum() / m.sum()
    expected = pg + 0.1 * k3 - 0.01 * (ent * m).sum() / m.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    # Splitting rows into micro-batches with the global normaliser gives the same total.
    parts = [batch.select(r) for r in ([0, 1], [2], [3, 4, 5])]
    assert sum(objective(model, p)[0].item() for p in parts) == pytest.approx(loss.item(), rel=1e-6)
    assert metrics["actor/entropy"] > 0


def test_kl_loss_with_a_zero_coefficient_needs_no_reference(tiny) -> None:
    """β = 0 disables the KL term (``--algo.kl.init_coef 0`` on a KL-loss preset such as
    grpo): a run without it builds no reference, so its batches carry no ``ref_logprobs`` and
    the loss is the policy loss alone; with β > 0 a missing reference is still named."""
    model = Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    batch = _rl_batch(model, seed=2)
    m = batch["action_mask"]
    norm = float(loss_normalizer(m, mode="token-mean"))
    del batch.fields["ref_logprobs"]
    kl_loss = AlgoConfig(kl=KLConfig(use_loss=True, init_coef=0.0))
    loss, metrics = PPOActorObjective(algo=kl_loss, normalizer=norm, kl_coef=0.0)(model, batch)
    lp = token_logprobs(model, batch.input_ids, batch.attention_mask)[0]
    pg, _ = policy_loss(
        logprobs=lp, old_logprobs=batch["old_logprobs"], advantages=batch["advantages"],
        action_mask=m, config=kl_loss.policy_loss,
    )  # fmt: skip
    assert loss.item() == pytest.approx(pg.item(), rel=1e-6)
    assert "actor/kl_loss" not in metrics
    with pytest.raises(KeyError, match="ref_logprobs"):
        PPOActorObjective(algo=kl_loss, normalizer=norm, kl_coef=0.1)(model, batch)


def test_micro_batches_without_actions_report_no_metrics_and_maxima_stay_maxima(tiny) -> None:
    """A micro-batch whose rows were all filtered out (action mask all 0) still contributes its
    (zero) loss but no metrics; `train_passes` averages the others over the micro-batches that
    report them and keeps ``*_max`` metrics as maxima."""
    from rlhf.learner.rank import combine_metric, train_passes

    model = Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    batch = _rl_batch(model, seed=1)
    m = batch["action_mask"]
    objective = PPOActorObjective(
        algo=AlgoConfig(), normalizer=float(loss_normalizer(m, mode="token-mean"))
    )
    filtered = batch.select([0, 1])
    filtered.fields["action_mask"] = torch.zeros_like(filtered["action_mask"])
    loss, metrics = objective(model, filtered)
    assert metrics == {} and loss.item() == 0.0
    parts = [batch.select([2]), filtered, batch.select([3, 4, 5])]
    each = [objective(model, p)[1] for p in parts]
    out = train_passes(
        parts, objective, runner=model, passes=3, weights=None, placed=lambda b: b,
        backward=lambda loss, w: None,
    )  # fmt: skip
    real = [e for e in each if e]
    assert len(real) == 2
    for key in real[0]:
        values = [float(e[key]) for e in real]
        want = max(values) if key.endswith("_max") else sum(values) / 2
        assert out[key] == pytest.approx(want, rel=1e-6), key
    assert combine_metric("actor/x_max", [0.1, 0.3]) == 0.3
    assert combine_metric("actor/x", [0.1, 0.3]) == pytest.approx(0.2)


def test_sft_objective_is_token_mean_nll(tiny, tokenizer) -> None:
    model = Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    rows = [
        sft_row({"input": f"what is {i} plus 1?", "output": str(i + 1)}, i, tokenizer)
        for i in range(3)
    ]
    batch = collate(
        [r.input_ids for r in rows], pad_token_id=0,
        per_token={"loss_mask": [r.loss_mask for r in rows]},
    )  # fmt: skip
    mask = batch["loss_mask"]
    loss, _ = SFTObjective(normalizer=float(mask.sum()))(model, batch)
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), batch.input_ids[:, 1:], reduction="none"
    )
    expected = (nll * mask[:, 1:]).sum() / mask.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
