"""On a GPU: claimed loads survive staging being recycled right after enqueue; TP arena bandwidth.

Two checks, run on the device machine (CUDA, no network, no model):

1. **The overlap race** (the engine-correctness issue, defect 1). The real scheduler and worker
   cores claim staged blocks (pinned host memory), plan the loads and enqueue the host→GPU
   copies on a stream kept busy by matrix products, so the copies are still queued when the
   host moves on — as under TensorRT-LLM's overlap loop. The host then does what the next
   iteration may do: run the next scheduler step and recycle every staging buffer it is
   allowed to (evict it and overwrite it with garbage, as a prefetch refilling the slot
   would). Two policies side by side:

   * ``next_step`` — the old rule: pins released at the next scheduler step;
   * ``completion`` — s3kv's rule: pins released once the worker publishes that the copies'
     CUDA event has completed.

   After a synchronize the pool is compared with the claimed bytes. Expected: ``next_step``
   corrupts blocks, ``completion`` corrupts none.

2. **TP arena bandwidth** (defect 10). Rank 0 creates a shared staging arena; a second process
   sharing the GPU maps it and copies from it into its own pool — once from a mapping that is
   not page-locked (the old reader), once from :meth:`SlabArena.attach` (registered per
   mapping). Both ranks measure at the same time.

Prints JSON lines (last line a summary) and writes them to ``--out``/gpu_load_race.json::

    PYTHONPATH=. python3 benchmarks/gpu_load_race.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from s3kv.arena import SlabArena
from s3kv.config import S3KVConfig
from s3kv.connector.api import RequestData
from s3kv.connector.completion import CompletionBoard
from s3kv.connector.requests import request_view
from s3kv.connector.scheduler import SchedulerCore
from s3kv.connector.shared import ShardStores
from s3kv.connector.worker import WorkerCore
from s3kv.keys import ModelIdentity, chain_hashes
from s3kv.pool import IOPool
from s3kv.staging import TorchPinnedAllocator
from s3kv.storage import MemoryBackend
from s3kv.store import KVStore

TPB = 32
LAYERS = 32
KV_HEADS = 8
HEAD_DIM = 128
BLOCK_ELEMS = KV_HEADS * TPB * HEAD_DIM  # an 8B-shaped block: 4 MiB in bf16
BLOCK_BYTES = LAYERS * 2 * BLOCK_ELEMS * 2


class Request:
    """The request attributes the scheduler reads."""

    def __init__(self, request_id: int, tokens: list[int]) -> None:
        self.request_id = request_id
        self.tokens = tokens
        self.prompt_len = len(tokens)
        self.lora_task_id = None
        self.cache_salt_id = None
        self.multimodal_hashes = None

    def get_tokens(self, beam: int) -> list[int]:
        return list(self.tokens)


def emit(rows: list[dict[str, Any]], **row: Any) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)


def race(blocks: int, policy: str, seed: int) -> dict[str, Any]:
    """One claim of ``blocks`` blocks, recycled right after enqueue under ``policy``."""
    identity = ModelIdentity(
        model_id="race", weights_revision="r", dtype="bfloat16", kv_dtype="bfloat16",
        quantization="none", tokens_per_block=TPB, kv_factor=2, block_elems=BLOCK_ELEMS,
        num_layers=LAYERS, layout="trtllm-v1/TRTLLM", tp_size=1, tp_rank=0,
    )  # fmt: skip
    config = S3KVConfig.load(
        environ={}, bucket="race", codec="raw", staging_bytes=blocks * BLOCK_BYTES,
        manifest_refresh_interval=0, warm_start_bytes=0,
    )  # fmt: skip
    store = KVStore.open(
        config, identity, backend=MemoryBackend(), allocator=TorchPinnedAllocator(),
        pool=IOPool(0), start_background=False,
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(0, 32000, size=blocks * TPB + 1)]
    keys = chain_hashes(tokens, TPB)
    expected = torch.empty((blocks, BLOCK_BYTES), dtype=torch.uint8)
    expected.view(torch.int32).copy_(torch.randint(-(2**31), 2**31 - 1, (blocks, BLOCK_BYTES // 4)))
    for i, key in enumerate(keys):
        buffer = store.staging.allocate(BLOCK_BYTES)
        assert buffer is not None
        buffer[:] = expected[i].numpy()
        store.staging.insert(key, buffer)

    core = SchedulerCore(config, TPB)
    board = CompletionBoard.private()
    core.attach(ShardStores([store]), board=board, manager="v1")
    pool = torch.zeros((blocks + 1, LAYERS, 2, BLOCK_ELEMS), dtype=torch.bfloat16, device="cuda")
    worker = WorkerCore(0, store, pool, 64 * 1024**2, board=board)
    stream = torch.cuda.Stream()
    request = Request(1, tokens)
    claimed = core.get_num_new_matched_tokens(request_view(request), 0)
    block_ids = list(range(1, blocks + 1))  # block 0 never written: it guards the indexing
    core.update_state_after_alloc(request.request_id, [*block_ids, 0])
    meta = core.build_connector_meta([RequestData(1, tokens, [*block_ids, 0], 0, 1)], [])

    # Keep the stream busy so the copies queue behind real work, as behind a forward pass.
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with torch.cuda.stream(stream):
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
    enqueue_start = time.perf_counter()
    worker.start_load(meta, stream)
    enqueued_s = time.perf_counter() - enqueue_start

    # The next iteration on the host, before the device has caught up.
    if policy == "next_step":
        ShardStores([store]).unpin(keys)  # the old rule: release at the next step
        core._held.clear()
    core.build_connector_meta([], [])
    pending_after_step = worker.loads_in_flight
    recycled = 0
    for key in keys:
        if store.staging.remove(key):  # evicted: its buffer goes back to the free pool
            buffer = store.staging.allocate(BLOCK_BYTES)  # a prefetch takes it...
            assert buffer is not None
            buffer.fill(0xA5)  # ...and writes another block's bytes into it
            store.staging.release(buffer)
            recycled += 1
    recycle_s = time.perf_counter() - enqueue_start
    torch.cuda.synchronize()
    wrong = sum(
        int(not torch.equal(pool[b].view(-1).view(torch.uint8).cpu(), expected[b - 1]))
        for b in block_ids
    )
    worker.poll_loads()
    core.build_connector_meta([], [])
    result = {
        "check": "overlap_race", "policy": policy, "blocks": blocks,
        "load_mib": blocks * BLOCK_BYTES / 2**20, "claimed_tokens": claimed,
        "enqueue_ms": round(enqueued_s * 1e3, 2),
        "copies_pending_at_next_step": pending_after_step,
        "buffers_recycled_before_copy_done": recycled,
        "ms_from_enqueue_to_recycle": round(recycle_s * 1e3, 2),
        "wrong_blocks": wrong, "pins_held_after_completion": core.held_load_batches,
        "guard_block_untouched": bool(torch.count_nonzero(pool[0]) == 0),
    }  # fmt: skip
    store.close()
    del pool, a
    torch.cuda.empty_cache()
    return result


def _copy_bandwidth(view: np.ndarray, slot_bytes: int, rounds: int) -> float:
    """GB/s of non_blocking host→GPU copies of every slot of ``view``, timed with events."""
    slots = view.nbytes // slot_bytes
    dst = torch.empty((slots, slot_bytes), dtype=torch.uint8, device="cuda")
    source = torch.from_numpy(view[: slots * slot_bytes].reshape(slots, slot_bytes))
    for _ in range(2):  # warm-up
        dst.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        for s in range(slots):
            dst[s].copy_(source[s], non_blocking=True)
    end.record()
    end.synchronize()
    return rounds * slots * slot_bytes / (start.elapsed_time(end) / 1e3) / 1e9


def _reader(path: str, slot_bytes: int, rounds: int, barrier: Any, queue: Any) -> None:
    """Rank 1: copy from rank 0's arena, first through a plain mapping, then through attach."""
    import os

    torch.cuda.init()
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    plain = np.frombuffer(mmap.mmap(fd, size, access=mmap.ACCESS_READ), dtype=np.uint8)
    barrier.wait()
    unpinned = _copy_bandwidth(plain, slot_bytes, rounds)
    arena = SlabArena.attach(path, slot_bytes)
    barrier.wait()
    pinned = _copy_bandwidth(arena._array, slot_bytes, rounds)
    queue.put({"rank": 1, "unpinned_gbps": unpinned, "pinned_gbps": pinned,
               "registered": arena.pinned})  # fmt: skip


def arena_bandwidth(mib: int, rounds: int) -> dict[str, Any]:
    """Both ranks copy from their shard's arena at the same time (two processes, one GPU)."""
    slot_bytes = BLOCK_BYTES
    budget = mib * 2**20
    own = SlabArena.create(slot_bytes, budget, tag="r0-")
    other = SlabArena.create(slot_bytes, budget, tag="r1-")
    for arena in (own, other):
        arena._array[:] = np.random.default_rng(0).integers(0, 255, arena._array.size, np.uint8)
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    reader = ctx.Process(target=_reader, args=(other.path, slot_bytes, rounds, barrier, queue))
    reader.start()
    barrier.wait()
    owner_first = _copy_bandwidth(own._array, slot_bytes, rounds)
    barrier.wait()
    owner_second = _copy_bandwidth(own._array, slot_bytes, rounds)
    rank1 = queue.get(timeout=300)
    reader.join(timeout=60)
    return {
        "check": "tp_arena_bandwidth", "arena_mib": mib, "rounds": rounds,
        "rank0_owner_registered": own.pinned,
        "rank0_gbps_during_rank1_unpinned": round(owner_first, 2),
        "rank0_gbps_during_rank1_pinned": round(owner_second, 2),
        "rank1_before_fix_gbps": round(rank1["unpinned_gbps"], 2),
        "rank1_after_fix_gbps": round(rank1["pinned_gbps"], 2),
        "rank1_registered": rank1["registered"],
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--sizes", default="100,1000", help="blocks per claim (4 MiB each)")
    parser.add_argument("--arena-mib", type=int, default=1024)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    emit(rows, check="device", name=torch.cuda.get_device_name(0))
    ok = True
    for blocks in (int(s) for s in args.sizes.split(",")):
        for policy in ("next_step", "completion"):
            row = race(blocks, policy, seed=blocks)
            emit(rows, **row)
            if policy == "completion":
                ok = ok and row["wrong_blocks"] == 0 and row["pins_held_after_completion"] == 0
    emit(rows, **arena_bandwidth(args.arena_mib, rounds=3))
    emit(rows, check="summary", completion_policy_correct=ok)
    Path(args.out, "gpu_load_race.json").write_text("\n".join(json.dumps(r) for r in rows))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
