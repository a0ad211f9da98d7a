"""The engine thread's host time for a cold prompt (a miss that will be saved). JSON lines.

A cold prompt costs the engine's thread, before its forward pass can start, the adapter's
``request_view``, the claim (``get_num_new_matched_tokens``: nothing staged, the tail handed to
the I/O side), ``update_state_after_alloc`` and ``build_connector_meta`` (hash every full block,
one filter pass, the saves' metadata), and the metadata's trip to the workers (TensorRT-LLM
broadcasts it pickled; the emulated runtime always pickles it). After the forward pass is
queued, ``wait_for_save`` plans the device→host copies; once they are done, ``get_finished``
hands the blocks to the store (the hand-off: admission, and the jobs of the I/O threads or
of the codec processes). On a GPU the pre-forward part delays the prefill's first kernel
(``gpu.save_overhead_pct`` in ``gpu_ab.py``) and the hand-off delays the iteration it runs
in; here each phase is measured alone, on the CPU, with a copy engine that never copies. The
claim's prefetch walk runs on the store's I/O threads, as in the engine (where it competes
for the GIL).

Each sample is a fresh random prompt against a manifest holding ``--manifest-keys`` other
keys (its Bloom filter has a realistic size; no prompt block is in it). Median over samples:

* ``save_path.pre_forward_ms`` (view + claim + alloc + meta + pickle), with every phase's
  ``*_ms``, ``wait_for_save_ms``, ``hand_off_ms`` (summed over the ``hand_off_calls`` calls
  of ``get_finished`` that hand a prompt's blocks over, a share each), ``sending_ms`` and
  ``outcomes_ms``
  (with codec processes: the CPU time of their sender thread, which pickles the jobs, and of
  their reader thread, which handles the saves' outcomes, both on the engine's interpreter,
  from the hand-off until the saves have ended); context:
  ``tokens``, ``tokens_per_block``, ``blocks``, ``saves`` (blocks planned),
  ``metadata_bytes``, ``codec_processes`` (the hand-off's path: 0 is the I/O threads, the
  default).

Usage: ``python benchmarks/bench_save_path.py [--quick]``. To compare two versions of the code,
run it with each on ``PYTHONPATH`` in the same session and compare the ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import platform
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np
import torch
from bench_hit_path import HEAD_DIM, KV_HEADS, LAYERS, NoCopyEngine, fresh_request, tiny_identity

from s3kv.config import S3KVConfig
from s3kv.connector.api import RequestData
from s3kv.connector.requests import request_view
from s3kv.connector.worker import WorkerCore
from s3kv.keys import ROOT_HASH, BlockHash
from s3kv.pool import IOPool
from s3kv.staging import NumpyAllocator
from s3kv.storage import MemoryBackend
from s3kv.store import KVStore

PHASES = (
    "request_view", "claim", "alloc", "meta", "pickle", "wait_for_save", "hand_off", "sending",
    "outcomes",
)  # fmt: skip
AFTER_FORWARD = ("wait_for_save", "hand_off", "sending", "outcomes")


def codec_thread_cpu_seconds(role: str) -> float:
    """CPU time so far of the codec processes' ``read`` or ``send`` thread (0 without one):
    they share the engine's interpreter, so their time is time the engine's thread may wait
    for the GIL."""
    for thread in threading.enumerate():
        if thread.name.endswith(f"-{role}") and thread.native_id is not None:
            try:
                with open(f"/proc/self/task/{thread.native_id}/schedstat") as stats:
                    return int(stats.read().split()[0]) / 1e9
            except OSError:
                return 0.0
    return 0.0


def emit(metric: str, value: float, unit: str, **extra: Any) -> None:
    print(json.dumps({"metric": metric, "value": round(value, 3), "unit": unit, **extra}))
    sys.stdout.flush()


class DeferringNoCopyEngine(NoCopyEngine):
    """As on CUDA, saves are planned in ``wait_for_save`` and queued by ``get_finished``."""

    defers_saves = True


class Case:
    """One store whose manifest holds ``manifest_keys`` unrelated keys.

    With ``codec_processes`` the store writes to a ``file://`` bucket in a temporary folder
    (the processes open the bucket from the settings), else to memory.
    """

    def __init__(self, n_tokens: int, tpb: int, manifest_keys: int, codec_processes: int) -> None:
        self.n_tokens, self.tpb = n_tokens, tpb
        self.blocks = n_tokens // tpb
        elems = KV_HEADS * tpb * HEAD_DIM
        identity = tiny_identity("bench-save", tpb)
        self.codec_processes = codec_processes
        self.folder = tempfile.TemporaryDirectory(prefix="bench-save-")
        self.config = S3KVConfig.load(
            environ={}, bucket="bench-save", codec="raw", manifest_refresh_interval=0,
            warm_start_bytes=0, codec_processes=codec_processes,
            endpoint_url=f"file://{self.folder.name}" if codec_processes else None,
            staging_bytes=64 << 20, manifest_compaction="off",
        )  # fmt: skip
        if codec_processes:
            self.store = KVStore.open(self.config, identity, start_background=False)
        else:
            self.store = KVStore.open(
                self.config, identity, backend=MemoryBackend(), allocator=NumpyAllocator(),
                pool=IOPool(2), start_background=False,
            )  # fmt: skip
        rng = np.random.default_rng(11)
        parent = ROOT_HASH
        keys = rng.bytes(16 * manifest_keys)
        for i in range(manifest_keys):
            key = BlockHash(keys[16 * i : 16 * i + 16])
            self.store.manifest.record_write(key, parent, 1)
            parent = key
        pool = torch.zeros((self.blocks + 2, LAYERS, 2, elems), dtype=torch.bfloat16)
        block_nbytes = LAYERS * 2 * elems * 2
        self.worker = WorkerCore(0, self.store, pool, (self.blocks + 1) * block_nbytes, board=None)
        self.worker._engine_for = lambda stream: DeferringNoCopyEngine()  # type: ignore[method-assign]
        self.rng = np.random.default_rng(7)
        self.request_id = 0
        self.hand_off_calls = 0

    def sample(self) -> tuple[dict[str, float], int, int]:
        """One cold prompt; seconds per phase, saves planned, metadata bytes."""
        tokens = [int(t) for t in self.rng.integers(0, 128_000, size=self.n_tokens + 1)]
        self.request_id += 1
        rid = self.request_id
        core, shards, request, block_ids = fresh_request(
            self.config, self.tpb, self.store, self.worker, tokens, rid
        )
        gc.collect()
        t0 = time.perf_counter()
        view = request_view(request)
        t1 = time.perf_counter()
        matched = core.get_num_new_matched_tokens(view, 0)
        t2 = time.perf_counter()
        core.update_state_after_alloc(rid, block_ids)
        t3 = time.perf_counter()
        report = RequestData(rid, tokens, block_ids, 0, len(tokens))
        meta = core.build_connector_meta([report], [])
        t4 = time.perf_counter()
        wire = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
        meta = pickle.loads(wire)
        t5 = time.perf_counter()
        self.worker.save_after_forward(meta, None)
        t6 = time.perf_counter()
        assert matched == 0
        start_walks = getattr(shards, "start_walks", None)
        if start_walks is not None:
            start_walks()  # NOTE: what wait_for_save starts on rank 0 (untimed: I/O side)
        core.request_finished(rid)
        t7 = time.perf_counter()
        reader_before = codec_thread_cpu_seconds("read")
        sender_before = codec_thread_cpu_seconds("send")
        # NOTE: copies "done": the blocks go to the store. A pass's copies are queued from
        # the get_finished after the one that sees them, a share per call (worker._issue),
        # so the hand-off spreads over calls, as over the engine's iterations.
        done = self.worker.finished([rid])
        self.hand_off_calls = 1
        while rid not in done and self.hand_off_calls < 10_000:
            done = self.worker.finished([])
            self.hand_off_calls += 1
        t8 = time.perf_counter()
        assert done == [rid], f"request {rid} not finished after {self.hand_off_calls} calls"
        self.store.flush(timeout=60)  # NOTE: the saves end before the next sample (untimed)
        time.sleep(0.01)  # NOTE: the I/O side's walk ends before the next sample
        outcomes = codec_thread_cpu_seconds("read") - reader_before
        sending = codec_thread_cpu_seconds("send") - sender_before
        phases = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t8 - t7, sending, outcomes)
        return dict(zip(PHASES, phases, strict=True)), len(meta.saves), len(wire)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    parser.add_argument("--manifest-keys", type=int, default=200_000)
    args = parser.parse_args()
    samples = 5 if args.quick else 25
    for n_tokens, processes in ((8192, 0), (32768, 0), (8192, 2)):
        case = Case(n_tokens, 32, args.manifest_keys, processes)
        results = [case.sample() for _ in range(samples + 1)][1:]  # NOTE: the first warms up
        rows = [r for r, _, _ in results]
        phases = {f"{p}_ms": round(statistics.median(r[p] for r in rows) * 1e3, 3) for p in PHASES}
        pre = [sum(r[p] for p in PHASES if p not in AFTER_FORWARD) * 1e3 for r in rows]
        emit("save_path.pre_forward_ms", statistics.median(pre), "ms", tokens=n_tokens,
             tokens_per_block=32, blocks=case.blocks, saves=results[-1][1],
             metadata_bytes=results[-1][2], manifest_keys=args.manifest_keys,
             hand_off_calls=case.hand_off_calls,
             samples=samples, **phases, codec_processes=processes, cores=os.cpu_count(),
             cpu=platform.processor() or platform.machine())  # fmt: skip
        case.store.close()
        case.folder.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
