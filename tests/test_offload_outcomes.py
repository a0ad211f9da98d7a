"""Outcomes in columns: what crosses from the codec processes and how the store books it."""

from __future__ import annotations

import pickle
from collections.abc import Iterator, Sequence

import pytest

from s3kv.keys import BlockHash
from s3kv.offload import Failure, Outcome, Outcomes, SaveJob, SaveJobs
from s3kv.offload.processes import _deliver_all
from s3kv.storage import MemoryBackend
from s3kv.store import KVStore, _SaveBatch
from tests.test_store import open_store


@pytest.fixture
def store() -> Iterator[KVStore]:
    opened = open_store(MemoryBackend())
    yield opened
    opened.close()


PUT_FAILED = Failure("EndpointError", "connection reset", "endpoint")
ENCODE_FAILED = Failure("CodecError", "encoding failed", "codec")


def rows() -> list[Outcome]:
    return [
        Outcome(10, True, 0.01, None, True, 700, None),
        Outcome(11, True, 0.02, PUT_FAILED, False, 0, None),
        Outcome(12, True, 0.03, None, False, 650, None),  # NOTE: a refused conditional PUT
        Outcome(13, False, 0.0, None, False, 0, ENCODE_FAILED),
        Outcome(14, True, 0.05, None, True, 800, None),
    ]


def test_columns_hold_the_rows_they_were_made_of_through_a_pickled_trip() -> None:
    outcomes = pickle.loads(pickle.dumps(Outcomes.of(rows()), pickle.HIGHEST_PROTOCOL))
    assert list(outcomes.rows()) == rows()
    assert len(outcomes) == 5
    assert list(outcomes.take([4, 0]).rows()) == [rows()[4], rows()[0]]
    parts = [Outcomes.of(rows()[:2]), Outcomes.of(rows()[2:])]
    assert Outcomes.joined(parts) == outcomes
    assert Outcomes.joined(parts[:1]) is parts[0]
    assert len(Outcomes.of([])) == 0
    assert list(Outcomes.of([]).rows()) == []


def test_save_jobs_in_columns_expand_to_the_jobs_they_stand_for_in_any_share() -> None:
    jobs = SaveJobs(
        "/proc/1/fd/3", 4096, 4000, "bfloat16", (2, 1000), 1, 3,
        ["a", "b", "c"], [7, 2, 5], [True, False, True],
    )  # fmt: skip
    expanded = list(pickle.loads(pickle.dumps(jobs, pickle.HIGHEST_PROTOCOL)).jobs())
    assert expanded == [
        SaveJob(key, "/proc/1/fd/3", 4096, slot, 4000, "bfloat16", (2, 1000), 1, 3, if_absent)
        for key, slot, if_absent in (("a", 7, True), ("b", 2, False), ("c", 5, True))
    ]
    assert len(jobs) == 3
    assert list(jobs.rows(1, 3).jobs()) == expanded[1:]
    assert list(jobs.rows(0, 0).jobs()) == []


def test_only_rows_that_all_made_their_request_and_all_succeeded_are_clean() -> None:
    every = rows()
    assert Outcomes.of([every[0], every[2], every[4]]).clean()
    assert not Outcomes.of([every[0], every[1]]).clean()  # NOTE: a failed request
    assert not Outcomes.of([every[0], every[3]]).clean()  # NOTE: no request, a codec error
    refused = Outcome(15, False, 0.0, None, False, 0, None)
    assert not Outcomes.of([every[0], refused]).clean()


def test_each_batch_gets_its_own_rows_once_and_rows_nobody_waits_for_are_dropped() -> None:
    calls: dict[str, list[tuple[list[int], list[Outcome]]]] = {"a": [], "b": []}

    def waiter(name: str):  # type: ignore[no-untyped-def]
        def done(indices: Sequence[int], outcomes: Outcomes) -> None:
            calls[name].append((list(indices), list(outcomes.rows())))

        return done

    a, b = waiter("a"), waiter("b")
    every = rows()
    _deliver_all(Outcomes.of(every), [(a, 3), (b, 0), None, (a, 1), (b, 7)])
    assert calls["a"] == [([3, 1], [every[0], every[3]])]
    assert calls["b"] == [([0, 7], [every[1], every[4]])]


def test_a_batch_of_save_outcomes_is_booked_row_by_row(store: KVStore) -> None:
    keys = [BlockHash(bytes([i]) * 16) for i in range(1, 9)]
    parents = [BlockHash(bytes([100 + i]) * 16) for i in range(1, 9)]
    consumed: list[int] = []
    batch = _SaveBatch(
        keys, parents, [lambda i=i: consumed.append(i) for i in range(8)], 1000, [False] * 8
    )
    indices = [6, 1, 4, 0, 3]  # NOTE: rows 0..4 of rows() answer these batch indices
    batch.rewrite[3] = True  # NOTE: row 4's, written
    store.quarantine.add(keys[3])
    with store._lock:
        store._saving.update(keys[i] for i in indices)
        store._inflight_save_bytes += len(indices) * 1000
    before = store.stats()
    store._saves_done(batch, indices, Outcomes.of(rows()))
    stats = store.stats()

    def added(name: str) -> float:
        return stats.get(name, 0) - before.get(name, 0)

    assert sorted(consumed) == sorted(indices)  # NOTE: every buffer back, once
    assert added("save_completed") == 2  # NOTE: rows 0 and 4
    assert added("save_skipped_existing") == 1  # NOTE: row 2, the key exists
    assert added("save_failed") == 2  # NOTE: the failed PUT and the failed encoding
    assert added("save_stored_bytes") == 700 + 800
    assert added("bytes_sent") == 700 + 800  # NOTE: not the refused conditional PUT's
    assert added("save_raw_bytes") == 2 * 1000
    assert added("save_rewrote_quarantined") == 1
    assert keys[3] not in store.quarantine
    assert added('requests{op="put"}') == 4  # NOTE: row 3 made none
    written = [store.manifest.may_contain(keys[i]) for i in indices]
    assert written == [True, False, True, False, True]
    assert not any(store.manifest.may_contain(keys[i]) for i in (2, 5, 7))
    assert store.stats()["inflight_save_bytes"] == 0


def test_a_buffer_that_fails_to_go_back_stops_neither_the_others_nor_the_booking(
    store: KVStore,
) -> None:
    keys = [BlockHash(bytes([i]) * 16) for i in range(1, 4)]
    consumed: list[int] = []

    def broken() -> None:
        raise RuntimeError("pool gone")

    batch = _SaveBatch(
        keys, list(keys), [broken, lambda: consumed.append(1), lambda: consumed.append(2)],
        1000, [False] * 3,
    )  # fmt: skip
    with store._lock:
        store._inflight_save_bytes += 3 * 1000
    clean = [Outcome(i, True, 0.01, None, True, 600, None) for i in range(3)]
    store._saves_done(batch, [0, 1, 2], Outcomes.of(clean))
    assert consumed == [1, 2]
    assert all(store.manifest.may_contain(k) for k in keys)
    assert store.stats()["inflight_save_bytes"] == 0


def test_a_clean_batch_of_fetches_is_recorded_in_bulk_with_the_bytes_received(
    store: KVStore,
) -> None:
    before = store.stats()
    clean = [Outcome(i, True, 0.01, None, i != 1, 500 + i, None) for i in range(3)]
    assert store._record_outcomes("get", Outcomes.of(clean)) is None
    stats = store.stats()
    assert stats["bytes_received"] - before.get("bytes_received", 0) == 500 + 501 + 502
    assert stats['requests{op="get"}'] - before.get('requests{op="get"}', 0) == 3


def test_only_seven_lists_of_one_length_are_well_formed_outcomes() -> None:
    assert Outcomes.of(rows()).well_formed()
    assert Outcomes.of([]).well_formed()
    short = Outcomes.of(rows())
    short.found.pop()
    assert not short.well_formed()
    assert not Outcomes(*([(), [], [], [], [], [], []])).well_formed()  # type: ignore[arg-type]


def test_a_clean_batch_is_booked_in_bulk_as_the_rows_would_be(store: KVStore) -> None:
    keys = [BlockHash(bytes([i]) * 16) for i in range(1, 4)]
    batch = _SaveBatch(keys, list(keys), [None] * 3, 1000, [False] * 3)
    with store._lock:
        store._inflight_save_bytes += 3 * 1000
    clean = [Outcome(i, True, 0.01 * i, None, i != 2, 600 + i, None) for i in range(3)]
    before = store.stats()
    store._saves_done(batch, [0, 1, 2], Outcomes.of(clean))
    stats = store.stats()
    assert stats['requests{op="put"}'] - before.get('requests{op="put"}', 0) == 3
    assert stats["bytes_sent"] - before.get("bytes_sent", 0) == 600 + 601  # NOTE: not 602
    assert stats["save_completed"] - before.get("save_completed", 0) == 2
    assert all(store.manifest.may_contain(k) for k in keys)
