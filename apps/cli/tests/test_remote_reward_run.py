"""An RL run scored by a real HTTP reward server on 127.0.0.1 (OpenRLHF's wire format), and
the error when the server is down."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request

from .conftest import rlhf, small_run


@pytest.fixture(scope="module")
def reward_server():
    app = FastAPI()
    seen: dict[str, int] = {"requests": 0, "samples": 0}

    @app.post("/get_reward")
    async def get_reward(request: Request):
        body = await request.json()
        seen["requests"] += 1
        seen["samples"] += len(body["query"])
        # The query is prompt + response; reward the fraction of label characters in place.
        rewards = []
        for query, label in zip(body["query"], body["labels"], strict=True):
            response = query.split(":", 1)[1]
            rewards.append(sum(a == b for a, b in zip(response, label, strict=False)) / len(label))
        return {"rewards": rewards}

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "reward server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}/get_reward", seen
    server.should_exit = True
    thread.join(timeout=10)


def _args(assets, run_dir, url: str, flag: str = "--reward.remote_url") -> list[str]:
    return [
        "--run_dir", str(run_dir),
        *small_run(assets, reward=False),
        flag, url,
    ]  # fmt: skip


def test_rl_with_a_remote_reward_server(assets, tmp_path, reward_server) -> None:
    url, seen = reward_server
    out = rlhf("train", "rloo", *_args(assets, tmp_path, url))  # OpenRLHF's spelling
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2
    assert seen["samples"] == 2 * 16  # every sample of both steps was scored remotely
    assert any(0 < r["reward/mean"] < 1 for r in steps)  # graded, not all-or-nothing


def test_a_reward_server_that_is_down_stops_the_run_naming_it(assets, tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/get_reward"  # nothing listens there
    out = rlhf("train", "rloo", *_args(assets, tmp_path, url, flag="--train.remote_url"))
    assert out.returncode == 2, out.stderr[-3000:]
    assert url in out.stderr
    # Under the fallback policy the run goes on: every sample gets the fallback reward.
    fallback = ["--reward.failure_policy", "fallback", "--reward.fallback_value", "0.25",
                "--reward.retries", "0"]  # fmt: skip
    out = rlhf("train", "rloo", *_args(assets, tmp_path / "fallback", url), *fallback)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "fallback/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["reward/mean"] for r in steps] == [0.25, 0.25]
    assert [r["reward/fallback"] for r in steps] == [16.0, 16.0]  # 4 prompts x 4 samples
    # Under the skip policy every sample drops out, so no group is left to train on: the run
    # stops with a message (exit 1), not a traceback.
    skip = ["--reward.failure_policy", "skip", "--reward.retries", "0"]
    out = rlhf("train", "rloo", *_args(assets, tmp_path / "skip", url), *skip)
    assert out.returncode == 1, out.stderr[-3000:]
    assert (
        "step 1: no sample is left to train on: 16 samples' rewards failed and were skipped "
        "(--reward.failure_policy skip" in out.stderr
    )
    assert "Traceback" not in out.stderr


HANGS = """
import threading
def reward_func(queries, prompts, labels, **kwargs):
    threading.Event().wait()  # never returns
"""


def test_a_reward_function_that_never_returns_stops_the_run_at_its_timeout(assets, tmp_path):
    hang = tmp_path / "hang.py"
    hang.write_text(HANGS)
    args = ["--run_dir", str(tmp_path / "run"), *small_run(assets, reward=False, steps=1)]
    out = rlhf("train", "grpo", *args, "--reward.reward_func", str(hang),
               "--reward.timeout_s", "1")  # fmt: skip
    assert out.returncode == 2, (out.stdout[-2000:], out.stderr[-3000:])
    assert f"reward function reward_func in {hang} did not return within 1.0 s " in out.stderr
    assert "(reward.timeout_s)" in out.stderr


def test_the_reward_key_comes_from_the_flag_or_the_environment(monkeypatch) -> None:
    from rlhf.cli.sampling import reward_source
    from rlhf.cli.sections import RewardConfig

    url = "http://127.0.0.1:5000/get_reward"
    monkeypatch.delenv("RLHF_REWARD_API_KEY", raising=False)
    assert reward_source(RewardConfig(remote_url=url)).config.api_key is None
    monkeypatch.setenv("RLHF_REWARD_API_KEY", "from-env")
    assert reward_source(RewardConfig(remote_url=url)).config.api_key == "from-env"
    flagged = RewardConfig(remote_url=url, api_key="from-flag")
    assert reward_source(flagged).config.api_key == "from-flag"
    assert "from-flag" not in repr(flagged)  # not echoed by a config print
