"""The capacity planner (``rlhf train … --dry_run``: `rlhf.learner.capacity`, `rlhf.molt.capacity`,
`rlhf.rollout.capacity`) against measured peaks.

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

With ``--largest``: the largest model each offload level trains on this machine (one GPU,
its host memory). The planner picks, per level, the most decoder layers of Qwen2.5-7B's width
(`WIDE`, untied head) whose plan fits the GPU (`Memory.total`) and the host (`Memory.host`
within `HOST_SHARE` of the memory available); that model then takes one PPO actor step on
8 × 2048 tokens (one row per micro-batch, gradient checkpointing on) in a fresh process, which
reports its peak device allocation, its peak resident host memory and the step's seconds; a
step that fails is tried one layer smaller (`LARGEST_RETRIES`).
The weights are random bf16 safetensors written once, a file per layer; each size is a folder
of links to its first layers.

Without a GPU it prints the planner's estimates only.

Usage: python benchmarks/bench_capacity.py [--json out.json] [--size 0.5B,1.5B]
       [--cases ds-z2-r2,…] [--engines] [--largest ds-z2,molt-optimizer,…]
       [--layers N] [--store DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time
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

LARGEST = {
    "ds-z2": Case(rows=1, gradient_checkpointing=True),
    "ds-z2-offload": Case(rows=1, gradient_checkpointing=True, offload_optimizer=True),
    "ds-z3-offload": Case(
        rows=1,
        gradient_checkpointing=True,
        zero_stage=3,
        offload_optimizer=True,
        offload_params=True,
    ),
    "molt-none": Case(backend="molt", rows=1, gradient_checkpointing=True),
    "molt-optimizer": Case(
        backend="molt", rows=1, gradient_checkpointing=True, molt_offload="optimizer"
    ),
    "molt-full": Case(backend="molt", rows=1, gradient_checkpointing=True, molt_offload="full"),
}
"""Offload levels of ``--largest``: each with the settings that make a model smallest on the
device (one row per micro-batch, gradient checkpointing)."""

WIDE = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}
"""Qwen2.5-7B's width; ``--largest`` varies only the number of layers."""

HOST_SHARE = 0.85
"""The part of the host's available memory a plan's offloaded states may take (the rest: the
process's own memory, 5-7 GiB in the steps measured on an H100)."""

MAX_LAYERS = 96

NO_GPU_PLANS_FOR = 80 * 2**30
"""Without a GPU, ``--largest`` prints the plans for a GPU of this size (an H100's 80 GiB)."""

LARGEST_RETRIES = 2
"""``--largest``: sizes tried one layer smaller after the planned one failed."""

CHILD_TIMEOUT_S = 480
"""A measuring child that runs longer than this is stopped (its case reports the timeout)."""


def _role(case: Case, model_dir: pathlib.Path) -> Any:
    """The run's `RoleConfig` for ``case`` (what ``--actor.*`` flags would give)."""
    from rlhf.cli.sections import RoleConfig
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


def plan(case: Case, model_dir: pathlib.Path) -> Any:
    """The planner's `Memory` of one rank of ``case`` (device parts, host)."""
    from rlhf.cli.dry_run import learner_memory
    from rlhf.learner.model_shape import ModelShape

    shape = ModelShape.read(model_dir, flag="--model")
    return learner_memory(
        _role(case, model_dir), shape, tokens=case.rows * LENGTH, trains=case.trains,
        outputs=shape.vocab,
    )  # fmt: skip


def estimate(case: Case, model_dir: pathlib.Path) -> float:
    """The planner's allocator peak for ``case``, in GiB."""
    from rlhf.learner.capacity import GIB

    return plan(case, model_dir).allocated / GIB


def measure_child(name: str, model_dir: pathlib.Path, *, steps: int = 2) -> None:
    """In a fresh process: the peak allocation of ``name``'s ``steps`` steps (GiB), the peak
    resident host memory and each step's seconds (one JSON line)."""
    from rlhf.algos import AlgoConfig, loss_normalizer
    from rlhf.cli.backends import backend_factory
    from rlhf.learner import ActionLogprobs, PPOActorObjective
    from rlhf.molt import init_distributed

    case = {**CASES, **LARGEST}[name]
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
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        if case.trains:
            backend.train_micro_batches(micro, objective)
        else:
            backend.forward_micro_batches(micro, ActionLogprobs())
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    out = {
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30,
        "step_s": seconds,
    }
    print(json.dumps(out), flush=True)


def _measure(name: str, model_dir: pathlib.Path, *, steps: int = 2) -> dict[str, Any]:
    """``measure_child`` of ``name`` in a fresh process: its JSON line, or ``{"error": …}``."""
    rendezvous = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {key: value for key, value in os.environ.items() if key not in rendezvous}
    try:
        child = subprocess.run(
            [sys.executable, __file__, "--child", name, "--model-dir", str(model_dir),
             "--steps", str(steps)],
            capture_output=True, text=True, check=False, env=env, timeout=CHILD_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after {CHILD_TIMEOUT_S} s"}
    if child.returncode:
        return {"error": f"exit {child.returncode}: {child.stderr[-1500:]}"}
    return json.loads(child.stdout.strip().splitlines()[-1])


def run_case(name: str, model_dir: pathlib.Path) -> dict[str, Any]:
    """Estimate ``name`` and, on a GPU, measure it in a child process."""
    out: dict[str, Any] = {"estimate_gib": estimate(CASES[name], model_dir)}
    if not torch.cuda.is_available():
        return out
    measured = _measure(name, model_dir)
    if "error" in measured:
        return out | measured
    out["measured_gib"] = measured["peak_gib"]
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
    from rlhf.learner.model_shape import ModelShape
    from rlhf.rollout.capacity import EngineLoad

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


def wide_config(layers: int) -> dict[str, Any]:
    """config.json of a `WIDE` Qwen2 model with ``layers`` decoder layers."""
    from transformers import Qwen2Config

    config = Qwen2Config(**WIDE, num_hidden_layers=layers, max_position_embeddings=4096)
    return config.to_dict() | {"torch_dtype": "bfloat16", "architectures": ["Qwen2ForCausalLM"]}


def write_random_layers(root: pathlib.Path, layers: int) -> dict[str, str]:
    """Random bf16 weights of a `WIDE` model with ``layers`` layers under ``root``: the
    embedding, final norm and head in ``rest.safetensors``, layer ``i`` in
    ``layer-<i>.safetensors`` (every layer the same values: memory and time do not depend on
    them); files already there are kept. Returns ``{weight name: file
    name}``."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config.from_dict(wide_config(layers)))
    files: dict[str, dict[str, torch.Tensor]] = {}
    weight_map = {}
    drawn: dict[str, torch.Tensor] = {}  # one layer's values, written under every layer's names
    for name, meta in model.state_dict().items():
        parts = name.split(".")
        in_layer = parts[1:2] == ["layers"]
        file = f"layer-{parts[2]}.safetensors" if in_layer else "rest.safetensors"
        weight_map[name] = file
        if (root / file).exists():
            continue
        key = ".".join(parts[3:]) if in_layer else name
        if key not in drawn:
            if name.endswith("norm.weight"):
                drawn[key] = torch.ones(meta.shape, dtype=torch.bfloat16)
            elif name.endswith(".bias"):
                drawn[key] = torch.zeros(meta.shape, dtype=torch.bfloat16)
            else:
                drawn[key] = torch.empty(meta.shape, dtype=torch.bfloat16).normal_(std=0.02)
        files.setdefault(file, {})[name] = drawn[key]
    for file, tensors in files.items():
        save_file(tensors, str(root / file), metadata={"format": "pt"})
    return weight_map


def wide_model(store: pathlib.Path, weight_map: dict[str, str], layers: int) -> pathlib.Path:
    """A folder holding the `WIDE` model of ``layers`` layers: its config, an index and links
    to the files of its layers in ``store``."""
    folder = store / f"layers-{layers}"
    folder.mkdir(exist_ok=True)
    keep = {"rest.safetensors"} | {f"layer-{i}.safetensors" for i in range(layers)}
    mine = {name: file for name, file in weight_map.items() if file in keep}
    for file in keep:
        link = folder / file
        if not link.exists():
            link.symlink_to(store / file)
    (folder / "config.json").write_text(json.dumps(wide_config(layers)))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": mine})
    )
    return folder


def machine_bytes() -> tuple[int | None, int]:
    """(the GPU's total memory, None without one; the host memory available now), in bytes,
    read without creating a CUDA context here (the children need all of the device)."""
    if shutil.which("nvidia-smi") is None:
        gpu = None
    else:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, check=True,
        ).stdout.split()[0]  # fmt: skip
    meminfo = dict(
        line.split(":", 1) for line in pathlib.Path("/proc/meminfo").read_text().splitlines()
    )
    host = int(meminfo["MemAvailable"].split()[0]) * 1024
    limit = pathlib.Path("/sys/fs/cgroup/memory.max")
    if limit.is_file() and limit.read_text().strip() != "max":
        used = int(pathlib.Path("/sys/fs/cgroup/memory.current").read_text())
        host = min(host, int(limit.read_text()) - used)
    return (None if gpu is None else int(gpu) * 2**20), host


def plan_folder(store: pathlib.Path, layers: int) -> pathlib.Path:
    """A folder holding only the config of the `WIDE` model of ``layers`` layers (what the
    planner reads)."""
    folder = store / f"plan-{layers}"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(wide_config(layers)))
    return folder


def largest_layers(case: Case, store: pathlib.Path, *, gpu: int, host: int) -> dict[str, Any]:
    """The most `WIDE` layers whose plan of ``case`` fits ``gpu`` and ``HOST_SHARE`` of
    ``host`` bytes, with the plan of that model and of one layer more."""
    from rlhf.learner.model_shape import ModelShape

    best = None
    for layers in range(1, MAX_LAYERS + 1):
        folder = plan_folder(store, layers)
        memory = plan(case, folder)
        params = ModelShape.read(folder, flag="--model").params
        entry = {
            "layers": layers,
            "params_b": params / 1e9,
            "plan_total_gib": memory.total / 2**30,
            "plan_allocated_gib": memory.allocated / 2**30,
            "host_gib": memory.host / 2**30,
        }
        if memory.total > gpu or memory.host > HOST_SHARE * host:
            bound = "gpu" if memory.total > gpu else "host"
            return {"largest": best, "next": entry | {"bound": bound}}
        best = entry
    return {"largest": best, "next": None}


def run_largest(
    names: list[str], store: pathlib.Path, *, layers: int | None = None
) -> dict[str, Any]:
    """``--largest``: per offload level, the planner's largest `WIDE` model and, on a GPU, one
    step of it (of ``layers`` layers instead, when given: a size to check). A step that fails
    (out of device memory, or killed by the host's OOM killer) is tried again one layer
    smaller, at most `LARGEST_RETRIES` times: the first step that completes is the level's
    measured largest, and each failed size is kept."""
    found_gpu, host = machine_bytes()
    gpu = found_gpu or NO_GPU_PLANS_FOR
    out: dict[str, Any] = {"gpu_gib": gpu / 2**30, "host_available_gib": host / 2**30}
    weight_map: dict[str, str] = {}

    def step(name: str, layers: int) -> dict[str, Any]:
        # Progress as it goes: a run cut short still shows how far it came.
        print(f"largest {name}: one step of {layers} layers", flush=True)
        start = time.perf_counter()
        weight_map.update(write_random_layers(store, layers))
        written = time.perf_counter() - start
        measured = _measure(name, wide_model(store, weight_map, layers), steps=1)
        return measured | {"weights_written_s": written, "layers": layers}

    for name in names:
        found = largest_layers(LARGEST[name], store, gpu=gpu, host=host)
        result: dict[str, Any] = {"plan": found}
        out[name] = result
        if found_gpu is None:  # no GPU here: the plans only
            print(f"largest {name} (planned for {gpu / 2**30:.0f} GiB):", json.dumps(result))
            continue
        size = layers or (found["largest"]["layers"] if found["largest"] else 0)
        failed = []
        while size >= 1 and len(failed) <= LARGEST_RETRIES:
            measured = step(name, size)
            if "error" not in measured:
                planned = plan(LARGEST[name], plan_folder(store, size))
                result["measured"] = measured
                result["ratio_plan_over_measured"] = (
                    planned.allocated / 2**30 / measured["peak_gib"]
                )
                if planned.host:
                    result["ratio_host_measured_over_plan"] = measured["host_peak_gib"] / (
                        planned.host / 2**30
                    )
                break
            failed.append(measured)
            size -= 1
        result["failed"] = failed
        print(f"largest {name}:", json.dumps(result), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--size", default="0.5B,1.5B")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--engines", action="store_true", help="vLLM KV-cache sizes too")
    parser.add_argument("--largest", default="", help=f"offload levels of {sorted(LARGEST)}")
    parser.add_argument(
        "--store", type=pathlib.Path, help="with --largest: a folder kept for the weights"
    )
    parser.add_argument(
        "--layers", type=int, help="with --largest: step this many layers, not the plan's"
    )
    parser.add_argument("--steps", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=sorted({*CASES, *LARGEST}), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        measure_child(args.child, args.model_dir, steps=args.steps)
        return
    if args.engine_child:
        engine_child(args.model_dir)
        return
    results: dict[str, Any] = {"device": "cuda" if torch.cuda.is_available() else "cpu"}
    if args.largest:
        names = args.largest.split(",")
        unknown = sorted(set(names) - set(LARGEST))
        if unknown:
            parser.error(f"--largest: unknown {unknown}; choose from {sorted(LARGEST)}")
        if args.store:  # kept for the next invocation (its weight files are reused)
            args.store.mkdir(parents=True, exist_ok=True)
            results["largest"] = run_largest(names, args.store, layers=args.layers)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                results["largest"] = run_largest(names, pathlib.Path(tmp), layers=args.layers)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return
    for flag, given, known in (("--size", args.size, SCALES), ("--cases", args.cases, CASES)):
        unknown = sorted(set(filter(None, given.split(","))) - set(known))
        if unknown:
            parser.error(f"{flag}: unknown {unknown}; choose from {sorted(known)}")
    for size in args.size.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = pathlib.Path(tmp)
            make_model(model_dir, SCALES[size])
            for name in filter(None, args.cases.split(",")):
                key = f"{size}/{name}"
                results[key] = run_case(name, model_dir)
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
