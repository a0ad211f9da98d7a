"""The native plane kernel (s3kv/_planes_native.c) against the Python codec it stands in for.

The kernel must write exactly the Python encoder's bytes: objects are read by every release,
and the Python encoder is what runs where the kernel is not built.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s3kv import _planes, _zstd, codec

KEY = "model/abc/0123"

needs_kernel = pytest.mark.skipif(
    _zstd._KERNEL is None, reason="the native kernel is not built (no C compiler at install)"
)


def block(n: int, kind: str, seed: int = 0) -> np.ndarray:
    """``n`` 16-bit words whose planes compress as ``kind`` says."""
    rng = np.random.default_rng(seed)
    if kind == "bf16":  # a compressible high plane, an incompressible low one
        values = rng.standard_normal(n).astype(np.float32)
        return (values.view(np.uint32) >> 16).astype(np.uint16)
    if kind == "fp16-small":  # both planes compress: the probe codes low planes
        return (rng.standard_normal(n) * 1e-3).astype(np.float16).view(np.uint16)
    if kind == "random":  # neither compresses: raw frames, then a RAW object
        return rng.integers(0, 1 << 16, n, dtype=np.uint16)
    if kind == "mixed":  # compressible first chunk (the probe), noise after it
        out = rng.integers(0, 1 << 16, n, dtype=np.uint16)
        out[: n // 3] = 0x3F80
        return out
    return np.full(n, 0x3F80, np.uint16)  # constant


def encode_both(words: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, bytes]:
    """The object as the kernel writes it, and as the Python encoder does."""
    shape = (words.size,)
    native = bytes(codec.encode_view(words, key=KEY, dtype="bfloat16", shape=shape))
    with monkeypatch.context() as patched:
        patched.setattr(_zstd, "_KERNEL", None)
        python = bytes(codec.encode_view(words, key=KEY, dtype="bfloat16", shape=shape))
    return native, python


def test_the_kernel_is_built_where_the_package_was_installed_with_a_compiler() -> None:
    """A silent fallback would leave encoding threads serialized on the GIL: where this
    interpreter could build the kernel (CPython 3.11+, a C compiler), it must be in use."""
    headers = Path(sysconfig.get_paths()["include"], "Python.h")
    if sys.version_info < (3, 11) or shutil.which("cc") is None or not headers.exists():
        pytest.skip("the kernel cannot be built here (CPython < 3.11, no compiler or headers)")
    if not _zstd.native():
        pytest.skip("zstandard's cffi backend is missing: the kernel is not used")
    assert _zstd._KERNEL is not None


@needs_kernel
@pytest.mark.parametrize("kind", ["bf16", "fp16-small", "random", "mixed", "constant"])
@pytest.mark.parametrize(
    "n",
    [1, 2, 3, 16_383, 16_384, 16_385, 131_072, 131_073, 262_144, 262_145, 737_280, 1_000_001],
)
def test_the_kernel_writes_the_python_encoders_bytes(
    kind: str, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    words = block(n, kind)
    native, python = encode_both(words, monkeypatch)
    assert native == python
    assert bytes(codec.decode(native, key=KEY)) == words.tobytes()


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 600_000),
    kind=st.sampled_from(["bf16", "fp16-small", "random", "mixed", "constant"]),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_writes_the_python_encoders_bytes_for_any_size(
    n: int, kind: str, seed: int
) -> None:
    words = block(n, kind, seed)
    with pytest.MonkeyPatch.context() as monkeypatch:
        native, python = encode_both(words, monkeypatch)
    assert native == python


@needs_kernel
def test_threads_encoding_at_once_write_what_one_thread_writes() -> None:
    """Each thread codes with its own libzstd context and scratch (the kernel keeps no
    state): eight threads at once give the bytes of a serial run."""
    blocks = [block(737_280, "bf16" if i % 3 else "fp16-small", seed=i) for i in range(16)]

    def encode(words: np.ndarray) -> bytes:
        return bytes(codec.encode_view(words, key=KEY, dtype="bfloat16", shape=(words.size,)))

    serial = [encode(words) for words in blocks]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for _ in range(3):
            assert list(pool.map(encode, blocks)) == serial


@needs_kernel
def test_a_caller_bug_raises_value_error_and_writes_nothing_past_the_payload() -> None:
    assert _zstd._KERNEL is not None
    kernel, compress = _zstd._KERNEL.module, _zstd._KERNEL.compress
    state = _zstd.local()
    assert state._addresses is not None
    cctx = state._addresses[0]
    words = block(300_000, "random")
    step = _planes.chunk_elements(words.size)
    room = _planes.planes_room(words.nbytes)[1]
    guard = np.full(room + 64, 0xAB, np.uint8)
    with pytest.raises(ValueError, match="payload too small"):
        kernel.encode_planes(words, guard[:1000], 0, step, 0, state.plane, state.plane2, cctx,
                             compress)  # fmt: skip
    assert (guard[1000:] == 0xAB).all()
    bad: list[tuple[Any, ...]] = [
        (words[:-1].view(np.uint8)[1:], guard, 0, step, 0),  # an odd byte count
        (words, guard, 0, _zstd.MAX_ENTROPY_CHUNK + 1, 0),  # a plane larger than a frame
        (words, guard, 0, step, step + 1),  # a probe past the first chunk
        (words[:1], guard, 0, step, 2),  # a probe past the last element
        (words, guard, room + 65, step, 0),  # a start past the payload
    ]
    for args in bad:
        with pytest.raises(ValueError, match="out of range"):
            kernel.encode_planes(*args, state.plane, state.plane2, cctx, compress)
    with pytest.raises(ValueError, match="null address"):
        kernel.encode_planes(words, guard, 0, step, 0, state.plane, state.plane2, 0, compress)


@needs_kernel
def test_a_kernel_built_with_other_constants_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel left from an older build beside newer Python must not write another layout."""
    module = importlib.import_module("s3kv._planes_native")
    assert _zstd._load_kernel() == (_zstd._KERNEL, None)
    monkeypatch.setattr(module, "FRAME_BOUND", module.FRAME_BOUND + 1)
    kernel, why = _zstd._load_kernel()
    assert kernel is None
    assert why is not None
    assert "built for another release" in why


def test_without_the_kernel_the_python_encoder_writes_the_object(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_zstd, "_KERNEL", None)
    words = block(737_280, "bf16")
    blob = codec.encode(words, key=KEY, dtype="bfloat16", shape=(words.size,))
    assert codec.read_header(blob).codec is codec.CodecId.PLANES_ZSTD
    assert bytes(codec.decode(blob, key=KEY)) == words.tobytes()


def decode_both(blob: bytes, monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, bytes]:
    """The object decoded by the kernel, and by the Python decoder."""
    native = bytes(codec.decode(blob, key=KEY))
    with monkeypatch.context() as patched:
        patched.setattr(_zstd, "_KERNEL", None)
        python = bytes(codec.decode(blob, key=KEY))
    return native, python


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 1_400_000),
    kind=st.sampled_from(["bf16", "fp16-small", "mixed", "constant"]),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_decodes_what_the_python_decoder_decodes(n: int, kind: str, seed: int) -> None:
    """Sizes up to two groups of chunks, with a short last chunk or none."""
    words = block(n, kind, seed)
    blob = codec.encode(words, key=KEY, dtype="bfloat16", shape=(n,))
    with pytest.MonkeyPatch.context() as monkeypatch:
        native, python = decode_both(blob, monkeypatch)
    assert native == python == words.tobytes()


def frames_of(words: np.ndarray) -> tuple[np.ndarray, int]:
    """A one-group object's plane frames, back to back, and its chunk's elements."""
    blob = codec.encode(words, key=KEY, dtype="bfloat16", shape=(words.size,))
    header = codec.read_header(blob)
    assert header.codec is codec.CodecId.PLANES_ZSTD
    return np.frombuffer(blob, np.uint8)[header.header_len :], header.chunk_len // 2


@needs_kernel
def test_corrupt_frames_raise_a_frame_error_and_leave_the_target_untouched() -> None:
    words = block(300_001, "bf16")
    frames, step = frames_of(words)
    state = _zstd.local()
    size = words.nbytes
    target = np.full(size + 16, 0xCD, np.uint8)
    assert state.decode_planes(frames, state.plane, target, 8, size, step)
    assert target[8 : 8 + size].tobytes() == words.tobytes()
    assert (target[:8] == 0xCD).all()
    assert (target[8 + size :] == 0xCD).all()
    broken = frames.copy()
    broken[0] ^= 0xFF  # the first frame's magic
    target[:] = 0xCD
    cases = [
        (broken, size, "nknown frame"),
        (frames[:-1], size, "."),  # the last frame cut short
        (frames, size - 2, "too small"),  # the frames hold a word more than asked for
        (frames, size + 2, "decodes to 600002 bytes, expected 600004"),
    ]
    for bad, asked, expected in cases:
        with pytest.raises(_zstd.FrameError, match=expected):
            state.decode_planes(bad, state.plane, target, 8, asked, step)
        assert (target == 0xCD).all()


@needs_kernel
def test_a_decode_caller_bug_raises_value_error() -> None:
    words = block(1000, "bf16")
    frames, step = frames_of(words)
    state = _zstd.local()
    target = np.empty(words.nbytes, np.uint8)
    for at, size, chunk in ((1, words.nbytes, step), (0, words.nbytes - 1, step), (0, 2000, 0)):
        with pytest.raises(ValueError, match="out of range"):
            state.decode_planes(frames, state.plane, target, at, size, chunk)
    with pytest.raises(ValueError, match="out of range"):  # planes scratch too small
        state.decode_planes(frames, state.plane[:100], target, 0, words.nbytes, step)


@needs_kernel
def test_threads_decoding_at_once_each_get_their_blocks() -> None:
    blocks = [block(737_280, "bf16", seed=i) for i in range(16)]
    blobs = [codec.encode(w, key=KEY, dtype="bfloat16", shape=(w.size,)) for w in blocks]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for _ in range(3):
            decoded = pool.map(lambda blob: bytes(codec.decode(blob, key=KEY)), blobs)
            assert list(decoded) == [w.tobytes() for w in blocks]
