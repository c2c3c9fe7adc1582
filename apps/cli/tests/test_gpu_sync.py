"""GPU, with ``-m gpu``: the learner's CUDA IPC sender half feeding the rollout's receiver.

A learner-side process packs perturbed weights on the GPU (`rlhf.weights.iter_buckets`,
wsum64) and shares them (`rlhf.weights.CudaIpcSender`); the engine opens the handles
(`rlhf.weights.CudaIpcReceiver`), loads with read-back verification, and then serves exactly
those weights: its log-probs equal a transformers forward of them."""

from __future__ import annotations

import asyncio
import base64
import pickle
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

SENDER = r"""
import base64, pickle, sys, torch
from safetensors.torch import load_file
from rlhf.weights import CudaIpcSender, iter_buckets
state = load_file(sys.argv[1] + "/model.safetensors")
gen = torch.Generator().manual_seed(int(sys.argv[2]))
new = {k: (v + 0.3 * torch.randn(v.shape, generator=gen)).cuda() for k, v in state.items()}
sender = CudaIpcSender()
sync = sender.send(iter_buckets(new.items(), version=5, bucket_bytes=1 << 16, device="cuda"))
print(base64.b64encode(pickle.dumps(sync)).decode(), flush=True)
sys.stdin.readline()  # the buffers stay alive until the engine has loaded them
"""
PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [10, 2, 11, 12, 13]]


def _checkpoint(path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate("0123456789:")}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>")
    tok.save_pretrained(path)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=16, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, eos_token_id=1, bos_token_id=1,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def _model(path, seed):
    from safetensors.torch import load_file
    from transformers import Qwen2ForCausalLM

    state = load_file(str(path / "model.safetensors"))
    if seed is not None:  # the sender's perturbation, recomputed here
        gen = torch.Generator().manual_seed(seed)
        state = {k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model.cuda().eval()


def test_the_learners_cuda_ipc_sync_loads_into_a_gpu_engine(tmp_path) -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA GPU; run them on the device machine")
    from rlhf.agents import SamplingParams
    from rlhf.rollout import EngineConfig, VLLMEngine, check_logprobs
    from rlhf.weights import CudaIpcReceiver

    path = _checkpoint(tmp_path / "model")
    engine = VLLMEngine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            max_model_len=64,
            max_num_seqs=8,
            gpu_memory_utilization=0.2,
        )
    ).start()
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    proc = subprocess.Popen(
        [sys.executable, "-c", SENDER, str(path), "5"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        sync = pickle.loads(base64.b64decode(proc.stdout.readline()))
        assert engine.update_weights(CudaIpcReceiver().receive(sync), verify=True) == 5
        proc.stdin.write("done\n")
        proc.stdin.flush()
        assert proc.wait(timeout=120) == 0
        # fp32 on both sides; Triton attention on Hopper computes fp32 dot products in TF32.
        for seed, served in ((5, True), (None, False)):
            report = asyncio.run(
                check_logprobs(engine, _model(path, seed), PROMPTS, sampling=greedy, tolerance=2e-2)
            )
            print(report.summary())
            assert report.passed == served, report.summary()
    finally:
        if proc.poll() is None:
            proc.kill()
        engine.shutdown()
