"""An OpenRLHF 0.11 agent file of the OpenAI-server shape, run by ``rlhf`` unchanged but for
its import line.

The shape: an ``AgentExecutor(AgentExecutorBase)`` whose ``execute`` starts, on first use, an
OpenAI-compatible HTTP server on 127.0.0.1 over the ``llm_engine`` it is given, lets an agent
talk to that server with the ``openai`` client (``run_agent``), records every completion's
tokens and log-probs per session, and stitches one session into OpenRLHF's episode dict
(``observation_tokens``, ``action_ranges``, ``rollout_log_probs``, ``reward``, ...).

The agent answers the prompt; a wrong first answer is told ``:`` and gets one more try (half
reward). Tokens stay exactly as sampled: each request appends only the tokens of the messages
the session has not seen yet (no re-tokenisation of earlier turns). Run it with
``rlhf train grpo --train.agent_func_path examples/openrlhf_agent_openai_server.py ...``.
"""

from __future__ import annotations

import copy
import socket
import threading
import time
import urllib.request
import uuid

import uvicorn
from fastapi import FastAPI, Request
from openai import AsyncOpenAI

from rlhf.agents.openrlhf import AgentExecutorBase  # was openrlhf.utils.agent

TURNS = 2


class AgentExecutor(AgentExecutorBase):
    def _serve(self, llm_engine, hf_tokenizer) -> None:
        """The first episode's engine and tokenizer serve every later one (as OpenRLHF's)."""
        self.engine, self.tokenizer = llm_engine, hf_tokenizer
        self.sessions: dict[str, dict] = {}  # id -> {"tokens", "seen", "calls"}
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        app = FastAPI()
        app.get("/health")(self._health)
        app.post("/v1/chat/completions")(self._complete)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        threading.Thread(target=server.run, daemon=True).start()
        for _ in range(200):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.05)
        else:
            raise RuntimeError(f"the agent's server on port {port} did not start")
        self.client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")

    async def _health(self) -> dict:
        return {"status": "ok"}

    async def _complete(self, request: Request) -> dict:
        body = await request.json()
        session = self.sessions[body["session_id"]]
        messages = body["messages"]
        for message in messages[session["seen"] :]:  # only what this session has not seen
            if message["role"] != "assistant":
                session["tokens"] += self.tokenizer.encode(
                    message["content"], add_special_tokens=False
                )
        session["seen"] = len(messages)
        prompt = list(session["tokens"])
        room = self.max_length - len(prompt)
        params = copy.copy(self.sampling_params)
        params.max_tokens = min(body.get("max_tokens") or room, room)
        params.temperature = body.get("temperature", params.temperature)
        ids, text, finish = [], "", "length"
        if params.max_tokens > 0:
            out = (await self.engine.generate(prompt, params)).outputs[0]
            ids, text, finish = list(out.token_ids), out.text, out.finish_reason
            logprobs = [entry[t].logprob for t, entry in zip(ids, out.logprobs, strict=True)]
            session["calls"].append((prompt, ids, logprobs, finish))
            session["tokens"] += ids
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "policy"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish,
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(ids),
                "total_tokens": len(prompt) + len(ids),
            },
        }

    async def run_agent(self, prompt: str, label: str, session_id: str) -> dict:
        """The agent: plain OpenAI client calls, the session id in ``extra_body``."""
        messages = [{"role": "user", "content": prompt}]
        for turn in range(1, TURNS + 1):
            reply = await self.client.chat.completions.create(
                model="policy",
                messages=messages,
                max_tokens=self.sampling_params.max_tokens,
                extra_body={"session_id": session_id},
            )
            answer = reply.choices[0].message.content or ""
            if answer.strip() == str(label).strip():
                return {"reward": 1.0 / turn, "scores": 1.0, "extra_logs": {"tries": turn}}
            if reply.choices[0].finish_reason == "length" and turn < TURNS:
                break  # the episode's budget is spent
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": ":"}]
        return {"reward": 0.0, "scores": 0.0, "extra_logs": {"tries": turn}}

    async def execute(
        self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None
    ) -> dict:
        self.sampling_params, self.max_length = sampling_params, max_length
        if not hasattr(self, "client"):
            self._serve(llm_engine, hf_tokenizer)
        session_id = uuid.uuid4().hex
        self.sessions[session_id] = {"tokens": [], "seen": 0, "calls": []}
        try:
            result = await self.run_agent(prompt, label, session_id)
            calls = self.sessions[session_id]["calls"]
        finally:
            self.sessions.pop(session_id, None)
        if not calls:
            raise RuntimeError(f"session {session_id} generated nothing")
        last_prompt, last_ids, _, last_finish = calls[-1]
        tokens = last_prompt + last_ids
        logprobs = [0.0] * len(tokens)
        ranges = []
        for call_prompt, ids, lps, _ in calls:
            start = len(call_prompt)
            ranges.append((start, start + len(ids)))
            logprobs[start : start + len(ids)] = lps
        return {
            "prompt": prompt,
            "label": label,
            "observation_tokens": tokens,
            "action_ranges": [(a, b) for a, b in ranges if b > a],
            "rollout_log_probs": logprobs,
            "truncated": last_finish == "length",
            "reward": result.get("reward"),
            "scores": result.get("scores"),
            "extra_logs": result.get("extra_logs", {}),
        }
