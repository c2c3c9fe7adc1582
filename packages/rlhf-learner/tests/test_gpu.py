"""GPU paths of the learner, run on a CUDA machine with ``-m gpu``: the CUDA IPC sender half.
The receiver is another process that opens the handles and checks every bucket and tensor
against the wire format's checksums, as the rollout's receiver does."""

from __future__ import annotations

import base64
import json
import pickle
import subprocess
import sys

import pytest
import torch

from rlhf.learner import iter_buckets, share_cuda_ipc
from rlhf.learner.weights import CHECKSUMS

pytestmark = pytest.mark.gpu

RECEIVER = r"""
import base64, json, pickle, sys, torch
from rlhf.learner.weights import CHECKSUMS
sync = pickle.loads(base64.b64decode(sys.stdin.readline()))
index = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
index = index.index(sync["device_uuid"])
out = []
for header, (rebuild, args) in zip(sync["headers"], sync["handles"]):
    args = list(args)
    args[6] = index  # the device position of rebuild_cuda_tensor's arguments
    buf = rebuild(*args)
    digest = CHECKSUMS[header["checksum_algorithm"]]
    tensors = {n: digest(buf[o : o + torch.Size(s).numel() * getattr(torch, d).itemsize])
               for n, d, s, o, _ in header["tensors"]}
    out.append({"index": header["index"], "total": header["total"], "nbytes": buf.numel(),
                "bucket_ok": digest(buf) == header["checksum"],
                "tensors_ok": all(tensors[t[0]] == t[4] for t in header["tensors"]),
                "tensors": tensors})
print(json.dumps(out), flush=True)
"""


def test_cuda_ipc_sync_opens_in_another_process_with_the_same_bytes() -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA GPU; run them on the device machine")
    gen = torch.Generator().manual_seed(0)
    state = {
        "embed.weight": torch.randn(300, 64, generator=gen).to(torch.bfloat16),
        "layer.weight": torch.randn(64, 64, generator=gen),
        "layer.bias": torch.randn(64, generator=gen),
        "head.weight": torch.randn(1000, 64, generator=gen).to(torch.bfloat16),
    }
    on_gpu = {k: v.cuda() for k, v in state.items()}
    pairs = list(
        iter_buckets(on_gpu.items(), version=7, bucket_bytes=64 << 10, total=None, device="cuda")
    )
    share = share_cuda_ipc(pairs)
    assert len(share.buffers) == len(pairs) >= 2
    proc = subprocess.run(
        [sys.executable, "-c", RECEIVER],
        input=base64.b64encode(pickle.dumps(share.sync)).decode() + "\n",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert [b["index"] for b in got] == list(range(len(pairs)))
    assert all(b["total"] == len(pairs) and b["bucket_ok"] and b["tensors_ok"] for b in got)
    # The receiver read the original parameters' bytes (wsum64 computed here from the sources).
    digest = CHECKSUMS["wsum64"]
    seen = {name: value for b in got for name, value in b["tensors"].items()}
    for name, tensor in on_gpu.items():
        assert seen[name] == digest(tensor.contiguous().view(-1).view(torch.uint8)), name
