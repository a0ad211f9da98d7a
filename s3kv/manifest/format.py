"""Wire formats and object names of the in-bucket manifest (see :mod:`s3kv.manifest`).

Layout under ``keys.manifest_prefix(prefix, fingerprint)`` (``<prefix>/<fp>/manifest/``)::

    segments/<13-digit epoch ms>-<instance id>-<6-digit seq>.seg   immutable record batches
    snapshots/<10-digit generation>/bloom.bin                       BloomFilter.to_bytes()
    snapshots/<10-digit generation>/usage.bin                       one row per live key
    CURRENT                                                         JSON pointer, written last

Segments and ``usage.bin`` share one framing: a 32-byte header (magic, format version,
record size, record count, xxh3_64 of the raw records) and one zstd frame holding a packed
numpy structured array. Nothing is pickled; decoding verifies every header field, the zstd
frame's declared size and the checksum. Before anything is allocated, the declared count is
checked against the caller's bound (a snapshot shard's row count is in its log entry) and
against the object's real length: real records hold 16 random key bytes each, so zstd
shrinks them 3-5x (measured: 3.0x for chained writes, 4.7x for write+hit+pin of each key,
3.7x for usage rows); a count claiming more than :data:`MAX_RATIO` times the frame's length
(past the first MiB) is forged, such as 10M records in 16 KB of zstd run-length blocks.

Segment names sort by their creation time, which is what lets a reader list only the
segments newer than a point in time with a single ``start_after``.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import xxhash
import zstandard

from s3kv.errors import (
    BadMagicError,
    ChecksumError,
    CodecError,
    SizeMismatchError,
    TruncatedError,
    UnsupportedVersionError,
)

__all__ = [
    "CURRENT_NAME",
    "JSON_ERRORS",
    "KIND_HIT",
    "KIND_PIN",
    "KIND_UNPIN",
    "KIND_WRITE",
    "MAX_CURRENT_BYTES",
    "MAX_SEGMENT_BYTES",
    "MAX_SEGMENT_RECORDS",
    "RECORD_DTYPE",
    "SEGMENT_MAGIC",
    "UNKNOWN_PARENT",
    "USAGE_DTYPE",
    "USAGE_MAGIC",
    "Current",
    "decode_records",
    "decode_usage",
    "encode_records",
    "encode_usage",
    "max_encoded_len",
    "segment_name",
    "segment_time_ms",
    "segments_start_after",
    "snapshot_paths",
    "snapshot_generation",
    "valid_instance_id",
]

FORMAT_VERSION: Final = 1
SEGMENT_MAGIC: Final = b"S3KVSEG1"
USAGE_MAGIC: Final = b"S3KVUSG1"
CURRENT_NAME: Final = "CURRENT"
#: Most raw bytes a frame may declare per byte of itself (real records: 3-5x; see above).
MAX_RATIO: Final = 64
#: Raw bytes any frame may declare whatever its length (small synthetic tables compress
#: better than real ones; 1 MiB of records costs nothing to allocate).
_FREE_RAW_BYTES: Final = 1 << 20
#: ``CURRENT`` is a few KB plus folded segment names; refuse absurd ones before parsing.
MAX_CURRENT_BYTES: Final = 16 * 1024 * 1024
#: Most records one segment holds: a writer splits more over several segments. A flush
#: holds at most 8 x ``manifest_flush_keys`` records (32,768 at the default: 1.7 MB at
#: worst), ``s3kv pin`` two per block; neither has an upper bound of its own.
MAX_SEGMENT_RECORDS: Final = 1 << 20
#: The longest segment a reader accepts (it refuses a longer one unread, as corrupt).
#: Segments have no length in a log entry to check against, so this bounds what junk
#: under a segment name costs a reader: ``MAX_SEGMENT_RECORDS`` need at most 55.8 MB.
MAX_SEGMENT_BYTES: Final = 64 << 20
SEGMENTS_DIR: Final = "segments/"
SNAPSHOTS_DIR: Final = "snapshots/"

#: Record kinds.
KIND_WRITE: Final = 1
KIND_HIT: Final = 2
KIND_PIN: Final = 3
KIND_UNPIN: Final = 4

#: Parent of a key whose chain parent is not known (hit/pin records, keys found by listing).
#: Distinct from ROOT_HASH (all zeros), which means "first block of its chain".
UNKNOWN_PARENT: Final = b"\xff" * 16

#: One segment record. ``count`` is how many events the record stands for (hits are
#: coalesced per key per flush); 1 for writes and pins.
RECORD_DTYPE: Final = np.dtype(
    [
        ("key", "V16"),
        ("parent", "V16"),
        ("time", "<f8"),
        ("size", "<u8"),
        ("kind", "u1"),
        ("count", "<u4"),
    ]
)

#: One row of a snapshot's usage table (one per live key).
USAGE_DTYPE: Final = np.dtype(
    [
        ("key", "V16"),
        ("parent", "V16"),
        ("first_written", "<f8"),
        ("last_used", "<f8"),
        ("hits", "<u4"),
        ("size", "<u8"),
        ("pinned", "u1"),
    ]
)

# magic, version, itemsize, reserved, count, xxh3_64(raw records)
_FRAME: Final = struct.Struct("<8sHHIQQ")
_ZSTD_LEVEL: Final = 3
_SEGMENT_RE: Final = re.compile(r"^(\d{13})-([A-Za-z0-9._-]{1,64})-(\d{6})\.seg$")
_INSTANCE_RE: Final = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_GENERATION_RE: Final = re.compile(r"^snapshots/(\d{10})/")

Records = npt.NDArray[np.void]

#: What parsing a hostile JSON object can raise: bad text, missing or mistyped fields, and
#: numbers too large for an int (1e999) or nesting too deep for the parser.
JSON_ERRORS: Final = (
    UnicodeDecodeError,
    ValueError,
    KeyError,
    TypeError,
    OverflowError,
    RecursionError,
)


# --- framing ----------------------------------------------------------------------------


def _encode(magic: bytes, dtype: np.dtype[Any], rows: Records) -> bytes:
    raw = np.ascontiguousarray(rows, dtype=dtype).tobytes()
    header = _FRAME.pack(
        magic, FORMAT_VERSION, dtype.itemsize, 0, len(rows), xxhash.xxh3_64_intdigest(raw)
    )
    return header + zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(raw)


def _decode(
    magic: bytes, dtype: np.dtype[Any], data: bytes, what: str, count: int | None
) -> Records:
    if len(data) < _FRAME.size:
        if data[:8] == magic[: len(data[:8])]:
            raise TruncatedError(f"{what}: {len(data)} bytes is shorter than the header")
        raise BadMagicError(f"{what}: not an s3kv manifest object")
    got_magic, version, itemsize, _reserved, declared_count, checksum = _FRAME.unpack_from(data)
    if got_magic != magic:
        if got_magic[:7] == magic[:7]:
            raise UnsupportedVersionError(f"{what}: unsupported format {got_magic!r}")
        raise BadMagicError(f"{what}: not an s3kv manifest object")
    if version != FORMAT_VERSION:
        raise UnsupportedVersionError(f"{what}: format version {version}, expected 1")
    if itemsize != dtype.itemsize:
        raise SizeMismatchError(f"{what}: record size {itemsize}, expected {dtype.itemsize}")
    if count is not None and declared_count != count:
        raise SizeMismatchError(f"{what}: {declared_count} records, its log entry says {count}")
    expected = declared_count * itemsize
    frame = memoryview(data)[_FRAME.size :]  # NOTE: a view: slicing bytes copies them
    if expected > max(_FREE_RAW_BYTES, MAX_RATIO * len(frame)):
        raise SizeMismatchError(
            f"{what}: {declared_count} records ({expected} bytes) declared in a "
            f"{len(data)}-byte object, more than {MAX_RATIO}x: forged or corrupt"
        )
    try:
        # NOTE: python-zstandard trusts the frame's declared size over max_output_size, so
        # check it too: a lying header must not make us allocate more than the above.
        declared = zstandard.frame_content_size(frame)
        if declared != expected:
            raise SizeMismatchError(f"{what}: frame holds {declared} bytes, expected {expected}")
        # NOTE: decompressed straight into the result: one allocation of the records, not
        # the bytes plus a writable copy of them.
        out = np.empty(declared_count, dtype=dtype)
        view = out.view(np.uint8).data
        got = 0
        reader = zstandard.ZstdDecompressor().stream_reader(frame)
        while got < expected and (n := reader.readinto(view[got:])):
            got += n
    except zstandard.ZstdError as exc:
        raise TruncatedError(f"{what}: corrupt zstd frame ({exc})") from exc
    if got != expected:  # NOTE: the reader stops early at the end of a cut-off frame
        raise TruncatedError(f"{what}: {got} bytes of records, expected {expected}")
    if xxhash.xxh3_64_intdigest(view) != checksum:
        raise ChecksumError(f"{what}: records do not match the stored checksum")
    return out


def max_encoded_len(count: int, dtype: np.dtype[Any]) -> int:
    """Longest object :func:`encode_records`/:func:`encode_usage` can write for ``count``
    rows of ``dtype``: the header plus zstd's worst case (``ZSTD_COMPRESSBOUND``).

    A bound for reading such an object (``Backend.get(max_bytes=...)``).
    """
    raw = count * dtype.itemsize
    small = ((128 << 10) - raw) >> 11 if raw < (128 << 10) else 0
    return _FRAME.size + raw + (raw >> 8) + small + 64


def encode_records(records: Records) -> bytes:
    """A segment object holding ``records`` (an array of :data:`RECORD_DTYPE`)."""
    return _encode(SEGMENT_MAGIC, RECORD_DTYPE, records)


def decode_records(data: bytes, *, count: int | None = None) -> Records:
    """The records of a segment object, verified.

    Args:
        data: The whole object.
        count: The record count the caller knows it holds (a delta's, from its log entry).

    Raises:
        CodecError: a subclass naming what is wrong (magic, version, size, checksum).
    """
    return _decode(SEGMENT_MAGIC, RECORD_DTYPE, data, "segment", count)


def encode_usage(rows: Records) -> bytes:
    """A ``usage.bin`` object holding ``rows`` (an array of :data:`USAGE_DTYPE`)."""
    return _encode(USAGE_MAGIC, USAGE_DTYPE, rows)


def decode_usage(data: bytes, *, count: int | None = None) -> Records:
    """The rows of a ``usage.bin`` object, verified.

    Args:
        data: The whole object.
        count: The row count the caller knows it holds (a shard's, from its log entry).

    Raises:
        CodecError: a subclass naming what is wrong (magic, version, size, checksum).
    """
    return _decode(USAGE_MAGIC, USAGE_DTYPE, data, "usage", count)


# --- names ------------------------------------------------------------------------------


def valid_instance_id(instance_id: str) -> bool:
    """Whether ``instance_id`` can appear in a segment name (1-64 of ``[A-Za-z0-9._-]``)."""
    return _INSTANCE_RE.fullmatch(instance_id) is not None


def segment_name(time_ms: int, instance_id: str, seq: int) -> str:
    """``<13-digit ms>-<instance>-<6-digit seq>.seg`` (relative to ``segments/``)."""
    return f"{time_ms:013d}-{instance_id}-{seq % 1_000_000:06d}.seg"


def segment_time_ms(name: str) -> int | None:
    """The creation time (epoch ms) in a segment name, or ``None`` if it is not one."""
    match = _SEGMENT_RE.fullmatch(name)
    return None if match is None else int(match.group(1))


def segments_start_after(cutoff_ms: int) -> str:
    """A ``start_after`` (relative to ``segments/``) that lists names with time ≥ cutoff.

    ``"1700000000000"`` sorts before every name starting with it (they are longer), and
    after every name with a smaller time, so the listing begins exactly at ``cutoff_ms``.
    """
    return f"{max(0, cutoff_ms):013d}"


def snapshot_paths(generation: int) -> tuple[str, str]:
    """``(bloom, usage)`` paths of a generation, relative to the manifest prefix."""
    base = f"{SNAPSHOTS_DIR}{generation:010d}/"
    return base + "bloom.bin", base + "usage.bin"


def snapshot_generation(path: str) -> int | None:
    """The generation of a path under ``snapshots/`` (relative), or ``None``."""
    match = _GENERATION_RE.match(path)
    return None if match is None else int(match.group(1))


# --- the CURRENT pointer ----------------------------------------------------------------


@dataclass(frozen=True)
class Current:
    """The ``CURRENT`` pointer: which snapshot is live and which segments it folded.

    Attributes:
        generation: Snapshot generation, 1 for the first compaction.
        bloom: Path of ``bloom.bin``, relative to the manifest prefix.
        usage: Path of ``usage.bin``, relative to the manifest prefix.
        keys: Live keys in the snapshot.
        watermark: Name of the newest folded segment ("" if none was ever folded).
        folded: Names of folded segments whose time is within ``grace_s`` of the watermark;
            readers list from ``watermark time - grace_s`` and skip these.
        grace_s: The grace window the compactor used.
        created_at: Epoch seconds when the snapshot was written.
        format: Manifest format version.
    """

    generation: int
    bloom: str
    usage: str
    keys: int
    watermark: str
    folded: tuple[str, ...] = field(default=())
    grace_s: float = 600.0
    created_at: float = 0.0
    format: int = FORMAT_VERSION

    @property
    def watermark_ms(self) -> int:
        """Epoch ms of the watermark segment (0 when there is none)."""
        return segment_time_ms(self.watermark) or 0

    @property
    def listing_cutoff_ms(self) -> int:
        """Segments at or after this time may be unfolded; older ones are folded or lost."""
        return max(0, self.watermark_ms - round(self.grace_s * 1000))

    def to_json(self) -> bytes:
        """Compact JSON, keys sorted."""
        payload = asdict(self)
        payload["folded"] = list(self.folded)
        return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes) -> Current:
        """Parse and validate a pointer.

        Raises:
            UnsupportedVersionError: a pointer of another format version.
            CodecError: not a valid pointer.
        """
        if len(data) > MAX_CURRENT_BYTES:
            raise CodecError(f"CURRENT: {len(data)} bytes is too large for a manifest pointer")
        try:
            payload = json.loads(data.decode("utf-8"))
            if not isinstance(payload, dict):
                raise TypeError("not an object")
            version = int(payload.get("format", -1))
            if version != FORMAT_VERSION:
                raise UnsupportedVersionError(f"CURRENT: format {version}, expected 1")
            current = cls(
                generation=int(payload["generation"]),
                bloom=str(payload["bloom"]),
                usage=str(payload["usage"]),
                keys=int(payload["keys"]),
                watermark=str(payload["watermark"]),
                folded=tuple(str(name) for name in payload["folded"]),
                grace_s=float(payload["grace_s"]),
                created_at=float(payload["created_at"]),
                format=version,
            )
        except UnsupportedVersionError:
            raise
        except JSON_ERRORS as exc:
            raise CodecError(f"CURRENT: not a valid manifest pointer ({exc})") from exc
        for path in (current.bloom, current.usage):
            if snapshot_generation(path) is None or ".." in path:
                raise CodecError(f"CURRENT: bad snapshot path {path!r}")
        return current
