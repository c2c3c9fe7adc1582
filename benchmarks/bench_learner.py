"""rlhf-learner side by side with plain baselines, in one invocation.

1. Actor train step: `DeepSpeedBackend.train_step` with `PPOActorObjective` against a plain
   DeepSpeed loop on the same model, batch, micro-batching and ZeRO stage (the loop computes
   ``log_softmax`` of the logits, the clipped PPO surrogate with a token mean, then
   ``engine.backward`` / ``engine.step``). Both engines live in this process and alternate
   rounds; ratio = median tokens/s of ours / plain (target >= 0.95).
2. Peak memory of the log-prob path (forward + backward of the actor loss on 4 x 512 tokens,
   vocabulary 16384), each variant in a fresh subprocess: `rlhf.learner.token_logprobs`
   (chunked, no full float32 log-softmax; and with ``chunked_lm_head``, no logits at all)
   against ``log_softmax(logits.float()).gather``; the peak RSS above the loaded model and
   batch is compared as a ratio (lower is better).

3. Model options: the same actor step (`DeepSpeedBackend`, `PPOActorObjective`) with one
   ``ModelConfig`` option off and on — ``packing_samples`` (padding-free) and
   ``chunked_lm_head`` — two backends in this process alternating rounds, on a batch of
   variable-length samples (lengths uniform in [max_len / 8, max_len], as RL responses vary)
   cut into the same micro-batches of rows; ratio = median tokens/s on / off. Also reports
   the padding share of the padded micro-batches.

4. ``--scale 0.5B,1.5B`` (GPU): the same side-by-side actor step in bf16 (ZeRO-2, fp32 master
   weights) on random Qwen2-shaped models of those sizes, 8 x 2048 tokens per step in micro-batches
   of 2 rows (``--micro-rows``); reports seconds per step and MFU. Model FLOPs per step =
   6 * (non-embedding params + lm_head params) * tokens + 6 * layers * hidden * seq * tokens
   (causal attention, forward + backward); MFU divides by the H200's dense bf16 peak (989 TFLOP/s).
   With ``--packing`` the packing comparison of 3 runs at those sizes too (8 rows of up to 2048
   tokens), for each attention backend of ``--attn`` (``sdpa`` builds a dense block-causal
   mask over the packed row; ``flex_attention`` skips the masked blocks).
   With ``--deepcompile`` the actor step (`DeepSpeedBackend`, `PPOActorObjective`, bf16,
   ZeRO ``--zero-stage``, default 1) with ``deepspeed.deepcompile`` off and on: two backends in
   this process alternating rounds on the same 8 x 2048-token batch as one micro-batch (the
   backend refuses DeepCompile over several: its accumulation was measured wrong), after
   ``--warmup`` untimed steps each (DeepCompile profiles its first steps, then recompiles with
   its schedule); ratio = median tokens/s on / off, both first losses (equal when the
   compiled forward is right), and the peak memory of a step above what was allocated before.

Usage: python benchmarks/bench_learner.py [--json out.json] [--quick]
       [--scale 0.5B,1.5B [--packing] [--attn sdpa,flex_attention]
        [--deepcompile [--zero-stage 1] [--warmup 8]]]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 16384,
}


# Qwen2-0.5B / Qwen2-1.5B shapes (random weights).
SCALES = {
    "0.5B": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
    },
    "1.5B": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
    },
}
H200_BF16_DENSE_FLOPS = 989e12


def make_model(path: pathlib.Path, shape: dict[str, int] = SHAPE) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(path)


def step_flops(shape: dict[str, int], *, rows: int, length: int) -> float:
    """Model FLOPs of one training step (forward + backward) on ``rows x length`` tokens."""
    h, layers, inter = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]
    head = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter  # q, o, k, v, gate/up/down
    matmul_params = layers * per_layer + shape["vocab_size"] * h  # + lm_head
    tokens = rows * length
    return 6.0 * matmul_params * tokens + 6.0 * layers * h * length * tokens


def rl_batch(*, rows: int, length: int, vocab: int) -> Any:
    from rlhf.learner import collate

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (rows, length), generator=gen).tolist()
    prompt = length // 4
    masks = [[0] * prompt + [1] * (length - prompt)] * rows
    batch = collate(ids, pad_token_id=0, per_token={"action_mask": masks})
    m = batch["action_mask"]
    batch.fields["old_logprobs"] = (-5.0 + 0.1 * torch.randn(m.shape, generator=gen)) * m
    batch.fields["advantages"] = torch.randn(m.shape, generator=gen) * m
    return batch


def varlen_batch(*, rows: int, max_len: int, vocab: int) -> Any:
    """Samples of lengths uniform in [max_len / 8, max_len]: a quarter prompt (at most 64
    tokens), the rest actions."""
    from rlhf.learner import collate

    gen = torch.Generator().manual_seed(2)
    lengths = torch.randint(max(max_len // 8, 2), max_len + 1, (rows,), generator=gen).tolist()
    ids = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    masks = [[0] * min(n // 4, 64) + [1] * (n - min(n // 4, 64)) for n in lengths]
    batch = collate(ids, pad_token_id=0, per_token={"action_mask": masks})
    m = batch["action_mask"]
    batch.fields["old_logprobs"] = (-5.0 + 0.1 * torch.randn(m.shape, generator=gen)) * m
    batch.fields["advantages"] = torch.randn(m.shape, generator=gen) * m
    return batch


def plain_loss(model: Any, batch: Any, normalizer: float) -> torch.Tensor:
    """The PPO clip surrogate written directly, as a hand-made loop would."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    logp = logp.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    mask = batch["action_mask"][:, 1:]
    ratio = torch.exp(logp - batch["old_logprobs"][:, 1:])
    adv = batch["advantages"][:, 1:]
    surrogate = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    return (surrogate * mask).sum() / normalizer


def bench_step(
    model_dir: pathlib.Path,
    *,
    rounds: int,
    stage: int,
    shape: dict[str, int] = SHAPE,
    rows: int = 8,
    length: int = 256,
    micro_rows: int = 4,
    bf16: bool = False,
    profile: bool = False,
) -> dict[str, float]:
    import deepspeed

    from rlhf.algos import AlgoConfig, loss_normalizer
    from rlhf.learner import (
        DeepSpeedBackend,
        DeepSpeedConfig,
        LearnerConfig,
        ModelConfig,
        OptimizerConfig,
        PPOActorObjective,
        load_model,
    )
    from rlhf.learner.deepspeed_backend import ds_config
    from rlhf.learner.optim import build_optimizer

    config = LearnerConfig(
        model=ModelConfig(path=str(model_dir)),
        optimizer=OptimizerConfig(lr=1e-6, grad_clip=1.0),
    )
    engine = DeepSpeedConfig(zero_stage=stage, bf16=bf16)
    ours = DeepSpeedBackend(config, deepspeed=engine)
    model = load_model(config.model)
    optimizer, scheduler = build_optimizer(model, config.optimizer)
    plain, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config(config, engine)
    )
    batch = rl_batch(rows=rows, length=length, vocab=shape["vocab_size"])
    micro = [
        batch.select(range(i, min(i + micro_rows, rows))).to(ours.device)
        for i in range(0, rows, micro_rows)
    ]
    norm = float(loss_normalizer(batch["action_mask"], mode="token-mean"))
    # The plain loop logs no entropy; neither does ours here (the same work on both sides).
    objective = PPOActorObjective(algo=AlgoConfig(), normalizer=norm, entropy_metric=False)
    tokens = int(batch.attention_mask.sum())

    sync = torch.cuda.synchronize if ours.device.type == "cuda" else (lambda: None)

    def run_plain() -> None:
        plain.train()
        for mb in micro:
            plain.backward(plain_loss(plain, mb, norm), scale_wrt_gas=False)
        plain.step()
        sync()

    def run_ours() -> None:
        ours.train_micro_batches(micro, objective)
        sync()

    times: dict[str, list[float]] = {"plain": [], "ours": []}
    for r in range(rounds + 1):
        for name, fn in (("plain", run_plain), ("ours", run_ours))[:: 1 if r % 2 else -1]:
            start = time.perf_counter()
            fn()
            if r:
                times[name].append(time.perf_counter() - start)
    if profile:  # where each side's step time goes (GPU kernels and host)
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        for name, fn in (("plain", run_plain), ("ours", run_ours)):
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14)
            print(f"--- profile {name} ---\n{table}", flush=True)
    plain_tps = tokens / statistics.median(times["plain"])
    ours_tps = tokens / statistics.median(times["ours"])
    flops = step_flops(shape, rows=rows, length=length)
    return {
        "zero_stage": float(stage),
        "tokens_per_step": float(tokens),
        "plain_s_per_step": statistics.median(times["plain"]),
        "ours_s_per_step": statistics.median(times["ours"]),
        "ours_tflops": flops / statistics.median(times["ours"]) / 1e12,
        "ours_mfu_h200": flops / statistics.median(times["ours"]) / H200_BF16_DENSE_FLOPS,
        "plain_tokens_per_s": plain_tps,
        "ours_tokens_per_s": ours_tps,
        "ratio_ours_over_plain": ours_tps / plain_tps,
    }


def bench_option(
    model_dir: pathlib.Path,
    *,
    option: str,
    rounds: int,
    shape: dict[str, int] = SHAPE,
    rows: int = 16,
    max_len: int = 256,
    micro_rows: int = 4,
    bf16: bool = False,
    attn: str = "sdpa",
) -> dict[str, Any]:
    """Actor step with one boolean ``ModelConfig`` option off and on (``packing_samples``,
    ``chunked_lm_head``): two backends, the same micro-batches of rows, alternating rounds."""
    from rlhf.algos import AlgoConfig, loss_normalizer
    from rlhf.learner import (
        DeepSpeedBackend,
        DeepSpeedConfig,
        LearnerConfig,
        ModelConfig,
        OptimizerConfig,
        PPOActorObjective,
    )

    backends = {
        name: DeepSpeedBackend(
            LearnerConfig(
                model=ModelConfig(path=str(model_dir), attn_implementation=attn, **{option: value}),
                optimizer=OptimizerConfig(lr=1e-6, grad_clip=1.0),
            ),
            deepspeed=DeepSpeedConfig(zero_stage=2, bf16=bf16),
        )
        for name, value in (("off", False), ("on", True))
    }
    device = backends["off"].device
    batch = varlen_batch(rows=rows, max_len=max_len, vocab=shape["vocab_size"])
    micro = [
        batch.select(range(i, min(i + micro_rows, rows))).to(device)
        for i in range(0, rows, micro_rows)
    ]
    norm = float(loss_normalizer(batch["action_mask"], mode="token-mean"))
    objective = PPOActorObjective(algo=AlgoConfig(), normalizer=norm, entropy_metric=False)
    tokens = int(batch.attention_mask.sum())
    padded_tokens = sum(m.input_ids.numel() for m in micro)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in backends}
    peak_gib: dict[str, float] = {}
    for r in range(rounds + 1):
        for name in list(backends)[:: 1 if r % 2 else -1]:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            start = time.perf_counter()
            backends[name].train_micro_batches(micro, objective)
            sync()
            if r:
                times[name].append(time.perf_counter() - start)
            if r and device.type == "cuda":  # the peak above what was allocated before it
                extra = (torch.cuda.max_memory_allocated(device) - base) / 2**30
                peak_gib[name] = max(peak_gib.get(name, 0.0), extra)
    off_s, on_s = (statistics.median(times[n]) for n in ("off", "on"))
    if peak_gib:
        peaks = {f"{n}_step_extra_peak_gib": v for n, v in peak_gib.items()}
        peaks["ratio_extra_peak_on_over_off"] = peak_gib["on"] / peak_gib["off"]
    else:
        peaks = {}
    return {
        **peaks,
        "option": option,
        "attn": attn,
        "real_tokens_per_step": float(tokens),
        "padding_share": 1.0 - tokens / padded_tokens,
        "off_s_per_step": off_s,
        "on_s_per_step": on_s,
        "ratio_tokens_per_s_on_over_off": off_s / on_s,
    }


def bench_deepcompile(
    model_dir: pathlib.Path,
    *,
    rounds: int,
    warmup: int,
    stage: int,
    shape: dict[str, int] = SHAPE,
    rows: int = 8,
    length: int = 2048,
) -> dict[str, Any]:
    """The bf16 actor step with ``deepspeed.deepcompile`` off and on: two backends, the same
    fixed-shape batch as one micro-batch (no recompiles), ``warmup`` untimed steps each, then
    ``rounds`` alternating timed ones."""
    from rlhf.algos import AlgoConfig, loss_normalizer
    from rlhf.learner import (
        DeepSpeedBackend,
        DeepSpeedConfig,
        LearnerConfig,
        ModelConfig,
        OptimizerConfig,
        PPOActorObjective,
    )

    backends = {
        name: DeepSpeedBackend(
            LearnerConfig(
                model=ModelConfig(path=str(model_dir)),
                optimizer=OptimizerConfig(lr=1e-6, grad_clip=1.0),
            ),
            deepspeed=DeepSpeedConfig(zero_stage=stage, bf16=True, deepcompile=value),
        )
        for name, value in (("off", False), ("on", True))
    }
    device = backends["off"].device
    batch = rl_batch(rows=rows, length=length, vocab=shape["vocab_size"])
    micro = [batch.to(device)]
    norm = float(loss_normalizer(batch["action_mask"], mode="token-mean"))
    objective = PPOActorObjective(algo=AlgoConfig(), normalizer=norm, entropy_metric=False)
    tokens = int(batch.attention_mask.sum())
    times: dict[str, list[float]] = {name: [] for name in backends}
    losses: dict[str, float] = {}
    peak_gib: dict[str, float] = {}
    for r in range(warmup + rounds):
        for name in list(backends)[:: 1 if r % 2 else -1]:
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            start = time.perf_counter()
            out = backends[name].train_micro_batches(micro, objective)
            torch.cuda.synchronize(device)
            losses.setdefault(name, out["loss"])  # the first step's: both start equal
            if r >= warmup:
                times[name].append(time.perf_counter() - start)
                extra = (torch.cuda.max_memory_allocated(device) - base) / 2**30
                peak_gib[name] = max(peak_gib.get(name, 0.0), extra)
    off_s, on_s = (statistics.median(times[n]) for n in ("off", "on"))
    flops = step_flops(shape, rows=rows, length=length)
    return {
        "zero_stage": stage,
        "tokens_per_step": float(tokens),
        "first_loss_off": losses["off"],
        "first_loss_on": losses["on"],
        "off_s_per_step": off_s,
        "on_s_per_step": on_s,
        "on_mfu_h200": flops / on_s / H200_BF16_DENSE_FLOPS,
        "off_step_extra_peak_gib": peak_gib["off"],
        "on_step_extra_peak_gib": peak_gib["on"],
        "ratio_tokens_per_s_on_over_off": off_s / on_s,
    }


def _status_kib(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_child(variant: str, model_dir: pathlib.Path) -> None:
    """In a fresh process: load the model and batch, reset the peak counter, run one forward +
    backward of the actor loss, print the peak above the starting RSS."""
    from rlhf.learner import ModelConfig, load_model, token_logprobs

    model = load_model(ModelConfig(path=str(model_dir)))
    batch = rl_batch(rows=4, length=512, vocab=SHAPE["vocab_size"])
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    start = _status_kib("VmRSS")
    if variant == "naive":
        loss = plain_loss(model, batch, 1.0)
    else:
        logp, _ = token_logprobs(
            model,
            batch.input_ids,
            batch.attention_mask,
            chunked_lm_head=variant == "chunked_head",
        )
        mask = batch["action_mask"]
        ratio = torch.exp(logp - batch["old_logprobs"])
        adv = batch["advantages"]
        loss = (-torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * mask).sum()
    loss.backward()
    print(json.dumps({"extra_kib": _status_kib("VmHWM") - start}))


def bench_memory(model_dir: pathlib.Path) -> dict[str, float]:
    """Extra peak RSS of one forward + backward, each variant in a fresh process."""
    extra = {}
    for variant in ("naive", "chunked", "chunked_head"):
        result = subprocess.run(
            [sys.executable, __file__, "--peak-child", variant, "--model", str(model_dir)],
            capture_output=True,
            text=True,
            check=True,
        )
        extra[variant] = json.loads(result.stdout.strip().splitlines()[-1])["extra_kib"] / 1024
    return {
        "naive_extra_peak_mib": extra["naive"],
        "chunked_extra_peak_mib": extra["chunked"],
        "chunked_head_extra_peak_mib": extra["chunked_head"],
        "ratio_extra_peak_chunked_over_naive": extra["chunked"] / extra["naive"],
        "ratio_extra_peak_chunked_head_over_naive": extra["chunked_head"] / extra["naive"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=pathlib.Path, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--scale", default="", help="GPU: comma-separated sizes of SCALES")
    parser.add_argument("--profile", action="store_true", help="with --scale: profile a step")
    parser.add_argument("--micro-rows", type=int, default=2, help="with --scale: rows per micro")
    parser.add_argument("--packing", action="store_true", help="with --scale: packed vs padded")
    parser.add_argument("--attn", default="sdpa", help="with --packing: attention backends")
    parser.add_argument("--chunked", action="store_true", help="with --scale: chunked lm_head")
    parser.add_argument(
        "--deepcompile", action="store_true", help="with --scale: deepcompile off vs on"
    )
    parser.add_argument("--zero-stage", type=int, default=1, help="with --deepcompile")
    parser.add_argument("--warmup", type=int, default=8, help="with --deepcompile: untimed")
    parser.add_argument("--peak-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=pathlib.Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_child:
        peak_child(args.peak_child, args.model)
        return
    rounds = 3 if args.quick else 7
    results: dict[str, Any] = {"device": "cuda" if torch.cuda.is_available() else "cpu"}
    if args.scale:
        if not torch.cuda.is_available():
            parser.error("--scale needs a GPU")
        for size in args.scale.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                make_model(pathlib.Path(tmp), SCALES[size])
                if args.deepcompile:
                    key = f"deepcompile_{size}_zero{args.zero_stage}"
                    results[key] = bench_deepcompile(
                        pathlib.Path(tmp), rounds=rounds, warmup=args.warmup,
                        stage=args.zero_stage, shape=SCALES[size],
                    )  # fmt: skip
                    print(f"{key}:", json.dumps(results[key]), flush=True)
                    torch.cuda.empty_cache()
                    continue
                if args.chunked:
                    key = f"chunked_lm_head_{size}"
                    results[key] = bench_option(
                        pathlib.Path(tmp), option="chunked_lm_head", rounds=rounds,
                        shape=SCALES[size], rows=8, max_len=2048,
                        micro_rows=args.micro_rows, bf16=True,
                    )  # fmt: skip
                    print(f"{key}:", json.dumps(results[key]), flush=True)
                    torch.cuda.empty_cache()
                    continue
                if args.packing:
                    for attn in args.attn.split(","):
                        key = f"packing_{size}_{attn}"
                        results[key] = bench_option(
                            pathlib.Path(tmp), option="packing_samples", rounds=rounds,
                            shape=SCALES[size], rows=8,
                            max_len=2048, micro_rows=args.micro_rows, bf16=True, attn=attn,
                        )  # fmt: skip
                        print(f"{key}:", json.dumps(results[key]), flush=True)
                        torch.cuda.empty_cache()
                    continue
                results[f"actor_step_{size}"] = bench_step(
                    pathlib.Path(tmp), rounds=rounds, stage=2, shape=SCALES[size],
                    rows=8, length=2048, micro_rows=args.micro_rows, bf16=True,
                    profile=args.profile,
                )  # fmt: skip
            print(f"actor_step_{size}:", json.dumps(results[f"actor_step_{size}"]), flush=True)
            torch.cuda.empty_cache()
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = pathlib.Path(tmp) / "model"
        make_model(model_dir)
        results["memory"] = bench_memory(model_dir)
        print("memory:", json.dumps(results["memory"]), flush=True)
        results["actor_step"] = bench_step(model_dir, rounds=rounds, stage=2)
        print("actor_step:", json.dumps(results["actor_step"]), flush=True)
        for option in ("packing_samples", "chunked_lm_head"):
            results[option] = bench_option(model_dir, option=option, rounds=rounds)
            print(f"{option}:", json.dumps(results[option]), flush=True)
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
