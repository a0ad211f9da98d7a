"""The in-bucket manifest: which block keys of a model fingerprint exist, and their usage.

The front of the manifest family: the store, warm start and :mod:`s3kv.ops` import from here,
never from the modules behind it. Objects live under ``<prefix>/<fp>/manifest/``: immutable
*segments* of records (write, hit, pin, unpin) that every instance appends, and *snapshots*
(a Bloom filter and a usage table per generation, named by the ``CURRENT`` pointer) that
compaction folds them into.

The parts, inward first (each imports only the ones listed before it)::

    format       wire formats and object names (segments, usage.bin, CURRENT)
    bloom        the vectorized, serializable Bloom filter
    io           ManifestIO (every manifest request, counted) and SegmentWriter (the one
                 way a segment is named and written)
    queue        the bounded queue of records waiting for the next flush
    usage        folding records into per-key usage; load_usage
    compaction   compact(): a new snapshot generation (the offline side)
    live         Manifest: one engine's Bloom filter, flush and refresh
"""

from s3kv.manifest.bloom import BloomFilter
from s3kv.manifest.compaction import CompactionReport, compact
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
from s3kv.manifest.usage import UsageRow, UsageTable, load_usage

__all__ = [
    "KIND_HIT",
    "KIND_PIN",
    "KIND_UNPIN",
    "KIND_WRITE",
    "RECORD_DTYPE",
    "UNKNOWN_PARENT",
    "USAGE_DTYPE",
    "BloomFilter",
    "CompactionReport",
    "Manifest",
    "ManifestIO",
    "Records",
    "SegmentWriter",
    "UsageRow",
    "UsageTable",
    "compact",
    "load_usage",
]
