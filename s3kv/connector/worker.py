"""The worker half: registration checks, loads into the KV pool, device→host saves. Every rank.

Contracts:

* :meth:`WorkerCore.register` checks the pool tensor is the single
  ``[blocks, layers, kv_factor, block_elems]`` pool s3kv can serve and turns the connector
  off (one log line) otherwise — it never raises into the engine.
* :meth:`WorkerCore.start_load` copies staged host bytes into the claimed blocks on the
  engine's stream, before the forward pass is enqueued (the execution stream waits on it).
* :meth:`WorkerCore.save_after_forward` copies full blocks to bounded host buffers on a side
  stream that waits for the forward-pass event, then hands them to the store, which encodes
  and uploads them on its pool. Nothing waits for S3.
* :meth:`WorkerCore.finished` reports a request as saved once all of its device→host copies
  have completed on this rank.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from s3kv.connector.arena import SlabArena
from s3kv.connector.metadata import ConnectorMetadata, LoadOp, SaveOp
from s3kv.keys import BlockHash
from s3kv.store import KVStore

logger = logging.getLogger(__name__)


def _torch() -> Any:
    import torch

    return torch


@dataclass
class _PendingCopy:
    """Device→host copies of one forward pass, waiting for their event."""

    event: Any  # a torch.cuda.Event, or None when the copies were synchronous
    ops: list[SaveOp]
    buffers: list[Any]


class SaveBufferPool:
    """Host buffers for device→host copies, bounded in bytes (pinned under CUDA).

    ``acquire`` returns ``None`` when the bound is reached: the save is dropped and counted,
    because the forward loop must never wait on uploads.
    """

    def __init__(self, block_nbytes: int, limit_bytes: int, *, pinned: bool) -> None:
        self.block_nbytes = block_nbytes
        self.capacity = max(1, limit_bytes // max(1, block_nbytes))
        self._pinned = pinned
        self._free: list[Any] = []
        self._allocated = 0
        self._lock = threading.Lock()

    def acquire(self) -> Any | None:
        """A free uint8 tensor of ``block_nbytes``, or ``None`` at the bound."""
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._allocated >= self.capacity:
                return None
            self._allocated += 1
        torch = _torch()
        return torch.empty(self.block_nbytes, dtype=torch.uint8, pin_memory=self._pinned)

    def release(self, buffer: Any) -> None:
        """Give a buffer back (called once the store has encoded it)."""
        with self._lock:
            self._free.append(buffer)


class WorkerCore:
    """Loads and saves for one rank's KV pool.

    Args:
        rank: This rank.
        store: The store of this rank's shard (saves; loads too when single-process).
        kv_cache: The registered pool tensor.
        max_inflight_bytes: Bound on host buffers of pending saves.
    """

    def __init__(self, rank: int, store: KVStore, kv_cache: Any, max_inflight_bytes: int) -> None:
        torch = _torch()
        self.rank = rank
        self.store = store
        self.kv_cache = kv_cache
        self.cuda = bool(kv_cache.is_cuda)
        self.block_shape = tuple(kv_cache.shape[1:])
        self.block_nbytes = kv_cache[0].numel() * kv_cache.element_size()
        self.dtype_name = _dtype_name(kv_cache.dtype)
        self._buffers = SaveBufferPool(self.block_nbytes, max_inflight_bytes, pinned=self.cuda)
        self._arenas: dict[str, SlabArena] = {}
        self._pending: deque[_PendingCopy] = deque()
        self._inflight: dict[int, int] = defaultdict(int)  # request id -> copies pending
        self._awaiting: set[int] = set()
        self._forward_event: Any = None
        self._side_stream = torch.cuda.Stream(device=kv_cache.device) if self.cuda else None

    # --- forward-pass event ---

    def forward_done(self) -> None:
        """Called at the end of every forward pass, on its stream: mark the point saves wait for."""
        if self.cuda:
            event = _torch().cuda.Event()
            event.record()
            self._forward_event = event

    # --- loads ---

    def start_load(self, metadata: ConnectorMetadata, stream: Any) -> None:
        """Copy every :class:`LoadOp` source into its block on ``stream``."""
        if not metadata.loads:
            return
        torch = _torch()
        arena = self._arena(metadata) if metadata.arenas else None
        use_stream = self.cuda and stream is not None
        with torch.cuda.stream(stream) if use_stream else contextlib.nullcontext():
            for op in metadata.loads:
                source = self._load_source(op, arena)
                target = self.kv_cache[op.block_id].view(-1).view(torch.uint8)
                target.copy_(torch.from_numpy(source), non_blocking=self.cuda)
        self.store.metrics.inc("connector_loaded_blocks", len(metadata.loads))

    def _load_source(self, op: LoadOp, arena: SlabArena | None) -> np.ndarray:
        if arena is not None:
            return arena.view(op.slots[self.rank])
        staged = self.store.staged(BlockHash(op.key))
        if staged is None or staged.nbytes != self.block_nbytes:
            # NOTE: unreachable by construction (the scheduler pinned it, the codec checked
            # its size); a claim cannot be withdrawn, so this is logged loudly.
            logger.error("s3kv: claimed block %s is not staged; output may be wrong", op.key.hex())
            return np.zeros(self.block_nbytes, dtype=np.uint8)
        return staged

    def _arena(self, metadata: ConnectorMetadata) -> SlabArena:
        path, slot_bytes = metadata.arenas[self.rank]
        arena = self._arenas.get(path)
        if arena is None:
            arena = SlabArena.attach(path, slot_bytes)
            self._arenas[path] = arena
        return arena

    # --- saves ---

    def save_after_forward(self, metadata: ConnectorMetadata) -> None:
        """Start device→host copies of this iteration's full blocks; never waits on them."""
        self._drain(block=False)
        if not metadata.saves:
            return
        torch = _torch()
        ops: list[SaveOp] = []
        buffers: list[Any] = []
        for op in metadata.saves:
            buffer = self._buffers.acquire()
            if buffer is None:
                self.store.metrics.inc("connector_save_buffers_full")
                continue
            ops.append(op)
            buffers.append(buffer)
        if not ops:
            return
        event = None
        if self.cuda:
            assert self._side_stream is not None
            with torch.cuda.stream(self._side_stream):
                if self._forward_event is not None:
                    self._side_stream.wait_event(self._forward_event)
                for op, buffer in zip(ops, buffers, strict=True):
                    buffer.copy_(self.kv_cache[op.block_id].view(-1).view(torch.uint8), True)
                event = torch.cuda.Event()
                event.record()
        else:
            for op, buffer in zip(ops, buffers, strict=True):
                buffer.copy_(self.kv_cache[op.block_id].view(-1).view(torch.uint8))
        for op in ops:
            self._inflight[op.request_id] += 1
        self._pending.append(_PendingCopy(event, ops, buffers))
        self._drain(block=False)

    def _drain(self, *, block: bool) -> None:
        """Hand completed copies to the store (oldest first)."""
        while self._pending:
            pending = self._pending[0]
            if pending.event is not None and not pending.event.query():
                if not block:
                    return
                pending.event.synchronize()
            self._pending.popleft()
            for op, buffer in zip(pending.ops, pending.buffers, strict=True):
                self._inflight[op.request_id] -= 1
                if not self._inflight[op.request_id]:
                    del self._inflight[op.request_id]
                host = buffer.numpy()
                self.store.save(
                    BlockHash(op.key), BlockHash(op.parent), host,
                    dtype=self.dtype_name, shape=self.block_shape,
                    on_consumed=functools.partial(self._buffers.release, buffer),
                )  # fmt: skip
                self.store.metrics.inc("connector_copied_blocks")

    def finished(self, finished_gen_req_ids: Sequence[int]) -> list[int]:
        """Requests (passed in now or earlier) whose device→host copies are all done here."""
        self._awaiting.update(int(i) for i in finished_gen_req_ids)
        self._drain(block=False)
        done = [rid for rid in self._awaiting if rid not in self._inflight]
        self._awaiting.difference_update(done)
        return sorted(done)

    def flush(self) -> None:
        """Wait for every pending copy and hand it to the store (shutdown)."""
        self._drain(block=True)


def _dtype_name(dtype: Any) -> str:
    from s3kv.connector.identity import kv_dtype_name

    return kv_dtype_name(dtype) or "uint8"
