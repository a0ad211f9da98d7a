"""The compactor: one per fingerprint, elected through the manifest log, folding segments.

Election and fencing use nothing but conditional creates of log entries
(:mod:`s3kv.manifest.log`). The holder of the lease is the ``holder`` of the newest entry.
It publishes entry ``V + 1`` every ``interval_s`` (at least every ``lease_s / 3``, as a
heartbeat); any instance that has seen no newer entry for ``lease_s`` creates ``V + 1``
naming itself. Creating ``V + 1`` can succeed for one writer only, so:

* two instances taking over at once: one wins, the other reads the winner and waits;
* a holder paused past its lease wakes, tries ``V + 1`` (or later), finds it taken and
  steps down before it deletes anything (it only ever deletes what a version *it*
  published made obsolete, which stays obsolete in every later version);
* a holder paused so long that ``V + 1`` was swept meanwhile creates it, but the listing
  that follows every create (:meth:`ManifestLog.append`) finds the newer entries: the
  create counts as lost, ``LATEST`` is left alone, and the stray entry is swept later;
* a holder killed mid-cycle leaves objects no entry names; the next holder's sweep
  deletes unreferenced objects older than the grace period.

Each cycle lists the segments (one page per 1000: a steady state holds about one segment
per writer), reads them in parallel, coalesces their records into a *delta*, and publishes
an entry naming it; then it deletes the folded segments. When the deltas outgrow
``max_deltas`` they are merged into one; when their records outgrow the snapshot policy
a new sharded snapshot is written (:func:`~s3kv.manifest.snapshot.write_snapshot`).
Readers therefore fetch a bounded number of objects per refresh whatever the number of
writers.

Migration: the first holder over a bucket written by format 1 (``CURRENT`` and a
``usage.bin``) folds that usage table and every segment into the first snapshot.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from s3kv.errors import CodecError, StorageError
from s3kv.manifest.format import RECORD_DTYPE, SEGMENTS_DIR, SNAPSHOTS_DIR, Records
from s3kv.manifest.io import Fault, ManifestIO
from s3kv.manifest.log import (
    LOG_DIR,
    DeltaRef,
    LogEntry,
    ManifestLog,
    SnapshotRef,
    log_name,
    log_version,
)
from s3kv.manifest.snapshot import (
    PARALLEL_GETS,
    coalesce,
    delta_write_keys,
    parallel,
    write_delta,
    write_snapshot,
)
from s3kv.manifest.xorfilter import XorFilter

__all__ = ["DELTAS_DIR", "CompactionPolicy", "Compactor", "CycleReport", "legacy_usage"]

logger = logging.getLogger(__name__)

DELTAS_DIR: Final = "deltas/"
#: Sweep unreferenced objects and old log entries this often (seconds).
_SWEEP_EVERY: Final = 3600.0


#: Folded segments left undeleted past this many: say so loudly (permissions?).
_PENDING_WARN: Final = 10_000


class _FencedError(Exception):
    """Another instance published first (raised only inside a cycle)."""


class _Heartbeats:
    """Keeps a long snapshot write alive: a heartbeat entry every ``lease / 3`` between shards.

    Without it, candidates would take over mid-write, fence this holder, face the same due
    snapshot and be fenced in turn, and nothing would ever be published again.
    """

    def __init__(self, compactor: Compactor, entry: LogEntry, version: int) -> None:
        self._compactor = compactor
        self.entry = entry
        self.version = version

    def maybe(self) -> None:
        compactor = self._compactor
        if compactor._monotonic() - compactor._last_publish < compactor.policy.lease_s / 3:
            return
        self.entry = compactor.heartbeat(self.entry, self.version)
        self.version += 1


def legacy_usage(io: ManifestIO) -> Records | None:
    """The format-1 snapshot's usage rows (``CURRENT`` + ``usage.bin``), for migration.

    ``None`` when there is none or it cannot be read (logged: its keys are then rebuilt
    only from segments, or by ``s3kv compact --full``).
    """
    try:
        current = io.read_current()
        return None if current is None else io.read_usage(current)
    except CodecError as exc:
        logger.warning("s3kv manifest: format-1 snapshot unreadable (%s); not migrated", exc.kind)
        return None


@dataclass(frozen=True)
class CompactionPolicy:
    """When the compactor publishes, merges and snapshots.

    Attributes:
        interval_s: Seconds between cycles of the holder.
        lease_s: Others take the lease over after seeing no new entry for this long.
        max_deltas: Deltas an entry may name (>= 2); one more merges the old ones into one.
        snapshot_records: Delta records that trigger a snapshot, at least ...
        snapshot_ratio: ... or this fraction of the snapshot's keys, whichever is larger,
        snapshot_cap: ... but never more than this (bounds the compactor's memory).
        shard_keys: Keys per snapshot shard.
        fpr: Target false-positive rate (sets the filters' fingerprint bits).
        grace_s: Unreferenced objects and old entries live this long (readers mid-load).
        max_segments: Segments folded per cycle at most (bounds a cycle's memory).
        keep_versions: Log entries kept behind the newest.
        snapshot_max_age_s: A snapshot older than this is rewritten even without news, so
            no live object ever ages into a bucket lifecycle rule's expiry.
    """

    interval_s: float = 20.0
    lease_s: float = 60.0
    max_deltas: int = 6
    snapshot_records: int = 100_000
    snapshot_ratio: float = 0.25
    snapshot_cap: int = 4_000_000
    shard_keys: int = 8_000_000
    fpr: float = 1e-6
    grace_s: float = 600.0
    max_segments: int = 20_000
    keep_versions: int = 64
    snapshot_max_age_s: float = 7 * 86400.0

    def snapshot_due(self, delta_records: int, snapshot_keys: int) -> bool:
        """Whether deltas of ``delta_records`` should become a new snapshot."""
        threshold = max(self.snapshot_records, round(self.snapshot_ratio * snapshot_keys))
        return delta_records >= min(threshold, self.snapshot_cap)


@dataclass(frozen=True)
class CycleReport:
    """What one cycle did.

    Attributes:
        entry: The entry published (``None``: fenced, another instance holds the lease).
        segments: Segments folded.
        corrupt: Segments corrupt in the bucket (two reads alike), deleted like folded
            ones. A segment whose read failed verification otherwise is left for the next
            cycle.
        records: Records folded.
        action: ``"delta"``, ``"merge"``, ``"snapshot"``, ``"heartbeat"``, ``"idle"`` or
            ``"fenced"``.
        requests: Requests the cycle issued.
        dropped: Live keys a snapshot removed because they were in ``drop``.
    """

    entry: LogEntry | None
    segments: int
    corrupt: int
    records: int
    action: str
    requests: int
    dropped: int


class Compactor:
    """Holds (or tries to take) one fingerprint's compaction lease and runs cycles.

    Not thread-safe: one thread drives it. Every method may raise
    :class:`~s3kv.errors.StorageError` (nothing published, nothing deleted).

    Args:
        io: The fingerprint's manifest objects.
        instance_id: This instance's id (the ``holder`` of the entries it publishes).
        policy: Cycle, lease and snapshot policy.
        clock: Epoch seconds.
        monotonic: Seconds for intervals (heartbeat, sweep); injectable for simulations.
        legacy_usage: Reads a format-1 usage table for migration (``None``: none).
    """

    def __init__(
        self,
        io: ManifestIO,
        instance_id: str,
        policy: CompactionPolicy,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        legacy_usage: Callable[[], Records | None] | None = None,
    ) -> None:
        self.io = io
        self.log = ManifestLog(io)
        self.instance_id = instance_id
        self.policy = policy
        self._clock = clock
        self._monotonic = monotonic
        self._legacy_usage = legacy_usage
        self.token = secrets.token_hex(4)
        self.fp_bits = XorFilter.fp_bits_for(policy.fpr)
        self._pending: set[str] = set()  # folded segments not yet deleted
        self._superseded: list[tuple[float, list[str]]] = []  # (delete after, paths)
        self._delta_cache: dict[str, Records] = {}
        self._last_publish = 0.0
        self._last_sweep = 0.0

    # --- the lease ------------------------------------------------------------------------

    def holds(self, entry: LogEntry | None) -> bool:
        """Whether ``entry`` names this compactor's current term."""
        return entry is not None and entry.holder == self.instance_id and entry.token == self.token

    def take_over(self, entry: LogEntry | None, *, lease_s: float | None = None) -> LogEntry | None:
        """Create the entry after ``entry`` naming this instance; ``None`` if another won
        (or the log has already moved past ``entry``).

        The new term starts with the previous holder's undeleted segments (``folded``),
        which it deletes before folding anything, so nothing is folded twice.
        """
        # NOTE: a candidate behind the log is the usual loser of a take-over race: info only.
        base = entry or LogEntry(0, "", "", 1.0, None)
        version = self._next_version(base, level=logging.INFO)
        if version is None:
            return None
        self.token = secrets.token_hex(4)
        self._delta_cache.clear()
        lease = self.policy.lease_s if lease_s is None else lease_s
        now = self._clock()
        if entry is None:
            taken = LogEntry(version, self.instance_id, self.token, lease, None, created_at=now)
        else:
            taken = entry.next(
                version=version,
                holder=self.instance_id,
                token=self.token,
                lease_s=lease,
                folded=entry.folded,
                created_at=now,
            )
        if not self.log.append(taken):
            return None
        self._pending = set(taken.folded)
        self._last_publish = self._monotonic()
        self._last_sweep = 0.0
        logger.info(
            "s3kv manifest: %s holds the compaction lease (v%d)", self.instance_id, taken.version
        )
        return taken

    def _next_version(self, entry: LogEntry, *, level: int = logging.WARNING) -> int | None:
        """The version to create after ``entry``; ``None`` when a valid newer entry exists.

        One LIST from ``entry``. The conditional create of ``V + 1`` fences only while
        ``V + 1`` exists; entries are swept after ``keep_versions``, so a holder (or
        candidate) woken from a pause longer than that would re-create a swept version.
        This listing saves it the work of a cycle; the one after the create
        (:meth:`ManifestLog.append`) is what makes the stray entry harmless, because a
        pause can also fall between the two. Listing sees every newer entry whatever the ``LATEST``
        hint says (a hint can be stale, garbage or far ahead: it never decides). A newer
        entry that is not valid (torn, hostile, a future format) occupies its number and
        nothing else: the next entry goes past it.
        """
        newer = self.log.versions_after(entry.version)
        for version in newer:
            try:
                found = self.log.read(version)
            except CodecError:
                continue
            if found is not None:
                logger.log(
                    level,
                    "s3kv manifest: %s is behind the log (v%d < v%d); not publishing",
                    self.instance_id,
                    entry.version,
                    version,
                )
                return None
        return max(newer, default=entry.version) + 1

    def release(self, entry: LogEntry) -> bool:
        """Publish an entry with no holder, so another instance takes over at once."""
        if not self.holds(entry):
            return False
        version = self._next_version(entry)
        if version is None:
            return False
        folded = tuple(sorted(self._pending | set(entry.folded)))
        released = entry.next(version=version, holder="", folded=folded, created_at=self._clock())
        return self.log.append(released)

    # --- a cycle --------------------------------------------------------------------------

    def cycle(
        self,
        entry: LogEntry,
        *,
        force_snapshot: bool = False,
        drop: Collection[bytes] = (),
        listing: Sequence[tuple[bytes, int, float]] | None = None,
    ) -> CycleReport:
        """Fold new segments into ``entry`` and publish the next entry if there is news.

        ``entry`` must be the newest entry and held by this compactor. Publishes when
        segments were folded, a snapshot is forced, or a heartbeat is due. ``drop`` (keys
        prune deleted) and ``listing`` (``(key, size, last_modified)`` of every block
        object, to rebuild from) force a snapshot; with a listing, a base snapshot that
        cannot be read is replaced by it.
        """
        start_requests = self.io.requests

        def report(published: LogEntry | None, action: str, *counts: int) -> CycleReport:
            segments, corrupt, records, dropped = counts or (0, 0, 0, 0)
            requests = self.io.requests - start_requests
            return CycleReport(published, segments, corrupt, records, action, requests, dropped)

        next_version = self._next_version(entry)
        if next_version is None:
            self._pending.clear()
            return report(None, "fenced")
        # NOTE: only names a published entry lists as folded are ever deleted: a publish
        # that failed (or whose outcome is unknown) must not cost the segments it read.
        self._pending.update(entry.folded)
        self._delete_pending()
        folded, corrupt, new = self._read_unfolded()
        legacy = self._legacy() if entry.snapshot is None else None
        snapshot, deltas, action, dropped = entry.snapshot, entry.deltas, "idle", 0
        stale = snapshot is not None and self._clock() - snapshot.created_at > (
            self.policy.snapshot_max_age_s
        )
        forced = force_snapshot or stale or bool(drop) or listing is not None or legacy is not None
        due = bool(len(new)) and self.policy.snapshot_due(
            entry.delta_records + len(new), snapshot.keys if snapshot else 0
        )
        if forced or due:
            try:
                merged = coalesce(np.concatenate([*self._delta_records(entry), new]))
                beats = _Heartbeats(self, entry, next_version)
                snapshot, dropped = self._write_snapshot(
                    snapshot, merged, next_version, legacy, drop, listing, beats.maybe
                )
                entry, next_version = beats.entry, beats.version
                deltas, action = (), "snapshot"
            except _FencedError:
                self._pending.clear()
                return report(None, "fenced")
            except CodecError as exc:
                if forced and not due and not stale:
                    raise
                # NOTE: an unreadable base shard must not stop compaction for good: keep
                # publishing deltas, and say how to rebuild (only a listing can).
                logger.error(
                    "s3kv manifest: cannot write a snapshot (%s); publishing deltas meanwhile. "
                    "Rebuild it with `s3kv compact --full`",
                    exc,
                )
                snapshot = entry.snapshot
        version = next_version
        if action != "snapshot" and len(new):
            merge = len(deltas) + 1 > self.policy.max_deltas
            if merge:
                # NOTE: the merged delta holds only what readers already have, so a reader
                # following every entry skips it; the new records stay a delta of their own.
                old = coalesce(np.concatenate(self._delta_records(entry)))
                deltas = (self._write_delta(f"{version:020d}-{self.token}-m", old, merged=True),)
            fresh = self._write_delta(f"{version:020d}-{self.token}", new, merged=False)
            deltas, action = (*deltas, fresh), "merge" if merge else "delta"
        elif action != "snapshot":
            idle = self._monotonic() - self._last_publish < self.policy.lease_s / 3
            if idle and not folded and not corrupt:
                return report(entry, "idle")
            action = "heartbeat"
        nxt = entry.next(
            version=version,
            holder=self.instance_id,
            token=self.token,
            lease_s=self.policy.lease_s if entry.holder == self.instance_id else entry.lease_s,
            snapshot=snapshot,
            deltas=deltas,
            folded=self._folded_names(folded, corrupt),
            created_at=self._clock(),
        )
        if not self.log.append(nxt):
            logger.warning(
                "s3kv manifest: %s lost the compaction lease at v%d; stepping down",
                self.instance_id,
                version,
            )
            self._pending.clear()
            return report(None, "fenced")
        self._pending.update(folded, corrupt)
        self._last_publish = self._monotonic()
        self._after_publish(entry, nxt)
        return report(nxt, action, len(folded), len(corrupt), len(new), dropped)

    def _folded_names(self, folded: list[str], corrupt: list[str]) -> tuple[str, ...]:
        """The entry's ``folded`` list: this cycle's names plus the undeleted, bounded.

        If deletes keep failing the list would grow with every cycle (and every reader
        parses it); past the bound the oldest undeleted names are given up: they are
        folded again later, which only repeats their records (said loudly once).
        """
        fresh = {*folded, *corrupt}
        older = sorted(self._pending - fresh)
        room = max(0, _PENDING_WARN - len(fresh))
        if len(older) > room:
            given_up = older[: len(older) - room]
            self._pending.difference_update(given_up)
            logger.error(
                "s3kv manifest: %d folded segments could not be deleted; they will be folded "
                "again (check s3:DeleteObject on the manifest prefix)",
                len(given_up),
            )
            older = older[len(given_up) :]
        return tuple(sorted({*fresh, *older}))

    def heartbeat(self, entry: LogEntry, version: int) -> LogEntry:
        """Publish ``entry``'s state again as ``version`` (no news: the holder is alive).

        Raises:
            _FencedError: another instance published ``version`` first.
        """
        beat = entry.next(
            version=version,
            holder=self.instance_id,
            token=self.token,
            lease_s=self.policy.lease_s,
            folded=tuple(sorted(self._pending | set(entry.folded))),
            created_at=self._clock(),
        )
        if not self.log.append(beat):
            raise _FencedError
        self._last_publish = self._monotonic()
        return beat

    def _write_snapshot(
        self,
        base: SnapshotRef | None,
        records: Records,
        version: int,
        legacy: Records | None,
        drop: Collection[bytes],
        listing: Sequence[tuple[bytes, int, float]] | None,
        after_shard: Callable[[], None] | None = None,
    ) -> tuple[SnapshotRef, int]:
        generation = (base.generation if base else 0) + 1

        def write(base: SnapshotRef | None, suffix: str) -> tuple[SnapshotRef, int]:
            return write_snapshot(
                self.io,
                base,
                records,
                path=f"{SNAPSHOTS_DIR}{version:020d}-{self.token}{suffix}",
                generation=generation,
                shard_keys=self.policy.shard_keys,
                fp_bits=self.fp_bits,
                created_at=self._clock(),
                base_rows=legacy,
                listing=listing or (),
                drop=drop,
                after_shard=after_shard,
            )

        try:
            return write(base, "")
        except CodecError as exc:
            if listing is None or base is None:
                raise
            logger.warning(
                "s3kv manifest: snapshot unreadable (%s); rebuilding from the listing", exc.kind
            )
            return write(None, "-rebuilt")

    def _write_delta(self, name: str, records: Records, *, merged: bool) -> DeltaRef:
        path = f"{DELTAS_DIR}{name}.delta"
        write_delta(self.io, path, records)
        self._delta_cache[path] = records
        return DeltaRef(path, len(records), len(delta_write_keys(records)), merged=merged)

    def _read_unfolded(self) -> tuple[list[str], list[str], Records]:
        """(folded names, corrupt names, coalesced records) of the segments to fold now.

        Reads in parallel batches, oldest names first, and stops once ``max_segments``
        names or ``snapshot_cap`` records are in hand: a cycle's memory is bounded whatever
        piled up (the rest is folded by the next cycles). Both lists are deleted once the
        entry is published, so a segment is called corrupt only when a second read shows
        the same bytes at the listed size (:meth:`ManifestIO.read_records_checked`); one
        that failed verification otherwise is left alone and read again next cycle.
        """
        listed = [item for item in self.io.segments(0) if item[0] not in self._pending]
        listed = listed[: self.policy.max_segments]
        folded: list[str] = []
        corrupt: list[str] = []
        loaded: list[Records] = []
        records = 0
        step = 4 * PARALLEL_GETS
        for start in range(0, len(listed), step):
            chunk = listed[start : start + step]
            reads = parallel(lambda item: self.io.read_segment_checked(*item), chunk)
            for (name, _size), got in zip(chunk, reads, strict=True):
                if got is Fault.CORRUPT:
                    corrupt.append(name)
                elif got is Fault.UNVERIFIED:
                    # NOTE: maybe a fault on the way: neither folded nor deleted; the next
                    # cycle reads it again (two GETs a cycle while the fault lasts).
                    continue
                else:
                    folded.append(name)
                    if got is not None:
                        loaded.append(got)
                        records += len(got)
            if records >= self.policy.snapshot_cap:
                break
        new = coalesce(np.concatenate(loaded)) if loaded else np.zeros(0, RECORD_DTYPE)
        return folded, corrupt, new

    def cached_delta(self, path: str) -> Records | None:
        """Records of a delta this term wrote and still names (no request), else ``None``."""
        return self._delta_cache.get(path)

    def _delta_records(self, entry: LogEntry) -> list[Records]:
        """Records of ``entry``'s deltas (cached when this term wrote them)."""

        def one(ref: DeltaRef) -> Records:
            cached = self._delta_cache.get(ref.path)
            if cached is not None:
                return cached
            records = self.io.read_records_checked(ref.path, count=ref.records)
            if records is Fault.UNVERIFIED:
                # NOTE: the merge or snapshot replaces this delta, which is then deleted:
                # folding it without its records would lose them for good. Retry the cycle.
                raise StorageError(f"delta {ref.path} failed verification; cycle retried")
            if records is None or records is Fault.CORRUPT:
                return np.zeros(0, RECORD_DTYPE)  # NOTE: gone, or corrupt in the bucket
            return records

        return parallel(one, list(entry.deltas))

    def _legacy(self) -> Records | None:
        if self._legacy_usage is None:
            return None
        rows = self._legacy_usage()
        self._legacy_usage = None  # NOTE: migrate once per term: the next entry has a snapshot
        return rows

    # --- deleting what is obsolete ----------------------------------------------------------

    def _after_publish(self, previous: LogEntry, published: LogEntry) -> None:
        """Delete what ``published`` made obsolete: never raises (a publish that succeeded
        always returns its entry; what could not be deleted is retried later)."""
        now = self._clock()
        self._delete_pending()
        gone = sorted(previous.objects() - published.objects())
        if gone:
            self._superseded.append((now + self.policy.grace_s, gone))
        for path in gone:
            self._delta_cache.pop(path, None)
        due = [paths for when, paths in self._superseded if when <= now]
        self._superseded = [(w, p) for w, p in self._superseded if w > now]
        self._delete([path for paths in due for path in paths])
        if self._monotonic() - self._last_sweep >= _SWEEP_EVERY or not self._last_sweep:
            self._last_sweep = self._monotonic()
            try:
                self.sweep(published)
            except (StorageError, CodecError) as exc:
                logger.warning("s3kv manifest: sweep failed (%s); retried later", exc.kind)

    def _delete_pending(self) -> None:
        if not self._pending:
            return
        names = sorted(self._pending)
        try:
            deleted = self.io.delete([SEGMENTS_DIR + name for name in names])
        except StorageError as exc:
            logger.warning("s3kv manifest: could not delete folded segments (%s)", exc.kind)
            return
        # NOTE: only names the server reported deleted leave the list; the others stay in
        # every entry's `folded` (so nobody folds them again) until a delete succeeds.
        self._pending.difference_update(path[len(SEGMENTS_DIR) :] for path in deleted)

    def _delete(self, paths: Iterable[str]) -> int:
        paths = list(paths)
        try:
            return len(self.io.delete(paths))
        except StorageError as exc:
            logger.warning("s3kv manifest: cleanup failed (%s); retried later", exc.kind)
            return 0

    def sweep(self, entry: LogEntry) -> int:
        """Delete unreferenced snapshot and delta objects and old log entries past grace.

        Objects of a term killed mid-cycle and of format-1 generations end here. Objects any
        kept log entry names are spared (a reader may still be loading an older version),
        as is anything younger than the grace period. Returns the objects deleted.
        """
        cutoff = self._clock() - self.policy.grace_s
        floor = entry.version - self.policy.keep_versions
        logs = [(log_version(n), modified) for n, modified in self._listed(LOG_DIR)]
        kept = sorted(v for v, _ in logs if v is not None and v >= floor)
        live = set(entry.objects())
        for version in kept:
            try:
                older = self.log.read(version) if version != entry.version else entry
            except CodecError:
                continue
            if older is not None:
                live |= older.objects()
        doomed: list[str] = []
        for directory in (SNAPSHOTS_DIR, DELTAS_DIR):
            for name, modified in self._listed(directory):
                path = directory + name
                if path not in live and modified < cutoff:
                    doomed.append(path)
        for found, modified in logs:
            if found is not None and found < floor and modified < cutoff:
                doomed.append(log_name(found))
        return self._delete(doomed)

    def _listed(self, directory: str) -> list[tuple[str, float]]:
        return list(self.io.list_modified(directory))
