"""Tensor parallelism in the FSDP2 backend (Ray actors, gloo): TP=2 and a 2×2 data × tensor
parallel mesh take the same step as one process (actor and critic), the tied embedding stays
tied, a TP=2 checkpoint resumes on 2 data-parallel ranks, and models that cannot be split are
refused naming the flag.

Parameters are compared after one AdamW step with ``eps`` 1: the first step moves a weight by
``lr * g / (|g| + eps)``, so a gradient that differs by d (summation order of the split
matmuls, ~1e-7) moves it by at most ``lr * d``; with the default ``eps`` the update is
``lr * sign(g)`` and tiny gradients turn rounding into 1e-5 differences.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoConfig, Qwen2ForCausalLM

from rlhf.algos import AlgoConfig
from rlhf.learner import LearnerGroup, PPOActorObjective
from rlhf.molt import FSDPBackend, FSDPConfig, FSDPConfigError
from rlhf.molt.tensor_parallel import check_tensor_parallel

from .molt_cases import clipped_ppo_case, config, critic_case, full_state, rl_batch

TP2 = functools.partial(FSDPBackend, fsdp=FSDPConfig(tp_size=2))
LR, EPS = 0.1, 1.0


def _layout(backend) -> dict[str, object]:
    """What one rank holds: tied head, parameter count, the meshes of a split layer and a
    norm."""
    model = backend.module
    layer = model.model.layers[0]
    return {
        "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        "params": len(list(model.named_parameters())),
        "q_proj": layer.self_attn.q_proj.weight.device_mesh.mesh_dim_names,
        "norm": layer.input_layernorm.weight.device_mesh.mesh_dim_names,
        "dp": (backend.dp_rank, backend.dp_size),
    }


@pytest.mark.parametrize(
    ("ranks", "offload", "sequence_parallel"),
    [(2, "none", False), (4, "none", False), (4, "optimizer", False), (2, "none", True),
     (4, "none", True)],
    ids=["tp2", "dp2xtp2", "dp2xtp2-host-adamw", "tp2-sequence-parallel",
         "dp2xtp2-sequence-parallel"],
)  # fmt: skip
def test_tensor_parallel_step_equals_one_process(
    groups, tiny_tp, ranks, offload, sequence_parallel
) -> None:
    """3 micro-batches over dp 1 (TP=2) or dp 2 (one padded pass) with the gradient clipped
    to half its norm, AdamW on the device or on the host, the sequence split between blocks
    or not (padded lengths 7–11: odd ones split unevenly): loss, gradient norm and every
    parameter equal one full-batch step."""
    model, batch, objective, cfg, loss, grad_norm = clipped_ppo_case(tiny_tp, lr=LR, eps=EPS)

    group = groups[ranks]
    fsdp = FSDPConfig(tp_size=2, offload=offload, sequence_parallel=sequence_parallel)
    group.build(cfg, backend=functools.partial(FSDPBackend, fsdp=fsdp))
    dp = ranks // 2
    layouts = group.run(_layout)
    assert [lay["dp"] for lay in layouts] == [(r // 2, dp) for r in range(ranks)]
    for lay in layouts:
        assert lay["tied"] and lay["params"] == len(list(model.named_parameters()))
        # Under sequence parallelism the norms are replicated DTensors on the tp group too.
        norm_mesh = ("dp", "tp") if sequence_parallel else ("dp",)
        assert lay["q_proj"] == ("dp", "tp") and lay["norm"] == norm_mesh
    assert len(group.split(batch, max_rows=2)) == dp
    out = group.train_step(batch, objective, max_rows=2)
    assert out["loss"] == pytest.approx(loss, rel=1e-5)
    assert out["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    state = full_state(group)
    assert state.keys() == dict(model.named_parameters()).keys()
    for name, param in model.named_parameters():
        torch.testing.assert_close(state[name], param.detach(), rtol=0, atol=LR * 1e-5)


def _collectives(backend) -> dict[str, int]:
    """The collectives one forward of 2 × 9 tokens issues on this rank, by op."""
    from torch.distributed.tensor.debug import CommDebugMode

    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with CommDebugMode() as comm, torch.no_grad():
        backend.module(input_ids=ids, attention_mask=torch.ones_like(ids))
    return {str(op).rsplit(".", 1)[-1]: n for op, n in comm.get_comm_counts().items()}


def test_sequence_parallel_moves_the_sequence_once_per_block(groups, tiny_tp) -> None:
    """Per decoder layer, tensor parallelism all-reduces the two row-wise outputs; with the
    sequence split they are reduce-scattered instead and each of the two blocks gathers its
    input once (not once per column-wise layer: q, k, v and gate, up would be 5). Plus the
    embedding (all-reduce / reduce-scatter), the final hidden states gathered for the heads
    (sequence parallel only) and the gathered logits."""
    layers = AutoConfig.from_pretrained(tiny_tp).num_hidden_layers
    counts = {}
    for sequence_parallel in (False, True):
        fsdp = FSDPConfig(tp_size=2, sequence_parallel=sequence_parallel)
        groups[2].build(config(tiny_tp), backend=functools.partial(FSDPBackend, fsdp=fsdp))
        counts[sequence_parallel] = groups[2].run(_collectives)
    for rank in range(2):
        assert counts[False][rank] == {
            "all_reduce": 2 * layers + 1,
            "all_gather_into_tensor": 1,
        }
        assert counts[True][rank] == {
            "reduce_scatter_tensor": 2 * layers + 1,
            "all_gather_into_tensor": 2 * layers + 2,
        }


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sequence-parallel"])
def test_tensor_parallel_critic_equals_one_process(
    groups, tiny_tp, tmp_path, sequence_parallel
) -> None:
    """The scalar head stays whole on both ranks (under sequence parallelism it reads the
    decoder's hidden states gathered whole); the split decoder under it gives the same loss
    and gradient norm as one process."""
    path, batch, objective, loss, grad_norm = critic_case(
        tiny_tp, tmp_path, batch_seed=7, value_seed=6
    )
    fsdp = FSDPConfig(tp_size=2, sequence_parallel=sequence_parallel)
    groups[2].build(config(path, kind="scalar"), backend=functools.partial(FSDPBackend, fsdp=fsdp))
    out = groups[2].train_step(batch, objective, max_rows=2)
    assert out["loss"] == pytest.approx(loss, rel=1e-5)
    assert out["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)


def test_a_tensor_parallel_checkpoint_resumes_data_parallel(groups, tiny_tp, tmp_path) -> None:
    """DCP reshards on load: a TP=2 checkpoint loads into 2 data-parallel ranks bit for bit,
    and the next step there equals the TP=2 run's next step."""
    model = Qwen2ForCausalLM.from_pretrained(tiny_tp, dtype=torch.float32)
    batch = rl_batch(model, seed=8)
    objective = PPOActorObjective(
        algo=AlgoConfig(), normalizer=float(batch["action_mask"].sum()), kl_coef=0.0
    )
    cfg = config(tiny_tp, lr=LR, eps=EPS)
    tp, dp = groups[2], LearnerGroup(num_ranks=2, num_cpus_per_rank=0.5)
    try:
        tp.build(cfg, backend=TP2)
        tp.train_step(batch, objective, max_rows=3)
        saved = full_state(tp)
        path = tp.save(str(tmp_path), 1, client_state={"step": 1})
        expected = tp.train_step(batch, objective, max_rows=3)
        expected_state = full_state(tp)
        dp.build(cfg, backend=functools.partial(FSDPBackend, fsdp=FSDPConfig()))
        assert dp.load(path) == {"step": 1}
        loaded = full_state(dp)
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)
        got = dp.train_step(batch, objective, max_rows=3)
        state = full_state(dp)
    finally:
        dp.shutdown()
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert got["lr"] == expected["lr"]
    for name, tensor in expected_state.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=LR * 1e-5)


def test_models_that_cannot_be_split_are_refused_by_flag(tiny, tiny_tp) -> None:
    one_kv_head = AutoConfig.from_pretrained(tiny)
    with pytest.raises(
        FSDPConfigError, match=r"--actor.fsdp.tp_size 2 .*num_key_value_heads \(1\)"
    ):
        check_tensor_parallel(one_kv_head, tp_size=2, world_size=2, flag="actor.fsdp")
    four_heads = AutoConfig.from_pretrained(tiny_tp)
    with pytest.raises(FSDPConfigError, match=r"--actor.fsdp.tp_size 4 .*num_key_value_heads"):
        check_tensor_parallel(four_heads, tp_size=4, world_size=4, flag="actor.fsdp")
    with pytest.raises(FSDPConfigError, match=r"tp_size 2 must divide the role's 3 rank"):
        check_tensor_parallel(four_heads, tp_size=2, world_size=3, flag="actor.fsdp")
    four_heads.base_model_tp_plan = None
    with pytest.raises(FSDPConfigError, match="carries no tensor-parallel plan"):
        check_tensor_parallel(four_heads, tp_size=2, world_size=2, flag="actor.fsdp")
    check_tensor_parallel(one_kv_head, tp_size=1, world_size=3, flag="actor.fsdp")
