"""The demo's RL stage against TRL's `GRPOTrainer`, side by side on one machine.

Both start from the same warm-started model (the demo's SFT, made once here), train GRPO on the
same prompts with the same budget (``--steps`` steps of 16 prompts × 8 samples, at most 6 new
tokens, temperature 1, lr 1e-3 constant, grad clip 1, KL off, one optimizer step per batch,
token-mean loss), and are scored by one evaluator: transformers sampling 4 answers at
temperature 1 for each of the 200 held-out prompts (pass@1 = mean exact match). Runs alternate
(ours, TRL, ours, TRL, …), each in a fresh process; a warm-up run of each goes first and is not
counted (DeepSpeed's op build, compile caches).

Per run: time to step 1 (process start → first step done), median step wall time (steps 2…N),
RL wall time, final pass@1. Ratios: ours / TRL for step time and time to step 1.

Ours is ``rlhf demo --sft_model …`` (vLLM engine, DeepSpeed learner, Ray), with its start-up
record (``startup.json``) and per-step ``time/step_s``; TRL's run is this file with ``--trl``
(generation with transformers ``generate``, one process). Thread counts: each of our processes
runs torch with one thread (Ray gives each actor one) except the learner's rank inside its train
and forward calls, which uses the machine's cores (`rlhf.cli.backends.compute_threads`); TRL's
single process uses torch's default (``--trl-threads``, default: the machine's cores); all are
printed.

``--shape HIDDENxLAYERS`` (e.g. ``512x4``) times both on a random model of that shape instead
(the warm start's tokenizer and vocabulary, ``intermediate_size`` 3 × hidden, heads of 32):
how the ratio moves as the model grows. Such a model learns nothing in the budget; its pass@1 is
printed but means nothing.

``--floor`` times, in this one process and alternating, what bounds a step from below whatever
runs around it: our vLLM engine sampling the step's 16 prompts × 8 answers (in process, no Ray),
transformers ``generate`` sampling the same (TRL's way), and one plain torch AdamW step on 128
such sequences; vLLM's sampling plus that step is the least a step with vLLM rollout can take.

Usage (nox installs TRL in a session of its own):
``nox -s bench_trl -- [--steps 40] [--rounds 2] [--shape 512x4] [--floor]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

TRL_VERSION = "1.16.0"


# -- TRL's side (runs in its own process) ---------------------------------------------------
def run_trl(*, model: str, train: str, out: str, steps: int, seed: int, threads: int) -> None:
    started = time.time()
    import psutil
    import torch

    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    process_start = psutil.Process().create_time()
    rows = [json.loads(line) for line in pathlib.Path(train).read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": r["input"], "label": r["label"]} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(model)

    def exact_match(completions: list[str], label: list[str], **_: Any) -> list[float]:
        return [float(c.strip() == y) for c, y in zip(completions, label, strict=True)]

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.ends.append(time.time())

    clock = Clock()
    config = GRPOConfig(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=128,
        gradient_accumulation_steps=1,
        num_generations=8,
        max_completion_length=6,
        temperature=1.0,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        beta=0.0,
        loss_type="dapo",  # token-mean over the batch, as our grpo preset
        scale_rewards="group",
        num_iterations=1,
        seed=seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
        reward_funcs=exact_match,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.train()
    trainer.save_model(str(pathlib.Path(out) / "final"))
    tokenizer.save_pretrained(str(pathlib.Path(out) / "final"))
    ends = clock.ends
    record = {
        "to_step_1_s": ends[0] - process_start,
        "step_s": [b - a for a, b in itertools.pairwise(ends)],
        "rl_wall_s": ends[-1] - started,
        "threads": torch.get_num_threads(),
    }
    (pathlib.Path(out) / "bench.json").write_text(json.dumps(record))


def sample_answers(model: Any, tokenizer: Any, ids: Any) -> Any:
    """transformers ``generate`` as TRL samples here: temperature 1, no top-k, ≤ 6 new tokens,
    no gradients. ``ids``: [rows, prompt_len] (the task's prompts are all one length);
    returns [rows, prompt_len + ≤ 6]."""
    import torch

    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=6,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )


# -- one evaluator for both -----------------------------------------------------------------
def pass_at_1(model_dir: str, eval_rows: list[dict[str, str]], *, seed: int) -> float:
    """Mean exact match of 4 sampled answers (temperature 1, ≤ 6 new tokens) per prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [r["input"] for r in eval_rows for _ in range(4)]
    labels = [r["label"] for r in eval_rows for _ in range(4)]
    ids = torch.tensor([tokenizer.encode(p) for p in prompts])  # equal lengths ("dddd:")
    out = sample_answers(model, tokenizer, ids)
    answers = tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
    return sum(a.strip() == y for a, y in zip(answers, labels, strict=True)) / len(labels)


def model_shape(shape: str) -> str:
    """``--shape``'s value, checked before anything runs: ``HIDDENxLAYERS``, hidden a positive
    multiple of 64 (heads of 32, two query heads per key-value head), layers positive."""
    hidden, _, layers = shape.partition("x")
    if not (hidden.isdigit() and layers.isdigit() and int(hidden) % 64 == 0 and int(hidden)):
        raise argparse.ArgumentTypeError(
            f"{shape!r}: expected HIDDENxLAYERS with hidden a positive multiple of 64, e.g. 512x4"
        )
    if not int(layers):
        raise argparse.ArgumentTypeError(f"{shape!r}: at least one layer")
    return shape


def random_model(sft: pathlib.Path, out: pathlib.Path, shape: str) -> pathlib.Path:
    """A random Qwen2 of ``shape`` (`model_shape`) with ``sft``'s tokenizer and special
    tokens, saved in ``out`` (kept: a later run with the same ``--work`` reuses it)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    hidden, _, layers = shape.partition("x")
    if (out / "config.json").is_file():
        return out
    base = json.loads((sft / "config.json").read_text())
    AutoTokenizer.from_pretrained(sft).save_pretrained(out)
    config = Qwen2Config(
        vocab_size=base["vocab_size"],
        hidden_size=int(hidden),
        intermediate_size=3 * int(hidden),
        num_hidden_layers=int(layers),
        num_attention_heads=int(hidden) // 32,
        num_key_value_heads=int(hidden) // 64,
        max_position_embeddings=base["max_position_embeddings"],
        tie_word_embeddings=True,
        **{k: base[k] for k in ("eos_token_id", "pad_token_id", "bos_token_id")},
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    return out


def floor(model: str, train: str, *, repeats: int, seed: int, threads: int) -> dict[str, Any]:
    """Median seconds of vLLM's sampling, transformers' sampling and a plain training step on
    the demo's step shape (see the module docstring), alternating, after 3 untimed rounds."""
    import asyncio
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.agents import SamplingParams
    from rlhf.cli.demo import DemoConfig, rl_config
    from rlhf.rollout import EngineConfig, VLLMEngine

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(x) for x in pathlib.Path(train).read_text().splitlines()][:16]
    prompts = [tokenizer.encode(r["input"]) for r in rows]  # equal lengths ("dddd:")
    # The engine the demo's RL stage runs (its --vllm section and max_len), here in process;
    # only those sections of its config are read, so its data paths need not be the eval's.
    files = dict.fromkeys(("train", "eval"), pathlib.Path(train))
    demo = rl_config(DemoConfig(seed=seed), pathlib.Path(model), files)
    engine = VLLMEngine(
        EngineConfig.of(demo.vllm, model=model, max_model_len=demo.rollout.max_len, seed=seed)
    )
    engine.start()
    sampling = SamplingParams(
        max_new_tokens=6, temperature=1.0, stop_token_ids=(tokenizer.eos_token_id,)
    )
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    learner = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(learner.parameters(), lr=1e-6)
    ids = torch.tensor([p for p in prompts for _ in range(8)])  # [128, prompt_len]

    async def vllm_step(k: int) -> None:
        groups = (
            engine.generate_group(p, dataclasses.replace(sampling, seed=seed + 128 * k + 8 * i), 8)
            for i, p in enumerate(prompts)
        )
        await asyncio.gather(*groups)

    def hf_step(k: int) -> torch.Tensor:
        torch.manual_seed(seed + k)
        return sample_answers(hf, tokenizer, ids)

    sequences = hf_step(0)  # [128, prompt_len + ≤ 6]
    advantages = torch.randn(sequences.shape[0], 1)

    def train_step(k: int) -> None:
        logits = learner(sequences).logits[:, :-1]  # [128, T - 1, vocab]
        logp = logits.log_softmax(-1).gather(-1, sequences[:, 1:, None]).squeeze(-1)
        loss = -(logp[:, ids.shape[1] - 1 :] * advantages).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(learner.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    parts: dict[str, Callable[[int], Any]] = {
        "vllm_generate_s": lambda k: asyncio.run(vllm_step(k)),
        "hf_generate_s": hf_step,
        "train_step_s": train_step,
    }
    times: dict[str, list[float]] = {name: [] for name in parts}
    for k in range(3 + repeats):
        for name, part in parts.items():
            tick = time.perf_counter()
            part(k)
            if k >= 3:
                times[name].append(time.perf_counter() - tick)
    engine.shutdown()
    med = {name: statistics.median(v) for name, v in times.items()}
    return {
        **med,
        "ratio_vllm_over_hf_generate": med["vllm_generate_s"] / med["hf_generate_s"],
        "floor_vllm_step_s": med["vllm_generate_s"] + med["train_step_s"],
        "threads": threads,
    }


# -- the driver -----------------------------------------------------------------------------
def _ours(work: pathlib.Path, name: str, sft: str, steps: int, seed: int) -> dict[str, Any]:
    run = work / name
    cmd = ["rlhf", "demo", "--run_dir", str(run), "--sft_model", sft, "--rl_steps", str(steps)]
    cmd += ["--eval_steps", str(steps), "--seed", str(seed)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ))
    summary = json.loads((run / "summary.json").read_text())
    startup = json.loads((run / "rl" / "startup.json").read_text())
    rows = [json.loads(x) for x in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
    step_s = [r["time/step_s"] for r in rows if "time/step_s" in r][1:]
    return {
        "to_step_1_s": startup["to_step_1_s"],
        "startup": startup,
        "step_s": statistics.median(step_s),
        "rl_wall_s": summary["rl_wall_s"],
        "model": str(run / "rl" / "final"),
        "threads": 1,
    }


def _trl(work: pathlib.Path, name: str, sft: str, train: str, steps: int, seed: int, threads: int):
    out = work / name
    cmd = [sys.executable, __file__, "--trl", "--model", sft, "--train", train, "--out", str(out)]
    cmd += ["--steps", str(steps), "--seed", str(seed), "--trl-threads", str(threads)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    record = json.loads((out / "bench.json").read_text())
    return {
        "to_step_1_s": record["to_step_1_s"],
        "step_s": statistics.median(record["step_s"][1:]),
        "rl_wall_s": record["rl_wall_s"],
        "model": str(out / "final"),
        "threads": record["threads"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trl-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=pathlib.Path, default=None)
    parser.add_argument("--work", type=pathlib.Path, default=None)
    parser.add_argument(
        "--shape", type=model_shape, default=None, help="HIDDENxLAYERS: a random model instead"
    )
    parser.add_argument("--floor", action="store_true", help="also the step's floor (docstring)")
    # TRL's run (internal)
    parser.add_argument("--trl", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--train", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl:
        run_trl(
            model=args.model,
            train=args.train,
            out=args.out,
            steps=args.steps,
            seed=args.seed,
            threads=args.trl_threads,
        )
        return

    work = args.work or pathlib.Path(tempfile.mkdtemp(prefix="bench-trl-"))
    print(f"[bench_trl] work dir {work}; warm start and warm-up runs first", flush=True)
    if not (work / "warm" / "sft" / "final").is_dir():  # a --work of an earlier run keeps it
        subprocess.run(
            ["rlhf", "demo", "--run_dir", str(work / "warm"), "--rl_steps", "3"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    sft = str(work / "warm" / "sft" / "final")
    if args.shape:
        sft = str(random_model(pathlib.Path(sft), work / f"random-{args.shape}", args.shape))
        print(f"[bench_trl] a random {args.shape} model: {sft}", flush=True)
    assets = work / "warm" / "assets"
    train = str(assets / "train.jsonl")
    eval_rows = [json.loads(x) for x in (assets / "eval.jsonl").read_text().splitlines()]
    _trl(work, "trl-warm", sft, train, 3, args.seed, args.trl_threads)

    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "trl": []}
    for k in range(args.rounds):
        for side in ("ours", "trl") if k % 2 == 0 else ("trl", "ours"):
            if side == "ours":
                result = _ours(work, f"ours-{k}", sft, args.steps, args.seed + k)
            else:
                result = _trl(
                    work, f"trl-{k}", sft, train, args.steps, args.seed + k, args.trl_threads
                )
            result["pass@1"] = pass_at_1(result["model"], eval_rows, seed=args.seed)
            runs[side].append(result)
            print(
                f"[bench_trl] round {k} {side}: step {result['step_s']:.3f} s, "
                f"to step 1 {result['to_step_1_s']:.1f} s, RL wall {result['rl_wall_s']:.1f} s, "
                f"pass@1 {result['pass@1']:.3f}",
                flush=True,
            )

    from rlhf.cli.backends import compute_threads

    def med(side: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[side])

    report = {
        "steps": args.steps,
        "rounds": args.rounds,
        "shape": args.shape or "the demo's SFT model",
        "threads": {
            "ours_per_process": 1,
            "ours_learner_computing": compute_threads(num_ranks=1, gpu=False, beside_engines=False),
            "trl": runs["trl"][0]["threads"],
        },
        "sft_pass@1": pass_at_1(sft, eval_rows, seed=args.seed),
        **{
            f"{side}_{key}": med(side, key)
            for side in runs
            for key in ("step_s", "to_step_1_s", "rl_wall_s", "pass@1")
        },
        "ours_startup_phases_s": runs["ours"][-1]["startup"]["phases_s"],
        "ratio_step_ours_over_trl": med("ours", "step_s") / med("trl", "step_s"),
        "ratio_to_step_1_ours_over_trl": med("ours", "to_step_1_s") / med("trl", "to_step_1_s"),
        "per_round": runs,
    }
    if args.floor:
        report["floor"] = floor(sft, train, repeats=20, seed=args.seed, threads=os.cpu_count() or 1)
        report["floor"]["ratio_floor_over_trl_step"] = report["floor"]["floor_vllm_step_s"] / med(
            "trl", "step_s"
        )
    print(json.dumps({k: v for k, v in report.items() if k != "per_round"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
