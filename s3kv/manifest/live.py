"""The live manifest of one model fingerprint: which block keys exist, and their usage.

Listing a bucket of millions of objects takes thousands of requests, so every instance
keeps a Bloom filter of the keys in its fingerprint, built from objects under
``<prefix>/<fp>/manifest/`` (formats in :mod:`s3kv.manifest.format`):

* **Segments** — immutable batches of records (write, hit, pin, unpin) that each instance
  appends in the background (:meth:`Manifest.flush`).
* **Snapshot** — a generation of ``bloom.bin`` (every live key) and ``usage.bin`` (one row
  per live key), written by :func:`~s3kv.manifest.compact`, and the ``CURRENT`` pointer
  written last.

Startup (:meth:`Manifest.open`) costs a number of requests independent of the key count
but not of the manifest's age: GET ``CURRENT``, GET ``bloom.bin``, one LIST page per 1000
recent segment names, and one GET per segment not yet folded into the snapshot, so it grows
with the segments written since the last compaction (nothing compacts automatically yet:
see the fleet-scale manifest issue).
:meth:`Manifest.refresh` then reads other instances' new segments on a timer, so their
writes become visible within the refresh interval, and reloads the Bloom filter when a
compaction published a new generation.

Clock skew and late PUTs: segment names carry their writer's clock, and a reader lists from
``(newest time it knows) - grace_s``, skipping names it already read. A segment whose
writer's clock lags (or whose PUT lands late) by less than ``grace_s`` is still picked up;
beyond that it is lost to readers (its keys become misses until ``s3kv compact --full``).

Failure policy: lookups never touch the network. Storage errors during flush and refresh
are counted and logged once per kind, never raised; corrupt segments and snapshots are
skipped and counted. Everything held in memory is bounded (:meth:`Manifest.start`).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Final

from s3kv._logonce import LogOnce
from s3kv.errors import CodecError, ConfigError, StorageError
from s3kv.keys import HASH_BYTES, BlockHash
from s3kv.manifest.bloom import BloomFilter
from s3kv.manifest.format import (
    KIND_PIN,
    KIND_UNPIN,
    KIND_WRITE,
    UNKNOWN_PARENT,
    Current,
    segment_time_ms,
    valid_instance_id,
)
from s3kv.manifest.io import ManifestIO, SegmentWriter
from s3kv.manifest.queue import RecordQueue
from s3kv.storage import Backend

__all__ = ["Manifest"]

logger = logging.getLogger(__name__)

#: Default early-flush threshold until :meth:`Manifest.start` sets it.
_DEFAULT_FLUSH_KEYS: Final = 4096
#: Pending records are bounded to this many flushes' worth.
_PENDING_FACTOR: Final = 8
#: Generation marker: CURRENT could not be read yet (retry on the next refresh).
_UNKNOWN_GEN: Final = -2
#: Generation marker: CURRENT exists but is corrupt (reload only when it changes).
_CORRUPT_GEN: Final = -1

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
    "snapshots_corrupt",
    "thread_errors",
)


def _check_keys(keys: Sequence[bytes]) -> None:
    for key in keys:
        if len(key) != HASH_BYTES:
            raise ValueError(f"keys: every key must be {HASH_BYTES} bytes, got {len(key)}")


class Manifest:
    """The live manifest of one fingerprint: a Bloom filter plus a queue of new records.

    Create it with :meth:`open`. Lookups (:meth:`may_contain`, :meth:`count_leading`) are
    lock-free and never touch the network; ``record_*`` only append to memory; the network
    is used by :meth:`flush` and :meth:`refresh`, which the background thread of
    :meth:`start` calls. Thread-safe.

    Memory: the Bloom filter (``bloom_capacity`` keys at ``bloom_fpr``: 36 MB for 10M keys
    at 1e-6) plus at most ``8 × flush_keys`` pending records (~250 bytes each: 8 MB at the
    default 4096), plus the names of the segments seen within the grace window.
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
    ) -> None:
        instance = instance_id or secrets.token_hex(4)
        if not valid_instance_id(instance):
            raise ConfigError(f"instance_id: must be 1-64 of [A-Za-z0-9._-], got {instance!r}")
        if grace_s < 0:
            raise ConfigError(f"grace_s: must be >= 0, got {grace_s}")
        self.instance_id = instance
        self._io = ManifestIO(backend, prefix, fingerprint)
        self._writer = SegmentWriter(self._io, instance, clock)
        self._capacity, self._fpr = capacity, fpr
        self._clock = clock
        self._grace_ms = round(grace_s * 1000)
        self._bloom = BloomFilter.for_capacity(capacity, fpr)
        self._generation = _UNKNOWN_GEN
        self._seen: dict[str, int] = {}  # segment names within the window -> time ms
        self._high_ms = 0  # newest segment time known (watermark included)
        self._floor_ms = 0  # the snapshot's listing cutoff: older segments are folded
        self._lock = threading.Lock()  # pending records, seen names, counters
        self._flush_lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._queue = RecordQueue(_PENDING_FACTOR * _DEFAULT_FLUSH_KEYS)
        self._inflight: list[bytes] = []  # write keys of the flush in progress
        self._flush_keys = _DEFAULT_FLUSH_KEYS
        self._flush_failing = False
        self._counters: Counter[str] = Counter()
        self._log_once = LogOnce(logger)
        self._open_requests = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

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
    ) -> Manifest:
        """Load the manifest: snapshot Bloom filter plus the segments not folded into it.

        Requests: 1 GET ``CURRENT`` + 1 GET ``bloom.bin`` + 1 LIST per 1000 segment names in
        the window + 1 GET per unfolded segment (see :attr:`open_requests`). Never raises
        :class:`StorageError`: if the bucket fails, the manifest starts empty (lookups miss)
        and the next :meth:`refresh` retries.

        Args:
            backend: The bucket.
            prefix: The configured key prefix.
            fingerprint: The model fingerprint.
            capacity: Keys the Bloom filter is sized for, when there is no snapshot.
            fpr: Its false-positive rate at capacity.
            instance_id: Name of this instance in segment names; random if ``None``/empty.
            clock: Epoch seconds (injectable for tests).
            grace_s: Tolerated clock skew and PUT delay between instances.

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
        )
        manifest.refresh()
        manifest._open_requests = manifest._io.requests
        return manifest

    # --- lookups: memory only -------------------------------------------------------------

    def may_contain(self, key: bytes) -> bool:
        """Whether ``key`` may exist in the bucket (false positives at ~fpr). No network."""
        return key in self._bloom

    def count_leading(self, keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` that may exist. No network."""
        return self._bloom.count_leading(keys)

    @property
    def open_requests(self) -> int:
        """Requests :meth:`open` issued."""
        return self._open_requests

    @property
    def generation(self) -> int:
        """Snapshot generation loaded (0: none exists; negative: not loadable yet)."""
        return self._generation

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
            self._bloom.add(record[0])
            self._queue.append(record)
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
            for key in keys:
                self._queue.append((bytes(key), UNKNOWN_PARENT, now, 0, kind, 1))
            self._maybe_wake()

    def _maybe_wake(self) -> None:
        # NOTE: no early flush while flushes fail: the timer paces retries during an outage.
        if not self._flush_failing and len(self._queue) >= self._flush_keys:
            self._wake.set()

    # --- flush ----------------------------------------------------------------------------

    def flush(self) -> int:
        """Write one segment with every pending record; returns the records written.

        Never raises :class:`StorageError`: a failed PUT puts the records back (ahead of
        newer ones, still bounded; the excess oldest are dropped and counted), counts
        ``flush_errors`` and returns 0.
        """
        with self._flush_lock:
            with self._lock:
                taken = self._queue.take()
                self._inflight = taken.write_keys()
            if not len(taken):
                return 0
            rows = taken.to_array()
            try:
                name = self._writer.write(rows)
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
                self._mark_seen(name)
                self._inflight = []
                self._flush_failing = False
                self._counters["segments_written"] += 1
                self._counters["records_flushed"] += len(rows)
            self._log_once.rearm("flush:")
            return len(rows)

    # --- refresh --------------------------------------------------------------------------

    def refresh(self) -> int:
        """Read new segments of other instances (or a new snapshot); returns keys added.

        One GET of ``CURRENT`` plus one LIST, then a GET per new segment. If ``CURRENT``
        names a new generation, the Bloom filter is rebuilt from it (keys recorded here
        meanwhile are kept) and the return value counts the snapshot's keys too. Never
        raises :class:`StorageError` (counted, logged once per kind).
        """
        with self._refresh_lock:
            try:
                current, generation = self._fetch_current()
                if generation != self._generation:
                    added = self._reload(current, generation)
                else:
                    added = self._read_new(self._bloom, self._window_start(), self._seen)
                    with self._lock:
                        floor = self._window_start()
                        self._seen = {n: t for n, t in self._seen.items() if t >= floor}
            except StorageError as exc:
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

    def _fetch_current(self) -> tuple[Current | None, int]:
        try:
            current = self._io.read_current()
        except CodecError as exc:
            with self._lock:
                self._counters["snapshots_corrupt"] += 1
            self._log_once("current", "s3kv manifest: CURRENT is corrupt (%s)", exc.kind)
            return None, _CORRUPT_GEN
        return current, 0 if current is None else current.generation

    def _reload(self, current: Current | None, generation: int) -> int:
        """Build a filter from ``current``'s snapshot plus newer segments, then swap it in."""
        bloom = self._load_bloom(current) if current is not None else None
        if bloom is None:
            bloom = BloomFilter.for_capacity(self._capacity, self._fpr)
        seen = {name: segment_time_ms(name) or 0 for name in (current.folded if current else ())}
        floor = current.listing_cutoff_ms if current else 0
        added = self._read_new(bloom, floor, seen)
        with self._lock:
            # NOTE: writes recorded meanwhile are pending or in flight: re-add them. Own
            # segments that landed after the listing are not in `seen` (flush marked them in
            # the old dict), so the next refresh reads them back.
            writes = self._queue.write_keys() + self._inflight
            if writes:
                bloom.add_many(writes)
            self._bloom, self._generation = bloom, generation
            self._seen, self._floor_ms = seen, floor
            self._high_ms = max([current.watermark_ms if current else 0, *seen.values()])
            self._counters["reloads"] += 1
        return added + (current.keys if current else 0)

    def _load_bloom(self, current: Current) -> BloomFilter | None:
        """The snapshot's filter; rebuilt from ``usage.bin`` if ``bloom.bin`` is unusable."""
        try:
            data = self._io.get(current.bloom)
            if data is not None:
                return BloomFilter.from_bytes(data)
            reason = "missing"
        except CodecError as exc:
            reason = exc.kind
        with self._lock:
            self._counters["snapshots_corrupt"] += 1
        self._log_once("bloom", "s3kv manifest: bloom.bin unusable (%s); using usage.bin", reason)
        try:
            rows = self._io.read_usage(current)
        except CodecError as exc:
            self._log_once("usage", "s3kv manifest: usage.bin unusable too (%s)", exc.kind)
            return None
        bloom = BloomFilter.for_capacity(max(self._capacity, len(rows)), self._fpr)
        bloom.add_array(rows["key"])
        return bloom

    def _window_start(self) -> int:
        """Where a refresh lists from: ``grace_s`` before the newest segment time known."""
        now_ms = round(self._clock() * 1000)
        # NOTE: min() with the local clock so that one segment from a clock far ahead cannot
        # move the window past everyone else's; max() with the snapshot's floor because
        # older names are folded into it (or lost to every reader alike).
        return max(self._floor_ms, min(self._high_ms, now_ms) - self._grace_ms)

    def _read_new(self, bloom: BloomFilter, cutoff_ms: int, seen: dict[str, int]) -> int:
        """GET segments at/after ``cutoff_ms`` not in ``seen``; add their writes to ``bloom``.

        Marks each segment read (or corrupt) in ``seen``; one that fails with a storage
        error is left unmarked, so the next refresh retries it.
        """
        with self._lock:
            skip = set(seen)
        added = 0
        for name, time_ms in self._io.segments(cutoff_ms, skip):
            try:
                records = self._io.read_segment(name)
            except CodecError as exc:
                with self._lock:
                    self._counters["segments_corrupt"] += 1
                    seen[name] = time_ms
                self._log_once(
                    f"segment:{exc.kind}",
                    "s3kv manifest: skipping corrupt segment %s (%s)",
                    name,
                    exc.kind,
                )
                continue
            if records is not None:
                writes = records["key"][records["kind"] == KIND_WRITE]
                bloom.add_array(writes)
                added += len(writes)
            with self._lock:
                seen[name] = time_ms
                if seen is self._seen:
                    self._high_ms = max(self._high_ms, time_ms)
                if records is not None:
                    self._counters["segments_read"] += 1
        return added

    def _mark_seen(self, name: str) -> None:
        """Caller holds ``self._lock``."""
        time_ms = segment_time_ms(name) or 0
        self._seen[name] = time_ms
        self._high_ms = max(self._high_ms, time_ms)

    # --- background thread ----------------------------------------------------------------

    def start(
        self,
        refresh_interval: float = 30.0,
        flush_interval: float = 5.0,
        flush_keys: int = _DEFAULT_FLUSH_KEYS,
    ) -> None:
        """Start the one daemon thread that flushes and refreshes on timers.

        It flushes every ``flush_interval`` seconds, and early once ``flush_keys`` records
        wait; it refreshes every ``refresh_interval`` seconds (0 disables). Pending records
        are bounded to ``8 × flush_keys``. Waits on an Event, so :meth:`close` and early
        flushes wake it at once.

        Raises:
            RuntimeError: already started.
        """
        if self._thread is not None:
            raise RuntimeError("Manifest.start: already started")
        with self._lock:
            self._flush_keys = max(1, flush_keys)
            self._queue.bound = _PENDING_FACTOR * self._flush_keys
        self._thread = threading.Thread(
            target=self._run,
            args=(refresh_interval, flush_interval),
            name=f"s3kv-manifest-{self.instance_id}",
            daemon=True,
        )
        self._thread.start()

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
                if (woken and not self._flush_failing) or now >= next_flush:
                    self.flush()
                    if flush_interval > 0:
                        next_flush = now + flush_interval
                if now >= next_refresh:
                    self.refresh()
                    next_refresh = now + refresh_interval
            except Exception:
                logger.exception("s3kv manifest: background round failed")
                with self._lock:
                    self._counters["thread_errors"] += 1

    def close(self, flush: bool = True, timeout: float | None = None) -> None:
        """Stop the background thread (waiting up to ``timeout``), then flush if asked.

        Idempotent. Records recorded after ``close`` stay pending until a :meth:`flush`.
        """
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if flush:
            self.flush()

    def stats(self) -> dict[str, float]:
        """Counters and gauges, by name (all present from the start, 0 until counted).

        Counters: ``segments_written``, ``segments_read``, ``segments_corrupt``,
        ``records_flushed``, ``records_dropped``, ``flush_errors``, ``refresh_errors``,
        ``refreshes``, ``reloads``, ``snapshots_corrupt``, ``thread_errors``, ``requests``.
        Gauges: ``pending_records``, ``keys_in_filter`` (inserts; an upper bound),
        ``bloom_bytes``, ``generation``, ``open_requests``.
        """
        with self._lock:
            values: dict[str, float] = dict.fromkeys(_COUNTERS, 0.0)
            values.update({name: float(value) for name, value in self._counters.items()})
            values["pending_records"] = float(len(self._queue))
            values["records_dropped"] = float(self._queue.dropped)
        values["keys_in_filter"] = float(self._bloom.count)
        values["bloom_bytes"] = float(self._bloom.nbytes)
        values["generation"] = float(self._generation)
        values["open_requests"] = float(self._open_requests)
        values["requests"] = float(self._io.requests)
        return values
