"""Oversized manifest objects are refused unread (issue 12, item 5).

Every manifest GET is capped at the longest object its kind can legitimately be: a log
entry, the ``LATEST`` hint, a segment, a delta (from its record count in the log entry), a
snapshot's usage and filter shards (from their key counts), the format-1 ``CURRENT`` and
``usage.bin``. 65 MiB of junk planted under each of those names must cost the reader no
memory (the peak traced while it opens, refreshes or compacts stays under 16 MB), count as
corrupt where corruption is counted, and hide nothing else. Compactors, the engine's and the
operator's, must neither crash nor delete good data because of it.

The bucket is a MemoryBackend behind a wire that copies every body it hands out, as reading
it off a socket does (a MemoryBackend hands out the bytes it holds, which costs nothing).
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Final, TypeVar

import numpy as np
import pytest

from s3kv.errors import CodecError
from s3kv.manifest import (
    RECORD_DTYPE,
    Manifest,
    ManifestIO,
    SegmentWriter,
    compact,
    load_usage,
)
from s3kv.manifest.format import (
    CURRENT_NAME,
    KIND_WRITE,
    MAX_SEGMENT_BYTES,
    MAX_SEGMENT_RECORDS,
    Current,
    max_encoded_len,
    segment_name,
    snapshot_paths,
)
from s3kv.manifest.log import LATEST_NAME, log_name
from s3kv.storage import Backend, DelegatingBackend, MemoryBackend
from tests.test_manifest_faults import FPR, PREFIX, Fleet, segment_names

T = TypeVar("T")

#: Planted by reference under every name tested (a MemoryBackend keeps the bytes it is
#: given), so the module allocates it once.
JUNK: Final = bytes(65 << 20)
#: The most a reader may allocate while it meets the junk: its real work here is a few MB.
MAX_PEAK: Final = 16 << 20


class Socket(DelegatingBackend):
    """Hands out a fresh copy of every body, as a read off a socket allocates one."""

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        data = self.inner.get(key, max_bytes=max_bytes)
        return None if data is None else bytes(memoryview(data))


def fleet_on_a_socket() -> Fleet:
    fleet = Fleet()
    fleet.wire.inner = Socket(fleet.wire.inner)
    return fleet


def plant(fleet: Fleet, path: str) -> None:
    """Junk at ``path`` (relative to the manifest prefix), straight into the bucket."""
    fleet.bucket.backend.put(fleet.root + path, JUNK)


def traced(fn: Callable[[], T]) -> tuple[T, int]:
    """``fn()`` and the peak of the memory traced while it ran (every thread)."""
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def raised(fn: Callable[[], object]) -> Callable[[], BaseException | None]:
    """``fn`` that returns what it raised (so :func:`traced` can measure a failing call)."""

    def call() -> BaseException | None:
        try:
            fn()
        except CodecError as exc:
            return exc
        return None

    return call


def compactor_with_deltas(fleet: Fleet, rounds: int, **policy: object) -> None:
    """A compactor ``c`` takes the lease and publishes one delta per round of 8 keys."""
    compactor = fleet.open("c", **policy)
    assert compactor.compact_once() == "takeover"
    for round_ in range(rounds):
        fleet.write(8, seed=round_)
        fleet.advance(20)
        assert compactor.compact_once() == "cycle:delta"
    compactor.close(flush=False)  # NOTE: hands the lease over: the next compactor reads back


def test_the_measure_sees_a_read_that_is_not_capped() -> None:
    # The control: through the socket, an uncapped GET of the junk costs its whole length.
    fleet = fleet_on_a_socket()
    plant(fleet, LATEST_NAME)
    data, peak = traced(lambda: fleet.wire.get(fleet.root + LATEST_NAME))
    assert data == JUNK
    assert peak > len(JUNK)


# --- (a) a segment ----------------------------------------------------------------------


def junk_segment(fleet: Fleet) -> None:
    plant(fleet, "segments/" + segment_name(round(fleet.clock() * 1000), "junk", 0))


def test_an_oversized_segment_is_skipped_as_corrupt_by_a_reader_with_no_log() -> None:
    fleet = fleet_on_a_socket()
    fleet.write(8, seed=1)
    junk_segment(fleet)
    reader, peak = traced(lambda: fleet.open("reader", compacting=False))
    assert peak < MAX_PEAK
    assert sum(reader.may_contain(key) for key in fleet.keys) == 8
    reader.refresh()
    stats = reader.stats()
    assert (stats["segments_corrupt"], stats["segments_read"], stats["refresh_errors"]) == (1, 1, 0)
    usage, peak = traced(lambda: load_usage(fleet.wire, PREFIX, fleet.fp))
    assert peak < MAX_PEAK
    assert (len(usage), usage.segments_corrupt) == (8, 1)


@pytest.mark.parametrize("operator", [False, True], ids=["engine", "operator"])
def test_the_compactor_deletes_an_oversized_segment_and_folds_the_rest(operator: bool) -> None:
    fleet = fleet_on_a_socket()
    compactor = fleet.open("c")
    assert compactor.compact_once() == "takeover"
    fleet.write(8, seed=1)
    junk_segment(fleet)
    fleet.advance(20)
    if operator:
        report, peak = traced(lambda: compact(fleet.wire, PREFIX, fleet.fp, fpr=FPR,
                                              clock=fleet.clock, grace_s=0.0))  # fmt: skip
        assert (report.segments_corrupt, report.segments_folded, report.keys) == (1, 1, 8)
    else:
        outcome, peak = traced(compactor.compact_once)
        assert outcome == "cycle:delta"
    assert peak < MAX_PEAK
    assert segment_names(fleet) == []  # the junk went as corrupt, the good one as folded
    assert fleet.visible() == 8


# --- (b) a delta the log names -------------------------------------------------------------


def test_an_oversized_delta_is_given_up_as_corrupt_and_hides_nothing_else() -> None:
    fleet = fleet_on_a_socket()
    compactor_with_deltas(fleet, 2)
    first, _ = fleet.latest().deltas
    plant(fleet, first.path)
    reader, peak = traced(lambda: fleet.open("reader", compacting=False))
    assert peak < MAX_PEAK
    assert sum(reader.may_contain(key) for key in fleet.keys[8:]) == 8
    for _ in range(16):  # read again after 1, 2, 4, 8 refreshes, then given up
        _, peak = traced(reader.refresh)
        assert peak < MAX_PEAK
    stats = reader.stats()
    assert (stats["segments_corrupt"], stats["refresh_errors"]) == (1, 0)
    assert len(reader._unread) == 0
    # The operator's usage table refuses a corrupt delta (no usage is better than wrong
    # usage); it says so without reading the junk.
    error, peak = traced(raised(lambda: load_usage(fleet.wire, PREFIX, fleet.fp)))
    assert isinstance(error, CodecError)
    assert peak < MAX_PEAK


@pytest.mark.parametrize("operator", [False, True], ids=["engine", "operator"])
def test_a_compactor_folds_past_an_oversized_delta(operator: bool) -> None:
    fleet = fleet_on_a_socket()
    compactor_with_deltas(fleet, 2)  # max_deltas=2: the next engine cycle merges them
    first, _ = fleet.latest().deltas
    plant(fleet, first.path)
    fleet.write(8, seed=2)
    fleet.advance(20)
    if operator:
        report, peak = traced(lambda: compact(fleet.wire, PREFIX, fleet.fp, fpr=FPR,
                                              clock=fleet.clock, grace_s=0.0))  # fmt: skip
        assert (report.keys, report.lost_race) == (16, False)
    else:
        second = fleet.open("second")
        assert second.compact_once() == "takeover"
        outcome, peak = traced(second.compact_once)
        assert outcome == "cycle:merge"
    assert peak < MAX_PEAK
    assert fleet.visible(fleet.keys[8:]) == 16  # all but the keys the junk replaced


# --- (c) snapshot shards ---------------------------------------------------------------------


def snapshot_of_40(fleet: Fleet) -> Manifest:
    """``c`` publishes a snapshot of 40 keys in 4 shards, then junk replaces two shard
    objects; returns ``c`` (it holds the lease)."""
    compactor = fleet.open("c", snapshot_records=1, shard_keys=16)
    assert compactor.compact_once() == "takeover"
    fleet.write(40, seed=1)
    fleet.advance(20)
    assert compactor.compact_once() == "cycle:snapshot"
    snapshot = fleet.latest().snapshot
    assert snapshot is not None
    assert len(snapshot.shard_keys) == 4
    # Junk as shard 0's filter (a reader rebuilds it from shard 0's usage) and as shard 1's
    # usage (readers never need it while shard 1's filter is good; a compactor does).
    plant(fleet, snapshot.filter_path(0))
    plant(fleet, snapshot.usage_path(1))
    return compactor


def test_oversized_snapshot_shards_cost_a_reader_a_rebuilt_filter_only() -> None:
    fleet = fleet_on_a_socket()
    snapshot_of_40(fleet)
    reader, peak = traced(lambda: fleet.open("reader", compacting=False))
    assert peak < MAX_PEAK
    stats = reader.stats()
    assert (stats["snapshots_corrupt"], stats["refresh_errors"]) == (1, 0)
    assert sum(reader.may_contain(key) for key in fleet.keys) == 40
    error, peak = traced(raised(lambda: load_usage(fleet.wire, PREFIX, fleet.fp)))
    assert isinstance(error, CodecError)
    assert peak < MAX_PEAK


def test_compactors_keep_every_key_past_an_oversized_usage_shard() -> None:
    fleet = fleet_on_a_socket()
    compactor = snapshot_of_40(fleet)
    # The engine compactor cannot rewrite the snapshot: it publishes deltas meanwhile.
    fleet.write(8, seed=2)
    fleet.advance(20)
    outcome, peak = traced(compactor.compact_once)
    assert outcome == "cycle:delta"
    assert peak < MAX_PEAK
    assert fleet.visible() == 48
    # The operator's plain compaction refuses, changing nothing; a full one rebuilds.
    fleet.advance(20)
    error, peak = traced(raised(fleet.operator_compact))
    assert isinstance(error, CodecError)
    assert peak < MAX_PEAK
    assert fleet.visible() == 48
    listing = [(bytes(key), 5, fleet.clock()) for key in fleet.keys]
    _, peak = traced(lambda: fleet.operator_compact(full_listing_keys=listing))
    assert peak < MAX_PEAK
    assert fleet.visible() == 48
    assert len(load_usage(fleet.wire, PREFIX, fleet.fp)) == 48


# --- (d) the next log entry --------------------------------------------------------------------


def test_an_oversized_log_entry_occupies_its_number_and_nothing_else() -> None:
    fleet = fleet_on_a_socket()
    compactor = fleet.open("c")
    assert compactor.compact_once() == "takeover"
    fleet.write(8, seed=1)
    fleet.advance(20)
    assert compactor.compact_once() == "cycle:delta"
    reader = fleet.open("reader", compacting=False)
    version = reader.version
    plant(fleet, log_name(version + 1))
    # A following reader skips it, counted; a fresh one walks back past it.
    _, peak = traced(reader.refresh)
    assert peak < MAX_PEAK
    stats = reader.stats()
    assert (stats["snapshots_corrupt"], stats["refresh_errors"]) == (1, 0)
    fresh, peak = traced(lambda: fleet.open("fresh", compacting=False))
    assert peak < MAX_PEAK
    assert fresh.version == version
    assert sum(fresh.may_contain(key) for key in fleet.keys) == 8
    # The engine compactor publishes past it; the reader follows.
    fleet.write(8, seed=2)
    fleet.advance(20)
    outcome, peak = traced(compactor.compact_once)
    assert outcome == "cycle:delta"
    assert peak < MAX_PEAK
    assert fleet.latest().version == version + 2
    reader.refresh()
    assert reader.version == version + 2
    assert sum(reader.may_contain(key) for key in fleet.keys) == 16
    # So does the operator's compaction.
    fleet.advance(20)
    report, peak = traced(lambda: compact(fleet.wire, PREFIX, fleet.fp, fpr=FPR,
                                          clock=fleet.clock, grace_s=0.0))  # fmt: skip
    assert peak < MAX_PEAK
    assert (report.keys, report.lost_race) == (16, False)
    assert fleet.visible() == 16


# --- (e) the LATEST hint -------------------------------------------------------------------------


def test_an_oversized_latest_hint_costs_a_listing_not_the_log() -> None:
    fleet = fleet_on_a_socket()
    compactor_with_deltas(fleet, 1)
    version = fleet.latest().version
    plant(fleet, LATEST_NAME)
    reader, peak = traced(lambda: fleet.open("reader", compacting=False))
    assert peak < MAX_PEAK
    assert reader.version == version
    assert sum(reader.may_contain(key) for key in fleet.keys) == 8
    usage, peak = traced(lambda: load_usage(fleet.wire, PREFIX, fleet.fp))
    assert peak < MAX_PEAK
    assert len(usage) == 8
    report, peak = traced(lambda: compact(fleet.wire, PREFIX, fleet.fp, fpr=FPR,
                                          clock=fleet.clock, grace_s=0.0))  # fmt: skip
    assert peak < MAX_PEAK
    # It took the lease after the entry it found, then published its snapshot.
    assert (report.keys, report.version, report.lost_race) == (8, version + 2, False)
    assert fleet.visible() == 8


# --- format 1: CURRENT and usage.bin ------------------------------------------------------------


@pytest.mark.parametrize("what", ["CURRENT", "usage"])
def test_an_oversized_format_1_snapshot_is_not_migrated_and_costs_nothing(what: str) -> None:
    fleet = fleet_on_a_socket()
    fleet.write(8, seed=1)
    _, usage_path = snapshot_paths(1)
    if what == "CURRENT":
        plant(fleet, CURRENT_NAME)
    else:
        current = Current(1, snapshot_paths(1)[0], usage_path, keys=100, watermark="")
        fleet.bucket.backend.put(fleet.root + CURRENT_NAME, current.to_json())
        plant(fleet, usage_path)
    compactor = fleet.open("c")
    assert compactor.compact_once() == "takeover"
    fleet.advance(20)
    outcome, peak = traced(compactor.compact_once)  # the first cycle migrates format 1
    assert outcome == "cycle:delta"  # no usage table to migrate: the segments' keys only
    assert peak < MAX_PEAK
    assert fleet.visible() == 8


# --- the writer keeps every segment under the readers' bound -------------------------------------


def test_every_segment_a_writer_may_write_is_under_the_bound() -> None:
    assert max_encoded_len(MAX_SEGMENT_RECORDS, RECORD_DTYPE) <= MAX_SEGMENT_BYTES


def test_the_segment_writer_splits_what_one_segment_cannot_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import s3kv.manifest.io as manifest_io

    monkeypatch.setattr(manifest_io, "MAX_SEGMENT_RECORDS", 4)
    backend: Backend = MemoryBackend()
    io = ManifestIO(backend, PREFIX, "fp")
    records = np.zeros(10, RECORD_DTYPE)
    records["key"] = [bytes([i]) * 16 for i in range(10)]
    records["kind"], records["count"] = KIND_WRITE, 1
    last = SegmentWriter(io, "big", clock=lambda: 1_700_000_000.0).write(records)
    names = [info.key.rsplit("/", 1)[1] for info in backend.list(io.root + "segments/")]
    assert names[-1] == last
    read = [io.read_segment(name) for name in names]
    assert [len(r) for r in read if r is not None] == [4, 4, 2]
    assert np.concatenate([r for r in read if r is not None]).tolist() == records.tolist()
