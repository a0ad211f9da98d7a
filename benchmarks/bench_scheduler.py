"""The scheduler's claim for long prompts, the path production takes. JSON lines.

``SchedulerCore.get_num_new_matched_tokens`` runs under TensorRT-LLM's block manager lock while
every TP rank waits. Each case builds a fresh store (real ``IOPool`` of 8 threads, in-memory
bucket: every prefetch GET is a miss) over one live ``Manifest`` whose filter says "maybe"
for the prompt's blocks, with nothing staged, and asks for a new request:

* ``scheduler.claim_cold_ms``: the first call for a request (median over samples).
* ``scheduler.claim_repeated_ms``: the engine asks again for a request it did not schedule
  (the next iteration; the first call's prefetches are still in flight).

Context fields: ``tokens`` (8K/32K/128K), ``tokens_per_block`` (32, 64), ``maybe`` (``all``:
the whole prompt is Bloom-positive, the worst case; ``half``: its first half). At 128K two
more cases: ``device_half`` (the device matched the first half; the rest is Bloom-positive)
and ``staged`` (every block staged: the claim pins them all, no prefetch). ``hash_ms``,
``lookup_ms`` (staging and filter), ``queue_ms`` (handing prefetches to the I/O pool) and
``other_ms`` break one call down: a separate sample with timers around those functions on
the calling thread (exclusive time; what the I/O threads do meanwhile is not counted).
``scheduler.request_view_ms``: the adapter's ``request_view`` for the prompt (also on the
engine's path, before the core is called).

``scheduler.cold_prompt_first_iteration_us``: what a cold prompt (nothing in the bucket)
costs the engine's thread before its first forward pass, through the adapter's path:
``request_view`` of an emulated request binding, the claim, ``update_state_after_alloc`` and
the first ``build_connector_meta`` (``view_us``, ``claim_us``, ``alloc_us``, ``meta_us``; 8,152
tokens, 32 per block; median over samples). ``cache`` says whether the CPU caches were first
evicted (a 64 MiB pass, as the previous iteration's host work does) or not.

``scheduler.young_collections_ms``: what ten young garbage collections cost while the
scheduler holds one cold 8,152-token prompt's state (``held``: ``none``, no request;
``planned``, after its first metadata; ``packed``, after ``after_forward``, as once its
forward pass is queued); the collections are driven by allocating containers, as an engine
iteration does. A prompt's tokens in a list cost every collection that finds it young a pass.

``scheduler.decode_step_us``: ``build_connector_meta`` in steady decode, every request of a
batch (``batch`` 1, 64, 256; 1K-token prompts, saved) reported with one new token a step, as
TensorRT-LLM reports running requests; median over 200 steps, and ``per_request_us``.

Usage: ``python benchmarks/bench_scheduler.py [--quick]``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

import s3kv.connector.scheduler as scheduler_module
import s3kv.keys as keys_module
from s3kv.config import S3KVConfig
from s3kv.connector.completion import CompletionBoard
from s3kv.connector.requests import RequestView, request_view
from s3kv.connector.scheduler import SchedulerCore
from s3kv.connector.shared import ShardStores
from s3kv.keys import ROOT_HASH, BlockHash, chain_hashes
from s3kv.manifest import Manifest
from s3kv.pool import IOPool
from s3kv.staging import NumpyAllocator, StagingCache
from s3kv.storage import MemoryBackend
from s3kv.store import KVStore

PREFIX, FP = "bench", "fp-bench"
IO_THREADS = 8


def emit(metric: str, value: float, unit: str, **extra: Any) -> None:
    print(json.dumps({"metric": metric, "value": round(value, 3), "unit": unit, **extra}))
    sys.stdout.flush()


class SharedManifest:
    """The one live manifest every sample's store reads; a store's close leaves it open."""

    def __init__(self, inner: Manifest) -> None:
        self.inner = inner

    def may_contain(self, key: bytes) -> bool:
        return self.inner.may_contain(key)

    def count_leading(self, keys: Sequence[bytes]) -> int:
        return self.inner.count_leading(keys)

    def record_write(self, key: BlockHash, parent: BlockHash, size: int) -> None:
        self.inner.record_write(key, parent, size)

    def record_writes(self, writes: Sequence[tuple[BlockHash, BlockHash, int]]) -> None:
        self.inner.record_writes(writes)

    def record_hits(self, keys: Sequence[BlockHash]) -> None:
        """Not recorded: the samples claim the same blocks again and again."""

    def flush(self) -> int:
        return 0

    def close(self, flush: bool = True, timeout: float | None = None) -> None:
        """Left open for the next sample."""

    def stats(self) -> dict[str, float]:
        return {}


class Profile:
    """Exclusive wall time per phase of functions called on one thread."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []  # child time accumulated per open frame

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self.thread:
                return fn(*args, **kwargs)
            self._stack.append(0.0)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                children = self._stack.pop()
                self.seconds[phase] += elapsed - children
                if self._stack:
                    self._stack[-1] += elapsed

        return timed


#: (owner, attribute, phase) timed by :func:`profiled`; attributes an owner lacks are skipped.
TIMED: list[tuple[Any, str, str]] = [
    (keys_module, "chain_hashes", "hash"),
    (scheduler_module, "chain_hashes", "hash"),
    (getattr(keys_module, "KeyChain", None), "_hash", "hash"),
    (StagingCache, "pin_leading", "lookup"),
    (StagingCache, "count_leading", "lookup"),
    (SharedManifest, "count_leading", "lookup"),
    (KVStore, "prefetch", "queue"),
    (KVStore, "prefetch_many", "queue"),
    (IOPool, "submit", "queue"),
]


@contextmanager
def profiled() -> Iterator[Profile]:
    profile = Profile()
    present = [(owner, name, phase) for owner, name, phase in TIMED if hasattr(owner, name)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in present]
    try:
        for owner, name, phase in present:
            setattr(owner, name, profile.wrap(phase, getattr(owner, name)))
        yield profile
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


class Case:
    """One prompt, its manifest and a fresh store plus scheduler per sample."""

    def __init__(self, n_tokens: int, tpb: int, maybe: str, rng: np.random.Generator) -> None:
        self.n_tokens, self.tpb, self.maybe = n_tokens, tpb, maybe
        tokens = rng.integers(0, 128_000, size=n_tokens + 1)  # +1: the last block is claimable
        self.view = RequestView(1, tuple(int(t) for t in tokens), {})
        self.keys = chain_hashes(self.view.prompt, tpb)
        self.device = len(self.keys) // 2 * tpb if maybe == "device_half" else 0
        manifest = Manifest.open(MemoryBackend(), PREFIX, FP, capacity=1_000_000, fpr=1e-6)
        positive = self.keys[: len(self.keys) // 2] if maybe == "half" else self.keys
        parent = ROOT_HASH
        for key in positive:
            manifest.record_write(key, parent, 1)
            parent = key
        self.manifest = SharedManifest(manifest)
        self.config = S3KVConfig.load(environ={}, bucket="bench", manifest_refresh_interval=0)

    def fresh(self) -> tuple[SchedulerCore, KVStore]:
        store = KVStore(backend=MemoryBackend(), manifest=self.manifest, fingerprint=FP,
                        config=self.config, allocator=NumpyAllocator(),
                        pool=IOPool(IO_THREADS))  # fmt: skip
        if self.maybe == "staged":
            for key in self.keys:
                buffer = store.staging.allocate(16)
                assert buffer is not None
                store.staging.insert(key, buffer)
        core = SchedulerCore(self.config, self.tpb)
        core.attach(ShardStores([store]), board=CompletionBoard.private(), manager="v1")
        return core, store

    def sample(self) -> tuple[float, float]:
        """(cold, repeated) seconds of one request's claim on a fresh store."""
        core, store = self.fresh()
        try:
            gc.collect()  # NOTE: the setup's garbage is not the claim's cost
            t0 = time.perf_counter()
            cold_tokens = core.get_num_new_matched_tokens(self.view, self.device)
            t1 = time.perf_counter()
            repeated_tokens = core.get_num_new_matched_tokens(self.view, self.device)
            t2 = time.perf_counter()
            expected = self.n_tokens - self.device if self.maybe == "staged" else 0
            assert cold_tokens == repeated_tokens == expected, (cold_tokens, repeated_tokens)
            core.request_finished(self.view.request_id)
            store.start_held_walks()  # NOTE: what wait_for_save does after the forward pass
        finally:
            store.close()  # drains the prefetches (misses) before the next sample
        return t1 - t0, t2 - t1

    def breakdown(self) -> tuple[dict[str, float], dict[str, float]]:
        """Per-phase ms of one cold and one repeated call, timers on."""
        core, store = self.fresh()
        try:
            out = []
            for _ in range(2):
                gc.collect()
                with profiled() as profile:
                    t0 = time.perf_counter()
                    core.get_num_new_matched_tokens(self.view, self.device)
                    total = time.perf_counter() - t0
                phases = {f"{k}_ms": v * 1e3 for k, v in profile.seconds.items()}
                phases["other_ms"] = total * 1e3 - sum(phases.values())
                out.append({k: round(v, 3) for k, v in phases.items()})
            core.request_finished(self.view.request_id)
        finally:
            store.close()
        return out[0], out[1]


def run_case(n_tokens: int, tpb: int, maybe: str, samples: int, rng: np.random.Generator) -> None:
    case = Case(n_tokens, tpb, maybe, rng)
    cold, repeated = zip(*(case.sample() for _ in range(samples)), strict=True)
    phases_cold, phases_repeated = case.breakdown()
    context = {"tokens": n_tokens, "tokens_per_block": tpb, "blocks": len(case.keys),
               "maybe": maybe, "samples": samples}  # fmt: skip
    for metric, times, phases in (
        ("scheduler.claim_cold_ms", cold, phases_cold),
        ("scheduler.claim_repeated_ms", repeated, phases_repeated),
    ):
        ms = np.array(times) * 1e3
        emit(metric, float(np.median(ms)), "ms", **context,
             p90_ms=round(float(np.percentile(ms, 90)), 3), **phases)  # fmt: skip


class BindingRequest:
    """What ``request_view`` reads of TensorRT-LLM's request binding (tokens as a list)."""

    def __init__(self, tokens: list[int], request_id: int = 1) -> None:
        self.request_id = request_id
        self.prompt_len = len(tokens)
        self._tokens = tokens

    def get_tokens(self, beam: int) -> list[int]:
        return list(self._tokens)


def bench_request_view(n_tokens: int, samples: int) -> None:
    request = BindingRequest([int(t) for t in np.arange(n_tokens) % 128_000])
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        request_view(request)
        times.append(time.perf_counter() - t0)
    emit("scheduler.request_view_ms", statistics.median(times) * 1e3, "ms", tokens=n_tokens,
         note="adapter: RequestView from the binding (get_tokens copy included)")  # fmt: skip


#: A cold prompt's tokens (SmolLM2's 8K case in gpu_ab.py) and tokens per block.
COLD_TOKENS, COLD_TPB = 8152, 32


def cold_request(request_id: int, rng: np.random.Generator) -> Any:
    """An emulated request binding with a fresh random prompt of :data:`COLD_TOKENS`."""
    from s3kv.testing.emulator.request import LlmRequest

    tokens = [int(t) for t in rng.integers(0, 128_000, size=COLD_TOKENS)]
    return LlmRequest(request_id, tokens, 16)


def first_report(request: Any) -> tuple[list[int], Any]:
    """The request's blocks and its first report, as the engine builds it."""
    from s3kv.connector.api import RequestData

    blocks = list(range(COLD_TOKENS // COLD_TPB + 1))
    return blocks, RequestData(request.request_id, request.get_tokens(0), blocks, 0, COLD_TOKENS)


def bench_cold_first_iteration(samples: int, evict: bool, rng: np.random.Generator) -> None:
    """A cold prompt's claim and first metadata, through the adapter's path (see above)."""
    case = Case(COLD_TOKENS, COLD_TPB, "none", rng)
    sweep = np.ones(64 << 20, dtype=np.uint8) if evict else None
    parts: dict[str, list[float]] = defaultdict(list)
    for i in range(samples):
        request = cold_request(i, rng)
        core, store = case.fresh()
        try:
            gc.collect()
            if sweep is not None:
                sweep += 1  # NOTE: evicts the caches, as an iteration's other host work does
            t0 = time.perf_counter()
            view = request_view(request)
            t1 = time.perf_counter()
            core.get_num_new_matched_tokens(view, 0)
            t2 = time.perf_counter()
            blocks, report = first_report(request)  # NOTE: the engine's, not timed
            t3 = time.perf_counter()
            core.update_state_after_alloc(i, blocks)
            t4 = time.perf_counter()
            meta = core.build_connector_meta([report], [])
            t5 = time.perf_counter()
            assert len(meta.saves) == COLD_TOKENS // COLD_TPB, len(meta.saves)
            for name, seconds in (("view_us", t1 - t0), ("claim_us", t2 - t1),
                                  ("alloc_us", t4 - t3), ("meta_us", t5 - t4)):  # fmt: skip
                parts[name].append(seconds * 1e6)
            parts["total"].append((t2 - t0 + t5 - t3) * 1e6)
            store.start_held_walks()
        finally:
            store.close()
    medians = {name: round(statistics.median(values), 1) for name, values in parts.items()}
    emit("scheduler.cold_prompt_first_iteration_us", medians.pop("total"), "us",
         tokens=COLD_TOKENS, tokens_per_block=COLD_TPB, samples=samples,
         cache="evicted" if evict else "warm", **medians)  # fmt: skip


def bench_young_collections(samples: int, rng: np.random.Generator) -> None:
    """Ten young collections with a cold prompt's scheduler state held (see above)."""
    case = Case(COLD_TOKENS, COLD_TPB, "none", rng)
    spent: list[float] = []

    def timer(phase: str, info: dict[str, Any]) -> None:
        spent.append(time.perf_counter() if phase == "start" else -time.perf_counter())

    results: dict[str, list[float]] = defaultdict(list)
    gc.callbacks.append(timer)
    try:
        for i in range(samples):
            for held in ("none", "planned", "packed"):
                request = cold_request(i, rng)
                core, store = case.fresh()
                try:
                    gc.collect()  # NOTE: before, not after: the state below must be young
                    spent.clear()
                    if held != "none":
                        core.get_num_new_matched_tokens(request_view(request), 0)
                        blocks, report = first_report(request)
                        core.update_state_after_alloc(i, blocks)
                        meta = core.build_connector_meta([report], [])
                        del report
                        if held == "packed":
                            core.after_forward()
                    del request
                    churn = [[k] for k in range(7_000)]  # NOTE: ten young collections' worth
                    results[held].append(-sum(spent) * 1e3)
                    del churn
                    if held != "none":
                        core.request_finished(i)
                        del meta
                    store.start_held_walks()
                finally:
                    store.close()
    finally:
        gc.callbacks.remove(timer)
    for held, values in results.items():
        emit("scheduler.young_collections_ms", round(statistics.median(values), 3), "ms",
             held=held, tokens=COLD_TOKENS, samples=samples)  # fmt: skip


def bench_decode_steps(batch: int, steps: int, rng: np.random.Generator) -> None:
    """Steady decode: ``batch`` requests whose prompts were planned, one token a step."""
    from s3kv.connector.api import RequestData

    tpb, prompt_tokens = 32, 1025
    config = S3KVConfig.load(environ={}, bucket="bench", manifest_refresh_interval=0)
    manifest = Manifest.open(MemoryBackend(), PREFIX, FP, capacity=1_000_000, fpr=1e-6)
    store = KVStore(backend=MemoryBackend(), manifest=manifest, fingerprint=FP, config=config,
                    allocator=NumpyAllocator(), pool=IOPool(0))  # fmt: skip
    core = SchedulerCore(config, tpb)
    core.attach(ShardStores([store]), board=CompletionBoard.private(), manager="v1")
    first = []
    for rid in range(batch):
        tokens = tuple(int(t) for t in rng.integers(0, 128_000, size=prompt_tokens))
        core.get_num_new_matched_tokens(RequestView(rid, tokens, {}), 0)
        blocks = list(range(rid * 40, rid * 40 + prompt_tokens // tpb + 1))
        core.update_state_after_alloc(rid, blocks)
        first.append(RequestData(rid, list(tokens), blocks, 0, prompt_tokens))
    core.build_connector_meta(first, [])
    seconds = []
    for step in range(steps):
        reports = [RequestData(rid, [7], [], prompt_tokens + step, 1) for rid in range(batch)]
        started = time.perf_counter()
        core.build_connector_meta([], reports)
        seconds.append(time.perf_counter() - started)
    median = statistics.median(seconds) * 1e6
    emit("scheduler.decode_step_us", median, "us", batch=batch, steps=steps,
         per_request_us=round(median / batch, 3), prompt_tokens=prompt_tokens,
         tokens_per_block=tpb)  # fmt: skip
    store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    args = parser.parse_args()
    rng = np.random.default_rng(2024)
    samples = 3 if args.quick else 15
    for n_tokens in (8192, 32768, 131072):
        for tpb in (32, 64):
            for maybe in ("all", "half"):
                run_case(n_tokens, tpb, maybe, samples, rng)
    for maybe in ("device_half", "staged"):
        for tpb in (32, 64):
            run_case(131072, tpb, maybe, samples, rng)
    bench_request_view(131072, samples)
    for evict in (False, True):
        bench_cold_first_iteration(20 if args.quick else 200, evict, rng)
    bench_young_collections(5 if args.quick else 30, rng)
    for batch in (1, 64, 256):
        bench_decode_steps(batch, 50 if args.quick else 200, rng)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
