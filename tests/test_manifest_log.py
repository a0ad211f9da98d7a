"""The manifest log at fleet scale: election, fencing, deltas, snapshots, startup, migration.

Every test runs on a MemoryBackend behind the counting wrapper of test_manifest, with an
injected clock and the compactor driven by hand (``compact_once``), so each step is exact.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np
import pytest

from s3kv.errors import CodecError, StorageError
from s3kv.keys import BlockHash
from s3kv.manifest import (
    CompactionPolicy,
    Compactor,
    KeyFilter,
    LogEntry,
    Manifest,
    ManifestIO,
    ManifestLog,
    compact,
    load_usage,
)
from s3kv.manifest.format import (
    CURRENT_NAME,
    RECORD_DTYPE,
    USAGE_DTYPE,
    Current,
    encode_usage,
    snapshot_paths,
)
from s3kv.manifest.loading import hottest
from s3kv.manifest.snapshot import read_filters, write_snapshot
from s3kv.storage import MemoryBackend
from tests.test_manifest import (
    FP,
    PREFIX,
    ROOT,
    Clock,
    CountingBackend,
    make_chain,
    segment_keys,
    write_chain,
)

FPR = 1e-6
POLICY = CompactionPolicy(interval_s=20.0, lease_s=60.0, max_deltas=4, snapshot_records=200)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def backend(clock: Clock) -> CountingBackend:
    return CountingBackend(MemoryBackend(clock=clock))


def member(backend: Any, clock: Clock, name: str, **kwargs: Any) -> Manifest:
    """An instance taking part in compaction."""
    options: dict[str, Any] = {"compaction": POLICY, "clock": clock, **kwargs}
    return Manifest.open(backend, PREFIX, FP, capacity=1000, fpr=FPR, instance_id=name, **options)


def reader(backend: Any, clock: Clock, name: str = "reader") -> Manifest:
    return Manifest.open(backend, PREFIX, FP, capacity=1000, fpr=FPR, instance_id=name, clock=clock)


def io_of(backend: Any) -> ManifestIO:
    return ManifestIO(backend, PREFIX, FP)


def latest(backend: Any) -> LogEntry:
    entry = ManifestLog(io_of(backend)).latest()
    assert entry is not None
    return entry


def expire_lease(manifest: Manifest) -> None:
    """Make ``manifest`` believe it has seen no news for longer than any lease."""
    manifest._entry_seen_at -= 10 * POLICY.lease_s


# --- election and the normal cycle -------------------------------------------------------


def test_first_instance_takes_the_lease_and_others_see_writes_after_one_cycle(
    backend: CountingBackend, clock: Clock
) -> None:
    a, b = member(backend, clock, "a"), member(backend, clock, "b")
    assert a.compact_once() == "takeover"
    assert a.is_compactor
    b.refresh()
    assert b.compact_once() == "wait"
    assert not b.is_compactor
    chain = make_chain(5, seed=1)
    write_chain(b, chain)
    assert b.flush() == 5
    assert not any(a.may_contain(key) for key in chain)
    clock.advance(20)
    assert a.compact_once() == "cycle:delta"
    assert segment_keys(backend) == []  # folded segments are deleted once published
    r = reader(backend, clock)
    assert all(r.may_contain(key) for key in chain)
    assert all(a.may_contain(key) for key in chain)


def test_refresh_with_no_news_is_one_request_whatever_the_number_of_writers(
    backend: CountingBackend, clock: Clock
) -> None:
    compactor = member(backend, clock, "c")
    compactor.compact_once()
    writers = [reader(backend, clock, f"w{i}") for i in range(30)]
    r = reader(backend, clock)
    for writer in writers:
        write_chain(writer, make_chain(3, seed=hash(writer.instance_id) % 1000))
        writer.flush()
    compactor.compact_once()
    r.refresh()  # one entry with one delta of all 30 writers
    before = backend.requests
    assert r.refresh() == 0
    assert backend.requests - before == 1


def test_startup_requests_do_not_grow_with_age_or_writers(
    backend: CountingBackend, clock: Clock
) -> None:
    compactor = member(backend, clock, "c")
    compactor.compact_once()
    writers = [reader(backend, clock, f"w{i}") for i in range(20)]
    counts = []
    for rounds in (5, 60):
        for step in range(rounds):
            for i, writer in enumerate(writers):
                write_chain(writer, make_chain(2, seed=10_000 * rounds + 100 * step + i))
                writer.flush()
            clock.advance(20)
            compactor.compact_once()
        fresh = reader(backend, clock, f"new{rounds}")
        counts.append(fresh.open_requests)
        assert fresh.may_contain(bytes(make_chain(2, seed=10_000 * rounds)[0]))
    entry = latest(backend)
    assert len(entry.deltas) <= POLICY.max_deltas
    assert counts[0] <= 10
    assert counts[1] <= 10, counts
    assert entry.snapshot is not None
    assert entry.snapshot.generation >= 2


def test_hits_alone_are_flushed_once_per_hit_interval(
    backend: CountingBackend, clock: Clock
) -> None:
    m = reader(backend, clock)
    m._hit_interval = 600.0
    keys = make_chain(4, seed=3)
    for _ in range(50):
        m.record_hits(keys)
        clock.advance(60)
        if clock.now - 1_700_000_000.0 < 600:
            assert m.flush(force=False) == 0
    assert m.flush(force=False) == 4  # four coalesced hit records, one segment
    assert m.flush(force=False) == 0


# --- fencing ----------------------------------------------------------------------------


def test_two_instances_taking_over_at_once_one_wins(backend: CountingBackend) -> None:
    io = io_of(backend)
    first = Compactor(io, "a", POLICY)
    entry = first.take_over(None)
    assert entry is not None
    x, y = Compactor(io, "x", POLICY), Compactor(io, "y", POLICY)
    won = [x.take_over(entry), y.take_over(entry)]
    assert sum(w is not None for w in won) == 1
    winner = next(w for w in won if w is not None)
    assert latest(backend) == winner
    # The old holder wakes with news to publish: refused, and it deletes nothing.
    writer = reader(backend, Clock(), "w")
    write_chain(writer, make_chain(2, seed=2))
    writer.flush()
    before = segment_keys(backend)
    report = first.cycle(entry)
    assert report.entry is None
    assert report.action == "fenced"
    assert segment_keys(backend) == before


def test_paused_compactor_waking_after_its_lease_deletes_nothing(
    backend: CountingBackend, clock: Clock
) -> None:
    a, b = member(backend, clock, "a"), member(backend, clock, "b")
    a.compact_once()
    write_chain(b, make_chain(3, seed=4))
    b.flush()
    b.refresh()
    expire_lease(b)  # a is paused past its lease
    assert b.compact_once() == "takeover"
    held = latest(backend)
    segments_before = segment_keys(backend)
    # a wakes believing it holds the lease; its cycle is fenced.
    assert a.compact_once() == "lost"
    assert segment_keys(backend) == segments_before
    assert latest(backend) == held
    a.refresh()
    assert a.compact_once() == "wait"
    assert b.compact_once().startswith("cycle:")


def test_compactor_killed_mid_publish_leaves_orphans_the_next_one_sweeps(
    backend: CountingBackend, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = member(backend, clock, "a")
    a.compact_once()
    chain = make_chain(6, seed=5)
    write_chain(a, chain)
    a.flush()

    def die(self: ManifestLog, entry: LogEntry) -> bool:
        raise StorageError("killed between the delta and the entry")

    monkeypatch.setattr(ManifestLog, "append", die)
    assert a.compact_once() == "error"
    monkeypatch.undo()
    orphans = [i.key for i in backend.inner.list(ROOT + "deltas/")]
    assert len(orphans) == 1
    # Readers see the previous version; the segment is still there to fold again.
    assert not reader(backend, clock).may_contain(chain[0])
    b = member(backend, clock, "b")
    expire_lease(b)
    assert b.compact_once() == "takeover"
    clock.advance(POLICY.grace_s + 1)
    assert b.compact_once() == "cycle:delta"
    assert reader(backend, clock, "r2").may_contain(chain[0])
    remaining = {i.key for i in backend.inner.list(ROOT + "deltas/")}
    assert orphans[0] not in remaining


def test_reader_opening_during_a_compaction_sees_a_consistent_version(
    backend: CountingBackend, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = member(backend, clock, "a")
    a.compact_once()
    old = make_chain(3, seed=6)
    write_chain(a, old)
    a.flush()
    a.compact_once()
    new = make_chain(3, seed=7)
    write_chain(a, new)
    a.flush()
    seen: list[Manifest] = []
    real_append = ManifestLog.append

    def open_reader_first(self: ManifestLog, entry: LogEntry) -> bool:
        seen.append(reader(backend, clock, "mid"))  # objects written, entry not yet
        return real_append(self, entry)

    monkeypatch.setattr(ManifestLog, "append", open_reader_first)
    assert a.compact_once() == "cycle:delta"
    monkeypatch.undo()
    mid = seen[0]
    assert all(mid.may_contain(k) for k in old)
    mid.refresh()
    assert all(mid.may_contain(k) for k in new)


def test_a_closing_compactor_hands_the_lease_over_at_once(
    backend: CountingBackend, clock: Clock
) -> None:
    a, b = member(backend, clock, "a"), member(backend, clock, "b")
    a.compact_once()
    b.refresh()
    a.close()
    assert latest(backend).holder == ""
    b.refresh()
    assert b.compact_once() == "takeover"


def test_skewed_writer_clocks_do_not_lose_segments(backend: CountingBackend, clock: Clock) -> None:
    c = member(backend, clock, "c")
    c.compact_once()
    late = reader(backend, Clock(clock.now - 3600), "late")  # an hour behind
    early = reader(backend, Clock(clock.now + 3600), "early")  # an hour ahead
    keys = make_chain(4, seed=8)
    write_chain(late, keys[:2])
    write_chain(early, keys[2:])
    late.flush()
    early.flush()
    c.compact_once()
    assert all(reader(backend, clock, "r").may_contain(k) for k in keys)


# --- snapshots, filters, migration ------------------------------------------------------


def test_deltas_merge_then_become_a_snapshot_and_readers_keep_local_writes(
    backend: CountingBackend, clock: Clock
) -> None:
    c = member(backend, clock, "c")
    c.compact_once()
    w = reader(backend, clock, "w")
    r = reader(backend, clock, "r")
    every: list[BlockHash] = []
    for step in range(12):
        chain = make_chain(30, seed=100 + step)
        every += chain
        write_chain(w, chain)
        w.flush()
        clock.advance(20)
        c.compact_once()
        r.refresh()
        assert len(latest(backend).deltas) <= POLICY.max_deltas
    local = make_chain(2, seed=99)
    write_chain(r, local)  # pending on r while a snapshot arrives
    assert latest(backend).snapshot is not None
    assert all(r.may_contain(k) for k in every + local)
    assert r.generation >= 1


def test_key_filter_grows_and_holds_its_false_positive_rate() -> None:
    target = 1e-3
    keys = np.random.default_rng(1).bytes(16 * 300_000)
    chunks = [keys[i : i + 16] for i in range(0, len(keys), 16)]
    f = KeyFilter(target, growth_capacity=70_000)
    f.add_many(chunks)  # past the first two partitions
    assert all(f.contains_many(chunks))
    assert f.partitions == 3
    probes = np.random.default_rng(2).bytes(16 * 200_000)
    hits = f.contains_many([probes[i : i + 16] for i in range(0, len(probes), 16)]).sum()
    assert hits / 200_000 <= target


def test_snapshot_shards_round_trip_and_stream(backend: CountingBackend) -> None:
    io = io_of(backend)
    rows = np.zeros(50_000, USAGE_DTYPE)
    rows["key"] = np.frombuffer(np.random.default_rng(3).bytes(16 * len(rows)), "V16")
    rows["size"] = 7
    ref, _ = write_snapshot(
        io,
        None,
        np.zeros(0, RECORD_DTYPE),
        path="snapshots/00000000000000000001-t",
        generation=1,
        shard_keys=10_000,
        fp_bits=24,
        created_at=0.0,
        base_rows=rows,
    )
    assert len(ref.shard_keys) == 8
    assert ref.keys == len(rows)
    filters, rebuilt = read_filters(io, ref)
    built = KeyFilter(FPR, filters, ref.shard_bits)
    assert rebuilt == 0
    assert all(built.contains_many([bytes(k) for k in rows["key"][:5000]]))
    # A key asked alone takes the scalar path: the same answers, shards and growth alike.
    grown, absent = [os.urandom(16) for _ in range(50)], [os.urandom(16) for _ in range(50)]
    built.add_many(grown)
    sample = [bytes(k) for k in rows["key"][:200]] + grown + absent
    assert [key in built for key in sample] == built.contains_many(sample).tolist()
    assert built.count_leading(sample) == 250
    assert built.count_leading(absent + sample) == 0


def test_migration_from_format_1(backend: CountingBackend, clock: Clock) -> None:
    # A bucket as the previous release left it: CURRENT, usage.bin, one unfolded segment.
    io = io_of(backend)
    old = make_chain(4, seed=9)
    rows = np.zeros(len(old), USAGE_DTYPE)
    rows["key"] = np.frombuffer(b"".join(old), "V16")
    rows["size"], rows["last_used"] = 100, clock.now
    bloom_path, usage_path = snapshot_paths(1)
    io.put(usage_path, encode_usage(rows))
    pointer = Current(1, bloom_path, usage_path, len(rows), "", (), 600.0, clock.now)
    io.put(CURRENT_NAME, pointer.to_json())
    newer = make_chain(2, seed=10)
    writer = reader(backend, clock, "old-writer")
    write_chain(writer, newer)
    writer.flush()
    # Before any compactor: a new instance reads the segments the format-1 way.
    m = member(backend, clock, "m")
    assert all(m.may_contain(k) for k in newer)
    assert m.compact_once() == "takeover"
    assert m.compact_once() == "cycle:snapshot"
    entry = latest(backend)
    assert entry.snapshot is not None
    assert entry.snapshot.keys == 6
    fresh = reader(backend, clock, "fresh")
    assert all(fresh.may_contain(k) for k in old + newer)
    assert len(load_usage(backend, PREFIX, FP)) == 6


def test_operator_compaction_drops_keys_and_hands_the_lease_back(
    backend: CountingBackend, clock: Clock
) -> None:
    engine = member(backend, clock, "engine")
    engine.compact_once()
    chain = make_chain(5, seed=11)
    write_chain(engine, chain)
    engine.flush()
    engine.compact_once()
    report = compact(backend, PREFIX, FP, fpr=FPR, clock=clock, drop_keys=[bytes(chain[0])])
    assert not report.lost_race
    assert report.keys == 4
    assert report.keys_dropped == 1
    assert latest(backend).holder == ""
    write_chain(engine, make_chain(1, seed=13))
    engine.flush()
    assert engine.compact_once() == "lost"  # the operator took the lease meanwhile
    engine.refresh()
    assert engine.compact_once() == "takeover"
    usage = load_usage(backend, PREFIX, FP)
    assert bytes(chain[0]) not in usage
    assert bytes(chain[1]) in usage


def test_full_listing_rebuilds_a_corrupt_snapshot(backend: CountingBackend, clock: Clock) -> None:
    engine = member(backend, clock, "engine")
    engine.compact_once()
    chain = make_chain(3, seed=12)
    write_chain(engine, chain)
    engine.flush()
    compact(backend, PREFIX, FP, fpr=FPR, clock=clock)
    snapshot = latest(backend).snapshot
    assert snapshot is not None
    backend.inner.put(f"{ROOT}{snapshot.usage_path(0)}", b"garbage")
    listing = [(bytes(k), 100, clock.now) for k in chain]
    report = compact(backend, PREFIX, FP, fpr=FPR, clock=clock, full_listing_keys=listing)
    assert report.keys == 3
    assert not report.lost_race
    assert len(load_usage(backend, PREFIX, FP)) == 3


def test_open_never_blocks_past_its_timeout(backend: CountingBackend, clock: Clock) -> None:
    slow = CountingBackend(backend)
    original = slow.get

    def sluggish(key: str, *, max_bytes: int | None = None) -> bytes | None:
        time.sleep(0.3)
        return original(key, max_bytes=max_bytes)

    slow.get = sluggish  # type: ignore[method-assign]
    started = time.monotonic()
    m = Manifest.open(slow, PREFIX, FP, capacity=1000, fpr=FPR, clock=clock, open_timeout=0.1)
    assert time.monotonic() - started < 0.3
    assert not m.loaded
    deadline = time.monotonic() + 10
    while not m.loaded and time.monotonic() < deadline:
        time.sleep(0.05)
    assert m.loaded


def test_ten_million_key_snapshot_round_trip() -> None:
    # The scale the issue names: two 8M-key shards written and read back through a bucket.
    io = io_of(MemoryBackend())
    rows = np.zeros(10_000_000, USAGE_DTYPE)
    rows["key"] = np.frombuffer(np.random.default_rng(4).bytes(16 * len(rows)), "V16")
    rows["size"] = 1
    ref, _ = write_snapshot(
        io,
        None,
        np.zeros(0, RECORD_DTYPE),
        path="snapshots/00000000000000000001-big",
        generation=1,
        shard_keys=8_000_000,
        fp_bits=24,
        created_at=0.0,
        base_rows=rows,
    )
    assert ref.keys == len(rows)
    assert len(ref.shard_keys) == 2
    filters, rebuilt = read_filters(io, ref)
    assert rebuilt == 0
    loaded = KeyFilter(FPR, filters, ref.shard_bits)
    sample = rows["key"][:: len(rows) // 20_000]
    assert loaded.contains_many([bytes(k) for k in sample]).all()
    assert loaded.nbytes / len(rows) <= 4
    probes = np.random.default_rng(5).bytes(16 * 200_000)
    absent = [probes[i : i + 16] for i in range(0, len(probes), 16)]
    assert loaded.contains_many(absent).sum() <= 2  # 2**-24 each: 0.01 expected


def test_top_usage_streams_shards_and_matches_the_whole_table(
    backend: CountingBackend, clock: Clock
) -> None:
    w = reader(backend, clock, "w")
    chain = make_chain(300, seed=14)
    write_chain(w, chain)
    for i, key in enumerate(chain[:40]):
        w.record_hits([key] * (i % 7 + 1))
    w.flush()
    report = compact(
        backend, PREFIX, FP, fpr=FPR, clock=clock, policy=CompactionPolicy(shard_keys=50)
    )
    assert report.shards == 8
    for _ in range(10):  # the hottest keys now, and not in the snapshot yet: from the segment
        w.record_hits(chain[100:105])
    w.flush()
    whole = load_usage(backend, PREFIX, FP)
    top = load_usage(backend, PREFIX, FP, top=20)
    assert len(whole) == 300
    assert top.rows.tobytes() == hottest(whole.rows, 20).tobytes()
    assert {bytes(k) for k in chain[100:105]} <= {bytes(k) for k in top.rows["key"]}


def test_a_vanished_snapshot_never_raises_and_a_full_compaction_heals_it(
    backend: CountingBackend, clock: Clock
) -> None:
    c = member(backend, clock, "c")
    c.compact_once()
    chain = make_chain(3, seed=15)
    write_chain(c, chain)
    c.flush()
    compact(backend, PREFIX, FP, fpr=FPR, clock=clock)
    snapshot = latest(backend).snapshot
    assert snapshot is not None
    for path in snapshot.paths():  # a lifecycle rule expired it
        backend.inner.delete_many([ROOT + path])
    r = reader(backend, clock)  # does not raise; counts the fault
    assert r.loaded
    assert r.stats()["refresh_errors"] == 1
    listing = [(bytes(k), 100, clock.now) for k in chain]
    compact(backend, PREFIX, FP, fpr=FPR, clock=clock, full_listing_keys=listing)
    r.refresh()
    assert all(r.may_contain(k) for k in chain)


def test_a_snapshot_past_its_age_is_rewritten_without_news(
    backend: CountingBackend, clock: Clock
) -> None:
    c = member(backend, clock, "c")
    c.compact_once()
    write_chain(c, make_chain(3, seed=16))
    c.flush()
    compact(backend, PREFIX, FP, fpr=FPR, clock=clock)
    c.refresh()
    assert c.compact_once() == "takeover"
    clock.advance(POLICY.snapshot_max_age_s + 1)
    assert c.compact_once() == "cycle:snapshot"


def test_an_instance_paused_past_the_swept_log_catches_up_and_never_forks_it(
    backend: CountingBackend, clock: Clock
) -> None:
    # Entries behind the newest 64 are swept: a long pause must not let anyone re-create
    # a swept version number (that would fork the log and delete the live snapshot).
    mono = Clock(0.0)
    policy = CompactionPolicy(snapshot_records=50, grace_s=60.0)

    def join(name: str, compacting: bool = True) -> Manifest:
        return Manifest.open(backend, PREFIX, FP, capacity=1000, fpr=FPR, instance_id=name,
                             clock=clock, monotonic=mono,
                             compaction=policy if compacting else None)  # fmt: skip

    a, paused = join("a"), join("paused")
    a.compact_once()
    paused.refresh()
    writer = join("w", compacting=False)
    for step in range(200):  # about 67 minutes of 20-second cycles while "paused" sleeps
        write_chain(writer, make_chain(1, seed=1000 + step))
        writer.flush()
        clock.advance(20)
        mono.advance(20)
        a.compact_once()
    newest = latest(backend).version
    assert not backend.inner.get(f"{ROOT}log/{paused.version + 1:020d}.json")  # swept
    # The paused instance wakes: neither its takeover nor its refresh forks the log.
    assert paused.compact_once() == "lost"
    assert latest(backend).version == newest
    paused.refresh()
    assert paused.version == newest
    assert all(paused.may_contain(k) for k in make_chain(1, seed=1199))
    assert paused.compact_once() == "wait"
    assert a.compact_once().startswith("cycle:")


def test_a_holder_paused_past_the_swept_log_is_fenced(
    backend: CountingBackend, clock: Clock
) -> None:
    io = io_of(backend)
    policy = CompactionPolicy(grace_s=0.0, keep_versions=2)
    sleeper = Compactor(io, "sleeper", policy, clock=clock)
    entry = sleeper.take_over(None)
    assert entry is not None
    other = Compactor(io, "other", policy, clock=clock)
    current = other.take_over(entry)
    assert current is not None
    for _ in range(10):
        clock.advance(60)
        report = other.cycle(current, force_snapshot=True)
        assert report.entry is not None
        current = report.entry
    other.sweep(current)
    assert not backend.inner.get(f"{ROOT}log/{entry.version + 1:020d}.json")
    writer = reader(backend, clock, "w")
    write_chain(writer, make_chain(2, seed=17))
    writer.flush()
    assert sleeper.cycle(entry).action == "fenced"
    assert latest(backend) == current


# --- review findings: each test failed before its fix -------------------------------------


def test_a_failed_log_publish_never_costs_the_segments_it_read(
    backend: CountingBackend, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = member(backend, clock, "a")
    a.compact_once()
    chain = make_chain(5, seed=20)
    write_chain(a, chain)
    a.flush()
    real_append = ManifestLog.append

    def timeout(self: ManifestLog, entry: LogEntry) -> bool:
        raise StorageError("injected: the log entry PUT timed out, not written")

    monkeypatch.setattr(ManifestLog, "append", timeout)
    assert a.compact_once() == "error"
    monkeypatch.setattr(ManifestLog, "append", real_append)
    assert len(segment_keys(backend)) == 1  # not deleted: nothing published them
    assert a.compact_once() == "cycle:delta"
    assert all(reader(backend, clock, "r").may_contain(k) for k in chain)


def test_a_corrupt_newest_entry_is_skipped_and_never_forks_the_log(
    backend: CountingBackend, clock: Clock
) -> None:
    a = member(backend, clock, "a")
    a.compact_once()
    chain = make_chain(3, seed=21)
    write_chain(a, chain)
    a.flush()
    a.compact_once()
    top = latest(backend).version
    backend.inner.put(f"{ROOT}log/{top + 1:020d}.json", b'{"format": 2, "version": 1e999')
    backend.inner.put(f"{ROOT}LATEST", b'{"version": Infinity}')
    newcomer = member(backend, clock, "newcomer")  # never raises, never starts a new log
    assert newcomer.version == top
    assert all(newcomer.may_contain(k) for k in chain)
    assert newcomer.compact_once() in {"wait", "lost"}
    assert backend.inner.get(f"{ROOT}log/{1:020d}.json") is not None  # v1 untouched
    more = make_chain(2, seed=22)
    write_chain(a, more)
    a.flush()
    assert a.compact_once() == "cycle:delta"  # published past the corrupt entry
    assert latest(backend).version == top + 2
    newcomer.refresh()
    assert all(newcomer.may_contain(k) for k in more)


def test_hostile_entry_fields_are_refused_not_raised(
    backend: CountingBackend, clock: Clock
) -> None:
    a = member(backend, clock, "a")
    a.compact_once()
    compact(backend, PREFIX, FP, fpr=FPR, clock=clock)
    good = latest(backend)
    assert good.snapshot is not None
    for snapshot in ({"shard_keys": [10**16]}, {"fp_bits": 12}):
        raw = json.loads(good.to_json())
        raw["snapshot"].update(snapshot)
        with pytest.raises(CodecError):
            LogEntry.from_json(json.dumps(raw).encode())
    with pytest.raises(CodecError):
        LogEntry.from_json(b'{"format": 2, "version": 1e999}')
    backend.inner.put(f"{ROOT}LATEST", b"[" * 100_000)
    assert reader(backend, clock, "r").version == good.version


def test_close_never_races_a_compactor_cycle_in_progress(
    backend: CountingBackend, clock: Clock
) -> None:
    a = member(backend, clock, "a")
    a.compact_once()
    write_chain(a, make_chain(4, seed=23))
    a.flush(force=True)
    a._compact_lock.acquire()
    try:
        a.close(timeout=0.1)
    finally:
        a._compact_lock.release()
    assert latest(backend).holder == "a"  # not released under a running cycle
    assert len(segment_keys(backend)) == 1  # and nothing it read was deleted


def test_sweep_spares_what_a_kept_entry_still_names(backend: CountingBackend, clock: Clock) -> None:
    a = member(backend, clock, "a")
    a.compact_once()
    write_chain(a, make_chain(3, seed=24))
    a.flush()
    compact(backend, PREFIX, FP, fpr=FPR, clock=clock)
    first = latest(backend)
    clock.advance(2 * 3600)  # the first snapshot's objects are hours old
    compact(backend, PREFIX, FP, fpr=FPR, clock=clock)  # sweeps at its first publish
    assert first.snapshot is not None
    left = {i.key for i in backend.inner.list(ROOT + "snapshots/")}
    assert {ROOT + path for path in first.snapshot.paths()} <= left


def test_keys_a_prune_dropped_stop_being_advertised_at_its_snapshot(
    backend: CountingBackend, clock: Clock
) -> None:
    a = member(backend, clock, "a")
    a.compact_once()
    w = reader(backend, clock, "w")
    chain = make_chain(4, seed=25)
    write_chain(w, chain)
    w.flush()
    a.compact_once()
    r = reader(backend, clock, "r")
    assert all(r.may_contain(k) for k in chain)  # from a delta
    compact(backend, PREFIX, FP, fpr=FPR, clock=clock, drop_keys=[bytes(k) for k in chain])
    r.refresh()
    assert not any(r.may_contain(k) for k in chain)


def test_a_snapshot_longer_than_the_lease_keeps_the_lease_with_heartbeats(
    backend: CountingBackend, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    mono = Clock(0.0)
    policy = CompactionPolicy(lease_s=60.0, shard_keys=10, snapshot_records=1)
    a = Manifest.open(backend, PREFIX, FP, capacity=1000, fpr=FPR, instance_id="a",
                      clock=clock, monotonic=mono, compaction=policy)  # fmt: skip
    a.compact_once()
    write_chain(a, make_chain(100, seed=26))
    a.flush()
    real_put = ManifestIO.put
    writes: list[str] = []

    def slow_put(self: ManifestIO, path: str, data: bytes, *, if_absent: bool = False) -> bool:
        if path.startswith("snapshots/"):
            mono.advance(15.0)  # every shard object takes a quarter of the lease
        writes.append(path)
        return real_put(self, path, data, if_absent=if_absent)

    monkeypatch.setattr(ManifestIO, "put", slow_put)
    before = latest(backend).version
    assert a.compact_once() == "cycle:snapshot"
    beats = [p for p in writes if p.startswith("log/")]
    assert len(beats) >= 3  # heartbeats between the 16 shard objects, then the snapshot
    assert latest(backend).version == before + len(beats)
