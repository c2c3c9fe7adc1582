"""`rlhf.learner.muon`: Newton–Schulz against the singular values it maps, `MuonAdamW`'s two
halves against torch's own Muon and AdamW, and which parameters go to which half."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.learner import OptimizerConfig
from rlhf.learner.muon import (
    NS_COEFFICIENTS,
    NS_EPS,
    NS_STEPS,
    MuonAdamW,
    build_muon,
    muon_groups,
    newton_schulz5,
)


def _quintic_of_singular_values(g: torch.Tensor) -> torch.Tensor:
    """NS₅ from the SVD, in float64: g = U·Σ·Vᵀ → U·p⁵(Σ / (‖g‖_F + eps))·Vᵀ with
    p(σ) = a·σ + b·σ³ + c·σ⁵ (each iteration X ← aX + (bA + cA²)X, A = XXᵀ, maps X's singular
    values by p and keeps its singular vectors)."""
    a, b, c = NS_COEFFICIENTS
    u, s, vt = torch.linalg.svd(g.double(), full_matrices=False)
    s = s / (g.double().norm() + NS_EPS)
    for _ in range(NS_STEPS):
        s = a * s + b * s**3 + c * s**5
    return u @ torch.diag(s) @ vt


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (8, 8)])
def test_newton_schulz_maps_each_singular_value_by_the_quintic(shape) -> None:
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
    out = newton_schulz5(g)
    assert out.dtype == torch.float32 and out.shape == g.shape
    torch.testing.assert_close(out.double(), _quintic_of_singular_values(g), rtol=0, atol=2e-5)
    # A stack of matrices is orthogonalised matrix by matrix.
    stack = torch.stack([g, 2 * g.flip(0)])
    torch.testing.assert_close(
        newton_schulz5(stack), torch.stack([out, newton_schulz5(2 * g.flip(0))])
    )
    # Every singular value lands in the quintic's band around 1 (0.68 .. 1.13 after 5 steps
    # from anything not too small), which is what makes the update "orthogonal".
    singular = torch.linalg.svdvals(out)
    assert float(singular.min()) > 0.6 and float(singular.max()) < 1.2


class Tiny(torch.nn.Module):
    """An embedding, a hidden matrix with a bias, a norm scale and an output head."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embed_tokens = torch.nn.Parameter(torch.randn(11, 6, generator=gen))
        self.proj = torch.nn.Linear(6, 9)
        self.norm = torch.nn.Parameter(torch.ones(9))
        self.lm_head = torch.nn.Parameter(torch.randn(11, 9, generator=gen))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.embed_tokens[ids]) * self.norm
        return (h @ self.lm_head.T).logsumexp(-1).sum()


OPT = OptimizerConfig(lr=1e-2, muon_lr=0.05, muon_momentum=0.9, weight_decay=0.1,
                      betas=(0.9, 0.95), eps=1e-8, name="muon", schedule="constant")  # fmt: skip


def test_groups_put_the_hidden_matrices_under_muon_and_the_rest_under_adamw() -> None:
    model = Tiny()
    groups = muon_groups(model, OPT)
    names = {id(p): n for n, p in model.named_parameters()}
    assert [[names[id(p)] for p in g["params"]] for g in groups] == [
        ["proj.weight"], ["embed_tokens", "lm_head"], ["norm", "proj.bias"]
    ]  # fmt: skip
    assert [(g.get("use_muon", False), g["lr"], g["weight_decay"]) for g in groups] == [
        (True, 0.05, 0.1), (False, 1e-2, 0.1), (False, 1e-2, 0.0)
    ]  # fmt: skip


def test_each_half_steps_as_torchs_own_optimizer_does() -> None:
    """Three steps of the same gradients: the AdamW half equals torch's AdamW on the same
    groups (the same float32 arithmetic); the Muon half follows the formula — B ← μB + (1 − μ)g,
    U = (1 − μ)g + μB, W ← W(1 − ηλ) − η·sqrt(9/6)·NS₅(U), NS₅ from the SVD in float64 — and
    points where torch's Muon (Nesterov, the same lr scaling, a bfloat16 Newton–Schulz) does."""
    torch.manual_seed(0)
    ours, theirs = Tiny(), Tiny()
    theirs.load_state_dict(ours.state_dict())
    optimizer, scheduler = build_muon(ours, OPT)
    assert isinstance(optimizer, MuonAdamW)
    groups = muon_groups(theirs, OPT)
    muon = torch.optim.Muon(groups[0]["params"], lr=0.05, weight_decay=0.1, momentum=0.9)
    adamw = torch.optim.AdamW(groups[1:], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ids = torch.tensor([[1, 4, 7], [2, 9, 10]])
    before = ours.proj.weight.detach().clone()
    w, buffer = before.double(), torch.zeros_like(before, dtype=torch.float64)
    for step in range(3):
        ours.zero_grad()
        ours((ids + step) % 11).backward()
        for (_, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
            q.grad = p.grad.clone()  # both optimizers see the same gradients
        g = ours.proj.weight.grad.double()
        buffer = 0.9 * buffer + 0.1 * g
        w = w * (1 - 0.05 * 0.1) - 0.05 * math.sqrt(9 / 6) * _quintic_of_singular_values(
            0.1 * g + 0.9 * buffer
        )
        optimizer.step()
        scheduler.step()
        muon.step()
        adamw.step()
        torch.testing.assert_close(ours.proj.weight.double(), w, rtol=0, atol=1e-5)
    for name in ("embed_tokens", "lm_head", "proj.bias", "norm"):
        assert torch.equal(ours.get_parameter(name), theirs.get_parameter(name)), name
    moved_ours = (ours.proj.weight - before).flatten()
    moved_theirs = (theirs.proj.weight - before).flatten()
    cosine = torch.nn.functional.cosine_similarity(moved_ours, moved_theirs, 0)
    assert float(cosine) > 0.9995
    assert float(moved_ours.norm() / moved_theirs.norm()) == pytest.approx(1.0, abs=0.02)
    # One schedule drives both halves: a constant schedule keeps both peaks.
    assert [g["lr"] for g in optimizer.param_groups] == [0.05, 1e-2, 1e-2]
    assert set(optimizer.state[ours.proj.weight]) == {"momentum_buffer"}
    assert set(optimizer.state[ours.norm]) == {"step", "exp_avg", "exp_avg_sq"}
