"""s3kv.codec: round trips, precise verification errors, fuzzing, and the fallback path."""

from __future__ import annotations

import ast
import base64
import inspect
import json
import math
import struct
import threading
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from s3kv import _planes, _zstd, codec
from s3kv.codec import CodecId, DType
from s3kv.errors import (
    BadMagicError,
    ChecksumError,
    CodecError,
    KeyMismatchError,
    SizeMismatchError,
    TruncatedError,
    UnsupportedVersionError,
)

KEY = "s3kv/v1/fp-0123/ab/ab12cd34"
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

shapes = st.lists(st.integers(0, 9), min_size=0, max_size=4).map(tuple)
#: (layers, 2, heads, tokens, head_dim): PLANES_REF's geometry.
hnd_shapes = st.tuples(
    st.integers(1, 3), st.just(2), st.integers(1, 3), st.integers(2, 9), st.integers(1, 9)
)


def bf16_normal(n: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """bf16 bit patterns of normal samples (truncated float32), like real KV values."""
    f32 = np.random.default_rng(seed).normal(0, scale, n).astype(np.float32)
    return (f32.view(np.uint32) >> 16).astype(np.uint16)


def make_raw(dtype: DType, shape: tuple[int, ...], kind: str, seed: int) -> bytes:
    n = math.prod(shape) * dtype.itemsize
    rng = np.random.default_rng(seed)
    if kind == "random":
        return rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    if kind == "zeros":
        return bytes(n)
    # "values": low-entropy high bytes, like KV tensors.
    return np.resize(bf16_normal(n // 2 + 1, seed).view(np.uint8), n).tobytes()


def reseal(blob: bytes, *, payload: bool = False) -> bytes:
    """Recompute the header crc (and the payload checksum) after a deliberate edit.

    The result is a forged object that passes the outer checks, so that the checks behind
    them (header consistency, the zstd decoder, the raw checksum) are exercised.
    """
    (header_len,) = struct.unpack_from("<I", blob, 6)
    body = bytearray(blob[: header_len - 4])
    if payload and len(body) >= 70:
        body[62:70] = xxhash.xxh3_64_digest(blob[header_len:])
    return bytes(body) + struct.pack("<I", zlib.crc32(body)) + blob[header_len:]


@pytest.fixture(params=[None, 64], ids=["default-chunks", "64-byte-chunks"])
def chunked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Also encode with tiny chunks, so that many-section objects are exercised cheaply."""
    if request.param is not None:
        monkeypatch.setattr(_planes, "PLANE_CHUNK", request.param)
        monkeypatch.setattr(_planes, "REF_CHUNK", request.param)
        monkeypatch.setattr(_planes, "ZSTD_CHUNK", request.param)


SAMPLE_RAW = bf16_normal(3000).tobytes()
SAMPLE = codec.encode(SAMPLE_RAW, key=KEY, dtype=DType.BFLOAT16, shape=(3, 1000))


@pytest.fixture
def blob() -> bytes:
    return SAMPLE


# -- round trips ---------------------------------------------------------------------------


@pytest.mark.usefixtures("chunked")
@FAST
@given(
    dtype=st.sampled_from(DType),
    requested=st.sampled_from(CodecId),
    shape=st.one_of(shapes, hnd_shapes),  # NOTE: 5-D: PLANES_REF's geometry
    kind=st.sampled_from(["random", "zeros", "values"]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_every_dtype_and_codec(
    dtype: DType, requested: CodecId, shape: tuple[int, ...], kind: str, seed: int
) -> None:
    raw = make_raw(dtype, shape, kind, seed)
    blob = codec.encode(raw, key=KEY, dtype=dtype, shape=shape, codec=requested)
    header = codec.read_header(blob)
    assert (header.dtype, header.shape, header.raw_len) == (dtype, shape, len(raw))
    assert header.key_digest == codec.key_digest(KEY)
    assert header.total_len == len(blob)
    assert bytes(codec.decode(blob, key=KEY, expect_raw_len=len(raw))) == raw
    if requested is CodecId.RAW or not raw:
        assert header.codec is CodecId.RAW
    view = codec.encode_view(raw, key=KEY, dtype=dtype, shape=shape, codec=requested)
    assert (view.readonly, view.format, view.ndim) == (True, "B", 1)
    assert view == blob


@FAST
@given(shape=shapes.filter(lambda s: math.prod(s) > 0), seed=st.integers(0, 2**16))
def test_decode_into_out_buffer(shape: tuple[int, ...], seed: int) -> None:
    raw = make_raw(DType.BFLOAT16, shape, "values", seed)
    blob = codec.encode(raw, key=KEY, dtype="bfloat16", shape=shape)
    staging = bytearray(len(raw))
    out = memoryview(staging)
    result = codec.decode(blob, key=KEY, out=out)
    assert result is out
    assert bytes(staging) == raw


def test_numpy_input_and_multidimensional_out() -> None:
    values = bf16_normal(2 * 3 * 64).reshape(2, 3, 64)
    blob = codec.encode(values, key=KEY, dtype=DType.BFLOAT16, shape=values.shape)
    # A non-contiguous view is encoded as its logical (C-order) bytes.
    wide = np.zeros((2, 3, 128), np.uint16)
    wide[:, :, ::2] = values
    assert codec.encode(wide[:, :, ::2], key=KEY, dtype="bfloat16", shape=values.shape) == blob
    out = np.empty_like(values)
    codec.decode(blob, key=KEY, out=out.data)
    np.testing.assert_array_equal(out, values)


def test_incompressible_object_is_stored_raw() -> None:
    raw = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    blob = codec.encode(raw, key=KEY, dtype=DType.FLOAT16, shape=(2048,))
    assert codec.read_header(blob).codec is CodecId.RAW
    assert len(blob) == codec.read_header(blob).header_len + len(raw)


def test_planes_store_the_low_plane_raw_and_compress_the_high_plane() -> None:
    """The low plane (~8 bits of entropy) is not coded: each chunk's goes in a raw zstd frame
    of equal blocks (9 bytes of frame header, 3 per block), which any zstd decoder reads."""
    words = bf16_normal(600_000)  # > one chunk, so several sections
    blob = codec.encode(words, key=KEY, dtype="bfloat16", shape=(600_000,))
    header = codec.read_header(blob)
    assert header.codec is CodecId.PLANES_ZSTD
    assert header.planes == 2
    assert len(header.sections) == 2 * math.ceil(words.nbytes / header.chunk_len) > 2
    assert {s.codec for s in header.sections} == {codec.SectionCodec.ZSTD}
    at, step = header.header_len, header.chunk_len // 2
    for i, section in enumerate(header.sections):
        stored = blob[at : at + section.stored_len]
        at += section.stored_len
        if i % 2:
            low = (words[i // 2 * step : (i // 2 + 1) * step] & 0xFF).astype(np.uint8)
            blocks, size = _zstd.raw_blocks(section.raw_len)
            assert blocks == 2
            assert section.stored_len == section.raw_len + 9 + 3 * blocks
            first, second = stored[12 : 12 + size], stored[12 + size + 3 :]
            assert first + second == low.tobytes()
            assert zstandard.ZstdDecompressor().decompress(stored) == low.tobytes()
        else:
            assert section.stored_len < section.raw_len / 2


@pytest.mark.parametrize("n", [1, 5, 131_072, 131_073, 300_001, 737_280, 1 << 22])
def test_chunks_are_as_few_as_the_limit_allows_and_equal(n: int) -> None:
    """Equal chunks merge in one numpy call per operation (a short last chunk costs two more
    hand-offs of the GIL per block): a SmolLM2 block (737,280 elements) is 3 x 480 KiB."""
    step = _planes.chunk_elements(n)
    count = -(-n // step)
    assert 2 * step <= _planes.PLANE_CHUNK
    assert count == -(-n // (_planes.PLANE_CHUNK // 2))
    assert 0 <= step - (n - (count - 1) * step) < count
    if n == 737_280:
        blob = codec.encode(bf16_normal(n), key=KEY, dtype="bfloat16", shape=(n,))
        assert codec.read_header(blob).chunk_len == 491_520


GOLDEN = Path(__file__).parent / "data" / "codec-objects-db28acd.json"


@pytest.mark.parametrize("native", [True, False], ids=["grouped", "frame-by-frame"])
def test_objects_of_an_earlier_release_still_decode(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Objects written by the release before raw-frame low planes (commit db28acd): stored
    low planes, and all-frame objects with a short last chunk (which the grouped decoder
    reads in one call)."""
    golden = json.loads(GOLDEN.read_text())
    monkeypatch.setattr(_zstd, "native", lambda: native)
    for case in golden["objects"]:
        blob, raw = base64.b64decode(case["object"]), base64.b64decode(case["raw"])
        assert bytes(codec.decode(blob, key=case["key"])) == raw, case["name"]


class CountingZstd(_zstd.ThreadZstd):
    """A thread's zstd state that counts its decode calls."""

    def __init__(self) -> None:
        super().__init__()
        self.decodes = 0

    def decompress_into(self, frame: Any, dst: np.ndarray) -> None:
        self.decodes += 1
        super().decompress_into(frame, dst)

    def decode_planes(self, *args: Any) -> bool:
        """The native kernel's libzstd call (and merge), where it is built."""
        done = super().decode_planes(*args)
        self.decodes += done
        return done


@pytest.mark.skipif(not _zstd.native(), reason="needs libzstd's own API (zstandard's cffi)")
@pytest.mark.parametrize(
    ("shape", "requested", "calls"),
    [
        ((30, 2, 3, 64, 64), CodecId.PLANES_ZSTD, 1),  # a SmolLM2 block: one group
        ((1_300_001,), CodecId.PLANES_ZSTD, 2),  # two groups, a short last chunk
        ((30, 2, 3, 64, 64), CodecId.PLANES_REF, 1),
    ],
)
def test_a_block_decodes_in_one_libzstd_call_per_group(
    shape: tuple[int, ...], requested: CodecId, calls: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each C call that drops the GIL is a point where a decoding thread may sleep to take
    it back: the planes of a group of chunks decode together (see s3kv._planes)."""
    words = bf16_normal(math.prod(shape), seed=5)
    blob = codec.encode(words, key=KEY, dtype="bfloat16", shape=shape, codec=requested)
    assert codec.read_header(blob).codec is requested
    counting = CountingZstd()
    monkeypatch.setattr(_zstd, "local", lambda: counting)
    assert bytes(codec.decode(blob, key=KEY)) == words.tobytes()
    assert counting.decodes == calls


def test_a_plane_chunk_is_as_large_as_every_reader_accepts() -> None:
    """Readers since the plane codec's first release refuse plane sections over
    MAX_ENTROPY_CHUNK: a larger chunk would read as corrupt to them (and an older
    `s3kv verify --delete-corrupt` would delete it)."""
    assert _planes.PLANE_CHUNK // 2 == _zstd.MAX_ENTROPY_CHUNK
    assert _planes.REF_CHUNK // 2 <= _zstd.MAX_RAW_FRAME  # PLANES_REF's raw frames: one block


@pytest.mark.parametrize("n", [1, 5, 131_071, 131_072, 131_073, 245_760, 262_143, 262_144])
def test_a_raw_frame_of_equal_blocks_reads_back_through_zstd(n: int) -> None:
    """Around zstd's 128 KiB block limit: the blocks are equal but the last, which alone is
    flagged last, and the frame's length is what planes_room counts on."""
    words = np.arange(n, dtype=np.uint16) * 7919
    payload = np.zeros(n + 64, np.uint8)
    sections: list[Any] = []
    end = _planes._add_raw_frame(words, n, payload, 3, sections)
    blocks, size = _zstd.raw_blocks(n)
    assert end - 3 == n + _zstd.raw_frame_overhead(n) == sections[0][1]
    assert blocks == -(-n // 131_072)
    low = (words & 0xFF).astype(np.uint8).tobytes()
    assert zstandard.ZstdDecompressor().decompress(payload[3:end].tobytes()) == low
    at, lasts = 3 + 9, []
    for _ in range(blocks):
        header = int.from_bytes(payload[at : at + 3].tobytes(), "little")
        assert header & 0b110 == 0  # a raw block
        lasts.append(header & 1)
        assert (header >> 3) == size if not lasts[-1] else 0 < (header >> 3) <= size
        at += 3 + (header >> 3)
    assert lasts == [0] * (blocks - 1) + [1]
    assert at == end


@pytest.mark.parametrize("shape", [(300_000,), (1_300_001,), (3, 2, 4, 64, 64)])
def test_objects_decode_frame_by_frame_as_earlier_releases_do(
    shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Earlier releases decode section by section (their low planes were stored sections,
    which this release still reads): the objects written now decode the same way."""
    words = bf16_normal(math.prod(shape), seed=3)
    for requested in (CodecId.PLANES_ZSTD, CodecId.PLANES_REF):
        blob = codec.encode(words, key=KEY, dtype="bfloat16", shape=shape, codec=requested)
        assert bytes(codec.decode(blob, key=KEY)) == words.tobytes()
        with monkeypatch.context() as patched:
            patched.setattr(_zstd, "native", lambda: False)  # NOTE: no multi-frame calls
            assert bytes(codec.decode(blob, key=KEY)) == words.tobytes()


def test_other_dtypes_degrade_to_plain_zstd() -> None:
    raw = bytes(range(16)) * 256
    header = codec.read_header(codec.encode(raw, key=KEY, dtype=DType.FP8_E4M3, shape=(4096,)))
    assert (header.codec, header.planes) == (CodecId.ZSTD, 1)


def test_normal_bf16_compresses_with_planes() -> None:
    raw = bf16_normal(1 << 18, seed=7, scale=2.0).tobytes()
    blob = codec.encode(raw, key=KEY, dtype=DType.BFLOAT16, shape=(1 << 18,))
    assert len(raw) / len(blob) > 1.2
    assert bytes(codec.decode(blob, key=KEY)) == raw


def test_wire_codes_are_fixed() -> None:
    assert {d.value: d.code for d in DType} == {
        "bfloat16": 1, "float16": 2, "float32": 3, "fp8_e4m3": 4, "fp8_e5m2": 5,
        "int8": 6, "uint8": 7,
    }  # fmt: skip
    assert [DType(n).itemsize for n in ("bfloat16", "float32", "fp8_e5m2")] == [2, 4, 1]
    assert [CodecId.from_name(n) for n in ("raw", "zstd", "planes-zstd")] == [0, 1, 2]
    with pytest.raises(ValueError, match="lz4"):
        CodecId.from_name("lz4")


def test_fallback_encoder_and_decoder_read_the_same_format(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    raw = bf16_normal(70_000).tobytes()
    native_blob = codec.encode(raw, key=KEY, dtype="bfloat16", shape=(70_000,))
    monkeypatch.setattr(_zstd, "_CFFI", None)
    fallback = _zstd.ThreadZstd()
    monkeypatch.setattr(_zstd, "local", lambda: fallback)
    fallback_blob = codec.encode(raw, key=KEY, dtype="bfloat16", shape=(70_000,))
    assert len(raw) / len(fallback_blob) > 1.3
    for blob in (native_blob, fallback_blob):
        assert bytes(codec.decode(blob, key=KEY)) == raw
    ref_raw, ref_shape = bf16_normal(4 * 2 * 3 * 32 * 64).tobytes(), (4, 2, 3, 32, 64)
    for requested in (CodecId.PLANES_ZSTD, CodecId.PLANES_REF):
        fallback_ref = codec.encode(
            ref_raw, key=KEY, dtype="bfloat16", shape=ref_shape, codec=requested
        )
        assert codec.read_header(fallback_ref).codec is requested
        assert bytes(codec.decode(fallback_ref, key=KEY)) == ref_raw
    flipped = bytearray(native_blob)
    flipped[codec.read_header(native_blob).header_len + 20] ^= 0xFF
    with pytest.raises(ChecksumError):
        codec.decode(bytes(flipped), key=KEY)


# -- verification: each failure has its precise error -------------------------------------


def test_encode_rejects_a_size_that_disagrees_with_the_shape() -> None:
    with pytest.raises(SizeMismatchError):
        codec.encode(b"\x00" * 10, key=KEY, dtype=DType.BFLOAT16, shape=(6,))
    with pytest.raises(ValueError, match="shape"):
        codec.encode(b"", key=KEY, dtype=DType.UINT8, shape=(-1,))


def test_wrong_key_is_a_key_mismatch(blob: bytes) -> None:
    with pytest.raises(KeyMismatchError):
        codec.decode(blob, key=KEY + "x")


def test_wrong_version_is_unsupported(blob: bytes) -> None:
    newer = blob[:4] + struct.pack("<H", 2) + blob[6:]
    for forged in (newer, reseal(newer), newer[:8]):
        with pytest.raises(UnsupportedVersionError):
            codec.decode(forged, key=KEY)


def test_size_expectations_of_the_caller(blob: bytes) -> None:
    with pytest.raises(SizeMismatchError):
        codec.decode(blob, key=KEY, expect_raw_len=6001)
    with pytest.raises(SizeMismatchError):
        codec.decode(blob, key=KEY, out=memoryview(bytearray(5999)))
    with pytest.raises(ValueError, match="writable"):
        codec.decode(blob, key=KEY, out=memoryview(bytes(6000)))


def test_every_truncation_and_extension_is_truncated(blob: bytes) -> None:
    for length in [*range(0, 80), *range(80, len(blob), 97), len(blob) - 1]:
        with pytest.raises(TruncatedError):
            codec.decode(blob[:length], key=KEY)
    with pytest.raises(TruncatedError):
        codec.decode(blob + b"\x00", key=KEY)


def test_not_an_object_is_bad_magic() -> None:
    for junk in (b"PK\x03\x04" + bytes(100), b"{}", b"\x00"):
        with pytest.raises(BadMagicError):
            codec.decode(junk, key=KEY)


def expected_error(offset: int, header_len: int) -> tuple[type[CodecError], ...]:
    """The precise error for a corrupted byte at ``offset``, by the field it lands in."""
    if offset < 4:
        return (BadMagicError,)
    if offset < 6:
        return (UnsupportedVersionError,)
    if offset < 10:  # header_len itself: too long, too short, or a crc over other bytes
        return (TruncatedError, SizeMismatchError, ChecksumError)
    return (ChecksumError,)  # rest of the header (crc32) or the payload (xxh3 / zstd)


@pytest.mark.usefixtures("chunked")
def test_every_single_byte_flip_is_detected_precisely() -> None:
    raw = bf16_normal(1500).tobytes()
    blob = codec.encode(raw, key=KEY, dtype=DType.BFLOAT16, shape=(1500,))
    header_len = codec.read_header(blob).header_len
    for offset in range(len(blob)):
        corrupt = bytearray(blob)
        corrupt[offset] ^= 1 << (offset % 8)
        with pytest.raises(expected_error(offset, header_len)):
            codec.decode(bytes(corrupt), key=KEY)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        (10, 9, UnsupportedVersionError),  # codec id
        (11, 200, UnsupportedVersionError),  # dtype code
        (13, 1, SizeMismatchError),  # planes
        (22, 6002, SizeMismatchError),  # raw_len
        (14, 3, SizeMismatchError),  # chunk_len: odd for 2 planes
    ],
)
def test_forged_but_sealed_headers_are_rejected(
    blob: bytes, field: int, value: int, error: type[CodecError]
) -> None:
    forged = bytearray(blob)
    forged[field] = value & 0xFF
    if field in (14, 22):
        forged[field : field + 8] = struct.pack("<Q", value)
    with pytest.raises(error):
        codec.decode(reseal(bytes(forged)), key=KEY)


def test_forged_huge_raw_len_never_allocates(blob: bytes) -> None:
    header = codec.read_header(blob)
    forged = bytearray(blob)
    at = 70  # dims start: claim a 2**40-element block
    forged[at : at + 16] = struct.pack("<QQ", 1 << 20, 1 << 20)
    forged[22:30] = struct.pack("<Q", 1 << 41)
    with pytest.raises(SizeMismatchError):
        codec.decode(reseal(bytes(forged)), key=KEY)
    assert header.raw_len == 6000


def raw_frame(data: bytes) -> bytes:
    """RFC 8878: magic, a single-segment frame header with a 4-byte size, then raw blocks of
    at most 128 KiB, as few as that allows, equal but the last, which alone is flagged."""
    blocks = -(-len(data) // 131_072)
    size = -(-len(data) // blocks)
    frame = struct.pack("<IBI", 0xFD2FB528, 0xA0, len(data))
    for start in range(0, len(data), size):
        piece = data[start : start + size]
        last = start + size >= len(data)
        frame += ((len(piece) << 3) | last).to_bytes(3, "little") + piece
    return frame


def reference_planes_object(words: np.ndarray, key: str, *, low_frames: bool = True) -> bytes:
    """A bf16 object laid out by hand from the wire format in codec's docstring, with the
    codec's own plane coder: the encoder's output must be exactly this. ``low_frames=False``
    lays the low planes out as earlier releases wrote them: stored sections."""
    st_ = _zstd.local()
    frame = np.empty(_zstd.FRAME_BOUND, np.uint8)
    table, body = [], []
    step = _planes.chunk_elements(words.size)
    for start in range(0, words.size, step):
        chunk = words[start : start + step]
        high = (chunk >> 8).astype(np.uint8)
        st_.plane2[: chunk.size] = high
        size = st_.entropy_frame_into(st_.plane2, chunk.size, frame, 0)
        low = (chunk & 0xFF).astype(np.uint8).tobytes()  # normal values: low plane raw
        if low_frames:
            low = raw_frame(low)
        coded = frame[:size].tobytes() if size else raw_frame(high.tobytes())
        table += [(1, len(coded)), (int(low_frames), len(low))]
        body += [coded, low]
    payload = b"".join(body)
    head = struct.pack(
        "<4sHIBBBBQQ16s16s8sQI",
        b"S3KV", 1, 70 + 8 + 4 + 9 * len(table) + 4, CodecId.PLANES_ZSTD, DType.BFLOAT16.code,
        1, 2, 2 * step, words.nbytes, xxhash.xxh3_128_digest(words.tobytes()),
        xxhash.xxh3_128_digest(key.encode()), xxhash.xxh3_64_digest(payload), words.size,
        len(table),
    )  # fmt: skip
    head += b"".join(struct.pack("<BQ", flag, n) for flag, n in table)
    return head + struct.pack("<I", zlib.crc32(head)) + payload


@pytest.mark.parametrize("chunk", [_planes.PLANE_CHUNK, 4096])
def test_plane_objects_match_the_wire_format_byte_for_byte(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_planes, "PLANE_CHUNK", chunk)
    for n in (3000, 300_001, 737_280, 1_000_001):
        words = bf16_normal(n, seed=n)
        blob = codec.encode(words, key=KEY, dtype=DType.BFLOAT16, shape=(n,))
        assert blob == reference_planes_object(words, KEY)
        earlier = reference_planes_object(words, KEY, low_frames=False)
        assert bytes(codec.decode(earlier, key=KEY)) == words.tobytes()


# -- threads: nothing that serializes codec threads ---------------------------------------


def test_large_checksums_release_the_gil(monkeypatch: pytest.MonkeyPatch) -> None:
    """xxhash 3.x's one-shot digests hash under the GIL: 20-40 us per block that no other
    codec thread can use. The codec hashes payloads through hasher objects instead."""

    def guarded(real: Callable[..., Any]) -> Callable[..., Any]:
        def digest(data: Any, *args: Any) -> Any:
            assert memoryview(data).nbytes <= 64 * 1024, "one-shot xxhash on a large buffer"
            return real(data, *args)

        return digest

    for name in ("xxh3_64_digest", "xxh3_128_digest", "xxh3_64_intdigest"):
        monkeypatch.setattr(xxhash, name, guarded(getattr(xxhash, name)))
    for raw, dtype in (
        (bf16_normal(300_000).tobytes(), DType.BFLOAT16),
        (np.random.default_rng(0).integers(0, 256, 300_000, np.uint8).tobytes(), DType.UINT8),
    ):
        blob = codec.encode(raw, key=KEY, dtype=dtype, shape=(len(raw) // dtype.itemsize,))
        assert bytes(codec.decode(blob, key=KEY)) == raw


def test_encode_allocates_only_its_result() -> None:
    """Sections go straight into the thread's scratch and are copied once into the result:
    per-chunk bytes objects cost page faults and GIL-held copies under many threads."""
    words = bf16_normal(1 << 20)  # 2 MiB, 8 chunks
    codec.encode(words, key=KEY, dtype=DType.BFLOAT16, shape=words.shape)  # warm the scratch
    tracemalloc.start()
    try:
        blob = codec.encode(words, key=KEY, dtype=DType.BFLOAT16, shape=words.shape)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < len(blob) + 64 * 1024


def test_encode_view_joins_where_the_header_is_not_as_planned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A header longer than planned (a bug in the planning) costs the copy, not the bytes."""
    words = bf16_normal(300_000, seed=4)
    expected = codec.encode(words, key=KEY, dtype="bfloat16", shape=words.shape)
    planned = _planes.planes_room
    monkeypatch.setattr(_planes, "planes_room", lambda n: (planned(n)[0] + 1, planned(n)[1]))
    view = codec.encode_view(words, key=KEY, dtype="bfloat16", shape=words.shape)
    assert view == expected
    assert isinstance(view.obj, bytes)  # NOTE: joined


def test_encode_view_codes_the_payload_in_place_and_owns_its_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No final copy of the object (encode's join holds the GIL), and a buffer no later
    encode on the thread reuses: a view handed to a PUT stays intact."""
    first, second = bf16_normal(300_000, seed=1), bf16_normal(300_000, seed=2)
    expected = codec.encode(first, key=KEY, dtype="bfloat16", shape=first.shape)

    def no_join(*args: Any) -> bytes:
        raise AssertionError("the plane codecs' object was joined")

    monkeypatch.setattr(codec, "_assemble", no_join)
    for requested, shape in (
        (CodecId.PLANES_ZSTD, (300_000,)),
        (CodecId.PLANES_REF, (5, 2, 3, 100, 100)),
    ):
        view = codec.encode_view(first, key=KEY, dtype="bfloat16", shape=shape, codec=requested)
        assert codec.read_header(view).codec is requested
        kept = bytes(view)
        codec.encode_view(second, key=KEY, dtype="bfloat16", shape=shape, codec=requested)
        monkeypatch.undo()
        codec.encode(second, key=KEY, dtype="bfloat16", shape=shape, codec=requested)
        monkeypatch.setattr(codec, "_assemble", no_join)
        assert bytes(view) == kept
        assert not np.shares_memory(np.frombuffer(view, np.uint8), _zstd.local().payload(0))
        np.testing.assert_array_equal(
            np.frombuffer(codec.decode(view, key=KEY), np.uint16), first.view(np.uint16)
        )
    view = codec.encode_view(first, key=KEY, dtype="bfloat16", shape=first.shape)
    assert view == expected


def test_threads_encode_and_decode_independently() -> None:
    """Per-thread scratch: concurrent encodes and decodes give what one thread gives, and a
    result stays intact after its thread encodes again."""
    blocks = [bf16_normal(200_000 + 997 * i, seed=i) for i in range(8)]
    expected = [
        codec.encode(b, key=f"{KEY}/{i}", dtype="bfloat16", shape=b.shape)
        for i, b in enumerate(blocks)
    ]
    results: dict[int, list[bytes]] = {}
    failures: list[BaseException] = []

    def work(t: int) -> None:
        try:
            mine = []
            for r in range(3):
                i = (t + r) % len(blocks)
                blob = codec.encode(
                    blocks[i], key=f"{KEY}/{i}", dtype="bfloat16", shape=blocks[i].shape
                )
                out = np.empty_like(blocks[i])
                codec.decode(blob, key=f"{KEY}/{i}", out=out.data)
                np.testing.assert_array_equal(out, blocks[i])
                mine.append(blob)
            results[t] = mine
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not failures, failures
    for t, mine in results.items():
        assert mine == [expected[(t + r) % len(blocks)] for r in range(3)]
    assert len(results) == 8


# -- fuzzing: any bytes at all give a CodecError or the right answer ----------------------


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_raise_codec_errors(data: bytes) -> None:
    for candidate in (data, codec.MAGIC + struct.pack("<H", 1) + data):
        with pytest.raises(CodecError):
            codec.decode(candidate, key=KEY)


@settings(max_examples=400, deadline=None)
@given(edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), max_size=6),
       seal=st.sampled_from(["no", "header", "header+payload"]),
       cut=st.integers(0, 10_000))  # fmt: skip
def test_mutated_objects_raise_codec_errors_or_decode_exactly(
    edits: list[tuple[int, int]], seal: str, cut: int
) -> None:
    assert_mutation_is_caught(SAMPLE, SAMPLE_RAW, edits, seal, cut)


def assert_mutation_is_caught(
    sample: bytes, raw: bytes, edits: list[tuple[int, int]], seal: str, cut: int
) -> None:
    """``sample`` (an object of ``raw`` under KEY) with bytes flipped by ``edits``, sometimes
    truncated (``cut``) and resealed (``seal``): a CodecError, or exactly ``raw``."""
    corrupt = bytearray(sample)
    for offset, xor in edits:
        corrupt[offset % len(corrupt)] ^= xor
    if cut % 4 == 0:  # sometimes also truncate the payload
        del corrupt[len(corrupt) - cut % 300 :]
    candidate = bytes(corrupt)
    if seal != "no" and len(corrupt) >= 10:
        candidate = reseal(candidate, payload=seal == "header+payload")
    try:
        out = codec.decode(candidate, key=KEY)
    except CodecError:
        return
    assert bytes(out) == raw


def _imported_modules(module: object) -> Iterator[str]:
    for node in ast.walk(ast.parse(inspect.getsource(module))):  # type: ignore[arg-type]
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def test_no_pickle_on_the_read_path() -> None:
    forbidden = {"pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib", "torch"}
    for module in (codec, _zstd):
        assert forbidden.isdisjoint(name.split(".")[0] for name in _imported_modules(module))
        assert forbidden.isdisjoint(vars(module))


def test_header_layouts_are_cached_within_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parsed section lengths are cached per layout, but a layout of many sections (a forged
    header's) is not: the cache stays within 64 layouts of at most 4096 sections."""
    assert codec._cached_raw_lengths.cache_parameters()["maxsize"] == 64
    monkeypatch.setattr(_planes, "ZSTD_CHUNK", 64)
    raw = np.random.default_rng(2).integers(0, 4, 64 * 4097, np.uint8).tobytes()
    blob = codec.encode(raw, key=KEY, dtype=DType.UINT8, shape=(len(raw),))
    header = codec.read_header(blob)
    assert len(header.sections) == 4097 > codec._CACHED_SECTIONS
    codec._cached_raw_lengths.cache_clear()
    assert bytes(codec.decode(blob, key=KEY)) == raw
    assert codec._cached_raw_lengths.cache_info().currsize == 0
    assert bytes(codec.decode(SAMPLE, key=KEY)) == SAMPLE_RAW
    assert codec._cached_raw_lengths.cache_info().currsize == 1
