"""The FSDP2 backend (`rlhf.molt`) side by side with the DeepSpeed backend, in one invocation.

1. Actor step: `FSDPBackend` and `DeepSpeedBackend` (ZeRO-2) in this process, one rank each, on
   the same model, PPO batch and micro-batches, alternating rounds; bf16 compute with float32
   masters on both (``param_dtype bfloat16`` / ``deepspeed.bf16``) on a GPU, float32 on CPU.
   Reports seconds per step, tokens/s, MFU on the H200 (the model FLOPs of
   ``bench_learner.step_flops``) and ``ratio_fsdp_over_deepspeed`` (tokens/s).
2. Memory ladder (GPU): each configuration in a fresh subprocess — DeepSpeed ZeRO-2 and
   molt with ``offload none|optimizer|full`` — builds, takes two steps and reports the peak
   and the resident CUDA allocation after a step, and the allocation after
   `offload_states(weights=True)` (what hybrid turn-taking leaves on the device).

Usage: python benchmarks/bench_molt.py [--json out.json] [--size tiny|0.5B|1.5B]
       [--rounds 5] [--micro-rows 2] [--no-memory] [--variant reshard_after_forward=false ...]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from bench_learner import H200_BF16_DENSE_FLOPS, SCALES, SHAPE, make_model, rl_batch, step_flops

SHAPES = {"tiny": SHAPE, **SCALES}
MODES = ("deepspeed", "molt-none", "molt-optimizer", "molt-full")
DEEPSPEED_OFFLOAD = {
    "deepspeed-offload": {"zero_stage": 2, "offload_optimizer": True},
    "deepspeed-zero3-offload": {"zero_stage": 3, "offload_optimizer": True, "offload_params": True},
}
"""Further memory-ladder rungs (``--memory-modes``): DeepSpeed's own offload, torch AdamW on the
host (ZeRO-2 with the optimizer offloaded; ZeRO-3 with parameters offloaded too)."""
ALL_MODES = (*MODES, *DEEPSPEED_OFFLOAD)


def _setup(
    model_dir: pathlib.Path, mode: str, *, gpu: bool, options: dict[str, Any] | None = None
) -> Any:
    """One backend (rank 0 of 1) of ``mode``; ``options`` override the molt side's
    `FSDPConfig` fields."""
    from rlhf.learner import (
        DeepSpeedBackend,
        DeepSpeedConfig,
        LearnerConfig,
        ModelConfig,
        OptimizerConfig,
    )
    from rlhf.molt import FSDPBackend, FSDPConfig, init_distributed

    init_distributed()  # one process group for both backends
    config = LearnerConfig(
        model=ModelConfig(path=str(model_dir)),
        optimizer=OptimizerConfig(lr=1e-6, grad_clip=1.0),
    )
    if mode == "deepspeed":
        return DeepSpeedBackend(config, deepspeed=DeepSpeedConfig(zero_stage=2, bf16=gpu))
    if mode in DEEPSPEED_OFFLOAD:
        ds = DeepSpeedConfig(bf16=gpu, **DEEPSPEED_OFFLOAD[mode])
        return DeepSpeedBackend(config, deepspeed=ds)
    offload = mode.removeprefix("molt-")
    fsdp = FSDPConfig(
        param_dtype="bfloat16" if gpu else "float32", offload=offload, **(options or {})
    )
    return functools.partial(FSDPBackend, fsdp=fsdp)(config)


def _work(shape: dict[str, int], *, rows: int, length: int, micro_rows: int, device: Any):
    from rlhf.algos import AlgoConfig, loss_normalizer
    from rlhf.learner import PPOActorObjective

    batch = rl_batch(rows=rows, length=length, vocab=shape["vocab_size"])
    micro = [
        batch.select(range(i, min(i + micro_rows, rows))).to(device)
        for i in range(0, rows, micro_rows)
    ]
    norm = float(loss_normalizer(batch["action_mask"], mode="token-mean"))
    objective = PPOActorObjective(algo=AlgoConfig(), normalizer=norm, entropy_metric=False)
    return micro, objective, int(batch.attention_mask.sum())


def bench_step(
    model_dir: pathlib.Path,
    shape: dict[str, int],
    *,
    rounds: int,
    rows: int,
    length: int,
    micro_rows: int,
    variants: dict[str, dict[str, Any]],
) -> dict[str, float]:
    gpu = torch.cuda.is_available()
    backends = {name: _setup(model_dir, name, gpu=gpu) for name in ("deepspeed", "molt-none")}
    for label, options in variants.items():
        backends[label] = _setup(model_dir, "molt-none", gpu=gpu, options=options)
    device = backends["deepspeed"].device
    micro, objective, tokens = _work(
        shape, rows=rows, length=length, micro_rows=micro_rows, device=device
    )
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in backends}
    for r in range(rounds + 1):  # round 0 warms up
        for name in list(backends)[:: 1 if r % 2 else -1]:
            start = time.perf_counter()
            backends[name].train_micro_batches(micro, objective)
            sync()
            if r:
                times[name].append(time.perf_counter() - start)
    flops = step_flops(shape, rows=rows, length=length)
    out: dict[str, float] = {"tokens_per_step": float(tokens)}
    labels = {"deepspeed": "deepspeed", "molt-none": "fsdp"} | {v: v for v in variants}
    for name, label in labels.items():
        s = statistics.median(times[name])
        out[f"{label}_s_per_step"] = s
        out[f"{label}_tokens_per_s"] = tokens / s
        out[f"{label}_mfu_h200"] = flops / s / H200_BF16_DENSE_FLOPS
    for label in ("fsdp", *variants):
        ratio = out[f"{label}_tokens_per_s"] / out["deepspeed_tokens_per_s"]
        out[f"ratio_{label}_over_deepspeed"] = ratio
    for backend in backends.values():
        backend.close()
    gc.collect()
    return out


def memory_child(model_dir: pathlib.Path, size: str, mode: str, micro_rows: int) -> None:
    """Run in a fresh process: peak and resident CUDA memory of ``mode`` (GiB, one JSON
    line)."""
    backend = _setup(model_dir, mode, gpu=True)
    micro, objective, _ = _work(
        SHAPES[size], rows=8, length=2048, micro_rows=micro_rows, device=backend.device
    )
    gib = 2**30
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        backend.train_micro_batches(micro, objective)
    torch.cuda.synchronize()
    out = {
        "peak_gib": torch.cuda.max_memory_allocated() / gib,
        "resident_gib": torch.cuda.memory_allocated() / gib,
    }
    if mode not in DEEPSPEED_OFFLOAD:  # hybrid moves: ZeRO-1/2 without DeepSpeed's offload
        moved = backend.offload_states(weights=True)
        out["after_offload_states_gib"] = moved["allocated_gib_after"]
    print(json.dumps(out), flush=True)


def bench_memory(
    model_dir: pathlib.Path, size: str, micro_rows: int, modes: list[str]
) -> dict[str, Any]:
    out = {}
    # Each child makes its own single-process group: this process's rendezvous port is taken.
    rendezvous = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {key: value for key, value in os.environ.items() if key not in rendezvous}
    for mode in modes:
        child = subprocess.run(
            [sys.executable, __file__, "--memory-child", mode, "--model-dir", str(model_dir),
             "--size", size, "--micro-rows", str(micro_rows)],
            capture_output=True, text=True, check=False, env=env,
        )  # fmt: skip
        if child.returncode:
            out[mode] = {"error": child.stderr[-1500:]}
        else:
            out[mode] = json.loads(child.stdout.strip().splitlines()[-1])
        print(f"memory {mode}:", json.dumps(out[mode]), flush=True)
    return out


def _variants(specs: list[str]) -> dict[str, dict[str, Any]]:
    """``["compile=true", "reshard_after_forward=false"]`` → one FSDPConfig override each,
    keyed by its spec (booleans and integers parsed)."""
    words = {"true": True, "false": False}
    out = {}
    for spec in specs:
        options = {}
        for item in spec.split(","):
            field, _, value = item.partition("=")
            options[field] = words.get(value.lower(), int(value) if value.isdigit() else value)
        out[f"fsdp[{spec}]"] = options
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--size", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--micro-rows", type=int, default=2)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="FIELD=VALUE[,FIELD=VALUE]",
        help="an extra molt backend in the same rounds with these FSDPConfig fields "
        "(e.g. reshard_after_forward=false); repeatable",
    )
    parser.add_argument(
        "--memory-modes",
        default=",".join(MODES),
        help=f"comma-separated rungs of the memory ladder (of {', '.join(ALL_MODES)})",
    )
    parser.add_argument("--no-step", action="store_true", help="only the memory ladder")
    parser.add_argument("--memory-child", choices=ALL_MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.model_dir, args.size, args.memory_child, args.micro_rows)
        return
    gpu = torch.cuda.is_available()
    rows, length = (8, 2048) if gpu else (4, 128)
    results: dict[str, Any] = {"device": "cuda" if gpu else "cpu", "size": args.size}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = pathlib.Path(tmp) / "model"
        make_model(model_dir, SHAPES[args.size])
        if not args.no_step:
            results["actor_step"] = bench_step(
                model_dir, SHAPES[args.size], rounds=args.rounds, rows=rows, length=length,
                micro_rows=args.micro_rows, variants=_variants(args.variant),
            )  # fmt: skip
            print("actor_step:", json.dumps(results["actor_step"]), flush=True)
        if gpu and not args.no_memory:
            modes = args.memory_modes.split(",")
            results["memory"] = bench_memory(model_dir, args.size, args.micro_rows, modes)
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
