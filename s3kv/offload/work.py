"""The work of one job, as a codec process (or the store's own thread) does it.

:func:`open_stored` is the one place a stored object becomes a verified header: both the
store's in-thread path and the codec processes call it, so the two read blocks identically.
"""

from __future__ import annotations

import time

from s3kv import codec
from s3kv.arena import SlabArena
from s3kv.auth import Keyring, seal, unseal
from s3kv.errors import CodecError, SizeMismatchError, StorageError
from s3kv.offload.jobs import Failure, FetchJob, Outcome, SaveJob
from s3kv.storage import Backend


def open_stored(
    stored: bytes | memoryview,
    *,
    object_key: str,
    keyring: Keyring | None,
    block_nbytes: int | None,
) -> tuple[bytes | memoryview, codec.Header]:
    """Open a stored block (unseal when keyed) and read its header.

    Returns:
        The encoded block (valid until this thread's next :func:`~s3kv.auth.unseal`) and its
        verified header.

    Raises:
        CodecError: not a block, not sealed as required, forged, or of another size than
            ``block_nbytes`` (when given).
    """
    blob: bytes | memoryview = stored
    if keyring is not None:
        blob = unseal(stored, object_key=object_key, keyring=keyring)
    header = codec.read_header(blob)
    if block_nbytes is not None and header.raw_len != block_nbytes:
        raise SizeMismatchError(
            f"object holds {header.raw_len} raw bytes; the model's block is {block_nbytes}"
        )
    return blob, header


def fetch(
    job_id: int, job: FetchJob, backend: Backend, arena: SlabArena, keyring: Keyring | None
) -> Outcome:
    """GET, open, verify and decode one block into its slot. Never raises an S3KVError.

    The slot is written only by a decode that verified; a failed job may have written part
    of it, which the store then never inserts into staging.
    """
    start = time.perf_counter()
    try:
        stored = backend.get(job.object_key, max_bytes=job.max_bytes)
    except StorageError as exc:
        return Outcome(job_id, True, time.perf_counter() - start, Failure.of(exc), False, 0, None)
    seconds = time.perf_counter() - start
    if stored is None:
        return Outcome(job_id, True, seconds, None, False, 0, None)
    try:
        blob, header = open_stored(
            stored, object_key=job.object_key, keyring=keyring, block_nbytes=job.slot_bytes
        )
        out = arena.view(job.slot).data
        codec.decode(blob, key=job.object_key, out=out, header=header)
    except CodecError as exc:
        return Outcome(job_id, True, seconds, None, True, len(stored), Failure.of(exc))
    return Outcome(job_id, True, seconds, None, True, len(stored), None)


def save(
    job_id: int, job: SaveJob, backend: Backend, arena: SlabArena, keyring: Keyring | None
) -> Outcome:
    """Encode one block from its slot, seal it when keyed, PUT it. Never raises an S3KVError."""
    try:
        blob: bytes | memoryview = codec.encode_view(
            arena.view(job.slot)[: job.nbytes],
            key=job.object_key,
            dtype=job.dtype,
            shape=job.shape,
            codec=codec.CodecId(job.codec),
            level=job.level,
        )
        if keyring is not None:
            blob = seal(blob, object_key=job.object_key, keyring=keyring)
    except CodecError as exc:
        return Outcome(job_id, False, 0.0, None, False, 0, Failure.of(exc))
    start = time.perf_counter()
    try:
        written = backend.put(job.object_key, blob, if_absent=job.if_absent)
    except StorageError as exc:
        failure = Failure.of(exc)
        return Outcome(job_id, True, time.perf_counter() - start, failure, False, len(blob), None)
    return Outcome(job_id, True, time.perf_counter() - start, None, written, len(blob), None)


__all__ = ["fetch", "open_stored", "save"]
