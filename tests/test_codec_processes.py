"""Codec processes (``codec_processes``): real child processes, a real bucket, real faults.

Each test proves its path ran in the children where it matters: the store's own
``codec.encode``/``codec.decode`` are replaced by functions that fail, so a block that still
saves or stages was encoded or decoded by a codec process.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from s3kv import codec
from s3kv.arena import SlabArena
from s3kv.auth import new_key_line
from s3kv.config import S3KVConfig
from s3kv.errors import ConfigError
from s3kv.keys import ROOT_HASH, BlockHash, ModelIdentity
from s3kv.offload import CodecProcesses, affinity
from s3kv.quarantine import Quarantine
from s3kv.staging import NumpyAllocator
from s3kv.storage import CircuitBreaker, FileBackend
from s3kv.store import KVStore, SaveStatus

LAYERS, ELEMS = 2, 512  # one block: 2 layers x K,V x 512 bf16 = 4 KiB
NBYTES = LAYERS * 2 * ELEMS * 2
REAL_ENCODE = codec.encode  # NOTE: taken before any test replaces it


def identity() -> ModelIdentity:
    return ModelIdentity(
        model_id="test/codec-processes",
        weights_revision="r1",
        dtype="bfloat16",
        kv_dtype="bfloat16",
        quantization="none",
        tokens_per_block=4,
        kv_factor=2,
        block_elems=ELEMS,
        num_layers=LAYERS,
        layout="test",
    )


def block_bytes(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    values = rng.normal(0, 1, NBYTES // 2).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def keys(n: int, salt: int = 0) -> list[BlockHash]:
    return [BlockHash(bytes([salt, i % 256, i // 256]) * 5 + b"\x01") for i in range(n)]


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.fixture
def bucket(tmp_path: Path) -> Path:
    path = tmp_path / "bucket"
    path.mkdir()
    return path


def file_config(bucket: Path, **overrides: Any) -> S3KVConfig:
    settings: dict[str, Any] = {
        "endpoint_url": f"file://{bucket}",
        "codec_processes": 2,
        "io_threads": 2,
        "staging_bytes": 64 * NBYTES,
        "manifest_compaction": "off",
        **overrides,
    }
    return S3KVConfig(**settings)


@pytest.fixture
def no_local_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's process cannot encode or decode: only codec processes can."""

    def refuse(*args: object, **kwargs: object) -> Any:
        raise AssertionError("the codec ran in the store's process")

    monkeypatch.setattr("s3kv.store.codec.encode", refuse)
    monkeypatch.setattr("s3kv.store.codec.decode", refuse)


@pytest.fixture
def open_stores() -> Iterator[list[KVStore]]:
    stores: list[KVStore] = []
    yield stores
    for store in stores:
        store.close(timeout=10)


def open_store(config: S3KVConfig, stores: list[KVStore], **kwargs: Any) -> KVStore:
    store = KVStore.open(config, identity(), **kwargs)
    stores.append(store)
    return store


def save_blocks(store: KVStore, ids: list[BlockHash], *, salt: int = 0) -> list[int]:
    """Save one block per key from the store's save arena; returns the consumed count box."""
    arena = store.save_arena(NBYTES, len(ids) * NBYTES)
    assert arena is not None
    consumed = [0]

    def done() -> None:
        consumed[0] += 1

    blocks = []
    for i, key in enumerate(ids):
        slot = arena.allocate(NBYTES)
        slot[:] = block_bytes(salt + i)
        blocks.append((key, ROOT_HASH, slot, done))
    statuses = store.save_many(blocks, dtype="bfloat16", shape=(LAYERS, 2, ELEMS), checked=True)
    assert statuses == [SaveStatus.QUEUED] * len(ids)
    return consumed


def test_each_process_makes_its_share_of_the_requests_and_codes_on_at_most_two_threads(
    bucket: Path, open_stores: list[KVStore]
) -> None:
    # io_threads auto: 8 requests per process however few CPUs code; a number is the total.
    auto = open_store(file_config(bucket, io_threads="auto", codec_processes=3), open_stores)
    assert auto._offload is not None
    assert (auto._offload.threads, auto._offload.codec_threads) == (8, 2)
    total = open_store(file_config(bucket, io_threads=3), open_stores)
    assert total._offload is not None
    assert (total._offload.threads, total._offload.codec_threads) == (2, 2)
    one = open_store(file_config(bucket, io_threads=1, codec_processes=1), open_stores)
    assert one._offload is not None
    assert (one._offload.threads, one._offload.codec_threads) == (1, 1)


def test_blocks_round_trip_through_codec_processes(
    bucket: Path, no_local_codec: None, open_stores: list[KVStore]
) -> None:
    ids = keys(24)
    writer = open_store(file_config(bucket), open_stores)
    assert writer.stats()["codec_processes_alive"] == 2
    assert writer._offload is not None
    assert writer._offload.wait_ready(20) == 2
    consumed = save_blocks(writer, ids)
    assert writer.flush(timeout=20)
    assert consumed[0] == len(ids)
    stats = writer.stats()
    assert stats["save_completed"] == len(ids)
    assert stats['requests{op="put"}'] >= len(ids)
    assert stats["bytes_sent"] > 0

    reader = open_store(file_config(bucket), open_stores)
    assert isinstance(reader.staging._allocator, SlabArena)  # NOTE: the children decode there
    reader.prefetch(ids)
    assert reader.wait_staged(ids, timeout=20) == len(ids)
    for i, key in enumerate(ids):
        staged = reader.staged(key)
        assert staged is not None
        assert np.array_equal(staged, block_bytes(i))
    stats = reader.stats()
    assert stats["prefetch_staged"] == len(ids)
    assert stats['requests{op="get"}'] >= len(ids)
    assert stats["bytes_received"] > 0


def test_sealed_blocks_round_trip_and_unsealed_ones_are_refused(
    bucket: Path,
    no_local_codec: None,
    open_stores: list[KVStore],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("S3KV_TEST_KEYS", new_key_line("k1"))
    sealed = file_config(bucket, auth_keys="env:S3KV_TEST_KEYS")
    ids = keys(6)
    writer = open_store(sealed, open_stores)
    save_blocks(writer, ids)
    assert writer.flush(timeout=20)
    # An unsealed block planted under a key the reader will ask for.
    planted = keys(1, salt=9)[0]
    object_key = writer.object_key(planted)
    FileBackend(str(bucket)).put(
        object_key,
        REAL_ENCODE(block_bytes(99), key=object_key, dtype="bfloat16", shape=(LAYERS, 2, ELEMS)),
    )

    reader = open_store(sealed, open_stores)
    reader.prefetch([*ids, planted])
    assert reader.wait_staged(ids, timeout=20) == len(ids)
    assert wait_until(lambda: reader.stats().get("prefetch_failed", 0) == 1)
    assert not reader.is_staged(planted)
    assert reader.stats()['corrupt_objects{kind="unsigned"}'] == 1
    assert planted in reader.quarantine
    assert np.array_equal(reader.staged(ids[0]), block_bytes(0))  # type: ignore[arg-type]


def test_a_corrupt_object_is_a_counted_miss_and_quarantined(
    bucket: Path, no_local_codec: None, open_stores: list[KVStore]
) -> None:
    ids = keys(4)
    writer = open_store(file_config(bucket), open_stores)
    save_blocks(writer, ids)
    assert writer.flush(timeout=20)
    path = bucket / writer.object_key(ids[2])
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))

    reader = open_store(file_config(bucket), open_stores)
    reader.prefetch(ids)
    assert reader.wait_staged(ids[:2], timeout=20) == 2
    # NOTE: the fourth block may still be in flight when the third has failed.
    assert wait_until(
        lambda: (
            (reader.stats().get("prefetch_failed", 0), reader.stats().get("prefetch_staged"))
            == (1, 3)
        )
    )
    stats = reader.stats()
    assert sum(v for k, v in stats.items() if k.startswith("corrupt_objects")) == 1
    assert ids[2] in reader.quarantine
    assert not reader.is_staged(ids[2])


def test_a_killed_codec_process_fails_its_jobs_and_hands_slots_back_only_after_exit(
    bucket: Path, open_stores: list[KVStore]
) -> None:
    store = open_store(file_config(bucket, codec_processes=1), open_stores)
    offload = store._offload
    assert offload is not None
    (pid,) = offload.pids
    os.kill(pid, signal.SIGSTOP)  # NOTE: its jobs stay outstanding until it is killed
    arena = store.save_arena(NBYTES, 8 * NBYTES)
    assert arena is not None
    exited_at_release: list[bool] = []

    def released() -> None:
        exited_at_release.append(not os.path.exists(f"/proc/{pid}/status") or _is_zombie(pid))

    ids = keys(8)
    blocks = []
    for i, key in enumerate(ids):
        slot = arena.allocate(NBYTES)
        slot[:] = block_bytes(i)
        blocks.append((key, ROOT_HASH, slot, released))
    store.save_many(blocks, dtype="bfloat16", shape=(LAYERS, 2, ELEMS), checked=True)
    store.prefetch(keys(3, salt=5))  # NOTE: nothing there: each would be a miss
    assert wait_until(lambda: offload.outstanding == len(ids) + 3)
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: offload.alive == 0)
    assert store.flush(timeout=20)
    assert exited_at_release == [True] * len(ids)
    stats = store.stats()
    assert stats["save_failed"] == len(ids)
    assert wait_until(lambda: store.stats().get("prefetch_failed", 0) == 3)
    assert stats["codec_processes_alive"] == 0
    assert store.staging.used_bytes <= 3 * NBYTES  # NOTE: released slots, kept for reuse

    # Without processes the store does the work itself.
    consumed = save_blocks(store, keys(4, salt=7), salt=100)
    assert store.flush(timeout=20)
    assert consumed[0] == 4
    assert store.stats()["save_completed"] == 4
    fresh = open_store(file_config(bucket, codec_processes=0), open_stores)
    fresh.prefetch(keys(4, salt=7))
    assert fresh.wait_staged(keys(4, salt=7), timeout=20) == 4
    assert np.array_equal(fresh.staged(keys(4, salt=7)[3]), block_bytes(103))  # type: ignore[arg-type]


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return any(line.startswith("State:") and "Z" in line for line in fh)
    except OSError:
        return True


def test_a_process_that_cannot_start_is_logged_once_and_takes_no_jobs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = S3KVConfig(bucket="some-bucket", profile="s3kv-no-such-profile", region="us-east-1")
    caplog.set_level(logging.WARNING, logger="s3kv")
    processes = CodecProcesses(config, processes=1, threads=1)
    try:
        assert wait_until(lambda: processes.alive == 0)
        assert not processes.submit_batch(
            [__import__("s3kv.offload", fromlist=["FetchJob"]).FetchJob("k", "/nowhere", 1, 0, 1)],
            lambda pairs: None,
        )
    finally:
        processes.close(timeout=5)
    lines = [r.getMessage() for r in caplog.records if "codec process" in r.getMessage()]
    assert len(lines) == 1
    assert "failed to start" in lines[0]
    assert "profile" in lines[0]


def tripped_store(bucket: Path, open_stores: list[KVStore]) -> tuple[KVStore, CircuitBreaker]:
    """A store whose codec processes are set up and whose breaker has just opened."""
    store = ready_store(bucket, open_stores, breaker_failures=1, breaker_cooldown=0.05)
    breaker = store.backend.breaker
    assert breaker is not None
    breaker.record_failure()
    return store, breaker


def test_an_open_breaker_submits_nothing_and_a_failed_submit_returns_the_probe(
    bucket: Path, open_stores: list[KVStore]
) -> None:
    store, breaker = tripped_store(bucket, open_stores)
    assert not breaker.healthy
    blocks = [(keys(1)[0], ROOT_HASH, np.zeros(NBYTES, np.uint8), None)]
    assert store.save_many(blocks, dtype="bfloat16", shape=(LAYERS, 2, ELEMS)) == [
        SaveStatus.DROPPED
    ]
    assert store._offload.outstanding == 0
    # Half-open, and no process left to take the probe: it must be admitted again later.
    for pid in store._offload.pids:
        os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: store._offload is not None and store._offload.alive == 0)
    assert wait_until(lambda: breaker.state.value == "half_open")
    store.prefetch(keys(1, salt=3))  # NOTE: falls back to this process, which probes
    assert store.wait_staged(keys(1, salt=3), timeout=10) == 0
    assert breaker.healthy  # NOTE: the probe (a miss is an answer) closed it


def test_close_stops_every_process_and_an_injected_backend_keeps_threads(
    bucket: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = KVStore.open(file_config(bucket), identity())
    assert store._offload is not None
    pids = store._offload.pids
    consumed = save_blocks(store, keys(5))
    assert store.close(timeout=20)
    assert consumed[0] == 5
    assert store.stats()["save_completed"] == 5
    assert all(not os.path.exists(f"/proc/{pid}") for pid in pids)
    assert store.close(timeout=1)  # idempotent

    caplog.set_level(logging.WARNING, logger="s3kv")
    injected = KVStore.open(file_config(bucket), identity(), backend=FileBackend(str(bucket)))
    try:
        assert injected._offload is None
        assert injected.save_arena(NBYTES, NBYTES) is None
        assert any("given its backend" in r.getMessage() for r in caplog.records)
        injected.prefetch(keys(5))
        assert injected.wait_staged(keys(5), timeout=20) == 5
    finally:
        injected.close(timeout=10)


def test_only_whole_slots_of_a_store_arena_go_to_the_processes(
    bucket: Path, open_stores: list[KVStore]
) -> None:
    store = open_store(file_config(bucket), open_stores)
    arena = store.save_arena(NBYTES, 4 * NBYTES)
    assert arena is not None
    slot, other = arena.allocate(NBYTES), arena.allocate(NBYTES)
    for _ in range(2):  # NOTE: the second time from the store's table of views it has seen
        assert store._locate(slot) == (arena, arena.slot_of(slot))
        assert store._locate(other) == (arena, arena.slot_of(other))
    assert store._locate(arena.view(arena.slot_of(slot))) == (arena, arena.slot_of(slot))
    assert store._locate(slot[: NBYTES // 2]) is None
    assert store._locate(arena.view(0)[1:]) is None
    assert store._locate(np.zeros(NBYTES, np.uint8)) is None


def test_processes_started_while_the_bucket_is_down_work_once_it_answers(
    fault_proxy: Any, no_local_codec: None
) -> None:
    # NOTE: a degraded start (the connector's way): the bucket answers only 503 while the
    # store opens; its processes must not die of it (they opened their client with a probe).
    from s3kv.testing.faultproxy import Fault

    down = fault_proxy.add(Fault.error(503))
    config = fault_proxy.config(
        codec_processes=1,
        conditional_put="auto",
        startup_timeout=0.3,
        staging_bytes=16 * NBYTES,
        manifest_compaction="off",
    )
    store = KVStore.open(config, identity(), degraded_start=True)
    try:
        assert not store.ready
        assert store._offload is not None
        assert store._offload.wait_ready(20) == 1
        fault_proxy.remove(down)
        assert store.wait_ready(20)
        consumed = save_blocks(store, keys(3))
        assert store.flush(timeout=20)
        assert consumed[0] == 3
        assert store.stats()["save_completed"] == 3
        assert store._offload.alive == 1
    finally:
        store.close(timeout=10)


def test_a_strided_view_the_size_of_a_slot_is_not_taken_for_the_slot(
    bucket: Path, open_stores: list[KVStore]
) -> None:
    # NOTE: same start, same size, other element order: a process would save the slot's
    # memory order where the I/O threads save the view's elements.
    store = open_store(file_config(bucket), open_stores)
    arena = store.save_arena(NBYTES, 2 * NBYTES)
    assert arena is not None
    slot = arena.allocate(NBYTES)
    transposed = slot.reshape(64, -1).T
    assert transposed.nbytes == NBYTES
    assert store._locate(transposed) is None
    assert store._locate(slot) is not None


def test_a_batch_of_saves_is_handled_a_message_at_a_time_each_outcome_once(
    bucket: Path, open_stores: list[KVStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(file_config(bucket), open_stores)
    assert store._offload is not None
    assert store._offload.wait_ready(20) == 2
    calls: list[list[int]] = []
    real = KVStore._saves_done

    def spy(self: KVStore, batch: Any, indices: Any, outcomes: Any) -> None:
        assert len(indices) == len(outcomes)
        calls.append(list(indices))
        real(self, batch, indices, outcomes)

    monkeypatch.setattr(KVStore, "_saves_done", spy)
    ids = keys(63, salt=9)  # NOTE: not a multiple of the 2 processes: shares of 31 and 32
    consumed = save_blocks(store, ids)
    assert store.flush(timeout=20)
    assert consumed[0] == len(ids)
    delivered = sorted(i for call in calls for i in call)
    assert delivered == list(range(len(ids)))  # NOTE: every outcome once, none twice
    assert len(calls) < len(ids)  # NOTE: per message, not per block (was one call each)
    stats = store.stats()
    assert stats["save_completed"] == len(ids)
    assert stats["save_submitted"] == len(ids)
    assert stats["inflight_save_bytes"] == 0
    assert stats['requests{op="put"}'] >= len(ids)  # NOTE: and the manifest's own PUTs
    assert store.manifest.contains_many(ids).all()


def test_a_half_open_breaker_lets_one_save_of_a_batch_probe_and_fails_the_rest(
    bucket: Path, open_stores: list[KVStore]
) -> None:
    store, breaker = tripped_store(bucket, open_stores)
    assert wait_until(lambda: breaker.state.value == "half_open")
    ids = keys(4, salt=11)
    consumed = save_blocks(store, ids)
    assert store.flush(timeout=20)
    assert consumed[0] == len(ids)  # NOTE: refused saves hand their buffers back too
    stats = store.stats()
    assert stats["save_completed"] == 1
    assert stats["save_failed"] == 3
    assert stats['request_errors{kind="circuit_open",op="put"}'] == 3
    assert stats["inflight_save_bytes"] == 0
    assert breaker.healthy  # NOTE: the one admitted save was the probe, and it succeeded
    assert store.manifest.contains_many(ids).tolist() == [True, False, False, False]


def saved(bucket: Path, stores: list[KVStore], n: int, *, salt: int) -> list[BlockHash]:
    """``keys(n, salt)`` written to ``bucket`` (the i-th holds ``block_bytes(i)``)."""
    ids = keys(n, salt=salt)
    writer = open_store(file_config(bucket), stores)
    save_blocks(writer, ids)
    assert writer.flush(timeout=20)
    return ids


def ready_store(bucket: Path, stores: list[KVStore], **overrides: Any) -> KVStore:
    """A store on ``bucket`` whose two codec processes are set up."""
    store = open_store(file_config(bucket, **overrides), stores)
    assert store._offload is not None
    assert store._offload.wait_ready(20) == 2
    return store


def test_a_prefetch_goes_to_the_processes_in_batches_and_every_key_ends_once(
    bucket: Path, no_local_codec: None, open_stores: list[KVStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    saved(bucket, open_stores, 39, salt=12)
    ids = keys(40, salt=12)  # NOTE: the last key was never saved: a miss
    reader = ready_store(bucket, open_stores)
    reader.quarantine.add(ids[5])
    reader.quarantine.add(ids[20])
    batches: list[int] = []
    delivered: list[BlockHash] = []
    real_submit, real_done = CodecProcesses.submit_batch, KVStore._fetched_many

    def submitted(self: CodecProcesses, jobs: Any, done: Any) -> bool:
        batches.append(len(jobs))
        return real_submit(self, jobs, done)

    def ended(
        self: KVStore, keys: Any, names: Any, buffers: Any, indices: Any, outcomes: Any
    ) -> None:
        delivered.extend(keys[i] for i in indices)
        real_done(self, keys, names, buffers, indices, outcomes)

    monkeypatch.setattr(CodecProcesses, "submit_batch", submitted)
    monkeypatch.setattr(KVStore, "_fetched_many", ended)
    assert reader.prefetch(ids) == len(ids)
    assert reader.wait_staged(ids, timeout=20) == 5  # NOTE: the first quarantined key
    assert wait_until(lambda: len(delivered) == len(ids) - 2)
    assert batches == [15, 15, 8]  # NOTE: 16 keys a batch, the quarantined ones never sent
    assert sorted(delivered) == sorted(k for k in ids if k not in (ids[5], ids[20]))
    stats = reader.stats()
    assert stats["prefetch_scheduled"] == len(ids)
    assert stats["prefetch_staged"] == len(ids) - 3
    assert stats["prefetch_quarantined"] == 2
    assert stats["prefetch_not_found"] == 1
    assert stats['requests{op="get"}'] >= len(ids) - 2
    for i, key in enumerate(ids[:-1]):
        if key not in (ids[5], ids[20]):
            assert np.array_equal(reader.staged(key), block_bytes(i))  # type: ignore[arg-type]
    assert reader.wait_staged(ids[6:], timeout=1) == 14  # NOTE: nothing left to wait for
    assert len(reader.staging.allocate_many(NBYTES, 64)) == 64  # NOTE: no slot was leaked


def test_keys_without_room_end_at_once_counted_and_the_rest_stage(
    bucket: Path, open_stores: list[KVStore]
) -> None:
    ids = saved(bucket, open_stores, 10, salt=13)
    reader = open_store(file_config(bucket, staging_bytes=8 * NBYTES), open_stores)
    reader.prefetch(ids[:6])
    assert reader.wait_staged(ids[:6], timeout=20) == 6
    assert reader.pin_leading(ids[:6]) == 6  # NOTE: claimed: never evicted
    started = time.monotonic()
    assert reader.prefetch(ids[6:]) == 4
    assert reader.wait_staged(ids[6:], timeout=20) == 2
    assert time.monotonic() - started < 10  # NOTE: no waiter is left waiting
    assert reader.staging.count_leading(ids) == 8
    assert reader.stats()["prefetch_no_room"] == 2
    assert not reader._fetching


def test_a_half_open_breaker_lets_one_fetch_of_a_batch_probe_and_fails_the_rest(
    bucket: Path, open_stores: list[KVStore]
) -> None:
    ids = saved(bucket, open_stores, 4, salt=14)
    store, breaker = tripped_store(bucket, open_stores)
    assert wait_until(lambda: breaker.state.value == "half_open")
    store.prefetch(ids)
    assert store.wait_staged(ids, timeout=20) == 1  # NOTE: the probe, first in order
    stats = store.stats()
    assert stats["prefetch_staged"] == 1
    assert stats["prefetch_failed"] == 3
    assert stats['request_errors{kind="circuit_open",op="get"}'] == 3
    assert breaker.healthy  # NOTE: the probe succeeded
    assert not store._fetching
    assert len(store.staging.allocate_many(NBYTES, 64)) == 64  # NOTE: no slot was leaked


def test_one_reader_serves_every_process_while_one_hangs_and_after_it_dies(
    bucket: Path, open_stores: list[KVStore]
) -> None:
    ids = saved(bucket, open_stores, 16, salt=15)
    reader = ready_store(bucket, open_stores)
    offload = reader._offload
    assert offload is not None
    hung, alive = offload.pids
    os.kill(hung, signal.SIGSTOP)
    reader.prefetch(ids)
    # NOTE: a batch is spread over both processes: the live one's half stages meanwhile.
    assert wait_until(lambda: reader.stats().get("prefetch_staged", 0) == len(ids) // 2)
    assert offload.outstanding == len(ids) // 2
    os.kill(hung, signal.SIGKILL)
    assert wait_until(lambda: reader.stats().get("prefetch_failed", 0) == len(ids) // 2)
    assert offload.pids == [alive]
    assert not reader._fetching
    reader.prefetch(ids)  # NOTE: the failed half again, all to the survivor
    assert reader.wait_staged(ids, timeout=20) == len(ids)
    for i, key in enumerate(ids):
        assert np.array_equal(reader.staged(key), block_bytes(i))  # type: ignore[arg-type]


def test_a_quarantine_lifted_while_a_batch_is_handed_over_leaves_no_key_behind(
    bucket: Path, open_stores: list[KVStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = keys(3, salt=16)
    reader = ready_store(bucket, open_stores)
    asked: list[object] = []

    class Lifting(Quarantine[BlockHash]):
        """Quarantined when first asked, lifted after (as a save of the key would)."""

        def __contains__(self, key: object) -> bool:
            asked.append(key)
            return key == ids[1] and asked.count(key) == 1

    monkeypatch.setattr(reader, "quarantine", Lifting())
    reader.prefetch(ids)
    reader.wait_staged(ids, timeout=10)
    assert wait_until(lambda: not reader._fetching)  # NOTE: it was asked twice: stuck for good
    assert asked.count(ids[1]) == 1
    assert reader.stats()["prefetch_quarantined"] == 1
    assert wait_until(lambda: reader.stats().get("prefetch_not_found", 0) == 2)


def test_a_batch_that_cannot_be_handed_over_gives_back_its_slots_and_its_probe(
    bucket: Path, open_stores: list[KVStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = saved(bucket, open_stores, 1, salt=17)
    store, breaker = tripped_store(bucket, open_stores)
    assert wait_until(lambda: breaker.state.value == "half_open")
    real = CodecProcesses.submit_batch

    def broken(self: CodecProcesses, jobs: Any, done: Any) -> bool:
        raise RuntimeError("the sender is gone")

    monkeypatch.setattr(CodecProcesses, "submit_batch", broken)
    store.prefetch(ids)
    assert wait_until(lambda: store.stats().get("prefetch_failed", 0) == 1)
    assert not store._fetching
    free = store.staging.allocate_many(NBYTES, 64)
    assert len(free) == 64  # NOTE: the slot came back: the whole budget is there
    store.staging.release_many(free)
    monkeypatch.setattr(CodecProcesses, "submit_batch", real)
    store.prefetch(ids)  # NOTE: the probe was withdrawn, so it is admitted again
    assert store.wait_staged(ids, timeout=20) == 1
    assert breaker.healthy


def test_a_group_that_cannot_be_handed_over_ends_its_saves_and_the_next_group_still_goes(
    bucket: Path, open_stores: list[KVStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Blocks of two arenas form two groups; building the first group's jobs raises. Before,
    # its saves and every later group's stayed in flight for good: keys, bytes, buffers.
    store = ready_store(bucket, open_stores)
    ids = keys(6, salt=23)
    arenas = [store.save_arena(NBYTES, 3 * NBYTES) for _ in range(2)]
    consumed = [0]

    def done() -> None:
        consumed[0] += 1

    blocks = []
    for i, key in enumerate(ids):
        arena = arenas[i // 3]
        assert arena is not None
        slot = arena.allocate(NBYTES)
        slot[:] = block_bytes(i)
        blocks.append((key, ROOT_HASH, slot, done))
    real = store.quarantine.among
    calls = [0]

    def among_once_broken(found: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("the quarantine broke")
        return real(found)

    monkeypatch.setattr(store.quarantine, "among", among_once_broken)
    with pytest.raises(RuntimeError, match="the quarantine broke"):
        store.save_many(blocks, dtype="bfloat16", shape=(LAYERS, 2, ELEMS), checked=True)
    assert calls[0] == 2, "the second group was handed over after the first failed"
    assert store.flush(timeout=20)
    stats = store.stats()
    assert stats["save_failed"] == 3
    assert stats["save_completed"] == 3
    assert consumed[0] == 6, "every buffer came back"
    assert not store._saving
    assert store._inflight_save_bytes == 0
    objects = FileBackend(str(bucket))
    written = [objects.head(store.object_key(key)) is not None for key in ids]
    assert written == [False] * 3 + [True] * 3


def test_a_process_that_sends_garbage_is_stopped_and_the_others_go_on(
    bucket: Path, open_stores: list[KVStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    from s3kv.offload import processes

    ids = saved(bucket, open_stores, 8, salt=18)
    reader = ready_store(bucket, open_stores)
    offload = reader._offload
    assert offload is not None
    real_loads = processes.pickle.loads
    garbled = [0]

    def loads(data: bytes) -> Any:
        message = real_loads(data)
        if isinstance(message, processes.Outcomes) and not garbled[0]:
            garbled[0] += 1
            raise ValueError("garbled")
        return message

    monkeypatch.setattr(processes.pickle, "loads", loads)
    reader.prefetch(ids)
    assert wait_until(lambda: offload.alive == 1)
    assert wait_until(lambda: not reader._fetching)
    # NOTE: the batch went 4 and 4; the garbled process's 4 jobs fail once it is stopped
    assert reader.stats().get("prefetch_failed", 0) == len(ids) // 2
    assert reader.stats()["prefetch_staged"] == len(ids) // 2
    reader.prefetch(ids)
    assert reader.wait_staged(ids, timeout=20) == len(ids)


def test_staging_that_is_not_an_arena_is_fetched_in_this_process(
    bucket: Path, open_stores: list[KVStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = saved(bucket, open_stores, 4, salt=19)
    reader = open_store(file_config(bucket), open_stores, allocator=NumpyAllocator())
    assert reader.save_arena(NBYTES, 4 * NBYTES) is not None  # NOTE: an arena, not staging's
    handed: list[int] = []
    real = CodecProcesses.submit_batch

    def spy(self: CodecProcesses, jobs: Any, done: Any) -> bool:
        handed.append(len(jobs))
        return real(self, jobs, done)

    monkeypatch.setattr(CodecProcesses, "submit_batch", spy)
    reader.prefetch(ids)
    assert reader.wait_staged(ids, timeout=20) == len(ids)
    for i, key in enumerate(ids):
        assert np.array_equal(reader.staged(key), block_bytes(i))  # type: ignore[arg-type]
    assert handed == []  # NOTE: fetched here, not by the codec processes


# --- where the processes run (codec_cpus) ---


def thread_masks(pid: int) -> set[str]:
    """``Cpus_allowed_list`` of every thread of ``pid`` (the kernel's own account)."""
    masks = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                masks.add(line.split(":", 1)[1].strip())
    return masks


@pytest.fixture
def engine_on_cpu0() -> Iterator[None]:
    """This thread (the 'engine') pinned to CPU 0, as a launcher would pin a rank."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def test_codec_processes_leave_the_cpu_the_engine_is_pinned_to(
    bucket: Path, open_stores: list[KVStore], no_local_codec: None, engine_on_cpu0: None
) -> None:
    writer = open_store(file_config(bucket, codec_processes=1), open_stores)
    save_blocks(writer, keys(4))
    assert writer.flush(timeout=20)
    assert writer.stats()["codec_processes_alive"] == 1
    (pid,) = writer._offload.pids  # type: ignore[union-attr]
    others = affinity.format_cpus(affinity.allowed_cpus() - {0})
    # NOTE: every thread, the codec workers included: they start after the pinning.
    assert thread_masks(pid) == {others}
    assert len(list(Path(f"/proc/{pid}/task").iterdir())) > 2


def test_inherit_keeps_the_codec_on_the_engines_cpu_and_says_it_will_slow_it(
    bucket: Path,
    open_stores: list[KVStore],
    engine_on_cpu0: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="s3kv")
    store = open_store(file_config(bucket, codec_processes=1, codec_cpus="inherit"), open_stores)
    (pid,) = store._offload.pids  # type: ignore[union-attr]
    assert wait_until(lambda: store._offload.wait_ready(0.1) == 1)  # type: ignore[union-attr]
    assert thread_masks(pid) == {"0"}
    lines = [r.getMessage() for r in caplog.records if "codec_cpus" in r.getMessage()]
    assert len(lines) == 1
    assert "share CPUs 0 with the engine" in lines[0]


def test_a_cpu_list_pins_the_processes_and_a_refused_one_is_said_once(
    bucket: Path, open_stores: list[KVStore], caplog: pytest.LogCaptureFixture
) -> None:
    config = file_config(bucket)
    processes = CodecProcesses(config, processes=2, threads=1, cpus=frozenset({1}))
    try:
        assert processes.wait_ready(20) == 2
        for pid in processes.pids:
            assert thread_masks(pid) == {"1"}
    finally:
        processes.close(timeout=5)
    caplog.set_level(logging.WARNING, logger="s3kv")
    # NOTE: a CPU the kernel refuses (beyond the host, or outside a container's cpuset).
    refused = CodecProcesses(config, processes=2, threads=1, cpus=frozenset({4095}))
    try:
        assert refused.wait_ready(20) == 2
    finally:
        refused.close(timeout=5)
    lines = [r.getMessage() for r in caplog.records if "codec_cpus" in r.getMessage()]
    assert len(lines) == 1
    assert "cannot pin to CPUs 4095" in lines[0]


def test_a_cpu_list_this_host_lacks_stops_the_store_before_anything_starts(
    bucket: Path, open_stores: list[KVStore]
) -> None:
    with pytest.raises(ConfigError, match=r"^codec_cpus: CPUs 4000 are not available"):
        open_store(file_config(bucket, codec_cpus="4000"), open_stores)
    assert not list(bucket.iterdir())  # NOTE: no manifest was opened, nothing written


# --- the worker's device->host copies into the save arena ---


def test_runs_of_consecutive_blocks_are_copied_once_per_run_into_consecutive_slots(
    bucket: Path,
    no_local_codec: None,
    open_stores: list[KVStore],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from s3kv.connector.completion import CompletionBoard
    from s3kv.connector.device import SyncCopyEngine
    from s3kv.connector.metadata import ConnectorMetadata, SaveOp, SaveOps
    from s3kv.connector.worker import WorkerCore

    copies: list[int] = []
    real_save = SyncCopyEngine.save

    def counted(self: SyncCopyEngine, pairs: Any, stream: Any) -> Any:
        copies.append(len(pairs))
        return real_save(self, pairs, stream)

    monkeypatch.setattr(SyncCopyEngine, "save", counted)
    store = open_store(file_config(bucket, codec_processes=1), open_stores)
    pool = torch.stack([torch.from_numpy(block_bytes(b).view(np.int16)) for b in range(16)])
    pool = pool.view(torch.bfloat16).view(16, LAYERS, 2, ELEMS)
    core = WorkerCore(0, store, pool, 16 * NBYTES, board=CompletionBoard.private())
    block_ids = [3, 4, 5, 6, 9, 10, 12]  # NOTE: runs 3-6 and 9-10, then 12 alone
    ids = keys(len(block_ids), salt=9)
    saves = tuple(
        SaveOp(request_id=1, block_id=b, key=bytes(k), parent=bytes(ROOT_HASH))
        for b, k in zip(block_ids, ids, strict=True)
    )
    core.save_after_forward(ConnectorMetadata(saves=SaveOps.of(saves)))
    core.flush()
    assert store.flush(timeout=20)
    assert copies == [3]
    # NOTE: the second pass reuses the buffers the first gave back: the lowest slots first.
    again = keys(len(block_ids), salt=10)
    core.save_after_forward(
        ConnectorMetadata(
            saves=SaveOps.of(
                SaveOp(request_id=2, block_id=b, key=bytes(k), parent=bytes(ROOT_HASH))
                for b, k in zip(block_ids, again, strict=True)
            )
        )
    )
    core.flush()
    assert store.flush(timeout=20)
    assert copies == [3, 3]
    reader = open_store(file_config(bucket, codec_processes=1), open_stores)
    reader.prefetch(ids + again)
    assert reader.wait_staged(ids + again, timeout=20) == 2 * len(ids)
    for key, block in zip(ids + again, block_ids + block_ids, strict=True):
        staged = reader.staged(key)
        assert staged is not None
        assert np.array_equal(staged, block_bytes(block))


def test_closing_a_store_unmaps_its_staging_at_once_unless_a_load_holds_a_pin(
    bucket: Path, open_stores: list[KVStore]
) -> None:
    ids = saved(bucket, open_stores, 6, salt=21)
    for pin in (False, True):
        reader = ready_store(bucket, open_stores)
        reader.prefetch(ids)
        assert reader.wait_staged(ids, timeout=20) == 6
        if pin:
            assert reader.staging.pin_leading(ids[:1]) == 1  # NOTE: a claimed load's block
        arena = reader.staging.allocator
        assert isinstance(arena, SlabArena)
        reader.close(timeout=20)
        # NOTE: a pinned block may still be read by a device copy: its memory stays mapped.
        assert arena._mmap.closed is not pin
        assert len(reader.staging) == (1 if pin else 0)


def test_codec_processes_import_this_s3kv_first_never_one_in_their_working_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import s3kv
    from s3kv.offload import processes

    seen: dict[str, str] = {}

    def popen(args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs["env"])
        raise OSError("not started")

    monkeypatch.setattr(processes.subprocess, "Popen", popen)
    monkeypatch.setattr(processes.sys, "path", ["", "/elsewhere"])
    with pytest.raises(OSError, match="not started"):
        CodecProcesses._spawn(0)
    paths = seen["PYTHONPATH"].split(os.pathsep)
    assert paths[0] == str(Path(os.path.abspath(s3kv.__file__)).parents[1])
    assert paths[1:] == [os.getcwd(), "/elsewhere"]  # NOTE: '' is this process's directory
    assert seen["PYTHONSAFEPATH"] == "1"  # NOTE: -m would put the child's directory first
