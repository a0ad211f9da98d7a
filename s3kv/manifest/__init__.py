"""The in-bucket manifest: which block keys of a model fingerprint exist, and their usage.

The front of the manifest family: the store, warm start and :mod:`s3kv.ops` import from here,
never from the modules behind it. Objects live under ``<prefix>/<fp>/manifest/``: immutable
*segments* of records (write, hit, pin, unpin) that every instance appends; a numbered
*log* of entries, each naming a sharded *snapshot* and a few *deltas*, that the one elected
compactor publishes; and the ``LATEST`` hint. ``s3kv/manifest/README.md`` is the design,
with the request and memory formulas.

The parts, inward first (each imports only the ones listed before it)::

    format       wire formats and object names (segments, usage tables, format-1 CURRENT)
    bloom        the vectorized, serializable Bloom filter (growth partitions)
    xorfilter    the static xor filter (snapshot shards: 3.7 bytes per key)
    retry        RetryBook: reads that failed verification, retried with backoff (bounded)
    io           ManifestIO (every manifest request, counted and capped at the object's
                 largest legitimate size) and SegmentWriter (the one way a segment is named
                 and written)
    queue        the bounded queue of records waiting for the next flush
    usage        folding records into per-key usage; UsageTable
    log          log entries, the LATEST hint, conditional appends (lease and fencing)
    filters      KeyFilter: snapshot shards plus scalable growth partitions
    snapshot     writing sharded snapshots and deltas, reading them in parallel
    compactor    Compactor: election, cycles (delta, merge, snapshot), sweeping
    compaction   compact(): the operator's full compaction through the same lease
    loading      load_usage(): the whole usage table, for warm start and ops
    shards       one manifest shared by the shards of a TP layout
    live         Manifest: one instance's filter, flush, refresh and compactor duty
"""

from s3kv.manifest.bloom import BloomFilter
from s3kv.manifest.compaction import CompactionReport, compact
from s3kv.manifest.compactor import CompactionPolicy, Compactor, CycleReport
from s3kv.manifest.filters import KeyFilter
from s3kv.manifest.format import (
    KIND_HIT,
    KIND_PIN,
    KIND_UNPIN,
    KIND_WRITE,
    RECORD_DTYPE,
    UNKNOWN_PARENT,
    USAGE_DTYPE,
    Records,
)
from s3kv.manifest.io import ManifestIO, SegmentWriter
from s3kv.manifest.live import Manifest
from s3kv.manifest.loading import load_usage
from s3kv.manifest.log import DeltaRef, LogEntry, ManifestLog, SnapshotRef
from s3kv.manifest.shards import ShardedPresence, ShardView
from s3kv.manifest.usage import UsageRow, UsageTable
from s3kv.manifest.xorfilter import XorFilter

__all__ = [
    "KIND_HIT",
    "KIND_PIN",
    "KIND_UNPIN",
    "KIND_WRITE",
    "RECORD_DTYPE",
    "UNKNOWN_PARENT",
    "USAGE_DTYPE",
    "BloomFilter",
    "CompactionPolicy",
    "CompactionReport",
    "Compactor",
    "CycleReport",
    "DeltaRef",
    "KeyFilter",
    "LogEntry",
    "Manifest",
    "ManifestIO",
    "ManifestLog",
    "Records",
    "SegmentWriter",
    "ShardView",
    "ShardedPresence",
    "SnapshotRef",
    "UsageRow",
    "UsageTable",
    "XorFilter",
    "compact",
    "load_usage",
]
