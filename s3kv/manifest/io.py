"""Counted access to one fingerprint's manifest objects, checked reads, the segment writer.

:class:`ManifestIO` is the one place that issues manifest requests, and counts them; the
live manifest (:mod:`s3kv.manifest.live`), compaction and usage loading all read and write
through it. :class:`SegmentWriter` is the one way a segment is named and written: the live
manifest flushes through it, and so does ``s3kv pin`` (:mod:`s3kv.ops.pins`).

Every GET is capped at the longest object of its kind (``max_bytes``): a longer one is
refused before its body is read, as corrupt, so junk under a manifest name costs no memory.

A read that fails verification may be a fault on the way rather than in the bucket:
:meth:`ManifestIO.read_records_checked` tells the two apart as far as two reads can
(:class:`Fault`), and :class:`~s3kv.manifest.retry.RetryBook` keeps the ones to read again
later, bounded.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterable, Iterator
from enum import Enum
from typing import Final

import numpy as np

from s3kv.errors import (
    CodecError,
    ObjectTooLargeError,
    PreconditionFailedError,
    SizeMismatchError,
)
from s3kv.keys import manifest_prefix
from s3kv.manifest.format import (
    CURRENT_NAME,
    MAX_CURRENT_BYTES,
    MAX_SEGMENT_BYTES,
    MAX_SEGMENT_RECORDS,
    RECORD_DTYPE,
    SEGMENTS_DIR,
    USAGE_DTYPE,
    Current,
    Records,
    decode_records,
    decode_usage,
    encode_records,
    max_encoded_len,
    segment_name,
    segment_time_ms,
    segments_start_after,
)
from s3kv.storage import DELETE_BATCH, Backend, ObjectInfo

__all__ = ["Fault", "ManifestIO", "SegmentWriter", "read_segments"]

logger = logging.getLogger(__name__)

_LIST_PAGE: Final = 1000
_NAME_ATTEMPTS: Final = 5


class Fault(Enum):
    """Why a read gave no records although the object exists."""

    #: Two identical bodies, as long as listed, fail verification: corrupt in the bucket.
    CORRUPT = "corrupt"
    #: Failed verification, but not the same way twice: a fault on the way, not proven
    #: to be in the bucket (read it again later; never delete it on this evidence).
    UNVERIFIED = "unverified"


class ManifestIO:
    """Counted access to one fingerprint's manifest objects.

    Every method may raise :class:`~s3kv.errors.StorageError` from the backend; reading
    methods also raise :class:`~s3kv.errors.CodecError`, for an object that fails its
    checks or is longer than its kind can be (refused unread).

    Args:
        backend: The bucket.
        prefix: The configured key prefix.
        fingerprint: The model fingerprint.
    """

    def __init__(self, backend: Backend, prefix: str, fingerprint: str) -> None:
        self.backend = backend
        self.root = manifest_prefix(prefix, fingerprint)
        self._requests = 0
        self._lock = threading.Lock()

    @property
    def requests(self) -> int:
        """Requests issued so far (a listing counts one per page of 1000 keys)."""
        return self._requests

    def _count(self, n: int = 1) -> None:
        with self._lock:
            self._requests += n

    def get(self, path: str, *, max_bytes: int) -> bytes | None:
        """The object at ``path`` (relative to the manifest prefix), or ``None``.

        Raises:
            SizeMismatchError: the object is longer than ``max_bytes`` (the longest its
                kind can be): refused unread, and corrupt like any object failing its checks.
        """
        try:
            return self._get(path, max_bytes)
        except ObjectTooLargeError as exc:
            raise SizeMismatchError(
                f"manifest {path}: more than the {max_bytes} bytes its kind can be; not read "
                "(a corrupt or foreign object)"
            ) from exc

    def _get(self, path: str, max_bytes: int) -> bytes | None:
        """:meth:`get`, raising :class:`ObjectTooLargeError` for an object too long."""
        self._count()
        return self.backend.get(self.root + path, max_bytes=max_bytes)

    def put(self, path: str, data: bytes, *, if_absent: bool = False) -> bool:
        """PUT ``data`` at ``path``; ``False`` only when ``if_absent`` found it present."""
        self._count()
        return self.backend.put(self.root + path, data, if_absent=if_absent)

    def delete(self, paths: Collection[str]) -> list[str]:
        """Delete ``paths``; returns those the server reported deleted (relative paths)."""
        if not paths:
            return []
        self._count(-(-len(paths) // DELETE_BATCH))
        result = self.backend.delete_many([self.root + path for path in paths])
        for key, reason in list(result.failed.items())[:3]:
            logger.warning("s3kv manifest: could not delete %s: %s", key, reason)
        return [key[len(self.root) :] for key in result.deleted if key.startswith(self.root)]

    def _listing(self, directory: str, start_after: str | None) -> Iterator[tuple[str, ObjectInfo]]:
        """``(name relative to directory, info)``, counting one request per page of 1000."""
        base = self.root + directory
        self._count()
        after = None if start_after is None else base + start_after
        for seen, info in enumerate(self.backend.list(base, start_after=after), start=1):
            if seen % _LIST_PAGE == 0:
                self._count()
            yield info.key[len(base) :], info

    def list_dir(self, directory: str, start_after: str | None = None) -> Iterator[tuple[str, int]]:
        """``(name relative to directory, size)`` of the objects under ``directory``."""
        for name, info in self._listing(directory, start_after):
            yield name, info.size

    def list_modified(self, directory: str) -> Iterator[tuple[str, float]]:
        """``(name relative to directory, last modified epoch s)`` of its objects."""
        for name, info in self._listing(directory, None):
            yield name, info.last_modified

    def read_current(self) -> Current | None:
        """The ``CURRENT`` pointer, or ``None`` if no compaction ever ran.

        Raises:
            CodecError: ``CURRENT`` exists but is not a valid pointer.
        """
        data = self.get(CURRENT_NAME, max_bytes=MAX_CURRENT_BYTES)
        return None if data is None else Current.from_json(data)

    def segments(self, cutoff_ms: int, skip: Collection[str] = ()) -> list[tuple[str, int]]:
        """``(name, size)`` of segments created at or after ``cutoff_ms``, minus ``skip``.

        One listing request per 1000 names, starting at the cutoff (never the whole history).
        """
        found: list[tuple[str, int]] = []
        for name, size in self.list_dir(SEGMENTS_DIR, segments_start_after(cutoff_ms)):
            if segment_time_ms(name) is not None and name not in skip:
                found.append((name, size))
        return found

    def read_segment(self, name: str) -> Records | None:
        """The verified records of segment ``name``; ``None`` if it is gone (compacted).

        Raises:
            CodecError: corrupt, or longer than any segment can be.
        """
        data = self.get(SEGMENTS_DIR + name, max_bytes=MAX_SEGMENT_BYTES)
        return None if data is None else decode_records(data)

    def read_segment_checked(self, name: str, size: int | None = None) -> Records | Fault | None:
        """Segment ``name`` read with :meth:`read_records_checked`."""
        return self.read_records_checked(SEGMENTS_DIR + name, size)

    def read_records_checked(
        self, path: str, size: int | None = None, *, count: int | None = None
    ) -> Records | Fault | None:
        """The verified records of a segment-format object (segment or delta), or why not.

        ``None``: it is gone. A body that fails verification is read once more: a fault on
        the way (a flipped bit, a body cut short) rarely repeats, and the second body is
        used if it verifies. Otherwise :attr:`Fault.CORRUPT` only when both bodies are
        identical and as long as the object is (``size`` from a listing, else one HEAD):
        the object in the bucket is corrupt, and deleting it loses nothing readable. Else
        :attr:`Fault.UNVERIFIED`: read it again later, and never delete it on this
        evidence. ``count`` is the record count the caller knows (a delta's, from its log
        entry): a body declaring another fails verification.

        Each GET is capped: at the longest object ``count`` records make, else at the
        longest segment (:data:`~s3kv.manifest.format.MAX_SEGMENT_BYTES`). A longer object
        is refused unread, and :attr:`Fault.CORRUPT` when its stored size (listed, else one
        HEAD) is over the cap too.

        Raises:
            StorageError: a request failed.
        """
        bound = MAX_SEGMENT_BYTES if count is None else max_encoded_len(count, RECORD_DTYPE)
        try:
            data = self._get(path, bound)
            if data is None:
                return None
            try:
                return decode_records(data, count=count)
            except CodecError as exc:
                first = exc
            again = self._get(path, bound)
        except ObjectTooLargeError:
            return self._oversized(path, size, bound)
        if again is None:
            return None
        try:
            return decode_records(again, count=count)
        except CodecError:
            pass
        if size is None and again == data:
            size = self._stored_size(path)
            if size is None:
                return None
        if again == data and len(data) == size:
            logger.warning("s3kv manifest: skipping corrupt object %s (%s)", path, first.kind)
            return Fault.CORRUPT
        logger.info(
            "s3kv manifest: %s failed verification twice (%s), not the same way or not at its "
            "stored size: taken for a fault on the way, to read again later",
            path,
            first.kind,
        )
        return Fault.UNVERIFIED

    def _oversized(self, path: str, size: int | None, bound: int) -> Fault | None:
        """Why ``path``, refused as longer than ``bound``, gave no records (``None``: gone)."""
        if size is None:
            size = self._stored_size(path)
            if size is None:
                return None
        if size > bound:
            logger.warning(
                "s3kv manifest: skipping corrupt object %s (%d bytes, at most %d expected)",
                path,
                size,
                bound,
            )
            return Fault.CORRUPT
        # NOTE: the GET said too long, the listing (or HEAD) says not: two answers that
        # disagree are no proof that the object is corrupt. Read it again later.
        logger.info("s3kv manifest: %s was refused as too long, but is %d bytes", path, size)
        return Fault.UNVERIFIED

    def _stored_size(self, path: str) -> int | None:
        """The stored size of ``path`` by one HEAD (``None``: gone)."""
        self._count()
        info = self.backend.head(self.root + path)
        return None if info is None else info.size

    def read_usage(self, current: Current) -> Records:
        """The usage table of ``current``'s snapshot.

        Raises:
            CodecError: missing or corrupt, or longer than ``current.keys`` rows can be.
        """
        bound = max_encoded_len(max(0, current.keys), USAGE_DTYPE)  # NOTE: it holds `keys` rows
        data = self.get(current.usage, max_bytes=bound)
        if data is None:
            raise CodecError(f"usage: {current.usage} is missing (CURRENT is stale?)")
        return decode_usage(data)


def read_segments(
    io: ManifestIO, segments: Iterable[tuple[str, int]]
) -> tuple[Records, list[str], list[str]]:
    """(records, names read, names not read) of ``(name, listed size)`` pairs.

    A segment that vanished is neither read nor counted. The records of every segment read
    come back as one array. Segments that cannot be read (:meth:`ManifestIO.read_records_checked`:
    corrupt, or failing verification on both reads) are logged and skipped; storage errors
    propagate.
    """
    batches: list[Records] = []
    read: list[str] = []
    unread: list[str] = []
    for name, size in segments:
        records = io.read_segment_checked(name, size)
        if isinstance(records, Fault):
            unread.append(name)
        elif records is not None:
            batches.append(records)
            read.append(name)
    records = np.concatenate(batches) if batches else np.zeros(0, RECORD_DTYPE)
    return records, read, unread


class SegmentWriter:
    """Writes the segments of one writer: named ``<clock ms>-<instance_id>-<seq>.seg``.

    Each PUT is conditional (If-None-Match) so a name is never overwritten; a name already
    taken (another writer with the same ``instance_id``) moves on to the next sequence
    number, a few times. Thread-safe.

    Args:
        io: Where to write (its request counter counts the PUTs).
        instance_id: The writer's name in segment names (1-64 of ``[A-Za-z0-9._-]``).
        clock: Epoch seconds for the names.
    """

    def __init__(self, io: ManifestIO, instance_id: str, clock: Callable[[], float]) -> None:
        self._io = io
        self._instance_id = instance_id
        self._clock = clock
        self._seq = 0
        self._lock = threading.Lock()

    def write(self, records: Records) -> str:
        """PUT ``records`` (of ``RECORD_DTYPE``) as one segment; returns its name.

        More than :data:`~s3kv.manifest.format.MAX_SEGMENT_RECORDS` go in several segments,
        in order (the name returned is the last one's), so that no segment is ever longer
        than readers accept.

        Raises:
            StorageError: a PUT failed (the segments before it were written: records
                written again later are only coalesced).
            PreconditionFailedError: every name tried was taken (is ``instance_id`` shared?).
        """
        name = ""
        for start in range(0, max(1, len(records)), MAX_SEGMENT_RECORDS):
            name = self._write_one(records[start : start + MAX_SEGMENT_RECORDS])
        return name

    def _write_one(self, records: Records) -> str:
        blob = encode_records(records)
        for _ in range(_NAME_ATTEMPTS):
            with self._lock:
                seq, self._seq = self._seq, self._seq + 1
            name = segment_name(round(self._clock() * 1000), self._instance_id, seq)
            if self._io.put(SEGMENTS_DIR + name, blob, if_absent=True):
                return name
        raise PreconditionFailedError("segment names taken: is instance_id shared?")
