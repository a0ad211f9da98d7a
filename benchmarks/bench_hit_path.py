"""The engine thread's host time for an s3kv hit: every connector call up to the copies. JSON lines.

An s3kv hit costs the engine's thread, before its forward pass can start, the adapter's
``request_view``, the claim (``get_num_new_matched_tokens``: hash the prompt, pin the staged
run, record usage hits), ``update_state_after_alloc`` (plan the loads), ``build_connector_meta``
and the worker's ``start_load_kv`` (look up each staged source, enqueue the copies). On a GPU
those milliseconds come straight out of the hit's TTFT (``gpu.load_overhead_ms`` in
``gpu_ab.py``); here they are measured alone, on the CPU, with the copy engine replaced by one
that only returns completed events, so the figure is the connector's own Python work.

Each sample stages a fresh prompt's blocks (fully staged: the claim covers the whole prefix),
then times the calls one by one (median over samples):

* ``hit_path.total_ms``, with ``request_view_ms``, ``claim_ms``, ``alloc_ms``, ``meta_ms``,
  ``start_load_ms``; context: ``tokens``, ``tokens_per_block``, ``blocks``.

Usage: ``python benchmarks/bench_hit_path.py [--quick]``. To compare two versions of the code,
run it with each on ``PYTHONPATH`` in the same session and compare the ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch
from bench_scheduler import BindingRequest

from s3kv.config import S3KVConfig
from s3kv.connector import device
from s3kv.connector.api import RequestData
from s3kv.connector.completion import CompletionBoard
from s3kv.connector.identity import ModelIdentity
from s3kv.connector.requests import request_view
from s3kv.connector.scheduler import SchedulerCore
from s3kv.connector.shared import ShardStores
from s3kv.connector.worker import WorkerCore
from s3kv.keys import chain_hashes
from s3kv.pool import IOPool
from s3kv.staging import NumpyAllocator
from s3kv.storage import MemoryBackend
from s3kv.store import KVStore

LAYERS, KV_HEADS, HEAD_DIM = 2, 1, 8  # NOTE: tiny blocks: no copy runs; only counts matter
PHASES = ("request_view", "claim", "alloc", "meta", "start_load")


def emit(metric: str, value: float, unit: str, **extra: Any) -> None:
    print(json.dumps({"metric": metric, "value": round(value, 3), "unit": unit, **extra}))
    sys.stdout.flush()


class NoCopyEngine:
    """A copy engine whose copies are complete at once and never run (no device, no bytes)."""

    defers_saves = False

    def mark_forward(self, stream: Any) -> None:
        return None

    def load(self, targets: Any, sources: Any, bounds: Any, stream: Any) -> list[Any]:
        assert len(targets) == len(sources)
        return [device.DONE] * (len(bounds) - 1)

    def wait(self, event: Any, stream: Any) -> None:
        return None

    def save(self, pairs: Any, stream: Any) -> Any:
        return device.DONE


def tiny_identity(model_id: str, tpb: int) -> ModelIdentity:
    """The identity of a :data:`LAYERS`-layer model with blocks of ``tpb`` tokens."""
    return ModelIdentity(
        model_id=model_id, weights_revision="r", dtype="bfloat16", kv_dtype="bfloat16",
        quantization="none", tokens_per_block=tpb, kv_factor=2,
        block_elems=KV_HEADS * tpb * HEAD_DIM, num_layers=LAYERS, layout="trtllm-v1/TRTLLM",
        tp_size=1, tp_rank=0,
    )  # fmt: skip


def fresh_request(
    config: S3KVConfig, tpb: int, store: KVStore, worker: WorkerCore, tokens: list[int], rid: int
) -> tuple[SchedulerCore, ShardStores, BindingRequest, list[int]]:
    """A new scheduler over ``store`` (its board shared with ``worker``, as at an engine's
    start) and ``tokens`` as request ``rid`` with the block ids the engine would allocate
    (1, 2, ... for its full blocks, then 0)."""
    core = SchedulerCore(config, tpb)
    board = CompletionBoard.private()
    shards = ShardStores([store])
    core.attach(shards, board=board, manager="v1")
    worker.board = board
    block_ids = [*range(1, (len(tokens) - 1) // tpb + 1), 0]
    return core, shards, BindingRequest(tokens, rid), block_ids


class Case:
    """One store with a staging cache big enough for every sample's prompt."""

    def __init__(self, n_tokens: int, tpb: int, samples: int) -> None:
        self.n_tokens, self.tpb = n_tokens, tpb
        self.blocks = n_tokens // tpb
        elems = KV_HEADS * tpb * HEAD_DIM
        block_nbytes = LAYERS * 2 * elems * 2
        identity = tiny_identity("bench-hit", tpb)
        self.config = S3KVConfig.load(
            environ={}, bucket="bench-hit", codec="raw", manifest_refresh_interval=0,
            staging_bytes=(samples + 1) * (self.blocks + 1) * block_nbytes, warm_start_bytes=0,
        )  # fmt: skip
        self.store = KVStore.open(
            self.config, identity, backend=MemoryBackend(), allocator=NumpyAllocator(),
            pool=IOPool(0), start_background=False,
        )  # fmt: skip
        self.block_nbytes = block_nbytes
        pool = torch.zeros((self.blocks + 2, LAYERS, 2, elems), dtype=torch.bfloat16)
        self.worker = WorkerCore(0, self.store, pool, 1 << 20, board=None)
        self.worker._engine_for = lambda stream: NoCopyEngine()  # type: ignore[method-assign]
        self.rng = np.random.default_rng(7)
        self.request_id = 0

    def sample(self) -> dict[str, float]:
        """One hit on a freshly staged prompt; seconds per phase."""
        tokens = [int(t) for t in self.rng.integers(0, 128_000, size=self.n_tokens + 1)]
        for key in chain_hashes(tokens, self.tpb):
            buffer = self.store.staging.allocate(self.block_nbytes)
            assert buffer is not None
            self.store.staging.insert(key, buffer)
        self.request_id += 1
        rid = self.request_id
        core, _, request, block_ids = fresh_request(
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
        meta = core.build_connector_meta([RequestData(rid, tokens, block_ids, 0, 1)], [])
        t4 = time.perf_counter()
        self.worker.start_load(meta, None)
        t5 = time.perf_counter()
        assert matched == self.blocks * self.tpb
        assert len(meta.loads) == self.blocks
        core.request_finished(rid)
        core.build_connector_meta([], [])  # NOTE: releases the claim's pins
        for key in chain_hashes(tokens, self.tpb):
            self.store.staging.remove(key)
        return dict(zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    args = parser.parse_args()
    samples = 5 if args.quick else 25
    for n_tokens in (8192, 32768):
        case = Case(n_tokens, 32, samples)
        rows = [case.sample() for _ in range(samples + 1)][1:]  # NOTE: the first warms up
        phases = {f"{p}_ms": round(statistics.median(r[p] for r in rows) * 1e3, 3) for p in PHASES}
        totals = [sum(r.values()) * 1e3 for r in rows]
        emit("hit_path.total_ms", statistics.median(totals), "ms", tokens=n_tokens,
             tokens_per_block=32, blocks=case.blocks, samples=samples, **phases,
             cores=os.cpu_count(), cpu=platform.processor() or platform.machine())  # fmt: skip
        case.store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
