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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from s3kv.errors import CodecError
from s3kv.manifest import CompactionReport, compact
from s3kv.ops import ProgressFn, no_progress
from s3kv.ops.scope import Fingerprint, list_blocks
from s3kv.storage import Backend

__all__ = ["CompactAllReport", "compact_scope"]


@dataclass(frozen=True)
class CompactAllReport:
    """One :class:`~s3kv.manifest.CompactionReport` per fingerprint.

    Attributes:
        full: Whether a listing was folded in.
        reports: ``(fingerprint, report)`` in scope order.
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
    """Compact every fingerprint in ``scope``.

    Args:
        backend: The bucket.
        scope: Fingerprints to compact.
        prefix: The configured key prefix.
        fpr: ``bloom_fpr`` for them.
        full: Fold in a listing of the block objects too.
        clock: Epoch seconds.
        progress: Called with ``("compact", fingerprints done, fingerprints)``.

    Raises:
        StorageError: the bucket failed (a fingerprint whose ``CURRENT`` was not yet
            replaced is unchanged).
        CodecError: a snapshot is unreadable and ``full`` is off (the message says so).
    """
    reports: list[tuple[str, CompactionReport]] = []
    for done, fp in enumerate(scope, start=1):
        listing = None
        if full:
            listing = [
                (bytes(obj.block), obj.size, obj.last_modified)
                for obj in list_blocks(backend, prefix, fp.fingerprint)
                if obj.block is not None
            ]
        try:
            report = compact(
                backend,
                prefix,
                fp.fingerprint,
                fpr=fpr,
                clock=clock,
                full_listing_keys=listing,
            )
        except CodecError as exc:
            raise CodecError(
                f"the manifest snapshot of {fp.fingerprint} is unreadable ({exc}): "
                "re-run with --full to rebuild it from a listing"
            ) from exc
        reports.append((fp.fingerprint, report))
        progress("compact", done, len(scope))
    return CompactAllReport(full=full, reports=tuple(reports))
