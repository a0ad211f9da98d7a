"""The in-bucket manifest: startup cost, refresh, flush failures, compaction, grace, usage.

Every test runs on a MemoryBackend behind a counting wrapper, with an injected clock; only
the background-thread tests wait (on Events, with short timeouts).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from s3kv.errors import (
    BadMagicError,
    ChecksumError,
    CodecError,
    EndpointError,
    SizeMismatchError,
    TruncatedError,
)
from s3kv.keys import ROOT_HASH, BlockHash, manifest_prefix
from s3kv.manifest import (
    CompactionReport,
    Manifest,
    UsageRow,
    UsageTable,
    compact,
    load_usage,
)
from s3kv.manifest.format import (
    CURRENT_NAME,
    KIND_HIT,
    KIND_WRITE,
    RECORD_DTYPE,
    UNKNOWN_PARENT,
    USAGE_DTYPE,
    Current,
    decode_records,
    encode_records,
    segment_name,
    snapshot_paths,
)
from s3kv.storage import Backend, Capabilities, DeleteResult, MemoryBackend, ObjectInfo

PREFIX, FP = "kv", "fp0123"
ROOT = manifest_prefix(PREFIX, FP)
T0 = 1_700_000_000.0
CAP, FPR = 50_000, 1e-9


class Clock:
    """A settable epoch clock."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class CountingBackend(Backend):
    """Counts requests per operation and fails the operations named in ``fail``."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()
        self.fail: set[str] = set()

    def _op(self, op: str) -> None:
        self.calls[op] += 1
        if op in self.fail:
            raise EndpointError(f"injected {op} failure")

    @property
    def requests(self) -> int:
        return sum(self.calls.values())

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    @property
    def description(self) -> str:
        return "counting"

    def get(self, key: str) -> bytes | None:
        self._op("get")
        return self.inner.get(key)

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        self._op("put")
        return self.inner.put(key, data, if_absent=if_absent)

    def head(self, key: str) -> ObjectInfo | None:
        self._op("head")
        return self.inner.head(key)

    def delete_many(self, keys: Iterable[str]) -> DeleteResult:
        self._op("delete")
        return self.inner.delete_many(keys)

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        self._op("list")
        return self.inner.list(prefix, start_after=start_after)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def backend(clock: Clock) -> CountingBackend:
    return CountingBackend(MemoryBackend(clock=clock))


def make_chain(n: int, seed: int) -> list[BlockHash]:
    data = np.random.default_rng(seed).bytes(16 * n)
    return [BlockHash(data[i : i + 16]) for i in range(0, 16 * n, 16)]


def open_manifest(
    backend: Backend, clock: Clock, instance: str, grace_s: float = 600.0
) -> Manifest:
    return Manifest.open(backend, PREFIX, FP, capacity=CAP, fpr=FPR, instance_id=instance,
                         clock=clock, grace_s=grace_s)  # fmt: skip


def write_chain(manifest: Manifest, chain: list[BlockHash], size: int = 100) -> None:
    parent = ROOT_HASH
    for key in chain:
        manifest.record_write(key, parent, size)
        parent = key


def run_compact(backend: Backend, clock: Clock, **kwargs: Any) -> CompactionReport:
    return compact(backend, PREFIX, FP, capacity=CAP, fpr=FPR, clock=clock, **kwargs)


def row_of(usage: UsageTable, key: bytes) -> UsageRow:
    row = usage.row(key)
    assert row is not None
    return row


def segment_keys(backend: CountingBackend) -> list[str]:
    return [info.key for info in backend.inner.list(ROOT + "segments/")]


# --- startup ----------------------------------------------------------------------------


@pytest.mark.parametrize("n_keys", [10, 10_000])
def test_startup_requests_do_not_grow_with_keys(
    backend: CountingBackend, clock: Clock, n_keys: int
) -> None:
    # A writer flushes n keys, compaction folds them, then two more segments arrive.
    writer = open_manifest(backend, clock, "writer")
    chain = make_chain(n_keys + 2, seed=n_keys)
    write_chain(writer, chain[:n_keys])
    writer.flush()
    clock.advance(1)
    run_compact(backend, clock)
    for key in chain[n_keys:]:
        clock.advance(1)
        writer.record_write(key, ROOT_HASH, 100)
        writer.flush()
    # A new instance: GET CURRENT, GET bloom.bin, one LIST, GET each of the 2 new segments.
    before = backend.requests
    reader = open_manifest(backend, clock, "reader")
    assert backend.requests - before == reader.open_requests == 5
    assert backend.calls["list"] >= 1
    assert reader.count_leading(chain) == n_keys + 2
    # Lookups never touch the network.
    before = backend.requests
    reader.count_leading(chain)
    reader.may_contain(chain[0])
    assert backend.requests == before


def test_open_without_snapshot_reads_every_segment(backend: CountingBackend, clock: Clock) -> None:
    writer = open_manifest(backend, clock, "w")
    chain = make_chain(30, seed=1)
    for part in (chain[:10], chain[10:20], chain[20:]):
        write_chain(writer, part)
        writer.flush()
    reader = open_manifest(backend, clock, "r")
    assert reader.generation == 0
    assert reader.open_requests == 1 + 1 + 3  # CURRENT (absent), LIST, 3 segments
    assert reader.count_leading(chain) == 30


def test_open_survives_an_unreachable_bucket(backend: CountingBackend, clock: Clock) -> None:
    writer = open_manifest(backend, clock, "w")
    chain = make_chain(5, seed=2)
    write_chain(writer, chain)
    writer.flush()
    backend.fail = {"get"}
    reader = open_manifest(backend, clock, "r")
    assert reader.generation < 0
    assert reader.count_leading(chain) == 0
    assert reader.stats()["refresh_errors"] == 1
    backend.fail = set()
    assert reader.refresh() == 5
    assert reader.count_leading(chain) == 5


# --- refresh ----------------------------------------------------------------------------


def test_second_instance_sees_first_instances_writes_after_refresh(
    backend: CountingBackend, clock: Clock
) -> None:
    a = open_manifest(backend, clock, "a")
    b = open_manifest(backend, clock, "b")
    chain = make_chain(20, seed=3)
    write_chain(a, chain)
    assert a.count_leading(chain) == 20  # local writes are visible at once
    assert a.flush() == 20
    assert b.count_leading(chain) == 0
    clock.advance(1)
    assert b.refresh() == 20
    assert b.count_leading(chain) == 20
    # The writer does not GET its own segment back.
    gets = backend.calls["get"]
    assert a.refresh() == 0
    assert backend.calls["get"] == gets + 1  # only CURRENT
    assert b.refresh() == 0  # nothing new
    assert b.stats()["segments_read"] == 1


def test_refresh_reloads_a_new_generation_and_keeps_local_writes(
    backend: CountingBackend, clock: Clock
) -> None:
    a = open_manifest(backend, clock, "a", grace_s=0)
    b = open_manifest(backend, clock, "b", grace_s=0)
    chain = make_chain(10, seed=4)
    write_chain(b, chain[:3])
    b.flush()
    clock.advance(1)
    write_chain(b, chain[3:5])
    b.flush()
    clock.advance(1)
    report = run_compact(backend, clock, grace_s=0)
    # grace 0: the older folded segment is deleted and the newest is named in CURRENT as
    # folded, so `a` learns every key from bloom.bin and GETs no segment.
    assert report.segments_deleted == 1
    assert len(segment_keys(backend)) == 1
    write_chain(a, chain[5:])  # pending, not flushed: must survive the reload
    a.refresh()
    assert a.generation == 1
    stats = a.stats()
    assert (stats["reloads"], stats["segments_read"]) == (2, 0)  # the open, then generation 1
    assert a.count_leading(chain[:5]) == 5
    assert all(a.may_contain(key) for key in chain[5:])


def test_refresh_errors_are_counted_and_logged_once(
    backend: CountingBackend, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    m = open_manifest(backend, clock, "m")
    backend.fail = {"list"}
    with caplog.at_level(logging.DEBUG, logger="s3kv.manifest"):
        assert m.refresh() == 0
        assert m.refresh() == 0
    assert m.stats()["refresh_errors"] == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "endpoint" in warnings[0].getMessage()


# --- flush ------------------------------------------------------------------------------


def test_flush_failure_keeps_records_for_the_next_flush(
    backend: CountingBackend, clock: Clock
) -> None:
    a = open_manifest(backend, clock, "a")
    chain = make_chain(10, seed=5)
    write_chain(a, chain)
    a.record_hits(chain[:3])
    backend.fail = {"put"}
    assert a.flush() == 0
    assert a.pending_records == 13
    a.record_hits(chain[:1])
    assert a.stats()["flush_errors"] == 1
    backend.fail = set()
    assert a.flush() == 13
    assert a.pending_records == 0
    records = decode_records(backend.inner.get(segment_keys(backend)[0]) or b"")
    hits = records[records["kind"] == KIND_HIT]
    assert sorted(hits["count"].tolist()) == [1, 1, 2]  # the failed flush's hits merged
    assert (records["kind"] == KIND_WRITE).sum() == 10
    b = open_manifest(backend, clock, "b")
    assert b.count_leading(chain) == 10


def test_pending_records_are_bounded(backend: CountingBackend, clock: Clock) -> None:
    m = open_manifest(backend, clock, "m")
    keys = make_chain(8 * 4096 + 100, seed=6)
    m.record_hits(keys)
    assert m.pending_records == 8 * 4096
    assert m.stats()["records_dropped"] == 100
    # Writes survive when the bound is hit: hits are dropped first.
    m.record_write(keys[0], ROOT_HASH, 1)
    assert m.stats()["records_dropped"] == 101


def test_empty_flush_writes_nothing(backend: CountingBackend, clock: Clock) -> None:
    m = open_manifest(backend, clock, "m")
    puts = backend.calls["put"]
    assert m.flush() == 0
    assert backend.calls["put"] == puts


# --- corruption -------------------------------------------------------------------------


def test_corrupt_segment_is_skipped_and_counted(backend: CountingBackend, clock: Clock) -> None:
    a = open_manifest(backend, clock, "a")
    chain = make_chain(4, seed=7)
    write_chain(a, chain)
    a.flush()
    bad = ROOT + "segments/" + segment_name(round(T0 * 1000) + 5, "evil", 0)
    backend.inner.put(bad, b"S3KVSEG1 but then garbage follows here")
    b = open_manifest(backend, clock, "b")
    assert b.stats()["segments_corrupt"] == 1
    assert b.count_leading(chain) == 4
    assert b.refresh() == 0  # not read again
    assert b.stats()["segments_corrupt"] == 1
    report = run_compact(backend, clock)
    assert report.segments_corrupt == 1
    assert report.keys == 4


def test_corrupt_bloom_falls_back_to_usage(backend: CountingBackend, clock: Clock) -> None:
    a = open_manifest(backend, clock, "a")
    chain = make_chain(6, seed=8)
    write_chain(a, chain)
    a.flush()
    run_compact(backend, clock)
    bloom_key = ROOT + snapshot_paths(1)[0]
    backend.inner.put(bloom_key, (backend.inner.get(bloom_key) or b"")[:-10])
    b = open_manifest(backend, clock, "b")
    assert b.stats()["snapshots_corrupt"] == 1
    assert b.count_leading(chain) == 6


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda d: b"XXXXXXXX" + d[8:], BadMagicError),
        (lambda d: d[:20], TruncatedError),
        (lambda d: d[:-3], TruncatedError),
        (lambda d: d[:16] + (999).to_bytes(8, "little") + d[24:], SizeMismatchError),
        (lambda d: d[:24] + bytes(8) + d[32:], ChecksumError),
    ],
)
def test_segment_format_verifies_everything(mutate: object, error: type[CodecError]) -> None:
    records = np.zeros(3, RECORD_DTYPE)
    records["key"] = make_chain(3, seed=9)
    records["kind"] = KIND_WRITE
    data = encode_records(records)
    assert decode_records(data).tobytes() == records.tobytes()
    assert callable(mutate)
    with pytest.raises(error):
        decode_records(mutate(data))


def test_current_pointer_round_trip_and_validation() -> None:
    bloom, usage = snapshot_paths(3)
    current = Current(generation=3, bloom=bloom, usage=usage, keys=7, watermark="x",
                      folded=("a", "b"), grace_s=5.0, created_at=T0)  # fmt: skip
    assert Current.from_json(current.to_json()) == current
    with pytest.raises(CodecError):
        Current.from_json(b"{not json")
    with pytest.raises(CodecError):
        Current.from_json(current.to_json().replace(b"snapshots/", b"../../etc/"))


# --- compaction -------------------------------------------------------------------------


def test_compaction_folds_hits_pins_and_drop_keys(backend: CountingBackend, clock: Clock) -> None:
    a = open_manifest(backend, clock, "a")
    b = open_manifest(backend, clock, "b")
    chain = make_chain(6, seed=10)
    write_chain(a, chain[:4])
    a.flush()
    clock.advance(10)
    write_chain(b, chain[4:], size=300)
    b.record_hits(chain[:2])
    b.record_hits(chain[:1])
    b.record_pin(chain[2:4])
    b.flush()
    clock.advance(10)
    b.record_unpin(chain[3:4])
    b.flush()
    clock.advance(10)
    report = run_compact(backend, clock, drop_keys=[chain[5]])
    assert report.segments_folded == 3
    assert report.keys == 5
    assert report.keys_dropped == 1
    assert not report.lost_race
    usage = load_usage(backend, PREFIX, FP)
    assert usage.generation == 1
    assert len(usage) == 5
    assert chain[5] not in usage
    first = usage.row(chain[0])
    assert first is not None
    assert (first.hits, first.parent, first.size) == (2, ROOT_HASH, 100)
    assert first.last_used == T0 + 10
    pinned = {key: row_of(usage, key).pinned for key in chain[2:4]}
    assert pinned == {chain[2]: True, chain[3]: False}
    assert usage.last_used(chain[5]) is None
    # The new snapshot serves a fresh instance, without the dropped key.
    c = open_manifest(backend, clock, "c")
    assert c.count_leading(chain) == 5


def test_grace_window_keeps_segments_then_deletes_them(
    backend: CountingBackend, clock: Clock
) -> None:
    a = open_manifest(backend, clock, "a", grace_s=60)
    chain = make_chain(3, seed=11)
    write_chain(a, chain[:1])
    a.flush()
    clock.advance(1)
    first = run_compact(backend, clock, grace_s=60)
    # Within the grace window the folded segment stays, and CURRENT lists it as folded.
    assert first.segments_deleted == 0
    current = Current.from_json(backend.inner.get(ROOT + CURRENT_NAME) or b"")
    assert current.folded == (current.watermark,)
    # A later segment moves the watermark past the grace window: the old one goes.
    clock.advance(120)
    write_chain(a, chain[1:2])
    a.flush()
    second = run_compact(backend, clock, grace_s=60)
    assert second.segments_folded == 1
    assert second.segments_deleted == 1
    assert len(segment_keys(backend)) == 1
    # Generations: the previous one stays, older ones are deleted.
    clock.advance(120)
    write_chain(a, chain[2:])
    a.flush()
    third = run_compact(backend, clock, grace_s=60)
    assert third.snapshots_deleted == 2  # generation 1's bloom.bin + usage.bin
    snapshots = {info.key.split("/")[-2] for info in backend.inner.list(ROOT + "snapshots/")}
    assert snapshots == {"0000000002", "0000000003"}
    assert open_manifest(backend, clock, "r").count_leading(chain) == 3


def test_clock_skewed_segment_is_picked_up_within_grace(
    backend: CountingBackend, clock: Clock
) -> None:
    a = open_manifest(backend, clock, "a")
    reader = open_manifest(backend, clock, "reader")
    chain = make_chain(3, seed=12)
    write_chain(a, chain[:1])
    a.flush()
    clock.advance(1)
    run_compact(backend, clock)
    # Instance "late" runs 60 s behind: its segment is named before the watermark.
    late = open_manifest(backend, Clock(clock.now - 60), "late")
    late.record_write(chain[1], chain[0], 100)
    late.flush()
    # And one 700 s behind (beyond the 600 s grace): lost to readers, as documented.
    lost = open_manifest(backend, Clock(clock.now - 700), "lost")
    lost.record_write(chain[2], chain[1], 100)
    lost.flush()
    assert reader.refresh() >= 1
    assert reader.may_contain(chain[1])
    fresh = open_manifest(backend, clock, "fresh")
    assert fresh.may_contain(chain[1])
    assert not fresh.may_contain(chain[2])
    # The next compaction folds the late segment instead of treating it as folded.
    clock.advance(1)
    report = run_compact(backend, clock)
    assert report.segments_folded == 1
    assert chain[1] in load_usage(backend, PREFIX, FP)


class RacingBackend(CountingBackend):
    """Lets "another compactor" write ``key`` just before our PUT of a key ending ``when``."""

    def __init__(self, inner: Backend, when: str, key: str, data: bytes) -> None:
        super().__init__(inner)
        self.when, self.key, self.data = when, key, data

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        if key.endswith(self.when):
            self.inner.put(self.key, self.data)
        return super().put(key, data, if_absent=if_absent)


@pytest.mark.parametrize(
    ("when", "their_key", "their_data"),
    [
        # Both picked generation 1; the other one's bloom.bin landed first.
        ("bloom.bin", ROOT + snapshot_paths(1)[0], b"theirs"),
        # The other one published CURRENT between our snapshot PUTs and our CURRENT PUT.
        ("usage.bin", ROOT + CURRENT_NAME, Current(generation=7, bloom=snapshot_paths(7)[0],
                                                   usage=snapshot_paths(7)[1], keys=0,
                                                   watermark="").to_json()),
    ],
)  # fmt: skip
def test_losing_compactor_replaces_and_deletes_nothing(
    clock: Clock, when: str, their_key: str, their_data: bytes
) -> None:
    backend = RacingBackend(MemoryBackend(clock=clock), when, their_key, their_data)
    a = open_manifest(backend, clock, "a", grace_s=0)
    for key in make_chain(2, seed=13):
        clock.advance(1)
        a.record_write(key, ROOT_HASH, 1)
        a.flush()
    before = segment_keys(backend)
    report = run_compact(backend, clock, grace_s=0)
    assert report.lost_race
    current = backend.inner.get(ROOT + CURRENT_NAME)
    assert current is None or Current.from_json(current).generation == 7
    assert segment_keys(backend) == before


def test_full_listing_rebuilds_a_corrupt_snapshot(backend: CountingBackend, clock: Clock) -> None:
    a = open_manifest(backend, clock, "a")
    write_chain(a, make_chain(2, seed=14))
    a.flush()
    run_compact(backend, clock)
    backend.inner.put(ROOT + CURRENT_NAME, b"{garbage")
    with pytest.raises(CodecError):
        run_compact(backend, clock)
    listed = make_chain(3, seed=15)
    report = run_compact(backend, clock, full_listing_keys=[(k, 10, T0) for k in listed])
    assert report.generation == 2
    assert report.listing_keys == 3
    usage = load_usage(backend, PREFIX, FP)
    assert all(key in usage for key in listed)
    assert row_of(usage, listed[0]).parent is None  # a listing knows no parents


# --- usage ------------------------------------------------------------------------------


def usage_table(rows: Sequence[tuple[bytes, bytes, float, int, int, bool]]) -> UsageTable:
    """Rows of (key, parent, last_used, hits, size, pinned), sorted as fold() would."""
    array = np.zeros(len(rows), USAGE_DTYPE)
    for i, (key, parent, last_used, hits, size, pinned) in enumerate(rows):
        array[i] = (key, parent, last_used, last_used, hits, size, pinned)
    array.sort(order="key")
    return UsageTable(array)


def test_hottest_chains_respect_budget_and_order() -> None:
    r, h = make_chain(4, seed=20), make_chain(4, seed=21)
    hot = [(r[0], ROOT_HASH, 5.0, 50, 100, False), (r[1], r[0], 5.0, 40, 100, False),
           (r[2], r[1], 5.0, 30, 100, False), (r[3], r[1], 6.0, 35, 100, False)]  # fmt: skip
    cold = [(h[0], ROOT_HASH, 1.0, 1, 100, False), (h[1], h[0], 1.0, 1, 100, False)]
    pinned = [(h[2], ROOT_HASH, 0.0, 0, 100, True)]
    orphan = [(h[3], UNKNOWN_PARENT, 9.0, 99, 10, False)]  # cannot reach the root
    table = usage_table([*hot, *cold, *pinned, *orphan])
    # Pinned first, then the hot tree (branching at r[1]); the orphan never.
    assert table.hottest_chains(400) == [[h[2]], [r[0], r[1], r[3]]]
    assert table.hottest_chains(500) == [[h[2]], [r[0], r[1], r[3]], [r[0], r[1], r[2]]]
    everything = table.hottest_chains(10_000)
    assert [h[0], h[1]] in everything
    assert all(h[3] not in chain for chain in everything)
    assert table.hottest_chains(99) == []
    assert table.hottest_chains(0) == []
    assert sum(len(set(c)) for c in everything) >= 7


def test_load_usage_folds_segments_newer_than_the_snapshot(
    backend: CountingBackend, clock: Clock
) -> None:
    a = open_manifest(backend, clock, "a")
    chain = make_chain(2, seed=22)
    write_chain(a, chain)
    a.flush()
    run_compact(backend, clock)
    clock.advance(30)
    a.record_hits(chain)
    a.record_hits(chain[:1])
    a.flush()
    usage = load_usage(backend, PREFIX, FP)
    assert usage.segments_read == 1
    assert usage.last_used(chain[0]) == T0 + 30
    assert row_of(usage, chain[0]).hits == 2
    assert usage.hottest_chains(10_000) == [chain]


# --- background thread ------------------------------------------------------------------


def wait_until(predicate: object, timeout: float = 5.0) -> bool:
    assert callable(predicate)
    tick = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return True
        tick.wait(0.01)
    return bool(predicate())


def test_background_thread_flushes_and_refreshes(backend: CountingBackend) -> None:
    a = Manifest.open(backend, PREFIX, FP, capacity=CAP, fpr=FPR, instance_id="a")
    b = Manifest.open(backend, PREFIX, FP, capacity=CAP, fpr=FPR, instance_id="b")
    a.start(refresh_interval=0, flush_interval=100.0, flush_keys=3)
    b.start(refresh_interval=0.02, flush_interval=100.0, flush_keys=100)
    try:
        chain = make_chain(3, seed=23)
        write_chain(a, chain)  # 3 records = flush_keys: wakes a's thread to flush early
        assert wait_until(lambda: b.count_leading(chain) == 3)
        b.record_write(make_chain(1, seed=24)[0], ROOT_HASH, 1)
    finally:
        a.close(timeout=5)
        b.close(timeout=5)  # flushes what is pending
    assert b.stats()["segments_written"] == 1
    assert a.stats()["thread_errors"] == b.stats()["thread_errors"] == 0
    with pytest.raises(RuntimeError):
        a.start()


def test_no_early_flushes_while_the_bucket_fails(backend: CountingBackend) -> None:
    m = Manifest.open(backend, PREFIX, FP, capacity=CAP, fpr=FPR, instance_id="m")
    backend.fail = {"put"}
    m.start(refresh_interval=0, flush_interval=100.0, flush_keys=2)
    try:
        chain = make_chain(12, seed=25)
        write_chain(m, chain[:2])  # reaches flush_keys: one early flush, which fails
        assert wait_until(lambda: m.stats()["flush_errors"] == 1)
        write_chain(m, chain[2:])  # during the outage only the timer may retry
        threading.Event().wait(0.1)
        assert m.stats()["flush_errors"] == 1
        assert m.pending_records == 12
    finally:
        backend.fail = set()
        m.close(timeout=5)
    assert m.stats()["records_flushed"] == 12


def test_malformed_keys_are_rejected_before_queueing(
    backend: CountingBackend, clock: Clock
) -> None:
    m = open_manifest(backend, clock, "m")
    with pytest.raises(ValueError, match="16 bytes"):
        m.record_hits([BlockHash(b"short")])
    with pytest.raises(ValueError, match="16 bytes"):
        m.record_write(BlockHash(b"short"), ROOT_HASH, 1)
    with pytest.raises(ValueError, match="16 bytes"):
        m.record_pin([BlockHash(b"")])
    assert m.pending_records == 0
