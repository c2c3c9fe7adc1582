"""Loss aggregation: hand cases per mode and exactness under data-parallel/accumulation splits."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.algos import AGGREGATIONS, aggregate_loss, loss_normalizer

F64 = torch.float64
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
LOSS = torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=F64)


def test_registry_is_the_documented_set() -> None:
    assert AGGREGATIONS.names() == sorted(MODES)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 15 / 5),
        ("seq-mean-token-mean", (3 / 2 + 12 / 3) / 2),
        ("seq-mean-token-sum", (3 + 12) / 2),
        ("seq-mean-token-sum-norm", 15 / (2 * 4)),  # L_max = 4
    ],
)
def test_hand_cases(mode: str, expected: float) -> None:
    out = aggregate_loss(LOSS, MASK, mode=mode, max_len=4)
    assert out.item() == pytest.approx(expected, abs=1e-12)


def test_masked_nan_does_not_leak() -> None:
    loss = LOSS.clone()
    loss[0, 2] = float("nan")
    for mode in MODES:
        assert torch.isfinite(aggregate_loss(loss, MASK, mode=mode, max_len=4)), mode


def test_empty_sequences_do_not_count_as_sequences() -> None:
    # A third, fully masked row: seq means still average over the two non-empty rows;
    # sum-norm divides by all rows (a constant B·L_max).
    loss = torch.cat([LOSS, torch.full((1, 3), 7.0, dtype=F64)])
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=F64)])
    assert aggregate_loss(loss, mask, mode="seq-mean-token-mean").item() == pytest.approx(2.75)
    assert aggregate_loss(
        loss, mask, mode="seq-mean-token-sum-norm", max_len=4
    ).item() == pytest.approx(15 / 12)


@pytest.mark.parametrize("mode", MODES)
def test_all_masked_is_zero_with_zero_gradient(mode: str) -> None:
    loss = torch.randn(2, 3, dtype=F64, requires_grad=True)
    out = aggregate_loss(loss, torch.zeros(2, 3), mode=mode, max_len=3)
    out.backward()
    assert out.item() == 0.0
    assert (loss.grad == 0).all()


def test_sum_norm_requires_a_constant_max_len() -> None:
    with pytest.raises(ValueError, match="max_len .* is required by 'seq-mean-token-sum-norm'"):
        aggregate_loss(LOSS, MASK, mode="seq-mean-token-sum-norm")


def test_bad_inputs() -> None:
    with pytest.raises(
        ValueError, match="unknown loss aggregation 'sum'; choose one of: seq-mean-token-mean"
    ):
        aggregate_loss(LOSS, MASK, mode="sum")
    with pytest.raises(ValueError, match="mask has shape \\(2, 2\\) but must match loss"):
        aggregate_loss(LOSS, MASK[:, :2], mode="token-mean")
    with pytest.raises(ValueError, match="loss must have 2 dimensions"):
        aggregate_loss(LOSS[0], MASK[0], mode="token-mean")
    with pytest.raises(ValueError, match="normalizer must be a finite non-negative count"):
        aggregate_loss(LOSS, MASK, mode="token-mean", normalizer=-1.0)


@settings(max_examples=80, deadline=None)
@given(
    mode=st.sampled_from(MODES),
    lengths=st.lists(st.integers(0, 7), min_size=1, max_size=10),
    cuts=st.lists(st.integers(1, 9), max_size=4),
    seed=st.integers(0, 2**31 - 1),
)
def test_split_into_micro_batches_adds_up_to_the_full_batch(mode, lengths, cuts, seed) -> None:
    """Ranks/micro-batches with different token counts and padding widths sum to the full value."""
    gen = torch.Generator().manual_seed(seed)
    width, b, max_len = max(max(lengths), 1), len(lengths), 8
    mask = (torch.arange(width).expand(b, width) < torch.tensor(lengths).unsqueeze(1)).to(F64)
    loss = torch.randn(b, width, generator=gen, dtype=F64)
    full = aggregate_loss(loss, mask, mode=mode, max_len=max_len)

    bounds = sorted({c for c in cuts if c < b})
    pieces = list(zip([0, *bounds], [*bounds, b], strict=True))
    # Each micro-batch is trimmed to its own longest row, as a packing learner would.
    micro = []
    for lo, hi in pieces:
        w = max(1, max(lengths[lo:hi]))
        micro.append((loss[lo:hi, :w], mask[lo:hi, :w]))
    global_norm = sum(loss_normalizer(m, mode=mode, max_len=max_len) for _, m in micro)
    total = sum(
        aggregate_loss(lo, m, mode=mode, normalizer=global_norm, max_len=max_len) for lo, m in micro
    )
    torch.testing.assert_close(total, full, atol=1e-12, rtol=1e-12)


@settings(max_examples=40, deadline=None)
@given(mode=st.sampled_from(MODES), extra=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_padding_columns_do_not_change_the_result(mode, extra, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    padded_loss = torch.cat([LOSS, 1e9 * torch.randn(2, extra, generator=gen, dtype=F64)], dim=1)
    padded_mask = torch.cat([MASK, torch.zeros(2, extra, dtype=F64)], dim=1)
    torch.testing.assert_close(
        aggregate_loss(padded_loss, padded_mask, mode=mode, max_len=4),
        aggregate_loss(LOSS, MASK, mode=mode, max_len=4),
    )


def test_half_precision_sums_and_counts_stay_exact() -> None:
    # 70 000 valid float16 tokens: the count overflows float16 (max 65504) if kept there.
    loss = torch.full((7, 10000), 0.5, dtype=torch.float16)
    mask = torch.ones(7, 10000)
    assert aggregate_loss(loss, mask, mode="token-mean").item() == pytest.approx(0.5)
    # A global normaliser beyond float16's range: this micro-batch's share is 35000/100000.
    assert aggregate_loss(
        loss, mask, mode="token-mean", normalizer=100000.0
    ).item() == pytest.approx(0.35)
    # 1001 tokens: bfloat16 would round the count to 1000.
    m = torch.ones(1, 1001, dtype=torch.bfloat16)
    assert loss_normalizer(m, mode="token-mean").item() == 1001


def test_mask_entries_count_iff_positive() -> None:
    loss = torch.tensor([[1.0, 3.0, 5.0]], dtype=F64)
    assert aggregate_loss(
        loss, torch.tensor([[2, -1, 1]]), mode="token-mean"
    ).item() == pytest.approx(3.0)
