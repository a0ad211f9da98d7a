"""The work of one job, in the two steps a codec process runs on separate threads.

A block job is a request (GET or PUT: waits on the network, holds no CPU) and codec work
(decode or encode: CPU, no waiting). A codec process runs the two on different threads
(:mod:`s3kv.offload.child`), so the requests it keeps in flight and the CPUs it codes on
are set apart: :func:`get` then :func:`decode` for a fetch, :func:`encode` then :func:`put`
for a save. Each step returns the job's :class:`~s3kv.offload.jobs.Outcome` once the job
has ended (a failure, a miss, the last step), else what the next step takes.

:func:`open_stored` is the one place a stored object becomes a verified header: both the
store's in-thread path and the codec processes call it, so the two read blocks identically.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from s3kv import codec
from s3kv.arena import SlabArena
from s3kv.auth import Keyring, seal, unseal
from s3kv.errors import CodecError, SizeMismatchError, StorageError
from s3kv.offload.jobs import Failure, FetchJob, Outcome, SaveJob
from s3kv.storage import Backend


class Fetched(NamedTuple):
    """A fetch's object, received and not yet decoded."""

    stored: bytes
    seconds: float  # NOTE: the GET's time, reported in the outcome


class Encoded(NamedTuple):
    """A save's object, encoded (and sealed) and not yet PUT."""

    blob: bytes | memoryview


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


def get(job_id: int, job: FetchJob, backend: Backend) -> Outcome | Fetched:
    """A fetch's request: GET the object. Its outcome when the fetch ends here (the request
    failed, or nothing is stored under the key); else the object. Never raises an S3KVError.
    """
    start = time.perf_counter()
    try:
        stored = backend.get(job.object_key, max_bytes=job.max_bytes)
    except StorageError as exc:
        return Outcome(job_id, True, time.perf_counter() - start, Failure.of(exc), False, 0, None)
    seconds = time.perf_counter() - start
    if stored is None:
        return Outcome(job_id, True, seconds, None, False, 0, None)
    return Fetched(stored, seconds)


def decode(
    job_id: int, job: FetchJob, fetched: Fetched, arena: SlabArena, keyring: Keyring | None
) -> Outcome:
    """A fetch's codec work: open, verify and decode the object into the job's slot. Never
    raises an S3KVError.

    The slot is written only by a decode that verified; a failed job may have written part
    of it, which the store then never inserts into staging.
    """
    stored, seconds = fetched
    try:
        blob, header = open_stored(
            stored, object_key=job.object_key, keyring=keyring, block_nbytes=job.slot_bytes
        )
        out = arena.view(job.slot).data
        codec.decode(blob, key=job.object_key, out=out, header=header)
    except CodecError as exc:
        return Outcome(job_id, True, seconds, None, True, len(stored), Failure.of(exc))
    return Outcome(job_id, True, seconds, None, True, len(stored), None)


def encode(
    job_id: int, job: SaveJob, arena: SlabArena, keyring: Keyring | None
) -> Outcome | Encoded:
    """A save's codec work: encode the block from its slot and seal it when keyed. Its
    outcome when encoding failed; else the object to PUT. Never raises an S3KVError.

    The object is a buffer of its own: the slot may be reused once the job has ended.
    """
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
    return Encoded(blob)


def put(job_id: int, job: SaveJob, encoded: Encoded, backend: Backend) -> Outcome:
    """A save's request: PUT the encoded object (conditionally when the job says so). Never
    raises an S3KVError."""
    blob = encoded.blob
    start = time.perf_counter()
    try:
        written = backend.put(job.object_key, blob, if_absent=job.if_absent)
    except StorageError as exc:
        failure = Failure.of(exc)
        return Outcome(job_id, True, time.perf_counter() - start, failure, False, len(blob), None)
    return Outcome(job_id, True, time.perf_counter() - start, None, written, len(blob), None)


__all__ = ["Encoded", "Fetched", "decode", "encode", "get", "open_stored", "put"]
