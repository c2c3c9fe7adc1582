"""rlhf-learner side by side with plain baselines, in one invocation.

1. Actor train step: `DeepSpeedBackend.train_step` with `PPOActorObjective` against a plain
   DeepSpeed loop on the same model, batch, micro-batching and ZeRO stage (the loop computes
   ``log_softmax`` of the logits, the clipped PPO surrogate with a token mean, then
   ``engine.backward`` / ``engine.step``). Both engines live in this process and alternate
   rounds; ratio = median tokens/s of ours / plain (target >= 0.95).
2. Peak memory of the log-prob path (forward + backward of the actor loss on 4 x 512 tokens,
   vocabulary 16384), each variant in a fresh subprocess: `rlhf.learner.token_logprobs`
   (chunked, no full float32 log-softmax) against ``log_softmax(logits.float()).gather``; the
   peak RSS above the loaded model and batch is compared as a ratio (lower is better).

Usage: python benchmarks/bench_learner.py [--json out.json] [--quick]
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


def make_model(path: pathlib.Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPE, max_position_embeddings=2048, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(path)


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


def bench_step(model_dir: pathlib.Path, *, rounds: int, stage: int) -> dict[str, float]:
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
        deepspeed=DeepSpeedConfig(zero_stage=stage),
    )
    ours = DeepSpeedBackend(config)
    model = load_model(config.model)
    optimizer, scheduler = build_optimizer(model, config.optimizer)
    plain, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config(config)
    )
    batch = rl_batch(rows=8, length=256, vocab=SHAPE["vocab_size"])
    micro = [batch.select(range(0, 4)), batch.select(range(4, 8))]
    norm = float(loss_normalizer(batch["action_mask"], mode="token-mean"))
    # The plain loop logs no entropy; neither does ours here (the same work on both sides).
    objective = PPOActorObjective(algo=AlgoConfig(), normalizer=norm, entropy_metric=False)
    tokens = int(batch.attention_mask.sum())

    def run_plain() -> None:
        plain.train()
        for mb in micro:
            plain.backward(plain_loss(plain, mb, norm), scale_wrt_gas=False)
        plain.step()

    def run_ours() -> None:
        ours.train_step(micro, objective)

    times: dict[str, list[float]] = {"plain": [], "ours": []}
    for r in range(rounds + 1):
        for name, fn in (("plain", run_plain), ("ours", run_ours))[:: 1 if r % 2 else -1]:
            start = time.perf_counter()
            fn()
            if r:
                times[name].append(time.perf_counter() - start)
    plain_tps = tokens / statistics.median(times["plain"])
    ours_tps = tokens / statistics.median(times["ours"])
    return {
        "zero_stage": float(stage),
        "tokens_per_step": float(tokens),
        "plain_tokens_per_s": plain_tps,
        "ours_tokens_per_s": ours_tps,
        "ratio_ours_over_plain": ours_tps / plain_tps,
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
        logp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
        mask = batch["action_mask"]
        ratio = torch.exp(logp - batch["old_logprobs"])
        adv = batch["advantages"]
        loss = (-torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * mask).sum()
    loss.backward()
    print(json.dumps({"extra_kib": _status_kib("VmHWM") - start}))


def bench_memory(model_dir: pathlib.Path) -> dict[str, float]:
    """Extra peak RSS of one forward + backward, each variant in a fresh process."""
    extra = {}
    for variant in ("naive", "chunked"):
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
        "ratio_extra_peak_chunked_over_naive": extra["chunked"] / extra["naive"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=pathlib.Path, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--peak-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=pathlib.Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_child:
        peak_child(args.peak_child, args.model)
        return
    rounds = 3 if args.quick else 7
    results: dict[str, Any] = {"device": "cuda" if torch.cuda.is_available() else "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = pathlib.Path(tmp) / "model"
        make_model(model_dir)
        results["memory"] = bench_memory(model_dir)
        print("memory:", json.dumps(results["memory"]), flush=True)
        results["actor_step"] = bench_step(model_dir, rounds=rounds, stage=2)
        print("actor_step:", json.dumps(results["actor_step"]), flush=True)
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
