"""``s3kv.ops.compaction.compact_scope`` on an in-memory bucket."""

from __future__ import annotations

import pytest
from cli_support import DAY, PREFIX, Bucket, Clock

from s3kv.manifest import load_usage
from s3kv.ops.compaction import compact_scope
from s3kv.ops.scope import resolve_scope
from s3kv.storage import MemoryBackend

T0 = 1_700_000_000.0


@pytest.fixture
def clock() -> Clock:
    return Clock(T0)


@pytest.fixture
def bucket(clock: Clock) -> Bucket:
    b = Bucket(MemoryBackend(clock=clock), "memory://", "test")
    b.write_identity()
    return b


def test_segments_fold_into_a_snapshot(bucket: Bucket, clock: Clock) -> None:
    bucket.write_chain(bucket.chain(range(12)), clock)
    scope = resolve_scope(bucket.backend, PREFIX)
    calls: list[tuple[str, int, int | None]] = []

    report = compact_scope(
        bucket.backend,
        scope,
        prefix=PREFIX,
        fpr=0.01,
        clock=clock,
        progress=lambda *a: calls.append(a),
    )
    ((fp, first),) = report.reports
    assert fp == bucket.fingerprint
    assert (first.keys, first.segments_folded, first.lost_race) == (3, 1, False)
    assert calls == [("compact", 1, 1)]
    assert report.lost_races == []

    # A second run has nothing new to fold; the keys stay.
    clock.now += DAY
    (_, again), *_ = compact_scope(
        bucket.backend, scope, prefix=PREFIX, fpr=0.01, clock=clock
    ).reports
    assert (again.keys, again.segments_folded) == (3, 0)
    assert again.generation > first.generation


def test_full_compaction_adopts_listed_objects(bucket: Bucket, clock: Clock) -> None:
    (stray,) = bucket.chain(range(100, 104))
    bucket.put_block(stray)  # an object whose segment was lost
    scope = resolve_scope(bucket.backend, PREFIX)
    plain = compact_scope(bucket.backend, scope, prefix=PREFIX, fpr=0.01, clock=clock)
    assert plain.reports[0][1].keys == 0
    assert load_usage(bucket.backend, PREFIX, bucket.fingerprint).row(stray) is None

    full = compact_scope(bucket.backend, scope, prefix=PREFIX, fpr=0.01, full=True, clock=clock)
    assert full.full
    assert (full.reports[0][1].listing_keys, full.reports[0][1].keys) == (1, 1)
    assert load_usage(bucket.backend, PREFIX, bucket.fingerprint).row(stray) is not None
