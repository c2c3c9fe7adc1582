"""The capacity planner (`rlhf.cli.capacity`, ``rlhf train … --dry_run``) against measured peaks.

Each case builds one learner rank (rank 0 of 1) in a fresh process on a random Qwen2-shaped
model of ``--size`` (bench_learner.SCALES), runs two PPO actor steps (or, for ``reference``,
two forward passes of the action log-probs, as the reference role does) on 8 rows x 2048 tokens
in micro-batches of ``rows`` rows, and reports torch's peak allocation. Beside it, the
planner's estimate of the same allocation (`Memory.allocated`: no runtime, no headroom) from the
model's config alone, and the ratio estimate / measured (target: within 0.85–1.15).

Cases: DeepSpeed ZeRO-2 at 1, 2 and 4 rows per micro-batch; with gradient checkpointing at 2
and 4 rows; ZeRO-3; ZeRO-2 with the optimizer offloaded; the molt backend at offload
``none|optimizer|full``; the reference's forward. bf16 compute with float32 masters.

With ``--engines``: one `rlhf.rollout.VLLMEngine` per size (bf16, ``max_model_len`` 4096,
``gpu_memory_utilization`` 0.5, CUDA graphs, in a fresh process) and the KV-cache tokens vLLM
allocated (``num_gpu_blocks x block_size``) against the planner's `EngineLoad.kv_tokens` for
the same GPU.

Without a GPU it prints the planner's estimates only.

Usage: python benchmarks/bench_capacity.py [--json out.json] [--size 0.5B,1.5B]
       [--cases ds-z2-r2,…] [--engines]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Any

import torch

from bench_learner import SCALES, make_model, rl_batch

ROWS, LENGTH = 8, 2048


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured configuration."""

    backend: str = "deepspeed"
    rows: int = 2
    zero_stage: int = 2
    offload_optimizer: bool = False
    offload_params: bool = False
    gradient_checkpointing: bool = False
    molt_offload: str = "none"
    trains: bool = True


CASES = {
    "ds-z2-r1": Case(rows=1),
    "ds-z2-r2": Case(rows=2),
    "ds-z2-r4": Case(rows=4),
    "ds-z2-r2-gc": Case(rows=2, gradient_checkpointing=True),
    "ds-z2-r4-gc": Case(rows=4, gradient_checkpointing=True),
    "ds-z3-r2": Case(zero_stage=3),
    "ds-z2-offload-r2": Case(offload_optimizer=True),
    "ds-z3-offload-r2": Case(zero_stage=3, offload_optimizer=True, offload_params=True),
    "molt-none-r2": Case(backend="molt"),
    "molt-optimizer-r2": Case(backend="molt", molt_offload="optimizer"),
    "molt-full-r2": Case(backend="molt", molt_offload="full"),
    "reference-r2": Case(trains=False),
}


def _role(case: Case, model_dir: pathlib.Path) -> Any:
    """The run's `RoleConfig` for ``case`` (what ``--actor.*`` flags would give)."""
    from rlhf.cli.config import RoleConfig
    from rlhf.learner import DeepSpeedConfig, ModelConfig
    from rlhf.molt import FSDPConfig

    return RoleConfig(
        model=ModelConfig(path=str(model_dir), gradient_checkpointing=case.gradient_checkpointing),
        backend=case.backend,
        deepspeed=DeepSpeedConfig(
            zero_stage=case.zero_stage,
            offload_optimizer=case.offload_optimizer,
            offload_params=case.offload_params,
            bf16=True,
        ),
        fsdp=FSDPConfig(param_dtype="bfloat16", offload=case.molt_offload),
    )


def estimate(case: Case, model_dir: pathlib.Path) -> float:
    """The planner's allocator peak for ``case``, in GiB."""
    from rlhf.cli.capacity import GIB
    from rlhf.cli.dry_run import learner_memory
    from rlhf.cli.model_shape import ModelShape

    shape = ModelShape.read(model_dir, flag="--model")
    memory = learner_memory(
        _role(case, model_dir),
        shape,
        tokens=case.rows * LENGTH,
        trains=case.trains,
        outputs=shape.vocab,
    )
    return memory.allocated / GIB


def measure_child(name: str, model_dir: pathlib.Path) -> None:
    """In a fresh process: the peak allocation of ``name``'s two steps (GiB, one JSON line)."""
    from rlhf.algos import AlgoConfig, loss_normalizer
    from rlhf.cli.backends import backend_factory
    from rlhf.learner import ActionLogprobs, PPOActorObjective
    from rlhf.molt import init_distributed

    case = CASES[name]
    init_distributed()
    role = _role(case, model_dir)
    backend = backend_factory(role)(role.learner(seed=0, total_steps=10, train=case.trains))
    batch = rl_batch(rows=ROWS, length=LENGTH, vocab=json.loads(
        (model_dir / "config.json").read_text())["vocab_size"])  # fmt: skip
    micro = [
        batch.select(range(i, min(i + case.rows, ROWS))).to(backend.device)
        for i in range(0, ROWS, case.rows)
    ]
    norm = float(loss_normalizer(batch["action_mask"], mode="token-mean"))
    objective = PPOActorObjective(algo=AlgoConfig(), normalizer=norm, entropy_metric=False)
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        if case.trains:
            backend.train_micro_batches(micro, objective)
        else:
            backend.forward_micro_batches(micro, ActionLogprobs())
    torch.cuda.synchronize()
    print(json.dumps({"peak_gib": torch.cuda.max_memory_allocated() / 2**30}), flush=True)


def run_case(name: str, model_dir: pathlib.Path, size: str) -> dict[str, Any]:
    """Estimate ``name`` and, on a GPU, measure it in a child process."""
    out: dict[str, Any] = {"estimate_gib": estimate(CASES[name], model_dir)}
    if not torch.cuda.is_available():
        return out
    rendezvous = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {key: value for key, value in os.environ.items() if key not in rendezvous}
    child = subprocess.run(
        [sys.executable, __file__, "--child", name, "--model-dir", str(model_dir), "--size", size],
        capture_output=True, text=True, check=False, env=env,
    )  # fmt: skip
    if child.returncode:
        out["error"] = child.stderr[-1500:]
        return out
    out["measured_gib"] = json.loads(child.stdout.strip().splitlines()[-1])["peak_gib"]
    out["ratio_estimate_over_measured"] = out["estimate_gib"] / out["measured_gib"]
    return out


ENGINE = {"dtype": "bfloat16", "max_model_len": 4096, "gpu_memory_utilization": 0.5}


def engine_child(model_dir: pathlib.Path) -> None:
    """In a fresh process: the KV-cache tokens and batch budget vLLM chose (one JSON line)."""
    from rlhf.rollout import EngineConfig, VLLMEngine

    engine = VLLMEngine(EngineConfig(model=str(model_dir), enforce_eager=False, **ENGINE))
    engine.start()
    vllm_config = engine._engine.vllm_config
    cache = vllm_config.cache_config
    out = {
        "kv_tokens": cache.num_gpu_blocks * cache.block_size,
        "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens,
        "gpu_bytes": torch.cuda.get_device_properties(0).total_memory,
    }
    print(json.dumps(out), flush=True)
    os._exit(0)  # the engine's threads need no orderly shutdown here


def run_engine(model_dir: pathlib.Path, size: str) -> dict[str, Any]:
    """vLLM's KV-cache tokens against the planner's, for ``size``."""
    from rlhf.cli.capacity import EngineLoad
    from rlhf.cli.model_shape import ModelShape

    child = subprocess.run(
        [sys.executable, __file__, "--engine-child", "--model-dir", str(model_dir)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if child.returncode:
        return {"error": child.stderr[-1500:]}
    measured = json.loads(child.stdout.strip().splitlines()[-1])
    shape = ModelShape.read(model_dir, flag="--model")
    load = EngineLoad(
        params=shape.params, weight_bytes=2, kv_bytes_per_token=shape.kv_bytes_per_token(
            dtype_bytes=2), tp=1, pp=1, kv_heads=shape.kv_heads,
        gpu_memory_utilization=ENGINE["gpu_memory_utilization"], vocab=shape.vocab,
        max_num_seqs=256, hidden=shape.hidden, intermediate=shape.intermediate,
    )  # fmt: skip
    estimate = load.kv_tokens(measured["gpu_bytes"])
    return {
        **measured,
        "estimate_kv_tokens": estimate,
        "ratio_estimate_over_measured": estimate / measured["kv_tokens"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--size", default="0.5B,1.5B")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--engines", action="store_true", help="vLLM KV-cache sizes too")
    parser.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=sorted(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        measure_child(args.child, args.model_dir)
        return
    if args.engine_child:
        engine_child(args.model_dir)
        return
    results: dict[str, Any] = {"device": "cuda" if torch.cuda.is_available() else "cpu"}
    for size in args.size.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = pathlib.Path(tmp)
            make_model(model_dir, SCALES[size])
            for name in filter(None, args.cases.split(",")):
                key = f"{size}/{name}"
                results[key] = run_case(name, model_dir, size)
                print(key, json.dumps(results[key]), flush=True)
            if args.engines and torch.cuda.is_available():
                results[f"{size}/engine"] = run_engine(model_dir, size)
                print(f"{size}/engine", json.dumps(results[f"{size}/engine"]), flush=True)
    ratios = [r["ratio_estimate_over_measured"] for r in results.values()
              if isinstance(r, dict) and "ratio_estimate_over_measured" in r]  # fmt: skip
    if ratios:
        results["ratio_range"] = [min(ratios), max(ratios)]
        print("ratio estimate/measured:", f"{min(ratios):.3f}–{max(ratios):.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
