"""What crosses between the store and its codec processes: jobs, outcomes, failures.

Everything here is a plain tuple of builtins, so one ``pickle`` of a list of them is one
message on the socket, in both directions. Block bytes never cross: a job names a slot of a
shared-memory arena (:class:`~s3kv.arena.SlabArena`) by the arena's path and the slot's index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, NamedTuple

from s3kv import errors


class FetchJob(NamedTuple):
    """GET ``object_key``, open and verify it, decode it into ``slot`` of ``arena``.

    Attributes:
        object_key: The block's object key.
        arena: Path of the arena (``/proc/<pid>/fd/<fd>`` of the store's process).
        slot_bytes: Size of every slot of that arena: the raw block size expected.
        slot: Index of the slot to fill.
        max_bytes: Refuse objects longer than this before reading the body.
    """

    object_key: str
    arena: str
    slot_bytes: int
    slot: int
    max_bytes: int


class SaveJob(NamedTuple):
    """Encode the first ``nbytes`` of ``slot`` of ``arena``, seal, PUT as ``object_key``.

    Attributes:
        object_key: The block's object key.
        arena: Path of the arena holding the raw block.
        slot_bytes: Size of every slot of that arena.
        slot: Index of the slot to read (unchanged until the outcome arrives).
        nbytes: Raw bytes of the block.
        dtype: :class:`~s3kv.codec.DType` value.
        shape: Logical shape, recorded in the header.
        codec: :class:`~s3kv.codec.CodecId` value.
        level: zstd level.
        if_absent: Conditional PUT (If-None-Match).
    """

    object_key: str
    arena: str
    slot_bytes: int
    slot: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    codec: int
    level: int
    if_absent: bool


@dataclass(frozen=True, slots=True)
class SaveJobs:
    """Several :class:`SaveJob` of one arena, size, dtype, shape and codec: one item of a
    message, a list per field that differs (row ``i``: one job).

    How a batch of saves crosses to a codec process: one object of a few lists, where a
    :class:`SaveJob` per block cost the engine's interpreter an object to build and pickle
    (its sender thread's CPU per 256-block prompt: 0.92 -> 0.29 ms on a 2-core machine).
    The process expands it, on its own interpreter (:meth:`jobs`).
    """

    arena: str
    slot_bytes: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    codec: int
    level: int
    object_keys: list[str]
    slots: list[int]
    if_absent: list[bool]

    def __len__(self) -> int:
        return len(self.object_keys)

    def rows(self, start: int, stop: int) -> SaveJobs:
        """Rows ``start`` to ``stop`` (excluded)."""
        return dataclasses.replace(
            self,
            object_keys=self.object_keys[start:stop],
            slots=self.slots[start:stop],
            if_absent=self.if_absent[start:stop],
        )

    def jobs(self) -> Iterator[SaveJob]:
        """Each row as a :class:`SaveJob`."""
        for object_key, slot, if_absent in zip(
            self.object_keys, self.slots, self.if_absent, strict=True
        ):
            yield SaveJob(
                object_key, self.arena, self.slot_bytes, slot, self.nbytes, self.dtype,
                self.shape, self.codec, self.level, if_absent,
            )  # fmt: skip


Job = FetchJob | SaveJob


class Failure(NamedTuple):
    """An :class:`~s3kv.errors.S3KVError` raised in a codec process, to raise again here."""

    name: str
    message: str
    kind: str

    @classmethod
    def of(cls, exc: errors.S3KVError) -> Failure:
        return cls(type(exc).__name__, str(exc), str(getattr(exc, "kind", "")))

    def rebuild(self) -> errors.S3KVError:
        """The same class, message and ``kind`` (a generic one for an unknown class)."""
        kind_cls = getattr(errors, self.name, None)
        exc: errors.S3KVError
        if isinstance(kind_cls, type) and issubclass(kind_cls, errors.AuthenticationError):
            exc = kind_cls(self.message, self.kind)
        elif isinstance(kind_cls, type) and issubclass(kind_cls, errors.S3KVError):
            exc = kind_cls(self.message)
        else:
            exc = errors.StorageError(self.message)
        if self.kind and getattr(exc, "kind", None) != self.kind:
            exc.kind = self.kind  # type: ignore[attr-defined]
        return exc


class Outcome(NamedTuple):
    """What a codec process did with one job.

    Attributes:
        job_id: The job's number in its store's process.
        requested: Whether a request reached the bucket (counted and timed like a local one).
        seconds: Time of that request.
        request_error: The request failed (not found is not a failure: ``found`` is False).
        found: GET: the object existed. SAVE: the PUT wrote it (False: ``if_absent`` refused).
        stored_len: Bytes received (GET) or sent (PUT).
        codec_error: The object did not open, verify or decode (GET), or encoding failed.
    """

    job_id: int
    requested: bool
    seconds: float
    request_error: Failure | None
    found: bool
    stored_len: int
    codec_error: Failure | None


@dataclass(frozen=True, slots=True)
class Outcomes:
    """Several jobs' outcomes, one list per field of :class:`Outcome` (row ``i``: one job).

    The form outcomes cross the socket and reach the store's bookkeeping in: a message of
    many outcomes unpickles as seven lists of builtins rather than an object per job, and
    the store handles a batch column by column. That work runs on the engine's interpreter:
    as rows, one message of 64 saves' outcomes cost it 243 µs on an H200 host, as columns
    162 µs (``benchmarks/results/save_path-h200-host-2026-11-28-outcomes.jsonl`` for the
    reader's CPU per prompt, ``outcomes_ms``).
    """

    job_id: list[int]
    requested: list[bool]
    seconds: list[float]
    request_error: list[Failure | None]
    found: list[bool]
    stored_len: list[int]
    codec_error: list[Failure | None]

    @classmethod
    def of(cls, rows: Iterable[Outcome]) -> Outcomes:
        """The columns of ``rows``."""
        columns = list(zip(*rows, strict=True))
        if not columns:
            return cls([], [], [], [], [], [], [])
        return cls(*(list(column) for column in columns))

    @classmethod
    def joined(cls, parts: Sequence[Outcomes]) -> Outcomes:
        """The rows of ``parts``, in order (``parts[0]`` itself when it is the only one)."""
        if len(parts) == 1:
            return parts[0]
        columns = zip(*(part.columns() for part in parts), strict=True)
        return cls(*(list(chain.from_iterable(column)) for column in columns))

    def columns(self) -> tuple[list[Any], ...]:
        """The seven lists, in the order of :class:`Outcome`'s fields."""
        return (
            self.job_id, self.requested, self.seconds, self.request_error, self.found,
            self.stored_len, self.codec_error,
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self.job_id)

    def rows(self) -> Iterator[Outcome]:
        """Each row as an :class:`Outcome`."""
        return map(Outcome._make, zip(*self.columns(), strict=True))

    def take(self, positions: Sequence[int]) -> Outcomes:
        """The rows at ``positions``, in that order."""
        return Outcomes(*([column[p] for p in positions] for column in self.columns()))

    def well_formed(self) -> bool:
        """Seven lists of one length (what a codec process of this version sends)."""
        columns = self.columns()
        return all(type(c) is list for c in columns) and len({len(c) for c in columns}) == 1

    def clean(self) -> bool:
        """Every job made its request and nothing failed (the common case, handled in bulk)."""
        return all(self.requested) and not any(self.request_error) and not any(self.codec_error)


__all__ = ["Failure", "FetchJob", "Job", "Outcome", "Outcomes", "SaveJob", "SaveJobs"]
