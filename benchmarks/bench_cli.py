"""Hybrid placement (``--train.colocate_all``) with and without turn-taking, side by side.

Two ``rlhf train grpo`` runs on the same model, prompts and seed, one after the other in this
invocation:

- turn-taking: the engines sleep while the learners train (GPUs) and the learners' DeepSpeed
  states leave the device outside training (`rlhf.cli.hybrid`; ``--train.deepspeed_enable_sleep
  True``, so on a CPU machine it measures what the round trip costs there);
- resident: ``--vllm.enable_sleep False --train.deepspeed_enable_sleep False``, every role
  keeps its memory.

Printed per run: median seconds per phase over the steps after the first (generation,
experience, training, sync and the hybrid moves), and on GPUs the device memory free while the
learners train and while the engines generate. Ratios: step time turn-taking / resident, free
memory during training turn-taking / resident.

With ``--transports object_store,cuda_ipc`` it runs the turn-taking configuration once per
``--train.weight_transport`` and prints sync and step time ratios against the first.

With ``--baseline-python PATH`` it measures a change instead: the resident run with this
interpreter's rlhf against the same run with another environment's (e.g. the previous
commit's packages installed into a copy of the environment), alternating ``--rounds`` times;
ratio: median step time ours / baseline, per phase too (after one unrecorded warm-up run of
each; use an even number of rounds so that each side goes first equally often).

Usage: python benchmarks/bench_cli.py [--size tiny|0.5b] [--steps 4] [--json out.json]
       [--baseline-python PATH --rounds 3]
(tiny on CPU, as ``nox -s bench -- cli`` runs it; 0.5b on the GPU machine).
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
    else:
        flags += ["--train.deepspeed_enable_sleep", "True"]
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
    result["step_s"] = sum(med[p] for p in ("generation", "experience", "training", "sync"))
    result["step_s"] += med["hybrid_training"]
    for key in ("hybrid/gpu_free_gib_training", "hybrid/gpu_free_gib_generation"):
        values = [r[key] for r in steps if key in r]
        if values:
            result[key.split("/")[1]] = min(values)
    return result


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
    if args.baseline_python:
        report = compare(model, data, root, args)
        print(json.dumps({k: v for k, v in report.items() if "ratio" in k}, indent=1))
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
        return
    report: dict = {"size": args.size, "device": "cuda" if torch.cuda.is_available() else "cpu"}
    for name in ("turn-taking", "resident"):
        report[name] = run(name, model, data, root, args)
        print(name, json.dumps(report[name], indent=1), flush=True)
    a, b = report["turn-taking"], report["resident"]
    report["step_time_ratio_turn_taking_over_resident"] = a["step_s"] / b["step_s"]
    if "gpu_free_gib_training" in a and "gpu_free_gib_training" in b:
        report["free_while_training_ratio"] = a["gpu_free_gib_training"] / max(
            b["gpu_free_gib_training"], 1e-9
        )
    print(json.dumps({k: v for k, v in report.items() if "ratio" in k}, indent=1))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
