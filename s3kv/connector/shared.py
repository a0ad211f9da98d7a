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
from s3kv.keys import BlockHash, ModelIdentity
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

    A block counts as staged only when every shard is staged; pins are all-or-nothing.
    """

    def __init__(self, stores: Sequence[KVStore]) -> None:
        self.stores = list(stores)

    @property
    def healthy(self) -> bool:
        """All shard stores' circuit breakers are closed."""
        return all(store.healthy for store in self.stores)

    def pin_leading(self, keys: Sequence[BlockHash]) -> int:
        """Pin the leading run staged on *every* shard; returns its length."""
        counts: list[int] = []
        for store in self.stores:
            counts.append(store.pin_leading(keys))
        claim = min(counts)
        for store, count in zip(self.stores, counts, strict=True):
            store.unpin(keys[claim:count])
        return claim

    def unpin(self, keys: Sequence[BlockHash]) -> None:
        """Release pins taken by :meth:`pin_leading`."""
        for store in self.stores:
            store.unpin(keys)

    def maybe(self, keys: Sequence[BlockHash]) -> int:
        """Leading blocks the manifest of every shard says may exist (memory only)."""
        return min(store.manifest.count_leading(keys) for store in self.stores)

    def prefetch(self, keys: Sequence[BlockHash]) -> None:
        """Stage ``keys`` on every shard in the background."""
        for store in self.stores:
            store.prefetch(keys)

    def wait_staged(self, keys: Sequence[BlockHash], timeout: float) -> int:
        """Wait for fetches of ``keys``; the leading count staged on every shard."""
        return min(store.wait_staged(keys, timeout) for store in self.stores)

    def record_hits(self, keys: Sequence[BlockHash]) -> None:
        """Usage records for prune and warm start (rank 0's manifest is the usage source)."""
        for store in self.stores:
            store.record_hits(keys)

    def may_contain(self, key: BlockHash) -> bool:
        """Whether every shard's manifest says ``key`` may exist (then saving is skipped)."""
        return all(store.manifest.may_contain(key) for store in self.stores)
