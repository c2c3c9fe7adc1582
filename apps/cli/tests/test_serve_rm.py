"""``rlhf serve-rm``: a real server process on 127.0.0.1, scored against a direct forward."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from .conftest import rlhf


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def reward_model(assets, tmp_path_factory):
    """The demo's tiny model with a random scalar head (scores differ from text to text)."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("rm")
    torch.manual_seed(3)
    model = AutoModelForTokenClassification.from_pretrained(assets["model"], num_labels=1)
    with torch.no_grad():
        model.score.weight.normal_(std=1.0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(assets["model"]).save_pretrained(out)
    return out


KEY = "test-key-7f3a"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(reward_model):
    """The server with ``--api_key``: scoring requests carry the key."""
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhf.cli", "serve-rm", "--model_path", str(reward_model),
         "--port", str(port), "--batch_size", "3", "--api_key", KEY],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(f"{base}/health", timeout=2).json() == {"status": "ok"}:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve-rm did not come up in 180 s"
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _direct_score(model_dir, text: str) -> float:
    """The head's output at the last token of the unpadded text."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForTokenClassification.from_pretrained(model_dir, num_labels=1).eval()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, -1, 0])


QUERIES = ["1234:1234<eos>", "9081:0189", "55:5", "3210:0123<eos>", "7:"]


def test_scores_equal_a_direct_forward_of_each_text(server, reward_model) -> None:
    # Five texts of different lengths in batches of three: padding must not change a score.
    body = httpx.post(
        f"{server}/get_reward", json={"query": QUERIES}, headers=AUTH, timeout=60
    ).json()
    expected = [_direct_score(reward_model, q) for q in QUERIES]
    assert body["rewards"] == pytest.approx(expected, abs=1e-4)
    assert body["scores"] == body["rewards"]
    assert len({round(s, 4) for s in expected}) == len(QUERIES)  # the check can tell them apart


def test_the_remote_reward_client_reads_it(server, reward_model) -> None:
    from rlhf.agents import RemoteReward, RemoteRewardConfig

    config = RemoteRewardConfig(urls=(f"{server}/get_reward",), max_batch_size=2, api_key=KEY)
    client = RemoteReward(config)
    scored = asyncio.run(
        client.score(queries=QUERIES, prompts=[q.split(":")[0] for q in QUERIES], labels=[""] * 5)
    )
    assert scored.valid == [True] * 5
    assert scored.rewards == pytest.approx(
        [_direct_score(reward_model, q) for q in QUERIES], abs=1e-4
    )


def test_a_body_without_query_is_a_400_naming_it(server) -> None:
    response = httpx.post(
        f"{server}/get_reward", json={"prompts": ["1:"]}, headers=AUTH, timeout=30
    )
    assert response.status_code == 400
    assert "'query'" in response.json()["error"]
    response = httpx.post(f"{server}/get_reward", json={"query": [1, 2]}, headers=AUTH, timeout=30)
    assert response.status_code == 400 and "list of strings" in response.json()["error"]


def test_scoring_needs_the_key(server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.post(
            f"{server}/get_reward", json={"query": QUERIES}, headers=headers, timeout=30
        )
        assert response.status_code == 401, headers
        assert "--api_key" in response.json()["error"]
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200  # probes need no key


def test_a_language_model_without_a_score_head_is_refused(assets) -> None:
    out = rlhf("serve-rm", "--model_path", str(assets["model"]))
    assert out.returncode == 2, out.stderr[-2000:]
    assert "has no trained score head" in out.stderr and "rlhf train rm" in out.stderr


def test_binding_beyond_this_machine_without_a_key_warns(reward_model) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhf.cli", "serve-rm", "--model_path", str(reward_model),
         "--host", "0.0.0.0", "--port", str(_free_port())],
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    stop = threading.Timer(120, proc.terminate)  # no warning at all: stderr ends, test fails
    stop.start()
    line = ""
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # written before the model loads and the server starts
            if line.startswith("[serve-rm]"):
                break
    finally:
        stop.cancel()
        proc.terminate()
        proc.wait(timeout=30)
    assert line.startswith("[serve-rm] warning: --host 0.0.0.0 exposes the reward model"), line


def test_a_missing_model_is_a_clear_error(tmp_path) -> None:
    out = rlhf("serve-rm", "--model_path", str(tmp_path / "nope"))
    assert out.returncode == 2
    assert "nope" in out.stderr and "does not exist" in out.stderr


def test_without_a_model_path_the_flag_is_named() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rlhf.cli", "serve-rm"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "--model_path" in out.stderr


def test_a_4bit_model_scores_as_its_dequantised_weights(reward_model) -> None:
    """``--load_in_4bit`` (OpenRLHF's ``--ds.load_in_4bit``): the decoder's linear layers load
    as bitsandbytes NF4 (uint8), the score head stays dense, and each score is what a dense
    model with the dequantised weights gives for that text."""
    from bitsandbytes.functional import dequantize_4bit
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    from rlhf.cli.serve_rm import RewardModelScorer, ServeRMConfig

    config = ServeRMConfig(model_path=str(reward_model), batch_size=3, load_in_4bit=True)
    scorer = RewardModelScorer(config)
    quantised = {
        name: module
        for name, module in scorer.model.named_modules()
        if type(module).__name__ == "Linear4bit"
    }
    assert "model.layers.0.mlp.up_proj" in quantised
    assert {m.weight.dtype for m in quantised.values()} == {torch.uint8}
    assert scorer.model.score.weight.dtype == torch.float32
    got = scorer.score(QUERIES)

    dense = AutoModelForTokenClassification.from_pretrained(reward_model, num_labels=1).eval()
    with torch.no_grad():
        for name, module in quantised.items():
            weight = dequantize_4bit(module.weight.data, module.weight.quant_state)
            dense.get_submodule(name).weight.copy_(weight)
    tok = AutoTokenizer.from_pretrained(reward_model)
    want = []
    for text in QUERIES:
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            want.append(float(dense(input_ids=ids).logits[0, -1, 0]))
    assert got == pytest.approx(want, abs=1e-4)
    # NF4 keeps 16 levels per block of 64 weights: the scores moved off the dense model's.
    original = [_direct_score(reward_model, q) for q in QUERIES]
    assert max(abs(a - b) for a, b in zip(got, original, strict=True)) > 1e-3
