"""``s3kv.ops.prune``: the plan and its execution on an in-memory bucket, time injected.

Chain ``old`` is written 20 days before ``T0``, chain ``new`` at ``T0``; the window is 7 days.
"""

from __future__ import annotations

import pytest
from cli_support import DAY, PREFIX, Bucket, Clock

from s3kv.keys import BlockHash
from s3kv.manifest import load_usage
from s3kv.ops.prune import execute_prune, plan_prune
from s3kv.ops.scope import resolve_scope
from s3kv.storage import MemoryBackend

T0 = 1_700_000_000.0
WEEK = 7 * DAY


@pytest.fixture
def clock() -> Clock:
    return Clock(T0 - 20 * DAY)


@pytest.fixture
def bucket(clock: Clock) -> Bucket:
    b = Bucket(MemoryBackend(clock=clock), "memory://", "test")
    b.write_identity()
    return b


def _seed(bucket: Bucket, clock: Clock) -> tuple[list[BlockHash], list[BlockHash]]:
    old, new = bucket.chain(range(12)), bucket.chain(range(100, 108))
    bucket.write_chain(old, clock)
    clock.now = T0
    bucket.write_chain(new, clock, seed=50)
    return old, new


def test_plan_deletes_what_is_stale_and_changes_nothing(bucket: Bucket, clock: Clock) -> None:
    old, new = _seed(bucket, clock)
    before = bucket.block_keys()
    scope = resolve_scope(bucket.backend, PREFIX)
    plan = plan_prune(bucket.backend, PREFIX, scope, older_than=WEEK, clock=clock)
    (fp,) = plan.fingerprints
    assert {o.block for o in fp.delete} == set(old)
    assert (fp.kept_recent.objects, fp.kept_pinned.objects, fp.kept_ancestor.objects) == (
        len(new),
        0,
        0,
    )
    assert plan.to_delete.objects == 3
    assert plan.cutoff == T0 - WEEK
    assert bucket.block_keys() == before
    with pytest.raises(ValueError, match="older_than"):
        plan_prune(bucket.backend, PREFIX, scope, older_than=0, clock=clock)


def test_a_pin_keeps_the_block_and_its_ancestors(bucket: Bucket, clock: Clock) -> None:
    old, _ = _seed(bucket, clock)
    bucket.record(clock, pins=[old[-1]])
    scope = resolve_scope(bucket.backend, PREFIX)
    (fp,) = plan_prune(bucket.backend, PREFIX, scope, older_than=WEEK, clock=clock).fingerprints
    assert fp.delete == ()
    assert (fp.kept_pinned.objects, fp.kept_ancestor.objects) == (1, 2)


def test_execute_deletes_and_rewrites_the_manifest(bucket: Bucket, clock: Clock) -> None:
    old, new = _seed(bucket, clock)
    scope = resolve_scope(bucket.backend, PREFIX)
    plan = plan_prune(bucket.backend, PREFIX, scope, older_than=WEEK, clock=clock)
    report = execute_prune(bucket.backend, plan, prefix=PREFIX, fpr=0.01, clock=clock, batch_size=2)
    assert report.complete
    assert (report.deleted.objects, report.failed.objects) == (3, 0)
    assert bucket.block_keys() == {bucket.object_key(k) for k in new}
    (outcome,) = report.outcomes
    assert outcome.manifest_keys_dropped == 3
    usage = load_usage(bucket.backend, PREFIX, bucket.fingerprint)
    assert all(usage.row(k) is None for k in old)
    assert all(usage.row(k) is not None for k in new)

    # Nothing is stale any more: a re-run plans nothing.
    again = plan_prune(bucket.backend, PREFIX, scope, older_than=WEEK, clock=clock)
    assert again.to_delete.objects == 0
