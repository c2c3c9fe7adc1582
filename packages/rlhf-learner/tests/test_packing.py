"""Padding-free packing: the layout of `pack`, token budgets, and every forward and objective
giving the padded batch's values and gradients on a real model in one process."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rlhf.algos import AlgoConfig, KLConfig, loss_normalizer
from rlhf.learner import (
    CriticObjective,
    DPOObjective,
    ModelConfig,
    PPOActorObjective,
    check_packing,
    collate,
    load_model,
    micro_batches,
    pack,
    sequence_scores,
    token_logprobs,
    token_values,
)

from .test_units import _rl_batch


def test_pack_lays_rows_end_to_end_and_unpack_restores_them() -> None:
    batch = collate([[5, 6, 7], [8], [9, 10]], pad_token_id=0)
    packed = pack(batch.input_ids, batch.attention_mask)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert packed.shape == (3, 3)
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    assert packed.unpack(values).tolist() == [[1, 2, 3], [4, 0, 0], [5, 6, 0]]
    # Shifted outputs: a sequence's first token was "predicted" from the previous sequence.
    assert packed.unpack(values, shifted=True).tolist() == [[0, 2, 3], [0, 0, 0], [0, 6, 0]]
    assert packed.unpack(values[..., None].expand(1, 6, 2)).shape == (3, 3, 2)


def test_an_empty_row_packs_to_nothing_and_unpacks_to_zeros() -> None:
    packed = pack(torch.tensor([[4, 5], [0, 0], [6, 0]]), torch.tensor([[1, 1], [0, 0], [1, 0]]))
    assert packed.input_ids.tolist() == [[4, 5, 6]]
    assert packed.position_ids.tolist() == [[0, 1, 0]]
    out = packed.unpack(torch.tensor([[1.0, 2.0, 3.0]]), shifted=True)
    assert out.tolist() == [[0, 2], [0, 0], [0, 0]]


def test_a_batch_without_real_tokens_runs_unpacked(lm) -> None:
    """Nothing to pack (every row empty): the forward still runs, on the padded rows."""
    ids, mask = torch.zeros((2, 3), dtype=torch.long), torch.zeros((2, 3), dtype=torch.long)
    lp, _ = token_logprobs(lm, ids, mask, packing_samples=True)
    torch.testing.assert_close(lp, token_logprobs(lm, ids, mask)[0], rtol=0, atol=0)


def test_packed_token_budgets_count_real_tokens() -> None:
    batch = collate([[1] * 3, [1] * 1, [1] * 4, [1] * 2], pad_token_id=0)
    # Padded: 3·2 = 6 fits, 4·3 = 12 and 4·2 = 8 do not. Packed: 3 + 1, then 4 + 2.
    assert micro_batches(batch, max_tokens=6) == [[0, 1], [2], [3]]
    assert micro_batches(batch, max_tokens=6, packing_samples=True) == [[0, 1], [2, 3]]
    assert micro_batches(batch, max_tokens=10) == [[0, 1], [2, 3]]
    assert micro_batches(batch, max_tokens=10, packing_samples=True) == [[0, 1, 2, 3]]


@pytest.fixture(scope="module")
def lm(tiny) -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32)


def _grads(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6, msg=name)


def test_packed_logprobs_and_entropy_equal_the_padded_ones(lm) -> None:
    batch = _rl_batch(lm, seed=5)
    ids, mask = batch.input_ids, batch.attention_mask
    assert (mask == 0).any()  # the batch has padding to skip
    lp, ent = token_logprobs(lm, ids, mask, temperature=0.7, with_entropy=True)
    plp, pent = token_logprobs(
        lm, ids, mask, temperature=0.7, with_entropy=True, packing_samples=True
    )
    assert pent is not None and ent is not None
    real = mask.bool()
    torch.testing.assert_close(plp[real], lp[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(pent[real], ent[real], rtol=0, atol=1e-5)
    # Padding and every row's first column are 0 in both layouts.
    assert (plp[~real] == 0).all() and (plp[:, 0] == 0).all() and (lp[:, 0] == 0).all()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_packed_ppo_loss_and_gradients_equal_the_padded_ones(lm, mode) -> None:
    """The sequence-mean modes need each sample's own row: packed outputs are unpacked
    before aggregation, so both layouts give one loss and one gradient."""
    batch = _rl_batch(lm, seed=6)
    algo = AlgoConfig(
        kl=KLConfig(use_loss=True, estimator="k3"), entropy_coef=0.01, loss_agg_mode=mode
    )
    norm = float(loss_normalizer(batch["action_mask"], mode=mode))
    objective = PPOActorObjective(algo=algo, normalizer=norm, kl_coef=0.1)
    loss, metrics = objective(lm, batch)
    packed_batch = dataclasses.replace(batch, packing_samples=True)
    ploss, pmetrics = objective(lm, packed_batch)
    assert ploss.item() == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
    assert pmetrics["actor/entropy"].item() == pytest.approx(metrics["actor/entropy"].item(), 1e-5)
    _assert_same_grads(_grads(lm, objective(lm, packed_batch)[0]), _grads(lm, loss))


def test_packed_dpo_loss_equals_the_padded_one(lm, tokenizer) -> None:
    rows = [tokenizer(t)["input_ids"] for t in ["what is 1 plus 2? 3", "yes", "the answer is no"]]
    rows += [tokenizer(t)["input_ids"] for t in ["what is 1 plus 2? 4", "no good", "bad"]]
    masks = [[0] + [1] * (len(r) - 1) for r in rows]
    batch = collate(rows, pad_token_id=0, per_token={"loss_mask": masks})
    batch.fields["ref_logps"] = torch.tensor([-9.0, -3.0, -7.5, -9.5, -4.0, -2.0])
    objective = DPOObjective(normalizer=3.0, beta=0.5, nll_coef=0.2)
    loss, _ = objective(lm, batch)
    ploss, _ = objective(lm, dataclasses.replace(batch, packing_samples=True))
    assert ploss.item() == pytest.approx(loss.item(), rel=1e-5)


def test_packed_values_and_scores_equal_the_padded_ones(lm, tiny) -> None:
    critic = load_model(ModelConfig(path=str(tiny), kind="scalar", init_value_head=False))
    assert critic.score.weight.abs().sum() > 0  # a random head, so values are not all 0
    batch = _rl_batch(lm, seed=7)
    ids, mask = batch.input_ids, batch.attention_mask
    real = mask.bool()
    values = token_values(critic, ids, mask)
    pvalues = token_values(critic, ids, mask, packing_samples=True)
    torch.testing.assert_close(pvalues[real], values[real], rtol=0, atol=1e-5)
    assert (pvalues[:, 0] == 0).all() and (pvalues[~real] == 0).all()
    scores = sequence_scores(critic, ids, mask)
    torch.testing.assert_close(
        sequence_scores(critic, ids, mask, packing_samples=True), scores, rtol=0, atol=1e-5
    )
    m = batch["action_mask"]
    batch.fields["old_values"] = values.detach() + 0.1 * m
    batch.fields["returns"] = torch.linspace(-1, 1, m.numel()).view(m.shape) * m
    algo = AlgoConfig(value_clip=0.2, loss_agg_mode="seq-mean-token-mean")
    objective = CriticObjective(
        algo=algo, normalizer=float(loss_normalizer(m, mode="seq-mean-token-mean"))
    )
    loss, _ = objective(critic, batch)
    ploss, _ = objective(critic, dataclasses.replace(batch, packing_samples=True))
    assert ploss.item() == pytest.approx(loss.item(), rel=1e-5)
    packed_grads = _grads(
        critic, objective(critic, dataclasses.replace(batch, packing_samples=True))[0]
    )
    _assert_same_grads(packed_grads, _grads(critic, objective(critic, batch)[0]))


class _DropsPositions(torch.nn.Module):
    """The model as an implementation that ignores position ids would run it."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *, input_ids, position_ids=None, **kwargs):
        return self.model(input_ids=input_ids, **kwargs)


def test_check_packing_passes_a_real_model_and_names_the_flag_otherwise(lm) -> None:
    check_packing(lm, device="cpu", flag="--actor.model.packing_samples")
    with pytest.raises(ValueError, match=r"--actor.model.packing_samples: this model's attention"):
        check_packing(_DropsPositions(lm), device="cpu", flag="--actor.model.packing_samples")
