"""Chunked log-probs/entropy: equal to the naive computation, never a full float32 copy."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlhf.algos import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits


def naive(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    picked = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return picked, entropy


def sample(b=3, t=5, v=37, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(b, t, v, generator=gen)).to(dtype)
    labels = torch.randint(0, v, (b, t), generator=gen)
    return logits, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("chunk_elements", [37, 100, 1 << 20])  # 1 row, 2 rows + remainder, all
def test_forward_equals_naive(dtype, temperature, chunk_elements) -> None:
    logits, labels = sample(dtype=dtype)
    lp, ent = logprobs_and_entropy(
        logits, labels, temperature=temperature, chunk_elements=chunk_elements
    )
    ref_lp, ref_ent = naive(logits, labels, temperature)
    logp64 = torch.log_softmax(logits.double() / temperature, dim=-1)
    truth_lp = logp64.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    truth_ent = -(logp64.exp() * logp64).sum(-1)
    assert lp.dtype == ent.dtype == torch.float32
    # Within a few float32 ulps of the naive float32 result (|logp| reaches ~20 here) ...
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    # ... and no farther from the float64 truth than float32 rounding allows.
    torch.testing.assert_close(lp.double(), truth_lp, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(ent.double(), truth_ent, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(
        logprobs_from_logits(
            logits, labels, temperature=temperature, chunk_elements=chunk_elements
        ),
        lp,
    )
    torch.testing.assert_close(
        entropy_from_logits(logits, temperature=temperature, chunk_elements=chunk_elements), ent
    )


@pytest.fixture(params=["eager", "fused"])
def path(request, monkeypatch):
    """The eager in-place chunk loop, or the functional chunk functions that CUDA runs through
    torch.compile (called uncompiled here: same algebra, same autograd wiring)."""
    if request.param == "fused":
        from rlhf.algos import logprobs as module

        kernels = (module._fused_forward_chunk, module._fused_backward_chunk)
        monkeypatch.setattr(module, "_fused_kernels", lambda device: kernels)
    return request.param


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("use", ["both", "logprobs", "entropy"])
def test_backward_equals_naive_autograd(temperature, use, path) -> None:
    logits, labels = sample(seed=1)
    gen = torch.Generator().manual_seed(2)
    w_lp, w_ent = torch.randn(labels.shape, generator=gen), torch.randn(labels.shape, generator=gen)

    def objective(fn_lp, fn_ent):
        return {
            "both": (fn_lp * w_lp).sum() + (fn_ent * w_ent).sum(),
            "logprobs": (fn_lp * w_lp).sum(),
            "entropy": (fn_ent * w_ent).sum(),
        }[use]

    x = logits.clone().requires_grad_()
    lp, ent = logprobs_and_entropy(x, labels, temperature=temperature, chunk_elements=80)
    (grad,) = torch.autograd.grad(objective(lp, ent), x)
    y = logits.clone().requires_grad_()
    ref_lp, ref_ent = naive(y, labels, temperature)
    torch.testing.assert_close(lp, ref_lp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent.detach(), atol=1e-5, rtol=1e-5)
    (ref_grad,) = torch.autograd.grad(objective(ref_lp, ref_ent), y)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)


def test_gradcheck_float64() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 6, (2, 3), generator=gen)

    # float64 logits are computed in float64, so gradcheck runs at its default tolerances.
    def f(x):
        return logprobs_and_entropy(x, labels, temperature=0.8, chunk_elements=12)

    assert torch.autograd.gradcheck(f, (logits,))


def test_bf16_input_gets_a_bf16_gradient_and_is_not_modified() -> None:
    logits, labels = sample(dtype=torch.bfloat16)
    before = logits.clone()
    x = logits.clone().requires_grad_()
    lp, ent = logprobs_and_entropy(x, labels, temperature=0.5, chunk_elements=40)
    (lp.sum() + ent.sum()).backward()
    assert x.grad.dtype == torch.bfloat16
    assert torch.equal(x.detach(), before)


class _LargestAllocation(TorchDispatchMode):
    """Records the largest float32 tensor any aten op produces (deterministic, no timing)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, tuple | list) else (out,):
            if isinstance(o, torch.Tensor) and o.dtype == torch.float32:
                self.largest = max(self.largest, o.numel())
        return out


def test_no_full_float32_copy_in_forward_or_backward() -> None:
    b, t, v, chunk = 4, 64, 512, 4096  # chunk = 8 rows of 512; the batch has 256 rows
    logits = torch.randn(b, t, v, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, v, (b, t))
    with _LargestAllocation() as probe:
        lp, ent = logprobs_and_entropy(logits, labels, temperature=0.9, chunk_elements=chunk)
        (lp.sum() + ent.sum()).backward()
    assert probe.largest <= chunk, probe.largest
    # The naive path under the same probe materialises the whole (B, T, V) in float32.
    with _LargestAllocation() as probe_naive:
        naive(logits, labels, 0.9)
    assert probe_naive.largest == b * t * v


def test_bad_labels_and_shapes() -> None:
    logits, labels = sample()
    with pytest.raises(ValueError, match="labels must lie in \\[0, V=37\\)"):
        logprobs_from_logits(logits, torch.full_like(labels, -100))
    with pytest.raises(
        ValueError,
        match="labels has shape \\(3, 4\\) but must equal logits.shape\\[:-1\\] = \\(3, 5\\)",
    ):
        logprobs_from_logits(logits, labels[:, :4])
    with pytest.raises(ValueError, match="labels must be an integer tensor"):
        logprobs_from_logits(logits, labels.float())
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        logprobs_from_logits(logits, labels, temperature=0.0)
    with pytest.raises(ValueError, match="logits must be a floating-point tensor"):
        entropy_from_logits(labels)


def test_minus_inf_logits_give_finite_entropy_and_gradient() -> None:
    # Masked vocabulary: softmax over the two finite logits is [0.5, 0.5] → H = log 2.
    logits = torch.tensor([[[0.0, 0.0, float("-inf")]]], requires_grad=True)
    lp, ent = logprobs_and_entropy(logits, torch.tensor([[1]]))
    assert ent.item() == pytest.approx(0.6931472, abs=1e-6)
    assert lp.item() == pytest.approx(-0.6931472, abs=1e-6)
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 0, 2] == 0


def test_double_backward_is_refused_clearly() -> None:
    logits, labels = sample()
    x = logits.clone().requires_grad_()
    lp = logprobs_from_logits(x, labels)
    (g,) = torch.autograd.grad(lp.sum(), x, create_graph=True)
    # once_differentiable: the first-order gradient carries no graph, so a second backward is
    # refused up front instead of silently returning a wrong second derivative.
    assert g.grad_fn is None
    with pytest.raises(RuntimeError, match="does not require grad"):
        g.sum().backward()


def test_more_bad_inputs() -> None:
    logits, labels = sample()
    with pytest.raises(ValueError, match="V >= 1"):
        logprobs_from_logits(torch.zeros(2, 3, 0), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_elements must be >= 1"):
        logprobs_from_logits(logits, labels, chunk_elements=2.5)
    out = logprobs_from_logits(logits, labels.to(torch.int8))
    torch.testing.assert_close(out, logprobs_from_logits(logits, labels))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_cuda_path_equals_float64_autograd(dtype) -> None:
    """On CUDA the chunks run through torch.compile; values and gradients match a float64
    log_softmax of the same (rounded) logits."""
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA GPU; run them on the device machine")
    gen = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(300, 1000, generator=gen)).to(dtype).cuda()
    labels = torch.randint(0, 1000, (300,), generator=gen).cuda()
    w = torch.randn(300, generator=gen).cuda()
    x = logits.clone().requires_grad_()
    lp, ent = logprobs_and_entropy(x, labels, temperature=0.7, chunk_elements=64 * 1000)
    (grad,) = torch.autograd.grad((lp * w).sum() + (ent * w).sum(), x)
    y = logits.double().requires_grad_()
    logp = torch.log_softmax(y / 0.7, dim=-1)
    ref_lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    (ref_grad,) = torch.autograd.grad((ref_lp * w).sum() + (ref_ent * w).sum(), y)
    torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=2e-5, rtol=2e-5)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16 gradient rounding
    torch.testing.assert_close(grad.double(), ref_grad.to(grad.dtype).double(), atol=tol, rtol=tol)


def test_the_default_chunk_on_cpu_bounds_the_float32_buffers() -> None:
    """Without ``chunk_elements`` a CPU batch is cut into the CPU default's chunks (the CUDA
    default would take this whole 9M-logit batch in one chunk)."""
    from rlhf.algos.logprobs import DEFAULT_CHUNK_ELEMENTS, default_chunk_elements

    cpu = default_chunk_elements(torch.device("cpu"))
    assert cpu < default_chunk_elements(torch.device("cuda")) == DEFAULT_CHUNK_ELEMENTS["cuda"]
    v = 4096
    logits = torch.randn(2, 1100, v, dtype=torch.bfloat16, requires_grad=True)
    assert logits.numel() > 2 * cpu
    labels = torch.randint(0, v, (2, 1100))
    with _LargestAllocation() as probe:
        lp, ent = logprobs_and_entropy(logits, labels)
        (lp.sum() + ent.sum()).backward()
    assert probe.largest <= cpu, probe.largest
