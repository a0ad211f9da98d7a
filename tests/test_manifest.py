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

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        self._op("get")
        return self.inner.get(key, max_bytes=max_bytes)

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
    return compact(backend, PREFIX, FP, fpr=FPR, clock=clock, **kwargs)


def row_of(usage: UsageTable, key: bytes) -> UsageRow:
    row = usage.row(key)
    assert row is not None
    return row


def segment_keys(backend: CountingBackend) -> list[str]:
    return [info.key for info in backend.inner.list(ROOT + "segments/")]


# --- startup ----------------------------------------------------------------------------


# --- refresh ----------------------------------------------------------------------------


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
    good = make_chain(1, seed=31)[0]
    with pytest.raises(ValueError, match="16 bytes"):
        m.record_writes([(good, ROOT_HASH, 1), (BlockHash(b"short"), ROOT_HASH, 1)])
    assert m.pending_records == 0
    assert not m.may_contain(good)  # NOTE: nothing of a refused batch is recorded
    m.record_writes([(good, ROOT_HASH, 7)])
    assert m.may_contain(good)
    assert m.pending_records == 1


@pytest.mark.parametrize("seed", range(6))
def test_a_usage_table_alone_folds_as_the_event_table_folds_it(seed: int) -> None:
    # fold() of a table with no records and no listing (a migrated usage.bin, shard by
    # shard) sorts the rows instead of building and reducing an event table: the same rows
    # for every value a row can hold, and a repeated key still takes the event table.
    from s3kv.manifest import usage as usage_module
    from s3kv.manifest.format import RECORD_DTYPE

    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 3000))
    table = np.zeros(n, USAGE_DTYPE)
    raw = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    raw[: n // 4, :8] = 7  # keys sharing their first half: the sort's second column decides
    table["key"] = raw.view("V16").ravel()
    parents = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    parents[rng.random(n) < 0.3] = 0xFF  # unknown parents
    table["parent"] = parents.view("V16").ravel()
    times = rng.choice([-np.inf, np.inf, np.nan, 0.0, 1e9, -5.0], size=(2, n))
    table["first_written"], table["last_used"] = times
    table["hits"] = rng.choice([0, 1, 2**32 - 1, 12345], size=n)
    table["size"] = rng.choice(np.array([0, 1, 2**64 - 1], np.uint64), size=n)
    table["pinned"] = rng.integers(0, 256, n)
    if seed % 2 and n > 1:
        table[n - 1] = table[0]  # a repeated key
    no_records = np.zeros(0, RECORD_DTYPE)
    drop = [bytes(table["key"][i]) for i in range(0, n, 7)]

    for dropped in ((), drop):
        folded = usage_module.fold(table.copy(), no_records, drop=dropped)
        expected = usage_module._fold_events(table.copy(), no_records, [], dropped)
        assert folded.dtype == expected.dtype
        assert folded.tobytes() == expected.tobytes()
    if seed % 2 and n > 1:
        assert usage_module._sorted_table(table) is None
