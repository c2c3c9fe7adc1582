"""Delta sync: what a delta carries follows from the words that changed, the rebuilt sync is
bit-exact (the full sync's checksums validate it), and every case without a usable base goes
whole or is refused with a message that says a full sync is needed."""

from __future__ import annotations

import pytest
import torch

from rlhf.weights import (
    DeltaReceiver,
    DeltaSender,
    SharedMemorySender,
    WeightSyncError,
    iter_tensors,
    pack_buckets,
    transport,
    validate_sync,
)
from rlhf.weights.transports.delta import DELTA, decode, encode


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": (torch.randn(64, 32, generator=gen) * 0.02).to(torch.bfloat16),  # 4096 B
        "b": (torch.randn(32, generator=gen) * 0.02).to(torch.bfloat16),  # 64 B
    }


def nudge(state: dict[str, torch.Tensor], positions: dict[str, list[int]]) -> dict:
    """``state`` with the bf16 elements at ``positions`` moved by one unit in the last place
    (their bit pattern + 1): exactly those words change."""
    out = {}
    for name, t in state.items():
        bits = t.clone().view(torch.int16).flatten()
        bits[positions.get(name, [])] += 1
        out[name] = bits.view(torch.bfloat16).view(t.shape)
    return out


def buckets(state: dict[str, torch.Tensor], version: int):
    return pack_buckets(state.items(), version=version, bucket_bytes=1 << 20)


def test_a_delta_carries_the_changed_words_and_rebuilds_bit_exact() -> None:
    old = model()
    new = nudge(old, {"w": [0, 5, 2047], "b": [31]})
    (base,), (bucket,) = buckets(old, 1), buckets(new, 2)
    sent, changed = encode(bucket, base=torch.as_tensor(base.buffer), base_version=1)
    assert changed == 4 and sent.checksum_algorithm == DELTA and sent.tensors == ()
    # 8 + the JSON padded to 8, then 4 int32 positions and 4 bf16 values.
    length = int(torch.as_tensor(sent.buffer)[:8].view(torch.int64)[0])
    assert sent.nbytes == 8 + -(-length // 8) * 8 + 4 * 4 + 4 * 2
    assert sent.nbytes < bucket.nbytes
    full = decode(sent, bases={0: torch.as_tensor(base.buffer)}, base_version=1)
    assert full.header == bucket.header  # the full sync's header: its checksums
    assert validate_sync([full]) == 2
    got = dict(iter_tensors([full]))
    assert all(torch.equal(got[k].view(torch.int16), v.view(torch.int16)) for k, v in new.items())


def test_a_bucket_that_changed_everywhere_or_has_no_base_goes_whole() -> None:
    old = model()
    everything = {k: v + 1 for k, v in old.items()}
    (base,), (bucket,) = buckets(old, 1), buckets(everything, 2)
    words = bucket.nbytes // 2
    sent, changed = encode(bucket, base=torch.as_tensor(base.buffer), base_version=1)
    assert sent is bucket and changed == words
    assert encode(bucket, base=None, base_version=None) == (bucket, words)
    assert decode(bucket, bases={}, base_version=None) is bucket  # a whole bucket passes


def test_a_delta_against_a_sync_the_receiver_lacks_is_refused() -> None:
    old = model()
    (base,), (bucket,) = buckets(old, 1), buckets(nudge(old, {"w": [3]}), 2)
    sent, _ = encode(bucket, base=torch.as_tensor(base.buffer), base_version=1)
    for bases, version in (({}, None), ({0: torch.as_tensor(base.buffer)}, 7)):
        with pytest.raises(WeightSyncError, match="delta against version 1, this receiver "
                                                  "holds .*: it needs a full sync"):  # fmt: skip
            decode(sent, bases=bases, base_version=version)


def test_delta_syncs_through_shared_memory_with_a_restarted_receiver() -> None:
    """Four syncs: whole, delta, delta refused by a receiver made anew (an engine restarted
    between two delta syncs), whole again from a new sender; each rebuilt sync equals what
    was sent, bit for bit, and the stats follow the changed words."""
    spec = transport("shared_memory_delta")
    assert spec.sender is not None and spec.sync_type is not None
    states = [model()]
    for step in range(3):
        states.append(nudge(states[-1], {"w": list(range(step, 2048, 64))}))  # 32 words
    sender, receiver = spec.sender(), DeltaReceiver()
    assert isinstance(sender, DeltaSender)

    def sync(sender, receiver, version: int) -> dict[str, float]:
        out = sender.send(buckets(states[version], version))
        assert type(out) is spec.sync_type
        rebuilt = receiver.receive(out)
        assert validate_sync(rebuilt) == version
        got = dict(iter_tensors(rebuilt))
        for k, v in states[version].items():
            assert torch.equal(got[k].view(torch.int16), v.view(torch.int16)), (version, k)
        return sender.metrics()

    first = sync(sender, receiver, 0)
    assert first["bytes_sent"] == first["bytes_full"] and first["whole_buckets"] == 1
    second = sync(sender, receiver, 1)
    words = second["bytes_full"] // 2
    assert second["changed_fraction"] == 32 / words and second["whole_buckets"] == 0
    # 32 int32 positions and 32 bf16 values beside the header's JSON (~300 bytes here).
    assert 32 * 6 < second["bytes_sent"] < second["bytes_full"] / 4
    restarted = DeltaReceiver()
    with pytest.raises(WeightSyncError, match="needs a full sync"):
        sync(sender, restarted, 2)
    sender.close()  # what the launcher does: a new sender, whose first sync goes whole
    again = spec.sender()
    assert sync(again, restarted, 3)["whole_buckets"] == 1
    again.close()
    restarted.close()
    receiver.close()


def test_a_failed_send_drops_the_base() -> None:
    class Flaky(SharedMemorySender):
        fail = False

        def send(self, buckets):
            if self.fail:
                list(buckets)
                raise OSError("no space left on the device")
            return super().send(buckets)

    inner = Flaky()
    sender = DeltaSender(inner)
    sender.send(buckets(model(), 1))
    assert sender.encoder.base.version == 1
    inner.fail = True
    with pytest.raises(OSError, match="no space left"):
        sender.send(buckets(nudge(model(), {"w": [1]}), 2))
    assert sender.encoder.base.version is None  # the receivers may hold either: next goes whole
    inner.fail = False
    sender.send(buckets(model(), 3))
    assert sender.metrics()["whole_buckets"] == 1
    sender.close()


def test_a_delta_over_half_the_bucket_goes_whole_unless_allowed() -> None:
    """410 of 2080 words changed: the delta (6 bytes per changed word, ~2.8 kB) is over half
    of the 4160-byte bucket, so it goes whole; allowed up to the whole size, it goes as a
    delta and still rebuilds exactly."""
    old = model()
    new = nudge(old, {"w": list(range(0, 2048, 5))})  # 410 words
    (base,), (bucket,) = buckets(old, 1), buckets(new, 2)
    sent, changed = encode(bucket, base=torch.as_tensor(base.buffer), base_version=1)
    assert sent is bucket and changed == 410
    allowed, _ = encode(bucket, base=torch.as_tensor(base.buffer), base_version=1, max_ratio=1.0)
    assert allowed.checksum_algorithm == DELTA
    assert bucket.nbytes / 2 < allowed.nbytes < bucket.nbytes
    full = decode(allowed, bases={0: torch.as_tensor(base.buffer).clone()}, base_version=1)
    assert validate_sync([full]) == 2
