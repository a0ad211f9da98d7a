"""Decoders check declared counts and sizes before allocating (issue 12, item 12).

Each test hands a decoder a small object whose header declares something huge and checks
two things: the object is refused with an error naming what is wrong, and the refusal cost
little memory (``tracemalloc``'s peak, which sees numpy's and zstd's buffers; the bounds
are generous: the defects allocated hundreds of MB to 1 GiB).
"""

from __future__ import annotations

import json
import os
import struct
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest
import zstandard
from cli_support import PREFIX, Bucket, Clock, identity

from s3kv import codec
from s3kv.errors import CodecError, SizeMismatchError, TruncatedError
from s3kv.keys import manifest_prefix
from s3kv.manifest import RECORD_DTYPE, USAGE_DTYPE, ManifestIO, ManifestLog, load_usage
from s3kv.manifest.format import (
    MAX_CURRENT_BYTES,
    SEGMENT_MAGIC,
    Current,
    decode_records,
    decode_usage,
    encode_records,
    encode_usage,
    max_encoded_len,
)
from s3kv.manifest.log import LATEST_NAME, MAX_ENTRY_BYTES, LogEntry, SnapshotRef
from s3kv.manifest.snapshot import read_delta, read_usage_shard
from s3kv.manifest.xorfilter import XOR_MAGIC, XorFilter
from s3kv.ops.scope import resolve_scope
from s3kv.ops.verify import MAX_UNKNOWN_RAW, verify_objects
from s3kv.storage import MemoryBackend

MB = 1024 * 1024
_FRAME = struct.Struct("<8sHHIQQ")  # the manifest framing's header (format.py)


@contextmanager
def peak_bytes() -> Iterator[Callable[[], int]]:
    """Traced allocations' peak within the block, above what was allocated before it."""
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    peak = [0]
    try:
        yield lambda: peak[0]
    finally:
        peak[0] = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()


def zero_frame(nbytes: int) -> bytes:
    """One zstd frame of ``nbytes`` zeros, declaring its size: zstd's run-length blocks
    make it about 4 bytes per 128 KiB (530 MB in 16 KB)."""
    compressor = zstandard.ZstdCompressor(level=3).compressobj(size=nbytes)
    chunk = bytes(4 * MB)
    parts = [
        compressor.compress(chunk[: min(len(chunk), nbytes - at)])
        for at in range(0, nbytes, len(chunk))
    ]
    return b"".join([*parts, compressor.flush()])


def forged_segment(records: int) -> bytes:
    """A segment whose header and frame both declare ``records`` records of zeros."""
    header = _FRAME.pack(SEGMENT_MAGIC, 1, RECORD_DTYPE.itemsize, 0, records, 0)
    return header + zero_frame(records * RECORD_DTYPE.itemsize)


# --- manifest segments and usage tables ------------------------------------------------


def test_a_forged_segment_declaring_10m_records_is_refused_before_allocating() -> None:
    forged = forged_segment(10_000_000)
    assert len(forged) < 20_000  # ~16 KB claiming 530 MB
    with peak_bytes() as peak, pytest.raises(SizeMismatchError) as raised:
        decode_records(forged)
    assert peak() < 50 * MB
    assert "10000000 records" in str(raised.value)
    assert "forged or corrupt" in str(raised.value)


def test_an_engine_opening_the_manifest_skips_a_forged_segment_cheaply() -> None:
    # What an instance reads at open: every segment not folded yet (here no compactor ran).
    backend = MemoryBackend()
    segments = manifest_prefix(PREFIX, "f" * 32) + "segments/"
    backend.put(segments + "1700000000000-forger-000000.seg", forged_segment(10_000_000))
    real = np.zeros(3, RECORD_DTYPE)
    real["key"] = np.frombuffer(os.urandom(48), "V16")
    real["kind"], real["count"] = 1, 1
    backend.put(segments + "1700000000001-honest-000000.seg", encode_records(real))
    with peak_bytes() as peak:
        usage = load_usage(backend, PREFIX, "f" * 32)
    assert peak() < 50 * MB
    assert (usage.segments_read, usage.segments_corrupt, len(usage)) == (1, 1, 3)


def test_real_tables_still_decode_in_one_allocation() -> None:
    # Random keys, as real ones are: zstd cannot shrink them past the ratio bound.
    n = 200_000
    rows = np.zeros(n, USAGE_DTYPE)
    rows["key"] = np.sort(np.frombuffer(os.urandom(16 * n), "V16"))
    rows["last_used"], rows["size"] = 1.7e9, 1 << 20
    blob = encode_usage(rows)
    assert len(blob) <= max_encoded_len(n, USAGE_DTYPE)
    with peak_bytes() as peak:
        decoded = decode_usage(blob, count=n)
    assert np.array_equal(decoded, rows)
    assert decoded.flags.writeable
    assert peak() < 1.25 * rows.nbytes  # the rows once (it was twice: bytes, then a copy)


@pytest.mark.parametrize("n", [0, 1, 7, 3000])
def test_max_encoded_len_bounds_incompressible_tables(n: int) -> None:
    rows = np.frombuffer(os.urandom(n * USAGE_DTYPE.itemsize), USAGE_DTYPE)
    assert len(encode_usage(rows)) <= max_encoded_len(n, USAGE_DTYPE)
    records = np.frombuffer(os.urandom(n * RECORD_DTYPE.itemsize), RECORD_DTYPE)
    assert len(encode_records(records)) <= max_encoded_len(n, RECORD_DTYPE)


def test_a_usage_shard_holding_another_count_than_its_entry_says_is_refused() -> None:
    io = ManifestIO(MemoryBackend(), PREFIX, "f" * 32)
    rows = np.zeros(5, USAGE_DTYPE)
    rows["key"] = np.sort(np.frombuffer(os.urandom(80), "V16"))
    ref = SnapshotRef("snapshots/00000000000000000001-t", 1, 0, (5,), 24, 0.0)
    io.put(ref.usage_path(0), encode_usage(rows))
    assert len(read_usage_shard(io, ref, 0)) == 5
    lying = SnapshotRef(ref.path, 1, 0, (4,), 24, 0.0)
    with pytest.raises(SizeMismatchError, match="5 records, its log entry says 4"):
        read_usage_shard(io, lying, 0)


def test_a_delta_holding_another_count_than_its_entry_says_is_refused() -> None:
    io = ManifestIO(MemoryBackend(), PREFIX, "f" * 32)
    io.put("deltas/d.delta", forged_segment(2_000_000))  # 106 MB of zeros, under the ratio
    # NOTE: refused unread now (longer than 3 records can be), or by its declared count.
    refused = "its log entry says 3|bytes its kind can be"
    with peak_bytes() as peak, pytest.raises(SizeMismatchError, match=refused):
        read_delta(io, "deltas/d.delta", records=3)
    assert peak() < 50 * MB


# --- filters, log entries, pointers -----------------------------------------------------


def test_a_filter_header_declaring_2_30_keys_is_refused_before_allocating() -> None:
    keys = 1 << 30
    slots = XorFilter.serialized_size(keys, 32) // 4 - 12  # consistent geometry (48-byte header)
    header = struct.pack("<8sIIQQQQ", XOR_MAGIC, 32, 0, 1, slots, keys, 0)
    with peak_bytes() as peak, pytest.raises(TruncatedError, match="header says"):
        XorFilter.from_bytes(header + bytes(100))
    assert peak() < 50 * MB
    built = XorFilter.build([os.urandom(16) for _ in range(1000)], 24)
    assert len(built.to_bytes()) == XorFilter.serialized_size(1000, 24)


def test_an_oversized_log_entry_is_refused_before_parsing() -> None:
    huge = b'{"folded": [' + b'"a",' * (MAX_ENTRY_BYTES // 4) + b'"a"]}'
    with peak_bytes() as peak, pytest.raises(CodecError, match="over the"):
        LogEntry.from_json(huge)
    assert peak() < 50 * MB


def test_an_oversized_latest_hint_is_ignored() -> None:
    io = ManifestIO(MemoryBackend(), PREFIX, "f" * 32)
    io.put(LATEST_NAME, json.dumps({"version": 7, "pad": "x" * 10_000}).encode())
    assert ManifestLog(io).hint() == 0
    io.put(LATEST_NAME, json.dumps({"version": 7}).encode())
    assert ManifestLog(io).hint() == 7


def test_an_oversized_current_pointer_is_refused_before_parsing() -> None:
    with pytest.raises(CodecError, match="too large"):
        Current.from_json(b" " * (MAX_CURRENT_BYTES + 1))


# --- block objects: verify --all ---------------------------------------------------------


def forged_block(key: str) -> bytes:
    """A valid object of 1 GiB of zeros, encoded into ~40 KB (the issue's 39 KB object)."""
    zeros = np.zeros(1 << 30, np.uint8)  # NOTE: calloc'd: reading it maps the zero page
    return codec.encode(zeros, key=key, dtype="uint8", shape=(1 << 30,), codec=codec.CodecId.ZSTD)


@pytest.fixture(scope="module")
def one_gib_block() -> Callable[[str], bytes]:
    cache: dict[str, bytes] = {}

    def make(key: str) -> bytes:
        if key not in cache:
            cache[key] = forged_block(key)
        return cache[key]

    return make


@pytest.mark.parametrize(
    ("block_elems", "kind"),
    [
        (32, "too_large"),  # 256-byte blocks: 40 KB is refused from its length, unread
        (1 << 20, "size_mismatch"),  # 4 MiB blocks: read, and refused from its header
    ],
)
def test_verify_all_reports_a_block_declaring_1_gib_as_corrupt_cheaply(
    one_gib_block: Callable[[str], bytes], block_elems: int, kind: str
) -> None:
    ident = replace(identity(), block_elems=block_elems)
    bucket = Bucket(MemoryBackend(), "memory://", "test", fingerprint=ident.fingerprint())
    bucket.write_identity(ident)
    (key,) = bucket.chain(range(4))
    object_key = bucket.object_key(key)
    bucket.backend.put(object_key, one_gib_block(object_key))
    scope = resolve_scope(bucket.backend, PREFIX)
    with peak_bytes() as peak:
        report = verify_objects(bucket.backend, scope, prefix=PREFIX, sample=None)
    assert peak() < 50 * MB
    (finding,) = report.findings
    assert (finding.verdict, finding.kind) == ("corrupt", kind)
    assert finding.size < 50_000


def test_verify_all_without_identity_does_not_decode_a_block_declaring_1_gib(
    one_gib_block: Callable[[str], bytes],
) -> None:
    bucket = Bucket(MemoryBackend(), "memory://", "test")  # no identity.json: no geometry
    (key,) = bucket.chain(range(4))
    object_key = bucket.object_key(key)
    bucket.backend.put(object_key, one_gib_block(object_key))
    scope = resolve_scope(bucket.backend, PREFIX)
    with peak_bytes() as peak:
        report = verify_objects(bucket.backend, scope, prefix=PREFIX, sample=None, delete=True)
    assert peak() < 50 * MB
    (finding,) = report.findings
    assert (finding.verdict, finding.kind, finding.deleted) == ("unsupported", "unchecked", False)
    assert str(MAX_UNKNOWN_RAW) in finding.detail
    assert report.remaining == 0


def test_verify_all_without_identity_still_decodes_ordinary_blocks() -> None:
    bucket = Bucket(MemoryBackend(), "memory://", "test")
    bucket.write_chain(bucket.chain(range(8)), Clock(0.0))
    scope = resolve_scope(bucket.backend, PREFIX)
    report = verify_objects(bucket.backend, scope, prefix=PREFIX, sample=None)
    assert (report.checked, report.ok, report.findings) == (2, 2, ())


@pytest.mark.parametrize("raw_len", [0, 2, 1000, 128 * 1024, 3 * MB + 2])
@pytest.mark.parametrize("codec_id", list(codec.CodecId))
def test_max_object_len_bounds_every_encoding(raw_len: int, codec_id: codec.CodecId) -> None:
    raw = os.urandom(raw_len)  # incompressible: every section stored as is
    blob = codec.encode(raw, key="k", dtype="bfloat16", shape=(raw_len // 2,), codec=codec_id)
    assert len(blob) <= codec.max_object_len(raw_len)
