"""Payload kernels of :mod:`s3kv.codec` (private): sections in, sections out.

An object's payload is a list of sections (see the wire format in :mod:`s3kv.codec`). The
encoders here cut raw bytes into chunks, code each chunk's sections and hash everything
while it is still in cache; the decoders do the reverse into a caller's buffer. Headers,
verification order and errors belong to :mod:`s3kv.codec`; this module only raises
:class:`s3kv._zstd.FrameError`.

Measured on real SmolLM2 bf16 KV (1.47 MB blocks, one thread, MB/s of raw block; mostly
on the idle 16-core Xeon of the device box, cross-checked on the 2-vCPU dev box), each
choice against its alternative:

* High plane through zstd's Huffman literal coder with no match search (``_zstd``), vs
  zstd level 1: ratio 1.452 vs 1.443, plane encode 1900 vs 550, plane decode 2600 vs
  1850. Negative levels with forced Huffman literals reached 690 (ratio 1.449); strategy
  fast/dfast with min_match 7 kept level 1's speed (ratio 1.453).
* Low plane stored raw after a 16 KiB probe (it has 7.96 bits/byte) instead of a Huffman
  attempt per chunk: 7 vs 290 us per block, ~20% of encode.
* 256 KiB chunks vs 64 KiB: encode +9%, decode +20% (fewer Python-level calls);
  512 KiB-2 MiB were equal within noise.
* Merge by multiply + or instead of left_shift + or: 116 vs 160 us per block.
* Raw checksum fed while in cache rather than in a final pass: encode +3-7%.

PLANES_REF (:func:`encode_ref`), on the same KV as the connector hands it over (HND pages,
``[30, 2, 3, T, 64]``), 2-vCPU dev box, interleaved with PLANES_ZSTD in one run:

* Reference = largest sign-less high byte of the channel over the block's tokens, K and V
  residuals in their own sections: ratio 1.4734 (T=32) / 1.4754 (T=64) vs 1.4497 / 1.4514.
  With the sign in the reference (no mask): 1.461. OR instead of max: 1.378.
* No exponent rotation (``(u << 1) | (u >> 15)``, which puts the whole exponent in one byte:
  1.503 in the prototype): its three extra 16-bit passes on decode alone took decode from
  0.96x to 0.875x of PLANES_ZSTD (0.80x in the prototype), and more on encode.
* References repeated over 16 tokens before the subtract: 68 vs 100-115 us per 1.47 MB block
  (numpy's inner loop spans 1 KiB instead of one head_dim's 64 bytes).
* Measured: encode 0.78-0.86x, decode 0.82-0.96x PLANES_ZSTD's MB/s, best of 10-15
  interleaved passes (a shared 2-vCPU box: +-5% from run to run); on one core of a 16-vCPU
  Xeon VM (an H200 host): 0.82x and 0.95x. Over 8 threads (each numpy call a GIL hand-off)
  decode 4,512 vs 4,473 MB/s, encode 2,703 vs 3,263 MB/s; with the references tiled by a
  doubling loop (five calls, not one) decode had scaled 2.86x one thread's against 3.83x.
  Transforming a group of layers at a time (planes in L2 from shift to subtract) was slower:
  more numpy calls.

Threads (benchmarks/bench_codec_threads.py, 16-core Xeon VM, 8 threads vs one). Forked
processes scale 7.6x on decode, but threads reached 1.5x: every call that drops the GIL
(zstd, numpy, xxhash over 64 KiB) is a point where a thread must take it back, and under
contention it sleeps there (~1 context switch per call, ~0.1 ms each in the VM), while GIL-held
Python and copies lengthen the queue. So the kernels keep both low, at no cost to one thread:

* Groups of chunks (up to ``_zstd.PLANE_GROUP`` bytes of a plane, a whole 1.5 MB block): the
  group's high planes side by side in a per-thread scratch, then one multiply, one or per
  chunk and one hash for the group; the encoder shifts out a group's high bytes in one call.
  GIL-dropping calls per decoded block: 31 -> 15.
* Sections written straight into a per-thread payload scratch, which the codec copies
  once: no per-chunk ``bytes`` (each a GIL-held copy) nor ``astype`` buffers.
* No ``ZSTD_isError`` call on success, checksums through hasher objects (xxhash 3.x's
  one-shot digests hold the GIL), and a header parse without enum calls.

Measured after/before: decode 3.1x / 1.5x, staging 3.6x / 2.3x, encode 3.1x / 3.4x at 8
threads (2.8x, 1.2x and 1.3x the throughput; single-thread equal within noise).

* Every section a frame (2026-11-29): incompressible low planes go in raw zstd frames
  (:func:`s3kv._zstd.raw_frame_header`, 12 bytes a section) instead of stored sections,
  so libzstd decodes a whole group of chunks, high and low planes, in one call (it reads
  concatenated frames); with equal chunks (:func:`chunk_elements`) one multiply and one or
  merge them. GIL-dropping calls per decoded 1.47 MB block: 15 -> 4-5 (context switches
  per block at 8 threads: 16 -> 4.3). On an H200 host's 16-vCPU Xeon, interleaved with the
  code before, three rounds (``codec_threads-h200-host-2026-11-29-framed.jsonl``):
  decode at 8 threads 5,797-6,718 MB/s against 3,608-4,974 (scaling 5.3-5.9x against
  3.1-3.9x), staging 4,842-5,872 against 3,080-3,732 MB/s (4.9-5.2x against 3.6-3.9x);
  8 forked processes 7,699 MB/s. One thread: decode +8% on the 2-vCPU box. PLANES_REF
  decodes its four planes in one call too: 4,212-4,890 against 3,558-4,423 MB/s at 8.
  On a second host, with the final code: 7,233-7,397 against 4,263-5,212 MB/s, 95-97% of
  8 processes' 7,620 (``...-framed-final.jsonl``). Encode is unchanged (16 calls a block:
  a frame and a copy per chunk).
* Coded in place (2026-11-29): given ``out``, the plane encoders write the payload there
  instead of the thread's scratch, so :func:`s3kv.codec.encode_view` leaves room for the
  header in front and returns the object without the final copy (made holding the GIL)
  that a ``bytes`` result needs: at 8 threads +8-30% (``benchmarks/bench_encode_ablation.py``
  measured what that copy cost).
* Chunks of up to 512 KiB (commit ac69793): a plane section of up to 256 KiB, the most
  every reader since the codec's first release accepts, so a 1.47 MB block is 3 chunks, not
  6. The encoder's per-chunk calls (a high frame, a low copy) halve: a raw frame of two
  equal blocks takes one strided copy. Calls that drop the GIL per encoded block 16 -> 10.
  H200 host, interleaved with the code before, three rounds
  (``codec_threads-h200-host-2026-11-29-larger-chunks.jsonl``): ``encode_view`` at 8 threads
  3,336-3,591 against 3,008-3,058 MB/s (context switches per block 10.1-10.7 against
  16.3-16.5; 8 processes 5,178), one thread within noise; staging at 8 threads 4,963-5,421
  against 4,355-5,026; decode alone 5,703-5,999 against 5,961-6,192 (the host's +-10%).
  The objects are read by every release: the decoders did not change.
* Native kernel (2026-11-29): where ``s3kv/_planes_native.c`` is built, :func:`encode_planes`
  is one call into it (split, probe, Huffman-only and raw frames, the same bytes as the loop
  below) and :func:`_decode_framed_planes` one call per group (libzstd and the merge), through
  the same libzstd contexts (:meth:`s3kv._zstd.ThreadZstd.encode_planes`, ``decode_planes``).
  GIL-dropping calls per block: encode 10 -> 3, decode 5 -> 3 (with the checksums). H200
  host, five rounds taking turns with this Python code
  (``codec_threads-h200-host-2026-11-29-native-kernel.jsonl``): at 8 threads ``encode_view``
  6,285-6,576 against 3,755-4,493 MB/s (8 processes: 6,176-6,344), decode 8,773-10,436
  against 6,574-7,707, staging 8,069-8,758 against 5,342-6,423.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Final, NamedTuple

import numpy as np
import numpy.typing as npt
import xxhash

from s3kv import _zstd

U8 = npt.NDArray[np.uint8]

#: Most raw bytes per chunk of a PLANES_ZSTD object: each plane section is at most the
#: 256 KiB every reader accepts (``_zstd.MAX_ENTROPY_CHUNK``), a frame of two zstd blocks.
#: Half the chunks of 256 KiB ones: each chunk costs the encoder two calls that drop the GIL.
PLANE_CHUNK: Final = 512 * 1024
#: Raw bytes per chunk of a PLANES_REF object (its planes' pieces are ``REF_CHUNK // 2``),
#: and of every PLANES_ZSTD object written before commit ac69793: the most sections per byte
#: any object has (:func:`s3kv.codec.max_object_len`).
REF_CHUNK: Final = 256 * 1024
#: Raw bytes per chunk of plain zstd: level 1's window is 512 KiB, so 4 MiB frames cost no
#: ratio and bound the work of one call.
ZSTD_CHUNK: Final = 4 * 1024 * 1024
#: Elements of the first chunk's low plane coded to decide whether low planes compress.
PROBE: Final = 16 * 1024
#: The multiplier that moves a high byte into place (a 0-d array: numpy's cheapest call).
_HIGH: Final = np.array(256, np.uint16)
#: The high byte less its top (sign) bit.
_EXPONENT_BITS: Final = np.array(0x7F, np.uint8)
#: Most tokens the references are repeated over before they are subtracted (a power of 2).
_REF_TILE: Final = 16


class SectionCodec(enum.IntEnum):
    """How one section's bytes are stored (the wire byte of its table entry)."""

    STORED = 0
    ZSTD = 1


class Section(NamedTuple):
    """One section of the payload; ``raw_len`` is derived from the header, not stored."""

    codec: SectionCodec
    stored_len: int
    raw_len: int


class Layout(NamedTuple):
    """An encoded payload: its layout, section table, bytes and their xxh3_64."""

    planes: int
    chunk_len: int
    sections: list[tuple[SectionCodec, int]]
    pieces: list[Any]
    payload_checksum: bytes


class _Collector:
    """Collects sections and hashes each piece while it is still in cache."""

    def __init__(self) -> None:
        self.sections: list[tuple[SectionCodec, int]] = []
        self.pieces: list[Any] = []
        self._hasher = xxhash.xxh3_64()

    def add(self, flag: SectionCodec, piece: Any) -> None:
        self._hasher.update(piece)
        self.sections.append((flag, len(piece)))
        self.pieces.append(piece)

    def layout(self, planes: int, chunk_len: int) -> Layout | None:
        """The layout, or None where no section was worth compressing."""
        if all(flag is SectionCodec.STORED for flag, _ in self.sections):
            return None
        return Layout(planes, chunk_len, self.sections, self.pieces, self._hasher.digest())


def stored(data: U8) -> Layout:
    """``data`` as one stored section (no section at all when empty)."""
    sections = [(SectionCodec.STORED, data.size)] if data.size else []
    checksum = xxhash.xxh3_64(data.data).digest()  # NOTE: releases the GIL, unlike 3.x's one-shot
    return Layout(1, max(data.size, 1), sections, [data.data], checksum)


def encode_zstd(data: U8, level: int, hasher: Any) -> Layout | None:
    """Plain zstd in ZSTD_CHUNK frames; feeds every raw byte to ``hasher`` on the way."""
    st = _zstd.local()
    out = _Collector()
    for start in range(0, data.size, ZSTD_CHUNK):
        chunk = data[start : start + ZSTD_CHUNK]
        hasher.update(chunk.data)
        frame = st.zstd_frame(chunk, level)
        if len(frame) < chunk.size:
            out.add(SectionCodec.ZSTD, frame)
        else:
            out.add(SectionCodec.STORED, chunk.data)
    return out.layout(1, ZSTD_CHUNK)


def planes_room(nbytes: int) -> tuple[int, int]:
    """Sections of a PLANES_ZSTD payload of ``nbytes`` raw bytes, and the room
    :func:`encode_planes` needs to write it into (its ``out``)."""
    step = chunk_elements(nbytes // 2)
    frames = 2 * -(-(nbytes // 2) // step)
    return frames, nbytes + _zstd.raw_frame_overhead(step) * frames + _zstd.FRAME_BOUND


def ref_room(nbytes: int, geometry: RefGeometry) -> tuple[int, int]:
    """Sections of a PLANES_REF payload of ``nbytes`` raw bytes, and the room
    :func:`encode_ref` needs to write it into (its ``out``)."""
    frames = ref_section_count(geometry, REF_CHUNK)
    return frames, nbytes + geometry.refs + _zstd.RAW_FRAME_OVERHEAD * frames + _zstd.FRAME_BOUND


def _payload_buffer(st: _zstd.ThreadZstd, room: int, out: U8 | None) -> U8:
    """``out`` where given (checked to hold ``room`` bytes), else the thread's scratch."""
    if out is None:
        return st.payload(room - _zstd.FRAME_BOUND)
    if out.size < room:
        raise ValueError(f"out: {out.size} bytes, the payload may need {room} (a caller bug)")
    return out


def encode_planes(data: U8, hasher: Any, out: U8 | None = None) -> Layout | None:
    """Little-endian 16-bit elements as high/low byte planes, chunk by chunk (equal chunks:
    :func:`chunk_elements`); low planes that a probe finds incompressible go in raw frames.

    Feeds every raw byte to ``hasher`` on the way. Returns None when the payload would not
    be smaller than the raw bytes.
    The layout's one piece is a view of the payload where it was written: ``out`` (from
    its start; :func:`planes_room` says how large it must be), else the calling thread's
    payload scratch (copy it before the thread encodes again).

    Raises:
        ValueError: ``out`` is too small (a caller bug).
    """
    st = _zstd.local()
    words = data.view("<u2")
    step = chunk_elements(words.size)
    payload = _payload_buffer(st, planes_room(data.size)[1], out)
    # NOTE: bf16/fp16 low bytes carry ~8 bits of entropy. libzstd only rejects a plane
    # after coding it, so a sample of the first chunk decides for the whole object.
    probe = min(words.size, step, PROBE)
    coded = st.encode_planes(data, payload, step, probe)
    if coded is not None:
        at, lengths = coded
        hasher.update(data.data)
        return _planes_layout(data.size, step, payload, at,
                              [(SectionCodec.ZSTD, n) for n in lengths])  # fmt: skip
    sections: list[tuple[SectionCodec, int]] = []
    at = 0
    np.copyto(st.plane2[:probe], words[:probe], casting="unsafe")
    try_low = probe > 0 and st.compresses(st.plane2, probe)
    group = _group(step)
    for first in range(0, words.size, group):
        block = words[first : first + group]
        np.right_shift(block, 8, out=st.plane[: block.size], casting="unsafe")
        for start in range(0, block.size, step):
            chunk = block[start : start + step]
            n = chunk.size
            at = _add_plane(st, st.plane[start:], n, payload, at, sections)
            if try_low:
                np.copyto(st.plane2[:n], chunk, casting="unsafe")
                at = _add_plane(st, st.plane2, n, payload, at, sections)
            else:
                at = _add_raw_frame(chunk, n, payload, at, sections)
        hasher.update(data[2 * first : 2 * (first + block.size)].data)
    return _planes_layout(data.size, step, payload, at, sections)


def _planes_layout(
    raw_len: int, step: int, payload: U8, at: int, sections: list[tuple[SectionCodec, int]]
) -> Layout | None:
    """The layout of a plane payload written up to ``at``, or None where it is not smaller
    than the raw bytes."""
    if at >= raw_len:
        return None  # NOTE: also bounds every object by codec.max_object_len
    body = payload[:at]
    checksum = xxhash.xxh3_64(body.data).digest()
    return Layout(2, 2 * step, sections, [body.data], checksum)


def chunk_elements(n: int) -> int:
    """Elements per chunk of an ``n``-element PLANES_ZSTD object: as few chunks as
    ``PLANE_CHUNK`` bytes allow, of equal size (the last shorter by less than one element
    per chunk). Equal chunks merge in one numpy call per plane operation; a short last one
    takes two more calls, each a hand-off of the GIL (a 1.47 MB block: 3 chunks of 480 KiB,
    not 2 of 512 KiB and one of 448 KiB). Readers take the chunk length from the header."""
    count = max(1, -(-n // (PLANE_CHUNK // 2)))
    return max(1, -(-n // count))


def _group(step: int) -> int:
    """Elements per group: whole chunks of ``step`` elements that fit the plane scratch."""
    return max(1, _zstd.PLANE_GROUP // step) * step


def _add_plane(
    st: _zstd.ThreadZstd, plane: U8, n: int, payload: U8, at: int, sections: list[Any]
) -> int:
    """Append ``plane[:n]`` to ``payload`` at ``at`` as a Huffman-coded frame, or as a raw
    frame where that is not smaller (every section of a plane object is then a frame: see
    :func:`decode_planes`); returns the new end."""
    size = st.entropy_frame_into(plane, n, payload, at)
    if size:
        sections.append((SectionCodec.ZSTD, size))
        return at + size
    return _add_raw_frame(plane, n, payload, at, sections)


def _add_raw_frame(words: Any, n: int, payload: U8, at: int, sections: list[Any]) -> int:
    """Append the low bytes of ``words[:n]`` (bytes, or 16-bit elements) to ``payload`` at
    ``at`` as a raw zstd frame of equal blocks (:func:`s3kv._zstd.raw_blocks`): one strided
    copy fills them, their headers written around it; returns the new end."""
    prefix = _zstd.raw_frame_prefix(n)
    body = at + prefix.size
    payload[at:body] = prefix
    _, size = _zstd.raw_blocks(n)
    equal = n // size  # every block, or all but a shorter last one
    width = _zstd.BLOCK_HEADER + size
    rows = payload[body : body + equal * width].reshape(equal, width)
    rows[:, : _zstd.BLOCK_HEADER] = _zstd.raw_block_header(size, False)
    np.copyto(rows[:, _zstd.BLOCK_HEADER :], words[: equal * size].reshape(equal, size),
              casting="unsafe")  # fmt: skip
    end = body + equal * width
    rest = n - equal * size
    if rest:
        payload[end : end + _zstd.BLOCK_HEADER] = _zstd.raw_block_header(rest, True)
        end += _zstd.BLOCK_HEADER
        np.copyto(payload[end : end + rest], words[equal * size : n], casting="unsafe")
        end += rest
    else:
        rows[-1, : _zstd.BLOCK_HEADER] = _zstd.raw_block_header(size, True)
    sections.append((SectionCodec.ZSTD, end - at))
    return end


def decode_chunks(sections: tuple[Section, ...], src: U8, at: int, target: U8, hasher: Any) -> None:
    """Decode one-plane sections from ``src[at:]`` into ``target``, hashing the output.

    Raises:
        FrameError: A zstd section is corrupt or decodes to the wrong length.
    """
    _decode_run(_zstd.local(), sections, src, at, target, hasher)


def decode_planes(sections: tuple[Section, ...], src: U8, at: int, target: U8, hasher: Any) -> None:
    """Decode (high, low) plane section pairs from ``src[at:]`` into ``target``.

    Where every section is a zstd frame (what this encoder writes: low planes in raw
    frames), a group of chunks is decoded in one libzstd call into both its planes and
    merged in two numpy calls (:func:`_decode_framed_planes`); else section by section.

    Raises:
        FrameError: A zstd section is corrupt or decodes to the wrong length.
    """
    st = _zstd.local()
    if _all_frames(sections):
        _decode_framed_planes(st, sections, src, at, target, hasher)
        return
    words = target.view("<u2")
    high_planes = st.plane
    pos = 0  # first element of the group
    i = 0
    while i < len(sections):
        # A group of chunks: their high planes side by side in the scratch, then one merge.
        lows: list[tuple[int, Section, U8]] = []
        size = 0
        while i < len(sections) and (not lows or size + sections[i].raw_len <= _zstd.PLANE_GROUP):
            high, low = sections[i], sections[i + 1]
            n = high.raw_len
            piece = src[at : at + high.stored_len]
            if high.codec is SectionCodec.ZSTD:
                st.decompress_into(piece, high_planes[size : size + n])
            else:
                high_planes[size : size + n] = piece
            at += high.stored_len
            lows.append((size, low, src[at : at + low.stored_len]))
            at += low.stored_len
            size += n
            i += 2
        dst = words[pos : pos + size]
        np.multiply(high_planes[:size], _HIGH, out=dst)
        for start, low, stored in lows:
            n = low.raw_len
            low_plane = stored
            if low.codec is SectionCodec.ZSTD:
                low_plane = st.plane2[:n]
                st.decompress_into(stored, low_plane)
            part = dst[start : start + n]
            np.bitwise_or(part, low_plane, out=part)
        hasher.update(target[2 * pos : 2 * (pos + size)].data)
        pos += size


def _all_frames(sections: tuple[Section, ...]) -> bool:
    """Whether the sections can be decoded several at a time: all zstd frames, and libzstd
    reached directly (it decodes concatenated frames in one call; the fallback does not)."""
    return _zstd.native() and all(s.codec is SectionCodec.ZSTD for s in sections)


def _decode_framed_planes(
    st: _zstd.ThreadZstd, sections: tuple[Section, ...], src: U8, at: int, target: U8, hasher: Any
) -> None:
    """decode_planes where every section is a frame: per group of chunks (up to
    ``2 * PLANE_GROUP`` raw bytes, a whole 1.5 MB block), one libzstd call decodes the
    group's frames back to back into ``st.plane`` (high, low, high, low...) and
    :func:`_merge_planes` merges them (both in one call where the native kernel is built),
    then one call hashes them. Fewer calls that drop the GIL is what lets decoding
    threads scale (see the module docstring).
    """
    words = target.view("<u2")
    limit = 2 * _zstd.PLANE_GROUP
    pos = 0  # first raw byte of the group
    i = 0
    while i < len(sections):
        size = stored = 0
        j = i
        while j < len(sections) and (j == i or size + 2 * sections[j].raw_len <= limit):
            size += sections[j].raw_len + sections[j + 1].raw_len
            stored += sections[j].stored_len + sections[j + 1].stored_len
            j += 2
        # NOTE: a group fits st.plane (a chunk is at most 2 x MAX_ENTROPY_CHUNK raw bytes);
        # the named scratch only serves a PLANE_GROUP raised after the thread's state was made.
        planes = st.plane if size <= st.plane.size else st.scratch("framed-planes", size)
        # NOTE: only the group's total is checked here, not each section's stored and raw
        # length: a forged table that moves bytes between sections yields bytes the raw
        # checksum judges, as it judges every decoded byte (the per-section path rejects it).
        frames = src[at : at + stored]
        if not st.decode_planes(frames, planes, target, pos, size, sections[i].raw_len):
            st.decompress_into(frames, planes[:size])
            lengths = [sections[k].raw_len for k in range(i, j, 2)]
            _merge_planes(planes, words[pos // 2 : (pos + size) // 2], lengths)
        hasher.update(target[pos : pos + size].data)
        at += stored
        pos += size
        i = j


def _merge_planes(planes: U8, group: Any, lengths: list[int]) -> None:
    """Merge a group's decoded planes (high, low, high, low..., chunk by chunk of
    ``lengths`` elements) into its 16-bit words ``group``: one multiply and one or for the
    full chunks, two more for the object's last, shorter one (the native kernel's merge,
    in numpy)."""
    step = lengths[0]
    full = next((k for k, n in enumerate(lengths) if n != step), len(lengths))
    pairs = planes[: 2 * full * step].reshape(full, 2, step)
    merged = group[: full * step].reshape(full, step)
    np.multiply(pairs[:, 0], _HIGH, out=merged)
    np.bitwise_or(merged, pairs[:, 1], out=merged)
    done = full * step
    for n in lengths[full:]:  # NOTE: only the object's last chunk is shorter
        tail = planes[2 * done : 2 * done + 2 * n]
        part = group[done : done + n]
        np.multiply(tail[:n], _HIGH, out=part)
        np.bitwise_or(part, tail[n:], out=part)
        done += n


class RefGeometry(NamedTuple):
    """Channel geometry of a ``(layers, 2, heads, tokens, head_dim)`` block (PLANES_REF)."""

    layers: int
    heads: int
    tokens: int
    head_dim: int

    @property
    def channels(self) -> int:
        """(K/V, layer, head) rows of ``tokens x head_dim`` elements."""
        return 2 * self.layers * self.heads

    @property
    def refs(self) -> int:
        """Bytes of the reference plane: one per channel and dim."""
        return self.channels * self.head_dim


def ref_geometry(shape: tuple[int, ...]) -> RefGeometry | None:
    """The geometry of a 5-D ``(layers, 2, heads, tokens, head_dim)`` shape, or None for
    any other rank, a K/V axis other than 2, a zero size or fewer than 2 tokens."""
    if len(shape) != 5 or shape[1] != 2 or min(shape) < 1 or shape[3] < 2:
        return None
    layers, _, heads, tokens, head_dim = shape
    return RefGeometry(layers, heads, tokens, head_dim)


def _ref_planes(geometry: RefGeometry) -> tuple[int, int, int, int]:
    """Bytes of the PLANES_REF planes, in payload order: K residuals, V residuals, refs, low."""
    half = geometry.channels * geometry.tokens * geometry.head_dim // 2
    return half, half, geometry.refs, 2 * half


def ref_section_count(geometry: RefGeometry, chunk_len: int) -> int:
    """Sections of a PLANES_REF object: each plane in pieces of ``chunk_len // 2`` bytes."""
    piece = chunk_len // 2
    return sum(-(-n // piece) for n in _ref_planes(geometry))


def ref_raw_lengths(geometry: RefGeometry, chunk_len: int) -> list[int]:
    """Raw length of every section of a PLANES_REF object, in payload order."""
    piece = chunk_len // 2
    lengths: list[int] = []
    for n in _ref_planes(geometry):
        lengths.extend(min(piece, n - start) for start in range(0, n, piece))
    return lengths


def encode_ref(
    data: U8, geometry: RefGeometry, hasher: Any, out: U8 | None = None
) -> Layout | None:
    """16-bit elements as exponent-residual and low byte planes (PLANES_REF).

    The high byte of every element (bf16: sign and 7 exponent bits) is subtracted, mod 256,
    from its channel's reference: the largest high byte over the block's tokens of that
    (layer, K/V, head, dim). K and V residuals, then the references, are Huffman-coded in
    pieces of ``REF_CHUNK // 2`` bytes; the low bytes follow, in raw frames unless a
    probe shows they compress. Feeds every raw byte to ``hasher``. Returns None when the
    payload would not be smaller than the raw bytes. The layout's one piece is a view of
    the payload where it was written: ``out`` (from its start; :func:`ref_room` says how
    large it must be), else the calling thread's payload scratch (copy it before the
    thread encodes again).

    Raises:
        ValueError: ``out`` is too small (a caller bug).
    """
    st = _zstd.local()
    words = data.view("<u2")
    n = words.size
    g = geometry
    # NOTE: residuals, references and the masked work plane in one buffer, laid out as
    # decode_ref decodes a payload (a thread that saves and stages keeps one buffer).
    work = st.scratch("ref-planes", 2 * n + g.refs)
    residuals, refs = work, work[n:]  # NOTE: views to the end: libzstd's slack is readable
    # NOTE: the high bytes land K first, then V (the K/V axis outermost): each is one
    # distribution, and each gets its own Huffman tables.
    split = residuals[:n].reshape(2, g.layers, -1)
    np.right_shift(
        words.reshape(g.layers, 2, -1).transpose(1, 0, 2), 8, out=split, casting="unsafe"
    )
    hasher.update(data.data)  # NOTE: while the block is still in cache
    rows = residuals[:n].reshape(g.channels, g.tokens, g.head_dim)
    ref_rows = refs[: g.refs].reshape(g.channels, 1, g.head_dim)
    # NOTE: the reference leaves the sign bit out (the largest exponent bits): a residual
    # is then (reference - exponent bits) with the sign in bit 7 (1.4735 vs 1.461 unmasked).
    masked = work[n + g.refs : 2 * n + g.refs].reshape(rows.shape)
    np.bitwise_and(rows, _EXPONENT_BITS, out=masked)
    _token_max(masked, ref_rows)
    _subtract_refs(st, refs, rows)
    piece = REF_CHUNK // 2
    payload = _payload_buffer(st, ref_room(data.size, g)[1], out)
    sections: list[tuple[SectionCodec, int]] = []
    at = 0
    half = n // 2
    for plane, first, size in ((residuals, 0, half), (residuals, half, half), (refs, 0, g.refs)):
        for start in range(first, first + size, piece):
            m = min(piece, first + size - start)
            at = _add_plane(st, plane[start:], m, payload, at, sections)
    probe = min(n, piece, PROBE)
    np.copyto(st.plane2[:probe], words[:probe], casting="unsafe")
    if st.compresses(st.plane2, probe):
        for start in range(0, n, piece):
            m = min(piece, n - start)
            np.copyto(st.plane2[:m], words[start : start + m], casting="unsafe")
            at = _add_plane(st, st.plane2, m, payload, at, sections)
    else:
        at = _add_raw_frames(words, piece, payload, at, sections)
    if at >= data.size:
        return None
    body = payload[:at]
    checksum = xxhash.xxh3_64(body.data).digest()
    return Layout(2, REF_CHUNK, sections, [body.data], checksum)


def _add_raw_frames(words: Any, piece: int, payload: U8, at: int, sections: list[Any]) -> int:
    """Append the low bytes of ``words`` to ``payload`` at ``at`` as raw zstd frames of
    ``piece`` bytes each (the last may be shorter); returns the new end. The full pieces
    take one copy: their frames viewed as the rows of a 2-D array."""
    full, rest = divmod(words.size, piece)
    if full:
        header = _zstd.raw_frame_header(piece)
        width = header.size + piece
        rows = payload[at : at + full * width].reshape(full, width)
        rows[:, : header.size] = header
        np.copyto(
            rows[:, header.size :], words[: full * piece].reshape(full, piece), casting="unsafe"
        )
        sections.extend([(SectionCodec.ZSTD, width)] * full)
        at += full * width
    if rest:
        at = _add_raw_frame(words[full * piece :], rest, payload, at, sections)
    return at


def _token_max(work: U8, out: U8) -> None:
    """``out[c, 0, d] = max over t of work[c, t, d]``, clobbering ``work``: pairwise halving
    in place, which numpy runs as wide vector ops (a reduce over the middle axis: 2x slower).
    """
    tokens = work.shape[1]
    while tokens > 1:
        keep, pairs = (tokens + 1) // 2, tokens // 2
        np.maximum(work[:, :pairs], work[:, keep:tokens], out=work[:, :pairs])
        tokens = keep
    np.copyto(out, work[:, :1])


def _subtract_refs(st: _zstd.ThreadZstd, refs: U8, rows: U8) -> None:
    """``rows[c, t, d] = refs[c * dim + d] - rows[c, t, d]`` (mod 256), in place.

    The references are first repeated over up to 16 tokens, so that numpy's inner loop
    spans 16 tokens' bytes instead of one head_dim's: 2x faster on 64-token blocks. The
    repeat is one broadcast copy (a quarter of the block's bytes at most), not a doubling
    loop: each numpy call is one more hand-off of the GIL between codec threads.
    """
    channels, tokens, dim = rows.shape
    width = math.gcd(tokens, _REF_TILE)
    tiled = st.scratch("tiled-refs", channels * width * dim)[: channels * width * dim]
    np.copyto(tiled.reshape(channels, width, dim), refs[: channels * dim].reshape(channels, 1, dim))
    wide = rows.reshape(channels, tokens // width, width * dim)
    np.subtract(tiled.reshape(channels, 1, width * dim), wide, out=wide)


def decode_ref(
    sections: tuple[Section, ...],
    geometry: RefGeometry,
    chunk_len: int,
    src: U8,
    at: int,
    target: U8,
    hasher: Any,
) -> None:
    """Decode a PLANES_REF payload from ``src[at:]`` into ``target``, hashing the output.
    ``sections`` are the header's (:func:`ref_raw_lengths` of ``geometry`` and ``chunk_len``).

    Raises:
        FrameError: A zstd section is corrupt or decodes to the wrong length.
    """
    st = _zstd.local()
    g = geometry
    words = target.view("<u2")
    n = words.size
    k, v, nrefs, _ = _ref_planes(g)
    piece = chunk_len // 2
    # NOTE: residuals, references and low bytes back to back in encode_ref's buffer (one
    # buffer a thread), where every plane decodes in one libzstd call.
    planes = st.scratch("ref-planes", 2 * n + nrefs)
    residuals, refs, low = planes, planes[n : n + nrefs], planes[n + nrefs : 2 * n + nrefs]
    if _all_frames(sections):
        stored = sum(s.stored_len for s in sections)
        st.decompress_into(src[at : at + stored], planes[: 2 * n + nrefs])
    else:  # NOTE: an earlier release's object (stored sections): section by section
        counts = (-(-k // piece) + -(-v // piece), -(-nrefs // piece), -(-n // piece))
        first = 0
        for plane, count in zip((residuals, refs, low), counts, strict=True):
            at = _decode_run(st, sections[first : first + count], src, at, plane)
            first += count
    _subtract_refs(st, refs, residuals[:n].reshape(g.channels, g.tokens, g.head_dim))
    high = residuals[:n].reshape(2, g.layers, -1).transpose(1, 0, 2)
    np.multiply(high, _HIGH, out=words.reshape(g.layers, 2, -1))
    np.bitwise_or(words, low[:n], out=words)
    hasher.update(target.data)


def _decode_run(
    st: _zstd.ThreadZstd,
    sections: tuple[Section, ...],
    src: U8,
    at: int,
    dst: U8,
    hasher: Any = None,
) -> int:
    """Decode consecutive sections from ``src[at:]`` into ``dst`` back to back, each fed to
    ``hasher`` (if any) while in cache; returns the offset in ``src`` after them.

    Raises:
        FrameError: A zstd section is corrupt or decodes to the wrong length.
    """
    pos = 0
    for section in sections:
        out = dst[pos : pos + section.raw_len]
        piece = src[at : at + section.stored_len]
        if section.codec is SectionCodec.ZSTD:
            st.decompress_into(piece, out)  # NOTE: straight into the caller's buffer
        else:
            out[:] = piece
        if hasher is not None:
            hasher.update(out.data)
        at += section.stored_len
        pos += section.raw_len
    return at
