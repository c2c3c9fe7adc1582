"""Weight receiving: buckets in the wire format load into the live engine, or are rejected whole."""

import asyncio
import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen2ForCausalLM

from rlhf.agents import SamplingParams
from rlhf.rollout import read_checkpoint_params
from rlhf.weights import WeightBucket, WeightSyncError, checksum, validate_sync

PROMPT = [5, 17, 42, 99, 7]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)


def greedy(engine) -> tuple[int, ...]:
    return asyncio.run(engine.generate(PROMPT, GREEDY)).token_ids


FROM_DISK = """
import asyncio, json, sys
from rlhf.agents import SamplingParams
from rlhf.rollout import EngineConfig, VLLMEngine
engine = VLLMEngine(EngineConfig(model=sys.argv[1], dtype="float32", max_model_len=256, max_num_seqs=4)).start()
g = asyncio.run(engine.generate(json.loads(sys.argv[2]), SamplingParams(max_new_tokens=10, temperature=0.0)))
print(json.dumps(list(g.token_ids)))
"""


def greedy_from_disk(model_dir) -> tuple[int, ...]:
    # A second in-process engine would share (and on shutdown tear down) vLLM's process-global
    # parallel state with the session's engine, so the reference engine runs in its own process.
    out = subprocess.run(
        [sys.executable, "-c", FROM_DISK, str(model_dir), json.dumps(PROMPT)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def new_weights(checkpoint, tmp_path_factory):
    state = load_file(str(checkpoint / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    perturbed = {k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    # The same weights saved as a checkpoint, for the engine that loads them from disk.
    disk = tmp_path_factory.mktemp("updated")
    model = Qwen2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model.load_state_dict(perturbed, strict=False)
    model.tie_weights()
    model.save_pretrained(disk)
    for f in checkpoint.glob("tokenizer*"):
        (disk / f.name).write_bytes(f.read_bytes())
    return perturbed, disk, model.eval()


def test_checkpoint_params_are_read_from_safetensors_headers(checkpoint) -> None:
    params = read_checkpoint_params(str(checkpoint))
    state = load_file(str(checkpoint / "model.safetensors"))
    assert params == {k: (tuple(v.shape), "float32") for k, v in state.items()}


def test_update_from_buckets_equals_loading_from_disk(engine, new_weights, pack) -> None:
    perturbed, disk, hf = new_weights
    before = greedy(engine)
    version = engine.update_weights(pack(perturbed, version=5, bucket_bytes=64 * 1024))
    assert version == engine.weight_version == 5
    after = greedy(engine)
    assert after != before
    assert greedy_from_disk(disk) == after
    # And the live engine's log-probs follow the new weights (tied lm_head refreshed too).
    g = asyncio.run(
        engine.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=1.0, seed=1))
    )
    assert g.weight_version == 5
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([PROMPT + list(g.token_ids)])).logits[0], dim=-1)
    expected = [logp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(g.token_ids)]
    assert max(abs(a - b) for a, b in zip(g.logprobs, expected, strict=True)) < 1e-4


def _corrupt_byte(bucket: WeightBucket, *, fix_bucket_checksum: bool) -> WeightBucket:
    buf = bucket.buffer.clone()
    buf[bucket.tensors[0].offset] ^= 0xFF
    digest = checksum(buf, bucket.checksum_algorithm) if fix_bucket_checksum else bucket.checksum
    return dataclasses.replace(bucket.header, checksum=digest).with_buffer(buf)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda bs: [_corrupt_byte(bs[0], fix_bucket_checksum=False), *bs[1:]],
            r"bucket 0 of version 9 is corrupted \(checksum mismatch\); tensors that differ: "
            r"\['model\.embed_tokens\.weight'\]",
        ),
        (lambda bs: bs[:-1], r"incomplete or duplicated buckets"),
        (lambda bs: [*bs, bs[0]], r"incomplete or duplicated buckets"),
        (
            lambda bs: [
                dataclasses.replace(bs[0].header, version=8).with_buffer(bs[0].buffer),
                *bs[1:],
            ],
            r"buckets disagree on the weight version: \[8, 9\]",
        ),
        (lambda bs: [], r"needs at least one bucket"),
    ],
)
def test_bad_syncs_are_rejected_and_the_engine_keeps_its_weights(
    engine, checkpoint, pack, mutate, message
) -> None:
    state = load_file(str(checkpoint / "model.safetensors"))
    buckets = pack({k: v + 1.0 for k, v in state.items()}, version=9, bucket_bytes=64 * 1024)
    assert len(buckets) > 2
    before, version = greedy(engine), engine.weight_version
    with pytest.raises(WeightSyncError, match=message):
        engine.update_weights(mutate(buckets))
    assert greedy(engine) == before
    assert engine.weight_version == version


def test_every_tensor_checksum_on_request(checkpoint, pack) -> None:
    """A bucket checksummed after one of its tensors was damaged passes the one-pass check;
    ``check_every_tensor`` still names the tensor."""
    state = load_file(str(checkpoint / "model.safetensors"))
    buckets = pack(state, version=2, bucket_bytes=64 * 1024)
    bad = [_corrupt_byte(buckets[0], fix_bucket_checksum=True), *buckets[1:]]
    assert validate_sync(bad) == 2
    with pytest.raises(
        WeightSyncError, match=r"checksum mismatches: \['model\.embed_tokens\.weight'\]"
    ):
        validate_sync(bad, check_every_tensor=True)


def test_missing_unknown_and_misshapen_parameters_are_named(checkpoint, pack) -> None:
    expected = read_checkpoint_params(str(checkpoint))
    state = load_file(str(checkpoint / "model.safetensors"))
    missing = dict(state)
    missing.pop("model.norm.weight")
    with pytest.raises(WeightSyncError, match=r"missing parameters: \['model\.norm\.weight'\]"):
        validate_sync(pack(missing, version=1, bucket_bytes=1 << 20), expected=expected)
    assert (
        validate_sync(
            pack(missing, version=1, bucket_bytes=1 << 20), expected=expected, require_all=False
        )
        == 1
    )
    extra = {**state, "model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)}
    with pytest.raises(
        WeightSyncError,
        match=r"names the model does not have: \['model\.layers\.9\.mlp\.up_proj\.weight'\]",
    ):
        validate_sync(pack(extra, version=1, bucket_bytes=1 << 20), expected=expected)
    misshapen = {**state, "model.norm.weight": torch.zeros(3)}
    with pytest.raises(
        WeightSyncError, match=r"wrong shapes: \['model\.norm\.weight \(3,\) != \(128,\)'\]"
    ):
        validate_sync(pack(misshapen, version=1, bucket_bytes=1 << 20), expected=expected)
