"""Counted access to one fingerprint's manifest objects, and the one segment writer.

:class:`ManifestIO` is the one place that issues manifest requests, and counts them; the
live manifest (:mod:`s3kv.manifest.live`), compaction and usage loading all read and write
through it. :class:`SegmentWriter` is the one way a segment is named and written: the live
manifest flushes through it, and so does ``s3kv pin`` (:mod:`s3kv.ops.pins`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Final, Literal

import numpy as np

from s3kv.errors import CodecError, PreconditionFailedError
from s3kv.keys import manifest_prefix
from s3kv.manifest.format import (
    CURRENT_NAME,
    RECORD_DTYPE,
    SEGMENTS_DIR,
    Current,
    Records,
    decode_records,
    decode_usage,
    encode_records,
    segment_name,
    segment_time_ms,
    segments_start_after,
)
from s3kv.storage import DELETE_BATCH, Backend, ObjectInfo

__all__ = ["ManifestIO", "SegmentWriter", "read_segments"]

logger = logging.getLogger(__name__)

_LIST_PAGE: Final = 1000
_NAME_ATTEMPTS: Final = 5


class ManifestIO:
    """Counted access to one fingerprint's manifest objects.

    Every method may raise :class:`~s3kv.errors.StorageError` from the backend; decoding
    methods also raise :class:`~s3kv.errors.CodecError`.

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

    def get(self, path: str) -> bytes | None:
        """The object at ``path`` (relative to the manifest prefix), or ``None``."""
        self._count()
        return self.backend.get(self.root + path)

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
        data = self.get(CURRENT_NAME)
        return None if data is None else Current.from_json(data)

    def segments(self, cutoff_ms: int, skip: Collection[str] = ()) -> list[tuple[str, int]]:
        """``(name, time ms)`` of segments created at or after ``cutoff_ms``, minus ``skip``.

        One listing request per 1000 names, starting at the cutoff (never the whole history).
        """
        found: list[tuple[str, int]] = []
        for name, _size in self.list_dir(SEGMENTS_DIR, segments_start_after(cutoff_ms)):
            time_ms = segment_time_ms(name)
            if time_ms is not None and name not in skip:
                found.append((name, time_ms))
        return found

    def read_segment(self, name: str) -> Records | None:
        """The verified records of segment ``name``; ``None`` if it is gone (compacted)."""
        data = self.get(SEGMENTS_DIR + name)
        return None if data is None else decode_records(data)

    def read_segment_checked(self, name: str) -> Records | Literal[False] | None:
        """Like :meth:`read_segment`, but a corrupt segment is logged and gives ``False``."""
        try:
            return self.read_segment(name)
        except CodecError as exc:
            logger.warning("s3kv manifest: skipping corrupt segment %s (%s)", name, exc.kind)
            return False

    def read_usage(self, current: Current) -> Records:
        """The usage table of ``current``'s snapshot.

        Raises:
            CodecError: missing or corrupt.
        """
        data = self.get(current.usage)
        if data is None:
            raise CodecError(f"usage: {current.usage} is missing (CURRENT is stale?)")
        return decode_usage(data)


def read_segments(io: ManifestIO, names: Iterable[str]) -> tuple[Records, list[str], list[str]]:
    """(records, names read, names corrupt) of ``names``; a segment that vanished is neither.

    The records of every segment read come back as one array. Corrupt segments are logged
    (WARNING) and skipped; storage errors propagate.
    """
    batches: list[Records] = []
    read: list[str] = []
    corrupt: list[str] = []
    for name in names:
        records = io.read_segment_checked(name)
        if records is False:
            corrupt.append(name)
        elif records is not None:
            batches.append(records)
            read.append(name)
    records = np.concatenate(batches) if batches else np.zeros(0, RECORD_DTYPE)
    return records, read, corrupt


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
        """PUT one segment holding ``records`` (of ``RECORD_DTYPE``); returns its name.

        Raises:
            StorageError: the PUT failed (nothing was written).
            PreconditionFailedError: every name tried was taken (is ``instance_id`` shared?).
        """
        blob = encode_records(records)
        for _ in range(_NAME_ATTEMPTS):
            with self._lock:
                seq, self._seq = self._seq, self._seq + 1
            name = segment_name(round(self._clock() * 1000), self._instance_id, seq)
            if self._io.put(SEGMENTS_DIR + name, blob, if_absent=True):
                return name
        raise PreconditionFailedError("segment names taken: is instance_id shared?")
