"""Pure bytes <-> bytes codec for KV blocks: header, byte planes, zstd, checksums.

Every object is self-describing and verified on every read (DESIGN.md invariant 5). The
wire format, all integers little-endian::

    offset  size     field
    0       4        magic b"S3KV"
    4       2        u16 format version (s3kv.keys.FORMAT_VERSION)
    6       4        u32 header_len: bytes from offset 0 to the end of the header crc
    10      1        u8 codec id (CodecId)
    11      1        u8 dtype code (DType)
    12      1        u8 ndim
    13      1        u8 planes: 1, or 2 = 16-bit elements split into byte planes
    14      8        u64 chunk_len: raw bytes per chunk (the last chunk may be shorter)
    22      8        u64 raw_len = prod(shape) * itemsize
    30      16       xxh3_128 of the raw bytes
    46      16       xxh3_128 of the UTF-8 object key this object was written under
    62      8        xxh3_64 of the payload (every section's stored bytes)
    70      8*ndim   u64 dims
    ..      4        u32 nsections = planes * ceil(raw_len / chunk_len) (PLANES_REF: below)
    ..      9*n      per section: u8 section codec (0 stored, 1 zstd frame), u64 stored length
    ..      4        u32 crc32 (zlib) of every header byte before it
    header_len ...   the sections' stored bytes, back to back, in table order

Sections are chunk-major (except PLANES_REF's, below): for chunk c, the section(s)
holding raw bytes ``[c * chunk_len, (c + 1) * chunk_len)``. With ``planes == 2``
(PLANES_ZSTD on a 2-byte dtype) chunk c has two sections: first the high bytes of its
elements (bf16: sign and 7 exponent bits, ~3 bits of entropy), then the low bytes
(mantissa, ~8 bits: incompressible). The writer picks ``chunk_len``: since commit ac69793 it
cuts an object into equal chunks of at most 512 KiB (a plane section of at most 256 KiB,
the most every reader accepts); from 20412bf to then, equal chunks of at most 256 KiB;
before, 256 KiB chunks. A plane that a Huffman-coded frame does not shrink (and every
low plane, where a probe of the object's first chunk finds them incompressible) goes in a
raw zstd frame: 9 bytes of frame header, then the bytes in equal raw blocks of at most
128 KiB behind 3-byte block headers, a zstd section to any reader. So every section of a
plane object is a frame, and a reader decodes a group of them in one call. Releases before
2026-11-29 stored such planes as sections of codec 0 (stored); those objects are read too.
Plain zstd (codec ZSTD) stores a chunk as is where its frame does not shrink it. An object
whose payload would not be smaller than its raw bytes is written with codec RAW.

PLANES_REF (2-byte dtypes, 5-D shape ``(layers, 2, heads, tokens, head_dim)``: the
connector's block of an HND pool) has ``planes == 2`` and lays its sections out plane by
plane, each plane in pieces of ``chunk_len // 2`` bytes: the K residuals, the V residuals,
the references (one byte per (K/V, layer, head, dim) channel: the largest high byte over the
block's tokens), then the low bytes. A residual is ``reference - high byte`` (mod 256), so
the exponent's distribution around its channel's scale is coded instead of the scales
themselves. It is written only where its payload is shorter than the raw bytes (else RAW);
a block of any other shape or dtype is written as PLANES_ZSTD would write it.

:func:`decode` checks, in this order, each failure with its own error: magic
(BadMagicError), version (UnsupportedVersionError), the header's length and crc32
(TruncatedError, ChecksumError), the header's internal consistency (SizeMismatchError),
the blob's length (TruncatedError), the key digest (KeyMismatchError), the caller's size
(SizeMismatchError), the payload's xxh3_64 (ChecksumError: so that no corrupt byte reaches
the zstd decoder), then decodes and checks the raw xxh3_128 (ChecksumError).

The payload kernels, and the measurements that chose them, are in :mod:`s3kv._planes`;
``benchmarks/bench_codec.py`` measures the whole codec on real KV.
"""

from __future__ import annotations

import enum
import functools
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Final, cast

import numpy as np
import numpy.typing as npt
import xxhash
import zstandard

from s3kv import _planes, _zstd
from s3kv._planes import Section, SectionCodec
from s3kv.errors import (
    BadMagicError,
    ChecksumError,
    KeyMismatchError,
    SizeMismatchError,
    TruncatedError,
    UnsupportedVersionError,
)
from s3kv.keys import FORMAT_VERSION

MAGIC: Final = b"S3KV"
#: Largest raw object accepted, so that no header can make a reader allocate without bound.
MAX_RAW_LEN: Final = 1 << 32
_MAX_NDIM: Final = 32
_MIN_LEVEL: Final = -(1 << 17)  # libzstd's ZSTD_minCLevel()
_FIXED = struct.Struct("<4sHIBBBBQQ16s16s8s")
_SECTION = struct.Struct("<BQ")
_SECTION_CODECS: Final = {c.value: c for c in SectionCodec}  # by wire byte
_U32 = struct.Struct("<I")
_MIN_HEADER: Final = _FIXED.size + _U32.size + _U32.size
#: Builds a Section from a tuple without NamedTuple's Python-level __new__ (header parsing
#: runs under the GIL for every block a thread decodes).
_new_section: Final = tuple.__new__

U8 = npt.NDArray[np.uint8]
Bytes = bytes | bytearray | memoryview


class DType(str, enum.Enum):
    """Element type of a KV block; the value is the config name, ``code`` the wire byte."""

    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    INT8 = "int8"
    UINT8 = "uint8"

    @property
    def code(self) -> int:
        """One-byte wire code; fixed forever (new dtypes take new codes)."""
        return _DTYPE_CODES[self]

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZES.get(self, 1)


_DTYPE_CODES: Final = {d: i for i, d in enumerate(DType, start=1)}
_DTYPE_BY_CODE: Final = {code: d for d, code in _DTYPE_CODES.items()}
#: Itemsizes other than 1 (fp8 and 8-bit integers are one byte).
_ITEMSIZES: Final = {DType.BFLOAT16: 2, DType.FLOAT16: 2, DType.FLOAT32: 4}


class CodecId(enum.IntEnum):
    """Object codec; the value is the wire byte. ``from_name`` maps config names."""

    RAW = 0
    ZSTD = 1
    PLANES_ZSTD = 2
    PLANES_REF = 3

    @classmethod
    def from_name(cls, name: str) -> CodecId:
        """Map a config name ("raw", "zstd", "planes-zstd", "planes-ref") to its id.

        Raises:
            ValueError: Unknown name.
        """
        try:
            return cls[name.upper().replace("-", "_")]
        except KeyError:
            raise ValueError(f"codec: unknown name {name!r}") from None


@dataclass(frozen=True)
class Header:
    """A verified object header. Lengths are in bytes."""

    format_version: int
    codec: CodecId
    dtype: DType
    shape: tuple[int, ...]
    raw_len: int
    checksum: bytes
    key_digest: bytes
    payload_checksum: bytes
    planes: int
    chunk_len: int
    sections: tuple[Section, ...]
    header_len: int

    @property
    def section_lengths(self) -> tuple[int, ...]:
        """Stored length of each section, in payload order."""
        return tuple(s.stored_len for s in self.sections)

    @property
    def total_len(self) -> int:
        """Length of the whole object: header plus every section."""
        return self.header_len + sum(s.stored_len for s in self.sections)


def key_digest(key: str) -> bytes:
    """16-byte xxh3_128 of the UTF-8 object key; binds an object to the key it was put at."""
    return xxhash.xxh3_128_digest(key.encode("utf-8"))


def _u8_view(data: Any) -> U8:
    """A flat uint8 view of a C-contiguous buffer (non-contiguous arrays are copied)."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(data).cast("B"), np.uint8)


def _raw_lengths(
    codec: CodecId, shape: tuple[int, ...], raw_len: int, chunk_len: int, planes: int
) -> tuple[int, ...]:
    """Raw length of every section, chunk-major (see the module docstring), or
    PLANES_REF's plane by plane."""
    geometry = _planes.ref_geometry(shape) if codec is CodecId.PLANES_REF else None
    if geometry is not None:
        return tuple(_planes.ref_raw_lengths(geometry, chunk_len))
    lengths = []
    for start in range(0, raw_len, chunk_len):
        n = min(chunk_len, raw_len - start)
        lengths.extend([n // planes] * planes)
    return tuple(lengths)


#: Layouts of at most this many sections are cached (a model's blocks share a few): every
#: decode parses a header under the GIL. A forged header's huge layout is not, so the cache
#: holds at most 64 x 4096 lengths (2 MiB of pointers).
_CACHED_SECTIONS: Final = 4096
_cached_raw_lengths: Final = functools.lru_cache(maxsize=64)(_raw_lengths)


def _head(
    codec: CodecId,
    layout: _planes.Layout,
    dtype: DType,
    shape: tuple[int, ...],
    checksum: bytes,
    digest: bytes,
) -> bytes:
    """The object's header, its crc32 included: ``_header_len(len(shape), sections)``
    bytes."""
    header_len = _header_len(len(shape), len(layout.sections))
    raw_len = math.prod(shape) * dtype.itemsize
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        header_len,
        codec,
        dtype.code,
        len(shape),
        layout.planes,
        layout.chunk_len,
        raw_len,
        checksum,
        digest,
        layout.payload_checksum,
    )
    parts = [
        fixed,
        struct.pack(f"<{len(shape)}Q", *shape),
        _U32.pack(len(layout.sections)),
        *(_SECTION.pack(flag, n) for flag, n in layout.sections),
    ]
    head = b"".join(parts)
    return head + _U32.pack(zlib.crc32(head))


def _header_len(ndim: int, sections: int) -> int:
    return _MIN_HEADER + 8 * ndim + _SECTION.size * sections


def _assemble(head: bytes, pieces: list[Any]) -> bytes:
    """The object as one ``bytes``: a copy of every piece, made holding the GIL."""
    return b"".join([head, *pieces])


def _owned_buffer(ndim: int, planned: tuple[int, int] | None) -> tuple[U8 | None, int]:
    """For :func:`encode_view`: a fresh buffer for an object of ``planned`` (sections,
    payload room) with room for its header in front, and the header's length; ``(None,
    0)`` when nothing is planned (the thread's scratch, then a join)."""
    if planned is None:
        return None, 0
    sections, room = planned
    header_len = _header_len(ndim, sections)
    return np.empty(header_len + room, np.uint8), header_len


def encode(
    raw: bytes | bytearray | memoryview | npt.NDArray[Any],
    *,
    key: str,
    dtype: DType | str,
    shape: tuple[int, ...],
    codec: CodecId = CodecId.PLANES_ZSTD,
    level: int = 1,
) -> bytes:
    """Encode one KV block into a self-describing, verifiable object.

    Args:
        raw: The block's bytes (any C-contiguous buffer; a non-contiguous array is copied).
        key: The object key the result will be stored under (bound into the header).
        dtype: Element type; with PLANES_ZSTD, 2-byte dtypes are split into byte planes and
            other dtypes get plain zstd.
        shape: Element shape; ``prod(shape) * dtype.itemsize`` must equal ``len(raw)``.
        codec: Requested codec. RAW is written instead when compression does not pay;
            PLANES_REF needs a 2-byte dtype and a 5-D ``(layers, 2, heads, tokens,
            head_dim)`` shape (see the module docstring), else the block is encoded as
            PLANES_ZSTD would encode it.
        level: zstd level for plain zstd sections (the plane codecs use zstd's Huffman
            literal coder, which has no level).

    Returns:
        The encoded object.

    Raises:
        SizeMismatchError: ``len(raw)`` disagrees with ``shape`` and ``dtype``.
        ValueError: A negative or too long shape, raw over MAX_RAW_LEN, or a level zstd
            does not have.
    """
    return cast(bytes, _encode(raw, key, dtype, shape, codec, level, owned=False))


def encode_view(
    raw: bytes | bytearray | memoryview | npt.NDArray[Any],
    *,
    key: str,
    dtype: DType | str,
    shape: tuple[int, ...],
    codec: CodecId = CodecId.PLANES_ZSTD,
    level: int = 1,
) -> memoryview:
    """:func:`encode`'s object, the same bytes, as a read-only flat memoryview.

    With the plane codecs the payload is coded straight into a buffer of the object's own,
    behind room left for the header: no final copy of the whole object, which
    :func:`encode` makes into its ``bytes`` holding the GIL (on a 16-vCPU host that copy
    costs 8 encoding threads a quarter to a third of their throughput:
    ``benchmarks/bench_encode_ablation.py``). The buffer is never reused, so the view is
    valid for as long as it is referenced. It is ``raw_len`` plus about 260 KiB of coding
    room (a 1.47 MB block: about 1.7 MB held while the view lives, against its ~1 MB
    object; about 260 KiB for any small block). Other codecs, and objects written RAW, are
    :func:`encode`'s ``bytes`` viewed. Unlike ``bytes`` the view can be neither hashed nor
    pickled: ``bytes(view)`` (a copy) where that is needed.

    Arguments and errors are :func:`encode`'s.
    """
    encoded = _encode(raw, key, dtype, shape, codec, level, owned=True)
    return encoded if isinstance(encoded, memoryview) else memoryview(encoded)


def _encode(
    raw: bytes | bytearray | memoryview | npt.NDArray[Any],
    key: str,
    dtype: DType | str,
    shape: tuple[int, ...],
    codec: CodecId,
    level: int,
    *,
    owned: bool,
) -> bytes | memoryview:
    """:func:`encode`; with ``owned``, a plane codec's object in a buffer of its own."""
    dtype, codec = DType(dtype), CodecId(codec)
    shape = tuple(int(d) for d in shape)
    if len(shape) > _MAX_NDIM or any(d < 0 for d in shape):
        raise ValueError(f"shape: need <= {_MAX_NDIM} non-negative dims, got {shape}")
    data = _u8_view(raw)
    raw_len = math.prod(shape) * dtype.itemsize
    if data.size != raw_len:
        raise SizeMismatchError(
            f"raw is {data.size} bytes; shape {shape} of {dtype.value} needs {raw_len}"
        )
    if raw_len > MAX_RAW_LEN:
        raise ValueError(f"raw: {raw_len} bytes is over the {MAX_RAW_LEN}-byte limit")
    if not _MIN_LEVEL <= level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise ValueError(f"level: must be a zstd level in [{_MIN_LEVEL}, 22], got {level}")
    # NOTE: the encoders hash the raw bytes a group of chunks at a time (see _planes), while
    # the group is still in cache: one pass over a cold block instead of two.
    hasher = xxhash.xxh3_128()
    layout = None
    out: U8 | None = None
    header_len = 0
    geometry = _planes.ref_geometry(shape) if dtype.itemsize == 2 else None
    if codec is CodecId.PLANES_REF and geometry is None:
        codec = CodecId.PLANES_ZSTD  # NOTE: no channel geometry: the plain plane codec
    if codec is not CodecId.RAW and raw_len > 0:
        if codec is CodecId.PLANES_REF and geometry is not None:
            planned = _planes.ref_room(raw_len, geometry) if owned else None
            out, header_len = _owned_buffer(len(shape), planned)
            payload = None if out is None else out[header_len:]
            layout = _planes.encode_ref(data, geometry, hasher, payload)
        elif codec is CodecId.PLANES_ZSTD and dtype.itemsize == 2:
            out, header_len = _owned_buffer(
                len(shape), _planes.planes_room(raw_len) if owned else None
            )
            payload = None if out is None else out[header_len:]
            layout = _planes.encode_planes(data, hasher, payload)
        else:
            codec = CodecId.ZSTD
            layout = _planes.encode_zstd(data, level, hasher)
    else:
        hasher.update(data.data)
    if layout is None:
        codec, layout, out = CodecId.RAW, _planes.stored(data), None
    head = _head(codec, layout, dtype, shape, hasher.digest(), key_digest(key))
    if out is not None and len(head) == header_len and len(layout.pieces) == 1:  # as planned
        out[:header_len] = np.frombuffer(head, np.uint8)
        return out.data[: header_len + len(layout.pieces[0])].toreadonly()
    return _assemble(head, layout.pieces)


def max_object_len(raw_len: int) -> int:
    """Longest object :func:`encode` writes for ``raw_len`` raw bytes: a bound for reading
    one (``Backend.get(max_bytes=...)``).

    A payload is at most as long as its raw bytes (a frame that does not shrink them is
    stored as is; the plane codecs, whose raw frames and PLANES_REF's reference plane are
    extra, are written only when the payload is shorter than the raw bytes), and the
    header is fixed fields, up to 32 dims and 9 bytes per section: at most two per
    :data:`~s3kv._planes.REF_CHUNK` (the smallest chunk any release writes), or two and a
    half plus four with PLANES_REF (its references are at most half a plane).
    """
    sections = 3 * -(-raw_len // _planes.REF_CHUNK) + 4
    return raw_len + _MIN_HEADER + 8 * _MAX_NDIM + _SECTION.size * sections


def read_header(blob: Bytes) -> Header:
    """Parse and verify an object's header and its length against the blob's.

    Args:
        blob: The whole object.

    Returns:
        The verified header.

    Raises:
        BadMagicError: Not an s3kv object.
        UnsupportedVersionError: Another format version, or an unknown codec/dtype code.
        TruncatedError: The blob is shorter or longer than its header says.
        ChecksumError: The header's crc32 does not match (the header is corrupt).
        SizeMismatchError: Header fields disagree with each other.
    """
    view = memoryview(blob).cast("B")
    size = len(view)
    if view[: len(MAGIC)] != MAGIC[:size]:
        raise BadMagicError("not an s3kv object (bad magic)")
    if size < _MIN_HEADER:
        if size >= 6 and (version := int.from_bytes(view[4:6], "little")) != FORMAT_VERSION:
            raise UnsupportedVersionError(_version_message(version))
        raise TruncatedError(f"object is {size} bytes, shorter than any header")
    (
        _,
        version,
        header_len,
        codec_id,
        dtype_code,
        ndim,
        planes,
        chunk_len,
        raw_len,
        checksum,
        digest,
        payload_checksum,
    ) = _FIXED.unpack_from(view)
    if version != FORMAT_VERSION:
        raise UnsupportedVersionError(_version_message(version))
    if header_len < _MIN_HEADER:
        raise SizeMismatchError(f"header_len {header_len} is below the minimum {_MIN_HEADER}")
    if header_len > size:
        raise TruncatedError(f"object is {size} bytes; its header alone claims {header_len}")
    (crc,) = _U32.unpack_from(view, header_len - _U32.size)
    if zlib.crc32(view[: header_len - _U32.size]) != crc:
        raise ChecksumError("header crc32 mismatch: the header is corrupt")
    # The header is intact from here on: a disagreement is a writer bug or a forged object.
    if codec_id not in CodecId._value2member_map_ or dtype_code not in _DTYPE_BY_CODE:
        raise UnsupportedVersionError(f"unknown codec {codec_id} or dtype code {dtype_code}")
    codec, dtype = CodecId(codec_id), _DTYPE_BY_CODE[dtype_code]
    table_at = _FIXED.size + 8 * ndim
    if ndim > _MAX_NDIM or table_at + _U32.size > header_len:
        raise SizeMismatchError(f"ndim {ndim} does not fit a {header_len}-byte header")
    shape = struct.unpack_from(f"<{ndim}Q", view, _FIXED.size)
    (nsections,) = _U32.unpack_from(view, table_at)
    if header_len != _MIN_HEADER + 8 * ndim + _SECTION.size * nsections:
        raise SizeMismatchError(f"header_len {header_len} disagrees with {nsections} sections")
    _check_layout(codec, dtype, shape, raw_len, planes, chunk_len, nsections)
    lengths_of = _cached_raw_lengths if nsections <= _CACHED_SECTIONS else _raw_lengths
    raw_lengths = lengths_of(codec, shape, raw_len, chunk_len, planes)
    sections = []
    table = view[table_at + _U32.size : header_len - _U32.size]
    stored_only = codec is CodecId.RAW
    # NOTE: a tuple lookup, not SectionCodec(flag): this loop runs under the GIL for every
    # block a thread decodes, and the enum call was most of the header's parse time.
    for (flag, stored), n in zip(_SECTION.iter_unpack(table), raw_lengths, strict=True):
        section_codec = _SECTION_CODECS.get(flag)
        if section_codec is None:
            raise UnsupportedVersionError(f"unknown section codec {flag}")
        if (section_codec is SectionCodec.STORED or stored_only) and stored != n:
            raise SizeMismatchError(f"stored section of {stored} bytes, raw length is {n}")
        sections.append(_new_section(Section, (section_codec, stored, n)))
    header = Header(
        version,
        codec,
        dtype,
        shape,
        raw_len,
        checksum,
        digest,
        payload_checksum,
        planes,
        chunk_len,
        tuple(sections),
        header_len,
    )
    if header.total_len != size:
        raise TruncatedError(f"object is {size} bytes; its header says {header.total_len}")
    return header


def _version_message(version: int) -> str:
    return f"format version {version}; this reader knows only {FORMAT_VERSION}"


def _check_layout(
    codec: CodecId,
    dtype: DType,
    shape: tuple[int, ...],
    raw_len: int,
    planes: int,
    chunk_len: int,
    nsections: int,
) -> None:
    if raw_len > MAX_RAW_LEN or raw_len != math.prod(shape) * dtype.itemsize:
        raise SizeMismatchError(f"raw_len {raw_len} disagrees with {shape} of {dtype.value}")
    if codec is CodecId.PLANES_REF:
        _check_ref_layout(dtype, shape, planes, chunk_len, nsections)
        return
    two_planes = codec is CodecId.PLANES_ZSTD and dtype.itemsize == 2
    if planes != (2 if two_planes else 1) or chunk_len < 1 or chunk_len % planes:
        raise SizeMismatchError(f"bad layout: planes {planes}, chunk_len {chunk_len}")
    if two_planes and chunk_len // 2 > _zstd.MAX_ENTROPY_CHUNK:
        raise SizeMismatchError(f"chunk_len {chunk_len} is over the plane codec's limit")
    if nsections != planes * -(-raw_len // chunk_len):
        raise SizeMismatchError(f"{nsections} sections for {raw_len} bytes in {chunk_len}")


def _check_ref_layout(
    dtype: DType, shape: tuple[int, ...], planes: int, chunk_len: int, nsections: int
) -> None:
    geometry = _planes.ref_geometry(shape)
    if dtype.itemsize != 2 or geometry is None:
        raise SizeMismatchError(f"PLANES_REF needs a 2-byte dtype and 5-D geometry, got {shape}")
    if planes != 2 or chunk_len < 2 or chunk_len % 2 or chunk_len // 2 > _zstd.MAX_ENTROPY_CHUNK:
        raise SizeMismatchError(f"bad layout: planes {planes}, chunk_len {chunk_len}")
    if nsections != _planes.ref_section_count(geometry, chunk_len):
        raise SizeMismatchError(f"{nsections} sections for {shape} in {chunk_len}")


def decode(
    blob: Bytes,
    *,
    key: str,
    out: memoryview | None = None,
    expect_raw_len: int | None = None,
    header: Header | None = None,
) -> memoryview:
    """Verify an object completely and return its raw bytes.

    Nothing is allocated beyond ``raw_len`` of the verified header (none of it when ``out``
    is given) plus per-thread scratch: fixed for every codec but PLANES_REF, whose planes
    are decoded whole into scratch of about ``raw_len`` bytes more, kept by the thread for
    its next block up to :data:`~s3kv._zstd.MAX_KEPT_PAYLOAD` per buffer (PLANES_ZSTD
    decodes into the fixed scratch a group of chunks at a time). Any input bytes
    whatsoever either decode to the exact bytes that were encoded under ``key`` or raise a
    :class:`~s3kv.errors.CodecError`.

    Args:
        blob: The whole object as stored.
        key: The object key it was read from; must be the key it was written under.
        out: Optional writable, C-contiguous buffer of exactly ``raw_len`` bytes (a pinned
            staging buffer) to decode into. Its contents are unspecified after an error.
        expect_raw_len: If given, the raw length the caller requires.
        header: What :func:`read_header` returned for this very ``blob``, if the caller
            already read it (it is not parsed again).

    Returns:
        ``out`` (as a memoryview), or a new buffer of ``raw_len`` bytes.

    Raises:
        BadMagicError, UnsupportedVersionError, TruncatedError, SizeMismatchError: see
            :func:`read_header`; SizeMismatchError also when ``out`` or ``expect_raw_len``
            disagree with the header.
        KeyMismatchError: The object was written under another key.
        ChecksumError: The payload fails its checksum, a section does not decode, or the
            raw bytes fail theirs.
        ValueError: ``out`` is read-only or not contiguous (a caller bug, not bad data).
    """
    # NOTE: a caller that already read this blob's header (to size its buffer) passes it:
    # parsing it again costs ~13 us per block with the GIL held.
    header = read_header(blob) if header is None else header
    if header.key_digest != key_digest(key):
        raise KeyMismatchError(f"object was written under another key than {key!r}")
    if expect_raw_len is not None and header.raw_len != expect_raw_len:
        raise SizeMismatchError(f"object holds {header.raw_len} bytes, expected {expect_raw_len}")
    if out is None:
        target = np.empty(header.raw_len, np.uint8)
        result = target.data
    else:
        result = out if isinstance(out, memoryview) else memoryview(out)
        if result.readonly or not result.c_contiguous:
            raise ValueError("out: must be a writable, C-contiguous buffer")
        if result.nbytes != header.raw_len:
            raise SizeMismatchError(f"out is {result.nbytes} bytes, object holds {header.raw_len}")
        target = np.frombuffer(result, np.uint8)
    payload = memoryview(blob).cast("B")[header.header_len :]
    # NOTE: checked first so that no corrupt byte ever reaches the zstd decoder, and so that
    # corruption is reported as such even where a decoder would ignore it (a frame's
    # unused header bits). 20 us per 1.5 MB block. The constructor, not xxh3_64_digest:
    # xxhash 3.x's one-shot functions hash under the GIL, which serializes decoding threads.
    if xxhash.xxh3_64(payload).digest() != header.payload_checksum:
        raise ChecksumError("payload does not match its xxh3_64 checksum")
    src = np.frombuffer(memoryview(blob).cast("B"), np.uint8)
    # NOTE: the decoders hash each group of chunks right after writing it, while it is in
    # cache (no gain over a final pass on 1.5 MB blocks, which are one group; it is for
    # larger ones).
    hasher = xxhash.xxh3_128()
    ref = header.codec is CodecId.PLANES_REF
    geometry = _planes.ref_geometry(header.shape) if ref else None
    try:
        if geometry is not None:
            _planes.decode_ref(
                header.sections, geometry, header.chunk_len, src, header.header_len, target, hasher
            )
        elif header.planes == 2:
            _planes.decode_planes(header.sections, src, header.header_len, target, hasher)
        else:
            _planes.decode_chunks(header.sections, src, header.header_len, target, hasher)
    except _zstd.FrameError as exc:
        raise ChecksumError(f"corrupt section: {exc}") from exc
    if hasher.digest() != header.checksum:
        raise ChecksumError("raw bytes do not match the stored xxh3_128 checksum")
    return result


__all__ = [
    "MAGIC",
    "MAX_RAW_LEN",
    "CodecId",
    "DType",
    "Header",
    "Section",
    "SectionCodec",
    "decode",
    "encode",
    "encode_view",
    "key_digest",
    "max_object_len",
    "read_header",
]
