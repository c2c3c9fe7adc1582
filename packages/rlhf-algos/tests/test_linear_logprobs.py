"""Log-probs/entropy from hidden states and the output projection: equal in value and gradient
(to h, W and b) to autograd through the materialised logits, never holding those logits."""

import pytest
import torch

from rlhf.algos import linear_logprobs_and_entropy, logprobs_and_entropy

from .test_logprobs import _LargestAllocation


@pytest.fixture(params=["eager", "fused"])
def path(request, monkeypatch):
    """The eager chunk functions, or the functional ones CUDA compiles (uncompiled here)."""
    if request.param == "fused":
        from rlhf.algos import logprobs as module

        kernels = (module._fused_forward_chunk, module._fused_backward_chunk)
        monkeypatch.setattr(module, "_fused_kernels", lambda device: kernels)
    return request.param


def problem(*, n=23, h=8, v=41, dtype=torch.float64, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).to(dtype)
    weight = (torch.randn(v, h, generator=gen) / 2).to(dtype)
    b = torch.randn(v, generator=gen).to(dtype) if bias else None
    labels = torch.randint(0, v, (n,), generator=gen)
    return hidden, weight, b, labels


def reference(hidden, weight, bias, labels, temperature):
    """Autograd through the full logits and log_softmax (float64)."""
    z = hidden @ weight.T + (bias if bias is not None else 0)
    logp = torch.log_softmax(z / temperature, dim=-1)
    return logp.gather(-1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chunk_elements", [41, 5 * 41 + 3, 1 << 20])  # 1 row, 5 rows + rest, all
def test_values_and_gradients_equal_autograd_through_the_logits(
    temperature, bias, chunk_elements, path
) -> None:
    hidden, weight, b, labels = problem(bias=bias)
    gen = torch.Generator().manual_seed(1)
    w_lp, w_ent = torch.randn(23, generator=gen).double(), torch.randn(23, generator=gen).double()

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight) + ((b,) if bias else ())]
        lp, ent = fn(*leaves)
        grads = torch.autograd.grad((lp * w_lp).sum() + (ent * w_ent).sum(), leaves)
        return lp, ent, grads

    ours = run(
        lambda h, w, *bb: linear_logprobs_and_entropy(
            h, w, labels, bias=bb[0] if bb else None, temperature=temperature,
            chunk_elements=chunk_elements,
        )
    )  # fmt: skip
    expected = run(lambda h, w, *bb: reference(h, w, bb[0] if bb else None, labels, temperature))
    torch.testing.assert_close(ours[0], expected[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours[1], expected[1], rtol=1e-10, atol=1e-10)
    assert len(ours[2]) == len(expected[2]) == (3 if bias else 2)
    for got, want in zip(ours[2], expected[2], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_logprobs_only_and_a_frozen_head(path) -> None:
    """Without entropy, and with W frozen (no gradient asked for it): ∂/∂h still exact."""
    hidden, weight, _, labels = problem(bias=False, seed=3)
    h = hidden.clone().requires_grad_()
    lp, ent = linear_logprobs_and_entropy(h, weight, labels, with_entropy=False, chunk_elements=90)
    assert ent is None
    (grad,) = torch.autograd.grad(lp.sum(), h)
    h2 = hidden.clone().requires_grad_()
    (want,) = torch.autograd.grad(reference(h2, weight, None, labels, 1.0)[0].sum(), h2)
    torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-10)


def test_bfloat16_matches_the_materialised_bfloat16_logits() -> None:
    """In bf16 the chunk's logits round as the model's own lm_head output does, so the result
    equals the logits route (`logprobs_and_entropy` on ``h Wᵀ`` in bf16)."""
    hidden, weight, _, labels = problem(n=64, h=32, v=300, dtype=torch.bfloat16, bias=False)
    ours = linear_logprobs_and_entropy(hidden, weight, labels, temperature=0.8, chunk_elements=900)
    logits = logprobs_and_entropy(hidden @ weight.T, labels, temperature=0.8)
    torch.testing.assert_close(ours[0], logits[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours[1], logits[1], rtol=0, atol=1e-5)


def test_the_logits_are_never_materialised() -> None:
    n, h, v, chunk = 512, 16, 1024, 8 * 1024  # 8 rows per chunk; the logits have 512k elements
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    with _LargestAllocation() as probe:
        lp, ent = linear_logprobs_and_entropy(hidden, weight, labels, chunk_elements=chunk)
        (lp.sum() + ent.sum()).backward()
    # Chunk-sized logits, and ∂/∂W (V × H = 16k) — nothing near N × V.
    assert probe.largest <= max(chunk, v * h), probe.largest
    with _LargestAllocation() as probe_logits:
        logprobs_and_entropy(hidden @ weight.T, labels, chunk_elements=chunk)
    assert probe_logits.largest == n * v


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"weight": torch.zeros(5, 7)}, r"weight must have shape \(V, H\)"),
        ({"weight": torch.zeros(5, 8, dtype=torch.float64)}, "must share a dtype"),
        ({"labels": torch.full((4,), 5)}, r"labels must lie in \[0, V=5\)"),
        ({"labels": torch.zeros(3, dtype=torch.long)}, "labels has shape"),
        ({"bias": torch.zeros(4)}, r"bias must have shape \(5,\)"),
    ],
)
def test_bad_shapes_are_named(change, message) -> None:
    args = {"hidden": torch.zeros(4, 8), "weight": torch.zeros(5, 8),
            "labels": torch.zeros(4, dtype=torch.long), "bias": None}  # fmt: skip
    args.update(change)
    with pytest.raises(ValueError, match=message):
        linear_logprobs_and_entropy(
            args["hidden"], args["weight"], args["labels"], bias=args["bias"]
        )
