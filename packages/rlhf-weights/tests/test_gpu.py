"""GPU paths, run on a CUDA machine with ``-m gpu``: CUDA IPC between two processes, and
``wsum64`` computed on the GPU equal to the host's."""

from __future__ import annotations

import base64
import pickle
import subprocess
import sys

import pytest
import torch

from rlhf.weights import CudaIpcSender, checksum, iter_buckets

pytestmark = pytest.mark.gpu

RECEIVER = r"""
import base64, json, pickle, sys
import torch
from rlhf.weights import CudaIpcReceiver, checksum, iter_tensors, validate_sync
buckets = CudaIpcReceiver().receive(pickle.loads(base64.b64decode(sys.stdin.readline())))
validate_sync(buckets, check_every_tensor=True)  # wsum64 on the GPU, where the bytes are
out = {name: [str(t.device), checksum(t.contiguous().view(-1).view(torch.uint8), "wsum64")]
       for name, t in iter_tensors(buckets)}
print(json.dumps({"buckets": len(buckets), "tensors": out}), flush=True)
"""


def _gpu() -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA GPU; run them on the device machine")


def test_cuda_ipc_sync_opens_in_another_process_with_the_same_bytes() -> None:
    _gpu()
    import json

    gen = torch.Generator().manual_seed(0)
    state = {
        "embed.weight": torch.randn(300, 64, generator=gen).to(torch.bfloat16),
        "layer.weight": torch.randn(64, 64, generator=gen),
        "layer.bias": torch.randn(64, generator=gen),
        "head.weight": torch.randn(1000, 64, generator=gen).to(torch.bfloat16),
    }
    on_gpu = {k: v.cuda() for k, v in state.items()}
    sender = CudaIpcSender()
    sync = sender.send(iter_buckets(on_gpu.items(), version=7, bucket_bytes=64 << 10))
    assert len(sync.headers) >= 2 and {h.total for h in sync.headers} == {len(sync.headers)}
    assert {h.checksum_algorithm for h in sync.headers} == {"wsum64"}
    proc = subprocess.run(
        [sys.executable, "-c", RECEIVER],
        input=base64.b64encode(pickle.dumps(sync)).decode() + "\n",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    sender.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["buckets"] == len(sync.headers)
    for name, tensor in on_gpu.items():
        device, digest = got["tensors"][name]
        assert device.startswith("cuda")
        assert digest == checksum(tensor.contiguous().view(-1).view(torch.uint8), "wsum64"), name


def test_wsum64_is_the_same_on_gpu_and_host() -> None:
    _gpu()
    data = torch.randint(0, 256, (1_000_003,), dtype=torch.uint8)
    assert checksum(data.cuda(), "wsum64") == checksum(data, "wsum64")
    flipped = data.clone()
    flipped[777] ^= 4
    assert checksum(flipped.cuda(), "wsum64") != checksum(data.cuda(), "wsum64")
