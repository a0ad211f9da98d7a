"""Snapshots and deltas: writing them shard by shard, reading them in parallel.

A snapshot is ``2**shard_bits`` shards; shard ``i`` holds the keys whose leading bits are
``i`` as two objects, a usage table (:func:`~s3kv.manifest.format.encode_usage`) and an
:class:`~s3kv.manifest.xorfilter.XorFilter`. Shards are sized to ``shard_keys`` keys, so at
any key count every object stays far below S3's 5 GB single-PUT limit (8M keys ≈ 460 MB of
usage rows before compression), and writing a snapshot holds one shard in memory at a time.

A delta is one segment-format object (:func:`~s3kv.manifest.format.encode_records`) of
records coalesced per key (:func:`coalesce`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Final, TypeVar

import numpy as np

from s3kv.errors import CodecError
from s3kv.manifest.filters import shard_of
from s3kv.manifest.format import (
    KIND_WRITE,
    RECORD_DTYPE,
    USAGE_DTYPE,
    Records,
    decode_records,
    decode_usage,
    encode_records,
    encode_usage,
    max_encoded_len,
)
from s3kv.manifest.io import ManifestIO
from s3kv.manifest.log import SnapshotRef
from s3kv.manifest.usage import fold, fold_sorted, remove_keys
from s3kv.manifest.xorfilter import XorFilter

__all__ = [
    "PARALLEL_GETS",
    "coalesce",
    "delta_write_keys",
    "parallel",
    "read_delta",
    "read_filters",
    "read_usage_shard",
    "shard_bits_for",
    "usage_shards",
    "write_delta",
    "write_snapshot",
]

logger = logging.getLogger(__name__)

#: Requests in flight when reading several manifest objects.
PARALLEL_GETS: Final = 16
_MAX_SHARD_BITS: Final = 16

T = TypeVar("T")
R = TypeVar("R")


def parallel(fn: Callable[[T], R], items: Sequence[T], workers: int = PARALLEL_GETS) -> list[R]:
    """``[fn(item) for item in items]`` with up to ``workers`` calls at once (order kept)."""
    if len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(min(workers, len(items)), thread_name_prefix="s3kv-manifest") as pool:
        return list(pool.map(fn, items))


def shard_bits_for(keys: int, shard_keys: int) -> int:
    """Smallest ``b`` with ``keys / 2**b <= shard_keys`` (at most 16)."""
    bits = 0
    while bits < _MAX_SHARD_BITS and keys > shard_keys << bits:
        bits += 1
    return bits


# --- deltas ---------------------------------------------------------------------------

#: Class of each record kind (index): write 0, hit 1, pin or unpin 2; 3 is not a kind.
_CLASS_OF_KIND: Final = np.array([3, 0, 1, 2, 2], np.int8)


def coalesce(records: Records) -> Records:
    """One record per key and class (write, hit, pin-or-unpin), sorted by key.

    Writes keep the earliest (``first_written``) with the latest known size; hits add
    their counts and keep the latest time; of pins and unpins the latest wins. Folding the
    result gives the same usage as folding ``records`` (up to a key's size and parent
    when two writers disagreed, which they do not: both are the block's).
    """
    if not len(records):
        return np.zeros(0, RECORD_DTYPE)
    kinds = records["kind"].astype(np.intp)
    klass = _CLASS_OF_KIND[np.clip(kinds, 0, 4)]
    keep = klass < 3
    records, klass = records[keep], klass[keep]
    pairs = np.ascontiguousarray(records["key"]).view(">u8").reshape(-1, 2)
    # NOTE: writes sort by time ascending (earliest first); hits and pins take the last.
    order = np.lexsort((records["time"], klass, pairs[:, 1], pairs[:, 0]))
    records, klass, pairs = records[order], klass[order], pairs[order]
    new_group = np.ones(len(records), np.bool_)
    new_group[1:] = (
        (pairs[1:, 0] != pairs[:-1, 0])
        | (pairs[1:, 1] != pairs[:-1, 1])
        | (klass[1:] != klass[:-1])
    )
    starts = np.flatnonzero(new_group)
    ends = np.append(starts[1:], len(records)) - 1
    is_write = klass[starts] == 0
    out = records[np.where(is_write, starts, ends)].copy()
    out["count"] = np.minimum(np.add.reduceat(records["count"].astype(np.int64), starts), 2**32 - 1)
    out["count"][~(klass[starts] == 1)] = 1
    out["size"][is_write] = records["size"][ends[is_write]]
    return out


def write_delta(io: ManifestIO, path: str, records: Records) -> None:
    """PUT a delta object.

    Paths carry the writing term's random token and the version it is for, so only this
    term ever writes one; writing it again (a retry after a publish that failed) is safe
    because no published entry can name it yet.
    """
    io.put(path, encode_records(records))


def read_delta(io: ManifestIO, path: str, *, records: int) -> Records | None:
    """A delta's records; ``None`` if it is gone (a newer snapshot superseded it).

    Args:
        io: The manifest's objects.
        path: The delta's path.
        records: Its record count, from its :class:`~s3kv.manifest.log.DeltaRef`: an object
            declaring another, or longer than that many records can be, is corrupt (checked
            before anything is read or allocated).

    Raises:
        CodecError: corrupt.
    """
    data = io.get(path, max_bytes=max_encoded_len(records, RECORD_DTYPE))
    return None if data is None else decode_records(data, count=records)


# --- snapshots ------------------------------------------------------------------------


def read_usage_shard(io: ManifestIO, ref: SnapshotRef, shard: int) -> Records:
    """Usage rows of one shard.

    Raises:
        CodecError: missing or corrupt, or not holding the rows ``ref`` counts for it (one
            longer than those rows can be is refused unread).
    """
    path = ref.usage_path(shard)
    data = io.get(path, max_bytes=max_encoded_len(ref.shard_keys[shard], USAGE_DTYPE))
    if data is None:
        raise CodecError(f"usage: {path} is missing")
    return decode_usage(data, count=ref.shard_keys[shard])


def usage_shards(io: ManifestIO, ref: SnapshotRef | None) -> Iterator[tuple[int, Records]]:
    """``(shard, rows)`` of every shard, one in memory at a time."""
    if ref is None:
        return
    for shard in range(len(ref.shard_keys)):
        yield shard, read_usage_shard(io, ref, shard)


def read_filters(io: ManifestIO, ref: SnapshotRef) -> tuple[list[XorFilter], int]:
    """Every shard's filter, fetched in parallel; (filters, shards rebuilt from usage).

    A filter object that is missing or corrupt is rebuilt from its shard's usage table, and
    so is one longer than a filter of its shard's keys (refused unread).

    Raises:
        CodecError: a shard's filter and usage table are both unusable.
    """

    def one(shard: int) -> tuple[XorFilter, bool]:
        try:
            bound = XorFilter.serialized_size(ref.shard_keys[shard], ref.fp_bits)
            data = io.get(ref.filter_path(shard), max_bytes=bound)
            if data is not None:
                built = XorFilter.from_bytes(data)
                if built.keys == ref.shard_keys[shard]:
                    return built, False
        except CodecError:
            pass
        rows = read_usage_shard(io, ref, shard)
        return XorFilter.build(rows["key"], ref.fp_bits), True

    results = parallel(one, list(range(len(ref.shard_keys))))
    return [f for f, _ in results], sum(rebuilt for _, rebuilt in results)


def _base_rows(
    io: ManifestIO, base: SnapshotRef | None, shard: int, bits: int, cache: dict[int, Records]
) -> Records:
    """The base snapshot's rows that fall in new shard ``shard`` of ``2**bits``."""
    if base is None:
        return np.zeros(0, USAGE_DTYPE)
    if base.shard_bits >= bits:
        span = 1 << (base.shard_bits - bits)
        parts = [read_usage_shard(io, base, s) for s in range(shard * span, (shard + 1) * span)]
        return np.concatenate(parts) if parts else np.zeros(0, USAGE_DTYPE)
    parent = shard >> (bits - base.shard_bits)
    if parent not in cache:
        cache.clear()  # NOTE: children of one parent are consecutive: hold one parent only
        cache[parent] = read_usage_shard(io, base, parent)
    rows = cache[parent]
    inside: Records = rows[shard_of(rows["key"], bits) == shard]
    return inside


def write_snapshot(
    io: ManifestIO,
    base: SnapshotRef | None,
    records: Records,
    *,
    path: str,
    generation: int,
    shard_keys: int,
    fp_bits: int,
    created_at: float,
    base_rows: Records | None = None,
    listing: Sequence[tuple[bytes, int, float]] = (),
    drop: Collection[bytes] = (),
    after_shard: Callable[[], None] | None = None,
) -> tuple[SnapshotRef, int]:
    """Fold ``records`` (and ``listing``, minus ``drop``) into ``base``; write the shards.

    Returns the new snapshot and how many live keys ``drop`` removed.

    Streams shard by shard: memory is one shard's rows plus ``records``. ``base_rows`` is
    a base given whole instead of a snapshot (migrating a format-1 ``usage.bin``).
    ``after_shard`` is called after each shard is written (the compactor heartbeats there).
    Objects are written under the new ``path`` (this term's token), so nothing a reader
    can see changes until a log entry names the result.

    Raises:
        StorageError: a request failed (the new objects are orphans; compaction deletes
            them after the grace period).
        CodecError: a base shard is corrupt.
    """
    estimate = (base.keys if base else 0) + len(records) + len(listing)
    if base_rows is not None:
        estimate += len(base_rows)
    bits = max(shard_bits_for(estimate, shard_keys), base.shard_bits if base else 0)
    by_shard = shard_of(records["key"], bits)
    order = np.argsort(by_shard, kind="stable")
    records, by_shard = records[order], by_shard[order]
    bounds = np.searchsorted(by_shard, np.arange((1 << bits) + 1))
    listing_keys = np.frombuffer(b"".join(k for k, _, _ in listing), "V16") if listing else None
    listing_shard = shard_of(listing_keys, bits) if listing_keys is not None else None
    extra_shard = shard_of(base_rows["key"], bits) if base_rows is not None else None
    cache: dict[int, Records] = {}
    counts: list[int] = []
    dropped = 0
    ref = SnapshotRef(path, generation, bits, (), fp_bits, created_at)
    for shard in range(1 << bits):
        rows = _base_rows(io, base, shard, bits, cache)
        if base_rows is not None and extra_shard is not None:
            rows = np.concatenate([rows, base_rows[extra_shard == shard]])
        part_listing: Sequence[tuple[bytes, int, float]] = ()
        if listing_shard is not None:
            part_listing = [listing[int(i)] for i in np.flatnonzero(listing_shard == shard)]
        part = records[bounds[shard] : bounds[shard + 1]]
        if part_listing or base_rows is not None:
            live = fold(rows, part, listing=part_listing)
        else:
            live = fold_sorted(rows, part)  # base shards are sorted: fold only touched keys
        folded = remove_keys(live, drop)
        dropped += len(live) - len(folded)
        usage_blob = encode_usage(folded)
        filter_blob = XorFilter.build(folded["key"], fp_bits).to_bytes()
        # NOTE: plain PUTs: the path names this term's token (see write_delta).
        io.put(ref.usage_path(shard), usage_blob)
        io.put(ref.filter_path(shard), filter_blob)
        counts.append(len(folded))
        if after_shard is not None:
            after_shard()
    return SnapshotRef(path, generation, bits, tuple(counts), fp_bits, created_at), dropped


def delta_write_keys(records: Records) -> Records:
    """Keys of the write records (what readers add to their filters)."""
    keys: Records = records["key"][records["kind"] == KIND_WRITE]
    return keys
