"""Packing and checking a weight sync (`rlhf.weights`), on a GPU when there is one.

Side by side, alternating rounds on the same buckets of a Qwen2-0.5B-shaped model (random bf16
tensors, 24 layers, 151936 × 896 embedding; ``--size tiny`` for a quick look):

- ``digests_one_pass``: `span_digests`, the bucket's digest and every tensor's from one pass
  (what `iter_buckets` does since it landed);
- ``digests_per_tensor``: one `checksum` per tensor plus one for the bucket, the baseline (on a
  GPU each ``wsum64`` synchronises with the host);
- ``pack``: `pack_buckets` of the whole model (copies into buckets and the one-pass digests);
- ``validate``: `validate_sync` as an engine runs it on receipt (bucket digests), and with
  ``check_every_tensor``.

Prints medians and ``ratio_per_tensor_over_one_pass``. ``nox -s bench -- weights``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from collections.abc import Callable

import torch

from rlhf.weights import checksum, pack_buckets, span_digests, validate_sync

SHAPES = {  # layers, hidden, intermediate, heads, kv heads, vocab
    "0.5b": (24, 896, 4864, 14, 2, 151936),
    "tiny": (2, 64, 128, 4, 2, 1000),
}


def model_tensors(size: str, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Checkpoint names and shapes of a Qwen2 model (untied head), random bf16 values."""
    layers, hidden, inter, heads, kv, vocab = SHAPES[size]
    head_dim = hidden // heads
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)

    out = [("model.embed_tokens.weight", rand(vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", rand(hidden)),
            (p + "self_attn.q_proj.weight", rand(heads * head_dim, hidden)),
            (p + "self_attn.q_proj.bias", rand(heads * head_dim)),
            (p + "self_attn.k_proj.weight", rand(kv * head_dim, hidden)),
            (p + "self_attn.k_proj.bias", rand(kv * head_dim)),
            (p + "self_attn.v_proj.weight", rand(kv * head_dim, hidden)),
            (p + "self_attn.v_proj.bias", rand(kv * head_dim)),
            (p + "self_attn.o_proj.weight", rand(hidden, heads * head_dim)),
            (p + "post_attention_layernorm.weight", rand(hidden)),
            (p + "mlp.gate_proj.weight", rand(inter, hidden)),
            (p + "mlp.up_proj.weight", rand(inter, hidden)),
            (p + "mlp.down_proj.weight", rand(hidden, inter)),
        ]
    return [*out, ("model.norm.weight", rand(hidden)), ("lm_head.weight", rand(vocab, hidden))]


def timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    tick = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - tick


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=pathlib.Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tensors = model_tensors(args.size, device)
    bucket_bytes = args.bucket_mib << 20
    buckets = pack_buckets(tensors, version=1, bucket_bytes=bucket_bytes)
    algorithm = buckets[0].checksum_algorithm
    layouts = [(b.buffer, [(t.offset, t.nbytes) for t in b.tensors]) for b in buckets]

    def one_pass() -> None:
        for buffer, spans in layouts:
            span_digests(buffer, spans, algorithm)

    def per_tensor() -> None:
        for buffer, spans in layouts:
            checksum(buffer, algorithm)
            for offset, nbytes in spans:
                checksum(buffer[offset : offset + nbytes], algorithm)

    # The two digest paths must agree before they are timed.
    for b in buckets:
        whole, parts = span_digests(b.buffer, [(t.offset, t.nbytes) for t in b.tensors], algorithm)
        assert whole == checksum(b.buffer, algorithm) == b.checksum
        assert parts == [t.checksum for t in b.tensors]
    variants: dict[str, Callable[[], object]] = {
        "digests_one_pass": one_pass,
        "digests_per_tensor": per_tensor,
        "pack": lambda: pack_buckets(tensors, version=1, bucket_bytes=bucket_bytes),
        "validate": lambda: validate_sync(buckets),
        "validate_every_tensor": lambda: validate_sync(buckets, check_every_tensor=True),
    }
    for fn in variants.values():  # warm-up: kernels, allocator
        fn()
    seen: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        names = list(variants)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            seen[name].append(timed(variants[name], device))
    report = {
        "device": str(device),
        "size": args.size,
        "algorithm": algorithm,
        "tensors": len(tensors),
        "buckets": len(buckets),
        "bytes": sum(b.header.nbytes for b in buckets),
        **{f"{name}_s": statistics.median(times) for name, times in seen.items()},
    }
    report["ratio_per_tensor_over_one_pass"] = (
        report["digests_per_tensor_s"] / report["digests_one_pass_s"]
    )
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
