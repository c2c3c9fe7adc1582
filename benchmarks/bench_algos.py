"""Chunked log-probs/entropy versus the naive log_softmax, side by side in one invocation.

Shape: B=4, T=2048, V=32768 float32 logits on CPU (1 GiB), temperature 1 so the naive route
needs no extra copy for the division (the baseline is as cheap as it can be made).

- Time: both variants alternate in this process, `--repeats` rounds; the ratio of medians is
  reported (chunked / naive, lower is better).
- Peak memory: each variant runs in a fresh subprocess that allocates the inputs, resets the
  kernel's peak-RSS counter (/proc/self/clear_refs) and reads VmHWM after one call; the extra
  peak above the inputs is reported and compared as a ratio.

Cases: ``logprobs`` (forward, no grad), ``logprobs+entropy`` (forward, no grad), and
``train`` (forward + backward of logprobs and entropy; the gradient of the logits, 1 GiB, is part
of both variants' peak).

Usage: python benchmarks/bench_algos.py [--repeats 5] [--json out.json] [--small]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

import torch

from rlhf.algos import logprobs_and_entropy, logprobs_from_logits

CASES = ("logprobs", "logprobs+entropy", "train")


def naive(logits: torch.Tensor, labels: torch.Tensor, case: str) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if case == "logprobs":
        return picked
    entropy = -(logp.exp() * logp).sum(-1)
    return picked.sum() + entropy.sum()


def chunked(logits: torch.Tensor, labels: torch.Tensor, case: str) -> torch.Tensor:
    if case == "logprobs":
        return logprobs_from_logits(logits, labels)
    lp, ent = logprobs_and_entropy(logits, labels)
    assert ent is not None
    return lp.sum() + ent.sum()


VARIANTS = {"naive": naive, "chunked": chunked}


def run_once(variant: str, case: str, logits: torch.Tensor, labels: torch.Tensor) -> None:
    fn = VARIANTS[variant]
    if case == "train":
        x = logits.detach().requires_grad_()
        out = fn(x, labels, case)
        out.backward()
        return
    with torch.no_grad():
        fn(logits, labels, case)


def make_inputs(shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    b, t, v = shape
    return torch.randn(b, t, v, generator=gen), torch.randint(0, v, (b, t), generator=gen)


def _status_kib(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(variant: str, case: str, shape: tuple[int, int, int]) -> None:
    """Measure one variant's extra peak RSS in this fresh process and print it as JSON."""
    logits, labels = make_inputs(shape)
    base = _status_kib("VmRSS")
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    run_once(variant, case, logits, labels)
    peak = _status_kib("VmHWM")
    print(json.dumps({"extra_peak_mib": (peak - base) / 1024}))


def peak_extra_mib(variant: str, case: str, shape: tuple[int, int, int]) -> float:
    cmd = [sys.executable, __file__, "--child", variant, case, "--shape", *map(str, shape)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["extra_peak_mib"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--shape", type=int, nargs=3, default=(4, 2048, 32768))
    parser.add_argument("--small", action="store_true", help="B=2, T=256, V=4096 smoke run")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "CASE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (2, 256, 4096) if args.small else tuple(args.shape)
    if args.child:
        child(args.child[0], args.child[1], shape)
        return

    logits, labels = make_inputs(shape)
    results = {"shape": list(shape), "threads": torch.get_num_threads(), "cases": {}}
    print(f"B, T, V = {shape}, float32, {torch.get_num_threads()} threads, {args.repeats} rounds")
    header = ("naive s", "chunked s", "time ratio", "naive MiB", "chunked MiB", "mem ratio")
    print(f"{'case':<18}" + "".join(f"{h:>13}" for h in header))
    for case in CASES:
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for v in VARIANTS:  # warm-up
            run_once(v, case, logits, labels)
        for _ in range(args.repeats):
            for v in VARIANTS:
                start = time.perf_counter()
                run_once(v, case, logits, labels)
                times[v].append(time.perf_counter() - start)
        memory = {v: peak_extra_mib(v, case, shape) for v in VARIANTS}
        med = {v: statistics.median(ts) for v, ts in times.items()}
        row = {
            "naive_s": med["naive"],
            "chunked_s": med["chunked"],
            "time_ratio": med["chunked"] / med["naive"],
            "naive_peak_mib": memory["naive"],
            "chunked_peak_mib": memory["chunked"],
            "memory_ratio": memory["chunked"] / max(memory["naive"], 1e-9),
        }
        results["cases"][case] = row
        cells = (
            f"{row['naive_s']:13.3f}{row['chunked_s']:13.3f}{row['time_ratio']:13.3f}"
            f"{row['naive_peak_mib']:13.0f}{row['chunked_peak_mib']:13.0f}{row['memory_ratio']:13.3f}"
        )
        print(f"{case:<18}{cells}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
