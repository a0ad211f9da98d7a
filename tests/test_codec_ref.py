"""s3kv.codec's PLANES_REF: round trips, fallback to PLANES_ZSTD, verification, real-KV ratio."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_codec import KEY, assert_mutation_is_caught, expected_error, reseal

from s3kv import _planes, codec
from s3kv.codec import CodecId, DType
from s3kv.config import S3KVConfig
from s3kv.connector.worker import block_geometry
from s3kv.errors import ChecksumError, SizeMismatchError, UnsupportedVersionError
from s3kv.keys import ROOT_HASH, BlockHash, ModelIdentity, chain_hashes
from s3kv.pool import IOPool
from s3kv.staging import NumpyAllocator
from s3kv.storage import MemoryBackend
from s3kv.store import KVStore, SaveStatus

#: (layers, 2, heads, tokens, head_dim): a connector block of an HND pool.
SHAPE = (4, 2, 3, 8, 16)


def kv_like(shape: tuple[int, ...], dtype: DType, seed: int = 0) -> np.ndarray:  # type: ignore[type-arg]
    """Bit patterns of KV-like values: per-channel scales over normal samples."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(0, 1.5, (*shape[:3], 1, shape[4])))
    values = (rng.normal(0, 1, shape) * scale).astype(np.float32)
    if dtype is DType.FLOAT16:
        return values.astype(np.float16).view(np.uint16)
    return (values.view(np.uint32) >> 16).astype(np.uint16)


def ref_blob(shape: tuple[int, ...] = SHAPE, dtype: DType = DType.BFLOAT16) -> bytes:
    raw = kv_like(shape, dtype)
    return codec.encode(raw, key=KEY, dtype=dtype, shape=shape, codec=CodecId.PLANES_REF)


@pytest.fixture(params=[None, 256], ids=["default-chunks", "256-byte-chunks"])
def chunked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Also encode with tiny chunks: every plane in several sections."""
    if request.param is not None:
        monkeypatch.setattr(_planes, "REF_CHUNK", request.param)


# -- round trips and fallback --------------------------------------------------------------


def test_config_name_and_wire_code() -> None:
    assert CodecId.from_name("planes-ref") is CodecId.PLANES_REF == 3
    assert S3KVConfig.load(environ={"TLLM_S3KV_CODEC": "planes-ref"}).codec == "planes-ref"


@pytest.mark.usefixtures("chunked")
@pytest.mark.parametrize("dtype", [DType.BFLOAT16, DType.FLOAT16])
@pytest.mark.parametrize("shape", [SHAPE, (1, 2, 1, 2, 1), (3, 2, 5, 7, 9), (30, 2, 3, 32, 64)])
def test_round_trip_of_kv_like_blocks(dtype: DType, shape: tuple[int, ...]) -> None:
    raw = kv_like(shape, dtype)
    blob = codec.encode(raw, key=KEY, dtype=dtype, shape=shape, codec=CodecId.PLANES_REF)
    header = codec.read_header(blob)
    if _planes.REF_CHUNK > 4096 and math.prod(shape) >= 1000:  # NOTE: tiny frames may not pay
        assert (header.codec, header.planes, header.shape) == (CodecId.PLANES_REF, 2, shape)
    assert bytes(codec.decode(blob, key=KEY)) == raw.tobytes()
    out = np.full(raw.nbytes, 0xA5, np.uint8)
    codec.decode(blob, key=KEY, out=out.data)
    assert out.tobytes() == raw.tobytes()


@pytest.mark.usefixtures("chunked")
@settings(max_examples=40, deadline=None)
@given(
    dims=st.tuples(*(st.integers(1, 6) for _ in range(4))),
    dtype=st.sampled_from([DType.BFLOAT16, DType.FLOAT16]),
    kind=st.sampled_from(["random", "zeros", "values", "constant"]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_of_any_data(
    dims: tuple[int, int, int, int], dtype: DType, kind: str, seed: int
) -> None:
    layers, heads, tokens, dim = dims
    shape = (layers, 2, heads, tokens + 1, dim)
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    raw = {
        "random": rng.integers(0, 1 << 16, n, dtype=np.uint16),
        "zeros": np.zeros(n, np.uint16),
        "values": kv_like(shape, dtype, seed).reshape(-1),
        "constant": np.full(n, 0x8001, np.uint16),
    }[kind]
    blob = codec.encode(raw, key=KEY, dtype=dtype, shape=shape, codec=CodecId.PLANES_REF)
    assert codec.read_header(blob).codec in (CodecId.PLANES_REF, CodecId.RAW)
    assert len(blob) <= codec.max_object_len(raw.nbytes)
    assert bytes(codec.decode(blob, key=KEY)) == raw.tobytes()


@pytest.mark.parametrize(
    ("dtype", "shape", "written"),
    [
        (DType.BFLOAT16, (4, 2, 24, 16), CodecId.PLANES_ZSTD),  # rank 4: the pool's shape
        (DType.BFLOAT16, (4, 3, 3, 8, 16), CodecId.PLANES_ZSTD),  # no K/V axis of 2
        (DType.BFLOAT16, (4, 2, 3, 1, 16), CodecId.PLANES_ZSTD),  # one token
        (DType.BFLOAT16, (4, 2, 3, 8, 16, 1), CodecId.PLANES_ZSTD),  # rank 6
        (DType.FLOAT16, (2304,), CodecId.PLANES_ZSTD),
        (DType.FLOAT32, SHAPE, CodecId.ZSTD),
        (DType.UINT8, SHAPE, CodecId.ZSTD),
    ],
)
def test_unusable_geometry_falls_back_to_planes_zstd(
    dtype: DType, shape: tuple[int, ...], written: CodecId
) -> None:
    raw = np.resize(
        kv_like(SHAPE, DType.BFLOAT16).view(np.uint8), math.prod(shape) * dtype.itemsize
    )
    blob = codec.encode(raw, key=KEY, dtype=dtype, shape=shape, codec=CodecId.PLANES_REF)
    assert codec.read_header(blob).codec is written
    assert bytes(codec.decode(blob, key=KEY)) == raw.tobytes()
    # NOTE: the fallback is PLANES_ZSTD's very object, byte for byte.
    asked = CodecId.PLANES_ZSTD if written is CodecId.PLANES_ZSTD else CodecId.ZSTD
    assert blob == codec.encode(raw, key=KEY, dtype=dtype, shape=shape, codec=asked)


def test_empty_and_incompressible_blocks() -> None:
    empty = codec.encode(b"", key=KEY, dtype="bfloat16", shape=(0, 2, 3, 8, 16), codec=3)
    assert codec.read_header(empty).codec is CodecId.RAW
    noise = np.random.default_rng(1).integers(0, 256, math.prod(SHAPE) * 2, np.uint8)
    blob = codec.encode(noise, key=KEY, dtype="bfloat16", shape=SHAPE, codec=CodecId.PLANES_REF)
    assert codec.read_header(blob).codec is CodecId.RAW
    assert bytes(codec.decode(blob, key=KEY)) == noise.tobytes()


def test_references_beat_planes_zstd_on_kv_like_data() -> None:
    raw = kv_like((30, 2, 3, 32, 64), DType.BFLOAT16)
    ref = codec.encode(raw, key=KEY, dtype="bfloat16", shape=raw.shape, codec=CodecId.PLANES_REF)
    plain = codec.encode(raw, key=KEY, dtype="bfloat16", shape=raw.shape)
    assert codec.read_header(ref).codec is CodecId.PLANES_REF
    assert len(ref) < 0.97 * len(plain)


def test_real_smollm2_kv_ratio() -> None:
    from s3kv.testing.smollm2 import kv_blocks

    # NOTE: the connector's blocks of TensorRT-LLM's HND pool: [layers, 2, heads, tokens, dim].
    blocks = [np.ascontiguousarray(b.transpose(0, 1, 3, 2, 4)) for b in kv_blocks(32)]
    raw = sum(b.nbytes for b in blocks)
    stored = {CodecId.PLANES_ZSTD: 0, CodecId.PLANES_REF: 0}
    for i, block in enumerate(blocks):
        for codec_id in stored:
            blob = codec.encode(
                block, key=f"k{i}", dtype="bfloat16", shape=block.shape, codec=codec_id
            )
            assert codec.read_header(blob).codec is codec_id
            assert bytes(codec.decode(blob, key=f"k{i}")) == block.tobytes()
            stored[codec_id] += len(blob)
    assert raw / stored[CodecId.PLANES_REF] >= 1.47  # measured 1.4734 (PLANES_ZSTD: 1.4497)
    assert stored[CodecId.PLANES_REF] < 0.985 * stored[CodecId.PLANES_ZSTD]


# -- verification --------------------------------------------------------------------------


@pytest.mark.usefixtures("chunked")
def test_every_single_byte_flip_is_detected_precisely() -> None:
    blob = ref_blob((2, 2, 1, 8, 16))
    header = codec.read_header(blob)
    assert header.codec is CodecId.PLANES_REF
    for offset in range(len(blob)):
        corrupt = bytearray(blob)
        corrupt[offset] ^= 1 << (offset % 8)
        with pytest.raises(expected_error(offset, header.header_len)):
            codec.decode(bytes(corrupt), key=KEY)


@pytest.mark.usefixtures("chunked")
def test_corrupt_sections_behind_a_resealed_payload_are_checksum_errors() -> None:
    blob = ref_blob()
    header = codec.read_header(blob)
    at = header.header_len
    for section in header.sections:
        corrupt = bytearray(blob)
        corrupt[at + section.stored_len // 2] ^= 0x10
        with pytest.raises(ChecksumError):
            codec.decode(reseal(bytes(corrupt), payload=True), key=KEY)
        at += section.stored_len


@pytest.mark.parametrize(
    "dims",
    [
        (4, 2, 3, 16, 8),  # same size, another geometry: other section lengths
        (4, 2, 3, 1, 128),  # one token: no geometry for PLANES_REF
        (8, 1, 3, 8, 16),  # no K/V axis
    ],
)
def test_forged_geometry_is_rejected(dims: tuple[int, ...]) -> None:
    blob = bytearray(ref_blob())
    blob[70 : 70 + 40] = struct.pack("<5Q", *dims)
    with pytest.raises((SizeMismatchError, ChecksumError)):
        codec.decode(reseal(bytes(blob), payload=True), key=KEY)


def test_forged_chunk_len_and_huge_geometry_never_allocate() -> None:
    blob = ref_blob()
    forged = bytearray(blob)
    forged[14:22] = struct.pack("<Q", 2)  # chunk_len: millions of sections for this table
    with pytest.raises(SizeMismatchError):
        codec.decode(reseal(bytes(forged)), key=KEY)
    forged = bytearray(blob)
    forged[70 : 70 + 40] = struct.pack("<5Q", 1 << 20, 2, 1 << 10, 1 << 10, 1 << 10)
    forged[22:30] = struct.pack("<Q", 1 << 52)
    with pytest.raises(SizeMismatchError):
        codec.decode(reseal(bytes(forged)), key=KEY)


SAMPLE_RAW = kv_like(SHAPE, DType.BFLOAT16).tobytes()
SAMPLE = ref_blob()


@settings(max_examples=300, deadline=None)
@given(edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), max_size=6),
       seal=st.sampled_from(["no", "header", "header+payload"]),
       cut=st.integers(0, 10_000))  # fmt: skip
def test_mutated_objects_raise_codec_errors_or_decode_exactly(
    edits: list[tuple[int, int]], seal: str, cut: int
) -> None:
    assert_mutation_is_caught(SAMPLE, SAMPLE_RAW, edits, seal, cut)


# -- the connector's geometry and the store ------------------------------------------------


def test_block_geometry_of_a_pool() -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, 32-token blocks.
    assert block_geometry((100, 30, 2, 3 * 32 * 64), 32, 64) == (30, 2, 3, 32, 64)
    assert block_geometry((100, 30, 2, 3 * 32 * 64), 32, None) is None
    assert block_geometry((100, 30, 2, 3 * 32 * 64 + 64), 32, 64) is None
    assert block_geometry((100, 30, 1, 3 * 32 * 64), 32, 64) is None
    assert block_geometry((30, 2, 3 * 32 * 64), 32, 64) is None


def open_store(backend: MemoryBackend, codec_name: str = "planes-ref") -> KVStore:
    """A store of a model whose blocks are :data:`SHAPE`, with ``codec_name``."""
    layers, _, heads, tokens, dim = SHAPE
    identity = ModelIdentity(
        model_id="test/model",
        weights_revision="r1",
        dtype="bfloat16",
        kv_dtype="bfloat16",
        quantization="none",
        tokens_per_block=tokens,
        kv_factor=2,
        block_elems=heads * tokens * dim,
        num_layers=layers,
        layout="test",
    )
    settings = {"bucket": "test", "manifest_refresh_interval": 0, "io_threads": 1}
    return KVStore.open(
        S3KVConfig.load(environ={}, codec=codec_name, **settings),
        identity,
        backend=backend,
        allocator=NumpyAllocator(),
        pool=IOPool(0),
        start_background=False,
    )


def save_chain(store: KVStore, keys: list[BlockHash], data: list[np.ndarray]) -> list[SaveStatus]:  # type: ignore[type-arg]
    parent = ROOT_HASH
    statuses = []
    for key, block in zip(keys, data, strict=True):
        statuses.append(store.save(key, parent, block, dtype="bfloat16", shape=SHAPE))
        parent = key
    assert store.flush(timeout=10)
    return statuses


def block_headers(backend: MemoryBackend) -> list[codec.Header]:
    blobs = [backend.get(o.key) for o in backend.list("")]
    return [codec.read_header(b) for b in blobs if b and b[:6] == codec.MAGIC + b"\x01\x00"]


def test_store_saves_planes_ref_objects_that_a_new_reader_stages() -> None:
    backend = MemoryBackend()
    data = [kv_like(SHAPE, DType.BFLOAT16, seed) for seed in range(4)]
    keys = chain_hashes(list(range(4 * SHAPE[3])), SHAPE[3])
    writer = open_store(backend)
    assert save_chain(writer, keys, data) == [SaveStatus.QUEUED] * 4
    writer.close()
    headers = block_headers(backend)
    assert [h.codec for h in headers] == [CodecId.PLANES_REF] * 4
    assert {h.shape for h in headers} == {SHAPE}
    reader = open_store(backend)
    assert reader.prefetch(keys) == 4
    assert reader.wait_staged(keys, timeout=5) == 4
    for key, block in zip(keys, data, strict=True):
        staged = reader.staged(key)
        assert staged is not None
        assert staged.tobytes() == block.tobytes()


def test_a_release_without_planes_ref_rewrites_its_blocks_once_and_both_then_hit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Instances set to planes-ref share a bucket with instances of a release before it
    # (a rolling upgrade). To those, codec 3 is an unsupported version: a miss they
    # quarantine and overwrite with PLANES_ZSTD when they save the block. planes-ref
    # instances read PLANES_ZSTD and never rewrite it, so the bucket settles, no thrash.
    backend = MemoryBackend()
    data = [kv_like(SHAPE, DType.BFLOAT16, seed) for seed in range(3)]
    keys = chain_hashes(list(range(3 * SHAPE[3])), SHAPE[3])
    new = open_store(backend)
    save_chain(new, keys, data)
    new.close()

    read_header = codec.read_header

    def previous_release(blob: bytes) -> codec.Header:
        if bytes(blob[10:11]) == bytes([CodecId.PLANES_REF]):
            raise UnsupportedVersionError("unknown codec 3 or dtype code 2")
        return read_header(blob)

    with monkeypatch.context() as old_release:
        old_release.setattr(codec, "read_header", previous_release)
        old = open_store(backend, "planes-zstd")
        assert old.prefetch(keys) == 3
        assert old.wait_staged(keys, timeout=5) == 0
        assert old.metrics.value("corrupt_objects", kind="unsupported_version") == 3
        assert save_chain(old, keys, data) == [SaveStatus.QUEUED] * 3
        old.close()
    assert [h.codec for h in block_headers(backend)] == [CodecId.PLANES_ZSTD] * 3

    for _ in range(2):
        again = open_store(backend)
        assert again.prefetch(keys) == 3
        assert again.wait_staged(keys, timeout=5) == 3
        assert [again.staged(k).tobytes() for k in keys] == [b.tobytes() for b in data]  # type: ignore[union-attr]
        assert save_chain(again, keys, data) == [SaveStatus.SKIPPED] * 3
        again.close()
    assert [h.codec for h in block_headers(backend)] == [CodecId.PLANES_ZSTD] * 3


def test_the_trtllm_worker_derives_the_shape_from_the_model_config(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from s3kv.connector import trtllm

    pool = SimpleNamespace(shape=(100, 30, 2, 3 * 32 * 64))

    def shape(args: SimpleNamespace, codec_name: str) -> tuple[int, ...] | None:
        return trtllm._block_shape(args, trtllm._read_model_config(args), pool, codec_name)

    (tmp_path / "config.json").write_text(
        json.dumps({"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3})
    )
    kv_cache = SimpleNamespace(tokens_per_block=32)
    args = SimpleNamespace(model=str(tmp_path), kv_cache_config=kv_cache)
    assert shape(args, "planes-ref") == (30, 2, 3, 32, 64)
    assert not caplog.records
    # NOTE: another attention backend may lay blocks out NHD: no HND geometry claimed
    flashinfer = SimpleNamespace(**vars(args), attn_backend="FLASHINFER")
    assert shape(flashinfer, "planes-ref") is None
    (tmp_path / "config.json").write_text(json.dumps({"head_dim": 128}))
    assert shape(args, "planes-zstd") is None  # 6144 is not k * 32 * 128
    assert len(caplog.records) == 1  # NOTE: planes-zstd does not need the geometry
    assert shape(args, "planes-ref") is None
    assert shape(SimpleNamespace(model="org/hub-id"), "planes-ref") is None
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 3
    assert all("written as planes-zstd" in w for w in warnings)
    assert "backend FLASHINFER" in warnings[0]
    assert "head_dim 128" in warnings[1]
    assert "'org/hub-id' gives none" in warnings[2]
