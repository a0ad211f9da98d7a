"""Per-thread zstd contexts and scratch buffers for :mod:`s3kv.codec` (private).

Two encoders write standard zstd frames, so any zstd decoder reads every section:

* :meth:`ThreadZstd.entropy_frame_into` codes a byte plane with zstd's Huffman literal coder
  only, through libzstd's ``ZSTD_compressSequencesAndLiterals`` with zero matches. A bf16 exponent
  plane (~3 bits of order-0 entropy) gains nothing from match finding, which is what makes
  zstd level 1 slow and, at higher levels, *worse* on it (perf-anchors §2.1).
* :meth:`ThreadZstd.zstd_frame` is ordinary zstd at a level, for data with repeats.

libzstd's experimental API is reached through the cffi module bundled with ``zstandard``
(``zstandard._cffi``). Where it cannot be imported, :meth:`entropy_frame_into` falls back to
zstd level 1 through the C extension (same wire format, encode 2-3x slower) and decoding to
``ZstdDecompressor.decompress`` plus one copy. Every failure to decode surfaces as
:class:`FrameError`; the caller maps it to its own exception tree.
"""

from __future__ import annotations

import functools
import importlib
import threading
from types import ModuleType
from typing import Any, Final, NamedTuple, NoReturn

import numpy as np
import numpy.typing as npt
import zstandard

U8 = npt.NDArray[np.uint8]

#: Largest plane chunk entropy_frame_into accepts.
MAX_ENTROPY_CHUNK: Final = 256 * 1024
#: Bytes of one plane that a thread's scratch holds for a group of chunks (at least one).
PLANE_GROUP: Final = 1024 * 1024
#: Room a frame of up to MAX_ENTROPY_CHUNK bytes may need: libzstd's ZSTD_compressBound.
FRAME_BOUND: Final = MAX_ENTROPY_CHUNK + (MAX_ENTROPY_CHUNK >> 8) + 64
#: Largest payload scratch a thread keeps between calls (larger objects get a fresh one).
MAX_KEPT_PAYLOAD: Final = 64 * 1024 * 1024
#: libzstd's largest block; entropy_frame_into emits one block per this many literals.
_BLOCK: Final = 128 * 1024
#: Readable bytes libzstd may touch past the end of the literals (its documented contract).
_LITERAL_SLACK: Final = 8
#: Bytes of a raw frame before its first block: magic, frame header with its content size.
RAW_FRAME_PREFIX: Final = 9
#: Bytes of a zstd block header.
BLOCK_HEADER: Final = 3
#: Bytes a :func:`raw_frame_header` adds in front of a stored plane: the prefix and one
#: block header.
RAW_FRAME_OVERHEAD: Final = RAW_FRAME_PREFIX + BLOCK_HEADER
#: Largest plane one raw frame of one block holds (:func:`raw_frame_header`).
MAX_RAW_FRAME: Final = _BLOCK


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


class _Kernel(NamedTuple):
    """The native plane kernel and the addresses of the libzstd functions it calls."""

    module: Any
    compress: int
    decompress: int


def _load_kernel() -> tuple[_Kernel | None, str | None]:
    """The native plane kernel (``s3kv._planes_native``, built where a C compiler was at
    install) and None, or None and why it is not used: it or libzstd's own API is missing,
    or it was built with other constants than this module's."""
    if _CFFI is None:
        return None, "zstandard's cffi backend is missing (the plane codec's slow fallback)"
    try:
        module: Any = importlib.import_module("s3kv._planes_native")
    except ImportError:
        return None, "s3kv._planes_native is not built (no C compiler, or CPython < 3.11)"
    expected = {
        "MAX_ENTROPY_CHUNK": MAX_ENTROPY_CHUNK,
        "ZSTD_BLOCK": _BLOCK,
        "LITERAL_SLACK": _LITERAL_SLACK,
        "FRAME_BOUND": FRAME_BOUND,
        "RAW_FRAME_PREFIX": RAW_FRAME_PREFIX,
        "BLOCK_HEADER": BLOCK_HEADER,
    }
    if any(getattr(module, name, None) != value for name, value in expected.items()):
        # NOTE: a stale build beside newer Python: the Python codec is right
        return None, f"{module.__file__} was built for another release of s3kv"
    lib, ffi = _CFFI

    def address(name: str) -> int:
        return int(ffi.cast("uintptr_t", ffi.addressof(lib, name)))

    kernel = _Kernel(
        module, address("ZSTD_compressSequencesAndLiterals"), address("ZSTD_decompressDCtx")
    )
    return kernel, None


#: The native plane kernel, or None and why not; None selects the Python code (tests and
#: benchmarks set ``_KERNEL`` to None to compare the two).
_KERNEL, _NO_KERNEL = _load_kernel()


def kernel_problem() -> str | None:
    """Why the plane codec runs in Python here (its threads then share the GIL), or None
    where the native kernel is in use."""
    if _KERNEL is not None:
        return None
    return _NO_KERNEL or "the native plane kernel is switched off"


@functools.lru_cache(maxsize=64)  # NOTE: a few block sizes per process
def raw_frame_header(n: int) -> U8:
    """The first :data:`RAW_FRAME_OVERHEAD` bytes of a standard zstd frame that stores the
    ``n`` bytes following it as they are (RFC 8878: a single-segment frame header with a
    4-byte content size, then one raw block, flagged last). Any zstd decoder reads it;
    unlike a stored section, it can be decoded in one libzstd call together with the
    frames around it (see :mod:`s3kv._planes`).

    Raises:
        ValueError: ``n`` is outside 1..MAX_RAW_FRAME (a caller bug).
    """
    if not 0 < n <= MAX_RAW_FRAME:
        raise ValueError(f"raw_frame_header: {n} bytes is not one zstd block (a caller bug)")
    out = np.concatenate([raw_frame_prefix(n), raw_block_header(n, True)])
    out.flags.writeable = False
    return out


def raw_blocks(n: int) -> tuple[int, int]:
    """How a raw frame of ``n`` bytes is cut: ``(blocks, size)``, as few blocks as zstd's
    128 KiB limit allows, of equal ``size`` but the last (shorter by less than ``blocks``).
    Equal blocks let one strided copy fill them (see :mod:`s3kv._planes`)."""
    blocks = max(1, -(-n // _BLOCK))
    return blocks, -(-n // blocks)


def raw_frame_overhead(n: int) -> int:
    """Bytes a raw frame of ``n`` bytes adds to them: prefix and one header per block."""
    return RAW_FRAME_PREFIX + BLOCK_HEADER * raw_blocks(n)[0]


@functools.lru_cache(maxsize=64)  # NOTE: a few plane sizes per process
def raw_frame_prefix(n: int) -> U8:
    """The :data:`RAW_FRAME_PREFIX` bytes that open a single-segment zstd frame of ``n``
    content bytes (RFC 8878: magic, descriptor, 4-byte content size); its raw blocks follow,
    each behind a :func:`raw_block_header`.

    Raises:
        ValueError: ``n`` is outside 1..2**32-1 (a caller bug).
    """
    if not 0 < n < 1 << 32:
        raise ValueError(f"raw_frame_prefix: {n} bytes (a caller bug)")
    descriptor = 0b1010_0000  # content size in 4 bytes, single segment, no checksum
    out = np.frombuffer(b"\x28\xb5\x2f\xfd" + bytes([descriptor]) + n.to_bytes(4, "little"),
                        np.uint8)  # fmt: skip
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=64)
def raw_block_header(size: int, last: bool) -> U8:
    """The header of a raw zstd block of ``size`` bytes (type 0), flagged ``last`` or not.

    Raises:
        ValueError: ``size`` is outside 1..128 KiB (a caller bug).
    """
    if not 0 < size <= _BLOCK:
        raise ValueError(f"raw_block_header: {size} bytes is not one zstd block (a caller bug)")
    out = np.frombuffer(((size << 3) | int(last)).to_bytes(3, "little"), np.uint8)
    out.flags.writeable = False
    return out


class FrameError(Exception):
    """A zstd frame could not be decoded into exactly the expected number of bytes."""


class ThreadZstd:
    """zstd contexts and scratch buffers owned by one thread; see :func:`local`.

    Memory: 2 x ``PLANE_GROUP`` + 2 x ``MAX_ENTROPY_CHUNK`` of scratch plus the zstd contexts
    (~1 MiB at level 1), per thread that ever encoded or decoded; a thread that encoded also
    keeps a payload scratch the size of its largest object (up to ``MAX_KEPT_PAYLOAD``), and
    one that used PLANES_REF its named scratch planes (up to the same bound each).
    """

    def __init__(self) -> None:
        #: One plane of a group of chunks, or both planes of a group decoded in one call
        #: (see :mod:`s3kv._planes`), plus libzstd's slack.
        self.plane: U8 = np.empty(2 * PLANE_GROUP + _LITERAL_SLACK, np.uint8)
        #: One plane of one chunk, plus libzstd's slack.
        self.plane2: U8 = np.empty(MAX_ENTROPY_CHUNK + _LITERAL_SLACK, np.uint8)
        self._payload: U8 = np.empty(0, np.uint8)
        self._scratch: dict[str, U8] = {}
        self._probe_dst: U8 = np.empty(FRAME_BOUND, np.uint8)
        self._compressors: dict[int, zstandard.ZstdCompressor] = {}
        self._decompressor = zstandard.ZstdDecompressor()
        #: Addresses of the libzstd contexts, for the native kernel: (compress, decompress).
        self._addresses: tuple[int, int] | None = None
        if _CFFI is not None:
            lib, ffi = _CFFI
            self._seqs = ffi.new("ZSTD_Sequence[]", -(-MAX_ENTROPY_CHUNK // _BLOCK))
            self._cctx = ffi.gc(lib.ZSTD_createCCtx(), lib.ZSTD_freeCCtx)
            self._dctx = ffi.gc(lib.ZSTD_createDCtx(), lib.ZSTD_freeDCtx)
            lib.ZSTD_CCtx_setParameter(self._cctx, lib.ZSTD_c_compressionLevel, 1)
            lib.ZSTD_CCtx_setParameter(
                self._cctx, lib.ZSTD_c_blockDelimiters, lib.ZSTD_sf_explicitBlockDelimiters
            )
            self._addresses = (
                int(ffi.cast("uintptr_t", self._cctx)),
                int(ffi.cast("uintptr_t", self._dctx)),
            )

    def payload(self, size: int) -> U8:
        """Scratch for a payload of at most ``size`` bytes (every section stored raw, or in
        a raw frame) plus one frame bound, so that :meth:`entropy_frame_into` can write at
        any offset the encoder reaches. Reused by the thread's next call (up to
        ``MAX_KEPT_PAYLOAD`` bytes); the caller copies what it keeps before then.
        """
        need = size + FRAME_BOUND
        if self._payload.size >= need:
            return self._payload
        scratch = np.empty(need, np.uint8)
        if need <= MAX_KEPT_PAYLOAD:
            self._payload = scratch
        return scratch

    def scratch(self, name: str, size: int) -> U8:
        """A buffer of at least ``size`` bytes plus libzstd's slack, reused by the thread's
        next call that asks for ``name`` (kept up to ``MAX_KEPT_PAYLOAD`` bytes)."""
        kept = self._scratch.get(name)
        if kept is not None and kept.size >= size + _LITERAL_SLACK:
            return kept
        buffer = np.empty(size + _LITERAL_SLACK, np.uint8)
        if size <= MAX_KEPT_PAYLOAD:
            self._scratch[name] = buffer
        return buffer

    def entropy_frame_into(self, plane: U8, n: int, out: U8, at: int) -> int:
        """Huffman-code ``plane[:n]`` as one zstd frame written at ``out[at:]``.

        Args:
            plane: The bytes to code, followed by ``_LITERAL_SLACK`` readable bytes
                (libzstd may read them): a slice of ``self.plane`` or ``self.plane2``.
            n: Bytes to code, 1..MAX_ENTROPY_CHUNK.
            out: Destination; ``out[at:]`` must hold at least FRAME_BOUND bytes.
            at: Offset of the frame in ``out``.

        Returns:
            The frame's length, or 0 when it would not be smaller than ``n`` (store the
            plane raw; ``out[at:]`` then holds garbage).

        Raises:
            ValueError: ``plane`` lacks the slack, or ``out[at:]`` the room.
        """
        if len(plane) < n + _LITERAL_SLACK or len(out) - at < FRAME_BOUND:
            raise ValueError(f"entropy_frame_into: no room for {n} bytes (a caller bug)")
        if _CFFI is None:
            frame = self.zstd_frame(plane[:n], 1)
            if len(frame) >= n:
                return 0
            out[at : at + len(frame)] = np.frombuffer(frame, np.uint8)
            return len(frame)
        lib, ffi = _CFFI
        # NOTE: per block, one sequence of literals and no match, flagged as the block's end:
        # libzstd then only builds a Huffman table and codes literals (no match finder runs).
        nseq = 0
        for start in range(0, n, _BLOCK):
            self._seqs[nseq].litLength = min(_BLOCK, n - start)
            nseq += 1
        size: int = lib.ZSTD_compressSequencesAndLiterals(
            self._cctx,
            ffi.from_buffer(out[at : at + FRAME_BOUND], require_writable=True),
            FRAME_BOUND,
            self._seqs,
            nseq,
            ffi.from_buffer(plane),
            n,
            n + _LITERAL_SLACK,
            n,
        )
        # NOTE: an error here means "incompressible block" (the documented limitation): store
        # raw. Errors are sizes above any capacity, so one comparison tells both apart
        # without a second call into libzstd (each call drops and retakes the GIL).
        return size if size < n else 0

    def encode_planes(
        self, words: U8, payload: U8, step: int, probe: int
    ) -> tuple[int, tuple[int, ...]] | None:
        """:func:`s3kv._planes.encode_planes`' frames in one call that drops the GIL once
        (the native kernel, ``s3kv/_planes_native.c``), written from ``payload[0]``: the
        payload's end and every section's length (each a frame); None where the kernel is
        not available (encode in Python).

        Args:
            words: The block's bytes (little-endian 16-bit elements), C-contiguous.
            payload: Destination with room for every section in a raw frame plus a frame
                bound (:func:`s3kv._planes.planes_room`).
            step: Elements per chunk, 1..MAX_ENTROPY_CHUNK.
            probe: Elements whose low bytes decide whether low planes are coded (0: never).

        Raises:
            ValueError: ``payload`` lacks room or an argument is out of range (a caller bug).
        """
        kernel = _KERNEL
        if kernel is None or self._addresses is None:
            return None
        result: tuple[int, tuple[int, ...]] = kernel.module.encode_planes(
            words, payload, 0, step, probe, self.plane, self.plane2, self._addresses[0],
            kernel.compress,
        )  # fmt: skip
        return result

    def decode_planes(
        self, frames: U8, planes: U8, target: U8, at: int, size: int, step: int
    ) -> bool:
        """Decode a group of chunks' plane frames (high, low, high, low..., back to back) in
        ``frames`` into ``planes[:size]`` and merge them into ``target[at:at + size]`` as
        little-endian 16-bit words, chunk by chunk of ``step`` elements (the last may be
        shorter), in one call that drops the GIL once (the native kernel); False where the
        kernel is not available (the caller decodes and merges in Python).

        Raises:
            FrameError: Corrupt frames, or their decoded size differs from ``size``
                (``target`` is then untouched).
            ValueError: An argument is out of range (a caller bug).
        """
        kernel = _KERNEL
        if kernel is None or self._addresses is None:
            return False
        decoded: int = kernel.module.decode_planes(
            frames, planes, target, at, size, step, self._addresses[1], kernel.decompress
        )
        if decoded != size:
            self._raise_frame_error(decoded, size)
        return True

    @staticmethod
    def _raise_frame_error(result: int, expected: int) -> NoReturn:
        """Raise what ZSTD_decompressDCtx's ``result`` (not ``expected``) means."""
        assert _CFFI is not None
        lib, ffi = _CFFI
        if lib.ZSTD_isError(result):
            raise FrameError(ffi.string(lib.ZSTD_getErrorName(result)).decode())
        raise FrameError(f"frame decodes to {result} bytes, expected {expected}")

    def compresses(self, plane: U8, n: int) -> bool:
        """Whether :meth:`entropy_frame_into` would shrink ``plane[:n]``."""
        return self.entropy_frame_into(plane, n, self._probe_dst, 0) > 0

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
            if size == len(dst):
                return  # NOTE: an error code is never a valid length: no ZSTD_isError call
            self._raise_frame_error(size, len(dst))
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
