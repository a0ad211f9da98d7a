"""``PyExecutorEmulator``: TensorRT-LLM's PyExecutor with a connector, on a real model.

Construction follows ``py_executor_creator.py`` and ``PyExecutor.__init__``:

1. creator checks: the ``GUARANTEED_NO_EVICT`` policy and no CUDA graphs;
2. the connector classes (given, or imported from ``llm_args.kv_connector_config`` with
   ``importlib``) are built concurrently in a 2-thread pool: the worker on every rank, the
   scheduler on rank 0 only; ``worker.register_forward_pass_callable()``; the manager;
3. ``_maybe_init_kv_connector_manager``: rejects PP/CP > 1, beam search, attention DP and a
   host cache tier, then ``worker.register_kv_caches(pool)`` (``KVCacheManagerV2``:
   ``register_kv_cache_layout(layout)``, or the base default through
   ``layout.as_single_pool_tensor()``), the layer hooks and, on the main runtime only,
   ``scheduler.wait_for_initialization()``.

Rejections raise :class:`UnsupportedConfiguration`, which is both ``NotImplementedError``
(what TensorRT-LLM raises) and ``ValueError``.

Requests are submitted with :meth:`PyExecutorEmulator.submit` or
:meth:`PyExecutorEmulator.generate`; the loop (:mod:`s3kv.testing.emulator.loop`) runs only while
one of those, :meth:`~PyExecutorEmulator.step` or :meth:`~PyExecutorEmulator.drain` is
called, like TensorRT-LLM's loop, which blocks on its request queue when idle. Under tensor
parallelism every rank constructs its own executor and makes the same calls in the same
order (see :mod:`s3kv.testing.emulator.parallel`).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from s3kv.connector.api import KvCacheConnectorScheduler, KvCacheConnectorWorker
from s3kv.connector.comm import Collectives, get_collectives
from s3kv.testing.emulator.connector_manager import KvCacheConnectorManager
from s3kv.testing.emulator.device import LateDevice
from s3kv.testing.emulator.kv_cache_manager import KVCacheManager, PrefixStats
from s3kv.testing.emulator.kv_cache_manager_v2 import KVCacheManagerV2
from s3kv.testing.emulator.layout import register_kv_cache_layout
from s3kv.testing.emulator.llm_args import CapacitySchedulerPolicy, TorchLlmArgs
from s3kv.testing.emulator.loop import ExecutorLoop, Tracked
from s3kv.testing.emulator.model import PagedLlama
from s3kv.testing.emulator.request import FinishReason, LlmRequest, MultimodalInput
from s3kv.testing.emulator.scheduler import RequestScheduler

ModelSource = PagedLlama | Callable[[int, int], PagedLlama]


class UnsupportedConfiguration(NotImplementedError, ValueError):  # noqa: N818
    """A configuration TensorRT-LLM (or this emulator) refuses at construction."""


class EmulatorStall(RuntimeError):  # noqa: N818
    """The loop can make no progress (e.g. an async transfer never reported finished)."""


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """One finished request.

    Attributes:
        request_id: The runtime's id (starts at ``max_batch_size``, as in TensorRT-LLM).
        prompt_tokens: The prompt.
        output_tokens: Greedy tokens generated (``max_new_tokens`` of them).
        reused_tokens: Prompt tokens matched in the local reuse tree.
        connector_tokens: Prompt tokens the connector claimed.
        computed_tokens: Prompt tokens computed by the forward passes.
        loaded_async: The connector loaded asynchronously (the request was parked).
        ttft_s: Wall seconds from submission to the first generated token (``nan`` when a
            cancelled or failed request produced none).
        latency_s: Wall seconds from submission to the last generated token (to the
            cancellation or failure).
        finish_reason: ``LENGTH``, ``CANCELLED`` (:meth:`PyExecutorEmulator.cancel`) or
            ``ERROR`` (:meth:`PyExecutorEmulator.fail_all`).
        error: The error message of a failed request.
    """

    request_id: int
    prompt_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    reused_tokens: int
    connector_tokens: int
    computed_tokens: int
    loaded_async: bool
    ttft_s: float
    latency_s: float
    finish_reason: FinishReason = FinishReason.LENGTH
    error: str | None = None


class PyExecutorEmulator:
    """An emulated TensorRT-LLM PyExecutor (V1 or V2 KV cache manager) for one rank."""

    def __init__(
        self,
        llm_args: TorchLlmArgs,
        model: ModelSource,
        *,
        num_blocks: int,
        connector_scheduler_cls: type[KvCacheConnectorScheduler] | None = None,
        connector_worker_cls: type[KvCacheConnectorWorker] | None = None,
        overlap: bool | None = None,
        stream: Any = None,
        collectives: Collectives | None = None,
        stall_timeout_s: float = 60.0,
        late_device: bool | None = None,
        runtime: Literal["1.2", "main"] = "main",
        copy_leader_results: bool = True,
    ) -> None:
        """Build the executor, its KV pool and (optionally) the connector.

        Args:
            llm_args: The configuration both connector classes are constructed with.
            model: This rank's :class:`PagedLlama`, or ``factory(rank, world_size)``.
            num_blocks: KV blocks in the pool.
            connector_scheduler_cls: Scheduler class; with ``connector_worker_cls``
                overrides ``llm_args.kv_connector_config``. Neither and no config: no
                connector.
            connector_worker_cls: Worker class.
            overlap: Run the overlap loop; ``None`` follows
                ``not llm_args.disable_overlap_scheduler``.
            stream: Passed as ``stream`` to the worker; ``None`` means
                ``torch.cuda.current_stream()`` on a CUDA model, the late device's stream
                with ``late_device`` and ``None`` otherwise.
            collectives: Rank and collectives; default
                :func:`s3kv.connector.comm.get_collectives`.
            stall_timeout_s: Idle seconds (nothing scheduled, transfers pending) before
                :class:`EmulatorStall`.
            late_device: Queue the model's work, and hand the worker the stream of, a
                :class:`~s3kv.testing.emulator.device.LateDevice` that runs it only where the host
                synchronises (see :mod:`s3kv.testing.emulator.loop`). ``None``: on when the model is
                on the CPU and no ``stream`` is given. Never on a CUDA model (real streams).

            runtime: Which TensorRT-LLM to emulate. ``"main"`` (py_executor.py @
                ``00043967``, connector manager @ ``035ab91c``): ``wait_for_initialization``
                at construction, ``handle_metadata`` every iteration, ``KVCacheManagerV2``
                available. ``"1.2"`` (the 155 kB py_executor.py, stored-file id 3542389387):
                no ``wait_for_initialization``, ``handle_metadata`` only inside
                ``_kv_connector_start_batch``, V1 only.
            copy_leader_results: With one rank, hand the connector's workers a pickled copy
                of the scheduler's results (checks they survive TP's broadcast); ``False``:
                the objects themselves, as TensorRT-LLM does with one rank (see
                :class:`~s3kv.testing.emulator.connector_manager.KvCacheConnectorManager`).

        Raises:
            UnsupportedConfiguration: A configuration TensorRT-LLM rejects with a connector,
                or one this emulator does not model (V2 on the 1.2 runtime).
            ValueError: Inconsistent arguments (block size, TP size, one class only,
                ``late_device=True`` with a CUDA model or an explicit ``stream``).
        """
        if runtime not in ("1.2", "main"):
            raise ValueError(f"runtime: must be '1.2' or 'main', got {runtime!r}")
        if runtime == "1.2" and llm_args.kv_cache_config.use_kv_cache_manager_v2:
            raise UnsupportedConfiguration(
                "kv_cache_config.use_kv_cache_manager_v2: the 1.2-era runtime has no "
                "KVCacheManagerV2 connector path (query/commit, layouts)"
            )
        self.runtime = runtime
        self.llm_args = llm_args
        self.collectives = collectives if collectives is not None else get_collectives()
        rank, world = self.collectives.rank, self.collectives.world_size
        self.model = model if isinstance(model, PagedLlama) else model(rank, world)
        self._stream = stream
        self._cuda_stream: Any = None
        on_cpu = self.model.device.type != "cuda"
        if late_device and (not on_cpu or stream is not None):
            raise ValueError("late_device: only for a CPU model without an explicit stream")
        use_late = on_cpu and stream is None if late_device is None else late_device
        self.device: LateDevice | None = LateDevice() if use_late else None
        self._stall_timeout_s = stall_timeout_s
        self._idle_since: float | None = None
        kv_config = llm_args.kv_cache_config
        tpb = kv_config.tokens_per_block
        if self.model.geometry.tokens_per_block != tpb:
            raise ValueError(
                f"model: tokens_per_block is {self.model.geometry.tokens_per_block}, "
                f"llm_args.kv_cache_config.tokens_per_block is {tpb}"
            )
        if llm_args.tensor_parallel_size != world or self.model.tp_size != world:
            raise ValueError(
                f"tensor_parallel_size: llm_args {llm_args.tensor_parallel_size}, model "
                f"{self.model.tp_size}, process group {world}: all three must agree"
            )
        self.overlap = not llm_args.disable_overlap_scheduler if overlap is None else overlap
        classes = _connector_classes(llm_args, connector_scheduler_cls, connector_worker_cls)
        self.connector_manager: KvCacheConnectorManager | None = None
        forward_callable = None
        if classes is not None:
            _check_creator_envelope(llm_args, runtime)
            worker, scheduler = _instantiate(llm_args, *classes, rank=rank)
            forward_callable = worker.register_forward_pass_callable()
            self.connector_manager = KvCacheConnectorManager(
                worker,
                scheduler,
                collectives=self.collectives,
                stream=self.current_stream,
                copy_leader_results=copy_leader_results,
            )
        _check_executor_envelope(llm_args, runtime, connector=classes is not None)
        self.pool = self.model.new_pool(num_blocks)
        manager_cls = KVCacheManagerV2 if kv_config.use_kv_cache_manager_v2 else KVCacheManager
        self.kv_cache_manager: KVCacheManager = manager_cls(
            num_blocks=num_blocks,
            tokens_per_block=tpb,
            enable_block_reuse=kv_config.enable_block_reuse,
            enable_partial_reuse=kv_config.enable_partial_reuse,
            copy_on_partial_reuse=kv_config.copy_on_partial_reuse,
            pool=self.pool,
            connector_manager=self.connector_manager,
            enqueue=None if self.device is None else self.device.enqueue,
        )
        self._loop = ExecutorLoop(
            model=self.model,
            pool=self.pool,
            kv=self.kv_cache_manager,
            scheduler=RequestScheduler(
                self.kv_cache_manager,
                max_batch_size=llm_args.max_batch_size,
                max_num_tokens=llm_args.max_num_tokens,
                enable_chunked_prefill=llm_args.enable_chunked_prefill,
                tokens_per_block=tpb,
            ),
            connector=self.connector_manager,
            forward_callable=forward_callable,
            overlap=self.overlap,
            stream=self.current_stream,
            clock=time.perf_counter,
            device=self.device,
            runtime=runtime,
            graph_decode=llm_args.cuda_graph_config is not None,
        )
        # NOTE: the first max_batch_size ids are reserved for dummy requests upstream.
        self._next_id = llm_args.max_batch_size
        if self.connector_manager is not None:
            worker = self.connector_manager.worker
            if isinstance(self.kv_cache_manager, KVCacheManagerV2):
                # NOTE: V2's call site was not located (trtllm-notes.md section 3); placed
                # where V1 registers. Without the method: the base class default.
                register_kv_cache_layout(worker, self.kv_cache_manager.get_kv_cache_layout())
            else:
                worker.register_kv_caches(self.kv_cache_manager.get_unique_primary_pool())
            if runtime == "main":  # NOTE: added after 1.2 (PR #9698)
                self.connector_manager.wait_for_initialization()

    # --- public API ---

    def current_stream(self) -> Any:
        """The stream handed to the worker (``torch.cuda.current_stream()`` upstream).

        On CUDA it is looked up once per iteration (:meth:`step`): the host code of one
        iteration never switches streams, and the lookup costs ~10 µs per layer hook.
        """
        if self.device is not None:
            return self.device.stream()
        if self._stream is not None or self.model.device.type != "cuda":
            return self._stream
        if self._cuda_stream is None:
            import torch

            self._cuda_stream = torch.cuda.current_stream(self.model.device)
        return self._cuda_stream

    @property
    def iterations(self) -> int:
        """Executor iterations run so far."""
        return self._loop.iterations

    @property
    def forward_passes(self) -> int:
        """Forward passes run so far."""
        return self._loop.forward_passes

    def submit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        cache_salt: str | None = None,
        lora_task_id: int | None = None,
        multimodal: Sequence[MultimodalInput] = (),
        prompt_table: Any = None,
    ) -> int:
        """Queue one request; returns its id. Nothing runs until the loop is driven.

        ``lora_task_id``, ``multimodal`` and ``prompt_table`` are what the connector sees on
        the request (see :class:`~s3kv.testing.emulator.request.LlmRequest`); the model
        ignores them.

        Raises:
            ValueError: Empty prompt, a token outside the vocabulary, a prompt longer than
                ``max_num_tokens`` without chunked prefill, or a request that could never
                fit in the pool.
        """
        args = self.llm_args
        if not args.enable_chunked_prefill and len(prompt) > args.max_num_tokens:
            raise ValueError(
                f"prompt: {len(prompt)} tokens exceed max_num_tokens ({args.max_num_tokens}) "
                "and chunked prefill is disabled"
            )
        if any(not 0 <= int(t) < self.model.vocab_size for t in prompt):
            raise ValueError(f"prompt: token ids must be in [0, {self.model.vocab_size})")
        request = LlmRequest(
            self._next_id, prompt, max_new_tokens, cache_salt=cache_salt,
            lora_task_id=lora_task_id, multimodal=multimodal, prompt_table=prompt_table,
        )  # fmt: skip
        needed = self.kv_cache_manager.blocks_to_completion(request)
        if needed > self.pool.shape[0]:
            raise ValueError(f"request: needs {needed} blocks, the pool has {self.pool.shape[0]}")
        self._next_id += 1
        self._loop.active.append(request)
        self._loop.tracked[request.request_id] = Tracked(request, time.perf_counter())
        return request.request_id

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        cache_salt: str | None = None,
        **inputs: Any,
    ) -> list[GenerationResult]:
        """Submit ``prompts`` together and run until all of them have finished generating.

        ``inputs`` (``lora_task_id``, ``multimodal``, ``prompt_table``) go to every request.
        Async saves may still hold blocks afterwards; :meth:`drain` waits for them.
        """
        ids = [self.submit(p, max_new_tokens, cache_salt=cache_salt, **inputs) for p in prompts]
        self.run_until_complete(ids)
        return [self.result(rid) for rid in ids]

    def run_until_complete(self, request_ids: Sequence[int]) -> None:
        """Iterate until every request in ``request_ids`` has finished generating.

        Returns with the device synchronised (no queued work left).
        """
        while not all(self.is_finished(rid) for rid in request_ids):
            self._checked_step()
        self.synchronize()

    def drain(self) -> None:
        """Iterate until no request is active and no async transfer is pending.

        Returns with the device synchronised (no queued work left).
        """
        while self._loop.active or self._transfers_pending():
            self._checked_step()
        self.synchronize()

    def synchronize(self) -> None:
        """Run all queued device work (a no-op without a late device).

        Under tensor parallelism queued work contains all-reduces: every rank must call this
        at the same point.
        """
        if self.device is not None:
            self.device.synchronize()

    def step(self) -> bool:
        """Run one iteration; whether anything moved."""
        self._cuda_stream = None  # NOTE: looked up again in each iteration
        return self._loop.step()

    def is_finished(self, request_id: int) -> bool:
        """Whether the request has finished generating (its blocks may still be saving)."""
        return self._loop.tracked[request_id].finished is not None

    def result(self, request_id: int) -> GenerationResult:
        """The result of a finished request.

        Raises:
            KeyError: Unknown id.
            RuntimeError: The request has not finished.
        """
        tracked = self._loop.tracked[request_id]
        if tracked.finished is None:
            raise RuntimeError(f"request {request_id} has not finished")
        req = tracked.request
        # NOTE: a request cancelled or failed before its allocation has no prefix stats.
        stats = self.kv_cache_manager.prefix_stats.get(request_id, PrefixStats(0, 0))
        first = tracked.first_token
        tokens = req.get_tokens(0)
        return GenerationResult(
            request_id=request_id,
            prompt_tokens=tuple(tokens[: req.prompt_len]),
            output_tokens=tuple(tokens[req.prompt_len :]),
            reused_tokens=stats.reused_tokens,
            connector_tokens=stats.connector_tokens,
            computed_tokens=req.prompt_len - stats.reused_tokens - stats.connector_tokens,
            loaded_async=tracked.loaded_async,
            ttft_s=math.nan if first is None else first - tracked.submitted,
            latency_s=tracked.finished - tracked.submitted,
            finish_reason=req.finish_reason or FinishReason.LENGTH,
            error=self._loop.errors.get(request_id),
        )

    def cancel(self, request_id: int) -> None:
        """Cancel a request; handled at the next iteration's ``_handle_canceled_requests``.

        The request then finishes as ``CANCELLED`` and is freed without ``request_finished``
        (see :meth:`s3kv.testing.emulator.loop.ExecutorLoop._handle_canceled_requests`); a request
        that already finished is unaffected. Plain loop: handled in an iteration that runs a
        forward pass; overlap loop: in one that commits a previous batch.

        Raises:
            KeyError: Unknown id.
        """
        if self._loop.tracked[request_id].finished is None:
            self._loop.canceled.add(request_id)

    def fail_all(self, message: str) -> list[int]:
        """``_handle_errors(message)`` with no request list: fail every active request.

        Each is terminated (``free_resources``) without any connector call; results have
        ``finish_reason == ERROR`` and ``error == message``. Returns the failed ids.
        """
        return self._loop.fail_all(message)

    # --- internals ---

    def _transfers_pending(self) -> bool:
        manager = self.connector_manager
        return manager is not None and manager.has_pending_transfers()

    def _checked_step(self) -> None:
        if self.step():
            self._idle_since = None
            return
        if not self._transfers_pending():
            raise EmulatorStall(
                f"no progress and nothing pending: {len(self._loop.active)} active requests "
                f"cannot be scheduled with {self.kv_cache_manager.get_num_free_blocks()} "
                "free blocks"
            )
        now = time.monotonic()
        since = now if self._idle_since is None else self._idle_since
        self._idle_since = since
        # NOTE: idle iterations are identical on every rank, so rank 0's clock decides for
        # all of them in one broadcast; each rank's own clock could disagree and deadlock.
        stalled = self.collectives.broadcast(now - since > self._stall_timeout_s, root=0)
        if stalled:
            raise EmulatorStall(
                f"async transfers pending for {self._stall_timeout_s} s with nothing "
                "else to run: get_finished never returned them on every rank"
            )
        time.sleep(0.001)  # NOTE: let the connector's threads run; TRT-LLM would spin


def _connector_classes(
    llm_args: TorchLlmArgs,
    scheduler_cls: type[KvCacheConnectorScheduler] | None,
    worker_cls: type[KvCacheConnectorWorker] | None,
) -> tuple[type[KvCacheConnectorWorker], type[KvCacheConnectorScheduler]] | None:
    if (scheduler_cls is None) != (worker_cls is None):
        raise ValueError("connector_scheduler_cls and connector_worker_cls go together")
    if worker_cls is not None and scheduler_cls is not None:
        return worker_cls, scheduler_cls
    config = llm_args.kv_connector_config
    if config is None:
        return None
    module = importlib.import_module(config.connector_module)
    return (
        getattr(module, config.connector_worker_class),
        getattr(module, config.connector_scheduler_class),
    )


def _instantiate(
    llm_args: TorchLlmArgs,
    worker_cls: type[KvCacheConnectorWorker],
    scheduler_cls: type[KvCacheConnectorScheduler],
    *,
    rank: int,
) -> tuple[KvCacheConnectorWorker, KvCacheConnectorScheduler | None]:
    # NOTE: concurrently, as upstream: either side may wait for the other at construction.
    with ThreadPoolExecutor(max_workers=2) as pool:
        worker_task = pool.submit(worker_cls, llm_args)
        scheduler = pool.submit(scheduler_cls, llm_args).result() if rank == 0 else None
        return worker_task.result(), scheduler


def _check_creator_envelope(llm_args: TorchLlmArgs, runtime: str) -> None:
    # NOTE: the first connector release refused CUDA graphs here; main's
    # py_executor_creator.py (@ 000429d5) and PyExecutor (the 445 kB py_executor.py) do not.
    # Kept for the 1.2-era runtime, whose acceptance is not established here.
    if llm_args.cuda_graph_config is not None and runtime == "1.2":
        raise UnsupportedConfiguration("CUDA graphs are not supported with KV connector hooks.")
    policy = llm_args.scheduler_config.capacity_scheduler_policy
    if policy != CapacitySchedulerPolicy.GUARANTEED_NO_EVICT:
        raise UnsupportedConfiguration(
            "KV connector is only supported with guaranteed no evict scheduler policy."
        )


def _check_executor_envelope(llm_args: TorchLlmArgs, runtime: str, *, connector: bool) -> None:
    checks = [
        (
            llm_args.pipeline_parallel_size > 1 or llm_args.context_parallel_size > 1,
            "pipeline or context parallelism",
        ),
        (llm_args.max_beam_width > 1, "beam search (max_beam_width > 1)"),
        (llm_args.enable_attention_dp, "attention data parallelism (enable_attention_dp)"),
        (
            bool(llm_args.kv_cache_config.host_cache_size),
            "KV cache host offloading (KvCacheConfig.host_cache_size)",
        ),
        (
            llm_args.cuda_graph_config is not None and runtime == "1.2",
            "CUDA graphs (cuda_graph_config)",
        ),
        (
            llm_args.scheduler_config.capacity_scheduler_policy
            != CapacitySchedulerPolicy.GUARANTEED_NO_EVICT,
            "a capacity scheduler policy other than GUARANTEED_NO_EVICT",
        ),
    ]
    for failed, what in checks:
        if failed and connector:
            raise UnsupportedConfiguration(f"KV Cache Connector is not supported with {what}.")
        if failed:
            raise UnsupportedConfiguration(f"the emulator does not model {what}")


__all__ = [
    "EmulatorStall",
    "GenerationResult",
    "PyExecutorEmulator",
    "UnsupportedConfiguration",
]
