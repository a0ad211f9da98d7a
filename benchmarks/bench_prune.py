"""``s3kv prune`` planning: peak memory and time per key. JSON lines.

A fingerprint holds N blocks in chains of 32 (a compacted manifest snapshot plus one newer
segment), listed by a backend that makes each page of ``ObjectInfo`` on demand, so what is
measured is the planner's own memory, not the listing's. 70% of the chains were written
20 days before ``T0``, 30% at ``T0``; 1% of the old chains have their leaf pinned; 1% of the
manifest's keys have no object (prune forgets them) and 1% of the objects are not in the
manifest; 0.1% of the objects are not block keys.

* ``prune.plan_peak_bytes_per_key_<n>``: peak memory ``plan_prune`` allocates (tracemalloc,
  which counts numpy's buffers), divided by the number of manifest keys, at ``T0 + 1h`` with
  ``--older-than 7d`` (70% of the blocks go).
* ``prune.plan_peak_bytes_per_key_<n>_all_stale``: the same 30 days later: everything but
  the pinned chains goes, so the plan holds ~N objects to delete (the worst case).
* ``prune.load_usage_peak_bytes_per_key_<n>``: the peak of :func:`~s3kv.manifest.load_usage`
  alone (reading and folding the snapshot and the segment), the first step of planning.
* ``prune.planner_peak_bytes_per_key_<n>[_all_stale]``: the peak of planning after that
  step (``load_usage`` returns rows loaded beforehand), beyond the rows themselves (61
  bytes a key): what the listing, the decisions and the plan cost.
* ``prune.plan_s_<n>``: wall time of ``plan_prune`` (no tracemalloc), median of 3.

Usage: ``python benchmarks/bench_prune.py [--quick] [--keys N] [--baseline PATH]``.
``--quick`` uses 200k keys instead of 1M. ``--baseline`` measures the ``plan_prune`` of
another copy of ``s3kv/ops/prune.py`` (``git show HEAD:s3kv/ops/prune.py > /tmp/old.py``)
and tags its lines ``"impl": "baseline"``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import numpy as np

from s3kv.keys import ROOT_HASH
from s3kv.manifest import compact, load_usage
from s3kv.manifest.format import KIND_PIN, KIND_WRITE, RECORD_DTYPE, encode_records, segment_name
from s3kv.ops import prune
from s3kv.ops import scope as ops_scope
from s3kv.ops.scope import Fingerprint, blocks_prefix
from s3kv.storage import Backend, DelegatingBackend, MemoryBackend, ObjectInfo

PREFIX = "bench"
FP = "0123456789abcdef0123456789abcdef"
T0 = 1_700_000_000.0
DAY = 86400.0
WEEK = 7 * DAY
CHAIN = 32
BLOCK_BYTES = 4 << 20
SEGMENT_RECORDS = 200_000
PAGE = 1000  # objects per listing page, as S3's ListObjectsV2


def emit(metric: str, value: float, unit: str, **extra: Any) -> None:
    print(json.dumps({"metric": metric, "value": round(value, 3), "unit": unit, **extra}))
    sys.stdout.flush()


class ListedBackend(DelegatingBackend):
    """The manifest from ``inner``; the blocks listing made page by page from arrays."""

    def __init__(
        self,
        inner: Backend,
        blocks: np.ndarray,
        sizes: np.ndarray,
        modified: np.ndarray,
        foreign: int,
    ) -> None:
        super().__init__(inner)
        order = np.argsort(blocks.view(">u8").reshape(-1, 2)[:, 0], kind="stable")
        self.blocks, self.sizes, self.modified = blocks[order], sizes[order], modified[order]
        self.foreign = foreign
        self.head = blocks_prefix(PREFIX, FP)

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        if prefix != self.head:
            return self.inner.list(prefix, start_after=start_after)
        return self._pages()

    def _pages(self) -> Iterator[ObjectInfo]:
        head = self.head
        for start in range(0, len(self.blocks), PAGE):
            stop = start + PAGE
            rows = zip(
                self.blocks[start:stop].tolist(),
                self.sizes[start:stop].tolist(),
                self.modified[start:stop].tolist(),
                strict=True,
            )
            for block, size, modified in rows:
                hex_hash = block.hex()
                yield ObjectInfo(f"{head}{hex_hash[:2]}/{hex_hash}", size, modified)
        for i in range(self.foreign):  # after every hex shard directory: "zz" > "ff"
            yield ObjectInfo(f"{head}zz/foreign-{i:08d}", 100, T0 - 30 * DAY)


def put_records(backend: Backend, records: np.ndarray, seq: int) -> None:
    name = segment_name(round(float(records["time"].max()) * 1000), "bench", seq)
    key = f"{PREFIX}/{FP}/manifest/segments/{name}"
    backend.put(key, encode_records(records))


def build(n_keys: int, rng: np.random.Generator) -> ListedBackend:
    """The bucket described in the module docstring."""
    inner = MemoryBackend()
    keys = np.frombuffer(rng.bytes(16 * n_keys), "V16")
    chains = n_keys // CHAIN
    old_chain = rng.random(chains) < 0.7
    written = np.where(np.repeat(old_chain, CHAIN), T0 - 20 * DAY, T0)
    parents = np.empty(n_keys, "V16")
    parents[:] = np.void(ROOT_HASH)
    position = np.arange(n_keys) % CHAIN
    parents[position > 0] = keys[np.flatnonzero(position > 0) - 1]
    records = np.zeros(n_keys, RECORD_DTYPE)
    records["key"], records["parent"], records["time"] = keys, parents, written
    records["size"], records["kind"], records["count"] = BLOCK_BYTES, KIND_WRITE, 1
    for seq, start in enumerate(range(0, n_keys, SEGMENT_RECORDS)):
        put_records(inner, records[start : start + SEGMENT_RECORDS], seq)
    report = compact(inner, PREFIX, FP, fpr=1e-6, clock=lambda: T0 + 1)
    assert report.keys == n_keys, report
    leaves = np.flatnonzero(old_chain & (rng.random(chains) < 0.01)) * CHAIN + CHAIN - 1
    pins = np.zeros(len(leaves), RECORD_DTYPE)
    pins["key"], pins["time"], pins["kind"], pins["count"] = keys[leaves], T0 + 2, KIND_PIN, 1
    put_records(inner, pins, 10_000)  # newer than the snapshot: load_usage folds it

    listed = rng.random(n_keys) >= 0.01  # 1% of the manifest's keys have no object
    extra = n_keys // 100  # objects the manifest does not know
    blocks = np.concatenate([keys[listed], np.frombuffer(rng.bytes(16 * extra), "V16")])
    modified = np.concatenate([written[listed], rng.choice([T0 - 20 * DAY, T0], extra)])
    sizes = np.full(len(blocks), BLOCK_BYTES, np.uint64)
    return ListedBackend(inner, blocks, sizes, modified, foreign=n_keys // 1000)


def peak(fn: Callable[[], Any]) -> tuple[int, Any]:
    """Peak bytes ``fn`` allocates (tracemalloc: Python objects and numpy buffers)."""
    gc.collect()
    tracemalloc.start()
    try:
        result = fn()
        return tracemalloc.get_traced_memory()[1], result
    finally:
        tracemalloc.stop()


def load_prune(path: str | None) -> ModuleType:
    """``s3kv.ops.prune``, or the copy of it at ``path``."""
    if path is None:
        return prune
    spec = importlib.util.spec_from_file_location("baseline_prune", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="200k keys instead of 1M")
    parser.add_argument("--keys", type=int, help="manifest keys (overrides --quick)")
    parser.add_argument("--baseline", help="measure the plan_prune of this prune.py copy")
    args = parser.parse_args()
    n_keys = args.keys or (200_000 if args.quick else 1_000_000)
    label = f"{n_keys // 1_000_000}m" if n_keys % 1_000_000 == 0 else f"{n_keys // 1000}k"
    tags = {"impl": "baseline"} if args.baseline else {}
    module = load_prune(args.baseline)
    backend = build(n_keys, np.random.default_rng(2024))
    scope = [Fingerprint(FP)]

    def plan(now: float) -> Any:
        return module.plan_prune(backend, PREFIX, scope, older_than=WEEK, clock=lambda: now)

    usage_peak, usage = peak(lambda: load_usage(backend, PREFIX, FP))
    emit(f"prune.load_usage_peak_bytes_per_key_{label}", usage_peak / n_keys, "bytes/key",
         keys=n_keys, peak_mb=round(usage_peak / 2**20, 1), **tags)  # fmt: skip
    for suffix, now in (("", T0 + 3600), ("_all_stale", T0 + 30 * DAY)):
        plan_peak, result = peak(lambda now=now: plan(now))
        (fp_plan,) = result.fingerprints
        emit(f"prune.plan_peak_bytes_per_key_{label}{suffix}", plan_peak / n_keys, "bytes/key",
             keys=n_keys, objects=len(backend.blocks) + backend.foreign,
             delete=fp_plan.to_delete.objects, forget=len(fp_plan.forget),
             kept=result.kept.objects, peak_mb=round(plan_peak / 2**20, 1), **tags)  # fmt: skip
        del result, fp_plan
        # The planner alone: the usage rows loaded beforehand (not counted: add 61 bytes/key).
        # NOTE: prune reads usage through s3kv.ops.scope (older copies: their own import).
        owner = module if hasattr(module, "load_usage") else ops_scope
        loader = owner.load_usage
        owner.load_usage = lambda *_, **__: usage
        try:
            own_peak, result = peak(lambda now=now: plan(now))
        finally:
            owner.load_usage = loader
        emit(f"prune.planner_peak_bytes_per_key_{label}{suffix}", own_peak / n_keys,
             "bytes/key", keys=n_keys, note="beyond the usage rows (61 bytes/key)",
             peak_mb=round(own_peak / 2**20, 1), **tags)  # fmt: skip
        del result
    times = []
    for _ in range(3):
        gc.collect()
        started = time.perf_counter()
        plan(T0 + 3600)
        times.append(time.perf_counter() - started)
    emit(f"prune.plan_s_{label}", statistics.median(times), "s", keys=n_keys, **tags)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
