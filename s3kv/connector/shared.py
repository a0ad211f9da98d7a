"""State shared by the scheduler and the worker living in one process, and the shard stores.

TensorRT-LLM builds the scheduler (rank 0) and the worker (every rank) as separate objects
with no channel between them but the pickled metadata. In rank 0's process they still share
memory, and s3kv uses that: the worker publishes what it learned at ``register_kv_caches``
(every rank's shard identity, via one all-gather) and the scheduler opens one store per shard
to stage every rank's bytes. Stores are opened once per process and fingerprint, and closed
(saves drained with the configured deadline) at interpreter exit, because the connector API
has no shutdown hook. They open degraded when the bucket does not answer at startup
(``KVStore.open(degraded_start=True)``, :mod:`s3kv.startup`): unhealthy until it does.

Under tensor parallelism the shards of a layout share one manifest, under the layout's
fingerprint (:meth:`ProcessState.open_layout`, :mod:`s3kv.manifest.shards`): it advertises a
block once every shard is written. Rank 0's process holds it; the other ranks' stores report
their writes to it through the write relay (:mod:`s3kv.connector.relay`) and open no
manifest at all (:meth:`ProcessState.open_relayed_store`).
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from s3kv.arena import SlabArena
from s3kv.config import S3KVConfig
from s3kv.connector.relay import RelayedManifest, RelayPump, WriteRelay
from s3kv.errors import StorageError
from s3kv.keys import BlockHash, ModelIdentity, identity_object_key, layout_fingerprint
from s3kv.manifest import ShardedPresence, ShardView
from s3kv.metrics import Metrics
from s3kv.staging import HostAllocator
from s3kv.storage import Backend
from s3kv.store import KVStore, ManifestSource, open_manifest

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


@dataclass(frozen=True)
class OpenLayout:
    """The stores of one TP layout, opened by :meth:`ProcessState.open_layout`.

    Attributes:
        stores: One per shard, in rank order, sharing the layout's manifest.
        relay: Path of the write relay the other ranks report their writes to.
    """

    stores: list[KVStore]
    relay: str


def _describe_layout(
    backend: Backend, prefix: str, layout: str, identities: Sequence[ModelIdentity]
) -> None:
    """Write the layout's ``identity.json`` once: rank 0's identity without a rank, and the
    fingerprints (and block sizes, which may differ) of its shards.

    Best effort (operators' tools read it; nothing in the engine does).
    """
    key = identity_object_key(prefix, layout)
    data = identities[0].as_dict()
    data["tp_rank"] = None
    data["block_elems"] = [identity.block_elems for identity in identities]
    data["shard_fingerprints"] = [identity.fingerprint() for identity in identities]
    try:
        if backend.head(key) is None:
            backend.put(key, json.dumps(data, indent=2, sort_keys=True).encode(), if_absent=True)
    except StorageError as exc:
        logger.warning("s3kv: cannot describe layout %s: %s", layout, exc)


def _rank_metrics(config: S3KVConfig, rank: int) -> S3KVConfig:
    """``config`` for rank ``rank``'s own process: it serves on ``metrics_port + rank``.

    Rank 0's process serves every shard's store and the layout's manifest on
    ``metrics_port``; the other ranks of the host would otherwise race it for that port.
    """
    if not config.metrics_port or rank == 0:
        return config
    port = config.metrics_port + rank
    if port > 65535:
        logger.warning("s3kv: rank %d does not serve metrics: port %d is out of range", rank, port)
        return config.replace(metrics_port=0)
    return config.replace(metrics_port=port)


class _LayoutManifest:
    """A TP layout's one manifest, opened (and started) by the first of its shard stores
    whose bucket answers: at startup rank 0's, or any of them once a pending bucket answers
    (:mod:`s3kv.startup`). Until then the relay's reports have nowhere to go and are dropped
    (nothing is saved meanwhile: a pending store is unhealthy). Thread-safe.
    """

    def __init__(
        self, config: S3KVConfig, layout: str, identities: Sequence[ModelIdentity]
    ) -> None:
        self._config = config
        self._layout = layout
        self._identities = list(identities)
        self._lock = threading.Lock()
        self._presence: ShardedPresence | None = None

    def view(self, shard: int, backend: Backend) -> ShardView:
        """Shard ``shard``'s view, opening the manifest through ``backend`` if first."""
        with self._lock:
            presence = self._presence
            if presence is None:
                config = self._config
                _describe_layout(backend, config.key_prefix, self._layout, self._identities)
                manifest = open_manifest(backend, config, self._layout)
                presence = ShardedPresence(manifest, len(self._identities))
                presence.start(
                    refresh_interval=config.manifest_refresh_interval,
                    flush_interval=config.manifest_flush_interval,
                    flush_keys=config.manifest_flush_keys,
                )
                self._presence = presence
            return presence.view(shard)

    def record_write(self, shard: int, key: BlockHash, parent: BlockHash, size: int) -> None:
        """A relayed write of shard ``shard`` (the relay pump's sink)."""
        presence = self._presence
        if presence is not None:
            presence.record_write(shard, key, parent, size)


@dataclass
class ProcessState:
    """The per-process singleton; see the module docstring."""

    shards: list[ShardInfo] | None = None
    #: Every store of this process, by fingerprint (a layout's: ``<shard fp>@<layout fp>``).
    stores: dict[str, KVStore] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: The scheduler built in this process (rank 0), initialized by the worker.
    scheduler: Any = None
    layouts: dict[str, OpenLayout] = field(default_factory=dict)
    relayed: dict[str, RelayedManifest] = field(default_factory=dict)
    pumps: list[tuple[RelayPump, float]] = field(default_factory=list)

    def open_store(
        self, config: S3KVConfig, identity: ModelIdentity, allocator: HostAllocator | None = None
    ) -> KVStore:
        """The store of ``identity``'s fingerprint, opened once per process."""
        fingerprint = identity.fingerprint()
        with self.lock:
            store = self.stores.get(fingerprint)
            if store is None:
                store = KVStore.open(config, identity, allocator=allocator, degraded_start=True)
                self.stores[fingerprint] = store
            return store

    def open_relayed_store(
        self, config: S3KVConfig, identity: ModelIdentity
    ) -> tuple[KVStore, RelayedManifest]:
        """A rank > 0's store under TP: no manifest, its writes relayed to rank 0's.

        Opened once per process and fingerprint. The caller attaches the returned
        :class:`~s3kv.connector.relay.RelayedManifest` once the metadata names the relay.
        """
        fingerprint = identity.fingerprint()
        with self.lock:
            store, relayed = self.stores.get(fingerprint), self.relayed.get(fingerprint)
            if store is None or relayed is None:
                new = RelayedManifest(identity.tp_rank)
                # NOTE: this rank reads no manifest (nor usage: warm start runs on rank 0) and
                # cannot name the layout before the all-gather, so the store keeps its own.
                source = ManifestSource(fingerprint, lambda _: new)
                # NOTE: nor does it stage: rank 0 stages every shard into arenas this rank
                # maps, so a staging budget here would sit unused (with codec processes, a
                # whole arena page-locked at start on every rank).
                store = KVStore.open(
                    _rank_metrics(config, identity.tp_rank).replace(staging_bytes=0),
                    identity,
                    manifest=source,
                    degraded_start=True,
                )
                self.stores[fingerprint], self.relayed[fingerprint] = store, new
                relayed = new
            return store, relayed

    def open_layout(
        self,
        config: S3KVConfig,
        identities: Sequence[ModelIdentity],
        allocators: Sequence[HostAllocator | None],
    ) -> OpenLayout:
        """One store per shard of a TP layout, sharing one manifest; opened once per process.

        The manifest lives under the layout fingerprint and advertises a block once every
        shard reported its write: rank 0's shard directly, the others through the write
        relay, which a background pump drains (closed first by :meth:`close_all`).

        Raises:
            KeyDerivationError: the identities are not the shards of one layout, in rank order.
            S3KVError: as :meth:`KVStore.open <s3kv.store.KVStore.open>`.
        """
        layout = layout_fingerprint(identities)
        with self.lock:
            opened = self.layouts.get(layout)
            if opened is None:
                opened = self._open_layout(config, list(identities), list(allocators), layout)
                self.layouts[layout] = opened
            return opened

    def _open_layout(
        self,
        config: S3KVConfig,
        identities: list[ModelIdentity],
        allocators: list[HostAllocator | None],
        layout: str,
    ) -> OpenLayout:
        """Caller holds ``self.lock``."""
        shared = _LayoutManifest(config, layout, identities)
        relay = WriteRelay.create(len(identities))
        stores: list[KVStore] = []
        try:
            for identity, allocator in zip(identities, allocators, strict=True):
                source = ManifestSource(layout, functools.partial(shared.view, identity.tp_rank))
                stores.append(
                    KVStore.open(
                        config, identity, allocator=allocator, manifest=source, degraded_start=True
                    )
                )
        except BaseException:
            for store in stores:
                store.close()
            relay.close()
            raise
        pump = RelayPump(relay, shared.record_write, min(0.25, config.manifest_flush_interval))
        pump.start()
        self.pumps.append((pump, config.close_timeout))
        for identity, store in zip(identities, stores, strict=True):
            self.stores[f"{identity.fingerprint()}@{layout}"] = store
        return OpenLayout(stores, relay.path)

    def close_all(self) -> None:
        """Drain and close every store (at exit).

        Order: the stores whose writes are relayed to another process first (their rings
        finish), then the relay pumps (rank 0 waits, bounded, for the other ranks' last
        reports), then the rest, so a shared manifest's last flush advertises every write.
        """
        with self.lock:
            stores, self.stores = dict(self.stores), {}
            relayed, self.relayed = set(self.relayed), {}
            pumps, self.pumps = self.pumps, []
            self.layouts = {}
            self.scheduler = None
        for name in relayed:
            store = stores.pop(name, None)
            if store is not None:
                store.close()
        for pump, timeout in pumps:
            pump.close(timeout)
        for store in stores.values():
            store.close()


_STATE = ProcessState()
atexit.register(_STATE.close_all)


def process_state() -> ProcessState:
    """This process's shared connector state."""
    return _STATE


class ShardStores:
    """One store per tensor-parallel shard, used together by the scheduler on rank 0.

    A block counts as staged only when every shard is staged; pins are all-or-nothing. Under
    tensor parallelism each shard stages into its own :class:`~s3kv.arena.SlabArena`
    (shared memory the other ranks map), and :meth:`slots` names, per rank, the slot holding
    a claimed block. The connector claims only through :meth:`claim`, which is
    :meth:`KVStore.claim <s3kv.store.KVStore.claim>` taken over every shard.

    Args:
        stores: The stores, in rank order.
        arenas: Their staging arenas, in rank order (tensor parallel), or none.
        relay: Path of the write relay the other ranks report to (tensor parallel), or ''.
    """

    def __init__(
        self, stores: Sequence[KVStore], arenas: Sequence[SlabArena] = (), relay: str = ""
    ) -> None:
        self.stores = list(stores)
        self.relay = relay
        self._arenas = list(arenas)

    @property
    def metrics(self) -> Metrics:
        """The registry connector counters go to (rank 0's shard)."""
        return self.stores[0].metrics

    @property
    def healthy(self) -> bool:
        """All shard stores are open and their circuit breakers closed."""
        return all(store.healthy for store in self.stores)

    @property
    def ready(self) -> bool:
        """Every shard store is open (its bucket answered; :mod:`s3kv.startup`)."""
        return all(store.ready for store in self.stores)

    def wait_ready(self) -> bool:
        """Block until every shard store is open (True) or one was closed first (False)."""
        return all(store.wait_ready() for store in self.stores)

    @property
    def arenas(self) -> tuple[tuple[str, int], ...]:
        """Per rank ``(path, slot_bytes)`` of the staging arenas, or empty (one rank)."""
        return tuple((a.path, a.slot_bytes) for a in self._arenas)

    def claim(self, keys: Sequence[BlockHash], *, hold_prefetch: int | None = None) -> int:
        """Pin the leading run staged on *every* shard, prefetch the rest; no network.

        With ``hold_prefetch`` (a tag) the prefetch waits for :meth:`start_walks`
        (:meth:`KVStore.prefetch_many <s3kv.store.KVStore.prefetch_many>`'s ``hold``).

        Returns:
            How many leading blocks were pinned (on every shard).
        """
        if len(self.stores) == 1:
            return self.stores[0].claim(keys, hold_prefetch=hold_prefetch)
        counts: list[int] = []
        try:
            for store in self.stores:
                counts.append(store.pin_leading(keys))
        except Exception:
            # NOTE: keys are hashed lazily; a malformed token raises on some shard after
            # others pinned: release theirs, so a failed claim leaves no pin behind.
            for store, count in zip(self.stores, counts, strict=False):
                store.unpin(keys[:count])
            raise
        claim = min(counts)
        for store, count in zip(self.stores, counts, strict=True):
            store.unpin(keys[claim:count])
        # NOTE: one step per shard; each walks the tail on its I/O side (KVStore.prefetch_many)
        for store in self.stores:
            store.prefetch_many(keys[claim:], maybe_only=True, hold=hold_prefetch)
        self.record_hits(keys[:claim])
        return claim

    def start_walks(self, before: int | None = None) -> None:
        """Start the prefetch walks held by :meth:`claim` on every shard, only those tagged
        below ``before`` if given (never raises)."""
        for store in self.stores:
            try:
                store.start_held_walks(before)
            except Exception:  # NOTE: a lost prefetch costs a later miss, never the engine
                logger.exception("s3kv: starting held prefetch walks failed")

    @property
    def held_walks(self) -> int:
        """Prefetch walks held for :meth:`start_walks`, over every shard."""
        return sum(store.held_walks for store in self.stores)

    def slots_many(self, keys: Sequence[BlockHash]) -> list[tuple[int, ...]]:
        """Per key, per rank, the arena slot holding its shard (empty tuples with one rank);
        one staging lookup per shard for all of them.

        Raises:
            RuntimeError: A key is not staged on some shard (it must be pinned by a claim).
        """
        if not self._arenas:
            return [() for _ in keys]
        per_rank: list[list[int]] = []
        for rank, (store, arena) in enumerate(zip(self.stores, self._arenas, strict=True)):
            slots = []
            for key, buffer in zip(keys, store.staged_many(keys), strict=True):
                if buffer is None:  # unreachable: claimed blocks are pinned on every shard
                    raise RuntimeError(f"claimed block {key.hex()} is not staged on rank {rank}")
                slots.append(arena.slot_of(buffer))
            per_rank.append(slots)
        return list(zip(*per_rank, strict=True))

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
        """Usage records for prune and warm start (a shared manifest counts them once)."""
        if keys:
            for store in self.stores:
                store.record_hits(keys)

    def may_contain(self, key: BlockHash) -> bool:
        """Whether ``key`` may exist on every shard (then saving is skipped).

        Under TP the shards' manifests are views of one: true once every shard is written.
        """
        return all(store.may_contain(key) for store in self.stores)

    def count_leading(self, keys: Sequence[BlockHash]) -> int:
        """Length of the leading run of ``keys`` that :meth:`may_contain` on every shard."""
        run = len(keys)
        for store in self.stores:
            run = store.count_maybe(keys[:run])
            if not run:
                break
        return run

    def contains_many(self, keys: Sequence[BlockHash]) -> npt.NDArray[np.bool_]:
        """:meth:`may_contain` for each of ``keys``: one filter pass per shard."""
        present = self.stores[0].contains_many(keys)
        for store in self.stores[1:]:
            present &= store.contains_many(keys)
        return present

    def close_arenas(self) -> None:
        """Unmap the staging arenas (their stores must be closed first)."""
        for arena in self._arenas:
            arena.close()


__all__ = [
    "OpenLayout",
    "ProcessState",
    "ShardInfo",
    "ShardStores",
    "process_state",
]
