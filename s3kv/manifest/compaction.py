"""Operator compaction: take the lease, write a full snapshot, hand the lease back.

:func:`compact` is what ``s3kv compact``, ``prune`` and ``verify`` run (through
:mod:`s3kv.ops`). It is an ordinary compactor (:mod:`s3kv.manifest.compactor`) with a long
lease: it creates the next log entry naming itself (an engine compactor's next publish then
fails and it steps down), folds every delta and segment into a new snapshot (minus the keys
prune deleted, plus a full listing when asked), publishes it, and releases the lease so
that a running instance takes compaction back at its next check. Two operators racing:
one wins, the other reports ``lost_race`` and changed nothing.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Final

from s3kv.errors import StorageError
from s3kv.manifest.compactor import CompactionPolicy, Compactor, legacy_usage
from s3kv.manifest.io import ManifestIO
from s3kv.manifest.log import LogEntry, ManifestLog
from s3kv.storage import Backend

__all__ = ["OPERATOR_LEASE_S", "CompactionReport", "compact"]

#: The lease an operator compaction declares (engines wait this long before taking over
#: from an operator that died mid-way; a finished one releases at once).
OPERATOR_LEASE_S: Final = 3600.0


@dataclass(frozen=True)
class CompactionReport:
    """What :func:`compact` did.

    Attributes:
        generation: The snapshot generation written (0 when ``lost_race``).
        version: The log version that published it (0 when ``lost_race``).
        keys: Live keys in the new snapshot.
        shards: Its shard count.
        records_folded: Segment and delta records folded in.
        segments_folded: Segments folded in.
        segments_corrupt: Segments corrupt in the bucket (two reads alike), deleted like
            folded ones.
        keys_dropped: Live keys removed because they were in ``drop_keys``.
        listing_keys: Keys passed from a full listing.
        lost_race: Another compactor published first; nothing was replaced or deleted.
        requests: Requests issued.
    """

    generation: int
    version: int
    keys: int
    shards: int
    records_folded: int
    segments_folded: int
    segments_corrupt: int
    keys_dropped: int
    listing_keys: int
    lost_race: bool
    requests: int


def compact(
    backend: Backend,
    prefix: str,
    fingerprint: str,
    *,
    fpr: float,
    clock: Callable[[], float] = time.time,
    grace_s: float = 600.0,
    drop_keys: Collection[bytes] = (),
    full_listing_keys: Iterable[tuple[bytes, int, float]] | None = None,
    policy: CompactionPolicy | None = None,
) -> CompactionReport:
    """Fold everything into a new snapshot generation, then delete what it supersedes.

    Args:
        backend: The bucket.
        prefix: The configured key prefix.
        fingerprint: The model fingerprint.
        fpr: Target false-positive rate of the new filters.
        clock: Epoch seconds (injectable for tests).
        grace_s: How long superseded objects outlive their use (readers mid-load).
        drop_keys: Keys to remove (``prune`` passes the keys it deleted).
        full_listing_keys: ``(key, size, last_modified)`` of every block object, from a full
            bucket listing (``s3kv compact --full``); ``None`` to trust the manifest.
        policy: Shard size and the like (defaults otherwise).

    Raises:
        StorageError: the bucket failed (nothing was published, or the lease stays taken
            by this operator until it expires; readers are unaffected).
        CodecError: the snapshot is corrupt and no full listing was given to rebuild from.
    """
    io = ManifestIO(backend, prefix, fingerprint)
    base = policy or CompactionPolicy()
    compactor = Compactor(
        io,
        f"s3kv-cli-{secrets.token_hex(3)}",
        CompactionPolicy(**{**vars(base), "fpr": fpr, "grace_s": grace_s}),
        clock=clock,
        legacy_usage=lambda: legacy_usage(io),
    )
    listing = None if full_listing_keys is None else list(full_listing_keys)
    lost = CompactionReport(0, 0, 0, 0, 0, 0, 0, 0, len(listing or ()), True, 0)
    taken = compactor.take_over(ManifestLog(io).latest(), lease_s=OPERATOR_LEASE_S)
    if taken is None:
        return lost
    try:
        cycle = compactor.cycle(taken, force_snapshot=True, drop=drop_keys, listing=listing)
    except BaseException:
        _release(compactor, taken)
        raise
    entry = cycle.entry
    if entry is None or entry.snapshot is None:
        return CompactionReport(**{**vars(lost), "requests": io.requests})
    _release(compactor, entry)
    return CompactionReport(
        generation=entry.snapshot.generation,
        version=entry.version,
        keys=entry.snapshot.keys,
        shards=len(entry.snapshot.shard_keys),
        records_folded=cycle.records,
        segments_folded=cycle.segments,
        segments_corrupt=cycle.corrupt,
        keys_dropped=cycle.dropped,
        listing_keys=len(listing or ()),
        lost_race=False,
        requests=io.requests,
    )


def _release(compactor: Compactor, entry: LogEntry) -> None:
    # NOTE: if this fails, engines take over once the operator lease expires.
    with contextlib.suppress(StorageError):
        compactor.release(entry)
