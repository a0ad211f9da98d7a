"""The worker half: registration checks, loads into the KV pool, device→host saves. Every rank.

Contracts:

* :meth:`WorkerCore.start_load` enqueues copies of staged host bytes into the claimed blocks,
  ordered after the work already queued on the engine's stream, in *layer groups* (each
  block's bytes of the first layers first), and never waits for them. The forward pass waits
  on the device, not the host: :meth:`WorkerCore.wait_for_layer` (TensorRT-LLM's
  ``wait_for_layer_load``, called before each decoder layer's work is enqueued) makes the
  forward's stream wait for the group holding that layer, so layer 0 runs as soon as its
  bytes are in while later groups are still copying, and the host never stalls behind the
  copies. Until the hooks have been seen for every layer of a whole forward pass, the stream
  waits for all of a load at once instead. The sources stay pinned by the scheduler until this
  rank publishes, on the :class:`~s3kv.connector.completion.CompletionBoard`, that the
  copies' last event has *completed* (:meth:`WorkerCore.poll_loads`, run at every entry
  point).
* :meth:`WorkerCore.save_after_forward` plans device→host copies of full blocks into bounded
  host buffers, on a side stream ordered after the engine's; on a device they are queued by
  :meth:`WorkerCore.finished`, a share per call, from the call after the one that ends their
  iteration, or by the idle saver once the engine has made no call for
  :data:`IDLE_SAVE_AFTER_S` (TensorRT-LLM stops calling when no request is left). Nothing
  waits for S3.
* :meth:`WorkerCore.finished` queues the planned copies, hands completed ones to the store
  (which encodes and uploads them on its pool), and reports a request as saved once all of
  its device→host copies have completed on this rank. An engine that never calls it gets the
  hand-off in :meth:`WorkerCore.save_after_forward` instead.
"""

from __future__ import annotations

import atexit
import bisect
import logging
import math
import operator
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial, update_wrapper
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import numpy as np

from s3kv.arena import SlabArena
from s3kv.connector.completion import CompletionBoard
from s3kv.connector.device import (
    DONE,
    NEVER,
    CopyEngine,
    DeferredStream,
    SavePair,
    StreamEvent,
    SyncCopyEngine,
    copy_engine,
    on_gpu,
)
from s3kv.connector.metadata import ConnectorMetadata, LoadOp, SaveOps
from s3kv.connector.relay import RelayedManifest
from s3kv.keys import BlockHash
from s3kv.store import KVStore

logger = logging.getLogger(__name__)

#: Per block, the fewest bytes a layer group's copy carries. Smaller copies cost the copy
#: engine bandwidth and the host a call each; a group of one layer of SmolLM2 (24 KiB) would.
#: NOTE: 1 MiB: whole SmolLM2 blocks (720 KiB) and 8-layer Llama-3-8B slices (1 MiB) load as
#: one group; a whole Llama-3-8B block (4 MiB) as 4 groups of 8 layers.
LOAD_GROUP_MIN_BYTES = 1 << 20

#: Bytes of planned device→host save copies queued per ``get_finished``: this much (a block
#: at least), or a :data:`SAVE_COPY_SPREAD` share of what waits if that is more, so what
#: waits stays within a few iterations' copies whatever the load. NOTE: a copy engine serves
#: device-to-host copies in the order queued, so the next iteration's sampled tokens wait
#: behind every block queued before them: a cold 8K prompt's 254 MiB at once delayed the
#: next decode step by 3-4 ms on an H200 (8-layer Llama-3-8B slice, CUDA-graph decode steps
#: of 2.5 ms; ``gpu_ab.py``), where 64 MiB (about 1.3 ms of copying) runs beside a step.
#: The quarter share can be more than 64 MiB (a 4 MiB-block model's 8K prompt: 256 MiB),
#: but such a model's step is longer too: the full 32-layer geometry's 9 ms steps showed no
#: delay with all of a prompt's 1 GiB at once (decode overhead 0.5-0.9%).
SAVE_COPY_BYTES = 64 << 20
SAVE_COPY_SPREAD = 4

#: Seconds without an engine call after which copies still waiting are queued, and completed
#: ones handed to the store, by the worker's idle saver (a thread) instead of the next
#: ``get_finished``. NOTE: TensorRT-LLM calls ``get_finished`` once after a request's last
#: forward pass, then, with no request active or waiting, blocks on its request queue with
#: no timeout (``_fetch_and_enqueue_requests``: ``request_queue.get(timeout=None)``) and
#: never calls the connector again before the next request; its shutdown does not call it
#: either (``should_stop_processing``, ``shutdown``; ``py_executor.py`` @ 000439672005).
#: The last request's blocks would reach the bucket only with the next request, or never.
#: Their requests are still reported by the next ``get_finished`` (their blocks stay
#: allocated until then: TensorRT-LLM's to call), but their bytes are saved.
IDLE_SAVE_AFTER_S = 0.5

_slot_of_entry = operator.itemgetter(0)  # NOTE: a C-level sort key (SaveBufferPool._free)


def layer_groups(num_layers: int, layer_nbytes: int, min_bytes: int) -> list[int]:
    """Layer boundaries ``[0, ..., num_layers]`` of groups of at least ``min_bytes`` per block.

    Consecutive layers are contiguous inside a block (``[layers, kv_factor, block_elems]``),
    so a group is one copy per block. The last group may be smaller.
    """
    per = max(1, -(-min_bytes // max(1, layer_nbytes)))
    return [*range(0, num_layers, per), num_layers]


def block_geometry(
    pool_shape: Sequence[int], tokens_per_block: int, head_dim: int | None
) -> tuple[int, ...] | None:
    """``(layers, 2, heads, tokens_per_block, head_dim)`` of one block of a
    ``[blocks, layers, 2, heads * tokens_per_block * head_dim]`` pool whose blocks are laid
    out HND (the TRTLLM attention backend's: ``KVBlockArray::getKVLocalIdx``,
    ``cpp/tensorrt_llm/kernels/kvCacheUtils.h`` @``deaae40b``), or None where the sizes do
    not divide so (the codec then sees the pool's shape).
    """
    if len(pool_shape) != 4 or head_dim is None or tokens_per_block < 1 or head_dim < 1:
        return None
    _, layers, kv_factor, elems = (int(d) for d in pool_shape)
    heads, rest = divmod(elems, tokens_per_block * head_dim)
    if kv_factor != 2 or heads < 1 or rest:
        return None
    return layers, kv_factor, heads, tokens_per_block, head_dim


def _torch() -> Any:
    import torch

    return torch


@dataclass
class _LoadInFlight:
    """One load batch: an event per layer group (in order), and how many the forward awaits.

    ``awaited`` groups have had a device-side wait placed on the forward's stream; since the
    groups are copied in order on one stream, waiting for group ``g`` covers ``0..g``.
    """

    events: list[StreamEvent]
    bounds: list[int]
    awaited: int = field(default=0)

    def group_of(self, layer: int) -> int:
        return min(len(self.events) - 1, max(0, bisect.bisect_right(self.bounds, layer) - 1))


@dataclass
class _PendingCopy:
    """Device→host copies of one forward pass, waiting for their event."""

    event: StreamEvent
    ops: SaveOps
    buffers: list[Any]


@dataclass
class _Unissued:
    """Device→host copies of one forward pass (or the rest of one, after a share was queued),
    planned in ``wait_for_save``, not queued yet. Their copy pairs are worked out when they
    are queued, a share at a time."""

    ops: SaveOps
    buffers: list[Any]
    stream: Any
    fresh: bool = True  # NOTE: no get_finished since its pass: the next one skips it


class SaveBufferPool:
    """Host buffers for device→host copies, bounded in bytes (pinned under CUDA).

    ``acquire`` returns ``None`` when the bound is reached: the save is dropped and counted,
    because the forward loop must never wait on uploads. With an ``arena`` (the store's
    :meth:`~s3kv.store.KVStore.save_arena`, when codec processes encode the saves) buffers
    are its slots, which those processes read in place.
    """

    def __init__(
        self, block_nbytes: int, limit_bytes: int, *, pinned: bool, arena: SlabArena | None = None
    ) -> None:
        self.block_nbytes = block_nbytes
        self.capacity = max(1, limit_bytes // max(1, block_nbytes))
        if arena is not None:
            self.capacity = min(self.capacity, arena.slots)
        self._arena = arena
        self._pinned = pinned
        # NOTE: (arena slot, buffer), the lowest slot last where runs are coalesced: sorted
        # with a C-level key only when a release broke the order. A Python key per buffer
        # cost wait_for_save 0.2-0.3 ms a cold prompt on an H200 host (2,000 free buffers).
        self._free: list[tuple[int, Any]] = []
        self._unsorted = False
        self._allocated = 0
        self._lock = threading.Lock()
        self._arrays: dict[int, np.ndarray] = {}  # id(buffer) -> its numpy view (made once)
        # NOTE: runs of consecutive slots take one device copy each (coalesced): only where
        # a slot holds exactly one block, so that consecutive slots are consecutive bytes.
        self._runs = arena is not None and arena.slot_bytes == block_nbytes
        self._slots: dict[int, int] = {}  # id(buffer) -> its arena slot (runs only)

    def acquire(self) -> Any | None:
        """A free uint8 tensor of ``block_nbytes``, or ``None`` at the bound."""
        taken = self.acquire_many(1)
        return taken[0] if taken else None

    def acquire_many(self, count: int) -> list[Any]:
        """Up to ``count`` free buffers (fewer at the bound), under one lock."""
        with self._lock:
            if self._unsorted and count:
                # NOTE: the lowest free slots, in order: a forward pass's blocks then lie in
                # few runs of consecutive slots (see slot / span).
                self._free.sort(key=_slot_of_entry, reverse=True)
                self._unsorted = False
            reused = [buffer for _, buffer in self._free[-count:][::-1]] if count else []
            del self._free[len(self._free) - len(reused) :]
            fresh = max(0, min(count - len(reused), self.capacity - self._allocated))
            self._allocated += fresh
        return reused + [self._new() for _ in range(fresh)]

    def slot(self, buffer: Any) -> int | None:
        """The arena slot of ``buffer`` where runs of slots can be copied at once, else None."""
        return self._slots.get(id(buffer)) if self._runs else None

    def span(self, first: Any, count: int) -> Any:
        """One uint8 tensor over ``count`` consecutive slots from ``first``'s (see slot)."""
        assert self._arena is not None
        return _torch().from_numpy(self._arena.span(self._slots[id(first)], count))

    def _new(self) -> Any:
        torch = _torch()
        if self._arena is not None:
            # NOTE: shares the slot's memory (page-locked by the arena under CUDA).
            slot = self._arena.allocate(self.block_nbytes)
            buffer = torch.from_numpy(slot)
            if self._runs:
                self._slots[id(buffer)] = self._arena.slot_of(slot)
        else:
            buffer = torch.empty(self.block_nbytes, dtype=torch.uint8, pin_memory=self._pinned)
        self._arrays[id(buffer)] = buffer.numpy()
        return buffer

    def array(self, buffer: Any) -> np.ndarray:
        """The numpy view of one of this pool's buffers (the same memory)."""
        return self._arrays[id(buffer)]

    def release(self, buffer: Any) -> None:
        """Give a buffer back (called once the store has encoded it)."""
        slot = self._slots.get(id(buffer), 0) if self._runs else 0
        with self._lock:
            if self._free and slot > self._free[-1][0]:
                self._unsorted = True
            self._free.append((slot, buffer))


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _engine_call(
    method: Callable[Concatenate[WorkerCore, _P], _R],
) -> Callable[Concatenate[WorkerCore, _P], _R]:
    """An engine entry point: runs under the worker's lock (the idle saver takes it too)
    and stamps the time of the engine's last call."""

    def entry(self: WorkerCore, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            try:
                return method(self, *args, **kwargs)
            finally:
                self._last_call = time.monotonic()

    update_wrapper(entry, method)  # NOTE: its return value's type hides the signature
    return entry


class WorkerCore:
    """Loads and saves for one rank's KV pool.

    Args:
        rank: This rank.
        store: The store of this rank's shard (saves; loads too when single-process).
        kv_cache: The registered pool tensor.
        max_inflight_bytes: Bound on host buffers of pending saves.
        board: Where this rank publishes completed loads (single process: the scheduler's
            board; tensor parallel: attached from the metadata when ``None``).
        relay: A rank > 0's relayed manifest under tensor parallelism: attached to rank 0's
            write relay the first time the metadata names it, before any save.
        idle_save_after: :data:`IDLE_SAVE_AFTER_S`, or ``None``: no idle saver.
        block_shape: The shape saved blocks are recorded with (the codec's geometry): the
            pool's ``(layers, 2, heads, tokens_per_block, head_dim)`` where the connector
            knows it (:func:`block_geometry`), else ``kv_cache.shape[1:]``.
    """

    def __init__(
        self,
        rank: int,
        store: KVStore,
        kv_cache: Any,
        max_inflight_bytes: int,
        board: CompletionBoard | None = None,
        relay: RelayedManifest | None = None,
        *,
        idle_save_after: float | None = IDLE_SAVE_AFTER_S,
        block_shape: tuple[int, ...] | None = None,
    ) -> None:
        self.rank = rank
        self.relay = relay
        self.store = store
        self.kv_cache = kv_cache
        self.cuda = on_gpu(kv_cache)
        self.block_nbytes = kv_cache[0].numel() * kv_cache.element_size()
        pool_shape = tuple(int(d) for d in kv_cache.shape[1:])
        if block_shape is None or math.prod(block_shape) != math.prod(pool_shape):
            block_shape = pool_shape
        self.block_shape = block_shape
        self.dtype_name = _dtype_name(kv_cache.dtype)
        self.board = board
        self._buffers = SaveBufferPool(
            self.block_nbytes,
            max_inflight_bytes,
            pinned=self.cuda,
            arena=store.save_arena(self.block_nbytes, max_inflight_bytes),
        )
        self._arenas: dict[str, SlabArena] = {}
        self._pending: deque[_PendingCopy] = deque()
        self._unissued: list[_Unissued] = []  # NOTE: queued from the next get_finished but one
        # NOTE: whether get_finished ran since the last wait_for_save: it hands completed
        # copies to the store; an engine that never calls it gets that in wait_for_save.
        self._finished_called = True
        self._inflight: dict[int, int] = defaultdict(int)  # request id -> copies pending
        self._awaiting: set[int] = set()
        self._loads: deque[tuple[int, StreamEvent]] = deque()  # (load_seq, its event)
        self._engine: CopyEngine | None = copy_engine(kv_cache, None) if self.cuda else None
        self._stream: Any = None
        self.num_layers = int(kv_cache.shape[1]) if kv_cache.dim() >= 2 else 1
        layer_nbytes = self.block_nbytes // self.num_layers
        self._layer_bounds = layer_groups(self.num_layers, layer_nbytes, LOAD_GROUP_MIN_BYTES)
        self._byte_bounds = [b * layer_nbytes for b in self._layer_bounds]
        self._byte_bounds[-1] = self.block_nbytes
        self._pool_bytes = kv_cache.view(kv_cache.shape[0], -1).view(_torch().uint8)
        self._views: dict[int, Any] = {}  # block id -> its uint8 view (built once)
        self._unawaited: list[_LoadInFlight] = []  # loads the forward has not fully awaited
        self._hooked: set[int] = set()  # layers whose wait_for_layer_load ran this pass
        self.layer_waits = False  # the hooks ran for every layer of a whole forward pass
        self._lock = threading.RLock()  # NOTE: the save path's state: engine calls, idle saver
        self._last_call = time.monotonic()
        self._idle_save_after = idle_save_after
        self._idle_saver: threading.Thread | None = None
        self._closing = threading.Event()

    def set_load_groups(self, min_bytes: int) -> None:
        """Copy loads in layer groups of at least ``min_bytes`` per block (benchmarks, tests)."""
        layer_nbytes = self.block_nbytes // self.num_layers
        self._layer_bounds = layer_groups(self.num_layers, layer_nbytes, min_bytes)
        self._byte_bounds = [b * layer_nbytes for b in self._layer_bounds]
        self._byte_bounds[-1] = self.block_nbytes

    def _view(self, block_id: int) -> Any:
        view = self._views.get(block_id)
        if view is None:
            view = self._views[block_id] = self._pool_bytes[block_id]
        return view

    def _engine_for(self, stream: Any) -> CopyEngine:
        """The copy engine; on the CPU it follows the first stream the engine passes."""
        engine = self._engine
        if engine is None or (isinstance(engine, SyncCopyEngine) and stream is not None):
            engine = self._engine = copy_engine(self.kv_cache, stream)
        return engine

    # --- forward-pass event ---

    def forward_done(self) -> None:
        """End of every forward pass, on its stream: the point device→host copies wait for.

        Also where the layer hooks are judged: a pass that asked for every layer lets later
        loads be awaited layer group by layer group; loads a pass did not await entirely are
        awaited now (a hook that never ran) and later loads are awaited whole again. A pass
        with no load that ran no hook at all says nothing about them.

        NOTE: TensorRT-LLM replays decode-only batches from CUDA graphs by default
        (``TorchLlmArgs.cuda_graph_config``, ``llmapi/llm_args.py`` @``fcd3f316``), also with
        a connector (``py_executor_creator.py`` @``000429d5`` no longer refuses it). A
        replayed graph runs no Python hook; such a pass between two eager ones must not
        turn the per-layer waits off. A batch with loads may be replayed only where a
        request computes one prompt token (a final one-token context:
        ``_make_single_token_context_graph_batch``, ``_torch/pyexecutor/engine/runners/
        decoder/runner.py`` @``fcc4432b``); the scheduler marks those loads to be awaited
        whole (``ConnectorMetadata.whole_loads``).
        """
        self._last_call = time.monotonic()
        engine = self._engine_for(self._stream)
        if self._unawaited:
            logger.warning(
                "s3kv: wait_for_layer_load did not run for every layer; loads are awaited "
                "before the forward pass until a pass runs it for every layer again"
            )
            self._await_all(self._stream)
            self.layer_waits = False
        elif self._hooked:
            self.layer_waits = len(self._hooked) >= self.num_layers
        self._hooked.clear()
        engine.mark_forward(self._stream)

    def wait_for_layer(self, layer: int, stream: Any) -> None:
        """Before layer ``layer``'s work is enqueued on ``stream``: order it after its bytes.

        Places device-side waits only (never blocks the host), once per layer group.

        NOTE: TensorRT-LLM calls ``wait_for_layer_load`` from
        ``KvCacheConnectorManager.layer_pre_hook`` (a forward pre-hook on every decoder
        layer, ``_torch/pyexecutor/connectors/kv_cache_connector.py`` @``5a06f334``) with
        ``torch.cuda.current_stream()``, inside ``_forward_step``'s ``with
        torch.cuda.stream(self.execution_stream)`` (``py_executor.py``, the 155 kB stored
        version): ``stream`` is the one the layer's kernels are queued on.
        """
        self._last_call = time.monotonic()  # NOTE: a forward pass is being queued: not idle
        self._hooked.add(layer)
        if not self._unawaited:
            return
        engine = self._engine_for(stream)
        try:
            for load in self._unawaited:
                group = load.group_of(layer)
                if group >= load.awaited:
                    engine.wait(load.events[group], stream)
                    load.awaited = group + 1
        except Exception:
            logger.exception("s3kv: a per-layer wait failed; awaiting every load in full")
            self._await_all(stream)
            return
        self._unawaited = [x for x in self._unawaited if x.awaited < len(x.events)]

    def _await_all(self, stream: Any) -> None:
        engine = self._engine_for(stream)
        for load in self._unawaited:
            engine.wait(load.events[-1], stream)
        self._unawaited = []

    # --- loads ---

    def start_load(self, metadata: ConnectorMetadata, stream: Any) -> None:
        """Enqueue a copy of every :class:`LoadOp` source into its block on ``stream``.

        Returns without waiting for the copies. Their completion is published on the board
        (:meth:`poll_loads`), and only then may the scheduler recycle the sources.
        """
        self._last_call = time.monotonic()  # NOTE: an engine call: the idle saver waits
        self._stream = stream
        engine = self._engine_for(stream)
        self.poll_loads()
        if not metadata.loads:
            return
        self._attach_board(metadata)
        arena = self._arena(metadata) if metadata.arenas else None
        event: StreamEvent = NEVER  # NOTE: until the copies are known to be enqueued or done
        try:
            targets = [self._view(op.block_id) for op in metadata.loads]
            sources = self._load_sources(metadata.loads, arena)
            events = engine.load(targets, sources, self._byte_bounds, stream)
            event = events[-1]
            load = _LoadInFlight(events, self._layer_bounds)
            if self.layer_waits and not metadata.whole_loads:
                self._unawaited.append(load)  # NOTE: awaited layer group by layer group
            else:
                engine.wait(event, stream)
        except Exception:
            # NOTE: a claim cannot be withdrawn: wait for whatever was enqueued, then copy
            # every block the plain way. If even that fails, the batch's event never
            # completes, so its sources stay pinned rather than be recycled under a copy.
            logger.exception("s3kv: enqueuing loads failed; copying them synchronously")
            self._load_synchronously(metadata, arena, stream)
            event = DONE
        finally:
            self._loads.append((metadata.load_seq, event))
        self.store.metrics.inc("connector_loaded_blocks", len(metadata.loads))
        self.poll_loads()

    def _load_synchronously(
        self, metadata: ConnectorMetadata, arena: SlabArena | None, stream: Any
    ) -> None:
        """The fallback load: after everything enqueued on the stream, complete on return."""
        if self.cuda:
            _torch().cuda.synchronize(self.kv_cache.device)
        elif isinstance(stream, DeferredStream):
            stream.record_event().synchronize()
        targets = [self._view(op.block_id) for op in metadata.loads]
        sources = self._load_sources(metadata.loads, arena)
        SyncCopyEngine().load(targets, sources, [0, self.block_nbytes], None)

    def poll_loads(self) -> None:
        """Publish, oldest first, every load batch whose copies have completed."""
        board = self.board
        while self._loads and self._loads[0][1].query():
            seq, _ = self._loads.popleft()
            if board is not None and seq:
                board.publish(self.rank, seq)

    @property
    def loads_in_flight(self) -> int:
        """Load batches enqueued whose completion has not been published yet."""
        return len(self._loads)

    def _attach_board(self, metadata: ConnectorMetadata) -> None:
        if self.board is None and metadata.board:
            self.board = CompletionBoard.attach(metadata.board)

    def _load_sources(self, ops: Sequence[LoadOp], arena: SlabArena | None) -> list[np.ndarray]:
        """The host bytes each load copies: its arena slot (tensor parallel) or staged block."""
        if arena is not None:
            return [arena.view(op.slots[self.rank]) for op in ops]
        staged = self.store.staged_many([BlockHash(op.key) for op in ops])
        sources = []
        for op, buffer in zip(ops, staged, strict=True):
            if buffer is not None and buffer.nbytes == self.block_nbytes:
                sources.append(buffer)
                continue
            # NOTE: unreachable by construction (the scheduler pinned it, the codec checked
            # its size); a claim cannot be withdrawn, so this is logged loudly.
            logger.error("s3kv: claimed block %s is not staged; output may be wrong", op.key.hex())
            sources.append(np.zeros(self.block_nbytes, dtype=np.uint8))
        return sources

    def _arena(self, metadata: ConnectorMetadata) -> SlabArena:
        path, slot_bytes = metadata.arenas[self.rank]
        arena = self._arenas.get(path)
        if arena is None:
            arena = SlabArena.attach(path, slot_bytes)
            self._arenas[path] = arena
        return arena

    # --- saves ---

    @_engine_call
    def save_after_forward(self, metadata: ConnectorMetadata, stream: Any = None) -> None:
        """Plan device→host copies of this iteration's full blocks; never waits on them.

        On a CUDA device (:attr:`~s3kv.connector.device.CopyEngine.defers_saves`; the
        emulator's late device too) the copies are queued by :meth:`finished`
        (``get_finished``), a share per call (:data:`SAVE_COPY_BYTES`), starting with the
        call after the one that ends this iteration, not here: TensorRT-LLM's sampler
        queues the new tokens' copy to the host after ``wait_for_save`` (``_forward_step``,
        then ``_sample_async``: ``py_executor.py`` @ 000439672005; ``TorchSampler.sample_async``
        in ``sampler.py`` @ 28edbcdb), and a device-to-host copy queued before it delays it by the
        whole of them: a token read waited 4.1 ms behind a prompt's 254 1-MiB block copies
        on an H100 (``benchmarks/gpu_copy_order.py``). And not in this iteration's
        ``get_finished`` either: under the overlap loop it runs before the engine waits for
        this pass's tokens (the next iteration's ``_update_requests``;
        ``_executor_loop_overlap``, ``py_executor.py`` @ 000439672005), so the host time of
        queueing a share (0.3-0.9 ms for a cold SmolLM2 8K prompt's first on an H200 host,
        ``gpu_ab.py``) would come before the token wherever the host, not the device, bounds
        the pass. One iteration later the token has been read. Until queued and completed,
        the blocks' requests count as saving, so their blocks stay allocated.

        On such a device completed copies reach the store in :meth:`finished`, not here,
        unless no :meth:`finished` ran since the last call (or the buffers ran short):
        TensorRT-LLM commits and answers the previous batch's tokens after ``_forward_step``
        and calls ``get_finished`` last (``_kv_connector_terminate_requests``,
        ``py_executor.py`` @ 000439672005), and handing a prompt's 254 blocks over took the
        engine's thread 3.5 ms on an H200 host: in ``wait_for_save`` it delayed the first
        token of a cold prompt by as much (``benchmarks/gpu_iteration_timeline.py``).
        """
        if self.relay is not None and metadata.relay:
            self.relay.attach(metadata.relay)  # idempotent; before any save reaches the store
        if self._unawaited:  # NOTE: no forward-pass callable ran: never leave a load unawaited
            self._await_all(stream)
        if not self._finished_called:
            self._ripen()  # NOTE: an engine that skipped get_finished: queue them now, in order
            self._issue()
        self.poll_loads()
        if not self._finished_called:
            self._drain(block=False)
        self._finished_called = False
        if not metadata.saves:
            return
        buffers = self._buffers.acquire_many(len(metadata.saves))
        if len(buffers) < len(metadata.saves) and (self._pending or self._unissued):
            # NOTE: short of buffers: copies waiting for their share are queued now and
            # completed ones go to the store, so that their buffers come back as soon as
            # they are encoded (the saves of this pass that found none are dropped).
            self._issue(everything=True)
            self._drain(block=False)
        try:  # NOTE: a part of the saves hashes the keys that travelled unhashed (KeyRun)
            ops = metadata.saves[: len(buffers)]
        except Exception:
            logger.exception("s3kv: hashing the keys of a pass's saves failed")
            self.store.metrics.inc("connector_save_errors", len(metadata.saves))
            for buffer in buffers:
                self._buffers.release(buffer)
            return
        if len(ops) < len(metadata.saves):
            self.store.metrics.inc("connector_save_buffers_full", len(metadata.saves) - len(ops))
        if not ops:
            return
        for request_id, count in Counter(ops.request_ids).items():
            self._inflight[request_id] += count
        self._unissued.append(_Unissued(ops, buffers, stream))
        engine = self._engine_for(stream)
        if not engine.defers_saves:
            self._issue(everything=True)  # NOTE: copies that run now: nothing to get ahead of
            self._drain(block=False)
        elif getattr(engine, "queues_from_any_thread", False):
            self._start_idle_saver()

    # --- the idle saver ---

    def _start_idle_saver(self) -> None:
        if self._idle_saver is not None or self._idle_save_after is None:
            return
        self._idle_saver = threading.Thread(
            target=self._idle_saves, name=f"s3kv-idle-saver-{self.rank}", daemon=True
        )
        self._idle_saver.start()
        atexit.register(self.close)  # NOTE: not inside torch or the store at interpreter exit

    def _idle_saves(self) -> None:
        """While the engine makes no call for :data:`IDLE_SAVE_AFTER_S`: queue what waits and
        hand completed copies to the store (:meth:`save_while_idle`)."""
        after = self._idle_save_after
        assert after is not None
        if self.cuda:  # NOTE: this rank's device, not device 0, for the thread's CUDA calls
            _torch().cuda.set_device(self.kv_cache.device)
        poll = min(max(after / 4, 0.001), 0.05)
        while not self._closing.wait(poll):
            if not (self._unissued or self._pending):
                continue
            if time.monotonic() - self._last_call < after:
                continue
            if not self._lock.acquire(blocking=False):
                continue  # NOTE: the engine is in a call: not idle
            try:
                if time.monotonic() - self._last_call >= after:
                    self.save_while_idle()
            except Exception:
                logger.exception("s3kv: saving while the engine is idle failed")
            finally:
                self._lock.release()

    def save_while_idle(self) -> None:
        """Queue every planned copy and hand completed ones to the store; their requests are
        reported by the next :meth:`finished`. Never waits for the device."""
        with self._lock:
            waiting = sum(len(batch.ops) for batch in self._unissued)
            self._ripen()
            self._issue(everything=True)
            self._drain(block=False)
            if waiting:
                self.store.metrics.inc("connector_saves_queued_idle", waiting)

    def close(self) -> None:
        """Stop the idle saver (copies still waiting stay for :meth:`flush`). Idempotent."""
        self._closing.set()
        # NOTE: the exit hook holds this core (and its pool): a closed core lets both go
        atexit.unregister(self.close)
        saver = self._idle_saver
        if saver is not None and saver is not threading.current_thread():
            saver.join(timeout=5.0)

    def _issue(self, *, everything: bool = False) -> None:
        """Queue the planned copies, oldest first. A copy that cannot be planned or queued
        loses its blocks' saves (counted, logged) and never holds its requests back.

        Unless ``everything``, copies planned since the last :meth:`finished` are left for
        the next call, and of the others at most :data:`SAVE_COPY_BYTES` (or a
        :data:`SAVE_COPY_SPREAD` share of them) are queued; the rest wait for the next call,
        their requests still saving.
        """
        ready = [batch for batch in self._unissued if everything or not batch.fresh]
        budget = sum(len(batch.ops) for batch in ready)
        if not everything:
            share = max(1, SAVE_COPY_BYTES // self.block_nbytes, -(-budget // SAVE_COPY_SPREAD))
            budget = min(budget, share)
        while self._unissued and budget > 0 and (everything or not self._unissued[0].fresh):
            batch = self._unissued.pop(0)
            if len(batch.ops) > budget:  # NOTE: the rest goes back to the head of the queue
                try:  # NOTE: slicing hashes the keys that travelled unhashed (KeyRun)
                    rest_ops, ops = batch.ops[budget:], batch.ops[:budget]
                except Exception:
                    logger.exception("s3kv: hashing the keys of a pass's saves failed")
                    self._drop(batch, queued=False)
                    continue
                rest = _Unissued(rest_ops, batch.buffers[budget:], batch.stream, fresh=False)
                self._unissued.insert(0, rest)
                batch = _Unissued(ops, batch.buffers[:budget], batch.stream)
            budget -= len(batch.ops)
            self._queue(batch)

    def _ripen(self) -> None:
        """Every planned copy may be queued by the next :meth:`_issue`."""
        for batch in self._unissued:
            batch.fresh = False

    def _queue(self, batch: _Unissued) -> None:
        """Queue one share's copies; if they cannot be planned or queued, drop its saves."""
        try:
            pairs = self._copy_pairs(batch.ops, batch.buffers)
        except Exception:
            self._drop(batch, queued=False)
            return
        try:
            event = self._engine_for(batch.stream).save(pairs, batch.stream)
        except Exception:
            self._drop(batch, queued=True)
            return
        self._pending.append(_PendingCopy(event, batch.ops, batch.buffers))

    def _drop(self, batch: _Unissued, *, queued: bool) -> None:
        """Give up a share that failed (counted, logged): its requests may finish. Its
        buffers go back to the pool unless part of its copies may have been ``queued``
        (then a copy may still write them, and they stay out, counted)."""
        logger.exception("s3kv: dropping the saves of %d block(s)", len(batch.ops))
        self.store.metrics.inc("connector_save_errors", len(batch.ops))
        self._settle(batch.ops)
        if queued:
            self.store.metrics.inc("connector_save_buffers_withheld", len(batch.buffers))
            return
        for buffer in batch.buffers:
            self._buffers.release(buffer)

    def _settle(self, ops: SaveOps) -> None:
        """These blocks' copies are over (done or lost): their requests may finish."""
        for request_id, count in Counter(ops.request_ids).items():
            self._inflight[request_id] -= count
            if not self._inflight[request_id]:
                del self._inflight[request_id]

    def _copy_pairs(self, ops: SaveOps, buffers: Sequence[Any]) -> list[SavePair]:
        """(host target, device source) per copy: a run of consecutive blocks going to
        consecutive slots is one copy. NOTE: on an H100, 254 1-MiB device-to-host copies took
        6.1-9.7 ms where one copy of the same bytes took 4.9-5.0 ms, and every copy costs the
        host an enqueue (``benchmarks/gpu_copy_order.py``)."""
        slot = self._buffers.slot
        block_ids = ops.block_ids
        pairs: list[SavePair] = []
        start = 0
        while start < len(block_ids):
            first = slot(buffers[start])
            end = start + 1
            if first is not None:
                while (
                    end < len(block_ids)
                    and block_ids[end] == block_ids[start] + (end - start)
                    and slot(buffers[end]) == first + (end - start)
                ):
                    end += 1
            if end - start == 1:
                pairs.append((buffers[start], self._view(block_ids[start])))
            else:
                block = block_ids[start]
                source = self._pool_bytes[block : block + end - start].reshape(-1)
                pairs.append((self._buffers.span(buffers[start], end - start), source))
            start = end
        return pairs

    def _drain(self, *, block: bool) -> None:
        """Hand completed copies to the store (oldest first); a failed save is only counted,
        and a copy whose event cannot be asked is abandoned (:meth:`_abandon`)."""
        while self._pending:
            pending = self._pending[0]
            try:
                done = pending.event.query()
                if not done and block:
                    pending.event.synchronize()
                    done = True
            except Exception:
                logger.exception("s3kv: a save copy's event failed")
                self._abandon(self._pending.popleft())
                continue
            if not done:
                return
            self._pending.popleft()
            self._settle(pending.ops)
            self._hand_to_store(pending.ops, pending.buffers)

    def _abandon(self, pending: _PendingCopy, *, done: bool = False) -> None:
        """Give up a queued copy's saves (counted): its requests may finish.

        Its blocks never reach the store, so a block the engine frees and reuses is never
        saved under its old key. Its buffers go back to the pool only if the copy is known to
        have ended (``done``); otherwise a copy may still write them, and they stay out
        (counted).
        """
        self.store.metrics.inc("connector_save_errors", len(pending.ops))
        self._settle(pending.ops)
        if done:
            for buffer in pending.buffers:
                self._buffers.release(buffer)
        else:
            self.store.metrics.inc("connector_save_buffers_withheld", len(pending.buffers))

    def _hand_to_store(self, ops: SaveOps, buffers: Sequence[Any]) -> None:
        """One forward pass's copied blocks to the store, in one call."""
        release, array = self._buffers.release, self._buffers.array
        try:  # NOTE: hashes the keys that travelled unhashed (KeyRun), if no split did
            # NOTE: BlockHash is a NewType: the lists are already what the store takes.
            keys = cast(list[BlockHash], ops.key_list())
            parents = cast(list[BlockHash], ops.parent_list())
        except Exception:  # NOTE: no buffer reached the store: all go back to the pool
            logger.exception("s3kv: hashing the keys of %d saved block(s) failed", len(ops))
            self.store.metrics.inc("connector_save_errors", len(ops))
            for buffer in buffers:
                release(buffer)
            return
        try:
            blocks = [
                (key, parent, array(buffer), partial(release, buffer))
                for key, parent, buffer in zip(keys, parents, buffers, strict=True)
            ]
            # NOTE: the scheduler planned these from one bulk filter pass (checked).
            self.store.save_many(
                blocks, dtype=self.dtype_name, shape=self.block_shape, checked=True
            )
        except Exception:  # NOTE: a lost save costs a future miss, never the request
            # NOTE: buffers the store did not hand back stay out of the pool: one it did
            # accept may still be read by an encoder, and reusing it would save other bytes
            # under this key.
            logger.exception("s3kv: dropping the saves of %d block(s)", len(ops))
            self.store.metrics.inc("connector_save_errors", len(ops))
            return
        self.store.metrics.inc("connector_copied_blocks", len(ops))

    @_engine_call
    def finished(self, finished_gen_req_ids: Sequence[int]) -> list[int]:
        """Requests (passed in now or earlier) whose device→host copies are all done here.

        Idempotent and loss-free: an id is recorded before anything can fail, and leaves the
        awaiting set only in the call that returns it, so it is returned exactly once.
        """
        self._awaiting.update(int(i) for i in finished_gen_req_ids)
        self._finished_called = True
        try:
            try:
                self._issue()
            finally:
                self._ripen()  # NOTE: this pass's copies are queued from the next call on
            self.poll_loads()
        except Exception:  # NOTE: the ids stay awaited; a later call returns them
            logger.exception("s3kv: polling device copies failed")
        try:
            self._drain(block=False)
        except Exception:
            # NOTE: were they held until a drain succeeds, a drain that keeps failing would
            # hold their requests, hence their blocks, for good.
            logger.exception("s3kv: polling device copies failed; abandoning their saves")
            self._abandon_all()
        done = sorted(rid for rid in self._awaiting if rid not in self._inflight)
        self._awaiting.difference_update(done)
        return done

    def _abandon_all(self) -> None:
        """:meth:`_abandon` every queued copy, its buffers back where its event says done."""
        while self._pending:
            pending = self._pending.popleft()
            try:
                done = bool(pending.event.query())
            except Exception:
                done = False
            self._abandon(pending, done=done)

    @_engine_call
    def flush(self) -> None:
        """Wait for every pending copy and hand it to the store (shutdown)."""
        self._issue(everything=True)
        for _, event in list(self._loads):
            event.synchronize()
        self.poll_loads()
        self._drain(block=True)


def _dtype_name(dtype: Any) -> str:
    from s3kv.connector.identity import kv_dtype_name

    return kv_dtype_name(dtype) or "uint8"


__all__ = [
    "block_geometry",
    "SaveBufferPool",
    "WorkerCore",
]
