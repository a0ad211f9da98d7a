"""How much a prompt's saves slow other host work on the same machine, with no GIL shared.

After a cold prefill its blocks are encoded and written by codec processes while the engine
thread goes on decoding. This script asks what that costs work that shares only the hardware
(cores, caches, memory bandwidth) with them: the main thread runs a fixed probe (Python dict
work and small numpy calls, plus ``--ws-mb`` MiB of random reads: a working set the size of
an engine's host state) in iterations, alone and while

* ``save-path`` — a :class:`~s3kv.store.KVStore` with ``--codec-processes`` codec processes
  saves ``--blocks`` distinct SmolLM2-sized bf16 blocks (1.47 MB) from its save arena to a
  ``file://`` bucket in ``--bucket-dir`` (what the connector hands over after a prefill);
* ``encoders`` — as many stand-in processes encode the same number of distinct blocks with
  s3kv's codec and write nothing (the codec's CPU work alone).

The variants alternate trial by trial. Rows (JSON lines): ``host.contention`` per variant and
working set, the median over trials of the probe's wall and thread-CPU time per iteration over
``none``'s (``wall_over_none``, ``cpu_over_none``; ``value`` is ``cpu_over_none``), and how
long the saves took once handed over (``window_ms``). Where ``cpu_over_none`` rises, the probe's own
instructions ran slower: caches and memory shared with the codec, not the GIL (the probe's
thread shares no lock with the codec processes; the store's reader thread is the only other
thread in this process).

Usage: ``python benchmarks/bench_host_contention.py [--quick] [--ws-mb 0,4,32]
[--codec-processes 4] [--blocks 160] [--trials 9] [--engine-cpu N] [--bucket-dir DIR]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt
from bench_s3 import identity
from bench_wan import codec_pids, saved_from

from s3kv import codec
from s3kv.config import S3KVConfig
from s3kv.keys import ROOT_HASH, hash_block
from s3kv.offload import affinity
from s3kv.store import KVStore

#: SmolLM2's block of 64 tokens: (layers, K and V, heads x tokens x head dim), bf16 as int16.
BLOCK_SHAPE = (30, 2, 3 * 64 * 64)
ENDED = ("save_completed", "save_failed", "save_skipped_existing", "save_dropped")
VARIANTS = ("none", "save-path", "encoders")
#: The probe's time alone per trial, and between phases (the machine settles).
ALONE_S = 0.15
GAP_S = 0.05


def kv_like_blocks(count: int, seed: int) -> list[npt.NDArray[np.int16]]:
    """``count`` distinct bf16 blocks of roughly KV-like values (as int16 bit patterns)."""
    rng = np.random.default_rng(seed)
    blocks = []
    for i in range(count):
        values = rng.standard_normal(int(np.prod(BLOCK_SHAPE)), dtype=np.float32) * 0.5
        bits = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)
        bits[:4] = i  # NOTE: distinct bytes per block even if the generator repeated
        blocks.append(bits.reshape(BLOCK_SHAPE))
    return blocks


class Probe:
    """The main thread's fixed host work, with a working set of ``ws_mb`` MiB."""

    def __init__(self, ws_mb: int) -> None:
        self.small = np.ones(16)
        self.ws = np.ones(ws_mb << 17) if ws_mb else None
        self.at = np.random.default_rng(1).integers(0, max(1, ws_mb << 17), 8192)

    def step(self) -> None:
        if self.ws is not None:
            self.ws[self.at].sum()
        table = {}
        for i in range(1000):
            table[i] = i * 2
        for _ in range(200):
            np.add(self.small, 1, out=self.small)

    def run(self, done: Callable[[], bool]) -> tuple[float, float]:
        """Iterate until ``done`` (asked every 4 iterations); wall and CPU ms per iteration."""
        n = 0
        wall, cpu = time.perf_counter(), time.thread_time()
        while n == 0 or n % 4 or not done():
            self.step()
            n += 1
        return (time.perf_counter() - wall) * 1e3 / n, (time.thread_time() - cpu) * 1e3 / n


def encoder(conn: Connection, blocks: int, seed: int) -> None:
    """A stand-in codec process: encodes its ``blocks`` distinct blocks per request."""
    sources = kv_like_blocks(blocks, seed)
    conn.send("ready")
    while conn.recv() is not None:
        for i, block in enumerate(sources):
            codec.encode(block, key=f"k{i}", dtype="bfloat16", shape=BLOCK_SHAPE)
        conn.send("done")


class SavePath:
    """A store with codec processes saving ``blocks`` per trial to a ``file://`` bucket."""

    def __init__(self, processes: int, blocks: int, bucket_dir: str) -> None:
        self.folder = tempfile.TemporaryDirectory(prefix="host-contention-", dir=bucket_dir)
        self.blocks = kv_like_blocks(blocks, 5)
        nbytes = sum(b.nbytes for b in self.blocks)
        config = S3KVConfig.load(
            environ={}, endpoint_url=f"file://{self.folder.name}", bucket="contention",
            codec_processes=processes, manifest_compaction="off", staging_bytes=64 << 20,
            max_inflight_save_bytes=2 * nbytes, warm_start_bytes=0,
        )  # fmt: skip
        self.store = KVStore.open(config, identity("host-contention"))
        codec_pids(self.store, processes)
        self.trial = 0

    def start(self) -> Callable[[], bool]:
        store = self.store
        self.trial += 1
        keys = [hash_block(ROOT_HASH, [self.trial, i]) for i in range(len(self.blocks))]
        sources = saved_from(store, self.blocks)
        before = sum(store.metrics.value(name) for name in ENDED)
        batch = [(key, ROOT_HASH, source, None) for key, source in zip(keys, sources, strict=True)]
        store.save_many(batch, dtype="bfloat16", shape=BLOCK_SHAPE)
        return lambda: sum(store.metrics.value(name) for name in ENDED) - before >= len(keys)

    def settle(self) -> None:
        self.store.flush(timeout=120)

    def close(self) -> None:
        self.store.close()
        self.folder.cleanup()


class Encoders:
    """``processes`` stand-in codec processes, ``blocks`` blocks between them per trial."""

    def __init__(self, processes: int, blocks: int, away_from: int) -> None:
        self.procs: list[tuple[multiprocessing.Process, Connection]] = []
        # NOTE: off a pinned probe's CPU, as codec_cpus=auto moves the codec processes
        cpus = os.sched_getaffinity(0) | affinity.allowed_cpus()
        for p in range(processes):
            parent, child = multiprocessing.Pipe()
            share = blocks // processes + (p < blocks % processes)
            proc = multiprocessing.Process(target=encoder, args=(child, share, p), daemon=True)
            proc.start()
            if away_from >= 0 and proc.pid is not None:
                os.sched_setaffinity(proc.pid, (cpus - {away_from}) or cpus)
            self.procs.append((proc, parent))
        for _, conn in self.procs:
            conn.recv()

    def start(self) -> Callable[[], bool]:
        pending = [conn for _, conn in self.procs]
        for conn in pending:
            conn.send(1)

        def done() -> bool:
            for conn in [c for c in pending if c.poll()]:
                conn.recv()
                pending.remove(conn)
            return not pending

        return done

    def settle(self) -> None:
        pass

    def close(self) -> None:
        for proc, conn in self.procs:
            conn.send(None)
            proc.join(10)


def measure(args: argparse.Namespace, ws_mb: int, loads: dict[str, Any]) -> None:
    probe = Probe(ws_mb)
    rows: dict[str, list[tuple[float, float, float]]] = {v: [] for v in VARIANTS}
    for trial in range(args.trials):
        shift = trial % len(VARIANTS)
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            time.sleep(GAP_S)
            if variant == "none":
                end = time.perf_counter() + ALONE_S
                wall, cpu = probe.run(lambda end=end: time.perf_counter() > end)
                rows[variant].append((wall, cpu, ALONE_S * 1e3))
                continue
            load = loads[variant]
            done = load.start()  # NOTE: the save path copies its blocks in first (untimed)
            start = time.perf_counter()
            wall, cpu = probe.run(done)
            rows[variant].append((wall, cpu, (time.perf_counter() - start) * 1e3))
            load.settle()
    alone_wall = statistics.median(r[0] for r in rows["none"])
    alone_cpu = statistics.median(r[1] for r in rows["none"])
    for variant in VARIANTS:
        wall = statistics.median(r[0] for r in rows[variant])
        cpu = statistics.median(r[1] for r in rows[variant])
        row = {
            "metric": "host.contention", "value": round(cpu / alone_cpu, 3), "unit": "x",
            "variant": variant, "ws_mb": ws_mb, "cpu_over_none": round(cpu / alone_cpu, 3),
            "wall_over_none": round(wall / alone_wall, 3), "probe_cpu_ms": round(cpu, 4),
            "probe_wall_ms": round(wall, 4), "window_ms": round(statistics.median(
                r[2] for r in rows[variant]), 1), "trials": args.trials,
            "codec_processes": args.codec_processes, "blocks": args.blocks,
            "engine_cpu": args.engine_cpu, "cores": os.cpu_count(),
        }  # fmt: skip
        print(json.dumps(row), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="3 trials, 32 blocks, ws 0,4")
    parser.add_argument("--ws-mb", default="0,4,32", help="probe working sets (MiB)")
    parser.add_argument("--codec-processes", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=160, help="blocks saved per trial")
    parser.add_argument("--trials", type=int, default=9)
    parser.add_argument("--engine-cpu", type=int, default=-1, help="pin the probe to a CPU")
    parser.add_argument("--bucket-dir", default=None, help="folder of the file:// bucket")
    args = parser.parse_args()
    if args.quick:
        args.trials, args.blocks, args.ws_mb = 3, 32, "0,4"
    if args.engine_cpu >= 0:
        # NOTE: as a launcher pins a rank; codec_cpus=auto then moves the codec off it.
        os.sched_setaffinity(0, {args.engine_cpu})
    loads = {
        "save-path": SavePath(args.codec_processes, args.blocks, args.bucket_dir),
        "encoders": Encoders(args.codec_processes, args.blocks, args.engine_cpu),
    }
    try:
        for ws_mb in (int(x) for x in args.ws_mb.split(",")):
            measure(args, ws_mb, loads)
    finally:
        for load in loads.values():
            load.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
