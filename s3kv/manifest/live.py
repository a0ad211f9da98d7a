"""The live manifest of one model fingerprint: which block keys exist, and their usage.

Every instance answers "may this key be in the bucket?" from memory
(:class:`~s3kv.manifest.filters.KeyFilter`), loaded from the manifest log
(:mod:`s3kv.manifest.log`) and kept current by the instance's background thread:

* **Startup** reads the ``LATEST`` hint, the entry it names (plus one probe for a newer
  one), the snapshot's shard filters and the entry's deltas in parallel: ``3 + shards +
  deltas`` requests (``max_deltas`` bounds the deltas), at any age and fleet size. It never
  blocks the caller past ``open_timeout``: the load goes on in the background and lookups
  miss until it is done (a claim needs staged bytes anyway, so a miss is only a recompute).
* **Refresh** GETs the next entry (absent: nothing changed; one request whatever the
  number of writers), then the deltas it adds and, after a new snapshot, its shard filters.
* **Flush** appends this instance's records as one immutable segment (writes, pins at
  once; hits coalesced and written at most once per ``hit_interval``).
* **Compaction** (:mod:`s3kv.manifest.compactor`) runs on the one instance holding the
  lease: it folds every writer's segments into deltas and snapshots. Every instance takes
  the lease over when the holder stops publishing for ``lease_s``.

A bucket with no log yet (a new bucket, format 1, or a server without conditional PUT where
nothing can be elected) is read the format-1 way, listing and reading every segment, until
a log exists.

Failure policy: lookups never touch the network. Storage errors during flush, refresh and
compaction are counted and logged once per kind, never raised; corrupt objects are skipped
and counted. Everything held in memory is bounded (:meth:`Manifest.start`).
"""

from __future__ import annotations

import logging
import random
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Final, TypeGuard

import numpy as np
import numpy.typing as npt

from s3kv._logonce import LogOnce
from s3kv.errors import CodecError, ConfigError, StorageError
from s3kv.keys import HASH_BYTES, BlockHash
from s3kv.manifest.compactor import CompactionPolicy, Compactor, legacy_usage
from s3kv.manifest.filters import KeyFilter
from s3kv.manifest.format import (
    KIND_PIN,
    KIND_UNPIN,
    KIND_WRITE,
    UNKNOWN_PARENT,
    Records,
    valid_instance_id,
)
from s3kv.manifest.io import Fault, ManifestIO, SegmentWriter
from s3kv.manifest.log import DeltaRef, LogEntry, ManifestLog
from s3kv.manifest.queue import RecordQueue
from s3kv.manifest.retry import RetryBook
from s3kv.manifest.snapshot import delta_write_keys, parallel, read_filters
from s3kv.storage import Backend

__all__ = ["Manifest"]

logger = logging.getLogger(__name__)

#: Default early-flush threshold until :meth:`Manifest.start` sets it.
_DEFAULT_FLUSH_KEYS: Final = 4096
#: Pending records are bounded to this many flushes' worth.
_PENDING_FACTOR: Final = 8
#: Entries a refresh applies one by one before it jumps to the newest.
_CATCH_UP: Final = 4
#: The first growth partition is sized from the snapshot, up to this many keys.
_MAX_GROWTH: Final = 1 << 24
#: Segment names remembered in format-1 mode (names seen are skipped).
_MAX_SEEN: Final = 1_000_000
#: Newest log entries tried when the one applied names objects that are gone.
_WALK_BACK: Final = 8

_COUNTERS: Final = (
    "segments_written",
    "segments_read",
    "segments_corrupt",
    "records_flushed",
    "records_dropped",
    "flush_errors",
    "refresh_errors",
    "refreshes",
    "reloads",
    "deltas_read",
    "snapshots_corrupt",
    "thread_errors",
    "compaction_cycles",
    "compaction_errors",
    "takeovers",
    "fenced",
)


def _is_records(got: Records | Fault | None) -> TypeGuard[Records]:
    return got is not None and not isinstance(got, Fault)


def _check_keys(keys: Sequence[bytes]) -> None:
    for key in keys:
        if len(key) != HASH_BYTES:
            raise ValueError(f"keys: every key must be {HASH_BYTES} bytes, got {len(key)}")


class Manifest:
    """The live manifest of one fingerprint: a key filter plus a queue of new records.

    Create it with :meth:`open`. Lookups (:meth:`may_contain`, :meth:`count_leading`) are
    lock-free and never touch the network; ``record_*`` only append to memory; the network
    is used by :meth:`flush`, :meth:`refresh` and the compactor, which the background
    threads of :meth:`start` drive. Thread-safe.

    Memory: the snapshot filters (3.7 bytes per key at the default rate), the growth
    partitions (about 4.2 bytes per key added since the previous snapshot), at most
    ``8 × flush_keys`` pending records (~250 bytes each), and on the compactor instance one
    cycle's records plus the deltas' (bounded by ``CompactionPolicy.snapshot_cap``).
    """

    def __init__(
        self,
        backend: Backend,
        prefix: str,
        fingerprint: str,
        *,
        capacity: int,
        fpr: float,
        instance_id: str | None = None,
        clock: Callable[[], float] = time.time,
        grace_s: float = 600.0,
        compaction: CompactionPolicy | None = None,
        hit_interval: float = 600.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        instance = instance_id or secrets.token_hex(4)
        if not valid_instance_id(instance):
            raise ConfigError(f"instance_id: must be 1-64 of [A-Za-z0-9._-], got {instance!r}")
        if grace_s < 0:
            raise ConfigError(f"grace_s: must be >= 0, got {grace_s}")
        self.instance_id = instance
        self._io = ManifestIO(backend, prefix, fingerprint)
        self._log = ManifestLog(self._io)
        self._writer = SegmentWriter(self._io, instance, clock)
        self._capacity, self._fpr = capacity, fpr
        self._clock = clock
        self._monotonic = monotonic
        self._hit_interval = hit_interval
        self._filter = KeyFilter(fpr, growth_capacity=capacity)
        self._entry: LogEntry | None = None
        self._entry_seen_at = self._monotonic()
        self._loaded_deltas: set[str] = set()
        self._no_log = False  # the log was read and is empty (not merely unreadable)
        self._seen: set[str] = set()  # format-1 mode: segment names read
        # NOTE: segments (format-1 mode) or deltas that could not be read: read again later.
        self._unread = RetryBook()
        self._compactor: Compactor | None = None
        if compaction is not None:
            policy = CompactionPolicy(**{**vars(compaction), "fpr": fpr, "grace_s": grace_s})
            self._compactor = Compactor(
                self._io,
                instance,
                policy,
                clock=clock,
                monotonic=monotonic,
                legacy_usage=lambda: legacy_usage(self._io),
            )
        self._jitter = random.uniform(0.0, 0.25)  # NOTE: spreads simultaneous takeovers
        self._lock = threading.Lock()  # pending records, counters
        self._flush_lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._compact_lock = threading.Lock()  # the Compactor is driven by one caller at a time
        self._queue = RecordQueue(_PENDING_FACTOR * _DEFAULT_FLUSH_KEYS)
        self._inflight: list[bytes] = []  # write keys of the flush in progress
        self._flush_keys = _DEFAULT_FLUSH_KEYS
        self._flush_failing = False
        self._counters: Counter[str] = Counter()
        self._log_once = LogOnce(logger)
        self._open_requests = 0
        self._loaded = threading.Event()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []

    @classmethod
    def open(
        cls,
        backend: Backend,
        prefix: str,
        fingerprint: str,
        *,
        capacity: int,
        fpr: float,
        instance_id: str | None = None,
        clock: Callable[[], float] = time.time,
        grace_s: float = 600.0,
        compaction: CompactionPolicy | None = None,
        hit_interval: float = 600.0,
        open_timeout: float | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> Manifest:
        """Load the manifest (see the module docstring for the requests), within a bound.

        Never raises :class:`StorageError`: if the bucket fails, the manifest starts empty
        (lookups miss) and the next :meth:`refresh` retries. If loading takes longer than
        ``open_timeout`` seconds (``None``: wait), it returns at once and the load finishes
        in the background (:attr:`loaded` says when).

        Args:
            backend: The bucket.
            prefix: The configured key prefix.
            fingerprint: The model fingerprint.
            capacity: Keys of the first growth partition (the filter grows past it).
            fpr: Target false-positive rate of the whole filter.
            instance_id: Name of this instance in segment names; random if ``None``/empty.
            clock: Epoch seconds (injectable for tests).
            grace_s: Tolerated clock skew, and how long obsolete objects outlive their use.
            compaction: Take part in compactor election (``None``: never compact).
            hit_interval: Hits alone are flushed at most this often (seconds).
            open_timeout: Longest :meth:`open` waits for the load.
            monotonic: Seconds for intervals (lease expiry); injectable for simulations.

        Raises:
            ConfigError: invalid ``instance_id`` or ``grace_s``.
        """
        manifest = cls(
            backend,
            prefix,
            fingerprint,
            capacity=capacity,
            fpr=fpr,
            instance_id=instance_id,
            clock=clock,
            grace_s=grace_s,
            compaction=compaction,
            hit_interval=hit_interval,
            monotonic=monotonic,
        )
        if open_timeout is None:
            manifest._first_load()
        else:
            loader = threading.Thread(
                target=manifest._first_load, name="s3kv-manifest-open", daemon=True
            )
            loader.start()
            loader.join(max(0.0, open_timeout))
            if loader.is_alive():
                logger.warning(
                    "s3kv manifest: still loading after %.1f s; serving meanwhile (misses "
                    "until it is done)",
                    open_timeout,
                )
        return manifest

    def _first_load(self) -> None:
        try:
            self.refresh()
        finally:
            self._open_requests = self._io.requests
            self._loaded.set()

    # --- lookups: memory only -------------------------------------------------------------

    def may_contain(self, key: bytes) -> bool:
        """Whether ``key`` may exist in the bucket (false positives at ~fpr). No network."""
        return key in self._filter

    def count_leading(self, keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` that may exist. No network."""
        return self._filter.count_leading(keys)

    def contains_many(self, keys: Sequence[bytes]) -> npt.NDArray[np.bool_]:
        """Whether each of ``keys`` may exist (one vectorized pass). No network."""
        return self._filter.contains_many(keys)

    @property
    def loaded(self) -> bool:
        """Whether the first load finished (lookups miss everything before it)."""
        return self._loaded.is_set()

    @property
    def open_requests(self) -> int:
        """Requests the first load issued."""
        return self._open_requests

    @property
    def generation(self) -> int:
        """Snapshot generation loaded (0: none)."""
        entry = self._entry
        return entry.snapshot.generation if entry is not None and entry.snapshot else 0

    @property
    def version(self) -> int:
        """Log version applied (0: none)."""
        entry = self._entry
        return 0 if entry is None else entry.version

    @property
    def is_compactor(self) -> bool:
        """Whether this instance holds the compaction lease."""
        return self._compactor is not None and self._compactor.holds(self._entry)

    @property
    def pending_records(self) -> int:
        """Records waiting for the next flush (hits coalesced per key)."""
        with self._lock:
            return len(self._queue)

    # --- recording: memory only -----------------------------------------------------------

    def record_write(self, key: BlockHash, parent: BlockHash, size: int) -> None:
        """Note that ``key`` (child of ``parent``) now exists, stored in ``size`` bytes.

        Call after the object's PUT succeeded (or found it present). The key is added to
        the local filter at once and to other instances' filters after the next flush.

        Raises:
            ValueError: ``key`` or ``parent`` is not 16 bytes (nothing is recorded).
        """
        record = (bytes(key), bytes(parent), self._clock(), int(size), KIND_WRITE, 1)
        if len(record[1]) != HASH_BYTES:
            raise ValueError(f"parent: must be {HASH_BYTES} bytes, got {len(record[1])}")
        with self._lock:
            # NOTE: added under self._lock so that a concurrent Bloom reload (which re-adds
            # pending writes under the same lock) cannot lose it. add() validates the key.
            self._filter.add_local([record[0]])
            self._queue.append(record)
            self._maybe_wake()

    def record_writes(self, writes: Sequence[tuple[BlockHash, BlockHash, int]]) -> None:
        """:meth:`record_write` of each ``(key, parent, size)``: one lock, one filter pass.

        Raises:
            ValueError: a key or parent is not 16 bytes (nothing is recorded).
        """
        now = self._clock()
        records = [(bytes(k), bytes(p), now, int(n), KIND_WRITE, 1) for k, p, n in writes]
        keys = [r[0] for r in records]
        # NOTE: checked in C (map), not a generator: this runs per saved block, on the
        # codec processes' reader thread, which shares the engine's interpreter.
        lengths = {*map(len, keys), *map(len, [r[1] for r in records])}
        if lengths - {HASH_BYTES}:
            raise ValueError(f"writes: keys and parents must be {HASH_BYTES} bytes")
        if not records:
            return
        with self._lock:
            self._filter.add_local(keys)
            self._queue.extend(records)
            self._maybe_wake()

    def record_hits(self, keys: Sequence[BlockHash]) -> None:
        """Note that ``keys`` served a request (coalesced per key until the next flush).

        Raises:
            ValueError: a key is not 16 bytes (nothing is recorded).
        """
        _check_keys(keys)
        now = self._clock()
        with self._lock:
            self._queue.add_hits(keys, now)
            self._maybe_wake()

    def record_pin(self, keys: Sequence[BlockHash]) -> None:
        """Pin ``keys``: prune keeps them and warm start loads them first."""
        self._record_kind(keys, KIND_PIN)

    def record_unpin(self, keys: Sequence[BlockHash]) -> None:
        """Undo :meth:`record_pin` (the latest pin/unpin record of a key wins)."""
        self._record_kind(keys, KIND_UNPIN)

    def _record_kind(self, keys: Sequence[BlockHash], kind: int) -> None:
        _check_keys(keys)
        now = self._clock()
        with self._lock:
            self._queue.extend((bytes(key), UNKNOWN_PARENT, now, 0, kind, 1) for key in keys)
            self._maybe_wake()

    def _maybe_wake(self) -> None:
        # NOTE: no early flush while flushes fail: the timer paces retries during an outage.
        if not self._flush_failing and len(self._queue) >= self._flush_keys:
            self._wake.set()

    # --- flush ----------------------------------------------------------------------------

    def flush(self, force: bool = True) -> int:
        """Write one segment with every pending record; returns the records written.

        With ``force=False`` (the timer), nothing is written while only hits wait and the
        oldest has waited less than ``hit_interval`` (hits are coalesced per key).

        Never raises :class:`StorageError`: a failed PUT puts the records back (ahead of
        newer ones, still bounded; the excess oldest are dropped and counted), counts
        ``flush_errors`` and returns 0.
        """
        with self._flush_lock:
            with self._lock:
                if not (force or self._queue.due(self._clock(), self._hit_interval)):
                    return 0
                taken = self._queue.take()
                self._inflight = taken.write_keys()
            if not len(taken):
                return 0
            rows = taken.to_array()
            try:
                self._writer.write(rows)
            except StorageError as exc:
                with self._lock:
                    self._queue.put_back(taken)
                    self._inflight = []
                    self._flush_failing = True
                    self._counters["flush_errors"] += 1
                self._log_once(
                    f"flush:{exc.kind}", "s3kv manifest: segment PUT failed (%s): %s", exc.kind, exc
                )
                return 0
            with self._lock:
                self._inflight = []
                self._flush_failing = False
                self._counters["segments_written"] += 1
                self._counters["records_flushed"] += len(rows)
            self._log_once.rearm("flush:")
            return len(rows)

    # --- refresh --------------------------------------------------------------------------

    def refresh(self) -> int:
        """Apply newer log entries (or, with no log yet, read segments); returns keys added.

        Steady state: one GET (the next entry, absent). Never raises :class:`StorageError`
        or :class:`CodecError` (counted, logged once per kind).
        """
        with self._refresh_lock:
            try:
                added = self._refresh()
            except (StorageError, CodecError) as exc:
                # NOTE: a snapshot shard that is gone or corrupt is a storage fault too: keep
                # serving what is loaded, retry at the next refresh (the compactor rewrites it).
                with self._lock:
                    self._counters["refresh_errors"] += 1
                self._log_once(
                    f"refresh:{exc.kind}", "s3kv manifest: refresh failed (%s): %s", exc.kind, exc
                )
                return 0
            with self._lock:
                self._counters["refreshes"] += 1
            self._log_once.rearm("refresh:")
            return added

    def _refresh(self) -> int:
        self._unread.next_round()
        entry = self._entry
        if entry is None:
            latest = self._log.latest()  # NOTE: walks back past corrupt entries itself
            # Only a log that is really empty lets this instance start one (and migrate).
            self._no_log = latest is None and not self._log.versions_after(0)
            if latest is None:
                return self._read_segments_v1()
            return self._apply_or_newer(latest)
        return self._follow(entry) + self._read_unread()

    def _follow(self, entry: LogEntry) -> int:
        """Apply the entries after ``entry``: one by one, or a jump to the newest."""
        added, probe = 0, self.version + 1
        for _ in range(_CATCH_UP):
            try:
                nxt = self._log.read(probe)
            except CodecError as exc:
                self._count_corrupt_entry(exc)
                probe += 1  # NOTE: a corrupt entry occupies its number; the next may follow
                continue
            if nxt is None:
                if self._monotonic() - self._entry_seen_at < entry.lease_s / 2:
                    return added
                # NOTE: a live compactor publishes every lease/3: this long without news, the
                # next entry may have been swept while this instance was paused. The hint
                # (one GET) tells a stale reader from a quiet log.
                if self._log.hint() <= probe:
                    return added
                break
            added += self._apply_or_newer(nxt)
            probe = self.version + 1
        latest = self._log.latest()  # far behind: jump to the newest
        return added + (self._apply_or_newer(latest) if latest is not None else 0)

    def _apply_or_newer(self, entry: LogEntry) -> int:
        """Apply ``entry``, or the newest entry after it if what ``entry`` names is gone.

        An entry names objects deleted ``grace_s`` after a later one replaced them: this
        instance lagged that long, or a stale ``LATEST`` hint led it there. A later entry
        names their replacements: one listing finds it (only when loading failed).

        Raises:
            CodecError: the newest entry cannot be loaded either (the refresh counts it).
        """
        try:
            return self._apply(entry)
        except CodecError:
            for version in reversed(self._log.versions_after(entry.version)[-_WALK_BACK:]):
                try:
                    newer = self._log.read(version)
                except CodecError:
                    continue  # NOTE: a corrupt entry occupies its number: the one before
                if newer is not None:
                    return self._apply(newer)
            raise

    def _count_corrupt_entry(self, exc: CodecError) -> None:
        with self._lock:
            self._counters["snapshots_corrupt"] += 1
        self._log_once("entry", "s3kv manifest: skipping a corrupt log entry (%s)", exc.kind)

    def apply(self, entry: LogEntry) -> int:
        """Apply an entry this process published (the compactor's); returns keys added."""
        with self._refresh_lock:
            if entry.version <= self.version:
                return 0
            return self._apply(entry)

    def _apply(self, entry: LogEntry) -> int:
        """Load what ``entry`` adds (new snapshot filters, new deltas); caller holds the lock."""
        previous = self._entry
        if previous is not None and entry.version <= previous.version:
            return 0
        new_snapshot = entry.snapshot is not None and (
            previous is None
            or previous.snapshot is None
            or previous.snapshot.path != entry.snapshot.path
        )
        if previous is None or new_snapshot:
            return self._reload(entry)
        # NOTE: a merged delta holds the deltas before it: skipped after applying them
        # all, read when one of them could not be read (it holds that one's keys too).
        skip_merged = entry.version == previous.version + 1 and not len(self._unread)
        fresh = [
            d
            for d in entry.deltas
            if d.path not in self._loaded_deltas
            and d.path not in self._unread
            and not (d.merged and skip_merged)
        ]
        batches = self._fetch_deltas(fresh)
        if any(batch is None for batch in batches):
            # NOTE: a delta gone (a snapshot superseded it): skipping it would leave its
            # keys out until the next snapshot; rebuild from the newest entry.
            newest = self._log.latest()
            return self._reload(newest if newest and newest.version > entry.version else entry)
        added = self._add_deltas(self._filter, batches)
        unread = [d.path for d, got in zip(fresh, batches, strict=True) if isinstance(got, Fault)]
        self._book_unread(entry, unread)
        self._set_entry(entry, {d.path for d in entry.deltas} - set(self._unread.held()))
        return added

    def _reload(self, entry: LogEntry) -> int:
        """Build a filter from ``entry``'s snapshot and deltas, then swap it in.

        The shard filters and the deltas are fetched in one parallel round.
        """
        snapshot = entry.snapshot
        paths = [d.path for d in entry.deltas]
        with ThreadPoolExecutor(2, thread_name_prefix="s3kv-manifest-load") as pool:
            shards = pool.submit(read_filters, self._io, snapshot) if snapshot else None
            deltas = pool.submit(self._fetch_deltas, list(entry.deltas))
            loaded = shards.result() if shards is not None else None
            batches = deltas.result()
        if snapshot is None or loaded is None:
            built = KeyFilter(self._fpr, growth_capacity=self._capacity)
        else:
            filters, rebuilt = loaded
            if rebuilt:
                with self._lock:
                    self._counters["snapshots_corrupt"] += rebuilt
            built = KeyFilter(
                self._fpr,
                filters,
                snapshot.shard_bits,
                growth_capacity=min(max(self._capacity, snapshot.keys // 8), _MAX_GROWTH),
            )
        added = self._add_deltas(built, batches)
        unread = [p for p, got in zip(paths, batches, strict=True) if not _is_records(got)]
        with self._lock:
            built.carry(self._filter)
            # NOTE: writes recorded meanwhile are pending or in flight: keep them.
            writes = self._queue.write_keys() + self._inflight
            if writes:
                built.add_local(writes)
            self._filter = built
            self._counters["reloads"] += 1
        for path in set(paths) - set(unread):
            self._unread.forget(path)  # NOTE: read at last (a reload reads every delta)
        self._book_unread(entry, unread)
        self._set_entry(entry, set(paths) - set(self._unread.held()))
        return added + (snapshot.keys if snapshot else 0)

    def _fetch_deltas(self, refs: list[DeltaRef]) -> list[Records | Fault | None]:
        """Delta records, fetched in parallel (``None``: gone; a :class:`Fault`: unreadable)."""

        def one(ref: DeltaRef) -> Records | Fault | None:
            # NOTE: the compactor instance applies its own entries: it has their deltas.
            cached = self._compactor.cached_delta(ref.path) if self._compactor else None
            if cached is not None:
                return cached
            return self._io.read_records_checked(ref.path, count=ref.records)

        batches = parallel(one, refs)
        with self._lock:
            self._counters["deltas_read"] += len(refs)
        return batches

    def _add_deltas(self, into: KeyFilter, batches: Sequence[Records | Fault | None]) -> int:
        added = 0
        for records in batches:
            if _is_records(records):
                keys = delta_write_keys(records)
                into.add_array(keys)
                added += len(keys)
        return added

    def _book_unread(self, entry: LogEntry, unread: list[str]) -> None:
        """Keep ``entry``'s deltas that could not be read (``unread``) to read again later.

        Names ``entry`` no longer lists are forgotten: what replaced them (a snapshot, a
        merged delta) was loaded instead.
        """
        named = {d.path for d in entry.deltas}
        for path in self._unread.held():
            if path not in named:
                self._unread.forget(path)
        for path in unread:
            if not self._unread.failed(path):
                self._give_up(path)

    def _read_unread(self) -> int:
        """Read again the current entry's deltas that could not be read (when due)."""
        entry = self._entry
        if entry is None or not len(self._unread):
            return 0
        due = [d for d in entry.deltas if d.path in self._unread and self._unread.due(d.path)]
        batches = self._fetch_deltas(due)
        added = self._add_deltas(self._filter, batches)
        for path, got in zip([d.path for d in due], batches, strict=True):
            if isinstance(got, Fault):
                if not self._unread.failed(path):
                    self._give_up(path)
                continue
            self._unread.forget(path)
            if got is not None:
                with self._lock:
                    self._loaded_deltas.add(path)
        return added

    def _give_up(self, name: str) -> None:
        with self._lock:
            self._counters["segments_corrupt"] += 1
        self._log_once("unread", "s3kv manifest: giving up on %s: it cannot be read", name)

    def _set_entry(self, entry: LogEntry, deltas: set[str]) -> None:
        with self._lock:
            self._entry = entry
            self._entry_seen_at = self._monotonic()
            self._loaded_deltas = deltas
            self._seen.clear()

    def _read_segments_v1(self) -> int:
        """No log yet: read every segment not read before (format 1, no compactor).

        A segment that fails verification, but not provably in the bucket, is read again
        at later refreshes (:class:`~s3kv.manifest.retry.RetryBook` bounds how often).
        """
        listed = [
            (name, size)
            for name, size in self._io.segments(0)
            if name not in self._seen and self._unread.due(name)
        ]
        reads = parallel(lambda item: self._io.read_segment_checked(*item), listed)
        added = 0
        for (name, _size), records in zip(listed, reads, strict=True):
            if records is Fault.UNVERIFIED and self._unread.failed(name):
                continue  # NOTE: read again at a later refresh
            self._unread.forget(name)
            with self._lock:
                if isinstance(records, Fault):
                    self._counters["segments_corrupt"] += 1
                elif records is not None:
                    self._counters["segments_read"] += 1
                if len(self._seen) < _MAX_SEEN:
                    self._seen.add(name)
            if _is_records(records):
                writes = records["key"][records["kind"] == KIND_WRITE]
                self._filter.add_array(writes)
                added += len(writes)
        return added

    # --- compaction -----------------------------------------------------------------------

    def compact_once(self) -> str:
        """One round of the compactor duty: cycle if holding the lease, else maybe take it.

        Returns what happened (``"cycle:<action>"``, ``"takeover"``, ``"lost"``,
        ``"wait"``, ``"off"``). Never raises :class:`StorageError` (counted, logged).
        """
        compactor = self._compactor
        if compactor is None:
            return "off"
        with self._compact_lock:
            return self._compact_once(compactor)

    def _compact_once(self, compactor: Compactor) -> str:
        try:
            entry = self._entry
            if compactor.holds(entry):
                assert entry is not None
                report = compactor.cycle(entry)
                with self._lock:
                    self._counters["compaction_cycles"] += 1
                if report.entry is None:
                    with self._lock:
                        self._counters["fenced"] += 1
                    return "lost"
                self.apply(report.entry)
                return f"cycle:{report.action}"
            if not self._takeover_due(entry):
                return "wait"
            taken = compactor.take_over(entry)
            if taken is None:
                return "lost"
            with self._lock:
                self._counters["takeovers"] += 1
            self.apply(taken)
            return "takeover"
        except (StorageError, CodecError) as exc:
            with self._lock:
                self._counters["compaction_errors"] += 1
            self._log_once(
                f"compact:{exc.kind}", "s3kv manifest: compaction failed (%s): %s", exc.kind, exc
            )
            return "error"

    def _takeover_due(self, entry: LogEntry | None) -> bool:
        if not self._loaded.is_set():
            return False
        if entry is None:
            return self._no_log  # no log yet: the first instance starts it (and migrates)
        if entry.holder == "":
            return True
        waited = self._monotonic() - self._entry_seen_at
        return waited > entry.lease_s * (1.0 + self._jitter)

    # --- background threads ---------------------------------------------------------------

    def start(
        self,
        refresh_interval: float = 10.0,
        flush_interval: float = 60.0,
        flush_keys: int = _DEFAULT_FLUSH_KEYS,
    ) -> None:
        """Start the daemon threads: flush and refresh on timers; the compactor duty.

        The manifest thread flushes every ``flush_interval`` seconds (early once
        ``flush_keys`` records wait) and refreshes every ``refresh_interval`` seconds (0
        disables). Pending records are bounded to ``8 × flush_keys``. With compaction on, a
        second thread runs :meth:`compact_once` every ``interval_s`` (more often while it
        waits to take a lease over). Both wait on Events, so :meth:`close` wakes them.

        Raises:
            RuntimeError: already started.
        """
        if self._threads:
            raise RuntimeError("Manifest.start: already started")
        with self._lock:
            self._flush_keys = max(1, flush_keys)
            self._queue.bound = _PENDING_FACTOR * self._flush_keys
        self._threads.append(
            threading.Thread(
                target=self._run,
                args=(refresh_interval, flush_interval),
                name=f"s3kv-manifest-{self.instance_id}",
                daemon=True,
            )
        )
        if self._compactor is not None:
            self._threads.append(
                threading.Thread(
                    target=self._run_compactor,
                    args=(self._compactor.policy.interval_s, refresh_interval),
                    name=f"s3kv-compactor-{self.instance_id}",
                    daemon=True,
                )
            )
        for thread in self._threads:
            thread.start()

    def _run(self, refresh_interval: float, flush_interval: float) -> None:
        now = time.monotonic()
        next_flush = now + flush_interval if flush_interval > 0 else float("inf")
        next_refresh = now + refresh_interval if refresh_interval > 0 else float("inf")
        while not self._stop.is_set():
            woken = self._wake.wait(max(0.0, min(next_flush, next_refresh) - time.monotonic()))
            if self._stop.is_set():
                return
            self._wake.clear()
            now = time.monotonic()
            # NOTE: this thread must outlive any bug in one round; a dead refresher would
            # silently stop all manifest updates, so log it with the traceback and go on.
            try:
                if woken and not self._flush_failing:
                    self.flush()
                elif now >= next_flush:
                    self.flush(force=False)
                if now >= next_flush and flush_interval > 0:
                    next_flush = now + flush_interval
                if now >= next_refresh:
                    self.refresh()
                    next_refresh = now + refresh_interval
            except Exception:
                logger.exception("s3kv manifest: background round failed")
                with self._lock:
                    self._counters["thread_errors"] += 1

    def _run_compactor(self, interval: float, refresh_interval: float) -> None:
        # NOTE: a waiting candidate checks as often as it refreshes, so a dead holder is
        # replaced within lease_s + refresh_interval; the holder cycles every interval.
        while not self._stop.is_set():
            try:
                self.compact_once()
            except Exception:
                logger.exception("s3kv manifest: compactor round failed")
                with self._lock:
                    self._counters["thread_errors"] += 1
            wait = interval if self.is_compactor else min(interval, refresh_interval or interval)
            self._stop.wait(max(0.05, wait))

    def close(self, flush: bool = True, timeout: float | None = None) -> None:
        """Stop the threads (waiting up to ``timeout``), flush if asked, hand the lease over.

        Idempotent. Records recorded after ``close`` stay pending until a :meth:`flush`.
        A compactor folds what is left and publishes one last entry with no holder, so
        another instance takes over at its next check instead of after the lease.
        """
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout)
        if flush:
            self.flush()
        compactor = self._compactor
        if compactor is None:
            return
        # NOTE: a compactor thread still in a cycle (the join timed out) owns the Compactor:
        # leave the lease to expire rather than race it (the other instances take over).
        if not self._compact_lock.acquire(timeout=0 if timeout is not None else 30.0):
            logger.warning("s3kv manifest: a compaction is still running; lease not released")
            return
        try:
            entry = self._entry
            if entry is not None and compactor.holds(entry):
                # NOTE: one last cycle folds what was just flushed, so the next instance (a
                # redeploy) sees every block at startup instead of after the next compaction.
                last = compactor.cycle(entry).entry
                if last is not None:
                    compactor.release(last)
        except (StorageError, CodecError) as exc:
            self._log_once("release", "s3kv manifest: lease not released (%s)", exc.kind)
        finally:
            self._compact_lock.release()

    def stats(self) -> dict[str, float]:
        """Counters and gauges, by name (all present from the start, 0 until counted).

        Counters: ``segments_written``, ``segments_read``, ``segments_corrupt``,
        ``records_flushed``, ``records_dropped``, ``flush_errors``, ``refresh_errors``,
        ``refreshes``, ``reloads``, ``deltas_read``, ``snapshots_corrupt``,
        ``thread_errors``, ``compaction_cycles``, ``compaction_errors``, ``takeovers``,
        ``fenced``, ``requests``. Gauges: ``pending_records``, ``keys_in_filter``
        (inserts; an upper bound), ``bloom_bytes`` (every filter held), ``generation``,
        ``version``, ``compactor`` (1 while holding the lease), ``open_requests``, and
        ``lag_seconds`` (since a new log entry was last applied; once one was).
        """
        with self._lock:
            values: dict[str, float] = dict.fromkeys(_COUNTERS, 0.0)
            values.update({name: float(value) for name, value in self._counters.items()})
            values["pending_records"] = float(len(self._queue))
            values["records_dropped"] = float(self._queue.dropped)
            if self._entry is not None:
                values["lag_seconds"] = self._monotonic() - self._entry_seen_at
        keyfilter = self._filter
        values["keys_in_filter"] = float(keyfilter.snapshot_keys + keyfilter.growth_keys)
        values["bloom_bytes"] = float(keyfilter.nbytes)
        values["generation"] = float(self.generation)
        values["version"] = float(self.version)
        values["compactor"] = float(self.is_compactor)
        values["open_requests"] = float(self._open_requests)
        values["requests"] = float(self._io.requests)
        return values
