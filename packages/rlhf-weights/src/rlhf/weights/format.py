"""The weight-sync wire format: buckets of packed tensors with checksums.

A sync is an ordered list of `WeightBucket` objects sharing one ``version``. Each bucket holds
one flat byte buffer and the metadata of the tensors packed into it: ``(name, dtype, shape,
offset, checksum)`` with ``offset`` in bytes into the buffer (a multiple of `ALIGN`, so a
receiver views every tensor without copying). The bucket carries a checksum of its whole
buffer; each tensor carries one of its own bytes, so a mismatch names the parameter. Names are
checkpoint (Hugging Face) names, as a trainer's ``named_parameters`` spells them; an inference
engine's loader maps them onto its fused parameters.

The buffer is any bytes-like object (host transports: a shared-memory ``memoryview``, a NumPy
array from Ray's object store) or a 1-D ``torch.uint8`` tensor on any device (CUDA IPC and
broadcast transports). A transport moves buffers; the `BucketHeader` travels beside them,
as itself or in its plain-data form (`BucketHeader.to_wire`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, TypedDict

import torch

ALIGN = 64
"""Byte alignment of every tensor inside its bucket."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
"""Wire names of the dtypes a sync may carry."""

DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

Buffer = bytes | bytearray | memoryview | torch.Tensor | Any
"""A bucket buffer: a bytes-like object or a 1-D ``torch.uint8`` tensor (any device)."""


class WeightSyncError(ValueError):
    """A sync was rejected (malformed, incomplete or corrupted); a receiver that raises it
    keeps its previous weights."""


def as_uint8(buffer: Buffer) -> torch.Tensor:
    """A 1-D ``torch.uint8`` view of ``buffer`` without copying; never write through it."""
    if isinstance(buffer, torch.Tensor):
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise TypeError(
                f"a tensor bucket buffer must be 1-D uint8, got {buffer.dtype} "
                f"{tuple(buffer.shape)}"
            )
        return buffer
    view = memoryview(buffer).cast("B")
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # Read-only sources (Ray's object store) are shared, not copied; receivers only read.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.frombuffer(view, dtype=torch.uint8)


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor sits in its bucket.

    Attributes:
        name: Checkpoint name, e.g. ``model.layers.0.self_attn.q_proj.weight``.
        dtype: A key of `DTYPES`.
        shape: Tensor shape.
        offset: Byte offset into the bucket's buffer.
        checksum: Digest of the tensor's bytes (the bucket's algorithm).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    checksum: str

    @property
    def nbytes(self) -> int:
        """Size of the tensor in bytes."""
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


class WireHeader(TypedDict):
    """`BucketHeader.to_wire`'s plain, JSON-able form; ``tensors`` holds one ``[name, dtype,
    shape, offset, checksum]`` list per tensor."""

    version: int
    index: int
    total: int | None
    nbytes: int
    checksum: str
    checksum_algorithm: str
    tensors: list[list[str | int | list[int]]]


_WIRE_KEYS = ("version", "index", "total", "nbytes", "checksum", "checksum_algorithm", "tensors")


@dataclass(frozen=True)
class BucketHeader:
    """A bucket without its buffer: what a transport sends beside the bytes it moves.

    Attributes:
        version: Weight version of the whole sync (the same in every bucket).
        index: Position of this bucket, 0-based.
        total: Number of buckets in the sync; None while a streaming sender does not know it
            yet (it fills it in once the last bucket is out; `validate_sync` refuses None).
        tensors: Metadata of the tensors in this bucket.
        nbytes: Size of the buffer in bytes.
        checksum: Digest of the buffer.
        checksum_algorithm: A key of `rlhf.weights.CHECKSUMS`, for the bucket and its tensors.
    """

    version: int
    index: int
    total: int | None
    tensors: tuple[TensorMeta, ...]
    nbytes: int
    checksum: str
    checksum_algorithm: str

    def to_wire(self) -> WireHeader:
        """The header as plain, JSON-able data (`from_wire` reads it back)::

        {"version": int, "index": int, "total": int | None, "nbytes": int,
         "checksum": str, "checksum_algorithm": str,
         "tensors": [[name, dtype, [dim, ...], offset, checksum], ...]}
        """
        return {
            "version": self.version,
            "index": self.index,
            "total": self.total,
            "nbytes": self.nbytes,
            "checksum": self.checksum,
            "checksum_algorithm": self.checksum_algorithm,
            "tensors": [
                [t.name, t.dtype, list(t.shape), t.offset, t.checksum] for t in self.tensors
            ],
        }

    @classmethod
    def from_wire(cls, header: BucketHeader | Mapping[str, Any]) -> BucketHeader:
        """A header from its plain-data form; headers pass through.

        Raises:
            WeightSyncError: naming the missing or malformed field.
        """
        if isinstance(header, BucketHeader):
            return header
        missing = [k for k in _WIRE_KEYS if k not in header]
        if missing:
            raise WeightSyncError(f"bucket header lacks {missing}; it has {sorted(header)}")
        try:
            tensors = tuple(
                TensorMeta(str(n), str(d), tuple(int(x) for x in shape), int(o), str(c))
                for n, d, shape, o, c in header["tensors"]
            )
            total = header["total"]
            return cls(
                version=int(header["version"]),
                index=int(header["index"]),
                total=None if total is None else int(total),
                tensors=tensors,
                nbytes=int(header["nbytes"]),
                checksum=str(header["checksum"]),
                checksum_algorithm=str(header["checksum_algorithm"]),
            )
        except (TypeError, ValueError) as exc:
            raise WeightSyncError(
                f"malformed bucket header (index {header.get('index')!r}): {exc}; tensors must "
                "be [name, dtype, shape, offset, checksum] entries"
            ) from exc

    def with_buffer(self, buffer: Buffer) -> WeightBucket:
        """The bucket carrying ``buffer`` (which must be ``nbytes`` long)."""
        return WeightBucket(header=self, buffer=buffer)

    def with_total(self, total: int) -> BucketHeader:
        """This header announcing ``total`` buckets in its sync."""
        return replace(self, total=total)


@dataclass(frozen=True)
class WeightBucket:
    """One bucket of a weight sync: a header and the buffer it describes.

    Attributes:
        header: Version, position, tensors and checksums.
        buffer: The packed bytes (bytes-like, or a 1-D uint8 tensor on any device).
    """

    header: BucketHeader
    buffer: Buffer

    @property
    def version(self) -> int:
        return self.header.version

    @property
    def index(self) -> int:
        return self.header.index

    @property
    def total(self) -> int | None:
        return self.header.total

    @property
    def tensors(self) -> tuple[TensorMeta, ...]:
        return self.header.tensors

    @property
    def checksum(self) -> str:
        return self.header.checksum

    @property
    def checksum_algorithm(self) -> str:
        return self.header.checksum_algorithm

    @property
    def nbytes(self) -> int:
        """Size of the buffer in bytes."""
        return as_uint8(self.buffer).numel()

    def with_total(self, total: int) -> WeightBucket:
        """This bucket announcing ``total`` buckets in its sync."""
        return WeightBucket(self.header.with_total(total), self.buffer)
