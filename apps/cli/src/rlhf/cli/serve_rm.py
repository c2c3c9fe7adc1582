"""``rlhf serve-rm``: a trained reward model behind HTTP, in OpenRLHF's wire format.

``POST /get_reward`` with ``{"query": [text, ...], "prompts": [...]?, "labels": [...]?}``
answers ``{"rewards": [score, ...], "scores": [score, ...]}``: each query (prompt and response
as one text, special tokens included, as the rollout decodes them) is tokenized without adding
special tokens, keeps its last ``max_len`` tokens, and is scored by the model's scalar head at
its last token, the same reading as training and ``--train.reward_model_path``. ``GET /health``
answers ``{"status": "ok"}``. The server binds 127.0.0.1 unless ``--host`` says otherwise; with
``--api_key`` every scoring request must carry ``Authorization: Bearer <key>`` (401 otherwise;
runs pass it with ``--reward.api_key``), and binding another interface without one prints a
warning. A model without a trained score head (a causal LM) is refused: it would answer 0.0 for
everything.
Point a run at it with ``--reward.remote_url http://127.0.0.1:PORT/get_reward``.
"""

from __future__ import annotations

import hmac
import importlib.util
import ipaddress
import math
import pathlib
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


@dataclass(frozen=True)
class ServeRMConfig:
    """``rlhf serve-rm``.

    Attributes:
        model_path: A reward model: ``rlhf train rm``'s export (run_dir/final).
        host: Interface to bind; 127.0.0.1 keeps it local to this machine.
        port: TCP port.
        max_len: Tokens kept per query (the last ones: the score is read at the end).
        batch_size: Queries per forward pass.
        dtype: ``float32`` or ``bfloat16`` (with ``load_in_4bit``: the dtype it computes in).
        load_in_4bit: Load the decoder's linear layers as bitsandbytes 4-bit NF4 weights (the
            score head stays dense): about a quarter of their memory, scores within the
            quantisation's error of the dense model's (``pip install 'rlhf-cli[qlora]'``;
            OpenRLHF's ``--ds.load_in_4bit``).
        api_key: Scoring requests must send ``Authorization: Bearer <api_key>`` (empty: no
            check; then keep the default host).
    """

    model_path: str = ""
    host: str = "127.0.0.1"
    port: int = 5000
    max_len: int = 2048
    batch_size: int = 16
    dtype: str = "float32"
    load_in_4bit: bool = False
    api_key: str = field(default="", repr=False)


class RewardModelScorer:
    """Scores texts with a scalar-head model; one forward at a time (a lock serialises callers).

    Args:
        config: Which model, how many tokens and queries per pass.
    """

    def __init__(self, config: ServeRMConfig) -> None:
        from transformers import AutoTokenizer

        from rlhf.learner import ModelConfig, load_model

        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = load_model(
            ModelConfig(
                path=config.model_path,
                kind="scalar",
                dtype=config.dtype,
                load_in_4bit=config.load_in_4bit,
            )
        )
        self.model = model.to(self.device).eval()
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._lock = threading.Lock()

    def score(self, texts: Sequence[str]) -> list[float]:
        """One score per text, in order."""
        from rlhf.learner import collate, sequence_scores

        ids = [
            self.tokenizer(t, add_special_tokens=False)["input_ids"][-self.config.max_len :]
            for t in texts
        ]
        out: list[float] = []
        with self._lock, torch.no_grad():
            for lo in range(0, len(ids), self.config.batch_size):
                chunk = [row or [self.pad] for row in ids[lo : lo + self.config.batch_size]]
                batch = collate(chunk, pad_token_id=self.pad).to(self.device)
                scores = sequence_scores(self.model, batch.input_ids, batch.attention_mask)
                out.extend(float(s) for s in scores.cpu())
        return out


class RequestError(ValueError):
    """A request body the server cannot score (HTTP 400)."""


def parse_queries(body: Any) -> list[str]:
    """The ``query`` list of a request body, or a `RequestError` naming what is wrong."""
    if not isinstance(body, dict):
        raise RequestError(
            f"the body must be a JSON object with 'query', got {type(body).__name__}"
        )
    if "query" not in body:
        raise RequestError(f"missing key 'query' (a list of texts); keys given: {sorted(body)}")
    queries = body["query"]
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise RequestError("'query' must be a list of strings (prompt + response texts)")
    return queries


def build_app(scorer: RewardModelScorer, *, api_key: str = "") -> FastAPI:
    """The FastAPI app serving ``scorer`` (``api_key``: required on scoring requests)."""
    app = FastAPI(title="rlhf reward model")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/get_reward")
    async def get_reward(request: Request) -> JSONResponse:
        if api_key and not hmac.compare_digest(
            request.headers.get("authorization", ""), f"Bearer {api_key}"
        ):
            return JSONResponse(
                {"error": "missing or wrong 'Authorization: Bearer <key>' (--api_key)"},
                status_code=401,
            )
        try:
            queries = parse_queries(await request.json())
        except ValueError as exc:  # RequestError or a body that is not JSON
            return JSONResponse({"error": str(exc)}, status_code=400)
        scores = await _in_thread(scorer.score, queries)
        if not all(math.isfinite(s) for s in scores):
            bad = [i for i, s in enumerate(scores) if not math.isfinite(s)]
            return JSONResponse(
                {"error": f"the reward model produced non-finite scores at {bad}"}, status_code=500
            )
        return JSONResponse({"rewards": scores, "scores": scores})

    return app


def _loopback(host: str) -> bool:
    """``host`` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _in_thread(fn: Any, *args: Any) -> Any:
    import asyncio

    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def serve_rm(config: ServeRMConfig) -> None:
    """Load the model and serve until interrupted."""
    import uvicorn

    from rlhf.cli.config import ConfigError
    from rlhf.learner import check_model_dir, checkpoint_names

    if not config.model_path:
        raise ConfigError("--model_path is required (an `rlhf train rm` export)")
    if not 0 <= config.port < 65536:
        raise ConfigError(f"--port must be in [0, 65535], got {config.port}")
    if config.max_len < 1 or config.batch_size < 1:
        raise ConfigError("--max_len and --batch_size must be >= 1")
    if config.load_in_4bit and importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(
            "--load_in_4bit (OpenRLHF's --ds.load_in_4bit) needs bitsandbytes, which is not "
            "installed: pip install 'rlhf-cli[qlora]', or serve the model dense"
        )
    check_model_dir(config.model_path)
    if not any(n.startswith("score.") for n in checkpoint_names(pathlib.Path(config.model_path))):
        raise ConfigError(
            f"--model_path {config.model_path!r} has no trained score head (no 'score.*' "
            "tensors): it is a language model, not a reward model, and would score every text "
            "0.0; serve an `rlhf train rm` export (its run_dir/final)"
        )
    if not config.api_key and not _loopback(config.host):
        print(
            f"[serve-rm] warning: --host {config.host} exposes the reward model beyond this "
            "machine without authentication; set --api_key (runs pass it with "
            "--reward.api_key) or bind 127.0.0.1",
            file=sys.stderr,
            flush=True,
        )
    app = build_app(RewardModelScorer(config), api_key=config.api_key)
    print(f"[serve-rm] http://{config.host}:{config.port}/get_reward", flush=True)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning")
