"""The usage table of a fingerprint, for warm start and the operator commands.

:func:`load_usage` folds the newest snapshot's usage shards, its deltas and every segment
not folded yet (or, on a bucket with no log, the format-1 ``usage.bin`` and segments). The
whole table costs about 60 bytes per live key. With ``top``, it streams: one shard is folded
at a time and only the ``top`` hottest rows are kept, so warm-start planning inside the
engine holds one shard plus the records not yet in the snapshot (bounded by the compaction
policy's snapshot cap), whatever the key count.
"""

from __future__ import annotations

import numpy as np

from s3kv.errors import CodecError, StorageError
from s3kv.manifest.compactor import legacy_usage
from s3kv.manifest.filters import shard_of
from s3kv.manifest.format import USAGE_DTYPE, Records
from s3kv.manifest.io import Fault, ManifestIO, read_segments
from s3kv.manifest.log import DeltaRef, ManifestLog
from s3kv.manifest.snapshot import parallel, usage_shards
from s3kv.manifest.usage import UsageTable, fold, fold_sorted
from s3kv.storage import Backend

__all__ = ["hottest", "load_usage"]


def hottest(rows: Records, top: int) -> Records:
    """The ``top`` hottest rows (pinned, then hits, then last use), sorted by key."""
    if len(rows) > top:
        rank = np.lexsort(
            (-rows["last_used"], -rows["hits"].astype(np.int64), -rows["pinned"].astype(np.int64))
        )
        rows = rows[rank[:top]]
    halves = np.ascontiguousarray(rows["key"]).view(">u8").reshape(-1, 2)
    ordered: Records = rows[np.lexsort((halves[:, 1], halves[:, 0]))]
    return ordered


def _read_delta(io: ManifestIO, ref: DeltaRef) -> Records | None:
    """A delta's records (``None``: gone); a read that fails verification is read again.

    Raises:
        CodecError: corrupt in the bucket.
        StorageError: failed verification twice, differently (a fault on the way: retry).
    """
    records = io.read_records_checked(ref.path, count=ref.records)
    if records is Fault.CORRUPT:
        raise CodecError(f"delta: {ref.path} is corrupt")
    if records is Fault.UNVERIFIED:
        raise StorageError(f"delta: {ref.path} failed verification twice; retry")
    return records


def load_usage(
    backend: Backend, prefix: str, fingerprint: str, *, top: int | None = None
) -> UsageTable:
    """The usage of every live key (or of the ``top`` hottest), everything uncompacted folded in.

    Segments that cannot be read are skipped and counted in :attr:`UsageTable.segments_corrupt`
    (a read that fails verification is read once more first: a fault on the way heals).

    Raises:
        StorageError: the bucket failed.
        CodecError: the log entry or a snapshot shard is corrupt or missing.
    """
    io = ManifestIO(backend, prefix, fingerprint)
    entry = ManifestLog(io).latest()
    skip = frozenset(entry.folded) if entry is not None else frozenset[str]()
    pending: list[Records] = []
    if entry is not None:
        loaded = parallel(lambda ref: _read_delta(io, ref), list(entry.deltas))
        pending = [d for d in loaded if d is not None]
    segments, read, corrupt = read_segments(io, io.segments(0, skip))
    records = np.concatenate([*pending, segments]) if pending else segments
    snapshot = entry.snapshot if entry is not None else None
    if snapshot is None:
        base = legacy_usage(io) if entry is None else None
        rows = fold(np.zeros(0, USAGE_DTYPE) if base is None else base, records)
        kept = rows if top is None else hottest(rows, top)
    else:
        shard = shard_of(records["key"], snapshot.shard_bits)
        parts: list[Records] = []
        best = np.zeros(0, USAGE_DTYPE)
        for index, base_rows in usage_shards(io, snapshot):
            folded = fold_sorted(base_rows, records[shard == index])
            if top is None:
                parts.append(folded)
            else:
                best = hottest(np.concatenate([best, folded]), top)
        # NOTE: shards are ranges of leading key bits, so shard order is key order.
        kept = best if top is not None else (np.concatenate(parts) if parts else best)
    return UsageTable(
        kept,
        generation=snapshot.generation if snapshot else 0,
        segments_read=len(read),
        segments_corrupt=len(corrupt),
    )
