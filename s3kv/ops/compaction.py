"""Compact: fold each fingerprint's manifest segments into a new snapshot generation.

A thin loop over :func:`s3kv.manifest.compact`, which documents the protocol (new
generation written with conditional PUTs, ``CURRENT`` replaced last, folded segments and
superseded generations deleted, safe against concurrent engines and compactors).

``full=True`` also lists every block object and folds the listing in: keys whose segments
were lost (a writer's clock beyond the grace window, a crash between PUT and flush, a
corrupt snapshot) become known again, with ``LastModified`` as their write and last-use
time. It is also the way to rebuild an unreadable snapshot. Keys the manifest lists whose
objects are gone are *not* removed by a full compaction (prune does that, for stale keys),
because an object can be listed a moment after an engine recorded it.

Compaction addresses manifests, not block directories: a TP shard in scope compacts its
layout's manifest (:attr:`~s3kv.ops.scope.Fingerprint.manifest_fingerprint`), and a
manifest shared by several fingerprints in scope is compacted once. ``full=True`` on a
layout's manifest lists every shard's blocks and folds in only the keys *every* shard holds
(the manifest advertises a block once all of its shards exist), each with the latest
``LastModified`` of its shards and the largest stored size of its shards: what engines
record for it (:mod:`s3kv.manifest.shards`), and what warm start budgets one shard by.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from s3kv.errors import CodecError
from s3kv.keys import HASH_BYTES
from s3kv.manifest import CompactionReport, compact
from s3kv.ops import ProgressFn, no_progress
from s3kv.ops.scope import Fingerprint, first_per_manifest, list_blocks
from s3kv.storage import Backend

__all__ = ["CompactAllReport", "compact_scope"]

_KEY: Final = np.dtype(f"V{HASH_BYTES}")


@dataclass(frozen=True)
class CompactAllReport:
    """One :class:`~s3kv.manifest.CompactionReport` per manifest.

    Attributes:
        full: Whether a listing was folded in.
        reports: ``(manifest fingerprint, report)`` in scope order, once per manifest (a TP
            shard's manifest is its layout's).
    """

    full: bool
    reports: tuple[tuple[str, CompactionReport], ...]

    @property
    def lost_races(self) -> list[str]:
        """Fingerprints where another compactor won (nothing replaced there)."""
        return [fp for fp, report in self.reports if report.lost_race]


def compact_scope(
    backend: Backend,
    scope: Sequence[Fingerprint],
    *,
    prefix: str,
    fpr: float,
    full: bool = False,
    clock: Callable[[], float] = time.time,
    progress: ProgressFn = no_progress,
) -> CompactAllReport:
    """Compact the manifest of every fingerprint in ``scope`` (once each).

    Args:
        backend: The bucket.
        scope: Fingerprints whose manifests to compact.
        prefix: The configured key prefix.
        fpr: ``bloom_fpr`` for them.
        full: Fold in a listing of the block objects too (for a layout: of every shard).
        clock: Epoch seconds.
        progress: Called with ``("compact", manifests done, manifests)``.

    Raises:
        StorageError: the bucket failed (a manifest whose ``CURRENT`` was not yet
            replaced is unchanged).
        CodecError: a snapshot is unreadable and ``full`` is off (the message says so).
    """
    targets = {fp.manifest_fingerprint: fp.manifest_shards for fp in first_per_manifest(scope)}
    reports: list[tuple[str, CompactionReport]] = []
    for done, (manifest, shards) in enumerate(targets.items(), start=1):
        listing = _listing(backend, prefix, shards) if full else None
        try:
            report = compact(
                backend,
                prefix,
                manifest,
                fpr=fpr,
                clock=clock,
                full_listing_keys=listing,
            )
        except CodecError as exc:
            raise CodecError(
                f"the manifest snapshot of {manifest} is unreadable ({exc}): "
                "re-run with --full to rebuild it from a listing"
            ) from exc
        reports.append((manifest, report))
        progress("compact", done, len(targets))
    return CompactAllReport(full=full, reports=tuple(reports))


def _listing(
    backend: Backend, prefix: str, shards: Sequence[str]
) -> Iterable[tuple[bytes, int, float]]:
    """``(key, size, last_modified)`` of the blocks a manifest describes.

    One fingerprint: every block object, as listed. The shards of a layout: the keys every
    shard holds, sorted, each with its shards' largest size and latest ``LastModified``.
    """
    if len(shards) == 1:
        return [
            (bytes(obj.block), obj.size, obj.last_modified)
            for obj in list_blocks(backend, prefix, shards[0])
            if obj.block is not None
        ]
    keys: npt.NDArray[np.void] | None = None
    sizes = np.zeros(0, np.int64)
    modified = np.zeros(0, np.float64)
    for shard in shards:
        k, z, m = _shard_listing(backend, prefix, shard)
        if keys is None:
            keys, sizes, modified = k, z, m
            continue
        keys, mine, theirs = np.intersect1d(keys, k, assume_unique=True, return_indices=True)
        sizes = np.maximum(sizes[mine], z[theirs])
        modified = np.maximum(modified[mine], m[theirs])
    if keys is None:
        return []
    return zip(keys.tolist(), sizes.tolist(), modified.tolist(), strict=True)


def _shard_listing(
    backend: Backend, prefix: str, shard: str
) -> tuple[npt.NDArray[np.void], npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """One shard's block keys (sorted, unique), with the largest size and latest
    ``LastModified`` of the objects of each (a key may have more than one object)."""
    found = [
        (bytes(obj.block), obj.size, obj.last_modified)
        for obj in list_blocks(backend, prefix, shard)
        if obj.block is not None and len(obj.block) == HASH_BYTES
    ]
    if not found:
        return np.zeros(0, _KEY), np.zeros(0, np.int64), np.zeros(0, np.float64)
    keys = np.array([key for key, _, _ in found], _KEY)
    sizes = np.array([size for _, size, _ in found], np.int64)
    modified = np.array([when for _, _, when in found], np.float64)
    unique, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    if len(unique) == len(keys):
        return unique, sizes[first], modified[first]
    top_size = np.zeros(len(unique), np.int64)
    top_modified = np.full(len(unique), -np.inf)
    np.maximum.at(top_size, inverse, sizes)
    np.maximum.at(top_modified, inverse, modified)
    return unique, top_size, top_modified
