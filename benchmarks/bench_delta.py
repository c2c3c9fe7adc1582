"""Delta sync against full sync, side by side (`rlhf.weights` transports, CPU).

A Qwen2-shaped model (``--size 0.5b``: 24 layers, 151936 × 896 embedding; ``tiny`` for a quick
look) trains as a learner keeps it: fp32 master weights, sent as bf16. Each step moves every
master weight by ``lr`` in the direction of a random sign (an Adam update is about ``lr`` per
element in its early steps, whatever the gradient's scale), so how many bf16 values change
follows from the learning rate and the weights' magnitudes (std 0.02), not from this script.

Per step, alternating which goes first, the same bf16 state is synced to a receiving Ray actor
(another process, as an engine is) through a full transport and its delta form: shared memory
against ``shared_memory_delta`` and a gloo broadcast against ``broadcast_delta``. Each sync is
timed from the first bucket packed to the receiver's validated, rebuilt buckets (the receiver
checks every sync by its checksums). Prints, per learning rate, the changed fraction per step,
bytes on the wire and median seconds of each, and the ratios delta/full.

``nox -s bench -- delta`` (``-- delta --size tiny`` for a quick look).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import ray
import torch

from rlhf.weights import iter_buckets, transport, validate_sync

SHAPES = {  # layers, hidden, intermediate, heads, kv heads, vocab
    "0.5b": (24, 896, 4864, 14, 2, 151936),
    "tiny": (2, 64, 128, 4, 2, 1000),
}


def master_weights(size: str) -> dict[str, torch.Tensor]:
    """fp32 weights of a Qwen2-shaped model (untied head), std 0.02; norms at 1."""
    layers, hidden, inter, heads, kv, vocab = SHAPES[size]
    d = hidden // heads
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    out = {"model.embed_tokens.weight": rand(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": rand(heads * d, hidden),
            p + "self_attn.q_proj.bias": rand(heads * d),
            p + "self_attn.k_proj.weight": rand(kv * d, hidden),
            p + "self_attn.k_proj.bias": rand(kv * d),
            p + "self_attn.v_proj.weight": rand(kv * d, hidden),
            p + "self_attn.v_proj.bias": rand(kv * d),
            p + "self_attn.o_proj.weight": rand(hidden, heads * d),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
        })  # fmt: skip
    out["model.norm.weight"] = torch.ones(hidden)
    out["lm_head.weight"] = rand(vocab, hidden)
    return out


def step(master: dict[str, torch.Tensor], *, lr: float, seed: int) -> None:
    """One Adam-like update in place: every weight moves by ``lr`` (random sign)."""
    gen = torch.Generator().manual_seed(seed)
    for t in master.values():
        t.add_(torch.randint(0, 2, t.shape, generator=gen, dtype=torch.int8).float().mul_(2 * lr)
               .sub_(lr))  # fmt: skip


@ray.remote(num_cpus=0)
class Engine:
    """A receiving end of every transport measured, as `rlhf.rollout`'s actor builds it."""

    def __init__(self) -> None:
        from rlhf.weights import receivers

        self.receivers = receivers()
        self.members: dict[str, object] = {}

    def join(self, kind: str, group: object) -> None:
        self.members[kind] = transport(kind).join(group, rank=1)  # type: ignore[misc]

    def receive(self, sync: object) -> int:
        _, receiver = self.receivers[type(sync)]
        return validate_sync(receiver.receive(sync))

    def receive_group(self, kind: str) -> int:
        return validate_sync(self.members[kind].receive())  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--json", type=pathlib.Path, default=None)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    engine = Engine.remote()
    pairs = {"shared_memory": "shared_memory_delta", "broadcast": "broadcast_delta"}
    senders: dict[str, object] = {}
    for kind in [k for pair in pairs.items() for k in pair]:
        spec = transport(kind)
        if spec.grouped:
            assert spec.new_group is not None
            assert spec.join is not None
            group = spec.new_group(world_size=2, device="cpu", host="127.0.0.1")
            joined = engine.join.remote(kind, group)
            senders[kind] = spec.join(group, rank=0)
            ray.get(joined)
        else:
            assert spec.sender is not None
            senders[kind] = spec.sender()

    def sync(kind: str, state: dict[str, torch.Tensor], version: int) -> float:
        sender = senders[kind]
        tick = time.perf_counter()
        buckets = iter_buckets(state.items(), version=version, bucket_bytes=args.bucket_mib << 20)
        if transport(kind).grouped:
            got = engine.receive_group.remote(kind)
            sender.send(buckets)  # type: ignore[attr-defined]
        else:
            got = engine.receive.remote(sender.send(buckets))  # type: ignore[attr-defined]
        assert ray.get(got) == version
        return time.perf_counter() - tick

    report: dict[str, object] = {"size": args.size, "bucket_mib": args.bucket_mib, "lrs": {}}
    for lr in args.lrs:
        master = master_weights(args.size)
        seen: dict[str, list[float]] = {k: [] for k in senders}
        fractions, sent_bytes, full_bytes = [], [], 0
        version = 0
        for s in range(args.steps + 1):  # step 0: the first (whole) sync, not measured
            if s:
                step(master, lr=lr, seed=s)
            state = {k: v.to(torch.bfloat16) for k, v in master.items()}
            version += 1
            order = [k for pair in pairs.items() for k in pair]
            for kind in reversed(order) if s % 2 else order:
                seen[kind].append(sync(kind, state, version))
            if s == 0:
                for times in seen.values():
                    times.clear()
                continue
            m = senders["shared_memory_delta"].metrics()  # type: ignore[attr-defined]
            fractions.append(m["changed_fraction"])
            sent_bytes.append(m["bytes_sent"])
            full_bytes = m["bytes_full"]
        medians = {k: statistics.median(v) for k, v in seen.items()}
        report["lrs"][str(lr)] = {  # type: ignore[index]
            "changed_fraction_per_step": fractions,
            "bytes_full": full_bytes,
            "bytes_sent_delta_median": statistics.median(sent_bytes),
            "ratio_bytes_delta_over_full": statistics.median(sent_bytes) / full_bytes,
            **{f"{k}_s": v for k, v in medians.items()},
            **{f"ratio_time_{d}_over_{f}": medians[d] / medians[f] for f, d in pairs.items()},
        }
        print(json.dumps({"lr": lr, **report["lrs"][str(lr)]}, indent=1), flush=True)  # type: ignore[index]
    for sender in senders.values():
        sender.close()  # type: ignore[attr-defined]
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    ray.shutdown()


if __name__ == "__main__":
    main()
