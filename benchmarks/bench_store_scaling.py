"""The store's staging and save paths at N workers: I/O threads vs codec processes. JSON lines.

What it answers (issue: "codec threads that scale"): decoding into staging with N I/O threads
scaled 3.1x at 8 threads on a 16-core host because every block's codec work runs ~15 C calls
separated by Python glue that needs the one GIL (``bench_codec_threads.py``). With
``codec_processes = N`` the GET, verify and decode run in N processes that write the staging
arena's shared memory, and encode and PUT read the save arena's: no shared GIL.

Each mode, on the same blocks and bucket, N = 1, 2, 4, 8, 16 (capped at the host's cores):

* ``threads``: ``codec_processes = 0``, ``io_threads = N`` (the path off the GPU);
* ``processes``: ``codec_processes = N``, ``io_threads = N`` (one job at a time per process).

Stage: a fresh store per N, ``prefetch`` of every block and ``wait_staged`` (after a few
warm-up blocks, so process start-up is not timed). Save: a fresh store per N, blocks already
in save buffers (the save arena's slots, or numpy buffers for threads), ``save_many`` and
``flush``. Bucket: a ``file://`` directory, so a GET or PUT is a read or write syscall from
the page cache and the codec dominates.

The host's own scaling (case ``ceiling``, always run first): N processes that share nothing,
each encoding (or decoding into rotating buffers) its own copies of the blocks with the codec
alone, no store, bucket, arena or message. Their aggregate MB/s at N over that at 1 is what the
host gives N busy cores running this code (shared caches and memory bandwidth, all-core clocks,
vCPUs that may share physical cores). It is a reference, not a bound: the store's single
process also waits on its GETs, PUTs and messages, so its ratio can exceed the reference's.
Rows ``store_scaling.{encode|decode}_ceiling_MBps``; each store row then carries
``ceiling_scaling`` (decode's for stage, encode's for save) and ``of_ceiling`` = scaling /
ceiling_scaling.

Rows: ``store_scaling.{stage|save}_{threads|processes}_MBps`` (raw MB/s) with
``scaling`` (= MB/s(N) / MB/s(1) of the same mode; the target is >= 0.8 N up to 8),
``engine_cpu_us_per_block`` (CPU of the store's own process per block: what the engine's
interpreter pays; with processes the codec's CPU is elsewhere) and ``cpu_per_wall``. Each
point is the median of ``--repeat`` runs (default 3, all listed in ``runs_MBps``): on the
16-core host one process's rate varied by 1.5x from run to run, which a single run at N = 1
would carry into every ratio.

Data: synthetic bf16 KV (normal values, the exponent-plane entropy of real KV) in blocks
shaped like a Llama-3-8B 8-layer slice's at 32 tokens (1 MiB).

Usage: ``python benchmarks/bench_store_scaling.py [--quick] [--workers 1,2,4,8,16]
[--modes threads,processes] [--cases ceiling,stage,save] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import queue
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from s3kv import codec
from s3kv.arena import SlabArena
from s3kv.config import S3KVConfig
from s3kv.keys import ROOT_HASH, BlockHash, ModelIdentity
from s3kv.store import KVStore

LAYERS, TOKENS, HEADS, HEAD_DIM = 8, 32, 8, 128
ELEMS = TOKENS * HEADS * HEAD_DIM
NBYTES = LAYERS * 2 * ELEMS * 2
SHAPE = (LAYERS, 2, TOKENS, HEADS, HEAD_DIM)
WARMUP = 8
#: Distinct blocks each ceiling process draws (64 MiB of its own, larger than its caches).
CEILING_DISTINCT = 64
#: How long a ceiling process may take to start, or to report, before the run fails.
CEILING_TIMEOUT_S = 600


def identity() -> ModelIdentity:
    return ModelIdentity(
        model_id="bench/store-scaling",
        weights_revision="r1",
        dtype="bfloat16",
        kv_dtype="bfloat16",
        quantization="none",
        tokens_per_block=TOKENS,
        kv_factor=2,
        block_elems=ELEMS,
        num_layers=LAYERS,
        layout="bench",
    )


def make_blocks(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    values = rng.normal(0, 1, (n, NBYTES // 2)).astype(np.float32)
    return [(row.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8) for row in values]


def block_keys(n: int, salt: int) -> list[BlockHash]:
    return [BlockHash(salt.to_bytes(4, "big") + i.to_bytes(12, "big")) for i in range(n)]


def config(bucket: Path, mode: str, n: int, blocks: int) -> S3KVConfig:
    return S3KVConfig(
        endpoint_url=f"file://{bucket}",
        codec_processes=n if mode == "processes" else 0,
        io_threads=n,
        staging_bytes=(blocks + WARMUP + 4) * NBYTES,
        max_inflight_save_bytes=(blocks + 4) * NBYTES,
        max_prefetch_queue=blocks + WARMUP + 4,
        manifest_compaction="off",
    )


def started(store: KVStore) -> None:
    """Wait until every codec process is set up (start-up is not what is measured), and
    back the staging arena's pages as CUDA registration does on a GPU host (the first write
    to each fresh page of a shared region is not what is measured either)."""
    if store._offload is not None:
        store._offload.wait_ready(120)
    arena = store.staging._allocator
    if isinstance(arena, SlabArena):
        arena.populate()


def save(bucket: Path, mode: str, n: int, blocks: list[np.ndarray], salt: int) -> dict[str, float]:
    store = KVStore.open(config(bucket, mode, n, len(blocks)), identity())
    try:
        started(store)
        arena = store.save_arena(NBYTES, (len(blocks) + WARMUP) * NBYTES)
        warm = [arena.allocate(NBYTES) if arena is not None else np.empty(NBYTES, np.uint8)
                for _ in range(WARMUP)]  # fmt: skip
        for buffer in warm:
            buffer[:] = blocks[0]
        store.save_many([(k, ROOT_HASH, b, None) for k, b in zip(block_keys(WARMUP, salt + 1),
                                                                 warm, strict=True)],
                        dtype="bfloat16", shape=SHAPE, checked=True)  # fmt: skip
        store.flush(timeout=120)
        buffers = []
        for block in blocks:
            buffer = arena.allocate(NBYTES) if arena is not None else np.empty(NBYTES, np.uint8)
            buffer[:] = block
            buffers.append(buffer)
        keys = block_keys(len(blocks), salt)
        cpu, wall = time.process_time(), time.perf_counter()
        store.save_many([(k, ROOT_HASH, b, None) for k, b in zip(keys, buffers, strict=True)],
                        dtype="bfloat16", shape=SHAPE, checked=True)  # fmt: skip
        done = store.flush(timeout=600)
        wall = time.perf_counter() - wall
        cpu = time.process_time() - cpu
        completed = store.stats().get("save_completed", 0)
    finally:
        store.close(timeout=60)
    assert done, "saves did not drain"
    assert completed >= len(blocks), (completed, len(blocks))
    return {"seconds": wall, "cpu": cpu}


def stage(bucket: Path, mode: str, n: int, keys: list[BlockHash]) -> dict[str, float]:
    store = KVStore.open(config(bucket, mode, n, len(keys)), identity())
    try:
        started(store)
        warm, timed = keys[:WARMUP], keys[WARMUP:]
        store.prefetch(warm)
        store.wait_staged(warm, timeout=120)
        cpu, wall = time.process_time(), time.perf_counter()
        store.prefetch(timed)
        staged = store.wait_staged(timed, timeout=600)
        wall = time.perf_counter() - wall
        cpu = time.process_time() - cpu
    finally:
        store.close(timeout=60)
    assert staged == len(timed), (staged, len(timed))
    return {"seconds": wall, "cpu": cpu}


def one(
    case: str,
    mode: str,
    n: int,
    root: Path,
    source: Path,
    data: list[np.ndarray],
    keys: list[BlockHash],
) -> dict[str, float]:
    """One run of ``case`` in ``mode`` at ``n`` workers, each in a fresh store (and, for a
    save, a fresh bucket)."""
    if case == "stage":
        return stage(source, mode, n, keys)
    bucket = Path(tempfile.mkdtemp(prefix=f"save-{mode}-{n}-", dir=root))
    try:
        return save(bucket, mode, n, data, salt=100 + n)
    finally:
        shutil.rmtree(bucket, ignore_errors=True)


def _codec_alone(kind: str, blocks: int, start: Any, spans: Any) -> None:
    """One ceiling process: ``kind`` (encode or decode) of ``blocks`` blocks drawn from its
    own set, timed from the moment every process is ready (``start``); its (start, end) goes
    to ``spans``. Decoded bytes rotate over as many output buffers as there are blocks in the
    set, as staging writes into many slots rather than one buffer that stays in cache."""
    data = make_blocks(min(blocks, CEILING_DISTINCT))  # NOTE: cycled: drawing is slow
    encoded = [codec.encode(b, key=f"k{i}", dtype="bfloat16", shape=SHAPE)
               for i, b in enumerate(data)]  # fmt: skip
    outs = [np.empty(NBYTES, np.uint8).data for _ in data]
    for i in range(min(WARMUP, len(data))):  # NOTE: first calls (contexts, pages) untimed
        codec.encode(data[i], key=f"k{i}", dtype="bfloat16", shape=SHAPE)
        codec.decode(encoded[i], key=f"k{i}", out=outs[i])
    start.wait(timeout=CEILING_TIMEOUT_S)
    began = time.perf_counter()
    for n in range(blocks):
        i = n % len(data)
        if kind == "encode":
            codec.encode(data[i], key=f"k{i}", dtype="bfloat16", shape=SHAPE)
        else:
            codec.decode(encoded[i], key=f"k{i}", out=outs[i])
    spans.put((began, time.perf_counter()))


def ceiling(kind: str, n: int, blocks: int) -> dict[str, float]:
    """N independent processes running the codec alone, each on ``blocks`` blocks.

    Returns ``seconds`` as the span from the first start to the last end
    (``time.perf_counter`` is one clock for every process on Linux) divided by ``n``, so that
    ``blocks * NBYTES / seconds`` is the aggregate rate, as for the store's runs.
    """
    context = multiprocessing.get_context("spawn")
    start, spans = context.Barrier(n), context.Queue()
    procs = [
        context.Process(target=_codec_alone, args=(kind, blocks, start, spans), daemon=True)
        for _ in range(n)
    ]
    for proc in procs:
        proc.start()
    try:
        got = [spans.get(timeout=CEILING_TIMEOUT_S) for _ in procs]
    except queue.Empty:
        codes = [proc.exitcode for proc in procs]
        raise SystemExit(f"ceiling: a {kind} process did not report (exit codes {codes})") from None
    finally:
        for proc in procs:
            proc.join(timeout=CEILING_TIMEOUT_S)
    span = max(end for _, end in got) - min(began for began, _ in got)
    return {"seconds": span / n, "cpu": math.nan}


def bucket_dir(blocks: int) -> str | None:
    """tmpfs (``/dev/shm``) when it has room: a disk or overlay filesystem's locks would
    serialize the processes' reads and writes, which is not what this measures."""
    need = 4 * blocks * NBYTES
    try:
        if shutil.disk_usage("/dev/shm").free > need:
            return "/dev/shm"
    except OSError:
        pass
    return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer blocks, N up to 2")
    parser.add_argument("--workers", default="1,2,4,8,16")
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--modes", default="threads,processes", help="which of the two")
    parser.add_argument(
        "--cases", default="ceiling,stage,save", help="the host's ceiling, stage, save"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per point; the median")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    counts = [n for n in (int(x) for x in args.workers.split(",")) if n <= cores]
    blocks = args.blocks
    if args.quick:
        counts, blocks, args.repeat = [n for n in counts if n <= 2], 48, 1
    data = make_blocks(blocks)
    common = {"cores": cores, "cpu": cpu_model(), "block_bytes": NBYTES, "blocks": blocks,
              "bucket": "file:// (page cache)"}  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="s3kv-scaling-", dir=bucket_dir(blocks)))
    common["bucket"] = f"file:// under {root.parent}"
    try:
        source = root / "stage"
        source.mkdir()
        save(source, "processes", min(4, cores), data + data[:WARMUP], salt=1)
        keys = block_keys(blocks + WARMUP, salt=1)
        ceilings: dict[tuple[str, int], float] = {}  # (case, n) -> the host's own scaling
        # NOTE: the ceiling first, whatever the order asked: the store's rows refer to it.
        cases = sorted(args.cases.split(","), key=lambda case: case != "ceiling")
        for case in cases:
            modes = ["decode", "encode"] if case == "ceiling" else args.modes.split(",")
            for mode in modes:
                base = 0.0
                for n in counts:
                    if case == "ceiling":
                        runs = [ceiling(mode, n, blocks) for _ in range(args.repeat)]
                    else:
                        runs = [one(case, mode, n, root, source, data, keys)
                                for _ in range(args.repeat)]  # fmt: skip
                    # NOTE: the median run (the faster middle one for an even count): one slow
                    # start is noise. runs_MBps keeps the runs in the order they ran.
                    got = sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]
                    mbps = blocks * NBYTES / got["seconds"] / 1e6
                    base = base or mbps
                    name = f"{mode}_ceiling" if case == "ceiling" else f"{case}_{mode}"
                    row: dict[str, Any] = {
                        "metric": f"store_scaling.{name}_MBps", "value": round(mbps, 1),
                        "unit": "MB/s", "n": n, "scaling": round(mbps / base, 2),
                        "target_scaling": round(0.8 * n, 2) if n <= 8 else None,
                        "engine_cpu_us_per_block": round(got["cpu"] / blocks * 1e6, 1),
                        "cpu_per_wall": round(got["cpu"] / got["seconds"], 2),
                        "runs_MBps": [round(blocks * NBYTES / r["seconds"] / 1e6, 1)
                                      for r in runs],
                        **common,
                    }  # fmt: skip
                    if case == "ceiling":
                        ceilings["stage" if mode == "decode" else "save", n] = mbps / base
                        del (
                            row["engine_cpu_us_per_block"],
                            row["cpu_per_wall"],
                            row["target_scaling"],
                        )
                        row["note"] = "processes sharing nothing, the codec alone: a reference"
                    elif (host := ceilings.get((case, n))) is not None:
                        row["ceiling_scaling"] = round(host, 2)
                        row["of_ceiling"] = round(mbps / base / host, 2)
                    print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
