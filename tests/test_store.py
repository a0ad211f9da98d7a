"""The store engine on the in-memory backend: lookup, prefetch, save, bounds, failures."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from s3kv import store as store_module
from s3kv.config import S3KVConfig
from s3kv.errors import EndpointError
from s3kv.keys import ROOT_HASH, BlockHash, KeyChain, ModelIdentity, chain_hashes
from s3kv.pool import IOPool
from s3kv.staging import NumpyAllocator
from s3kv.storage import MemoryBackend
from s3kv.store import KVStore, SaveStatus

SHAPE = (2, 2, 4, 1, 8)  # layers, kv, tokens, heads, head_dim
BLOCK_ELEMS = 4 * 1 * 8


def identity() -> ModelIdentity:
    return ModelIdentity(
        model_id="test/model",
        weights_revision="r1",
        dtype="bfloat16",
        kv_dtype="bfloat16",
        quantization="none",
        tokens_per_block=4,
        kv_factor=2,
        block_elems=BLOCK_ELEMS,
        num_layers=2,
        layout="test",
    )


def blocks(n: int, seed: int = 0) -> list[np.ndarray]:  # type: ignore[type-arg]
    rng = np.random.default_rng(seed)
    values = rng.normal(0, 1, size=(n, *SHAPE)).astype(np.float32)
    return [b.view(np.uint32).__rshift__(16).astype(np.uint16) for b in values]


def config(**changes: object) -> S3KVConfig:
    base = {"bucket": "test", "manifest_refresh_interval": 0, "io_threads": 1}
    base.update(changes)
    return S3KVConfig.load(environ={}, **base)


def open_store(
    backend: MemoryBackend, *, threads: int = 0, pool: IOPool | None = None, **changes: object
) -> KVStore:
    return KVStore.open(
        config(**changes),
        identity(),
        backend=backend,
        allocator=NumpyAllocator(),
        pool=pool if pool is not None else IOPool(threads),
        start_background=False,
    )


def save_chain(store: KVStore, keys: list[BlockHash], data: list[np.ndarray]) -> None:  # type: ignore[type-arg]
    parent = ROOT_HASH
    for key, block in zip(keys, data, strict=True):
        assert store.save(key, parent, block, dtype="bfloat16", shape=SHAPE) is SaveStatus.QUEUED
        parent = key
    assert store.flush(timeout=10)


@pytest.fixture
def backend() -> MemoryBackend:
    return MemoryBackend()


@pytest.fixture
def chain() -> list[BlockHash]:
    return chain_hashes(list(range(40)), 4)


def test_second_instance_finds_stages_and_reads_identical_bytes(
    backend: MemoryBackend, chain: list[BlockHash]
) -> None:
    # Instance A saves a chain of 10 blocks and closes.
    data = blocks(10)
    writer = open_store(backend)
    save_chain(writer, chain, data)
    writer.close()
    # Instance B knows nothing but the bucket: the manifest says "maybe", nothing is staged.
    reader = open_store(backend)
    assert reader.lookup(chain).staged == 0
    assert reader.lookup(chain).maybe == 10
    # Prefetch stages every block (inline pool); now lookup claims them all.
    assert reader.prefetch(chain) == 10
    assert reader.wait_staged(chain, timeout=5) == 10
    assert reader.lookup(chain).staged == 10
    for key, block in zip(chain, data, strict=True):
        staged = reader.staged(key)
        assert staged is not None
        assert staged.tobytes() == block.tobytes()
    assert reader.metrics.value("prefetch_staged") == 10


def test_lookup_makes_no_requests(backend: MemoryBackend, chain: list[BlockHash]) -> None:
    store = open_store(backend)
    save_chain(store, chain, blocks(10))
    before = store.backend.requests()
    for _ in range(100):
        store.lookup(chain)
    assert store.backend.requests() == before


def test_lookup_counts_only_the_leading_run(backend: MemoryBackend, chain: list[BlockHash]) -> None:
    store = open_store(backend)
    save_chain(store, chain[:3], blocks(3))
    other = chain_hashes(list(range(100, 140)), 4)
    assert store.lookup(chain).maybe == 3
    assert store.lookup(other).maybe == 0
    assert store.lookup([]).staged == 0


def test_corrupt_object_is_a_counted_miss(backend: MemoryBackend, chain: list[BlockHash]) -> None:
    store = open_store(backend)
    save_chain(store, chain[:2], blocks(2))
    key = store.object_key(chain[1])
    blob = bytearray(backend.get(key) or b"")
    blob[-1] ^= 0xFF
    backend.put(key, bytes(blob))
    reader = open_store(backend)
    reader.prefetch(chain[:2])
    assert reader.lookup(chain[:2]).staged == 1
    assert reader.metrics.value("corrupt_objects", kind="checksum") == 1
    assert reader.metrics.value("prefetch_failed") == 1


def test_object_under_the_wrong_key_is_rejected(
    backend: MemoryBackend, chain: list[BlockHash]
) -> None:
    store = open_store(backend)
    save_chain(store, chain[:1], blocks(1))
    # Someone copies block 0's object to block 1's key: the key digest in the header catches it.
    backend.put(store.object_key(chain[1]), backend.get(store.object_key(chain[0])) or b"")
    store.prefetch(chain[1:2])
    assert chain[1] not in store.staging
    assert store.metrics.value("corrupt_objects", kind="key_mismatch") == 1


def test_pruned_object_is_not_found(backend: MemoryBackend, chain: list[BlockHash]) -> None:
    store = open_store(backend)
    save_chain(store, chain[:2], blocks(2))
    backend.delete_many([store.object_key(chain[0])])
    reader = open_store(backend)
    assert reader.lookup(chain[:2]).maybe == 2, "the manifest still advertises it"
    reader.prefetch(chain[:2])
    assert reader.lookup(chain[:2]).staged == 0
    assert reader.metrics.value("prefetch_not_found") == 1


def test_existing_keys_are_not_written_twice(
    backend: MemoryBackend, chain: list[BlockHash]
) -> None:
    store = open_store(backend)
    data = blocks(2)
    save_chain(store, chain[:2], data)
    puts = store.backend.metrics.value("requests", op="put")
    again = store.save(chain[0], ROOT_HASH, data[0], dtype="bfloat16", shape=SHAPE)
    assert again is SaveStatus.SKIPPED
    assert store.backend.metrics.value("requests", op="put") == puts


class GatedPool(IOPool):
    """Holds every task until released, to observe in-flight bounds."""

    def __init__(self) -> None:
        super().__init__(0)
        self.tasks: list[object] = []

    def submit_many(self, priority: object, tasks: object) -> bool:  # type: ignore[override]
        self.tasks.extend(tasks)  # type: ignore[call-overload]  # NOTE: submit comes here too
        return True

    def run_all(self) -> None:
        while self.tasks:
            self.tasks.pop(0)()  # type: ignore[operator]


def prefetching_reader(backend: MemoryBackend, chain: list[BlockHash]) -> tuple[KVStore, GatedPool]:
    """``chain`` (10 blocks) saved, and a new store's prefetch of it queued, not yet run."""
    writer = open_store(backend)
    save_chain(writer, chain, blocks(10))
    writer.close()
    pool = GatedPool()
    reader = open_store(backend, pool=pool)
    assert reader.prefetch(chain) == 10
    return reader, pool


def test_one_wait_for_many_keys_ends_when_the_last_of_them_does(
    backend: MemoryBackend, chain: list[BlockHash], monkeypatch: pytest.MonkeyPatch
) -> None:
    reader, pool = prefetching_reader(backend, chain)
    assert len(pool.tasks) == 10  # NOTE: one fetch per key, none run yet
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(reader.wait_staged(chain, timeout=20)))
    events: list[threading.Event] = []
    real_event = threading.Event

    def counted() -> threading.Event:
        event = real_event()
        if threading.current_thread() is waiter:
            events.append(event)
        return event

    monkeypatch.setattr(threading, "Event", counted)  # NOTE: after the thread's own event
    waiter.start()
    assert wait_until(lambda: len(reader._waiters) == 10)
    tasks, pool.tasks = pool.tasks, []
    for task in reversed(tasks[1:]):  # NOTE: out of order; the first key's fetch last
        task()  # type: ignore[operator]
    waiter.join(0.1)
    assert waiter.is_alive(), "one key is still being fetched"
    tasks[0]()  # type: ignore[operator]
    waiter.join(10)
    assert got == [10]
    assert not reader._waiters
    assert len(events) == 1, "one event for the whole wait, not one per key"


def test_a_wait_that_times_out_leaves_nothing_registered_once_its_keys_end(
    backend: MemoryBackend, chain: list[BlockHash]
) -> None:
    reader, pool = prefetching_reader(backend, chain)
    assert reader.wait_staged(chain, timeout=0.05) == 0
    assert reader.wait_staged([], timeout=0.05) == 0
    pool.run_all()
    assert reader.wait_staged(chain, timeout=1) == 10
    assert not reader._waiters


def test_save_back_pressure_drops_and_counts(
    backend: MemoryBackend, chain: list[BlockHash]
) -> None:
    data = blocks(3)
    pool = GatedPool()
    store = KVStore.open(
        config(max_inflight_save_bytes=2 * data[0].nbytes),
        identity(),
        backend=backend,
        allocator=NumpyAllocator(),
        pool=pool,
        start_background=False,
    )
    statuses = [
        store.save(k, ROOT_HASH, b, dtype="bfloat16", shape=SHAPE)
        for k, b in zip(chain, data, strict=False)
    ]
    assert statuses == [SaveStatus.QUEUED, SaveStatus.QUEUED, SaveStatus.DROPPED]
    assert store.metrics.value("save_dropped") == 1
    # A duplicate of an in-flight save is skipped, not queued twice.
    assert store.save(chain[0], ROOT_HASH, data[0], dtype="bfloat16", shape=SHAPE) is (
        SaveStatus.SKIPPED
    )
    pool.run_all()
    assert store.metrics.value("save_completed") == 2
    assert store.metrics.value("inflight_save_bytes") == 0


def test_block_policy_waits_then_drops(backend: MemoryBackend, chain: list[BlockHash]) -> None:
    data = blocks(2)
    pool = GatedPool()
    store = KVStore.open(
        config(max_inflight_save_bytes=data[0].nbytes, save_policy="block",
               save_block_timeout=0.05),
        identity(),
        backend=backend,
        allocator=NumpyAllocator(),
        pool=pool,
        start_background=False,
    )  # fmt: skip
    assert store.save(chain[0], ROOT_HASH, data[0], dtype="bfloat16", shape=SHAPE) is (
        SaveStatus.QUEUED
    )
    done = threading.Timer(0.01, pool.run_all)
    done.start()
    # The first save completes while the second waits: the second is admitted.
    assert store.save(chain[1], chain[0], data[1], dtype="bfloat16", shape=SHAPE) is (
        SaveStatus.QUEUED
    )
    done.join()
    pool.run_all()
    assert store.metrics.value("save_completed") == 2


class FlakyBackend(MemoryBackend):
    def __init__(self) -> None:
        super().__init__()
        self.broken = False

    def _check(self) -> None:
        if self.broken:
            raise EndpointError("connection refused (test)")

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        self._check()
        return super().get(key, max_bytes=max_bytes)

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        self._check()
        return super().put(key, data, if_absent=if_absent)

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator:  # type: ignore[type-arg]
        self._check()
        return super().list(prefix, start_after=start_after)


def test_storage_outage_never_raises(chain: list[BlockHash]) -> None:
    backend = FlakyBackend()
    store = open_store(backend)
    save_chain(store, chain[:2], blocks(2))
    backend.broken = True
    data = blocks(2, seed=1)
    other = chain_hashes(list(range(500, 508)), 4)
    assert store.save(other[0], ROOT_HASH, data[0], dtype="bfloat16", shape=SHAPE) is (
        SaveStatus.QUEUED
    )
    assert store.metrics.value("save_failed") == 1
    assert store.lookup(chain[:2]).maybe == 2, "lookup still answers from memory"
    store.prefetch(chain[:1])
    assert store.metrics.value("prefetch_failed") == 1
    assert store.metrics.value("request_errors", op="get", kind="endpoint") == 1
    store.flush(timeout=1)
    store.close(timeout=1)


def test_close_drains_threaded_saves(backend: MemoryBackend, chain: list[BlockHash]) -> None:
    store = open_store(backend, threads=2)
    data = blocks(10)
    parent = ROOT_HASH
    for key, block in zip(chain, data, strict=True):
        store.save(key, parent, block, dtype="bfloat16", shape=SHAPE)
        parent = key
    assert store.close(timeout=30)
    assert store.metrics.value("save_completed") == 10
    assert store.save(chain[0], ROOT_HASH, data[0], dtype="bfloat16", shape=SHAPE) is (
        SaveStatus.DROPPED
    )
    reader = open_store(backend)
    assert reader.lookup(chain).maybe == 10


def test_on_consumed_is_always_called(backend: MemoryBackend, chain: list[BlockHash]) -> None:
    store = open_store(backend)
    calls: list[int] = []
    data = blocks(1)[0]
    store.save(chain[0], ROOT_HASH, data, dtype="bfloat16", shape=SHAPE,
               on_consumed=lambda: calls.append(1))  # fmt: skip
    store.save(chain[0], ROOT_HASH, data, dtype="bfloat16", shape=SHAPE,
               on_consumed=lambda: calls.append(2))  # fmt: skip
    assert calls == [1, 2]


def test_staging_budget_bounds_prefetch(backend: MemoryBackend, chain: list[BlockHash]) -> None:
    data = blocks(10)
    writer = open_store(backend)
    save_chain(writer, chain, data)
    reader = open_store(backend, staging_bytes=3 * data[0].nbytes)
    assert reader.pin_leading(chain) == 0
    reader.prefetch(chain[:3])
    assert reader.pin_leading(chain[:3]) == 3
    reader.prefetch(chain[3:6])
    assert reader.metrics.value("prefetch_no_room") == 3, "pinned blocks are never evicted"
    reader.unpin(chain[:3])
    reader.prefetch(chain[3:6])
    assert reader.lookup(chain[3:6]).staged == 3
    assert reader.staging.used_bytes <= 3 * data[0].nbytes


def test_prefetch_queue_is_bounded(backend: MemoryBackend, chain: list[BlockHash]) -> None:
    pool = GatedPool()
    store = open_store(backend, pool=pool, max_prefetch_queue=4)
    assert store.prefetch(chain) == 4
    assert store.metrics.value("prefetch_dropped") == 6
    assert store.prefetch(chain[:4]) == 0, "already in flight"
    pool.run_all()


def test_hits_reach_the_manifest(backend: MemoryBackend, chain: list[BlockHash]) -> None:
    store = open_store(backend)
    save_chain(store, chain[:2], blocks(2))
    store.record_hits(chain[:2])
    assert store.manifest.pending_records >= 2
    store.flush()
    assert store.manifest.pending_records == 0


def test_breaker_opens_then_recovers(chain: list[BlockHash]) -> None:
    from s3kv.storage import BreakerState

    backend = FlakyBackend()
    store = open_store(backend, breaker_failures=2, breaker_cooldown=0.0)
    breaker = store.backend.breaker
    assert breaker is not None
    breaker._clock = lambda: 0.0  # type: ignore[method-assign]  # frozen time: stays open
    breaker.cooldown = 10.0
    backend.broken = True
    store.prefetch(chain[:2])
    assert breaker.state is BreakerState.OPEN
    assert not store.healthy
    # Open: no request is even attempted; saves drop, prefetches are skipped.
    requests = store.backend.requests()
    assert store.save(chain[5], ROOT_HASH, blocks(1)[0], dtype="bfloat16", shape=SHAPE) is (
        SaveStatus.DROPPED
    )
    assert store.prefetch(chain[:3]) == 0
    assert store.backend.requests() == requests
    # After the cooldown one probe goes through; the bucket is back, so the circuit closes.
    backend.broken = False
    breaker._clock = lambda: 100.0  # type: ignore[method-assign]
    assert breaker.state is BreakerState.HALF_OPEN
    # Asking whether the store is healthy starts one probe (inline here); it closes the circuit.
    assert not store.healthy
    assert breaker.state is BreakerState.CLOSED
    assert store.healthy


# --- prefetch_many: the scheduler's tail, handed to the I/O side in one step ---


def test_prefetch_many_hands_the_keys_over_in_one_step(
    backend: MemoryBackend, chain: list[BlockHash]
) -> None:
    save_chain(open_store(backend), chain, blocks(10))
    pool = GatedPool()
    store = open_store(backend, pool=pool)
    requests = store.backend.requests()
    assert store.prefetch_many(chain) == 10
    # One task queued and nothing else done on the caller's thread: no GET, no admission.
    assert len(pool.tasks) == 1
    assert store.backend.requests() == requests
    assert store.metrics.value("prefetch_scheduled") == 0
    pool.run_all()  # the walk, then the fetches it queued
    assert store.lookup(chain).staged == 10
    assert store.metrics.value("prefetch_scheduled") == 10


def test_prefetch_many_stages_every_key_on_real_threads(
    backend: MemoryBackend, chain: list[BlockHash]
) -> None:
    save_chain(open_store(backend), chain, blocks(10))
    store = open_store(backend, threads=2)
    try:
        assert store.prefetch_many(chain, maybe_only=True) == 10
        assert wait_until(lambda: store.lookup(chain).staged == 10), "all keys staged"
    finally:
        store.close()


def test_prefetch_many_maybe_only_stops_at_the_first_unknown_block(
    backend: MemoryBackend, chain: list[BlockHash]
) -> None:
    save_chain(open_store(backend), chain[:3], blocks(3))
    store = open_store(backend)
    store.prefetch_many(chain, maybe_only=True)  # inline pool: walked at once
    assert store.metrics.value("prefetch_scheduled") == 3
    assert store.lookup(chain).staged == 3


def test_held_walks_wait_outside_the_queue_bound_and_a_burst_starts_them(
    chain: list[BlockHash],
) -> None:
    pool = GatedPool()
    store = open_store(MemoryBackend(), pool=pool)
    for i in range(32):
        assert store.prefetch_many(chain, hold=i) == 10
    assert (store.held_walks, len(pool.tasks)) == (32, 0)
    assert store.start_held_walks(before=2) == 2, "tags 0 and 1 only"
    assert (store.held_walks, len(pool.tasks)) == (30, 2)
    for i in range(3):  # NOTE: past 32 held, every held walk starts (a burst of claims)
        store.prefetch_many(chain, hold=100 + i)
    assert store.held_walks == 0
    assert len(pool.tasks) == 35
    assert store.metrics.value("prefetch_dropped") == 0


def test_held_walks_are_dropped_at_close_and_never_start(chain: list[BlockHash]) -> None:
    pool = GatedPool()
    store = open_store(MemoryBackend(), pool=pool)
    store.prefetch_many(chain, hold=1)
    store.close()
    assert store.held_walks == 0
    assert store.start_held_walks() == 0
    assert store.prefetch_many(chain, hold=2) == 0
    assert pool.tasks == []


def test_prefetch_many_is_bounded_by_the_prefetch_queue(
    backend: MemoryBackend, chain: list[BlockHash]
) -> None:
    save_chain(open_store(backend), chain, blocks(10))
    pool = GatedPool()
    store = open_store(backend, pool=pool, max_prefetch_queue=4)
    assert store.prefetch_many(chain) == 10
    pool.tasks.pop(0)()  # the walk: at most 4 fetches outstanding, as prefetch()
    assert len(pool.tasks) == 4
    assert store.metrics.value("prefetch_dropped") == 6
    pool.run_all()
    assert store.lookup(chain).staged == 4


def test_prefetch_many_bounds_the_walks_waiting_to_start(chain: list[BlockHash]) -> None:
    pool = GatedPool()
    store = open_store(MemoryBackend(), pool=pool)
    accepted = [store.prefetch_many(chain) for _ in range(100)]
    assert accepted.count(10) == len(pool.tasks) < 100
    assert store.metrics.value("prefetch_dropped") == 10 * accepted.count(0)
    pool.run_all()  # walks started: room again
    assert store.prefetch_many(chain) == 10


def test_claim_hashes_a_lazy_chain_only_as_far_as_it_must(backend: MemoryBackend) -> None:
    tokens = list(range(4 * 1000))
    keys = chain_hashes(tokens, 4)
    save_chain(open_store(backend), keys[:3], blocks(3))
    pool = GatedPool()
    store = open_store(backend, pool=pool)
    lazy = KeyChain(tokens, 4)
    assert store.claim(lazy) == 0
    assert lazy.hashed <= KeyChain.STEP, "the claim hashed one step, not 1000 blocks"
    assert len(pool.tasks) == 1
    pool.run_all()  # the I/O side hashes as far as the manifest says "maybe", and fetches
    # NOTE: one hashing step, not a first filter query's worth of blocks: on a cold prompt
    # the walk would otherwise hash the prompt on an I/O thread while the engine's thread
    # plans the same request (they share the chain and the GIL).
    most = max(KeyChain.STEP, store_module._MAYBE_STEP)  # one lookup's chunk of keys
    assert lazy.hashed <= most, "the walk hashed past the run the manifest holds"
    assert store.lookup(keys).staged == 3
    assert store.claim(KeyChain(tokens, 4)) == 3


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    tick = threading.Event()
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        tick.wait(0.01)
    return True


def test_prefetch_many_queues_nothing_while_unhealthy(chain: list[BlockHash]) -> None:
    pool = GatedPool()
    store = open_store(MemoryBackend(), pool=pool)
    assert store.backend.breaker is not None
    for _ in range(store.config.breaker_failures):
        store.backend.breaker.record_failure()
    assert store.prefetch_many(chain, maybe_only=True) == 0
    assert pool.tasks == []
    assert store.metrics.value("prefetch_skipped_unhealthy") == 10


def test_prefetch_many_stops_quietly_at_a_malformed_token(
    backend: MemoryBackend, caplog: pytest.LogCaptureFixture
) -> None:
    tokens = list(range(4 * 100))
    tokens[4 * 80] = -1  # block 80 has no key; the hashing steps before its own do
    hashed, step = 0, KeyChain.STEP
    while hashed + step <= 80:  # NOTE: the lazy walk's steps double
        hashed, step = hashed + step, min(2 * step, KeyChain.MAX_STEP)
    store = open_store(backend)
    with caplog.at_level(logging.DEBUG, logger="s3kv"):
        assert store.prefetch_many(KeyChain(tokens, 4)) == 100
    assert 0 < hashed < 80
    assert store.metrics.value("prefetch_scheduled") == hashed
    assert "prefetch stopped" in caplog.text
    assert "background task failed" not in caplog.text


def test_a_shard_claim_that_fails_midway_leaves_no_pin(backend: MemoryBackend) -> None:
    from s3kv.connector.shared import ShardStores

    tokens = list(range(40))
    good = chain_hashes(tokens, 4)
    stores = [open_store(backend), open_store(MemoryBackend())]
    save_chain(stores[0], good, blocks(len(good)))
    save_chain(stores[1], good, blocks(len(good), seed=1))
    for store in stores:
        store.prefetch(good)
        assert store.wait_staged(good, timeout=10) == len(good)

    class Faulty(list[BlockHash]):
        """Keys whose hashing fails on the second shard's walk (a lazily hashed chain)."""

        calls = 0

        def __getitem__(self, index: object) -> object:
            if isinstance(index, int) and index == 5:
                Faulty.calls += 1
                if Faulty.calls > 1:
                    raise ValueError("malformed token")
            return super().__getitem__(index)  # type: ignore[index]

        def __iter__(self):  # type: ignore[no-untyped-def]
            return (self[i] for i in range(len(self)))

    with pytest.raises(ValueError, match="malformed"):
        ShardStores(stores).claim(Faulty(good))
    for store in stores:
        assert all(entry.pins == 0 for entry in store.staging._entries.values())


def test_save_many_on_the_io_threads_writes_each_admitted_block_once(
    backend: MemoryBackend, chain: list[BlockHash]
) -> None:
    store = open_store(backend, threads=2)
    data = blocks(10)
    save_chain(store, chain[:3], data[:3])
    consumed: list[int] = []
    batch = [
        (key, parent, block, lambda i=i: consumed.append(i))
        for i, (key, parent, block) in enumerate(
            zip(chain, [ROOT_HASH, *chain[:9]], data, strict=True)
        )
    ]
    statuses = store.save_many(batch, dtype="bfloat16", shape=SHAPE)
    assert statuses == [SaveStatus.SKIPPED] * 3 + [SaveStatus.QUEUED] * 7
    assert store.flush(timeout=10)
    assert sorted(consumed) == list(range(10))  # NOTE: skipped ones at once, the rest once encoded
    assert store.metrics.value("save_completed") == 10  # NOTE: 3 by save_chain, 7 here
    reader = open_store(backend)
    assert reader.prefetch(chain[:10]) == 10
    assert reader.wait_staged(chain[:10], timeout=5) == 10
    for key, block in zip(chain[:10], data, strict=True):
        staged = reader.staged(key)
        assert staged is not None
        assert staged.tobytes() == block.tobytes()


def test_save_many_after_the_io_threads_stopped_drops_and_hands_back_every_block(
    backend: MemoryBackend, chain: list[BlockHash]
) -> None:
    pool = IOPool(1)
    store = open_store(backend, pool=pool)
    pool.shutdown(timeout=5)
    consumed: list[int] = []
    batch = [
        (key, ROOT_HASH, block, lambda i=i: consumed.append(i))
        for i, (key, block) in enumerate(zip(chain[:4], blocks(4), strict=True))
    ]
    assert store.save_many(batch, dtype="bfloat16", shape=SHAPE) == [SaveStatus.DROPPED] * 4
    assert sorted(consumed) == [0, 1, 2, 3]
    assert store.flush(timeout=1)  # NOTE: nothing left in flight
    assert not [o for o in backend.list("") if "/blocks/" in o.key]


def test_save_many_under_the_block_policy_lets_each_block_wait_for_the_ones_before_it(
    backend: MemoryBackend, chain: list[BlockHash]
) -> None:
    store = open_store(
        backend, threads=2, save_policy="block", max_inflight_save_bytes=1024,
        save_block_timeout=5.0,
    )  # fmt: skip
    small = [np.full(128, i, np.uint16) for i in range(10)]  # NOTE: 256 bytes; room for 4
    batch = [(key, ROOT_HASH, block, None) for key, block in zip(chain[:10], small, strict=True)]
    statuses = store.save_many(batch, dtype="bfloat16", shape=(128,))
    assert statuses == [SaveStatus.QUEUED] * 10
    assert store.flush(timeout=10)
    assert store.metrics.value("save_completed") == 10
