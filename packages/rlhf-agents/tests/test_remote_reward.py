"""Remote rewards against a real FastAPI/uvicorn server on 127.0.0.1."""

import asyncio
import re
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import PlainTextResponse, StreamingResponse

from rlhf.agents import FailurePolicy, RemoteReward, RemoteRewardConfig, RewardError, shard_bounds


def make_app(state: dict) -> FastAPI:
    app = FastAPI()

    @app.post("/reward")
    async def reward(request: Request):
        body = await request.json()
        state.setdefault("sizes", []).append(len(body["query"]))
        assert set(body) == {"query", "prompts", "labels"}
        return {
            "rewards": [float(len(q)) for q in body["query"]],
            "scores": [float(label) for label in body["labels"]],
            "extra_logs": {"server": [1.0] * len(body["query"])},
        }

    @app.post("/error500")
    async def error500():
        state["error500"] = state.get("error500", 0) + 1
        return PlainTextResponse("internal boom: model not loaded", status_code=500)

    @app.post("/bad_request")
    async def bad_request():
        state["bad_request"] = state.get("bad_request", 0) + 1
        return PlainTextResponse("missing field labels", status_code=422)

    @app.post("/malformed")
    async def malformed():
        return PlainTextResponse("<html>not json</html>", status_code=200)

    @app.post("/hang")
    async def hang():
        await asyncio.sleep(3)
        return {"rewards": []}

    @app.post("/flaky")
    async def flaky(request: Request):
        state["flaky"] = state.get("flaky", 0) + 1
        if state["flaky"] <= 2:
            return PlainTextResponse("warming up", status_code=503)
        body = await request.json()
        return {"rewards": [0.5] * len(body["query"])}

    @app.post("/reward_b")
    async def reward_b(request: Request):
        body = await request.json()
        state.setdefault("sizes_b", []).append(len(body["query"]))
        return {"rewards": [-float(len(q)) for q in body["query"]]}

    @app.post("/trickle")
    async def trickle():
        async def slow():
            yield b'{"rewards": ['
            for _ in range(30):
                await asyncio.sleep(0.1)
                yield b" "
            yield b"1.0]}"

        return StreamingResponse(slow(), media_type="application/json")

    @app.post("/latin1")
    async def latin1():
        return Response(content=b"\xff\xfe not utf-8", media_type="application/json")

    @app.post("/extra_logs_list")
    async def extra_logs_list(request: Request):
        body = await request.json()
        return {"rewards": [1.0] * len(body["query"]), "extra_logs": [1]}

    @app.post("/wrong_length")
    async def wrong_length():
        return {"rewards": [1.0]}

    @app.post("/nan")
    async def nan(request: Request):
        body = await request.json()
        values = ", ".join(["NaN"] + ["1.0"] * (len(body["query"]) - 1))
        return Response(content=f'{{"rewards": [{values}]}}', media_type="application/json")

    return app


@pytest.fixture(scope="module")
def server():
    state: dict = {}
    config = uvicorn.Config(make_app(state), host="127.0.0.1", port=0, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        if time.monotonic() > deadline:
            raise RuntimeError("reward server did not start")
        time.sleep(0.02)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", state
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def refused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/reward"  # nothing listens there any more


def run(config: RemoteRewardConfig, n: int = 4):
    async def go():
        async with RemoteReward(config) as client:
            return await client.score(
                queries=["x" * (i + 1) for i in range(n)], prompts=["p"] * n, labels=list(range(n))
            )

    return asyncio.run(go())


def test_scores_through_the_wire_format(server) -> None:
    url, _ = server
    out = run(RemoteRewardConfig(urls=(f"{url}/reward",)))
    assert out.rewards == [1.0, 2.0, 3.0, 4.0]
    assert out.scores == [0.0, 1.0, 2.0, 3.0]
    assert out.extra_logs == {"server": [1.0] * 4}
    assert all(out.valid)


def test_shards_over_urls_without_empty_requests(server) -> None:
    url, state = server
    state["sizes"] = []
    out = run(RemoteRewardConfig(urls=(f"{url}/reward",) * 3), n=7)
    assert out.rewards == [float(i + 1) for i in range(7)]
    assert sorted(state["sizes"]) == [2, 2, 3]
    state["sizes"] = []
    run(RemoteRewardConfig(urls=(f"{url}/reward",) * 3), n=2)
    assert sorted(state["sizes"]) == [1, 1]
    state["sizes"] = []
    run(RemoteRewardConfig(urls=(f"{url}/reward",), max_batch_size=3), n=7)
    assert sorted(state["sizes"]) == [2, 2, 3]


@pytest.mark.parametrize(
    ("n", "urls", "max_batch", "expected"),
    [
        (0, 2, None, []),
        (5, 2, None, [(0, 3), (3, 5)]),
        (3, 8, None, [(0, 1), (1, 2), (2, 3)]),
        (10, 1, 4, [(0, 4), (4, 7), (7, 10)]),
    ],
)
def test_shard_bounds(n, urls, max_batch, expected) -> None:
    assert shard_bounds(n, n_urls=urls, max_batch_size=max_batch) == expected


def test_500_is_retried_then_raises_with_url_status_and_body(server) -> None:
    url, state = server
    state["error500"] = 0
    cfg = RemoteRewardConfig(urls=(f"{url}/error500",), max_retries=2, backoff_s=0.01)
    with pytest.raises(
        RewardError,
        match=r"/error500: HTTP 500, body: 'internal boom: model not loaded' \(after 3 attempts\)",
    ):
        run(cfg)
    assert state["error500"] == 3


def test_4xx_is_not_retried(server) -> None:
    url, state = server
    state["bad_request"] = 0
    with pytest.raises(RewardError, match="HTTP 422, body: 'missing field labels'"):
        run(RemoteRewardConfig(urls=(f"{url}/bad_request",), max_retries=3, backoff_s=0.01))
    assert state["bad_request"] == 1


def test_retries_recover_a_flaky_server(server) -> None:
    url, state = server
    state["flaky"] = 0
    out = run(RemoteRewardConfig(urls=(f"{url}/flaky",), max_retries=3, backoff_s=0.01))
    assert out.rewards == [0.5] * 4
    assert state["flaky"] == 3


def test_malformed_json(server) -> None:
    url, _ = server
    with pytest.raises(
        RewardError, match=r"/malformed: malformed JSON body: '<html>not json</html>'"
    ):
        run(RemoteRewardConfig(urls=(f"{url}/malformed",)))


def test_wrong_length_response(server) -> None:
    url, _ = server
    with pytest.raises(RewardError, match=r"'rewards' has 1 entries for a batch of 4 samples"):
        run(RemoteRewardConfig(urls=(f"{url}/wrong_length",)))


def test_timeout_then_skip_policy(server) -> None:
    url, _ = server
    cfg = RemoteRewardConfig(urls=(f"{url}/hang",), timeout_s=0.2, max_retries=1, backoff_s=0.01)
    with pytest.raises(RewardError, match=r"/hang: no answer within 0.2 s \(after 2 attempts\)"):
        run(cfg)
    skip = RemoteRewardConfig(
        urls=(f"{url}/hang",), timeout_s=0.2, max_retries=0, policy=FailurePolicy(on_failure="skip")
    )
    out = run(skip)
    assert out.valid == [False] * 4
    assert out.metrics["reward/failed"] == 4


def test_a_slow_server_and_each_retry_are_reported(server) -> None:
    # /hang answers after 3 s: each attempt times out at 0.3 s. While one waits, a line every
    # notice_s says so; the retry says when the failure policy applies: after the next attempt
    # (0.3 s) and the backoff before it (0.1 s), 0.4 s at most.
    url, _ = server
    lines: list[str] = []
    cfg = RemoteRewardConfig(urls=(f"{url}/hang",), timeout_s=0.3, max_retries=1,
                             backoff_s=0.1, notice_s=0.1)  # fmt: skip

    async def go():
        async with RemoteReward(cfg, report=lines.append) as client:
            await client.score(queries=["x"], prompts=["p"], labels=[0])

    with pytest.raises(RewardError, match=r"after 2 attempts"):
        asyncio.run(go())
    retries = [line for line in lines if "retrying" in line]
    assert retries == [
        f"{url}/hang: no answer within 0.3 s: retrying in 0.1 s (attempt 2 of 2; the failure "
        "policy applies in at most 0.4 s)"
    ]
    waiting = [line for line in lines if "waiting" in line]
    assert waiting and all(
        re.fullmatch(rf"{url}/hang: waiting 0\.\d s of 0\.3 s for an answer \(attempt [12] of 2; "
                     r"the failure policy applies in at most 0\.\d s\)", line)
        for line in waiting
    ), waiting  # fmt: skip


def test_refused_connection_with_fallback_keeps_the_healthy_shard(server, refused_url) -> None:
    url, _ = server
    cfg = RemoteRewardConfig(
        urls=(f"{url}/reward", refused_url),
        max_retries=1,
        backoff_s=0.01,
        policy=FailurePolicy(on_failure="fallback", fallback_reward=-5.0),
    )
    out = run(cfg)
    assert out.rewards == [1.0, 2.0, -5.0, -5.0]
    assert all(out.valid)
    assert out.metrics["reward/failed_requests"] == 1
    with pytest.raises(RewardError, match=r"ConnectError"):
        run(RemoteRewardConfig(urls=(refused_url,), max_retries=0))


def test_nan_reward_from_the_server(server) -> None:
    url, _ = server
    with pytest.raises(RewardError, match=r"sample 0: reward nan \(float\) is not a finite number"):
        run(RemoteRewardConfig(urls=(f"{url}/nan",)))
    out = run(RemoteRewardConfig(urls=(f"{url}/nan",), policy=FailurePolicy(on_failure="skip")))
    assert out.valid == [False, True, True, True]


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="needs at least one URL"):
        RemoteRewardConfig(urls=())
    with pytest.raises(ValueError, match="must start with http:// or https://"):
        RemoteRewardConfig(urls=("127.0.0.1:5000",))
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        RemoteRewardConfig(urls=("http://x",), timeout_s=0)


def test_round_robin_over_distinct_urls(server) -> None:
    url, state = server
    state["sizes"], state["sizes_b"] = [], []
    out = run(RemoteRewardConfig(urls=(f"{url}/reward", f"{url}/reward_b")), n=5)
    # Shards [0, 3) to the first URL, [3, 5) to the second (which negates).
    assert out.rewards == [1.0, 2.0, 3.0, -4.0, -5.0]
    assert state["sizes"] == [3]
    assert state["sizes_b"] == [2]


def test_a_trickling_server_hits_the_hard_deadline(server) -> None:
    url, _ = server
    with pytest.raises(RewardError, match=r"/trickle: no answer within 0.5 s"):
        run(RemoteRewardConfig(urls=(f"{url}/trickle",), timeout_s=0.5, max_retries=0))


@pytest.mark.parametrize(
    ("path", "message"),
    [("latin1", "malformed JSON body"), ("extra_logs_list", "'extra_logs' must be a dict")],
)
def test_odd_bodies_follow_the_policy(server, path, message) -> None:
    url, _ = server
    with pytest.raises(RewardError, match=message):
        run(RemoteRewardConfig(urls=(f"{url}/{path}",)))
    out = run(RemoteRewardConfig(urls=(f"{url}/{path}",), policy=FailurePolicy(on_failure="skip")))
    assert out.valid == [False] * 4


def test_a_client_is_reusable_across_event_loops(server) -> None:
    url, _ = server
    client = RemoteReward(RemoteRewardConfig(urls=(f"{url}/reward",)))

    async def once():
        return await client.score(queries=["ab"], prompts=["p"], labels=[0])

    assert asyncio.run(once()).rewards == [2.0]
    assert asyncio.run(once()).rewards == [2.0]
