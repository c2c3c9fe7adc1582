"""Hybrid placement (``--train.colocate_all``) with and without turn-taking, side by side.

Three ``rlhf train grpo`` runs on the same model, prompts and seed, one after the other in
this invocation, and vLLM alone:

- turn-taking: the engines sleep while the learners train (GPUs) and the learners' DeepSpeed
  states leave the device outside training every step (`rlhf.cli.hybrid`; ``--vllm.enable_sleep
  True --train.deepspeed_enable_sleep True``, so on a CPU machine it measures what the round
  trip costs there);
- resident: ``--vllm.enable_sleep False --train.deepspeed_enable_sleep False``, every role
  keeps its memory;
- hybrid: the defaults (the engines sleep in the first step only, and after it only if
  training does not fit next to them; the learners move only when memory requires it);
- raw vLLM: ``LLM.generate`` alone on the same model, prompts per step, samples and new tokens.

Printed per run: median seconds per phase over the steps after the first (generation,
experience, training, sync and the hybrid moves), the transport's sync and the engine's own
load of it inside (``time/weight_sync_s``, ``sync/engine_load_s``), generated tokens/s, and on
GPUs the device memory free while the learners train and while the engines generate. Ratios:
step time and free memory during training of turn-taking and hybrid / resident; per run sync /
engine load and generation tokens/s / raw vLLM's.

With ``--transports object_store,cuda_ipc`` it runs the turn-taking configuration once per
``--train.weight_transport`` and prints sync and step time ratios against the first.

With ``--variants 'seeded=;unseeded=--rollout.seed_requests False'`` it runs the hybrid
configuration once per named set of extra flags (``;`` between variants, spaces between
flags), alternating ``--rounds`` times, and prints each variant's median step, generation time
and generated tokens/s as ratios against the first variant's, and each one's sync / engine
load.

With ``--baseline-python PATH`` it measures a change instead: the resident run with this
interpreter's rlhf against the same run with another environment's (e.g. the previous
commit's packages installed into a copy of the environment), alternating ``--rounds`` times;
ratio: median step time ours / baseline, per phase too (after one unrecorded warm-up run of
each; use an even number of rounds so that each side goes first equally often).

Usage: python benchmarks/bench_cli.py [--size tiny|0.5b|1.5b] [--steps 4] [--json out.json]
       [--runs turn-taking,hybrid,resident] [--baseline-python PATH --rounds 3]
(tiny on CPU, as ``nox -s bench -- cli`` runs it; 0.5b and 1.5b on the GPU machine).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_rollout import make_checkpoint

PHASES = ("generation", "experience", "training", "sync", "hybrid_training", "hybrid_sync",
          "hybrid_generation")  # fmt: skip
# A step's wall: time/sync_s holds the sync and generation moves, not the one into training.
STEP_PARTS = ("generation", "experience", "training", "sync", "hybrid_training")


def prompts(path: pathlib.Path, n: int = 256) -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randrange(40), rng.randrange(40)
            f.write(json.dumps({"input": f"{a} plus {b} is", "label": str(a + b)}) + "\n")


def run(
    name: str,
    model: pathlib.Path,
    data: pathlib.Path,
    root: pathlib.Path,
    args,
    python: str = sys.executable,
    extra: tuple[str, ...] = (),
) -> dict:
    gpu = torch.cuda.is_available()
    flags = [
        "--run_dir", str(root / name),
        "--actor.model.path", str(model),
        "--data.prompt_data", str(data),
        "--train.num_steps", str(args.steps),
        "--rollout.batch_size", str(args.prompts),
        "--rollout.n_samples_per_prompt", "4",
        "--rollout.max_new_tokens", str(args.max_new_tokens),
        "--rollout.max_len", str(args.max_new_tokens + 32),
        "--train.micro_batch_size", "8",
        "--eval.steps", "0",
        "--ckpt.export_hf", "False",
        "--train.colocate_all", "True",
        "--vllm.gpu_memory_utilization", "0.5",
        *(["--actor.deepspeed.bf16", "True", "--vllm.dtype", "bfloat16"] if gpu else []),
    ]  # fmt: skip
    if name.startswith("resident"):
        flags += ["--vllm.enable_sleep", "False", "--train.deepspeed_enable_sleep", "False"]
    elif name.startswith("turn-taking"):
        flags += ["--vllm.enable_sleep", "True", "--train.deepspeed_enable_sleep", "True"]
    # "hybrid": the defaults decide what moves (rlhf.cli.hybrid).
    flags += list(extra)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(
        [python, "-m", "rlhf.cli", "train", "grpo", *flags],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    if out.returncode:
        raise SystemExit(f"{name} run failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}")
    rows = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r][1:]  # the first step pays compile/warm-up
    med = {p: statistics.median(r.get(f"time/{p}_s", 0.0) for r in steps) for p in PHASES}
    result = {f"{p}_s": v for p, v in med.items()}
    # time/sync_s contains the sync and generation moves (the driver's sync makes them).
    result["step_s"] = sum(med[p] for p in STEP_PARTS)
    for key in ("hybrid/gpu_free_gib_training", "hybrid/gpu_free_gib_generation"):
        values = [r[key] for r in steps if key in r]
        if values:
            result[key.split("/")[1]] = min(values)
    for key in ("time/weight_sync_s", "sync/engine_load_s"):  # the transport vs the engine
        result[key.split("/")[1]] = statistics.median(r[key] for r in steps)
    # Each step after the first, and the actor's cudaMalloc retries by then (a step that
    # had to flush the allocator's cache shows as a jump).
    result["each_step_s"] = [
        round(sum(r.get(f"time/{p}_s", 0.0) for p in STEP_PARTS), 3) for r in steps
    ]
    slowest = max(steps, key=lambda r: sum(r.get(f"time/{p}_s", 0.0) for p in STEP_PARTS))
    result["slowest_step"] = {
        "step": slowest.get("step"),
        **{p: round(slowest[f"time/{p}_s"], 3) for p in PHASES if f"time/{p}_s" in slowest},
    }
    if any("hybrid/actor_alloc_retries" in r for r in steps):
        result["alloc_retries"] = [r.get("hybrid/actor_alloc_retries") for r in steps]
    parts = [f"sync/engine_{p}_s" for p in ("receive", "validate", "verify")]
    actor = [f"sync/actor_{p}_s" for p in ("send", "pack", "release")]
    for key in (*actor, "sync/engine_calls_s", *parts):  # the rest of the sync
        values = [r[key] for r in steps if key in r]
        if values:
            result[key.split("/")[1]] = statistics.median(values)
    result["tokens_per_s"] = statistics.median(
        r["rollout/response_length_mean"] * r["rollout/samples"] / r["time/generation_s"]
        for r in steps
    )
    return result


def raw_generation(model: pathlib.Path, data: pathlib.Path, args) -> dict:
    """vLLM alone (``LLM.generate``, one process) on the runs' shape: the same model, engine
    options, prompts per step, samples and new tokens; generated tokens/s over ``args.steps``
    batches after one warm-up batch."""
    code = f"""
import json, statistics, time
import torch
from vllm import LLM, SamplingParams
gpu = torch.cuda.is_available()
llm = LLM(model={str(model)!r}, dtype="bfloat16" if gpu else "float32", seed=0,
          gpu_memory_utilization=0.5, max_model_len={args.max_new_tokens + 32},
          enforce_eager=not gpu, enable_prefix_caching=True)
rows = [json.loads(x) for x in open({str(data)!r})]
params = SamplingParams(n=4, temperature=1.0, max_tokens={args.max_new_tokens}, logprobs=0)
rates = []
for step in range({args.steps} + 1):
    batch = [r["input"] for r in rows[step * {args.prompts}:(step + 1) * {args.prompts}]]
    tick = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - tick
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    if step:
        rates.append(tokens / seconds)
print("RAW", json.dumps({{"tokens_per_s": statistics.median(rates)}}))
"""
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "0" if torch.cuda.is_available() else "1"}
    if not torch.cuda.is_available():
        env["OMP_NUM_THREADS"] = "1"  # as Ray gives the engine actor (--vllm.num_cpus 1)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    if out.returncode:
        raise SystemExit(f"raw vLLM failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("RAW "))
    return json.loads(line.removeprefix("RAW "))


def compare(model: pathlib.Path, data: pathlib.Path, root: pathlib.Path, args) -> dict:
    """The resident run with this environment against ``--baseline-python``'s, alternating."""
    runs: dict[str, list[dict]] = {"ours": [], "baseline": []}
    pythons = {"ours": sys.executable, "baseline": args.baseline_python}
    for name in ("ours", "baseline"):  # warm-up: the first run after a pause is the slowest
        run(f"warmup-{name}", model, data, root, args, pythons[name])
    for r in range(args.rounds):
        for name in ("ours", "baseline")[:: 1 if r % 2 == 0 else -1]:
            result = run(f"resident-{name}-{r}", model, data, root, args, pythons[name])
            runs[name].append(result)
            print(name, r, json.dumps(result), flush=True)
    med = {
        name: {k: statistics.median(x[k] for x in results) for k in results[0]}
        for name, results in runs.items()
    }
    report: dict = {"ours": med["ours"], "baseline": med["baseline"], "rounds": args.rounds}
    for key in ("step_s", "generation_s", "experience_s", "training_s", "sync_s"):
        report[f"ratio_{key.removesuffix('_s')}_ours_over_baseline"] = med["ours"][key] / max(
            med["baseline"][key], 1e-9
        )
    report["per_round_step_ratios"] = [
        a["step_s"] / b["step_s"] for a, b in zip(runs["ours"], runs["baseline"], strict=True)
    ]
    return report


def variants(model: pathlib.Path, data: pathlib.Path, root: pathlib.Path, args) -> dict:
    """The hybrid run once per ``--variants`` entry, alternating over ``--rounds``."""
    named = dict(v.split("=", 1) for v in args.variants.split(";"))
    runs: dict[str, list[dict]] = {name: [] for name in named}
    for r in range(args.rounds):
        for name in list(named)[:: 1 if r % 2 == 0 else -1]:
            result = run(
                f"hybrid-{name}-{r}", model, data, root, args, extra=tuple(named[name].split())
            )
            runs[name].append(result)
            print(name, r, json.dumps(result), flush=True)
    report: dict = {"size": args.size, "rounds": args.rounds, "flags": named}
    med = {
        name: {
            k: statistics.median(x[k] for x in results)
            for k in ("step_s", "generation_s", "tokens_per_s", "weight_sync_s", "engine_load_s")
        }
        for name, results in runs.items()
    }
    report["median"] = med
    for name, m in med.items():  # each run's sync against its engine's own load
        report[f"sync_ratio_{name}_over_engine_load"] = m["weight_sync_s"] / max(
            m["engine_load_s"], 1e-9
        )
    first = next(iter(named))
    for name in list(named)[1:]:
        for key in ("step_s", "generation_s", "tokens_per_s"):
            report[f"ratio_{key}_{name}_over_{first}"] = med[name][key] / max(med[first][key], 1e-9)
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--baseline-python", default="")
    parser.add_argument("--transports", default="")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", default="")
    parser.add_argument("--runs", default="turn-taking,hybrid,resident")
    parser.add_argument("--variants", default="", help="name=flags;name=flags (hybrid runs)")
    args = parser.parse_args()
    root = pathlib.Path(tempfile.mkdtemp(prefix="bench-cli-"))
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    model = make_checkpoint(root, args.size, dtype)
    data = root / "prompts.jsonl"
    prompts(data)
    if args.transports:
        report = {"size": args.size, "device": "cuda" if torch.cuda.is_available() else "cpu"}
        names = args.transports.split(",")
        for t in names:
            extra = ("--train.weight_transport", t)
            report[t] = run(f"turn-taking-{t}", model, data, root, args, extra=extra)
            print(t, json.dumps(report[t]), flush=True)
        for t in names[1:]:
            for key in ("sync_s", "step_s"):
                ratio = report[t][key] / max(report[names[0]][key], 1e-9)
                report[f"ratio_{key.removesuffix('_s')}_{t}_over_{names[0]}"] = ratio
        print(json.dumps({k: v for k, v in report.items() if "ratio" in k}, indent=1))
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
        return
    if args.variants:
        report = variants(model, data, root, args)
        print(json.dumps(report, indent=1))
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
        return
    if args.baseline_python:
        report = compare(model, data, root, args)
        print(json.dumps({k: v for k, v in report.items() if "ratio" in k}, indent=1))
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
        return
    report: dict = {"size": args.size, "device": "cuda" if torch.cuda.is_available() else "cpu"}
    names = args.runs.split(",")
    for name in names:
        report[name] = run(name, model, data, root, args)
        print(name, json.dumps(report[name], indent=1), flush=True)
    report["raw_vllm"] = raw_generation(model, data, args)
    print("raw vLLM", json.dumps(report["raw_vllm"]), flush=True)
    b = report.get("resident")
    for name in names:
        a, key = report[name], name.replace("-", "_")
        if b is not None and name != "resident":
            report[f"step_time_ratio_{key}_over_resident"] = a["step_s"] / b["step_s"]
            if "gpu_free_gib_training" in a and "gpu_free_gib_training" in b:
                report[f"free_while_training_ratio_{key}_over_resident"] = a[
                    "gpu_free_gib_training"
                ] / max(b["gpu_free_gib_training"], 1e-9)
        report[f"sync_ratio_{key}_over_engine_load"] = a["weight_sync_s"] / max(
            a["engine_load_s"], 1e-9
        )
        report[f"generation_ratio_{key}_over_raw_vllm"] = (
            a["tokens_per_s"] / report["raw_vllm"]["tokens_per_s"]
        )
    print(json.dumps({k: v for k, v in report.items() if "ratio" in k}, indent=1))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
