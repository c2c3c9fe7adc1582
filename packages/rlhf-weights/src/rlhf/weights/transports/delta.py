"""Delta sync: only what changed since the last sync travels.

Between two syncs of a fine-tuned model most elements do not change: with a small learning
rate an update moves few bf16 values by a whole unit in the last place. A bucket is therefore
sent as the positions and new values of its *words* (its smallest tensor itemsize: 2 bytes
for a bf16 model) that differ from the same bucket of the last sync, and the receiver rebuilds
it from its own copy of that sync. The rebuilt bucket carries the full sync's header, so
`rlhf.weights.validate_sync` checks it by the same checksums as a full sync: the result is
bit-exact or refused, never approximate.

A bucket goes whole when the sender has no base for it (the first sync, a new sender after an
engine was replaced), when its layout changed, or when its delta would be more than half of it
(`MAX_RATIO`: past that, finding and applying the changes costs more time than the bytes
save). A receiver without the base a delta names (a restarted engine) refuses the sync with a
`WeightSyncError` that says a full sync is needed; the launcher then starts a new sender,
whose first sync is whole.

Cost: both ends keep a copy of the last sync (the sender on the buckets' device, the receiver
in host memory or on its device): one more copy of the weights each.

Wire form of a delta bucket, a plain `WeightBucket` to the transport it rides on (its header
has no tensors and the checksum algorithm ``"delta"``; a whole bucket is the bucket itself)::

    int64 L | L bytes of JSON {"base": version, "header": full header (to_wire), "word": w,
    "changed": n, "index_dtype": "int32" | "int64"} | zero padding to 8 | n positions (index
    dtype, in words) | n values (w bytes each)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from rlhf.weights.format import DTYPES, BucketHeader, WeightBucket, WeightSyncError, as_uint8
from rlhf.weights.registry import TRANSPORTS, GroupMember, Receiver, Sender, TransportSpec, register
from rlhf.weights.transports.broadcast import SPEC as BROADCAST
from rlhf.weights.transports.shared_memory import SPEC as SHARED_MEMORY

if TYPE_CHECKING:
    from torch.types import Device

    from rlhf.weights.transports.broadcast import BroadcastGroupSpec

_SyncT = TypeVar("_SyncT")
"""What an inner transport's send returns: a sync object, or a group's bucket count."""

DELTA = "delta"
"""The checksum-algorithm field that marks a delta bucket on the wire."""

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def word_size(header: BucketHeader) -> int:
    """The bucket's word: the smallest itemsize among its tensors (1 for an empty bucket)."""
    sizes = [DTYPES[t.dtype].itemsize for t in header.tensors]
    word = min(sizes, default=1)
    return word if header.nbytes % word == 0 else 1


def _words(buffer: torch.Tensor, word: int) -> torch.Tensor:
    return buffer.view(_WORDS[word])


MAX_RATIO = 0.5
"""A bucket goes whole when its delta would be larger than this share of it: finding,
packing and applying the changed words costs more than copying the rest (2-core CPU, 0.5B
model: at 25 % of the words changed a delta was 0.75x the bytes and 3-6x the time)."""


def encode(
    bucket: WeightBucket,
    *,
    base: torch.Tensor | None,
    base_version: int | None,
    max_ratio: float = MAX_RATIO,
) -> tuple[WeightBucket, int]:
    """``bucket`` as a delta against ``base`` (the same bucket of sync ``base_version``), or
    whole when there is no base, its size differs or the delta would exceed ``max_ratio`` of
    the bucket. Returns the bucket to send and the number of words that changed (all of
    them without a base)."""
    new = as_uint8(bucket.buffer)
    word = word_size(bucket.header)
    total_words = new.numel() // word
    if base is None or base_version is None or base.numel() != new.numel():
        return bucket, total_words
    differs = _words(new, word) != _words(base, word)
    n = int(torch.count_nonzero(differs))  # before any index is made: a whole bucket needs none
    index_dtype = torch.int32 if total_words < 2**31 else torch.int64
    meta = json.dumps({
        "base": base_version, "header": bucket.header.to_wire(), "word": word, "changed": n,
        "index_dtype": "int32" if index_dtype is torch.int32 else "int64",
    }).encode()  # fmt: skip
    head = 8 + -(-len(meta) // 8) * 8
    size = head + n * index_dtype.itemsize + n * word
    if size >= max_ratio * new.numel():
        return bucket, n
    changed = torch.nonzero(differs).flatten()
    payload = torch.zeros(size, dtype=torch.uint8, device=new.device)
    payload[:8] = torch.tensor([len(meta)], dtype=torch.int64).view(torch.uint8).to(new.device)
    payload[8 : 8 + len(meta)] = torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(new.device)
    positions = payload[head : head + n * index_dtype.itemsize]
    positions.view(index_dtype).copy_(changed.to(index_dtype))
    payload[head + n * index_dtype.itemsize :].view(_WORDS[word]).copy_(_words(new, word)[changed])
    carrier = BucketHeader(
        version=bucket.version, index=bucket.index, total=bucket.total, tensors=(),
        nbytes=size, checksum="", checksum_algorithm=DELTA,
    )  # fmt: skip
    return carrier.with_buffer(payload), n


def decode(
    bucket: WeightBucket, *, bases: dict[int, torch.Tensor], base_version: int | None
) -> WeightBucket:
    """The full bucket ``bucket`` stands for: itself when whole, else its delta applied in
    place to ``bases[index]`` (the receiver's copy of sync ``base_version``, which thereby
    becomes this sync's bucket: no copy of the model per sync).

    Raises:
        WeightSyncError: a delta against a sync this receiver does not hold.
    """
    if bucket.checksum_algorithm != DELTA:
        return bucket
    payload = as_uint8(bucket.buffer)
    length = int(payload[:8].cpu().view(torch.int64)[0])
    meta = json.loads(bytes(payload[8 : 8 + length].cpu().numpy()))
    header = BucketHeader.from_wire(meta["header"])
    if bucket.total is not None:  # a streaming sender's transport announced it on the carrier
        header = header.with_total(bucket.total)
    base = bases.get(header.index)
    if meta["base"] != base_version or base is None or base.numel() != header.nbytes:
        held = "none" if base_version is None else f"version {base_version}"
        raise WeightSyncError(
            f"bucket {header.index} is a delta against version {meta['base']}, this receiver "
            f"holds {held}: it needs a full sync (a new sender sends one)"
        )
    word, n = int(meta["word"]), int(meta["changed"])
    index_dtype = torch.int32 if meta["index_dtype"] == "int32" else torch.int64
    head = 8 + -(-length // 8) * 8
    positions = payload[head : head + n * index_dtype.itemsize].view(index_dtype).to(base.device)
    values = payload[head + n * index_dtype.itemsize :].view(_WORDS[word]).to(base.device)
    _words(base, word)[positions.long()] = values  # in place: the base becomes this sync
    return header.with_buffer(base)


@dataclass
class DeltaStats:
    """What the last sync sent: bytes on the wire against a full sync's, and the fraction of
    words that changed since the sync before."""

    bytes_sent: int = 0
    bytes_full: int = 0
    changed_words: int = 0
    words: int = 0
    whole_buckets: int = 0

    def as_metrics(self) -> dict[str, float]:
        return {
            "bytes_sent": float(self.bytes_sent),
            "bytes_full": float(self.bytes_full),
            "changed_fraction": self.changed_words / self.words if self.words else 0.0,
            "whole_buckets": float(self.whole_buckets),
        }


class _Base:
    """The last sync's buffers by bucket index, and its version."""

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}
        self.version: int | None = None

    def drop(self) -> None:
        self.buffers, self.version = {}, None


class DeltaEncoder:
    """The sender's half, shared by the delta transports: encodes a stream of buckets against
    the last sync and keeps the new one once the send went through (`send`)."""

    def __init__(self, *, max_ratio: float = MAX_RATIO) -> None:
        self.base = _Base()
        self.stats = DeltaStats()
        self.max_ratio = max_ratio
        self._next: dict[int, torch.Tensor] = {}

    def encode(self, buckets: Iterable[WeightBucket]) -> Iterator[WeightBucket]:
        self.stats, self._next = DeltaStats(), {}
        for bucket in buckets:
            new = as_uint8(bucket.buffer)
            sent, changed = encode(
                bucket, base=self.base.buffers.get(bucket.index), base_version=self.base.version,
                max_ratio=self.max_ratio,
            )  # fmt: skip
            # Kept, not copied: `iter_buckets` packs every bucket into a buffer of its own (a
            # caller that reuses one buffer must pass copies).
            self._next[bucket.index] = new
            s = self.stats
            s.bytes_sent += as_uint8(sent.buffer).numel()
            s.bytes_full += new.numel()
            s.changed_words += changed
            s.words += new.numel() // word_size(bucket.header)
            s.whole_buckets += sent is bucket
            yield sent

    def send(
        self, send: Callable[[Iterable[WeightBucket]], _SyncT], buckets: Iterable[WeightBucket]
    ) -> _SyncT:
        """What ``send`` (the inner transport's) returns for ``buckets`` encoded. Once it
        returned, this sync is the base of the next; if it raised, the base is dropped (the
        receivers may hold either sync: the next goes whole)."""
        version: list[int] = []

        def stream() -> Iterator[WeightBucket]:
            for b in self.encode(buckets):
                version[:1] = [b.version]
                yield b

        try:
            out = send(stream())
        except BaseException:
            self.base.drop()
            raise
        if version:
            self.base.buffers, self.base.version = self._next, version[0]
        self._next = {}
        return out


class DeltaSender:
    """A sync-object transport's sender (``inner``) that sends deltas; its sync is wrapped
    in a `DeltaSync` so that engines read it with a `DeltaReceiver`."""

    def __init__(self, inner: Sender) -> None:
        self.inner = inner
        self.encoder = DeltaEncoder()

    def send(self, buckets: Iterable[WeightBucket]) -> DeltaSync:
        return DeltaSync(self.encoder.send(self.inner.send, buckets))

    def metrics(self) -> dict[str, float]:
        return self.encoder.stats.as_metrics()

    def close(self) -> None:
        self.encoder.base.drop()
        self.inner.close()


@dataclass(frozen=True)
class DeltaSync:
    """A delta transport's sync: the inner transport's sync of the encoded buckets."""

    inner: object


class DeltaReceiver:
    """An engine's end of a delta sync-object transport: receives through the inner
    transport's receiver (by the inner sync's type) and rebuilds full buckets from its copy
    of the last sync."""

    def __init__(self) -> None:
        self.base = _Base()
        self._inner: dict[type, Receiver] = {}

    def receive(self, sync: DeltaSync) -> list[WeightBucket]:
        kind = type(sync.inner)
        if kind not in self._inner:
            spec = next((s for s in TRANSPORTS.values() if s.sync_type is kind), None)
            if spec is None or spec.receiver is None:
                raise WeightSyncError(f"no transport reads a {kind.__name__} inside a delta")
            self._inner[kind] = spec.receiver()
        return rebuild(self._inner[kind].receive(sync.inner), self.base, owned=False)

    def close(self) -> None:
        self.base.drop()
        for receiver in self._inner.values():
            receiver.close()


def rebuild(buckets: list[WeightBucket], base: _Base, *, owned: bool) -> list[WeightBucket]:
    """The full buckets of a received delta sync; ``base`` becomes this sync. A delta bucket
    is rebuilt in place in the base; a whole one is kept as it is when the transport gave a
    buffer of its own (``owned``), else copied into the base's buffer of its size (a view,
    e.g. of a shared-memory segment, that the next sync overwrites). A refused sync drops
    the base."""
    try:
        full = [decode(b, bases=base.buffers, base_version=base.version) for b in buckets]
    except WeightSyncError:
        base.drop()
        raise
    if not full:
        return full
    kept: dict[int, torch.Tensor] = {}
    out = []
    for source, bucket in zip(buckets, full, strict=True):
        buffer = as_uint8(bucket.buffer)
        if source.checksum_algorithm != DELTA and not owned:
            into = base.buffers.get(bucket.index)
            if into is None or into.numel() != buffer.numel() or into.device != buffer.device:
                into = torch.empty_like(buffer)
            buffer = into.copy_(buffer)
            bucket = bucket.header.with_buffer(buffer)
        kept[bucket.index] = buffer
        out.append(bucket)
    base.buffers, base.version = kept, full[0].version
    return out


class DeltaMember:
    """A group transport's member (``inner``) that sends deltas and rebuilds them."""

    def __init__(self, inner: GroupMember) -> None:
        self.inner = inner
        self.encoder = DeltaEncoder()
        self.base = _Base()

    def send(self, buckets: Iterable[WeightBucket]) -> int:
        return self.encoder.send(self.inner.send, buckets)

    def receive(self) -> list[WeightBucket]:
        # A group member receives into buffers of its own.
        return rebuild(self.inner.receive(), self.base, owned=True)

    def metrics(self) -> dict[str, float]:
        return self.encoder.stats.as_metrics()

    def close(self) -> None:
        self.encoder.base.drop()
        self.base.drop()
        self.inner.close()


def _shared_memory_sender() -> Sender:
    assert SHARED_MEMORY.sender is not None
    return SHARED_MEMORY.sender()


def _join_delta(spec: BroadcastGroupSpec, *, rank: int, device: Device = None) -> DeltaMember:
    assert BROADCAST.join is not None
    return DeltaMember(BROADCAST.join(spec, rank=rank, device=device))


SHARED_MEMORY_DELTA = register(
    TransportSpec(
        name="shared_memory_delta",
        reach=SHARED_MEMORY.reach,
        devices=SHARED_MEMORY.devices,
        sender=lambda: DeltaSender(_shared_memory_sender()),
        receiver=DeltaReceiver,
        sync_type=DeltaSync,
    )
)

BROADCAST_DELTA = register(
    TransportSpec(
        name="broadcast_delta",
        reach=BROADCAST.reach,
        devices=BROADCAST.devices,
        on_device=True,
        new_group=BROADCAST.new_group,
        join=_join_delta,
        requires=BROADCAST.requires,
    )
)
