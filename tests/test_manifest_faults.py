"""Faults on the wire between the manifest and the bucket: slow compactors, noisy reads.

* **Two compactors, one slow** (issue 12, item 4): one compactor is held at one of its
  publication steps (a delta PUT, a snapshot shard PUT, its log entry create, the
  ``LATEST`` hint PUT) while the other takes the lease over, runs cycles and cleans up
  (superseded objects deleted at once, old log entries swept). The hold is a gate in the
  backend that the test opens, so every interleaving is exact. Afterwards a fresh reader
  must see every key, and plain ``compact`` and ``prune`` must work without ``--full``.
* **A read corrupted in transit** (issue 12, item 3): the body of one GET is garbled, the
  object in the bucket is intact. Readers must not lose the segment for their lifetime,
  and the compactor must never delete a segment as folded or corrupt on such a read.

Everything runs on a MemoryBackend with injected clocks; threads wait on Events with
bounded deadlines, never on sleeps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from cli_support import Bucket

from s3kv.keys import BlockHash, block_object_key
from s3kv.manifest import (
    CompactionPolicy,
    LogEntry,
    Manifest,
    ManifestIO,
    ManifestLog,
    compact,
    load_usage,
)
from s3kv.ops.compaction import compact_scope
from s3kv.ops.prune import execute_prune, plan_prune
from s3kv.ops.scope import resolve_scope
from s3kv.storage import Backend, DelegatingBackend, MemoryBackend
from tests.test_manifest import PREFIX, Clock, make_chain, write_chain

FPR = 1e-6
DAY = 86400.0
WAIT_S = 30.0  # a bound on every wait for another thread: never reached when all is well


# --- the wire ----------------------------------------------------------------------------


@dataclass
class Hold:
    """One PUT stopped on its way: ``arrived`` when it is held, sent on when released."""

    prefix: str
    after: bool  # hold the response (the PUT already took effect) rather than the request
    arrived: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)

    def wait(self) -> None:
        self.arrived.set()
        if not self.released.wait(WAIT_S):
            raise TimeoutError(f"the hold on {self.prefix} was never released")


class Wire(DelegatingBackend):
    """The bucket seen through a wire the test controls, one request at a time.

    :meth:`hold` stops the next PUT of a key under a prefix; :meth:`garble` replaces the
    bodies of the next GETs of one key (the object in the bucket stays intact).
    """

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self._holds: list[Hold] = []
        self._garbles: dict[str, list[Callable[[bytes], bytes]]] = {}
        self._lock = threading.Lock()
        self.gets: dict[str, int] = {}

    def hold(self, prefix: str, *, after: bool = False) -> Hold:
        hold = Hold(prefix, after)
        with self._lock:
            self._holds.append(hold)
        return hold

    def garble(self, key: str, *mutations: Callable[[bytes], bytes]) -> None:
        with self._lock:
            self._garbles.setdefault(key, []).extend(mutations)

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        with self._lock:
            hold = next((h for h in self._holds if key.startswith(h.prefix)), None)
            if hold is not None:
                self._holds.remove(hold)
        if hold is not None and not hold.after:
            hold.wait()
        written = self.inner.put(key, data, if_absent=if_absent)
        if hold is not None and hold.after:
            hold.wait()
        return written

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        data = self.inner.get(key, max_bytes=max_bytes)
        with self._lock:
            self.gets[key] = self.gets.get(key, 0) + 1
            pending = self._garbles.get(key)
            mutate = pending.pop(0) if pending else None
        return data if data is None or mutate is None else mutate(data)


def flip(at: int) -> Callable[[bytes], bytes]:
    """A body with the byte at ``at`` (from the end when negative) inverted."""

    def mutate(data: bytes) -> bytes:
        body = bytearray(data)
        body[at] ^= 0xFF
        return bytes(body)

    return mutate


def truncate(data: bytes) -> bytes:
    """A body cut short (a connection that dropped mid-body, unnoticed)."""
    return data[: len(data) // 2]


class Thread:
    """Runs ``fn`` on a thread; :meth:`result` joins it (bounded) and returns or re-raises."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._out: list[Any] = []
        self._thread = threading.Thread(target=lambda: self._out.append(self._call(fn)))
        self._thread.start()

    @staticmethod
    def _call(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except BaseException as exc:  # NOTE: re-raised in the test's thread by result()
            return exc

    def result(self) -> Any:
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), "the slow compactor never finished"
        (out,) = self._out
        if isinstance(out, BaseException):
            raise out
        return out


# --- a fleet on one bucket ----------------------------------------------------------------


class Fleet:
    """Instances of one fingerprint sharing a bucket, epoch clock and monotonic clock."""

    def __init__(self, *, keep_versions: int = 2) -> None:
        self.clock = Clock(1_700_000_000.0 - 20 * DAY)
        self.mono = Clock(1000.0)
        self.bucket = Bucket(MemoryBackend(clock=self.clock), "memory://", "test")
        self.bucket.write_identity()
        self.fp = self.bucket.fingerprint
        self.wire = Wire(self.bucket.backend)
        self.root = f"{PREFIX}/{self.fp}/manifest/"
        self.policy = CompactionPolicy(
            interval_s=20.0,
            lease_s=60.0,
            max_deltas=2,
            snapshot_records=100,
            keep_versions=keep_versions,
        )
        self.writer = self.open("writer", compacting=False)
        self.keys: list[BlockHash] = []

    def open(self, name: str, *, compacting: bool = True, **policy: Any) -> Manifest:
        chosen = CompactionPolicy(**{**vars(self.policy), **policy}) if compacting else None
        return Manifest.open(self.wire, PREFIX, self.fp, capacity=1000, fpr=FPR,
                             instance_id=name, clock=self.clock, monotonic=self.mono,
                             grace_s=0.0, compaction=chosen)  # fmt: skip

    def write(self, n: int, seed: int) -> list[BlockHash]:
        """``n`` new blocks: their objects, then their records (one segment)."""
        chain = make_chain(n, seed=seed)
        for key in chain:
            self.wire.put(block_object_key(PREFIX, self.fp, key), b"block")
        write_chain(self.writer, chain)
        assert self.writer.flush() == n
        self.keys += chain
        return chain

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.mono.advance(seconds)

    def latest(self) -> LogEntry:
        entry = ManifestLog(ManifestIO(self.wire, PREFIX, self.fp)).latest()
        assert entry is not None
        return entry

    def visible(self, keys: list[BlockHash] | None = None) -> int:
        """Keys a fresh reader sees."""
        fresh = Manifest.open(self.wire, PREFIX, self.fp, capacity=1000, fpr=FPR,
                              instance_id="fresh", clock=self.clock)  # fmt: skip
        return sum(fresh.may_contain(key) for key in self.keys if keys is None or key in keys)

    def operator_compact(self, **kwargs: Any) -> None:
        report = compact(self.wire, PREFIX, self.fp, fpr=FPR, clock=self.clock, grace_s=0.0,
                         policy=self.policy, **kwargs)  # fmt: skip
        assert not report.lost_race


# --- item 4: two compactors, one slow -------------------------------------------------------

#: Where the slow compactor is held: (key prefix under the manifest, its policy overrides).
STEPS: dict[str, tuple[str, dict[str, Any]]] = {
    "delta": ("deltas/", {"snapshot_records": 10**6}),
    "snapshot": ("snapshots/", {"snapshot_records": 1, "shard_keys": 16}),
    "log": ("log/", {"snapshot_records": 10**6}),
    "latest": ("LATEST", {"snapshot_records": 10**6}),
}


def race(fleet: Fleet, step: str, *, after: bool, other: str) -> str:
    """Hold compactor ``slow`` at ``step`` while ``other`` compacts and cleans up meanwhile.

    Returns what the slow compactor's round ended with. 450 keys are written in all.
    """
    prefix, overrides = STEPS[step]
    slow = fleet.open("slow", **overrides)
    assert slow.compact_once() == "takeover"
    fleet.write(50, seed=1)  # 20 days ago: what prune deletes at the end
    fleet.clock.now += 20 * DAY
    fleet.advance(20)
    assert slow.compact_once().startswith("cycle:")
    fleet.write(40, seed=2)  # what the slow compactor folds when it is held
    fleet.advance(20)
    hold = fleet.wire.hold(fleet.root + prefix, after=after)
    held = Thread(slow.compact_once)
    assert hold.arrived.wait(WAIT_S)
    # The other compactor takes over, folds, snapshots and cleans up while `slow` is held.
    fast = fleet.open("fast")
    if other == "operator":
        fleet.operator_compact()  # takes the lease at once, whatever the lease says
    fleet.advance(10 * fleet.policy.lease_s)  # `slow` said nothing for ten leases
    fast.refresh()
    assert fast.compact_once() == "takeover"
    for round_ in range(9):
        fleet.write(40, seed=10 + round_)
        fleet.advance(3600)  # past the grace period, and an hourly sweep in every cycle
        if other == "operator" and round_ % 3 == 1:
            fleet.operator_compact()
            fast.refresh()
            assert fast.compact_once() == "takeover"
        else:
            assert fast.compact_once().startswith("cycle:")
    hold.released.set()
    outcome: str = held.result()
    assert len(fleet.keys) == 450
    return outcome


def check_after_race(fleet: Fleet) -> None:
    """Every key visible; the slow compactor stepped down; compact and prune work plainly."""
    assert fleet.visible() == 450
    assert fleet.latest().holder == "fast"
    fast = fleet.open("fast2")
    assert fast.compact_once() == "wait"
    # Plain `s3kv compact` (no --full): no lost race, every key.
    scope = resolve_scope(fleet.wire, PREFIX)
    compacted = compact_scope(fleet.wire, scope, prefix=PREFIX, fpr=FPR, clock=fleet.clock)
    ((_, report),) = compacted.reports
    assert not report.lost_race
    assert report.keys == 450
    # Plain `s3kv prune`: the 50 keys written 20 days ago go, the manifest is rewritten.
    plan = plan_prune(fleet.wire, PREFIX, scope, older_than=7 * DAY, clock=fleet.clock)
    assert plan.to_delete.objects == 50
    pruned = execute_prune(fleet.wire, plan, prefix=PREFIX, fpr=FPR, clock=fleet.clock)
    assert pruned.complete
    (outcome,) = pruned.outcomes
    assert outcome.manifest_error is None
    assert outcome.manifest_keys_dropped == 50
    assert fleet.visible(fleet.keys[50:]) == 400
    assert fleet.visible(fleet.keys[:50]) == 0


@pytest.mark.parametrize("other", ["engine", "operator"], ids=["lease-expired", "operator"])
@pytest.mark.parametrize("after", [False, True], ids=["request", "response"])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_a_slow_compactor_never_hides_keys_from_a_fresh_reader(
    step: str, after: bool, other: str
) -> None:
    # `other`: an engine that took the lease over once the slow one's had expired, or an
    # operator's compaction (it takes the lease at once). `after`: the held PUT had not
    # reached the bucket yet (request), or had taken effect and its answer is held (response).
    fleet = Fleet()
    outcome = race(fleet, step, after=after, other=other)
    # Only a publication already complete (the hint PUT comes after it) stands; every other
    # step ends with the slow compactor stepping down (its log entry refused or a stray).
    assert outcome == ("cycle:delta" if step == "latest" else "lost")
    check_after_race(fleet)


def test_a_stale_latest_hint_naming_swept_objects_costs_a_probe_not_the_keys() -> None:
    # The slow compactor's LATEST PUT lands after the other has published and cleaned up for
    # hours: the hint names a version whose snapshot and deltas were deleted (the entry
    # itself is kept: 64 versions are).
    fleet = Fleet(keep_versions=64)
    assert race(fleet, "latest", after=False, other="engine") == "cycle:delta"
    stale = ManifestLog(ManifestIO(fleet.wire, PREFIX, fleet.fp)).hint()
    entry = ManifestLog(ManifestIO(fleet.wire, PREFIX, fleet.fp)).read(stale)
    assert entry is not None
    assert stale < fleet.latest().version
    assert not any(fleet.wire.inner.get(fleet.root + path) for path in entry.objects())
    check_after_race(fleet)


def test_a_reader_that_lagged_past_the_grace_period_jumps_to_the_newest_entry() -> None:
    fleet = Fleet(keep_versions=64)
    compactor = fleet.open("c", snapshot_records=1)
    assert compactor.compact_once() == "takeover"
    lagging = fleet.open("lagging", compacting=False)
    for round_ in range(3):  # three snapshots; each deletes the one before it at once
        fleet.write(10, seed=round_)
        fleet.advance(20)
        assert compactor.compact_once() == "cycle:snapshot"
    # The next entry names a snapshot that is gone: the newest one is loaded instead.
    lagging.refresh()
    assert lagging.stats()["refresh_errors"] == 0
    assert lagging.version == fleet.latest().version
    assert sum(lagging.may_contain(key) for key in fleet.keys) == 30


# --- item 3: reads corrupted in transit ------------------------------------------------------


def segment_names(fleet: Fleet) -> list[str]:
    return [info.key for info in fleet.wire.inner.list(fleet.root + "segments/")]


#: Garbled bodies of the next reads of one object: one read, both reads of one refresh
#: alike in transit (a body cut short the same way twice), or differently.
GARBLES: dict[str, tuple[Callable[[bytes], bytes], ...]] = {
    "once": (flip(-1),),
    "twice-differently": (flip(-1), flip(-2)),
    "twice-cut-short": (truncate, truncate),
}


@pytest.mark.parametrize("garble", sorted(GARBLES))
def test_a_segment_corrupted_in_transit_is_read_again_by_a_reader(garble: str) -> None:
    # No log yet (format 1, or a server without conditional PUT): readers read segments.
    fleet = Fleet()
    reader = fleet.open("reader", compacting=False)
    fleet.write(8, seed=1)
    (segment,) = segment_names(fleet)
    fleet.wire.garble(segment, *GARBLES[garble])
    reader.refresh()
    for _ in range(3):  # three clean refreshes
        reader.refresh()
    assert sum(reader.may_contain(key) for key in fleet.keys) == 8
    assert reader.stats()["segments_corrupt"] == 0
    assert fleet.visible() == 8


@pytest.mark.parametrize("following", [False, True], ids=["startup", "following"])
@pytest.mark.parametrize("garble", sorted(GARBLES))
def test_a_delta_corrupted_in_transit_is_read_again_by_a_reader(
    garble: str, following: bool
) -> None:
    fleet = Fleet()
    compactor = fleet.open("c")
    assert compactor.compact_once() == "takeover"
    reader = fleet.open("reader", compacting=False) if following else None
    fleet.write(8, seed=1)
    fleet.advance(20)
    assert compactor.compact_once() == "cycle:delta"
    (delta,) = fleet.latest().deltas
    fleet.wire.garble(fleet.root + delta.path, *GARBLES[garble])
    if reader is None:
        reader = fleet.open("reader", compacting=False)  # the first load meets the garble
    for _ in range(4):  # the garbled one, then three clean refreshes
        reader.refresh()
    assert sum(reader.may_contain(key) for key in fleet.keys) == 8
    assert reader.stats()["segments_corrupt"] == 0


class Noise(Wire):
    """Garbles every read of the objects under ``prefix``, differently every time."""

    def __init__(self, inner: Backend, prefix: str) -> None:
        super().__init__(inner)
        self.prefix = prefix
        self._noise = 0

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        data = super().get(key, max_bytes=max_bytes)
        if data is None or not key.startswith(self.prefix):
            return data
        self._noise += 1
        body = bytearray(data)
        body[24 + self._noise % 8] ^= 1 + self._noise % 255  # NOTE: in the header's checksum
        return bytes(body)


def test_unreadable_segments_cost_bounded_reads_and_memory() -> None:
    # A writer that plants 300 segments no read ever verifies (noise on the wire, or a
    # hostile writer): each is read again a few times, a bounded number at once, then
    # given up and counted.
    fleet = Fleet()
    for seed in range(300):
        fleet.write(1, seed=seed)
    noisy = Noise(fleet.bucket.backend, fleet.root + "segments/")
    reader = Manifest.open(noisy, PREFIX, fleet.fp, capacity=1000, fpr=FPR,
                           instance_id="reader", clock=fleet.clock)  # fmt: skip
    held = reader._unread
    assert len(held) == held.names == 256  # the other 44 were given up at once
    assert reader.stats()["segments_corrupt"] == 44
    for _ in range(16):  # retries after 1, 2, 4, 8 refreshes, then given up
        reader.refresh()
        assert len(held) <= held.names
    assert len(held) == 0
    assert reader.stats()["segments_corrupt"] == 300
    reads = [n for key, n in noisy.gets.items() if key.startswith(noisy.prefix)]
    assert len(reads) == 300
    assert max(reads) == 2 * held.attempts  # two GETs (a read and its check) per attempt
    reader.refresh()
    again = [n for key, n in noisy.gets.items() if key.startswith(noisy.prefix)]
    assert again == reads  # given up: never read again


@pytest.mark.parametrize("operator", [False, True], ids=["engine", "operator"])
@pytest.mark.parametrize("garble", sorted(GARBLES))
def test_the_compactor_never_deletes_a_segment_read_corrupt_in_transit(
    garble: str, operator: bool
) -> None:
    fleet = Fleet()
    compactor = fleet.open("c")
    assert compactor.compact_once() == "takeover"
    fleet.write(8, seed=1)
    (segment,) = segment_names(fleet)
    fleet.wire.garble(segment, *GARBLES[garble])
    fleet.advance(20)
    if operator:
        fleet.operator_compact()
    else:
        compactor.compact_once()
    if garble == "once":
        assert segment_names(fleet) == []  # the second read verified: folded, then deleted
    else:
        assert segment_names(fleet) == [segment]  # neither folded nor deleted
    fleet.advance(20)
    if operator:
        fleet.operator_compact()
    else:
        compactor.compact_once()
    assert segment_names(fleet) == []
    assert fleet.visible() == 8


def test_the_compactor_deletes_a_segment_corrupt_in_the_bucket() -> None:
    fleet = Fleet()
    compactor = fleet.open("c")
    assert compactor.compact_once() == "takeover"
    fleet.write(8, seed=1)
    (segment,) = segment_names(fleet)
    body = fleet.wire.inner.get(segment)
    assert body is not None
    fleet.wire.inner.put(segment, flip(-1)(body))  # corrupt where it is stored
    fleet.advance(20)
    assert compactor.compact_once() == "cycle:heartbeat"
    assert segment_names(fleet) == []


@pytest.mark.parametrize("garble", sorted(GARBLES))
def test_a_merge_never_drops_a_delta_read_corrupt_in_transit(garble: str) -> None:
    fleet = Fleet()
    first = fleet.open("first")
    assert first.compact_once() == "takeover"
    for round_ in range(2):  # two deltas: the next cycle merges them (max_deltas=2)
        fleet.write(8, seed=round_)
        fleet.advance(20)
        assert first.compact_once() == "cycle:delta"
    first.close(flush=False)  # hands the lease over; the next term reads the deltas back
    second = fleet.open("second")
    assert second.compact_once() == "takeover"
    oldest = fleet.latest().deltas[0]
    fleet.wire.garble(fleet.root + oldest.path, *GARBLES[garble])
    fleet.write(8, seed=2)
    fleet.advance(20)
    if garble != "once":  # both reads failed: nothing published, the cycle is retried
        assert second.compact_once() == "error"
        assert fleet.wire.inner.get(fleet.root + oldest.path) is not None
        fleet.advance(20)
    assert second.compact_once() == "cycle:merge"
    for _ in range(3):  # past the grace period: the merged deltas are deleted
        fleet.write(1, seed=10 + _)
        fleet.advance(20)
        second.compact_once()
    assert fleet.wire.inner.get(fleet.root + oldest.path) is None
    assert fleet.visible() == len(fleet.keys)


def test_load_usage_reads_a_segment_corrupted_once_in_transit_again() -> None:
    fleet = Fleet()
    fleet.write(8, seed=1)
    (segment,) = segment_names(fleet)
    fleet.wire.garble(segment, flip(-1))
    usage = load_usage(fleet.wire, PREFIX, fleet.fp)
    assert (len(usage), usage.segments_corrupt) == (8, 0)
