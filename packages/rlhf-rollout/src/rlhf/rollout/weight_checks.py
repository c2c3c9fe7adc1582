"""What a vLLM engine checks and loads in a weight sync: the checkpoint's tensor list a sync
is validated against, the comparison of what the workers serve with what was sent, and the
loaders that run on the engine thread and on each worker (`rlhf.rollout.VLLMEngine`'s
``update_weights`` and ``verify_weights``)."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Collection, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from rlhf.rollout.errors import EngineError
from rlhf.rollout.readback import TIED, LiveDigest, refresh_tied_lm_head
from rlhf.weights import (
    DTYPES,
    TensorMeta,
    WeightBucket,
    as_uint8,
    digest_of,
    iter_tensors,
    pack_buckets,
)

if TYPE_CHECKING:
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.worker.gpu_worker import Worker

_SAFETENSORS_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "U8": "uint8",
    "BOOL": "bool",
}


def read_checkpoint_params(model_dir: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Names, shapes and dtypes of the tensors in a checkpoint's safetensors (headers only)."""
    import struct

    files = sorted(pathlib.Path(model_dir).glob("*.safetensors"))
    if not files:
        raise EngineError(
            f"no .safetensors files in {model_dir!r}: cannot check weight syncs against it"
        )
    params: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in files:
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                dtype = str(info["dtype"])
                params[name] = (tuple(info["shape"]), _SAFETENSORS_DTYPES.get(dtype, dtype))
    return params


def _covers(entries: Sequence[LiveDigest], shape: Sequence[int]) -> bool:
    """The workers' slices make up the whole tensor (one whole copy, or slices along one dim
    leaving no gap)."""
    if any(e.dim is None for e in entries):
        return True
    dims = {e.dim for e in entries if e.dim is not None}
    if len(dims) != 1:
        return False
    (dim,) = dims
    reached = 0
    for start, stop in sorted((e.start, e.stop) for e in entries):
        if start > reached:
            return False
        reached = max(reached, stop)
    return reached >= shape[dim]


def _expected(bucket: WeightBucket, meta: TensorMeta, entry: LiveDigest, algorithm: str) -> str:
    """The digest the engine must report for ``entry`` if it serves the sync's tensor: the
    sender's own checksum when it covers the same bytes, else the digest of the tensor (its
    slice) cast to the engine's dtype."""
    if entry.dim is None and bucket.checksum_algorithm == algorithm and meta.dtype == entry.dtype:
        return meta.checksum
    raw = as_uint8(bucket.buffer)[meta.offset : meta.offset + meta.nbytes]
    if raw.storage_offset() % DTYPES[meta.dtype].itemsize:
        raw = raw.clone()  # a sender that did not align this tensor
    tensor = raw.view(DTYPES[meta.dtype]).view(meta.shape)
    if entry.dim is not None:
        tensor = tensor.narrow(entry.dim, entry.start, entry.stop - entry.start)
    cast = tensor.to(DTYPES[entry.dtype]).contiguous()
    return digest_of(algorithm)(cast.view(-1).view(torch.uint8))


def load_on_worker(worker: Worker, buckets: list[WeightBucket]) -> None:
    """On each vLLM worker (in its own process under tensor parallelism, which receives the
    sync whole and keeps its slices through vLLM's weight loaders): layer-wise reload of the
    checkpoint-format tensors, then the tied head's refresh."""
    worker.reload_weights(weights_iterator=iter_tensors(buckets), is_checkpoint_format=True)
    refresh_tied_lm_head(worker)


def load_buckets(llm_engine: LLMEngine, buckets: list[WeightBucket]) -> None:
    """On the engine thread: every worker loads the sync."""
    # vLLM annotates the method as taking the worker alone; ``args`` passes the rest.
    llm_engine.collective_rpc(load_on_worker, args=(buckets,))  # pyright: ignore[reportArgumentType]
    # Requests in flight (a paused partial rollout) are preempted and recomputed with the new
    # weights, so no KV block computed with the old ones survives.
    if not llm_engine.reset_prefix_cache(reset_running_requests=True):
        raise EngineError("vLLM could not reset its prefix cache after a weight load")


def unserved(
    buckets: Sequence[WeightBucket],
    live: dict[str, list[LiveDigest]],
    algorithm: str,
    *,
    names: Collection[str] | None = None,
) -> tuple[list[str], list[str]]:
    """The sent tensors (only ``names`` when given) that the workers' digests ``live`` show
    served otherwise, and those no worker (or not every slice) reported: ``(differ,
    absent)``. A tied ``lm_head`` is compared with the tensor it is tied to."""
    sent = {t.name: (b, t) for b in buckets for t in b.tensors}
    for name, source in TIED.items():
        if name in live and name not in sent and source in sent:
            sent[name] = sent[source]
    if names is not None:
        sent = {k: v for k, v in sent.items() if k in names}
    differ, absent = [], []
    for name, (bucket, meta) in sent.items():
        entries = live.get(name, [])
        if not _covers(entries, meta.shape):
            absent.append(name)  # no worker, or not every slice, reported
        elif any(_expected(bucket, meta, e, algorithm) != e.digest for e in entries):
            differ.append(name)
    return differ, absent


def checkpoint_buckets(model_dir: str, bucket_bytes: int) -> list[WeightBucket]:
    """Every tensor of ``model_dir``'s safetensors files as one version-0 sync."""
    from safetensors import safe_open

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in sorted(pathlib.Path(model_dir).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, f.get_tensor(name)

    return pack_buckets(tensors(), version=0, bucket_bytes=bucket_bytes)
