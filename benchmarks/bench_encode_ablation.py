"""What each part of ``codec.encode`` costs threads: encode with a part taken out. JSON lines.

Runs ``bench_codec_threads.py``'s ``encode`` case (PLANES_ZSTD, 1.5 MB synthetic bf16 blocks)
in this process after removing one part of the encoder, so that N threads' throughput with
and without it shows what that part costs when threads share the GIL:

* ``full``: the encoder as shipped;
* ``no_join``: no final ``bytes`` (``_assemble`` returns the pieces): the 1 MB copy of the
  payload into the result, made under the GIL;
* ``no_low_copies``: the low planes' raw frames get their headers but not their bytes: one
  GIL-dropping numpy copy per chunk (3 for a SmolLM2 block; 6 before commit ac69793's larger
  chunks);
* ``no_probe``: the low-plane probe says "incompressible" without coding a sample;
* ``none``: all three removed.

An ablated encoder writes objects no reader accepts: the rows measure time, nothing else.
The benchmark's own setup encodes its blocks before the part is removed. Each row is
``bench_codec_threads``'s, with ``ablation`` added.

Finding (H200 hosts' 16-vCPU Xeon, three rounds each starting with the next ablation,
``codec_threads-h200-host-2026-11-29-encode-ablation.jsonl``), encode at 8 threads:

| ablation | MB/s | context switches a block |
|---|---|---|
| full | 2,771-2,883 | 16.3-16.7 |
| no_join | 3,752-4,122 (+35-43%) | 15.5-15.8 |
| no_low_copies | 3,352-3,834 (+21-33%) | 9.8-10.1 |
| no_probe | 2,913-3,106 (+5-8%) | 15.1-15.6 |
| none | 5,022-5,240 (+81-82%) | 7.4-8.1 |

8 forked processes of the full encoder: 5,573 MB/s. An earlier run of the same patches on
another host gave full 3,332-3,541, no_join +16-34%, no_low_copies +8-29%, none +51-67%.
So the final copy (GIL held) and the per-chunk low copies (a GIL hand-off each) each cost
the threads a fifth to a third of their throughput; the probe is within noise. The save path
has since dropped the final copy: it encodes with ``codec.encode_view`` (the object coded
into a buffer of its own, PUT as a view; see ``bench_codec_threads.py``'s ``encode_view``).
The low copies stay: the wire format puts each chunk's high frame before its low one, so the
low planes land at offsets known only after each high frame is coded.

Usage: ``python benchmarks/bench_encode_ablation.py [--threads 1,4,8] [--ablations a,b]
[--quick]``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import bench_codec_threads

from s3kv import _planes, _zstd, codec

ABLATIONS = ("full", "no_join", "no_low_copies", "no_probe", "none")


def ablate(name: str) -> Callable[[], None]:
    """Remove ``name``'s parts from the encoder; returns what puts them back."""
    parts = {"no_join", "no_low_copies", "no_probe"} if name == "none" else {name}
    saved = (codec._assemble, _planes._add_raw_frame, _zstd.ThreadZstd.compresses)

    def restore() -> None:
        codec._assemble, _planes._add_raw_frame = saved[0], saved[1]
        setattr(_zstd.ThreadZstd, "compresses", saved[2])  # noqa: B010 (a method: mypy)

    if "no_join" in parts:

        def unjoined(head: bytes, pieces: list[Any]) -> Any:
            return pieces

        codec._assemble = unjoined
    if "no_low_copies" in parts:

        def header_only(words: Any, n: int, payload: Any, at: int, sections: list[Any]) -> int:
            prefix = _zstd.raw_frame_prefix(n)
            payload[at : at + prefix.size] = prefix
            size = _zstd.raw_frame_overhead(n) + n
            sections.append((_planes.SectionCodec.ZSTD, size))
            return at + size

        _planes._add_raw_frame = header_only
    if "no_probe" in parts:
        _zstd.ThreadZstd.compresses = lambda self, plane, n: False  # type: ignore[method-assign]
    return restore


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", default="1,4,8")
    parser.add_argument("--ablations", default=",".join(ABLATIONS))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    emit = bench_codec_threads.emit
    encode = codec.encode
    for name in args.ablations.split(","):
        if name not in ABLATIONS:
            parser.error(f"--ablations: {name!r} is not one of {', '.join(ABLATIONS)}")
        calls = 0

        def encode_ablated(*a: Any, name: str = name, **k: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 17:  # NOTE: the setup's 16 blocks are encoded whole (they are decoded)
                ablate(name)
            return encode(*a, **k)

        def tagged(metric: str, value: Any, unit: str, name: str = name, **extra: Any) -> None:
            emit(metric, value, unit, ablation=name, **extra)

        codec.encode = encode_ablated
        bench_codec_threads.emit = tagged
        restore = ablate("full")
        try:
            sys.argv = [sys.argv[0], "--cases", "encode", "--threads", args.threads]
            sys.argv += ["--quick"] if args.quick else []
            bench_codec_threads.main()
        finally:
            restore()
            codec.encode, bench_codec_threads.emit = encode, emit
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
