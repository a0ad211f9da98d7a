"""Per-thread zstd contexts and scratch buffers for :mod:`s3kv.codec` (private).

Two encoders write standard zstd frames, so any zstd decoder reads every section:

* :meth:`ThreadZstd.entropy_frame` codes a byte plane with zstd's Huffman literal coder only,
  through libzstd's ``ZSTD_compressSequencesAndLiterals`` with zero matches. A bf16 exponent
  plane (~3 bits of order-0 entropy) gains nothing from match finding, which is what makes
  zstd level 1 slow and, at higher levels, *worse* on it (perf-anchors §2.1).
* :meth:`ThreadZstd.zstd_frame` is ordinary zstd at a level, for data with repeats.

libzstd's experimental API is reached through the cffi module bundled with ``zstandard``
(``zstandard._cffi``). Where it cannot be imported, :meth:`entropy_frame` falls back to
zstd level 1 through the C extension (same wire format, encode 2-3x slower) and decoding to
``ZstdDecompressor.decompress`` plus one copy. Every failure to decode surfaces as
:class:`FrameError`; the caller maps it to its own exception tree.
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import zstandard

U8 = npt.NDArray[np.uint8]

#: Largest plane chunk entropy_frame accepts (and the size of each scratch buffer).
MAX_ENTROPY_CHUNK: Final = 256 * 1024
#: libzstd's largest block; entropy_frame emits one block per this many literals.
_BLOCK: Final = 128 * 1024
#: Readable bytes libzstd may touch past the end of the literals (its documented contract).
_LITERAL_SLACK: Final = 8


def _load_cffi() -> tuple[Any, Any] | None:
    try:
        module: ModuleType = importlib.import_module("zstandard._cffi")
        lib, ffi = module.lib, module.ffi
        # NOTE: probe every symbol used, so a zstandard without them selects the fallback.
        for name in (
            "ZSTD_compressSequencesAndLiterals",
            "ZSTD_c_blockDelimiters",
            "ZSTD_sf_explicitBlockDelimiters",
            "ZSTD_decompressDCtx",
        ):
            getattr(lib, name)
    except (ImportError, AttributeError):
        return None
    return lib, ffi


_CFFI: Final = _load_cffi()


class FrameError(Exception):
    """A zstd frame could not be decoded into exactly the expected number of bytes."""


class ThreadZstd:
    """zstd contexts and scratch buffers owned by one thread; see :func:`local`.

    Memory: about 3 x ``MAX_ENTROPY_CHUNK`` of scratch plus the zstd contexts (~1 MiB at
    level 1), per thread that ever encoded or decoded.
    """

    def __init__(self) -> None:
        self.plane: U8 = np.empty(MAX_ENTROPY_CHUNK + _LITERAL_SLACK, np.uint8)
        self.plane2: U8 = np.empty(MAX_ENTROPY_CHUNK, np.uint8)
        self._compressors: dict[int, zstandard.ZstdCompressor] = {}
        self._decompressor = zstandard.ZstdDecompressor()
        if _CFFI is not None:
            lib, ffi = _CFFI
            self._dst: U8 = np.empty(lib.ZSTD_compressBound(MAX_ENTROPY_CHUNK), np.uint8)
            self._dst_ptr = ffi.from_buffer(self._dst, require_writable=True)
            self._plane_ptr = ffi.from_buffer(self.plane)
            self._seqs = ffi.new("ZSTD_Sequence[]", -(-MAX_ENTROPY_CHUNK // _BLOCK))
            self._cctx = ffi.gc(lib.ZSTD_createCCtx(), lib.ZSTD_freeCCtx)
            self._dctx = ffi.gc(lib.ZSTD_createDCtx(), lib.ZSTD_freeDCtx)
            lib.ZSTD_CCtx_setParameter(self._cctx, lib.ZSTD_c_compressionLevel, 1)
            lib.ZSTD_CCtx_setParameter(
                self._cctx, lib.ZSTD_c_blockDelimiters, lib.ZSTD_sf_explicitBlockDelimiters
            )

    def entropy_frame(self, n: int) -> bytes | None:
        """Huffman-code ``self.plane[:n]`` as one zstd frame.

        Args:
            n: Bytes of ``self.plane`` to code, 1..MAX_ENTROPY_CHUNK.

        Returns:
            The frame, or None when it would not be smaller than ``n`` (store it raw).
        """
        if _CFFI is None:
            frame = self.zstd_frame(self.plane[:n], 1)
            return frame if len(frame) < n else None
        lib, ffi = _CFFI
        # NOTE: per block, one sequence of literals and no match, flagged as the block's end:
        # libzstd then only builds a Huffman table and codes literals (no match finder runs).
        nseq = 0
        for start in range(0, n, _BLOCK):
            self._seqs[nseq].litLength = min(_BLOCK, n - start)
            nseq += 1
        size = lib.ZSTD_compressSequencesAndLiterals(
            self._cctx,
            self._dst_ptr,
            len(self._dst),
            self._seqs,
            nseq,
            self._plane_ptr,
            n,
            n + _LITERAL_SLACK,
            n,
        )
        # An error here means "incompressible block" (the documented limitation): store raw.
        if lib.ZSTD_isError(size) or size >= n:
            return None
        return bytes(ffi.buffer(self._dst_ptr, size))

    def zstd_frame(self, data: Any, level: int) -> bytes:
        """Ordinary zstd at ``level`` (a bytes-like ``data``); one frame with content size."""
        compressor = self._compressors.get(level)
        if compressor is None:
            compressor = self._compressors[level] = zstandard.ZstdCompressor(level=level)
        return compressor.compress(data)

    def decompress_into(self, frame: Any, dst: U8) -> None:
        """Decode the zstd frame(s) in ``frame`` into exactly ``len(dst)`` bytes of ``dst``.

        Never writes past ``dst`` nor allocates more than ``len(dst)``.

        Raises:
            FrameError: Corrupt input, or its decoded size differs from ``len(dst)``.
        """
        if _CFFI is not None:
            lib, ffi = _CFFI
            src = ffi.from_buffer(frame)
            out = ffi.from_buffer(dst, require_writable=True)
            size = lib.ZSTD_decompressDCtx(self._dctx, out, len(dst), src, len(src))
            if lib.ZSTD_isError(size):
                raise FrameError(ffi.string(lib.ZSTD_getErrorName(size)).decode())
            if size != len(dst):
                raise FrameError(f"frame decodes to {size} bytes, expected {len(dst)}")
            return
        try:
            # NOTE: python-zstandard sizes its output from the frame header when it has one;
            # check it first so that a lying header cannot make it allocate more.
            declared = zstandard.frame_content_size(frame)
            if declared not in (-1, len(dst)):
                raise FrameError(f"frame declares {declared} bytes, expected {len(dst)}")
            data = self._decompressor.decompress(
                frame, max_output_size=len(dst), allow_extra_data=False
            )
        except zstandard.ZstdError as exc:
            raise FrameError(str(exc)) from exc
        if len(data) != len(dst):
            raise FrameError(f"frame decodes to {len(data)} bytes, expected {len(dst)}")
        dst[:] = np.frombuffer(data, np.uint8)


_local = threading.local()


def local() -> ThreadZstd:
    """The calling thread's :class:`ThreadZstd` (created on first use, reused after)."""
    state: ThreadZstd | None = getattr(_local, "state", None)
    if state is None:
        state = _local.state = ThreadZstd()
    return state


def native() -> bool:
    """Whether the fast cffi path (entropy-only frames, decode in place) is in use."""
    return _CFFI is not None
