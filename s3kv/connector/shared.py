"""State shared by the scheduler and the worker living in one process, and the shard stores.

TensorRT-LLM builds the scheduler (rank 0) and the worker (every rank) as separate objects
with no channel between them but the pickled metadata. In rank 0's process they still share
memory, and s3kv uses that: the worker publishes what it learned at ``register_kv_caches``
(every rank's shard identity, via one all-gather) and the scheduler opens one store per shard
to stage every rank's bytes. Stores are opened once per process and fingerprint, and closed
(saves drained with the configured deadline) at interpreter exit, because the connector API
has no shutdown hook.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from s3kv.config import S3KVConfig
from s3kv.connector.arena import SlabArena
from s3kv.keys import BlockHash, ModelIdentity
from s3kv.metrics import Metrics
from s3kv.staging import HostAllocator
from s3kv.store import KVStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardInfo:
    """What one rank's worker reported at ``register_kv_caches``.

    Attributes:
        rank: The rank.
        identity: Its shard identity, or ``None`` when the worker turned itself off.
        reason: Why it is off ('' when on).
        block_nbytes: Raw bytes of one block shard.
        host: Host name (shards are staged in rank 0's memory: one host only).
    """

    rank: int
    identity: ModelIdentity | None
    reason: str
    block_nbytes: int
    host: str


@dataclass
class ProcessState:
    """The per-process singleton; see the module docstring."""

    shards: list[ShardInfo] | None = None
    stores: dict[str, KVStore] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: The scheduler built in this process (rank 0), initialized by the worker.
    scheduler: Any = None

    def open_store(
        self, config: S3KVConfig, identity: ModelIdentity, allocator: HostAllocator | None = None
    ) -> KVStore:
        """The store of ``identity``'s fingerprint, opened once per process."""
        fingerprint = identity.fingerprint()
        with self.lock:
            store = self.stores.get(fingerprint)
            if store is None:
                store = KVStore.open(config, identity, allocator=allocator)
                self.stores[fingerprint] = store
            return store

    def close_all(self) -> None:
        """Drain and close every store (at exit)."""
        with self.lock:
            stores, self.stores = list(self.stores.values()), {}
            self.scheduler = None
        for store in stores:
            store.close()


_STATE = ProcessState()
atexit.register(_STATE.close_all)


def process_state() -> ProcessState:
    """This process's shared connector state."""
    return _STATE


class ShardStores:
    """One store per tensor-parallel shard, used together by the scheduler on rank 0.

    A block counts as staged only when every shard is staged; pins are all-or-nothing. Under
    tensor parallelism each shard stages into its own :class:`~s3kv.connector.arena.SlabArena`
    (shared memory the other ranks map), and :meth:`slots` names, per rank, the slot holding
    a claimed block. The connector claims only through :meth:`claim`, which is
    :meth:`KVStore.claim <s3kv.store.KVStore.claim>` taken over every shard.

    Args:
        stores: The stores, in rank order.
        arenas: Their staging arenas, in rank order (tensor parallel), or none.
    """

    def __init__(self, stores: Sequence[KVStore], arenas: Sequence[SlabArena] = ()) -> None:
        self.stores = list(stores)
        self._arenas = list(arenas)

    @property
    def metrics(self) -> Metrics:
        """The registry connector counters go to (rank 0's shard)."""
        return self.stores[0].metrics

    @property
    def healthy(self) -> bool:
        """All shard stores' circuit breakers are closed."""
        return all(store.healthy for store in self.stores)

    @property
    def arenas(self) -> tuple[tuple[str, int], ...]:
        """Per rank ``(path, slot_bytes)`` of the staging arenas, or empty (one rank)."""
        return tuple((a.path, a.slot_bytes) for a in self._arenas)

    def claim(self, keys: Sequence[BlockHash]) -> int:
        """Pin the leading run staged on *every* shard, prefetch the rest; no network.

        Returns:
            How many leading blocks were pinned (on every shard).
        """
        if len(self.stores) == 1:
            return self.stores[0].claim(keys)
        counts = [store.pin_leading(keys) for store in self.stores]
        claim = min(counts)
        for store, count in zip(self.stores, counts, strict=True):
            store.unpin(keys[claim:count])
        tail = keys[claim:]
        maybe = min(store.count_maybe(tail) for store in self.stores) if tail else 0
        if maybe:
            self.prefetch(tail[:maybe])
        self.record_hits(keys[:claim])
        return claim

    def slots(self, key: BlockHash) -> tuple[int, ...]:
        """Per rank, the arena slot holding ``key``'s shard (empty with one rank).

        Raises:
            RuntimeError: ``key`` is not staged on some shard (it must be pinned by a claim).
        """
        if not self._arenas:
            return ()
        out = []
        for rank, (store, arena) in enumerate(zip(self.stores, self._arenas, strict=True)):
            buffer = store.staged(key)
            if buffer is None:  # unreachable: claimed blocks are pinned on every shard
                raise RuntimeError(f"claimed block {key.hex()} is not staged on rank {rank}")
            out.append(arena.slot_of(buffer))
        return tuple(out)

    def unpin(self, keys: Sequence[BlockHash]) -> None:
        """Release pins taken by :meth:`claim`."""
        for store in self.stores:
            store.unpin(keys)

    def prefetch(self, keys: Sequence[BlockHash]) -> None:
        """Stage ``keys`` on every shard in the background."""
        for store in self.stores:
            store.prefetch(keys)

    def wait_staged(self, keys: Sequence[BlockHash], timeout: float) -> int:
        """Wait for fetches of ``keys``; the leading count staged on every shard."""
        return min(store.wait_staged(keys, timeout) for store in self.stores)

    def staged_everywhere(self, key: BlockHash) -> bool:
        """Whether ``key`` is staged on every shard."""
        return all(store.is_staged(key) for store in self.stores)

    def record_hits(self, keys: Sequence[BlockHash]) -> None:
        """Usage records for prune and warm start."""
        if keys:
            for store in self.stores:
                store.record_hits(keys)

    def may_contain(self, key: BlockHash) -> bool:
        """Whether every shard's manifest says ``key`` may exist (then saving is skipped)."""
        return all(store.may_contain(key) for store in self.stores)

    def close_arenas(self) -> None:
        """Unmap the staging arenas (their stores must be closed first)."""
        for arena in self._arenas:
            arena.close()


__all__ = [
    "ProcessState",
    "ShardInfo",
    "ShardStores",
    "process_state",
]
