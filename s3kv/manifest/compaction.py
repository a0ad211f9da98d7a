"""Compaction: fold every segment into a new snapshot generation (the offline side).

:func:`compact` reads ``CURRENT``, its usage table and every segment not yet folded, folds
them (:func:`s3kv.manifest.usage.fold`), writes generation N+1 (``bloom.bin``, ``usage.bin``,
then ``CURRENT``) and deletes what it supersedes. The operator commands call it (``s3kv
compact``, ``prune``, ``verify``, through :mod:`s3kv.ops`); engines never compact.

Concurrent compactors: each writes its snapshot objects with conditional PUTs under a new
generation number and re-reads ``CURRENT`` just before replacing it, so where the server
supports conditional PUT the loser notices and stops before writing ``CURRENT`` or deleting
anything. Where it does not, or in the window between that re-read and the PUT, the last
``CURRENT`` wins and the other compactor's deletions may remove segments that the winner did
not fold. Either way the damage is bounded to *manifest entries* — keys the Bloom filter no
longer knows — which costs future misses (and re-saves), never wrong data: the manifest only
ever decides what to try to GET or skip re-writing, and every GET is verified.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

import numpy as np

from s3kv.errors import CodecError, StorageError
from s3kv.manifest.bloom import BloomFilter
from s3kv.manifest.format import (
    CURRENT_NAME,
    SEGMENTS_DIR,
    SNAPSHOTS_DIR,
    USAGE_DTYPE,
    Current,
    Records,
    encode_usage,
    segment_time_ms,
    snapshot_generation,
    snapshot_paths,
)
from s3kv.manifest.io import ManifestIO, read_segments
from s3kv.manifest.usage import fold, remove_keys
from s3kv.storage import Backend

__all__ = ["CompactionReport", "compact"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompactionReport:
    """What :func:`compact` did.

    Attributes:
        generation: The generation written (or attempted, when ``lost_race``).
        keys: Live keys in the new snapshot.
        records_folded: Segment records folded in.
        segments_folded: Segments folded in.
        segments_corrupt: Segments skipped as corrupt (deleted like folded ones).
        segments_deferred: Segments named too far in the future (clock skew), left for later.
        segments_deleted: Folded segments deleted (older than the grace window).
        snapshots_deleted: Objects of generations older than the previous one deleted.
        keys_dropped: Live keys removed because they were in ``drop_keys``.
        listing_keys: Keys passed from a full listing.
        bloom_bytes: Size of ``bloom.bin``.
        usage_bytes: Size of ``usage.bin``.
        over_capacity: More live keys than the filter's capacity (raise ``bloom_capacity``).
        lost_race: Another compactor moved ``CURRENT`` first; nothing was replaced or deleted.
        requests: Requests issued.
    """

    generation: int
    keys: int
    records_folded: int
    segments_folded: int
    segments_corrupt: int
    segments_deferred: int
    segments_deleted: int
    snapshots_deleted: int
    keys_dropped: int
    listing_keys: int
    bloom_bytes: int
    usage_bytes: int
    over_capacity: bool
    lost_race: bool
    requests: int


def compact(
    backend: Backend,
    prefix: str,
    fingerprint: str,
    *,
    capacity: int,
    fpr: float,
    clock: Callable[[], float] = time.time,
    grace_s: float = 600.0,
    drop_keys: Collection[bytes] = (),
    full_listing_keys: Iterable[tuple[bytes, int, float]] | None = None,
) -> CompactionReport:
    """Fold every segment into a new snapshot generation, then delete what it supersedes.

    Steps: read ``CURRENT`` and its usage table; list all segments; fold those not yet
    folded (plus ``full_listing_keys``, minus ``drop_keys``); write ``bloom.bin`` and
    ``usage.bin`` of generation N+1 (conditional PUTs), re-check ``CURRENT``, write it; then
    delete folded segments older than the new watermark's grace window and snapshot
    generations older than the previous one. Folded segments within the window stay (named
    in ``CURRENT.folded``) because readers list from ``watermark time - grace_s``: a segment
    whose writer's clock lags, or whose PUT landed late, by less than ``grace_s`` is
    therefore still seen by readers and by the next compaction. Segments named more than
    ``grace_s / 2`` in the future (by this clock) are deferred, so a wild clock cannot push
    the watermark ahead of everyone else's segments.

    Args:
        backend: The bucket.
        prefix: The configured key prefix.
        fingerprint: The model fingerprint.
        capacity: Keys the new Bloom filter is sized for.
        fpr: Its false-positive rate at capacity.
        clock: Epoch seconds (injectable for tests).
        grace_s: Window for clock skew and late segment PUTs.
        drop_keys: Keys to remove (``prune`` passes the keys it deleted).
        full_listing_keys: ``(key, size, last_modified)`` of every block object, from a full
            bucket listing (``s3kv compact --full``); ``None`` to trust the manifest.

    Raises:
        StorageError: the bucket failed before ``CURRENT`` was replaced (nothing changed).
        CodecError: ``CURRENT`` or the current usage table is corrupt and no full listing
            was given to rebuild from.
    """
    io = ManifestIO(backend, prefix, fingerprint)
    now_ms = round(clock() * 1000)
    listing = None if full_listing_keys is None else list(full_listing_keys)
    snapshots = _snapshot_objects(io)
    raw_current, current, usage = _read_base(io, rebuild=listing is not None)
    generation = max([current.generation if current else 0, *snapshots]) + 1
    folded_before, to_fold, deferred = _classify(io, current, now_ms + round(grace_s * 500))
    records, read, corrupt = read_segments(io, to_fold)
    folded_rows = fold(usage, records, listing=listing or ())
    rows = remove_keys(folded_rows, drop_keys)

    bloom = BloomFilter.for_capacity(capacity, fpr)
    bloom.add_array(rows["key"])
    bloom_blob, usage_blob = bloom.to_bytes(), encode_usage(rows)
    watermark = max([current.watermark if current else "", *read, *corrupt])
    cutoff = max(0, (segment_time_ms(watermark) or 0) - round(grace_s * 1000))
    every_folded = {*folded_before, *read, *corrupt}
    bloom_path, usage_path = snapshot_paths(generation)
    pointer = Current(
        generation=generation,
        bloom=bloom_path,
        usage=usage_path,
        keys=len(rows),
        watermark=watermark,
        grace_s=grace_s,
        created_at=now_ms / 1000,
        folded=tuple(sorted(n for n in every_folded if _time_ms(n) >= cutoff)),
    )
    published = _publish(io, pointer, bloom_blob, usage_blob, raw_current)
    deleted = snapshots_deleted = 0
    if published:
        if len(rows) > capacity:
            logger.warning(
                "s3kv manifest: %d live keys exceed bloom_capacity=%d; false positives rise",
                len(rows),
                capacity,
            )
        keep_gens = {generation, current.generation if current else generation}
        deleted, snapshots_deleted = _cleanup(
            io,
            [SEGMENTS_DIR + n for n in every_folded if _time_ms(n) < cutoff],
            [path for gen, paths in snapshots.items() if gen not in keep_gens for path in paths],
        )
    return CompactionReport(
        generation=generation,
        keys=len(rows),
        records_folded=len(records),
        segments_folded=len(read),
        segments_corrupt=len(corrupt),
        segments_deferred=deferred,
        segments_deleted=deleted,
        snapshots_deleted=snapshots_deleted,
        keys_dropped=len(folded_rows) - len(rows),
        listing_keys=len(listing or ()),
        bloom_bytes=len(bloom_blob),
        usage_bytes=len(usage_blob),
        over_capacity=len(rows) > capacity,
        lost_race=not published,
        requests=io.requests,
    )


def _time_ms(name: str) -> int:
    return segment_time_ms(name) or 0


def _snapshot_objects(io: ManifestIO) -> dict[int, list[str]]:
    """Generation -> paths of its snapshot objects."""
    found: dict[int, list[str]] = {}
    for name, _size in io.list_dir(SNAPSHOTS_DIR):
        generation = snapshot_generation(SNAPSHOTS_DIR + name)
        if generation is not None:
            found.setdefault(generation, []).append(SNAPSHOTS_DIR + name)
    return found


def _read_base(io: ManifestIO, *, rebuild: bool) -> tuple[bytes | None, Current | None, Records]:
    """``CURRENT`` (raw and parsed) and its usage table; ``rebuild``: corrupt → empty."""
    raw = io.get(CURRENT_NAME)
    try:
        current = None if raw is None else Current.from_json(raw)
        usage = np.zeros(0, USAGE_DTYPE) if current is None else io.read_usage(current)
    except CodecError:
        if not rebuild:
            raise
        logger.warning("s3kv manifest: snapshot unreadable; rebuilding from the full listing")
        return raw, None, np.zeros(0, USAGE_DTYPE)
    return raw, current, usage


def _classify(
    io: ManifestIO, current: Current | None, future_ms: int
) -> tuple[list[str], list[str], int]:
    """Split all segments into (folded before, to fold, number deferred).

    Folded before: named in ``CURRENT.folded``, or at/below the watermark and older than its
    grace window (folded earlier, or arrived too late for any reader: lost alike). Deferred:
    named after ``future_ms`` (a clock far ahead).
    """
    folded = set(current.folded) if current else set()
    watermark = current.watermark if current else ""
    cutoff = current.listing_cutoff_ms if current else 0
    before: list[str] = []
    to_fold: list[str] = []
    deferred = 0
    for name, time_ms in io.segments(0):
        if name in folded or (name <= watermark and time_ms < cutoff):
            before.append(name)
        elif time_ms > future_ms:
            deferred += 1
        else:
            to_fold.append(name)
    return before, to_fold, deferred


def _publish(
    io: ManifestIO, pointer: Current, bloom: bytes, usage: bytes, raw_current: bytes | None
) -> bool:
    """Write the snapshot objects, then ``CURRENT``; ``False`` if another compactor won."""
    if not (
        io.put(pointer.bloom, bloom, if_absent=True)
        and io.put(pointer.usage, usage, if_absent=True)
    ):
        logger.warning("s3kv manifest: another compactor wrote generation %d", pointer.generation)
        return False
    if io.get(CURRENT_NAME) != raw_current:
        logger.warning("s3kv manifest: CURRENT moved during compaction; not replacing it")
        return False
    io.put(CURRENT_NAME, pointer.to_json())
    return True


def _cleanup(io: ManifestIO, segments: list[str], snapshots: list[str]) -> tuple[int, int]:
    """Delete superseded objects; (segments deleted, snapshot objects deleted)."""
    try:
        return io.delete(segments), io.delete(snapshots)
    except StorageError as exc:
        # NOTE: the new generation is already live; leftovers are deleted next time.
        logger.warning("s3kv manifest: cleanup after compaction failed (%s)", exc.kind)
        return 0, 0
