"""Manifest startup cost and the scheduler's lookup, on an in-memory backend. JSON lines.

* ``manifest.startup_requests_1m`` / ``_10k``: requests ``Manifest.open`` issues for a
  manifest holding 1M / 10k keys (a compacted snapshot plus 2 newer segments). Equal values
  show that startup does not grow with the key count.
* ``manifest.startup_ms_1m`` / ``_10k``: median wall time of ``Manifest.open`` (Bloom filter
  sized for the key count at 1e-6: 3.6 MB for 1M). The backend is in memory, so this is the
  client-side cost (decode + verify); add one round trip per request for a real bucket.
* ``manifest.startup_ms_10m_filter``: the same for a 10M-key filter (36 MB).
* ``lookup.us_32k_tokens``: median µs of ``Manifest.count_leading`` over a 1000-key chain
  (32K tokens at 32 tokens per block), all present (the worst case), against a filter
  holding 10M keys at 1e-6, built with ``add_many``.
* ``lookup.requests``: requests issued during those lookups (must be 0).

Usage: ``python benchmarks/bench_manifest.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from s3kv.config import S3KVConfig
from s3kv.connector.completion import CompletionBoard
from s3kv.connector.requests import RequestView
from s3kv.connector.scheduler import SchedulerCore
from s3kv.connector.shared import ShardStores
from s3kv.keys import ROOT_HASH, BlockHash, chain_hashes, manifest_prefix
from s3kv.manifest import (
    CompactionPolicy,
    Compactor,
    LogEntry,
    Manifest,
    ManifestIO,
    ManifestLog,
    compact,
)
from s3kv.manifest.format import (
    KIND_WRITE,
    RECORD_DTYPE,
    USAGE_DTYPE,
    encode_records,
    segment_name,
)
from s3kv.manifest.snapshot import write_snapshot
from s3kv.pool import IOPool
from s3kv.staging import NumpyAllocator
from s3kv.storage import Backend, DelegatingBackend, DeleteResult, MemoryBackend, ObjectInfo
from s3kv.store import KVStore

PREFIX, FP = "bench", "fp-bench"
FPR = 1e-6
T0 = 1_700_000_000.0
CHAIN_BLOCKS = 1000  # 32K tokens at 32 tokens per block
SEGMENT_RECORDS = 100_000


def emit(metric: str, value: float, unit: str, **extra: Any) -> None:
    print(json.dumps({"metric": metric, "value": round(value, 3), "unit": unit, **extra}))
    sys.stdout.flush()


class CountingBackend(DelegatingBackend):
    """Delegates to ``inner`` and counts every request."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.requests = 0

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        self.requests += 1
        return self.inner.get(key, max_bytes=max_bytes)

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        self.requests += 1
        return self.inner.put(key, data, if_absent=if_absent)

    def head(self, key: str) -> ObjectInfo | None:
        self.requests += 1
        return self.inner.head(key)

    def delete_many(self, keys: Iterable[str]) -> DeleteResult:
        self.requests += 1
        return self.inner.delete_many(keys)

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        self.requests += 1
        return self.inner.list(prefix, start_after=start_after)


def put_segment(backend: Backend, keys: np.ndarray, time_s: float, seq: int) -> None:
    records = np.zeros(len(keys), RECORD_DTYPE)
    records["key"], records["parent"], records["time"] = keys, ROOT_HASH, time_s
    records["size"], records["kind"], records["count"] = 4 << 20, KIND_WRITE, 1
    name = segment_name(round(time_s * 1000), "bench", seq)
    backend.put(manifest_prefix(PREFIX, FP) + "segments/" + name, encode_records(records))


def build_manifest(n_keys: int, rng: np.random.Generator) -> tuple[MemoryBackend, np.ndarray]:
    """A bucket whose manifest holds ``n_keys`` in a snapshot plus 2 newer small deltas."""
    backend = MemoryBackend()
    keys = np.frombuffer(rng.bytes(16 * (n_keys + 200)), dtype="V16")
    for seq, start in enumerate(range(0, n_keys, SEGMENT_RECORDS)):
        put_segment(backend, keys[start : min(n_keys, start + SEGMENT_RECORDS)], T0, seq)
    report = compact(backend, PREFIX, FP, fpr=FPR, clock=lambda: T0 + 1)
    assert report.keys == n_keys, report
    # Two engine compaction cycles since the snapshot: the entry names two deltas.
    io = ManifestIO(backend, PREFIX, FP)
    compactor = Compactor(io, "bench", CompactionPolicy(snapshot_records=10**9))
    entry = compactor.take_over(ManifestLog(io).latest())
    for seq, (start, end) in enumerate([(n_keys, n_keys + 100), (n_keys + 100, n_keys + 200)]):
        assert entry is not None
        put_segment(backend, keys[start:end], T0 + 2 + seq, 10_000 + seq)
        entry = compactor.cycle(entry).entry
    return backend, keys


def bench_startup(label: str, n_keys: int, repeats: int, rng: np.random.Generator) -> None:
    backend, keys = build_manifest(n_keys, rng)
    counting = CountingBackend(backend)
    times = []
    requests = set()
    for _ in range(repeats):
        before = counting.requests
        started = time.perf_counter()
        manifest = Manifest.open(counting, PREFIX, FP, capacity=n_keys, fpr=FPR,
                                 clock=lambda: T0 + 4)  # fmt: skip
        times.append(time.perf_counter() - started)
        requests.add(counting.requests - before)
        assert manifest.open_requests == counting.requests - before
    sample = [bytes(k) for k in keys[:: max(1, len(keys) // 1000)]]
    assert manifest.count_leading(sample) == len(sample), "startup lost keys"
    assert len(requests) == 1, requests
    emit(f"manifest.startup_requests_{label}", requests.pop(), "requests", keys=n_keys)
    emit(f"manifest.startup_ms_{label}", statistics.median(times) * 1e3, "ms", keys=n_keys,
         bloom_mb=round(manifest.stats()["bloom_bytes"] / 1e6, 2))  # fmt: skip


def publish_10m_snapshot(rng: np.random.Generator, chain: list[bytes]) -> MemoryBackend:
    """A bucket whose log names a 10M-key snapshot (two xor-filter shards), chain included."""
    rows = np.zeros(10_000_000 + len(chain), USAGE_DTYPE)
    rows["key"][:10_000_000] = np.frombuffer(rng.bytes(16 * 10_000_000), dtype="V16")
    rows["key"][10_000_000:] = np.frombuffer(b"".join(chain), dtype="V16")
    backend = MemoryBackend()
    io = ManifestIO(backend, PREFIX, FP)
    ref, _ = write_snapshot(io, None, np.zeros(0, RECORD_DTYPE), path="snapshots/bench",
                            generation=1, shard_keys=8_000_000, fp_bits=24, created_at=T0,
                            base_rows=rows)  # fmt: skip
    ManifestLog(io).append(LogEntry(1, "", "bench", 60.0, ref, created_at=T0))
    return backend


def bench_lookup(lookups: int, rng: np.random.Generator) -> None:
    chain = [bytes(k) for k in np.frombuffer(rng.bytes(16 * CHAIN_BLOCKS), dtype="V16")]
    started = time.perf_counter()
    backend = publish_10m_snapshot(rng, chain)
    build_s = time.perf_counter() - started
    counting = CountingBackend(backend)
    started = time.perf_counter()
    manifest = Manifest.open(counting, PREFIX, FP, capacity=1_000_000, fpr=FPR)
    open_ms = (time.perf_counter() - started) * 1e3
    emit("manifest.startup_ms_10m_filter", open_ms, "ms",
         filter_mb=round(manifest.stats()["bloom_bytes"] / 1e6, 1),
         requests=manifest.open_requests)  # fmt: skip

    before = counting.requests
    assert manifest.count_leading(chain) == CHAIN_BLOCKS
    times = []
    for _ in range(lookups):
        t0 = time.perf_counter()
        manifest.count_leading(chain)
        times.append(time.perf_counter() - t0)
    absent = [bytes(16), *chain[1:]]
    absent_times = []
    for _ in range(max(50, lookups // 4)):
        t0 = time.perf_counter()
        manifest.count_leading(absent)
        absent_times.append(time.perf_counter() - t0)
    single = []
    for key in chain[:200]:
        t0 = time.perf_counter()
        manifest.may_contain(key)
        single.append(time.perf_counter() - t0)
    times_us = np.array(times) * 1e6
    emit("lookup.manifest_us_32k_tokens", float(np.median(times_us)), "us", blocks=CHAIN_BLOCKS,
         filter_keys=10_000_000, fpr=FPR, p90_us=round(float(np.percentile(times_us, 90)), 1),
         first_absent_us=round(statistics.median(absent_times) * 1e6, 1),
         single_key_us=round(statistics.median(single) * 1e6, 2),
         filter_build_s=round(build_s, 1), lookups=lookups)  # fmt: skip
    store_lookup(manifest, counting, chain, lookups)
    emit("lookup.requests", counting.requests - before, "requests", lookups=lookups)


def store_lookup(manifest: Manifest, backend: Backend, chain: list[bytes], lookups: int) -> None:
    """``KVStore.lookup`` (staging, then the Bloom filter) and the scheduler's whole claim.

    ``lookup.us_32k_tokens`` is the store's answer for a 32K-token prompt whose 1000 blocks
    are all in the manifest and none staged (the Bloom filter does all the work);
    ``lookup.staged_us_32k_tokens`` the same with all 1000 staged; ``lookup.claim_us_32k_tokens``
    is the path production takes for that prompt: ``SchedulerCore.get_num_new_matched_tokens``
    (chained SHA-256 hashing of the 32K token ids, then ``ShardStores.claim`` ->
    ``KVStore.claim`` pinning the staged run).
    """
    config = S3KVConfig.load(environ={}, bucket="bench", manifest_refresh_interval=0)
    store = KVStore(backend=backend, manifest=manifest, fingerprint=FP, config=config,
                    allocator=NumpyAllocator(), pool=IOPool(0))  # fmt: skip
    keys = [BlockHash(k) for k in chain]

    def median_us(fn: Any) -> float:
        samples = []
        for _ in range(lookups):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples) * 1e6

    assert store.lookup(keys).maybe == CHAIN_BLOCKS
    emit("lookup.us_32k_tokens", median_us(lambda: store.lookup(keys)), "us",
         blocks=CHAIN_BLOCKS, filter_keys=10_000_000, staged=0)  # fmt: skip
    tokens = [int(t) for t in np.arange(32 * CHAIN_BLOCKS + 1, dtype=np.int64) % 49152]
    chain_keys = chain_hashes(tokens, 32)
    for key in chain_keys:
        buffer = store.staging.allocate(16)
        assert buffer is not None
        store.staging.insert(key, buffer)
    assert store.lookup(chain_keys).staged == CHAIN_BLOCKS
    emit("lookup.staged_us_32k_tokens", median_us(lambda: store.lookup(chain_keys)), "us",
         blocks=CHAIN_BLOCKS, staged=CHAIN_BLOCKS)  # fmt: skip
    # The path production takes: the adapter's request view, chained hashing, then
    # ShardStores.claim -> KVStore.claim (pin the staged run), all in memory.
    core = SchedulerCore(config, 32)
    core.attach(ShardStores([store]), board=CompletionBoard.private(), manager="v1")
    view = RequestView(1, tuple(tokens), {})

    def claim() -> None:
        assert core.get_num_new_matched_tokens(view, 0) == 32 * CHAIN_BLOCKS
        core.abandon(1)  # unpin, so every sample claims the same staged run

    emit("lookup.claim_us_32k_tokens", median_us(claim), "us", blocks=CHAIN_BLOCKS,
         note="SchedulerCore claim: chain hashing + KVStore.claim, all staged")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    rng = np.random.default_rng(2024)
    repeats = 3 if args.quick else 7
    bench_startup("10k", 10_000, repeats, rng)
    bench_startup("1m", 1_000_000, repeats, rng)
    bench_lookup(200 if args.quick else 1000, rng)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
