"""The store engine: lookup, host staging, background prefetch and save.

Contracts (DESIGN.md invariants):

* :meth:`KVStore.lookup` answers from memory only (staging + manifest Bloom filter): zero
  network calls, whatever the chain length.
* Only *staged* blocks — fetched, verified by the codec and decoded into host memory — are
  reported as ``staged``; a Bloom hit is only ever ``maybe``. :meth:`KVStore.pin_leading`
  pins what a caller will load so eviction cannot race the copy.
* Nothing a bucket or an object can do raises out of :meth:`lookup`, :meth:`prefetch`,
  :meth:`save`, :meth:`flush` or :meth:`close`: failures become counted misses or dropped
  saves. :meth:`KVStore.open` is the exception: a missing bucket or rejected credentials
  fail there, loudly, with one line — unless ``degraded_start`` (the connector's way), which
  opens a store that claims and saves nothing until the bucket answers (:mod:`s3kv.startup`).
* Everything is bounded: staging bytes, queued prefetches, in-flight save bytes. When saves
  hit ``max_inflight_save_bytes``, ``save_policy="drop"`` (default) drops the new save and
  counts it — the engine's forward loop never waits on S3 — while ``"block"`` waits up to
  ``save_block_timeout`` and then drops.

Threads: one :class:`~s3kv.pool.IOPool` (owned here) runs GET→verify→decode and
encode→PUT, prefetches first; the manifest has one daemon thread for flush and refresh.

Manifest: by default each store opens (and owns) the manifest of its fingerprint. A caller
may instead hand :meth:`KVStore.open` a :class:`ManifestSource`: under tensor parallelism
the shards of one layout share one manifest (:mod:`s3kv.manifest.shards`), and each store
gets a view of it that its owner starts; the store then only closes its view.
"""

from __future__ import annotations

import enum
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from s3kv import codec
from s3kv._logonce import LogOnce
from s3kv._logsetup import apply_log_level
from s3kv.arena import SlabArena
from s3kv.auth import MAX_OVERHEAD, Keyring, load_keyring, seal
from s3kv.config import S3KVConfig
from s3kv.errors import (
    CodecError,
    KeyDerivationError,
    ObjectTooLargeError,
    S3KVError,
    StorageError,
)
from s3kv.keys import (
    BlockHash,
    ModelIdentity,
    block_object_key,
    block_object_keys,
    identity_object_key,
)
from s3kv.manifest import CompactionPolicy, Manifest, UsageTable, load_usage
from s3kv.metrics import Export, Metrics, exporter
from s3kv.offload import (
    CodecProcesses,
    Failure,
    FetchJob,
    Job,
    Outcome,
    Outcomes,
    Placement,
    SaveJobs,
    choose_cpus,
    log_placement,
    open_stored,
)
from s3kv.pool import IOPool, Priority
from s3kv.quarantine import Quarantine
from s3kv.staging import HostAllocator, HostBuffer, StagingCache
from s3kv.startup import BucketAccess, PendingManifest, StoreOpening
from s3kv.storage import (
    Backend,
    BreakerState,
    CircuitBreaker,
    InstrumentedBackend,
    Recorded,
)

logger = logging.getLogger(__name__)

#: First and largest steps of :meth:`KVStore.count_maybe` (keys per filter query). NOTE: small
#: first: a cold prompt's walk ends at its first block, and a first step of 256 hashed and
#: filtered a whole 8K-token prompt on an I/O thread while the engine's thread planned the
#: same request (0.5-1.5 ms of its first iteration lost to the GIL, CPU emulator).
_MAYBE_STEP = 16
_MAYBE_MAX_STEP = 4096
#: Most :meth:`KVStore.prefetch_many` walks queued at once. NOTE: walks pile up only while
#: the scheduler's thread keeps the GIL through a burst of claims; each holds its request's
#: keys (and, until hashed, its tokens) alive.
_MAX_WALKS = 64
#: Most walks held for :meth:`KVStore.start_held_walks`; past it they all start at once.
_MAX_HELD_WALKS = 32
#: Fetches handed to the codec processes per batch: the first blocks of a prompt start
#: at once, and the store's process pays its bookkeeping per batch, not per block.
_FETCH_BATCH = 16

_CODECS = {
    "raw": codec.CodecId.RAW,
    "zstd": codec.CodecId.ZSTD,
    "planes-zstd": codec.CodecId.PLANES_ZSTD,
    "planes-ref": codec.CodecId.PLANES_REF,
}


@dataclass(frozen=True)
class LookupResult:
    """Answer of :meth:`KVStore.lookup` for a chain of block keys.

    Attributes:
        staged: Leading blocks whose verified bytes are in host memory now.
        maybe: Blocks right after those that the manifest says may exist in the bucket (a
            prefetch candidate, never a promise).
    """

    staged: int
    maybe: int


class ManifestLike(Protocol):
    """What a store uses of a manifest: :class:`~s3kv.manifest.Manifest` and its views."""

    def may_contain(self, key: bytes) -> bool:
        """Whether ``key`` may exist (no network)."""
        ...

    def count_leading(self, keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` that may exist (no network)."""
        ...

    def contains_many(self, keys: Sequence[bytes]) -> npt.NDArray[np.bool_]:
        """Whether each of ``keys`` may exist (one vectorized pass; no network)."""
        ...

    def record_write(self, key: BlockHash, parent: BlockHash, size: int) -> None:
        """``key`` was written (``size`` stored bytes)."""
        ...

    def record_writes(self, writes: Sequence[tuple[BlockHash, BlockHash, int]]) -> None:
        """:meth:`record_write` of each ``(key, parent, size)``, in one step."""
        ...

    def record_hits(self, keys: Sequence[BlockHash]) -> None:
        """``keys`` served a request."""
        ...

    def flush(self) -> int:
        """Write pending records now; how many."""
        ...

    def close(self, flush: bool = True, timeout: float | None = None) -> None:
        """Stop background work (idempotent)."""
        ...

    def stats(self) -> dict[str, float]:
        """Counters and gauges by name."""
        ...


@dataclass(frozen=True)
class ManifestSource:
    """A manifest the store does not open itself (a shared one), for :meth:`KVStore.open`.

    Attributes:
        fingerprint: The fingerprint the manifest lives under (its usage records are read
            from there by :meth:`KVStore.usage`), e.g. a TP layout's fingerprint.
        open: Called once with the store's instrumented backend; returns the manifest the
            store uses. Whoever provides it starts its background work; the store neither
            starts it nor closes it more than once (its :meth:`~ManifestLike.close`).
    """

    fingerprint: str
    open: Callable[[Backend], ManifestLike]


class _Waiter:
    """One :meth:`KVStore.wait_staged` call: ``done`` is set once none of ``pending`` (its keys
    that were being fetched) is any more. Changed under the store's lock."""

    __slots__ = ("done", "pending")

    def __init__(self, pending: set[BlockHash]) -> None:
        self.pending = pending
        self.done = threading.Event()


class SaveStatus(enum.Enum):
    """What :meth:`KVStore.save` did with a block."""

    QUEUED = "queued"
    SKIPPED = "skipped"  # already written (per manifest) or already being written
    DROPPED = "dropped"  # back-pressure, or the store is closed


class KVStore:
    """Saves and stages KV blocks of one model fingerprint.

    Build it with :meth:`open`; the constructor takes ready parts (tests inject them).

    Args:
        backend: Object store (wrapped for metrics unless already instrumented).
        manifest: The opened manifest of ``fingerprint`` (or a view of a shared one).
        fingerprint: Namespace of every object key.
        config: Settings (prefix, bounds, codec, policies).
        metrics: Registry shared with the manifest and staging.
        allocator: Staging buffer allocator (pinned host memory under CUDA by default).
        pool: I/O pool; default ``config.io_concurrency()`` threads (pass ``IOPool(0)`` for inline).
        block_nbytes: Raw size every block must have, if known (checked on decode).
        manifest_fingerprint: Where the manifest lives, if not under ``fingerprint``.
        keyring: Block keys (``auth_keys``): seal every save, open only sealed blocks.
        codec_processes: Where GET→decode and encode→PUT run for blocks in shared memory
            (the staging allocator when it is a :class:`~s3kv.arena.SlabArena`, and
            :meth:`save_arena`'s); the store closes them. Other blocks stay in the pool.
    """

    def __init__(
        self,
        *,
        backend: Backend,
        manifest: ManifestLike,
        fingerprint: str,
        config: S3KVConfig,
        metrics: Metrics | None = None,
        allocator: HostAllocator | None = None,
        pool: IOPool | None = None,
        block_nbytes: int | None = None,
        manifest_fingerprint: str | None = None,
        keyring: Keyring | None = None,
        codec_processes: CodecProcesses | None = None,
    ) -> None:
        self.metrics = metrics or Metrics()
        self.backend = (
            backend
            if isinstance(backend, InstrumentedBackend)
            else InstrumentedBackend(backend, self.metrics)
        )
        self.manifest = manifest
        self.fingerprint = fingerprint
        self.manifest_fingerprint = manifest_fingerprint or fingerprint
        self.config = config
        self.block_nbytes = block_nbytes
        self.keyring = keyring
        #: Longest object a GET reads: a block of this model (or the staging budget, when
        #: the block size is unknown) encoded as badly as possible, plus the seal.
        self._max_object_bytes = codec.max_object_len(
            block_nbytes
            if block_nbytes is not None
            else min(config.staging_bytes, codec.MAX_RAW_LEN)
        ) + (MAX_OVERHEAD if keyring is not None else 0)
        #: Keys whose object failed verification: misses without a GET for a while.
        self.quarantine: Quarantine[BlockHash] = Quarantine()
        self.staging = StagingCache(config.staging_bytes, allocator=allocator, metrics=self.metrics)
        # NOTE: with codec processes the pool's threads only hand fetches over (and do the
        # work of whatever the processes cannot take): more of them would only contend for
        # the engine's GIL.
        threads = config.io_concurrency()
        if codec_processes is not None:
            threads = min(threads, 2)
        self._pool = pool if pool is not None else IOPool(threads)
        self._codec = _CODECS[config.codec]
        self._lock = threading.Lock()
        self._save_space = threading.Condition(self._lock)
        self._fetching: set[BlockHash] = set()
        #: Keys of ``_fetching`` someone waits for (:meth:`wait_staged`), with their waiters.
        self._waiters: dict[BlockHash, list[_Waiter]] = {}
        self._walks = 0  # prefetch_many tasks queued, not yet started
        #: Walks prefetch_many was asked to hold: (tag, keys, maybe_only).
        self._held_walks: list[tuple[int, Sequence[BlockHash], bool]] = []
        self._saving: set[BlockHash] = set()
        self._inflight_save_bytes = 0
        self._closed = False
        self._probing = False
        self._log_once = LogOnce(logger)
        self._exports: list[Export] = []
        self._offload = codec_processes
        #: Shared-memory arenas the codec processes may read and write (by path).
        self._arenas: list[SlabArena] = [allocator] if isinstance(allocator, SlabArena) else []
        # NOTE: id(view) -> (view, arena, slot) of views found to be slots (_locate)
        self._located: dict[int, tuple[HostBuffer, SlabArena, int]] = {}
        self._own_arenas: list[SlabArena] = []
        if codec_processes is not None:
            self.metrics.watch("codec_processes_alive", lambda: float(codec_processes.alive))
        self.metrics.set("staging_capacity_bytes", config.staging_bytes)
        self.metrics.watch("store_pending", lambda: 0.0 if self.ready else 1.0)
        self.metrics.set("inflight_save_limit_bytes", config.max_inflight_save_bytes)
        self.metrics.set("inflight_save_bytes", 0)
        self.metrics.set("staging_bytes", self.staging.used_bytes)
        self.metrics.set("staging_blocks", len(self.staging))

    # --- construction ---

    #: A ``degraded_start`` store's opening while its bucket has not answered (:meth:`open`).
    _opening: StoreOpening[ManifestLike] | None = None

    @classmethod
    def open(
        cls,
        config: S3KVConfig,
        identity: ModelIdentity,
        *,
        backend: Backend | None = None,
        allocator: HostAllocator | None = None,
        pool: IOPool | None = None,
        start_background: bool = True,
        manifest: ManifestSource | None = None,
        degraded_start: bool = False,
    ) -> KVStore:
        """Connect, check the bucket, load the manifest and start background work.

        ``manifest``: use that manifest (a view of one shared by the shards of a TP layout)
        instead of opening this fingerprint's own; its provider starts it.

        The store's metrics join the process's exporter (labelled with its fingerprint and
        shard, the identity's TP rank), and so does its manifest (once per manifest
        fingerprint); with ``metrics_port`` set the process serves them on
        ``metrics_address``. ``log_level``, when set, is applied to the ``s3kv`` logger.

        ``degraded_start`` (the connector's way, :mod:`s3kv.startup`): wait at most
        ``startup_timeout`` for the bucket. If it does not answer in time, or fails (also a
        missing bucket or denied credentials), return a *pending* store instead of raising:
        not :attr:`ready`, so it claims nothing, drops saves and skips prefetches, while a
        background thread retries the startup until it succeeds or the store is closed.

        Raises:
            ConfigError: no bucket configured for S3.
            BucketNotFoundError, AccessDeniedError, EndpointError: one clear line each
                (without ``degraded_start``).
        """
        apply_log_level(config.log_level)
        keyring = load_keyring(
            config.auth_keys, accept_unsigned=config.auth_accept_unsigned, region=config.region
        )
        # NOTE: before anything opens: a CPU list this host lacks is a bad setting.
        processes = _codec_processes(config)
        placement = choose_cpus(config.codec_cpus, processes) if processes else None
        metrics = Metrics()
        breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown)
        access = BucketAccess(config, backend)
        instrumented = InstrumentedBackend(access.backend, metrics, breaker=breaker)
        fingerprint = identity.fingerprint()
        finish = functools.partial(
            _finish_open, access, instrumented, config, identity, manifest, start_background
        )
        pending: StoreOpening[ManifestLike] | None = None
        opened: ManifestLike
        if degraded_start:
            opening = StoreOpening(
                access.check,
                finish,
                bucket=instrumented.description,
                retry_cap=config.breaker_cooldown,
                discard=_discard_manifest,
            )
            waited = opening.wait(config.startup_timeout)
            pending = opening if waited is None else None
            opened = PendingManifest(opening) if waited is None else waited
        else:
            opened = finish()
        block_nbytes = (
            identity.num_layers
            * identity.kv_factor
            * identity.block_elems
            * codec.DType(identity.kv_dtype).itemsize
            if identity.kv_dtype in {d.value for d in codec.DType}
            else None
        )
        offload, staging_arena = _start_codec_processes(
            config,
            keyring,
            block_nbytes,
            injected=backend is not None,
            allocator=allocator,
            placement=placement,
        )
        try:
            store = cls(
                backend=instrumented,
                manifest=opened,
                fingerprint=fingerprint,
                config=config,
                metrics=metrics,
                pool=pool,
                block_nbytes=block_nbytes,
                manifest_fingerprint=manifest.fingerprint if manifest is not None else None,
                keyring=keyring,
                allocator=staging_arena or allocator,
                codec_processes=offload,
            )
        except BaseException:
            opened.close(flush=False, timeout=0.0)  # NOTE: stops a pending opening too
            if offload is not None:
                offload.close(timeout=0.0)
            raise
        if staging_arena is not None:
            store._own_arenas.append(staging_arena)
        store._opening = pending
        store.export(shard=identity.tp_rank)
        if pending is None:
            logger.info(
                "s3kv: opened %s fingerprint %s (%d manifest requests)",
                instrumented.description,
                fingerprint,
                instrumented.requests(),
            )
        return store

    @property
    def ready(self) -> bool:
        """False while a ``degraded_start`` store waits for its bucket (claim nothing)."""
        opening = self._opening
        return opening is None or opening.ready

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until :attr:`ready`, :meth:`close` or ``timeout``; whether ready."""
        opening = self._opening
        return opening is None or opening.wait_ready(timeout)

    @property
    def healthy(self) -> bool:
        """False while the circuit breaker says the bucket is unhealthy (claim nothing).

        Once the breaker's cooldown has passed (half-open), asking schedules one background
        probe (HEAD bucket); its success closes the circuit, so recovery does not wait for
        some other request to happen by. False too while the store is not :attr:`ready`.
        """
        if not self.ready:
            return False
        breaker = self.backend.breaker
        if breaker is None:
            return True
        state = breaker.state
        if state is BreakerState.HALF_OPEN:
            self._probe()
        return state is BreakerState.CLOSED

    def _probe(self) -> None:
        with self._lock:
            if self._probing or self._closed:
                return
            self._probing = True

        def probe() -> None:
            try:
                self.backend.check()
            except StorageError as exc:
                self._log_failure("health probe", exc)
            finally:
                with self._lock:
                    self._probing = False

        self._pool.submit(Priority.PREFETCH, probe)

    def export(self, *, shard: int = 0) -> None:
        """Add this store's metrics (labels ``fingerprint``, ``shard``) and its manifest (under
        the manifest's fingerprint) to the process's exporter, until :meth:`close`; serve them
        if ``metrics_port`` is set. :meth:`open` does this; idempotent."""
        registry = exporter()
        with self._lock:
            if self._exports or self._closed:
                return
            self._exports = [
                registry.add_store(self.metrics, fingerprint=self.fingerprint, shard=str(shard)),
                registry.add_manifest(self.manifest_fingerprint, self.manifest.stats),
            ]
        if self.config.metrics_port:
            registry.serve(self.config.metrics_port, self.config.metrics_address)

    def _breaker_open(self) -> bool:
        if not self.ready:  # NOTE: a pending store behaves as if its breaker were open
            return True
        breaker = self.backend.breaker
        return breaker is not None and breaker.state is BreakerState.OPEN

    def object_key(self, key: BlockHash) -> str:
        """The object key a block is stored under."""
        return block_object_key(self.config.key_prefix, self.fingerprint, key)

    # --- the scheduler's path: memory only ---

    def lookup(self, keys: Sequence[BlockHash]) -> LookupResult:
        """How many leading blocks are staged, and how many more may exist. No network."""
        staged = self.staging.count_leading(keys)
        maybe = self.count_maybe(keys[staged:])
        self.metrics.inc("lookup_calls")
        self.metrics.inc("lookup_blocks_staged", staged)
        self.metrics.inc("lookup_blocks_maybe", maybe)
        return LookupResult(staged=staged, maybe=maybe)

    def claim(self, keys: Sequence[BlockHash], *, hold_prefetch: int | None = None) -> int:
        """The scheduler's claim: pin the leading staged run of ``keys``; no network.

        The pinned blocks are never evicted until :meth:`unpin`. The blocks behind them are
        handed to the I/O side in one step (:meth:`prefetch_many` with ``maybe_only``, and
        ``hold`` = ``hold_prefetch``), which prefetches those the manifest may hold so that
        a later request hits; the pinned ones are recorded as hits (usage for prune and warm
        start). ``keys`` may be a lazy :class:`~s3kv.keys.KeyChain` view: only the staged run
        (and one step) is hashed here.

        Returns:
            How many leading blocks were pinned.
        """
        # NOTE: counted first, pinned second: lazy keys are hashed while counting, so a
        # malformed block raises before any pin is taken, never half-way through pinning.
        staged = list(keys[: self.staging.count_leading(keys)])
        pinned = self.pin_leading(staged)
        # NOTE: queued even where the manifest lacks the next block now: it may not be
        # loaded yet (a store still opening), and the walk asks it later, with one scalar
        # lookup for a cold prompt (KeyFilter.count_leading).
        self.prefetch_many(keys[pinned:], maybe_only=True, hold=hold_prefetch)
        self.record_hits(staged[:pinned])
        return pinned

    def prefetch_maybe(self, keys: Sequence[BlockHash]) -> int:
        """Prefetch the leading run of ``keys`` the manifest may hold; returns its length.

        Counts and queues on the caller's thread; :meth:`prefetch_many` does it off it.
        """
        maybe = self.count_maybe(keys)
        if maybe:
            self.prefetch(keys[:maybe])
        return maybe

    def count_maybe(self, keys: Sequence[BlockHash]) -> int:
        """Leading blocks of ``keys`` the manifest may hold (its Bloom filter; no network).

        Asks in growing steps, so lazy keys are hashed only about as far as the run goes.
        """
        done, step, total = 0, _MAYBE_STEP, len(keys)
        while done < total:
            chunk = keys[done : done + step]
            found = self.manifest.count_leading(chunk)
            done += found
            if found < len(chunk):
                break
            step = min(2 * step, _MAYBE_MAX_STEP)
        return done

    def usage(self, top: int | None = None) -> UsageTable:
        """This fingerprint's usage (hits, writes, pins) folded from the bucket.

        ``top``: keep only that many hottest keys, streaming shard by shard (bounded memory).

        Raises:
            StorageError: The bucket cannot be read.
        """
        return load_usage(self.backend, self.config.key_prefix, self.manifest_fingerprint, top=top)

    def may_contain(self, key: BlockHash) -> bool:
        """Whether the bucket may hold ``key`` (false positives possible; no network)."""
        return self.manifest.may_contain(key)

    def contains_many(self, keys: Sequence[BlockHash]) -> npt.NDArray[np.bool_]:
        """:meth:`may_contain` for each of ``keys``, in one vectorized filter pass (a
        per-key check costs tens of microseconds: a prompt's worth is milliseconds)."""
        return self.manifest.contains_many(keys)

    def is_staged(self, key: BlockHash) -> bool:
        """Whether ``key``'s verified bytes are in host staging."""
        return key in self.staging

    def pin_leading(self, keys: Sequence[BlockHash]) -> int:
        """Pin the leading staged run of ``keys`` (never evicted until :meth:`unpin`)."""
        return self.staging.pin_leading(keys)

    def unpin(self, keys: Sequence[BlockHash]) -> None:
        """Release pins taken by :meth:`pin_leading`."""
        self.staging.unpin(keys)

    def staged(self, key: BlockHash) -> HostBuffer | None:
        """The staged raw bytes of ``key`` (hold a pin while reading), or ``None``."""
        return self.staging.get(key)

    def staged_many(self, keys: Sequence[BlockHash]) -> list[HostBuffer | None]:
        """:meth:`staged` for each of ``keys`` (one staging lock for all of them)."""
        return self.staging.get_many(keys)

    def record_hits(self, keys: Sequence[BlockHash]) -> None:
        """Note that ``keys`` served a request (usage for prune and warm start)."""
        if keys:
            self.manifest.record_hits(list(keys))

    # --- prefetch: GET → verify → decode into staging ---

    def prefetch(self, keys: Sequence[BlockHash]) -> int:
        """Fetch ``keys`` into staging in the background, in order; returns how many queued.

        Keys already staged or being fetched are skipped; once ``max_prefetch_queue``
        fetches are outstanding the rest are dropped (counted). With codec processes the
        keys go to them in batches of :data:`_FETCH_BATCH` from one I/O task; otherwise each
        key is one I/O task.

        Raises:
            KeyDerivationError: ``keys`` is lazy and a key cannot be derived; the keys
                before it are fetched.
        """
        if self._breaker_open():
            self.metrics.inc("prefetch_skipped_unhealthy", len(keys))
            return 0
        listed: list[BlockHash] = []
        malformed: KeyDerivationError | None = None
        try:
            listed.extend(keys)  # NOTE: lazy keys are hashed here, not under the lock
        except KeyDerivationError as exc:  # NOTE: the keys before it still go
            malformed = exc
        # NOTE: staging is asked before the store's lock is taken: the engine's save hook
        # waits on that lock, and a warm start asks about thousands of keys.
        unstaged = [key for key in listed if key not in self.staging]
        chosen: list[BlockHash] = []
        dropped = 0
        with self._lock:
            if self._closed:
                return 0
            for i, key in enumerate(unstaged):
                if key in self._fetching:
                    continue
                if len(self._fetching) >= self.config.max_prefetch_queue:
                    dropped = len(unstaged) - i
                    break
                self._fetching.add(key)
                chosen.append(key)
        self.metrics.inc_many({"prefetch_scheduled": len(chosen), "prefetch_dropped": dropped})
        if chosen and self._fetch_arena() is not None:
            if not self._pool.submit(Priority.PREFETCH, functools.partial(self._fetch_all, chosen)):
                self._fetch_done_many(chosen)
        else:
            self._fetch_each(chosen)
        if malformed is not None:
            raise malformed
        return len(chosen)

    def prefetch_many(
        self, keys: Sequence[BlockHash], *, maybe_only: bool = False, hold: int | None = None
    ) -> int:
        """Hand ``keys`` to the I/O side in one step; returns how many were accepted.

        Constant work here whatever ``len(keys)``: one task is queued at prefetch priority
        and walks the keys on an I/O thread. With ``maybe_only`` it first cuts them to the
        leading run the manifest may hold (:meth:`count_maybe`); then it does what
        :meth:`prefetch` does (skip staged and in-flight keys, drop past
        ``max_prefetch_queue`` outstanding fetches, fetch in order: in batches with codec
        processes, one I/O task per key without). ``keys`` may be lazy (a
        :class:`~s3kv.keys.KeyChain` view): it is hashed there.

        Bounded: the walk keeps ``max_prefetch_queue`` fetches outstanding at most, as
        :meth:`prefetch` does, and at most 64 walks wait to start; past that ``keys`` is
        dropped whole (counted in ``prefetch_dropped``). While the store is unhealthy nothing
        is queued (``prefetch_skipped_unhealthy`` counts every key: they are not filtered
        then). Nothing becomes claimable before it is staged and verified.

        With ``hold`` (a tag: the scheduler's step) the walk waits for
        :meth:`start_held_walks` instead, outside the 64: the engine's thread hands walks over
        while it plans an iteration and starts them once the iteration's forward pass is
        queued. A walk is a few hundred microseconds of Python on an I/O thread; started at
        once, it took the GIL from the engine's thread in the middle of planning (about 1 ms of
        its first iteration, CPU emulator). Past :data:`_MAX_HELD_WALKS` held walks, all of
        them start at once (a burst of claims), within the 64 as any walk.
        """
        total = len(keys)
        if not total:
            return 0
        if self._breaker_open():
            self.metrics.inc("prefetch_skipped_unhealthy", total)
            return 0
        if hold is None:
            return total if self._start_walk(keys, maybe_only) else 0
        with self._lock:
            if self._closed:
                return 0
            self._held_walks.append((hold, keys, maybe_only))
            over = len(self._held_walks) > _MAX_HELD_WALKS
        if over:  # NOTE: a burst of claims: started now rather than dropped or piled up
            self.start_held_walks()
        return total

    def _start_walk(self, keys: Sequence[BlockHash], maybe_only: bool) -> bool:
        """Queue one walk within :data:`_MAX_WALKS`; whether it was queued."""
        with self._lock:
            if self._closed:
                return False
            full = self._walks >= _MAX_WALKS
            if not full:
                self._walks += 1
        if full:
            self.metrics.inc("prefetch_dropped", len(keys))
            return False
        walk = functools.partial(self._walk, keys, maybe_only)
        if not self._pool.submit(Priority.PREFETCH, walk):
            with self._lock:
                self._walks -= 1
            return False
        return True

    def start_held_walks(self, before: int | None = None) -> int:
        """Start the walks :meth:`prefetch_many` was asked to hold (only those held with a
        tag below ``before``, if given); returns how many were queued.

        Never raises: a walk the queue bound or a closing pool refuses is dropped (counted in
        ``prefetch_dropped`` when the bound refused it).
        """
        with self._lock:
            if before is None:
                chosen, self._held_walks = self._held_walks, []
            else:
                chosen = [w for w in self._held_walks if w[0] < before]
                self._held_walks = [w for w in self._held_walks if w[0] >= before]
        return sum(self._start_walk(keys, maybe_only) for _, keys, maybe_only in chosen)

    @property
    def held_walks(self) -> int:
        """Walks held for :meth:`start_held_walks`."""
        return len(self._held_walks)

    def _walk(self, keys: Sequence[BlockHash], maybe_only: bool) -> None:
        """The I/O side of :meth:`prefetch_many`."""
        with self._lock:
            self._walks -= 1
        try:
            if maybe_only:
                keys = keys[: self.count_maybe(keys)]
            if keys:
                self.prefetch(keys)
        except KeyDerivationError as exc:  # lazy keys over malformed tokens: no key, no GET
            self._log_once("key_derivation", "s3kv: prefetch stopped: %s", exc)

    def wait_staged(self, keys: Sequence[BlockHash], timeout: float | None = None) -> int:
        """Wait up to ``timeout`` until no key of ``keys`` is being fetched; returns the
        leading staged count.

        One event and one wake-up per call, when the last of its keys ends, however many
        there are. NOTE: an event per key woke the caller once per key: 8-13 ms of its CPU
        for 192 keys staged by 2 codec processes, against 1-2 ms (2-core host). The warm start
        waits so for thousands of keys, on the engine's interpreter.
        """
        with self._lock:
            pending = {key for key in keys if key in self._fetching}
            waiter = _Waiter(pending) if pending else None
            for key in pending:
                self._waiters.setdefault(key, []).append(waiter)  # type: ignore[arg-type]
        if waiter is not None:
            waiter.done.wait(timeout)  # NOTE: on a timeout its keys release it as they end
        return self.staging.count_leading(keys)

    def _fetch_each(self, keys: Sequence[BlockHash]) -> None:
        """One I/O task per key, fetched in that thread (:meth:`_fetch`)."""
        for i, key in enumerate(keys):
            if not self._pool.submit(Priority.PREFETCH, functools.partial(self._fetch, key)):
                self._fetch_done_many(keys[i:])  # NOTE: closed: nobody will fetch them
                return

    def _fetch(self, key: BlockHash) -> None:
        """GET, verify and decode ``key`` into staging in this thread."""
        object_key = self.object_key(key)
        try:
            if key in self.quarantine:
                self.metrics.inc("prefetch_quarantined")
                return
            stored = self.backend.get(object_key, max_bytes=self._max_object_bytes)
            if stored is None:
                self.metrics.inc("prefetch_not_found")
                return
            blob, header = open_stored(
                stored, object_key=object_key, keyring=self.keyring, block_nbytes=self.block_nbytes
            )
            buffer = self.staging.allocate(header.raw_len)
            if buffer is None:
                self.metrics.inc("prefetch_no_room")
                return
            try:
                codec.decode(blob, key=object_key, out=buffer.data, header=header)
            except CodecError:
                self.staging.release(buffer)
                raise
            self._staged([(key, buffer)], len(stored))
        except (CodecError, StorageError) as exc:
            self._fetch_failed(key, object_key, exc)
        finally:
            self._fetch_done_many([key])

    def _staged(self, filled: Sequence[tuple[BlockHash, HostBuffer]], stored_bytes: int) -> None:
        """Publish fetched, verified blocks in staging and count them."""
        self.staging.insert_many(filled)
        self.metrics.inc_many(
            {
                "prefetch_staged": len(filled),
                "stage_raw_bytes": sum(buffer.nbytes for _, buffer in filled),
                "stage_stored_bytes": stored_bytes,
            }
        )

    def _fetch_failed(
        self, key: BlockHash, object_key: str, exc: CodecError | StorageError
    ) -> None:
        if isinstance(exc, CodecError | ObjectTooLargeError):
            # NOTE: an object longer than any block of this model is junk: never read, a miss
            # like a corrupt one (the GET stopped at its Content-Length).
            self.quarantine.add(key)
            self.metrics.inc("corrupt_objects", kind=exc.kind)
            self.metrics.inc("prefetch_failed")
            self._log_failure(f"verifying {object_key}", exc)
        else:
            self.metrics.inc("prefetch_failed")
            self._log_failure("prefetch", exc)

    def _fetch_done_many(self, keys: Sequence[BlockHash]) -> None:
        """``keys`` are no longer being fetched (staged or not): wake their waiters."""
        with self._lock:
            self._fetching.difference_update(keys)
            if self._waiters:
                for key in keys:
                    for waiter in self._waiters.pop(key, ()):
                        waiter.pending.discard(key)
                        if not waiter.pending:
                            waiter.done.set()

    def _fetch_arena(self) -> SlabArena | None:
        """The staging arena, when the codec processes can decode fetched blocks into it."""
        arena = self.staging.allocator
        offload = self._offload
        if (
            offload is None
            or not isinstance(arena, SlabArena)
            or arena.slot_bytes != self.block_nbytes
            or not offload.alive
        ):
            return None
        return arena

    def _fetch_all(self, keys: Sequence[BlockHash]) -> None:
        """The I/O task of :meth:`prefetch` with codec processes: hand ``keys`` over in
        order, :data:`_FETCH_BATCH` at a time. Once no process takes them (none left alive),
        the rest become one I/O task each, fetched in this process (:meth:`_fetch_each`)."""
        for start in range(0, len(keys), _FETCH_BATCH):
            end = start + _FETCH_BATCH
            try:
                left = self._fetch_elsewhere(keys[start:end])
            except Exception:
                self._fetch_done_many(keys[start:])  # NOTE: never leave a waiter waiting
                raise
            if left:
                self._fetch_each([*left, *keys[end:]])
                return

    def _fetch_elsewhere(self, keys: Sequence[BlockHash]) -> list[BlockHash]:
        """Hand the fetches of ``keys`` to the codec processes as one batch; returns those
        no process took (none left alive), for this process to fetch.

        Each key's slot is reserved first (the processes decode into it) and belongs to its
        job until the outcome (:meth:`_fetched_many`), which inserts or releases it. Keys
        quarantined, without room, or refused by the breaker end here, counted.
        """
        arena = self._fetch_arena()
        offload = self._offload
        if arena is None or offload is None:
            return list(keys)
        wanted: list[BlockHash] = []
        quarantined: list[BlockHash] = []
        for key in keys:  # NOTE: asked once per key: a save may lift a quarantine meanwhile
            (quarantined if key in self.quarantine else wanted).append(key)
        buffers = self.staging.allocate_many(arena.slot_bytes, len(wanted))
        self.metrics.inc_many(
            {
                "prefetch_quarantined": len(quarantined),
                "prefetch_no_room": len(wanted) - len(buffers),
            }
        )
        self._fetch_done_many([*quarantined, *wanted[len(buffers) :]])
        taken = wanted[: len(buffers)]
        object_keys = [self.object_key(key) for key in taken]
        done = functools.partial(self._fetched_many, taken, object_keys, buffers)
        admitted = self.backend.admit_many("get", len(taken))
        if admitted < len(taken):
            refused = range(admitted, len(taken))
            done(refused, Outcomes.of([_NOT_ADMITTED] * len(refused)))
        try:
            jobs: list[Job] = [
                FetchJob(object_keys[i], arena.path, arena.slot_bytes, arena.slot_of(buffers[i]),
                         self._max_object_bytes)
                for i in range(admitted)
            ]  # fmt: skip
            if not jobs or offload.submit_batch(jobs, done):
                return []
        except Exception:
            # NOTE: nothing was handed over: the slots and admissions are this thread's
            done(range(admitted), Outcomes.of([_NOT_SUBMITTED] * admitted))
            raise
        self.staging.release_many(buffers[:admitted])
        for _ in jobs:
            self.backend.withdraw()
        return taken[:admitted]

    def _fetched_many(
        self,
        keys: Sequence[BlockHash],
        object_keys: Sequence[str],
        buffers: Sequence[HostBuffer],
        indices: Sequence[int],
        outcomes: Outcomes,
    ) -> None:
        """Some of a batch's fetches ended (``indices``, row by row with ``outcomes``): on the
        codec processes' reader thread, on the thread that saw a process exit (its jobs), or
        on the I/O thread (refused ones).

        In one pass: their requests recorded, the verified blocks inserted into staging
        under one lock, the rest's slots released, counters added once, the keys finished.
        """
        staged: list[int] = []  # NOTE: indices of the verified blocks
        inserted: list[int] = []
        failed: list[tuple[int, CodecError | StorageError]] = []
        not_found = stored_bytes = 0
        try:
            errors = self._record_outcomes("get", outcomes)
            for row, index in enumerate(indices):
                error = errors[row] if errors is not None else None
                if error is not None:
                    failed.append((index, _as_failure(error)))
                elif not outcomes.found[row]:
                    not_found += 1
                else:
                    staged.append(index)
                    stored_bytes += outcomes.stored_len[row]
            self._staged([(keys[i], buffers[i]) for i in staged], stored_bytes)
            inserted = staged
            if not_found:
                self.metrics.inc("prefetch_not_found", not_found)
            for index, exc in failed:
                self._fetch_failed(keys[index], object_keys[index], exc)
        finally:
            kept = set(inserted)
            self.staging.release_many([buffers[i] for i in indices if i not in kept])
            self._fetch_done_many([keys[i] for i in indices])

    def _record_outcomes(self, op: str, outcomes: Outcomes) -> list[S3KVError | None] | None:
        """Record the requests the codec processes made for ``outcomes`` (``op``: get or put)
        as if made here, and say what failed: None when nothing did (recorded in bulk: the
        usual case), else each row's error, None where it did not fail."""
        if outcomes.clean():
            if op == "get":
                self.backend.record_succeeded(
                    op, outcomes.seconds, received=sum(outcomes.stored_len)
                )
            else:  # NOTE: a refused conditional PUT (not found) sent nothing that counts
                sent = sum(itertools.compress(outcomes.stored_len, outcomes.found))
                self.backend.record_succeeded(op, outcomes.seconds, sent=sent)
            return None
        requests: list[Recorded] = []
        errors = [self._outcome_error(op, outcome, requests) for outcome in outcomes.rows()]
        self.backend.record_many(op, requests)
        return errors

    def _outcome_error(
        self, op: str, outcome: Outcome, requests: list[Recorded]
    ) -> S3KVError | None:
        """What failed in a codec process's job (its request first, then its codec), if
        anything. A request it made goes to ``requests`` (for ``record_many``); an admitted
        one it never made is withdrawn; one the breaker refused was never admitted."""
        error = outcome.request_error.rebuild() if outcome.request_error is not None else None
        if outcome.requested:
            storage_error = error if isinstance(error, StorageError) else None
            size = outcome.stored_len if error is None and (op == "get" or outcome.found) else 0
            received, sent = (size, 0) if op == "get" else (0, size)
            requests.append(Recorded(outcome.seconds, storage_error, received, sent))
        elif outcome.job_id != _NOT_ADMITTED.job_id:  # NOTE: admitted, never made
            self.backend.withdraw()
        if error is None and outcome.codec_error is not None:
            error = outcome.codec_error.rebuild()
        return error

    # --- save: encode → PUT → manifest ---

    def save(
        self,
        key: BlockHash,
        parent: BlockHash,
        data: HostBuffer | bytes | memoryview,
        *,
        dtype: codec.DType | str,
        shape: tuple[int, ...],
        on_consumed: Callable[[], None] | None = None,
        checked: bool = False,
    ) -> SaveStatus:
        """Write one block in the background, once.

        Args:
            key: The block's hash.
            parent: Its chain parent (``ROOT_HASH`` for a first block); kept in the manifest
                so warm start can rebuild chains.
            data: Raw block bytes; must stay unmodified until ``on_consumed`` is called.
            dtype: Element dtype of ``data``.
            shape: Logical shape (recorded in the object header).
            on_consumed: Called (from a pool thread) once ``data`` is no longer needed; also
                called at once when the save is skipped or dropped.
            checked: The caller already asked the manifest about ``key`` (in bulk, with
                :meth:`contains_many`): do not ask again per block on the caller's thread.

        Returns:
            What happened; never raises for storage trouble.
        """
        nbytes = _nbytes(data)
        status = self._admit_save(key, nbytes, checked)
        if status is not SaveStatus.QUEUED:
            if on_consumed is not None:
                on_consumed()
            return status
        self.metrics.inc("save_submitted")
        dtype_enum = codec.DType(dtype)
        if self._offload is not None and self._write_elsewhere(
            key, parent, data, dtype_enum, shape, nbytes, on_consumed
        ):
            return SaveStatus.QUEUED

        def task() -> None:
            self._write(key, parent, data, dtype_enum, shape, nbytes, on_consumed)

        if not self._pool.submit(Priority.SAVE, task):
            self._finish_save(key, nbytes)
            if on_consumed is not None:
                on_consumed()
            return SaveStatus.DROPPED
        return SaveStatus.QUEUED

    def _admit_save(self, key: BlockHash, nbytes: int, checked: bool) -> SaveStatus:
        return self._admit_saves([(key, nbytes)], checked)[0]

    def _admit_saves(
        self, saves: Sequence[tuple[BlockHash, int]], checked: bool
    ) -> list[SaveStatus]:
        """Admit ``(key, raw bytes)`` saves in order: one filter pass, one lock."""
        if self._breaker_open():
            self.metrics.inc("save_dropped_unhealthy", len(saves))
            return [SaveStatus.DROPPED] * len(saves)
        # NOTE: a quarantined key's object failed verification here: the save rewrites it
        # (below, unconditionally) instead of trusting that "it is already there". Asked
        # outside the lock: the filter is the slow part.
        if checked:
            present = [False] * len(saves)
        elif len(saves) == 1:
            present = [self.manifest.may_contain(saves[0][0])]
        else:
            present = [bool(x) for x in self.manifest.contains_many([k for k, _ in saves])]
        statuses: list[SaveStatus] = []
        skipped = dropped = 0
        limit = self.config.max_inflight_save_bytes
        with self._lock:
            for (key, nbytes), exists in zip(saves, present, strict=True):
                if self._closed:
                    statuses.append(SaveStatus.DROPPED)
                    continue
                if key in self._saving or (exists and key not in self.quarantine):
                    skipped += 1
                    statuses.append(SaveStatus.SKIPPED)
                    continue
                if self._inflight_save_bytes + nbytes > limit and self._inflight_save_bytes > 0:
                    room = functools.partial(self._room_for, nbytes, limit)
                    if self.config.save_policy == "drop" or not self._save_space.wait_for(
                        room, timeout=self.config.save_block_timeout
                    ):
                        dropped += 1
                        statuses.append(SaveStatus.DROPPED)
                        continue
                    if self._closed:
                        statuses.append(SaveStatus.DROPPED)
                        continue
                self._saving.add(key)
                self._inflight_save_bytes += nbytes
                statuses.append(SaveStatus.QUEUED)
            self.metrics.set("inflight_save_bytes", self._inflight_save_bytes)
        self.metrics.inc_many({"save_skipped_existing": skipped, "save_dropped": dropped})
        return statuses

    def _room_for(self, nbytes: int, limit: int) -> bool:
        """Under the lock: ``nbytes`` more fit in flight (or the store is closing)."""
        return self._inflight_save_bytes + nbytes <= limit or self._closed

    def _write(
        self,
        key: BlockHash,
        parent: BlockHash,
        data: HostBuffer | bytes | memoryview,
        dtype: codec.DType,
        shape: tuple[int, ...],
        nbytes: int,
        on_consumed: Callable[[], None] | None,
    ) -> None:
        object_key = self.object_key(key)
        written = False
        try:
            try:
                blob: bytes | memoryview = codec.encode_view(
                    data,
                    key=object_key,
                    dtype=dtype,
                    shape=shape,
                    codec=self._codec,
                    level=self.config.compression_level,
                )
            finally:
                if on_consumed is not None:
                    on_consumed()
            if self.keyring is not None:
                blob = seal(blob, object_key=object_key, keyring=self.keyring)
            rewrite = key in self.quarantine
            conditional = self.backend.capabilities.conditional_put and not rewrite
            written = self.backend.put(object_key, blob, if_absent=conditional)
            self._saved(key, parent, nbytes, len(blob), written=written, rewrite=rewrite)
        except (StorageError, CodecError) as exc:
            self.metrics.inc("save_failed")
            self._log_failure("save", exc)
        finally:
            self._finish_save(key, nbytes)

    def _saved(
        self,
        key: BlockHash,
        parent: BlockHash,
        nbytes: int,
        stored_len: int,
        *,
        written: bool,
        rewrite: bool,
    ) -> None:
        if rewrite:
            self.quarantine.discard(key)
            self.metrics.inc("save_rewrote_quarantined")
        # A refused conditional PUT means another instance wrote the same bytes: the key
        # exists either way, so the manifest records it as written.
        self.manifest.record_write(key, parent, stored_len)
        if written:
            self.metrics.inc("save_completed")
            self.metrics.inc("save_raw_bytes", nbytes)
            self.metrics.inc("save_stored_bytes", stored_len)
        else:
            self.metrics.inc("save_skipped_existing")

    def _write_elsewhere(
        self,
        key: BlockHash,
        parent: BlockHash,
        data: HostBuffer | bytes | memoryview,
        dtype: codec.DType,
        shape: tuple[int, ...],
        nbytes: int,
        on_consumed: Callable[[], None] | None,
    ) -> bool:
        """Hand an admitted save to a codec process; ``False`` when the pool must do it.

        Only a block in one of the store's arenas can go (the process reads it there).
        """
        offload = self._offload
        located = self._locate(data)
        if offload is None or located is None or not offload.alive:
            return False
        batch = _SaveBatch([key], [parent], [on_consumed], nbytes)
        arena, slot = located
        return self._hand_over(offload, batch, arena, [slot], dtype, shape, fall_back=True)

    def save_many(
        self,
        blocks: Sequence[tuple[BlockHash, BlockHash, HostBuffer, Callable[[], None] | None]],
        *,
        dtype: codec.DType | str,
        shape: tuple[int, ...],
        checked: bool = False,
    ) -> list[SaveStatus]:
        """:meth:`save` for ``(key, parent, data, on_consumed)`` blocks of one dtype and shape.

        The same contract per block. Blocks in the store's arenas go to the codec processes
        as one batch: admitted under one lock, handed over with one wake-up, and their
        outcomes handled a message at a time (:meth:`_saves_done`), so the engine's
        interpreter pays per batch, not per block, for most of the bookkeeping. Without codec
        processes the batch goes to the I/O threads at once (:meth:`_save_many_here`). Under
        ``save_policy=block`` the blocks go one at a time, as :meth:`save`.

        Raises:
            Exception: the first failure to hand a group (an arena and block size) over to
                the codec processes, after every group went or had its saves failed.
        """
        offload = self._offload
        # NOTE: under block, one by one: a block waiting for room gets it as the ones before
        # it are written; admitted together, it could only wait for older saves, then drop.
        if self.config.save_policy == "block" or (offload is not None and not offload.alive):
            return [
                self.save(k, p, d, dtype=dtype, shape=shape, on_consumed=c, checked=checked)
                for k, p, d, c in blocks
            ]
        if offload is None:
            return self._save_many_here(blocks, codec.DType(dtype), shape, checked)
        statuses: list[SaveStatus] = [SaveStatus.DROPPED] * len(blocks)
        here: list[int] = []
        located: list[tuple[SlabArena, int]] = []
        for i, (key, parent, data, on_consumed) in enumerate(blocks):
            where = self._locate(data)
            if where is None:
                statuses[i] = self.save(
                    key, parent, data, dtype=dtype, shape=shape, on_consumed=on_consumed,
                    checked=checked,
                )  # fmt: skip
            else:
                here.append(i)
                located.append(where)
        if not here:
            return statuses
        admitted = self._admit_saves([(blocks[i][0], blocks[i][2].nbytes) for i in here], checked)
        # NOTE: one batch per arena and block size (a worker's blocks: one of each)
        batches: dict[tuple[int, int], tuple[SlabArena, _SaveBatch, list[int]]] = {}
        for i, (arena, slot), status in zip(here, located, admitted, strict=True):
            key, parent, data, on_consumed = blocks[i]
            statuses[i] = status
            if status is not SaveStatus.QUEUED:
                if on_consumed is not None:
                    on_consumed()
                continue
            group = batches.get((id(arena), data.nbytes))
            if group is None:
                group = (arena, _SaveBatch([], [], [], data.nbytes), [])
                batches[(id(arena), data.nbytes)] = group
            group[1].append(key, parent, on_consumed)
            group[2].append(slot)
        self.metrics.inc("save_submitted", sum(s is SaveStatus.QUEUED for s in admitted))
        failure: Exception | None = None
        for arena, batch, slots in batches.values():
            try:
                self._hand_over(
                    offload, batch, arena, slots, codec.DType(dtype), shape, fall_back=False
                )
            except Exception as exc:  # NOTE: that group's saves ended; the others still go
                failure = failure or exc
        if failure is not None:
            raise failure
        return statuses

    def _save_many_here(
        self,
        blocks: Sequence[tuple[BlockHash, BlockHash, HostBuffer, Callable[[], None] | None]],
        dtype: codec.DType,
        shape: tuple[int, ...],
        checked: bool,
    ) -> list[SaveStatus]:
        """:meth:`save_many` on the I/O threads: admitted under one lock, queued at once."""
        sizes = [_nbytes(data) for _, _, data, _ in blocks]
        statuses = self._admit_saves(
            [(b[0], n) for b, n in zip(blocks, sizes, strict=True)], checked
        )
        tasks: list[Callable[[], None]] = []
        queued: list[int] = []
        for i, ((key, parent, data, on_consumed), status) in enumerate(
            zip(blocks, statuses, strict=True)
        ):
            if status is not SaveStatus.QUEUED:
                if on_consumed is not None:
                    on_consumed()
                continue
            queued.append(i)
            tasks.append(
                functools.partial(
                    self._write, key, parent, data, dtype, shape, sizes[i], on_consumed
                )
            )  # fmt: skip
        if not tasks:
            return statuses
        self.metrics.inc("save_submitted", len(tasks))
        if not self._pool.submit_many(Priority.SAVE, tasks):
            for i in queued:  # NOTE: the pool is shut down: as save() does, one by one
                key, _, _, on_consumed = blocks[i]
                self._finish_save(key, sizes[i])
                if on_consumed is not None:
                    on_consumed()
                statuses[i] = SaveStatus.DROPPED
        return statuses

    def _hand_over(
        self,
        offload: CodecProcesses,
        batch: _SaveBatch,
        arena: SlabArena,
        slots: Sequence[int],
        dtype: codec.DType,
        shape: tuple[int, ...],
        *,
        fall_back: bool,
    ) -> bool:
        """Submit admitted saves, in ``slots`` of ``arena``, to the codec processes as one
        :class:`~s3kv.offload.jobs.SaveJobs`; ``False`` only with ``fall_back``, when none of
        them was taken (the caller then writes them itself).

        Saves the breaker refuses are failed here (counted, finished, consumed); without
        ``fall_back`` so are those no process took.

        Raises:
            Exception: whatever building or submitting the jobs raised, after failing the
                admitted saves as above (nothing of them is left in flight).
        """
        count = len(batch.keys)
        admitted = self.backend.admit_many("put", count)
        if admitted < count:
            refused = range(admitted, count)
            self._saves_done(batch, refused, Outcomes.of([_NOT_ADMITTED] * len(refused)))
            if not admitted:
                return True
        keys = batch.keys[:admitted]
        try:
            quarantined = self.quarantine.among(keys)
            batch.rewrite = (
                [key in quarantined for key in keys] if quarantined else [False] * admitted
            )
            conditional = self.backend.capabilities.conditional_put
            jobs = SaveJobs(
                arena.path, arena.slot_bytes, batch.nbytes, dtype.value, shape,
                int(self._codec), self.config.compression_level,
                block_object_keys(self.config.key_prefix, self.fingerprint, keys),
                list(slots[:admitted]), [conditional and not rewrite for rewrite in batch.rewrite],
            )  # fmt: skip
            if offload.submit_batch(jobs, functools.partial(self._saves_done, batch)):
                return True
        except Exception:
            # NOTE: nothing was handed over (submit_batch is all or nothing): the keys, the
            # in-flight bytes, the buffers and the admissions are this thread's to end.
            self._saves_done(batch, range(admitted), Outcomes.of([_NOT_SUBMITTED] * admitted))
            raise
        if fall_back:
            for _ in range(admitted):
                self.backend.withdraw()
            return False
        # NOTE: no process left: fail them as a dead process would (withdrawn there)
        self._saves_done(batch, range(admitted), Outcomes.of([_NOT_SUBMITTED] * admitted))
        return True

    def _saves_done(self, batch: _SaveBatch, indices: Sequence[int], outcomes: Outcomes) -> None:
        """Some of a batch's saves ended (``indices``, row by row with ``outcomes``): on a
        codec process's reader thread, or here.

        In one pass, column by column (this runs on the engine's interpreter): their buffers
        handed back, their requests recorded, the written keys recorded in the manifest with
        one lock, counters added once, the keys finished.
        """
        try:
            for index in indices:
                consumed = batch.consumed[index]
                if consumed is not None:
                    try:
                        consumed()
                    except Exception:  # NOTE: the others' buffers and the booking go on
                        logger.exception("s3kv: returning a saved block's buffer failed")
            errors = self._record_outcomes("put", outcomes)
            rows: Sequence[int] = range(len(indices))
            if errors is not None:
                rows = [row for row, error in enumerate(errors) if error is None]
                for error in errors:
                    if error is not None:
                        self._log_failure("save", _as_failure(error))
            written = [indices[row] for row in rows]
            rewrites = [i for i in written if i < len(batch.rewrite) and batch.rewrite[i]]
            for index in rewrites:
                self.quarantine.discard(batch.keys[index])
            # NOTE: a refused conditional PUT (not found) means another instance wrote the
            # same bytes: the key exists either way, so the manifest records it as written.
            keys, parents, stored_len = batch.keys, batch.parents, outcomes.stored_len
            if written:
                self.manifest.record_writes(
                    [
                        (keys[i], parents[i], stored_len[r])
                        for i, r in zip(written, rows, strict=True)
                    ]
                )
            found = [outcomes.found[row] for row in rows]
            completed = sum(found)
            self.metrics.inc_many(
                {
                    "save_completed": completed,
                    "save_raw_bytes": completed * batch.nbytes,
                    "save_stored_bytes": sum(itertools.compress(
                        [stored_len[row] for row in rows], found)),
                    "save_skipped_existing": len(rows) - completed,
                    "save_failed": len(indices) - len(rows),
                    "save_rewrote_quarantined": len(rewrites),
                }
            )  # fmt: skip
        finally:
            self._finish_saves([batch.keys[i] for i in indices], batch.nbytes)

    def _locate(self, data: object) -> tuple[SlabArena, int] | None:
        """The arena and slot ``data`` is (exactly one whole slot), if it is one.

        A view found once is answered from a table after: a view always shows the same
        bytes, and the worker hands over the same view of each of its buffers every time
        (asking the arena cost the hand-off of a prompt's 256 blocks 0.7 ms).
        """
        if not isinstance(data, np.ndarray) or not self._arenas:
            return None
        known = self._located.get(id(data))
        if known is not None and known[0] is data:
            return known[1], known[2]
        for arena in reversed(self._arenas):  # NOTE: save arenas first: saves ask this
            slot = arena.slot_at(data)
            if slot is not None:
                if len(self._located) >= _LOCATED_VIEWS:  # NOTE: callers making new views
                    self._located.clear()
                if not self._closed:  # NOTE: close() cleared it; no view may pin an arena
                    self._located[id(data)] = (data, arena, slot)  # NOTE: alive: id unique
                return arena, slot
        return None

    def save_arena(self, slot_bytes: int, budget_bytes: int) -> SlabArena | None:
        """Shared memory for blocks to be saved, which codec processes read in place.

        ``None`` without codec processes (plain or pinned buffers then serve as well). The
        store owns the arena: it is closed with the store, after the last save.
        """
        if self._offload is None:
            return None
        try:
            arena = SlabArena.create(slot_bytes, budget_bytes, tag="save-")
        except S3KVError as exc:
            logger.warning("s3kv: %s; saves are encoded in the I/O threads", exc)
            return None
        with self._lock:
            self._arenas.append(arena)
            self._own_arenas.append(arena)
        return arena

    def _finish_save(self, key: BlockHash, nbytes: int) -> None:
        self._finish_saves([key], nbytes)

    def _finish_saves(self, keys: Sequence[BlockHash], nbytes: int) -> None:
        """Saves of ``keys`` (``nbytes`` raw bytes each) no longer in flight."""
        with self._lock:
            self._saving.difference_update(keys)
            self._inflight_save_bytes -= nbytes * len(keys)
            self.metrics.set("inflight_save_bytes", self._inflight_save_bytes)
            self._save_space.notify_all()

    def _log_failure(self, what: str, exc: StorageError | CodecError) -> None:
        """Log a background failure: WARNING the first time of each kind, then DEBUG."""
        self._log_once(exc.kind, "s3kv: %s failed (%s): %s", what, exc.kind, exc)

    # --- lifecycle ---

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued saves, then write the manifest segment; ``True`` if all done."""
        with self._lock:
            drained = self._save_space.wait_for(
                lambda: self._inflight_save_bytes == 0, timeout=timeout
            )
        self.manifest.flush()
        return drained

    def close(self, timeout: float | None = None) -> bool:
        """Drain saves within ``timeout`` (default ``close_timeout``), flush, stop threads.

        Saves still running at the deadline are abandoned (counted as never completed).
        Returns ``True`` if everything drained in time. Idempotent.
        """
        with self._lock:
            if self._closed:
                return True
        deadline = time.monotonic() + (self.config.close_timeout if timeout is None else timeout)
        drained = self.flush(timeout=max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._closed = True
            self._held_walks = []  # NOTE: never started now; they hold requests' keys
            self._save_space.notify_all()
        pool_done = self._pool.shutdown(timeout=max(0.0, deadline - time.monotonic()))
        if self._offload is not None:
            pool_done = self._offload.close(max(0.0, deadline - time.monotonic())) and pool_done
        # NOTE: nothing stages any more: release what is staged now (pinned blocks stay, a
        # load may still read them), so that closing the arenas unmaps them at once.
        pinned = self.staging.drop_unpinned()
        self._located.clear()  # NOTE: its views would keep the arenas mapped
        for arena in self._own_arenas:
            if pinned and arena is self.staging.allocator:
                continue  # NOTE: stays mapped and page-locked while a device copy may read it
            arena.close()  # NOTE: the memory lives on while staged views still use it
        self.manifest.close(flush=True, timeout=max(0.0, deadline - time.monotonic()))
        with self._lock:
            exports, self._exports = self._exports, []
        for export in exports:
            export.close()
        if not (drained and pool_done):
            logger.warning("s3kv: close deadline passed with saves still in flight")
        return drained and pool_done

    def stats(self) -> dict[str, float]:
        """Every counter and gauge, plus the manifest's, keyed by name."""
        values = self.metrics.snapshot()
        for name, value in self.manifest.stats().items():
            values[f"manifest_{name}"] = value
        return values

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "KVStore",
    "LookupResult",
    "ManifestLike",
    "ManifestSource",
    "SaveStatus",
    "open_manifest",
]


def _finish_open(
    access: BucketAccess,
    backend: InstrumentedBackend,
    config: S3KVConfig,
    identity: ModelIdentity,
    source: ManifestSource | None,
    start_background: bool,
) -> ManifestLike:
    """:meth:`KVStore.open`'s steps once the bucket answers: probe, check, identity object,
    manifest (this fingerprint's own, started if ``start_background``, or ``source``'s).

    Raises:
        StorageError: the bucket failed.
    """
    import json

    access.connect(backend)
    backend.check()
    identity_key = identity_object_key(config.key_prefix, identity.fingerprint())
    if backend.head(identity_key) is None:
        payload = json.dumps(identity.as_dict(), indent=2, sort_keys=True).encode()
        backend.put(identity_key, payload, if_absent=True)
    access.close()
    if source is not None:
        return source.open(backend)
    own = open_manifest(backend, config, identity.fingerprint())
    if start_background:
        own.start(
            refresh_interval=config.manifest_refresh_interval,
            flush_interval=config.manifest_flush_interval,
            flush_keys=config.manifest_flush_keys,
        )
    return own


def _as_failure(error: S3KVError) -> CodecError | StorageError:
    """A codec process's failure as a kind the store counts and logs (an error of another
    kind is a failed request: a fetch's slot is never inserted, a save is not recorded)."""
    if isinstance(error, CodecError | StorageError):
        return error
    return StorageError(str(error))


#: Views of arena slots :meth:`KVStore._locate` remembers before starting over (a worker's
#: buffers are a few thousand at most).
_LOCATED_VIEWS = 8192

#: The outcome of a job no codec process accepted (none alive, or it could not be sent).
_NOT_SUBMITTED = Outcome(
    -2, False, 0.0, Failure("StorageError", "no codec process is running", "codec"), False, 0, None
)
#: The outcome of a save or fetch the circuit breaker refused (job id -1: nothing to
#: withdraw).
_NOT_ADMITTED = Outcome(
    -1, False, 0.0,
    Failure("CircuitOpenError", "s3kv: object store marked unhealthy; skipping the request",
            "circuit_open"),
    False, 0, None,
)  # fmt: skip


@dataclass(eq=False)
class _SaveBatch:
    """Admitted saves of one arena and size handed to the codec processes together, by
    index."""

    keys: list[BlockHash]
    parents: list[BlockHash]
    consumed: list[Callable[[], None] | None]
    nbytes: int
    rewrite: list[bool] = field(default_factory=list)  # NOTE: per admitted job

    def append(
        self, key: BlockHash, parent: BlockHash, consumed: Callable[[], None] | None
    ) -> None:
        self.keys.append(key)
        self.parents.append(parent)
        self.consumed.append(consumed)


def _nbytes(data: HostBuffer | bytes | memoryview) -> int:
    """Raw bytes of a block handed to :meth:`KVStore.save`."""
    return data.nbytes if isinstance(data, np.ndarray) else len(memoryview(data).cast("B"))


def _start_codec_processes(
    config: S3KVConfig,
    keyring: Keyring | None,
    block_nbytes: int | None,
    *,
    injected: bool,
    allocator: HostAllocator | None,
    placement: Placement | None,
) -> tuple[CodecProcesses | None, SlabArena | None]:
    """The codec processes ``codec_processes`` asks for, and a staging arena when the caller
    gave no allocator; ``(None, None)`` with one WARNING when they cannot work here."""
    processes = _codec_processes(config)
    if not processes:
        return None, None
    if injected or block_nbytes is None:
        # NOTE: the processes open the bucket from the settings, and fill fixed-size slots.
        logger.warning(
            "s3kv: codec_processes: %s; doing the codec in the I/O threads",
            "the store was given its backend" if injected else "the block size is unknown",
        )
        return None, None
    arena: SlabArena | None = None
    try:
        if allocator is None:
            arena = SlabArena.create(block_nbytes, config.staging_bytes, tag="staging-")
        offload = CodecProcesses(
            config,
            processes=processes,
            threads=config.io_concurrency(processes) // processes,
            keyring=keyring,
            cpus=placement.cpus if placement is not None else None,
        )
    except (OSError, S3KVError) as exc:
        logger.warning(
            "s3kv: codec_processes: cannot start them (%s); doing the codec in the I/O threads",
            exc,
        )
        if arena is not None:
            arena.close()
        return None, None
    if placement is not None:
        log_placement(placement, processes)
    return offload, arena


def _codec_processes(config: S3KVConfig) -> int:
    """The codec processes a store of ``config`` runs: ``auto`` is the connector's to decide
    (:mod:`s3kv.offload.sizing`, for a KV cache on a GPU); a store opened elsewhere with it
    runs none."""
    return config.codec_processes if isinstance(config.codec_processes, int) else 0


def _discard_manifest(manifest: ManifestLike) -> None:
    """A manifest that opened after its store was closed."""
    manifest.close(flush=False, timeout=0.0)


def open_manifest(backend: Backend, config: S3KVConfig, fingerprint: str) -> Manifest:
    """The live manifest of ``fingerprint`` with ``config``'s settings, loaded (not started).

    Compaction takes part in the election only where the server honours conditional PUT
    (the lease and the fencing rest on it); elsewhere it is off, said once in the log.
    """
    compaction = None
    if config.manifest_compaction == "auto":
        if backend.capabilities.conditional_put:
            compaction = CompactionPolicy(
                interval_s=config.manifest_compaction_interval, lease_s=config.manifest_lease
            )
        else:
            logger.warning(
                "s3kv: %s does not honour conditional PUT; manifest compaction is off "
                "(run `s3kv compact` on a schedule instead)",
                backend.description,
            )
    return Manifest.open(
        backend,
        config.key_prefix,
        fingerprint,
        capacity=config.bloom_capacity,
        fpr=config.bloom_fpr,
        instance_id=config.instance_id or None,
        compaction=compaction,
        hit_interval=config.manifest_hit_interval,
        open_timeout=config.manifest_open_timeout,
    )
