"""Host staging: a bounded LRU cache of decoded, verified blocks, with pins.

A block is *staged* when its raw bytes are in host memory and verified; only staged blocks
may be claimed (DESIGN.md invariant 1). Entries are pinned while a load needs them, so
eviction can never pull bytes out from under a claim.

Memory: at most ``budget_bytes`` of host memory, counting live entries, buffers being filled
(reserved by :meth:`StagingCache.allocate`) and recycled free buffers. With CUDA present the
buffers are page-locked (pinned) host memory, which makes host→GPU copies ~3× faster and
asynchronous; allocating pinned memory is slow, so freed buffers are kept for reuse (blocks of
one model all have the same size).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from s3kv.keys import BlockHash
from s3kv.metrics import Metrics

logger = logging.getLogger(__name__)

HostBuffer = npt.NDArray[np.uint8]


class HostAllocator(Protocol):
    """Allocates flat uint8 host buffers."""

    #: True when buffers are page-locked (CUDA pinned) memory.
    pinned: bool

    def allocate(self, nbytes: int) -> HostBuffer:
        """A new writable buffer of exactly ``nbytes`` bytes."""
        ...

    def free(self, buffer: HostBuffer) -> None:
        """Take back a buffer the cache no longer references."""
        ...


class NumpyAllocator:
    """Plain pageable host memory."""

    pinned = False

    def allocate(self, nbytes: int) -> HostBuffer:
        return np.empty(nbytes, dtype=np.uint8)

    def free(self, buffer: HostBuffer) -> None:
        """Nothing to do: the garbage collector frees it."""


class TorchPinnedAllocator:
    """CUDA pinned host memory through torch; the numpy view keeps the tensor alive."""

    pinned = True

    def allocate(self, nbytes: int) -> HostBuffer:
        import torch

        tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        # NOTE: Tensor.numpy() shares memory and its array keeps the tensor alive.
        array: HostBuffer = tensor.numpy()
        return array

    def free(self, buffer: HostBuffer) -> None:
        """Nothing to do: dropping the last view frees the pinned tensor."""


def default_allocator() -> HostAllocator:
    """Pinned memory when torch with CUDA is already imported and usable, else numpy."""
    import sys

    torch: Any = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return TorchPinnedAllocator()
    return NumpyAllocator()


class _Fresh(enum.Enum):
    """Room was made for a buffer the allocator must still make."""

    FRESH = enum.auto()


_FRESH = _Fresh.FRESH


@dataclass
class _Entry:
    buffer: HostBuffer
    pins: int = 0


class StagingCache:
    """Bounded LRU of staged blocks keyed by :data:`~s3kv.keys.BlockHash`. Thread-safe.

    Args:
        budget_bytes: Upper bound on host memory held (entries + reservations + free pool).
        allocator: Where buffers come from (default: :func:`default_allocator`).
        metrics: Registry for evictions and the occupancy gauges.
    """

    def __init__(
        self,
        budget_bytes: int,
        *,
        allocator: HostAllocator | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.budget_bytes = budget_bytes
        self._allocator = allocator or default_allocator()
        self._metrics = metrics or Metrics()
        self._entries: OrderedDict[BlockHash, _Entry] = OrderedDict()
        self._free: dict[int, list[HostBuffer]] = {}
        self._used = 0  # bytes of entries + reservations + free pool
        self._lock = threading.Lock()

    @property
    def allocator(self) -> HostAllocator:
        """Where this cache's buffers come from."""
        return self._allocator

    @property
    def pinned_memory(self) -> bool:
        """Whether buffers are CUDA pinned host memory."""
        return self._allocator.pinned

    # --- queries (no network, O(blocks)) ---

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def used_bytes(self) -> int:
        """Bytes held: entries, reservations and recycled buffers."""
        with self._lock:
            return self._used

    def count_leading(self, keys: Sequence[BlockHash]) -> int:
        """Length of the leading run of ``keys`` that are staged."""
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._entries:
                    return i
            return len(keys)

    def pin_leading(self, keys: Sequence[BlockHash]) -> int:
        """Pin the leading run of staged ``keys`` atomically; returns how many were pinned.

        Pinned entries are never evicted until :meth:`unpin`. Pinning and counting happen
        under one lock, so every counted block is guaranteed to stay readable.
        """
        with self._lock:
            # NOTE: found first, pinned after: ``keys`` may be hashed lazily and raise midway
            # (a malformed token), which must leave no pin behind.
            found: list[tuple[BlockHash, _Entry]] = []
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    break
                found.append((key, entry))
            for key, entry in found:
                entry.pins += 1
                self._entries.move_to_end(key)
            return len(found)

    def unpin(self, keys: Sequence[BlockHash]) -> None:
        """Release one pin on each of ``keys`` (unknown keys are ignored)."""
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and entry.pins > 0:
                    entry.pins -= 1

    def get(self, key: BlockHash) -> HostBuffer | None:
        """The staged bytes of ``key`` (marks it recently used), or ``None``.

        The caller must hold a pin while it reads the buffer.
        """
        return self.get_many((key,))[0]

    def get_many(self, keys: Sequence[BlockHash]) -> list[HostBuffer | None]:
        """:meth:`get` for each of ``keys``, under one lock acquisition (a claim's loads
        look up hundreds of blocks on the engine's thread)."""
        out: list[HostBuffer | None] = []
        with self._lock:
            entries, touch = self._entries, self._entries.move_to_end
            for key in keys:
                entry = entries.get(key)
                if entry is None:
                    out.append(None)
                else:
                    touch(key)
                    out.append(entry.buffer)
        return out

    # --- filling ---

    def allocate(self, nbytes: int) -> HostBuffer | None:
        """Reserve a buffer of ``nbytes`` for a block being fetched; ``None`` if no room.

        Makes room by dropping recycled buffers, then evicting least-recently-used unpinned
        entries. The buffer must end in :meth:`insert` or :meth:`release`.
        """
        buffers = self.allocate_many(nbytes, 1)
        return buffers[0] if buffers else None

    def allocate_many(self, nbytes: int, count: int) -> list[HostBuffer]:
        """:meth:`allocate` of ``count`` buffers under one lock: as many as there is room
        for (possibly none). Each must end in :meth:`insert` or :meth:`release`."""
        reused: list[HostBuffer] = []
        fresh = 0
        with self._lock:
            for _ in range(count):
                got = self._reserve(nbytes)
                if got is None:
                    break
                if got is _FRESH:
                    fresh += 1
                else:
                    reused.append(got)
            self._update_gauges()
        for made in range(fresh):
            try:
                reused.append(self._allocator.allocate(nbytes))
            except (RuntimeError, MemoryError) as exc:
                logger.warning("s3kv: host allocation of %d bytes failed: %s", nbytes, exc)
                with self._lock:
                    self._used -= (fresh - made) * nbytes
                    self._update_gauges()
                break
        return reused

    def insert(self, key: BlockHash, buffer: HostBuffer) -> None:
        """Publish a filled, verified buffer as the staged bytes of ``key``."""
        self.insert_many([(key, buffer)])

    def insert_many(self, filled: Sequence[tuple[BlockHash, HostBuffer]]) -> None:
        """:meth:`insert` of each ``(key, buffer)`` under one lock."""
        with self._lock:
            for key, buffer in filled:
                if key in self._entries:
                    self._recycle(buffer)
                else:
                    self._entries[key] = _Entry(buffer)
            self._update_gauges()

    def release(self, buffer: HostBuffer) -> None:
        """Give back a reserved buffer that will not be inserted (failed fetch or decode)."""
        self.release_many([buffer])

    def release_many(self, buffers: Sequence[HostBuffer]) -> None:
        """:meth:`release` of each of ``buffers`` under one lock."""
        with self._lock:
            for buffer in buffers:
                self._recycle(buffer)

    def remove(self, key: BlockHash) -> bool:
        """Drop ``key`` unless pinned; returns whether it was removed."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.pins:
                return False
            del self._entries[key]
            self._recycle(entry.buffer)
            self._update_gauges()
            return True

    def drop_unpinned(self) -> int:
        """Drop every unpinned entry and the recycled buffers, handing their memory back to
        the allocator; returns how many entries stay (pinned: a load may still read them).

        For a closing store, so that its arena is unmapped at close. NOTE: left to the
        garbage collector (the store's reference cycles), the 768 MiB staging arena of a
        closed store went in a collection that took 370-394 ms under the GIL in a later
        store's run, whose staging then fell 3-5x (16 vCPUs, ``results/*-close.jsonl``).
        """
        with self._lock:
            dropped = [k for k, e in self._entries.items() if not e.pins]
            for key in dropped:
                buffer = self._entries.pop(key).buffer
                self._used -= buffer.nbytes
                self._allocator.free(buffer)
            while self._drop_one_free_buffer():
                pass
            self._update_gauges()
            return len(self._entries)

    # --- internals (lock held) ---

    def _reserve(self, nbytes: int) -> HostBuffer | _Fresh | None:
        """Room for one buffer of ``nbytes``: a recycled or evicted buffer to reuse,
        :data:`_FRESH` (counted in ``_used``; the caller allocates it), or ``None``."""
        pool = self._free.get(nbytes)
        if pool:
            return pool.pop()
        if nbytes > self.budget_bytes:
            return None
        while self._used + nbytes > self.budget_bytes:
            if self._drop_one_free_buffer():
                continue
            victim = self._evict_one()
            if victim is None:
                return None
            if victim.nbytes == nbytes:
                # NOTE: the evicted buffer is reused as is: freeing it and allocating a
                # fresh one costs page faults (pinned: a cudaHostAlloc) per block, and
                # concurrent page faults serialize the I/O threads on the mmap lock.
                return victim
            self._used -= victim.nbytes
            self._allocator.free(victim)
        self._used += nbytes
        return _FRESH

    def _evict_one(self) -> HostBuffer | None:
        """Drop the least recently used unpinned entry; its buffer (still counted in
        ``_used``), or None when every entry is pinned."""
        victim = next((k for k, e in self._entries.items() if e.pins == 0), None)
        if victim is None:
            return None
        self._metrics.inc("staging_evictions")
        return self._entries.pop(victim).buffer

    def _drop_one_free_buffer(self) -> bool:
        for size, pool in self._free.items():
            if pool:
                self._allocator.free(pool.pop())
                self._used -= size
                return True
        return False

    def _recycle(self, buffer: HostBuffer) -> None:
        # NOTE: recycling matters for pinned memory, whose allocation costs milliseconds.
        self._free.setdefault(buffer.nbytes, []).append(buffer)

    def _update_gauges(self) -> None:
        self._metrics.set("staging_bytes", self._used)
        self._metrics.set("staging_blocks", len(self._entries))


__all__ = [
    "HostAllocator",
    "HostBuffer",
    "NumpyAllocator",
    "StagingCache",
    "TorchPinnedAllocator",
    "default_allocator",
]
