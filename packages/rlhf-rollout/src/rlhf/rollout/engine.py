"""An in-process vLLM engine behind the `rlhf.agents.Generator` protocol.

vLLM's `AsyncLLM` always runs its engine core in a child process (vllm 0.32: even with
VLLM_ENABLE_V1_MULTIPROCESSING=0), which costs ~12 s more at start and needs a ``__main__``
guard in every script. This engine instead builds the in-process `LLMEngine` and drives its
``step()`` loop from one background thread: ``generate`` coroutines enqueue requests and await
futures that the thread resolves. Every vLLM call happens on that thread.

Log-probs are vLLM's ``processed_logprobs`` of the sampled tokens (after temperature, top-k and
top-p), which is what importance-sampling correction needs.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from rlhf.agents import Generation, SamplingParams
from rlhf.rollout.buckets import WeightBucket, iter_tensors, validate_sync
from rlhf.rollout.config import EngineConfig

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class EngineError(RuntimeError):
    """The engine failed to start or to serve a request."""


def _vllm_sampling(sampling: SamplingParams) -> Any:
    from vllm import SamplingParams as VllmSamplingParams  # pyright: ignore[reportMissingImports]
    from vllm.sampling_params import RequestOutputKind  # pyright: ignore[reportMissingImports]

    return VllmSamplingParams(
        n=1,
        max_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else -1,
        stop=list(sampling.stop) or None,
        stop_token_ids=list(sampling.stop_token_ids) or None,
        seed=sampling.seed,
        logprobs=0,
        detokenize=bool(sampling.stop),
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


class VLLMEngine:
    """A `Generator` backed by one in-process vLLM engine.

    Args:
        config: Engine options.

    Use `start` (or the async context manager) before `generate`, and `shutdown` at the end.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.weight_version = 0
        self._engine: Any = None
        self._thread: threading.Thread | None = None
        self._inbox: queue.Queue[tuple[str, Any, Any, Future[Any]] | None] = queue.Queue()
        self._pending: dict[str, Future[Any]] = {}
        self._ids = itertools.count()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._tokens_generated = 0
        self._requests_done = 0
        self._expected: dict[str, tuple[tuple[int, ...], str]] | None = None
        self._dead: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, timeout_s: float = 600.0) -> VLLMEngine:
        """Build the engine on its own thread and wait until it is ready."""
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name="rlhf-vllm-engine", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise EngineError(
                f"vLLM engine for {self.config.model!r} did not start within {timeout_s} s"
            )
        if self._start_error is not None:
            self._thread = None  # a failed engine can be started again, never half-used
            raise EngineError(
                f"vLLM engine for {self.config.model!r} failed to start: {self._start_error!r}"
            ) from self._start_error
        return self

    async def __aenter__(self) -> VLLMEngine:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """Stop the step thread; pending requests fail with `EngineError`."""
        if self._thread is None:
            return
        self._inbox.put(None)
        self._thread.join(timeout=60)
        self._thread = None

    def _build(self) -> Any:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.config.cpu_kv_cache_gib))
        from vllm.engine.arg_utils import EngineArgs  # pyright: ignore[reportMissingImports]
        from vllm.v1.engine.llm_engine import LLMEngine  # pyright: ignore[reportMissingImports]

        c = self.config
        args = EngineArgs(
            model=c.model,
            dtype=c.dtype,
            max_model_len=c.max_model_len,
            seed=c.seed,
            enforce_eager=c.enforce_eager,
            enable_prefix_caching=c.enable_prefix_caching,
            tensor_parallel_size=c.tensor_parallel_size,
            gpu_memory_utilization=c.gpu_memory_utilization,
            max_num_seqs=c.max_num_seqs,
            logprobs_mode="processed_logprobs",
        )
        return LLMEngine.from_engine_args(args)

    # -- the step thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._engine = self._build()
        except BaseException as exc:
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        try:
            self._loop()
        except BaseException as exc:  # never leave callers awaiting a dead thread
            self._dead = exc
            self._fail_all(EngineError(f"the engine thread died: {exc!r}"))

    def _loop(self) -> None:
        while True:
            block = not self._pending
            try:
                while True:
                    item = self._inbox.get(block=block)
                    block = False
                    if item is None:
                        self._dead = EngineError("the engine was shut down")
                        self._fail_all(self._dead)
                        return
                    self._dispatch(item)
            except queue.Empty:
                pass
            if self._pending:
                self._step()

    def _dispatch(self, item: tuple[str, Any, Any, Future[Any]]) -> None:
        kind, payload, extra, future = item
        try:
            if kind == "generate":
                from vllm.inputs import TokensPrompt  # pyright: ignore[reportMissingImports]

                request_id = f"r{next(self._ids)}"
                self._engine.add_request(request_id, TokensPrompt(prompt_token_ids=payload), extra)
                self._pending[request_id] = future
            else:  # a call on the engine, run on this thread
                future.set_result(payload(self._engine, *extra))
        except BaseException as exc:
            future.set_exception(exc)

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except BaseException as exc:
            self._fail_all(EngineError(f"vLLM step failed: {exc!r}"))
            return
        for out in outputs:
            if not out.finished:
                continue
            future = self._pending.pop(out.request_id, None)
            if future is None:
                continue
            try:
                future.set_result(self._to_generation(out))
            except Exception as exc:  # a malformed output fails its request, not the thread
                future.set_exception(EngineError(f"request {out.request_id}: {exc!r}"))

    def _to_generation(self, out: Any) -> Generation:
        completion = out.outputs[0]
        ids = tuple(int(t) for t in completion.token_ids)
        lps = tuple(
            float(d[t].logprob) for d, t in zip(completion.logprobs or [], ids, strict=True)
        )
        self._tokens_generated += len(ids)
        self._requests_done += 1
        return Generation(
            token_ids=ids,
            logprobs=lps,
            finish_reason=_FINISH.get(str(completion.finish_reason), "stop"),  # type: ignore[arg-type]
            weight_version=self.weight_version,
        )

    def _fail_all(self, error: BaseException) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()

    # -- weights ---------------------------------------------------------------------------
    def checkpoint_params(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Checkpoint names → (shape, dtype) of the model directory's safetensors files."""
        if self._expected is None:
            self._expected = read_checkpoint_params(self.config.model)
        return self._expected

    def update_weights(self, buckets: Sequence[WeightBucket], *, require_all: bool = True) -> int:
        """Validate a whole sync, then load it into the live engine (blocking).

        Nothing is loaded unless every bucket and tensor checks out (`validate_sync`); on a
        `WeightSyncError` the engine keeps serving its previous weights. After loading, the
        prefix cache is reset and `weight_version` becomes the sync's version.

        Returns:
            The new weight version.
        """
        version = validate_sync(buckets, expected=self.checkpoint_params(), require_all=require_all)
        self.call(_load_buckets, list(buckets))
        self.weight_version = version
        return version

    # -- public API ------------------------------------------------------------------------
    async def generate(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> Generation:
        """Sample one completion of ``prompt_token_ids`` (see `rlhf.agents.Generator`)."""
        if self._thread is None:
            raise EngineError("call start() before generate()")
        if self._dead is not None:
            raise EngineError(f"the engine is not serving: {self._dead!r}")
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        if len(ids) + sampling.max_new_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens + max_new_tokens={sampling.max_new_tokens} exceeds "
                f"vllm.max_model_len={self.config.max_model_len}"
            )
        future: Future[Generation] = Future()
        self._inbox.put(("generate", ids, _vllm_sampling(sampling), future))
        return await asyncio.wrap_future(future)

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(llm_engine, *args)`` on the engine thread and return its result (blocking)."""
        if self._thread is None:
            raise EngineError("call start() before call()")
        future: Future[Any] = Future()
        self._inbox.put(("call", fn, args, future))
        return future.result()

    def metrics(self) -> dict[str, float]:
        """Requests finished, tokens generated and requests in flight."""
        return {
            "engine/requests_done": float(self._requests_done),
            "engine/tokens_generated": float(self._tokens_generated),
            "engine/in_flight": float(len(self._pending)),
        }


_SAFETENSORS_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "U8": "uint8",
    "BOOL": "bool",
}


def read_checkpoint_params(model_dir: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Names, shapes and dtypes of the tensors in a checkpoint's safetensors (headers only)."""
    import json
    import pathlib
    import struct

    files = sorted(pathlib.Path(model_dir).glob("*.safetensors"))
    if not files:
        raise EngineError(
            f"no .safetensors files in {model_dir!r}: cannot check weight syncs against it"
        )
    params: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in files:
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                dtype = str(info["dtype"])
                params[name] = (tuple(info["shape"]), _SAFETENSORS_DTYPES.get(dtype, dtype))
    return params


def _load_buckets(llm_engine: Any, buckets: list[WeightBucket]) -> None:
    """On the engine thread: layer-wise reload of checkpoint-format tensors, then refresh."""
    llm_engine.collective_rpc(
        "reload_weights",
        kwargs={"weights_iterator": iter_tensors(buckets), "is_checkpoint_format": True},
    )
    llm_engine.collective_rpc(_refresh_tied_lm_head)
    llm_engine.reset_prefix_cache()


def _refresh_tied_lm_head(worker: Any) -> None:
    """vllm-cpu packs linear weights into GEMM handles at load time; a tied ``lm_head`` shares
    the embedding's storage but keeps its old handle after a reload, so logits would silently
    come from the old weights. Re-dispatch it (a no-op on other platforms)."""
    model = worker.model_runner.model
    lm_head = getattr(model, "lm_head", None)
    if lm_head is None or not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return
    try:
        from vllm.model_executor.layers.utils import (  # pyright: ignore[reportMissingImports]
            dispatch_cpu_unquantized_gemm,
        )
    except ImportError:
        return
    dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
