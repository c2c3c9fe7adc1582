"""DeepSpeed options that change how a step is computed but not what it computes, each on 2
ranks (Ray actors, gloo) against the role without it, the same PPO batches dealt the same
way: ZeRO-0 against ZeRO-2, gradient checkpointing on and off, ``offload_optimizer``
(ZeRO-Offload) on and off, and the refusal of ``offload_optimizer`` at ZeRO-0, where DeepSpeed
ignores it.

Each run takes two AdamW steps (clipped unless a test says otherwise), one per batch: the
first is compared to float32 rounding
(`assert_same_step`), the second coarsely (`assert_same_second_step`), for what a step leaves
behind: gradients not cleared, optimizer moments lost, weights not copied back."""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rlhf.algos import AlgoConfig, KLConfig, loss_normalizer
from rlhf.learner import (
    DeepSpeedBackend,
    DeepSpeedConfig,
    LearnerConfig,
    LearnerGroup,
    ModelConfig,
    OptimizerConfig,
    PPOActorObjective,
)

from .test_units import _rl_batch

LR = 1e-3
EPS = 1.0
"""AdamW's ``eps``: its first step moves a weight by ``lr * g / (|g| + eps)``, so with ``eps`` 1
a gradient off by ``d`` moves the weight by at most ``lr * d`` more (the derivative of
``g / (|g| + 1)`` is at most 1). With the usual 1e-8 the step is ``lr * sign(g)``, which turns
float32 rounding of a gradient near 0 into an lr-sized difference."""
CLIP = 1.0
"""Below the batch's gradient norm (about 2.5, asserted): the compared steps clip."""
MAX_ROWS = 2
"""6 rows in micro-batches of 2 → 3 micro-batches on 2 ranks: rank 0 runs two, rank 1 one and
a weight-0 copy of it."""
PASSES = 2
"""Forward passes per rank and step (see `MAX_ROWS`)."""
ULP = torch.finfo(torch.float32).eps


@dataclasses.dataclass
class Step:
    """Two optimizer steps of a role: the metrics of each, every parameter after each, and the
    calls of decoder layer 0 on each rank (both steps)."""

    metrics: list[dict[str, float]]
    after: list[dict[str, torch.Tensor]]
    layer_calls: list[int]


@pytest.fixture(scope="module")
def group(ray_cluster):
    g = LearnerGroup(num_ranks=2)
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def ppo(tiny) -> list[tuple[Any, PPOActorObjective]]:
    """Two PPO batches of 6 rows with their objectives: one for each step (a second step on
    the first batch would see nearly the same gradient, which makes AdamW's moments
    invisible: with bias correction, equal gradients give the same update at any β)."""
    model = Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    algo = AlgoConfig(kl=KLConfig(use_loss=True, estimator="k3"), entropy_coef=0.01)
    out = []
    for seed in (2, 3):
        batch = _rl_batch(model, seed=seed)
        norm = float(loss_normalizer(batch["action_mask"], mode="token-mean"))
        out.append((batch, PPOActorObjective(algo=algo, normalizer=norm, kl_coef=0.1)))
    return out


def learner(
    path: pathlib.Path,
    *,
    lr: float = LR,
    beta1: float = 0.9,
    grad_clip: float = CLIP,
    gradient_checkpointing: bool = False,
    reentrant: bool = False,
    **deepspeed: Any,
) -> dict[str, Any]:
    """``build``'s arguments: the role and the DeepSpeed backend with ``deepspeed``'s
    `DeepSpeedConfig` fields."""
    model = ModelConfig(
        path=str(path),
        gradient_checkpointing=gradient_checkpointing,
        gradient_checkpointing_reentrant=reentrant,
    )
    config = LearnerConfig(
        model=model,
        optimizer=OptimizerConfig(lr=lr, grad_clip=grad_clip, betas=(beta1, 0.95), eps=EPS),
    )
    backend = functools.partial(DeepSpeedBackend, deepspeed=DeepSpeedConfig(**deepspeed))
    return {"config": config, "backend": backend}


def _count_layer_calls(backend) -> None:
    """Count this rank's calls of decoder layer 0 in ``backend.layer_calls``. A pre-hook:
    non-reentrant checkpointing stops recomputing once the last saved tensor is back, so a
    forward hook would not see the recomputation."""
    calls = [0]
    layer = backend.module.model.layers[0]
    layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    backend.layer_calls = calls


def _full_state(backend) -> dict[str, torch.Tensor] | None:
    return backend.state_dict_on_rank0()


def run(group: LearnerGroup, role: dict[str, Any], ppo) -> Step:
    group.build(**role)
    group.run(_count_layer_calls)
    metrics, after = [], []
    for batch, objective in ppo:
        metrics.append(group.train_step(batch, objective, max_rows=MAX_ROWS))
        after.append(group.run(_full_state)[0])
    calls = group.run(lambda backend: backend.layer_calls[0])
    return Step(metrics=metrics, after=after, layer_calls=calls)


@pytest.fixture(scope="module")
def baseline(group, tiny, ppo):
    """ZeRO-``stage`` clipping at ``grad_clip``; each run once for the module."""

    @functools.cache
    def at(stage: int, grad_clip: float = CLIP) -> Step:
        return run(group, learner(tiny, zero_stage=stage, grad_clip=grad_clip), ppo)

    return at


def assert_same_step(got: Step, want: Step) -> None:
    """The same first step, to float32 rounding in another order:

    - the loss exactly: the same weights, micro-batches and kernels, summed in the same order
      (none of these options changes a forward's arithmetic);
    - the gradient norm within rtol 1e-5 (≈ 80 ulps, the existing exactness tests'
      tolerance): each gradient element is the same 4 per-pass gradients (2 ranks × 2 passes)
      summed in another order (≲ 3 roundings of numbers below the passes' norms, ~1), and the
      norm sums 93 504 squares grouped differently (per tensor, per flat partition, then over
      ranks): ≲ 1 ulp per level of torch's blocked reductions, ~17 levels;
    - every parameter within ``LR * 1e-5`` plus 2 ulps of the weight: the gradient AdamW gets
      is off by ``d`` ≲ 1e-5 (the sums above, ≲ 1e-6, and, clipped, ``g * CLIP / norm``
      takes the norm's relative error ≤ 1e-5 times ``|g * CLIP / norm|`` ≤ ``CLIP`` = 1),
      which moves the weight by at most ``LR * d`` (see `EPS`); the update and its
      subtraction each round once at the weight's last bit.
    """
    assert got.metrics[0]["loss"] == want.metrics[0]["loss"]
    assert got.metrics[0]["grad_norm"] == pytest.approx(want.metrics[0]["grad_norm"], rel=1e-5)
    assert_parameters_close(got.after[0], want.after[0], atol=LR * 1e-5)


def assert_same_second_step(got: Step, want: Step) -> None:
    """The second step, coarsely: it starts from weights that differ within the first step's
    bound, so its gradients differ by the curvature times that and no rounding bound applies.
    Loss and gradient norm within rtol 1e-4 and every parameter within ``LR * 1e-3`` (100×
    the first step's bounds, 1/1000 of a step): far above what the first step's differences
    carry into a smooth loss, far below a step's leftovers (a gradient not cleared roughly
    doubles the norm; a lost moment changes the update by a fraction of ``LR``, see
    `test_the_comparisons_catch_a_learning_rate_and_a_moment_off`)."""
    for key in ("loss", "grad_norm"):
        assert got.metrics[1][key] == pytest.approx(want.metrics[1][key], rel=1e-4), key
    assert_parameters_close(got.after[1], want.after[1], atol=LR * 1e-3)


def assert_parameters_close(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, atol: float
) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(
            got[name], tensor, rtol=2 * ULP, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_the_comparisons_catch_a_learning_rate_and_a_moment_off(group, tiny, ppo, baseline) -> None:
    """The comparisons can fail: the baseline's first step clips (so clipping is what the
    options are compared on) and moves every parameter; a learning rate 0.1 % off fails the
    first step's comparison, and AdamW without its first moment (β1 = 0: the second step uses
    the second batch's gradient alone, as if the moment had been lost) fails the second's."""
    want = baseline(2)
    assert want.metrics[0]["grad_norm"] > 2 * CLIP
    before = Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32).state_dict()
    assert all(not torch.equal(want.after[0][n], before[n]) for n in want.after[0])
    lr_off = run(group, learner(tiny, zero_stage=2, lr=LR * 1.001), ppo)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        assert_same_step(lr_off, want)
    no_moment = run(group, learner(tiny, zero_stage=2, beta1=0.0), ppo)
    assert_same_step(no_moment, want)  # β1 does not enter the first step: m̂ = g either way
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        assert_same_second_step(no_moment, want)


@pytest.mark.parametrize("grad_clip", [CLIP, 0.0], ids=["clipped", "unclipped"])
def test_zero0_step_equals_zero2(group, tiny, ppo, baseline, grad_clip) -> None:
    """Plain data parallel (every rank holds whole gradients, all-reduced in ``step``; the
    backend clips and measures the norm, which DeepSpeed does not at this stage) takes ZeRO-2's
    steps, with rank 1's weight-0 padding pass in both."""
    for batch, _ in ppo:
        assert [len(m) for m, _ in group.split(batch, max_rows=MAX_ROWS)] == [2, 1]
    got = run(group, learner(tiny, zero_stage=0, grad_clip=grad_clip), ppo)
    engine = group.run(
        lambda b: (b.engine.zero_optimization_stage(), type(b.engine.optimizer).__name__)
    )
    assert engine == [(0, "AdamW")] * 2  # torch's AdamW unwrapped: no ZeRO optimizer
    want = baseline(2, grad_clip)
    assert_same_step(got, want)
    assert_same_second_step(got, want)


@pytest.mark.parametrize(
    ("stage", "reentrant"), [(2, False), (3, False), (2, True)], ids=["2", "3", "2-reentrant"]
)
def test_gradient_checkpointing_recomputes_the_same_steps(
    group, tiny, ppo, baseline, stage, reentrant
) -> None:
    """Recomputing each layer's forward in the backward pass is exact in float32 on the CPU
    (the same kernels on the same inputs, and the model has no dropout): both steps are bit
    for bit the steps without checkpointing, with torch's reentrant checkpoint too."""
    config = learner(tiny, zero_stage=stage, gradient_checkpointing=True, reentrant=reentrant)
    got = run(group, config, ppo)
    layer = "model.layers.0"
    kind = group.run(
        lambda b: b.module.get_submodule(layer)._gradient_checkpointing_func.keywords[
            "use_reentrant"
        ]
    )
    assert kind == [reentrant] * 2
    dropout = group.run(
        lambda b: (
            b.module.config.attention_dropout,
            [m.p for m in b.module.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0],
        )
    )
    assert dropout == [(0.0, [])] * 2
    want = baseline(stage)
    assert want.layer_calls == [2 * PASSES] * 2  # two steps
    assert got.layer_calls == [2 * 2 * PASSES] * 2  # and each pass's layer again in backward
    assert got.metrics == want.metrics
    for got_after, want_after in zip(got.after, want.after, strict=True):
        for name, tensor in want_after.items():
            assert torch.equal(got_after[name], tensor), name


def _optimizer_placement(backend) -> tuple[str, bool]:
    """The torch optimizer DeepSpeed steps, and whether its ZeRO optimizer offloads it."""
    zero = backend.engine.optimizer
    offloaded = zero.cpu_offload if hasattr(zero, "cpu_offload") else zero.offload_optimizer
    return type(backend.engine.basic_optimizer).__name__, offloaded


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_optimizer_takes_the_same_steps(group, tiny, ppo, baseline, stage) -> None:
    """ZeRO-Offload steps the same torch AdamW, on fp32 partitions and moments in host memory
    (not DeepSpeedCPUAdam: no compiled op); the gradients reach it through the offload path's
    copies and norm, the weights come back by copy, and the steps are the on-device ones."""
    got = run(group, learner(tiny, zero_stage=stage, offload_optimizer=True), ppo)
    assert group.run(_optimizer_placement) == [("AdamW", True)] * 2
    want = baseline(stage)
    assert_same_step(got, want)
    assert_same_second_step(got, want)


def test_zero3_with_hierarchical_partitions_takes_the_same_steps(group, tiny, ppo, baseline):
    """ZeRO++ hpZ (OpenRLHF's ``--ds.zpg``) keeps a secondary partition of the parameters
    per group of 2 ranks: DeepSpeed builds it and the steps are ZeRO-3's."""
    got = run(group, learner(tiny, zero_stage=3, hpz_partition_size=2), ppo)
    assert group.run(lambda b: b.engine.zero_hpz_partition_size()) == [2, 2]
    want = baseline(3)
    assert_same_step(got, want)
    assert_same_second_step(got, want)
    with pytest.raises(ValueError, match=r"hpz_partition_size 2 partitions ZeRO-3's"):
        DeepSpeedConfig(zero_stage=2, hpz_partition_size=2)


def test_overlapped_gradient_reduction_takes_the_same_steps(group, tiny, ppo, baseline):
    """OpenRLHF's ``--ds.overlap_comm``: ZeRO-2 reduces gradients during the backward pass in
    DeepSpeed's own buckets; the steps are ZeRO-2's."""
    got = run(group, learner(tiny, zero_stage=2, overlap_comm=True), ppo)
    assert group.run(lambda b: b.engine.zero_overlap_comm()) == [True, True]
    want = baseline(2)
    assert_same_step(got, want)
    assert_same_second_step(got, want)


def test_the_gradient_accumulation_dtype_reaches_deepspeed(group, tiny) -> None:
    """OpenRLHF's ``--ds.grad_accum_dtype``: DeepSpeed accumulates a bf16 model's gradients in
    bf16 by default, in fp32 when asked."""
    for accum, want in ((None, torch.bfloat16), ("fp32", torch.float32)):
        group.build(**learner(tiny, zero_stage=2, bf16=True, grad_accum_dtype=accum))
        assert group.run(lambda b: b.engine.get_data_types()) == [(torch.bfloat16, want)] * 2
    with pytest.raises(ValueError, match=r"grad_accum_dtype must be fp32, bf16 or fp16"):
        DeepSpeedConfig(grad_accum_dtype="float8")


def test_offload_optimizer_at_zero0_is_refused_naming_the_flag() -> None:
    """DeepSpeed ignores ``offload_optimizer`` at ZeRO-0 (no ZeRO optimizer to offload): the
    config refuses it rather than keep the states on the device silently."""
    with pytest.raises(
        ValueError, match=r"deepspeed.offload_optimizer needs deepspeed.zero_stage 1"
    ):
        DeepSpeedConfig(zero_stage=0, offload_optimizer=True)
    for stage in (1, 2, 3):
        assert DeepSpeedConfig(zero_stage=stage, offload_optimizer=True).offload_optimizer


@dataclasses.dataclass(frozen=True)
class _CountingThreads:
    """A PPO objective that also reports the intra-op threads its rank computes with."""

    inner: PPOActorObjective

    def __call__(self, model, batch):
        loss, metrics = self.inner(model, batch)
        return loss, {**metrics, "threads": torch.tensor(float(torch.get_num_threads()))}


def _threads_per_row(model, batch) -> torch.Tensor:
    return torch.full((batch.size,), float(torch.get_num_threads()))


def test_compute_threads_hold_during_a_rank_s_compute_calls_only(group, tiny, ppo) -> None:
    """``LearnerGroup.compute_threads``: every rank trains and runs forwards with that many
    torch intra-op threads and is back at its own count afterwards; None leaves its count."""
    group.build(**learner(tiny))
    own = group.num_threads()
    wanted = own[0] + 2
    batch, objective = ppo[0]
    counting = _CountingThreads(objective)
    try:
        group.compute_threads = wanted
        assert group.train_step(batch, counting, max_rows=MAX_ROWS)["threads"] == wanted
        rows = group.forward(batch, _threads_per_row, max_rows=MAX_ROWS)
        assert {float(t) for _, values in rows for t in values} == {wanted}
        assert group.num_threads() == own
    finally:
        group.compute_threads = None
    assert group.train_step(batch, counting, max_rows=MAX_ROWS)["threads"] == own[0]
    rows = group.forward(batch, _threads_per_row, max_rows=MAX_ROWS)
    assert {float(t) for _, values in rows for t in values} == {own[0]}
