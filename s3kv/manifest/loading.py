"""The whole usage table of a fingerprint, for warm start and the operator commands.

:func:`load_usage` folds the newest snapshot's usage shards, its deltas and every segment
not folded yet (or, on a bucket with no log, the format-1 ``usage.bin`` and segments) into
one :class:`~s3kv.manifest.usage.UsageTable` in memory: about 60 bytes per live key.
"""

from __future__ import annotations

import numpy as np

from s3kv.manifest.compactor import legacy_usage
from s3kv.manifest.format import RECORD_DTYPE, USAGE_DTYPE
from s3kv.manifest.io import ManifestIO, read_segments
from s3kv.manifest.log import ManifestLog
from s3kv.manifest.snapshot import parallel, read_delta, usage_shards
from s3kv.manifest.usage import UsageTable, fold
from s3kv.storage import Backend

__all__ = ["load_usage"]


def load_usage(backend: Backend, prefix: str, fingerprint: str) -> UsageTable:
    """The current usage of every live key, with everything not yet compacted folded in.

    Corrupt segments are skipped and counted in :attr:`UsageTable.segments_corrupt`.

    Raises:
        StorageError: the bucket failed.
        CodecError: the log entry or a snapshot shard is corrupt or missing.
    """
    io = ManifestIO(backend, prefix, fingerprint)
    entry = ManifestLog(io).latest()
    if entry is None:
        base = legacy_usage(io)
        usage = np.zeros(0, USAGE_DTYPE) if base is None else base
        skip: frozenset[str] = frozenset()
        generation, deltas = 0, [np.zeros(0, RECORD_DTYPE)]
    else:
        shards = [rows for _, rows in usage_shards(io, entry.snapshot)]
        usage = np.concatenate(shards) if shards else np.zeros(0, USAGE_DTYPE)
        skip = frozenset(entry.folded)
        generation = entry.snapshot.generation if entry.snapshot else 0
        loaded = parallel(lambda ref: read_delta(io, ref.path), list(entry.deltas))
        deltas = [d for d in loaded if d is not None] or [np.zeros(0, RECORD_DTYPE)]
    names = [name for name, _ in io.segments(0) if name not in skip]
    records, read, corrupt = read_segments(io, names)
    return UsageTable(
        fold(usage, np.concatenate([*deltas, records])),
        generation=generation,
        segments_read=len(read),
        segments_corrupt=len(corrupt),
    )
