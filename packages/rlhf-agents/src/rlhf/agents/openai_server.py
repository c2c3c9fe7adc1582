"""OpenAI-compatible chat endpoint over a `Generator`, with per-session delta tokenization.

Each session has its own base URL, ``http://127.0.0.1:{port}/sessions/{id}/v1``, so any OpenAI
client works unchanged. The session keeps the token stream it has produced so far. A new
``/chat/completions`` request is rendered through the chat template; the rendered text must
extend the text of that stream, and only the extension is tokenized and appended (mask 0), so
the policy's sampled tokens are never re-tokenized. A request that does not extend the history
(an edited assistant message, a template that rewrites earlier turns) is refused with HTTP 400
and a message saying where the two diverge. ``/v1/models`` and ``/health`` are served as well.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rlhf.agents.seeds import seeded
from rlhf.agents.tokens import Tokenizer
from rlhf.agents.types import FinishReason, Generator, SamplingParams


class SessionError(ValueError):
    """A request that cannot be served in token space (HTTP 400)."""


@dataclass
class Session:
    """The token stream of one agent episode.

    Attributes:
        token_ids: Prompt, sampled actions and rendered turns, in order.
        action_mask: 1 on sampled tokens.
        logprobs: The sampler's log-prob on sampled tokens, 0 elsewhere.
        prompt_length: Tokens of the first request's prompt.
        finish_reasons: One per completion.
        weight_version: Of the last completion.
        truncated: The session ran out of its token budget.
        text: The rendered conversation so far (what the next request must extend).
        seed: Base of the session's request seeds: completion ``k`` is drawn with
            ``request_seed(seed, k)`` unless the request names a seed; None: unseeded.
    """

    token_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_length: int = 0
    finish_reasons: list[FinishReason] = field(default_factory=list)
    weight_version: int | None = None
    truncated: bool = False
    text: str = ""
    seed: int | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _divergence(history: str, rendered: str) -> str:
    i = next((k for k, (a, b) in enumerate(zip(history, rendered, strict=False)) if a != b), None)
    i = min(len(history), len(rendered)) if i is None else i
    return (
        f"the conversation does not extend this session's token history: they diverge at "
        f"character {i}; history has {history[max(0, i - 20) : i + 20]!r}, the request renders "
        f"{rendered[max(0, i - 20) : i + 20]!r}. Send back assistant messages exactly as they "
        "were returned, and do not rewrite earlier turns"
    )


class OpenAICompatibleServer:
    """Serves ``/sessions/{id}/v1/chat/completions`` from a `Generator` in token space.

    Args:
        generator: Samples completions.
        tokenizer: Tokenizer with a chat template.
        model_name: Name reported by ``/v1/models`` (requests may name any model).
        sampling: Defaults; a request's temperature, top_p, max_tokens, stop and seed override.
        max_len: Token budget of a session (prompt + all turns).
    """

    def __init__(
        self,
        *,
        generator: Generator,
        tokenizer: Tokenizer,
        model_name: str = "policy",
        sampling: SamplingParams,
        max_len: int,
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the OpenAI-compatible server needs a tokenizer with a chat template")
        self.generator = generator
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.sampling = sampling
        self.max_len = max_len
        self.sessions: dict[str, Session] = {}
        self._ids = itertools.count()
        self.app = self._build_app()

    def new_session(self, *, seed: int | None = None) -> str:
        """Open a session and return its id (its base URL is ``/sessions/{id}/v1``); ``seed``:
        see `Session`."""
        sid = f"s{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        self.sessions[sid] = Session(seed=seed)
        return sid

    def close_session(self, sid: str) -> Session:
        """Remove and return a session."""
        return self.sessions.pop(sid)

    def _sampling_for(self, body: Mapping[str, Any], room: int) -> SamplingParams:
        """The request's sampling. ``body`` is the parsed JSON request, its fields converted
        as they come (``int(max_tokens)``, ``tuple(stop)``)."""
        overrides: dict[str, object] = {}
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        overrides["max_new_tokens"] = min(int(max_tokens or self.sampling.max_new_tokens), room)
        for key in ("temperature", "top_p", "seed"):
            if body.get(key) is not None:
                overrides[key] = body[key]
        stop = body.get("stop")
        if stop:
            overrides["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        try:
            return self.sampling.replace(**overrides)
        except (TypeError, ValueError) as exc:
            raise SessionError(f"invalid sampling parameters: {exc}") from None

    async def complete(self, sid: str, body: Mapping[str, object]) -> dict[str, object]:
        """Serve one chat completion request of session ``sid``."""
        session = self.sessions.get(sid)
        if session is None:
            raise SessionError(f"unknown session {sid!r}")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise SessionError("'messages' must be a non-empty list")
        if body.get("n", 1) != 1:
            raise SessionError("only n=1 is supported: sample several sessions instead")
        if body.get("tools"):
            raise SessionError("tool definitions are not supported; describe tools in the prompt")
        async with session.lock:
            try:
                rendered = str(
                    self.tokenizer.apply_chat_template(
                        messages, tokenize=False, add_generation_prompt=True
                    )
                )
            except Exception as exc:
                raise SessionError(
                    f"the chat template cannot render these messages: {exc}"
                ) from None
            if not rendered.startswith(session.text):
                raise SessionError(_divergence(session.text, rendered))
            delta = list(
                self.tokenizer.encode(rendered[len(session.text) :], add_special_tokens=False)
            )
            room = self.max_len - len(session.token_ids) - len(delta)
            if room < 1:
                # Out of budget: answer like an engine at its length limit, and keep the stream
                # as it is (the agent sees finish_reason="length"; the episode is truncated).
                session.truncated = True
                session.finish_reasons.append("length")
                return self._response(
                    body,
                    content="",
                    finish_reason="length",
                    prompt_tokens=len(session.token_ids),
                    completion_tokens=0,
                )
            sampling = self._sampling_for(body, room)
            if body.get("seed") is None:
                sampling = seeded(sampling, session.seed, len(session.finish_reasons))
            # Nothing is committed before the generation succeeds: a refused or failed request
            # (the client may retry it) leaves the session exactly as it was.
            generation = await self.generator.generate([*session.token_ids, *delta], sampling)
            if not session.token_ids:
                session.prompt_length = len(delta)
            session.token_ids += [*delta, *generation.token_ids]
            session.action_mask += [0] * len(delta) + [1] * len(generation.token_ids)
            session.logprobs += [0.0] * len(delta) + list(generation.logprobs)
            session.finish_reasons.append(generation.finish_reason)
            session.weight_version = generation.weight_version
            # The rendered text itself, not a decode of the tokens: decoding need not invert
            # encoding (normalisers), and the next request is compared with this text.
            session.text = rendered + self.tokenizer.decode(
                list(generation.token_ids), skip_special_tokens=False
            )
        content = self.tokenizer.decode(list(generation.token_ids), skip_special_tokens=True)
        return self._response(
            body,
            content=content,
            finish_reason=generation.finish_reason,
            prompt_tokens=len(session.token_ids) - len(generation.token_ids),
            completion_tokens=len(generation.token_ids),
        )

    def _response(
        self,
        body: Mapping[str, object],
        *,
        content: str,
        finish_reason: FinishReason,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> dict[str, object]:
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "length" if finish_reason == "length" else "stop",
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="rlhf OpenAI-compatible policy endpoint")

        @app.exception_handler(SessionError)
        async def invalid_request(request: Request, exc: SessionError) -> JSONResponse:
            # OpenAI's error shape, so clients surface the message in their exception.
            error = {"message": str(exc), "type": "invalid_request_error", "code": None}
            return JSONResponse({"error": error}, status_code=400)

        models: dict[str, object] = {
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "owned_by": "rlhf"}],
        }

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/v1/models")
        async def list_models() -> dict[str, object]:
            return models

        @app.get("/sessions/{sid}/v1/models")
        async def list_session_models(sid: str) -> dict[str, object]:
            return models

        @app.post("/v1/chat/completions")
        async def sessionless() -> None:
            raise SessionError(
                "use a session's base URL, /sessions/{id}/v1, so its tokens are kept"
            )

        @app.post("/sessions/{sid}/v1/chat/completions")
        async def chat_completions(sid: str, request: Request) -> dict[str, object]:
            try:
                body = await request.json()
            except ValueError:
                raise SessionError("the request body is not JSON") from None
            if not isinstance(body, dict):
                raise SessionError("the request body must be a JSON object")
            if body.get("stream"):
                raise SessionError("streaming is not supported")
            return await self.complete(sid, body)

        return app
