"""``s3kv.ops.prune``: the plan and its execution on an in-memory bucket, time injected.

Chain ``old`` is written 20 days before ``T0``, chain ``new`` at ``T0``; the window is 7 days.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Collection, Iterable, Iterator, Sequence
from types import SimpleNamespace

import numpy as np
import pytest
from cli_support import DAY, PREFIX, Bucket, Clock

from s3kv.errors import StorageError
from s3kv.keys import ROOT_HASH, BlockHash, block_object_key
from s3kv.manifest import UNKNOWN_PARENT, USAGE_DTYPE, Records, UsageTable, load_usage
from s3kv.ops import prune, scope
from s3kv.ops.prune import BlockHashes, BlockObjects, Tally, execute_prune, plan_prune
from s3kv.ops.scope import BlockObject, Fingerprint, blocks_prefix, resolve_scope
from s3kv.storage import DelegatingBackend, DeleteResult, MemoryBackend

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


# --- The vectorized planner against the per-key reference it replaced ---------------------

FP = "0123456789abcdef0123456789abcdef"
_HEADS = (bytes(8), b"\x12" * 8, b"\xff" * 8)  # shared leading bytes: lookups that tie


def _reference_plan(
    rows: Records, objects: list[BlockObject], cutoff: float
) -> tuple[list[BlockObject], list[bytes], dict[str, tuple[int, int]]]:
    """The planner as it was, one Python object per key: (delete, forget, kept tallies)."""
    keys: list[bytes] = rows["key"].tolist()
    last_used = dict(zip(keys, rows["last_used"].tolist(), strict=True))
    pinned = {key for key, pin in zip(keys, rows["pinned"].tolist(), strict=True) if pin}
    parent_of = dict(zip(keys, rows["parent"].tolist(), strict=True))
    recent = {
        o.block
        for o in objects
        if o.block is not None and max(o.last_modified, last_used.get(o.block, 0.0)) >= cutoff
    }
    recent |= {key for key, used in last_used.items() if used >= cutoff}
    ancestors: set[bytes] = set()
    for seed in recent | pinned:
        parent = parent_of.get(seed)
        while parent is not None and parent != UNKNOWN_PARENT and parent not in ancestors:
            if parent not in parent_of:
                break
            ancestors.add(parent)
            parent = parent_of.get(parent)
    delete: list[BlockObject] = []
    kept: dict[str, list[BlockObject]] = {"recent": [], "pinned": [], "ancestor": [], "foreign": []}
    for obj in objects:
        if obj.block is None:
            kept["foreign"].append(obj)
        elif obj.block in pinned:
            kept["pinned"].append(obj)
        elif obj.block in recent:
            kept["recent"].append(obj)
        elif obj.block in ancestors:
            kept["ancestor"].append(obj)
        else:
            delete.append(obj)
    present = {o.block for o in objects}
    forget = [k for k in keys if k not in present | pinned | recent | ancestors]
    tallies = {reason: (len(objs), sum(o.size for o in objs)) for reason, objs in kept.items()}
    return delete, forget, tallies


def _key(rng: np.random.Generator) -> bytes:
    head = _HEADS[int(rng.integers(len(_HEADS)))] if rng.random() < 0.5 else rng.bytes(8)
    return head + rng.bytes(8)


def _objects_of(rng: np.random.Generator, block: bytes, times: list[float]) -> list[BlockObject]:
    """The object of ``block`` (mostly canonical), sometimes an odd second key for it too."""
    head, hex_hash = blocks_prefix(PREFIX, FP), block.hex()
    odd_keys = [
        f"{head}{hex_hash[:1]}/{hex_hash}",
        f"{head}{hex_hash[:2].upper()}/{hex_hash.upper()}",
        f"{head}/{hex_hash}",
    ]
    found = []
    if rng.random() < 0.85:
        found.append(block_object_key(PREFIX, FP, BlockHash(block)))
    if rng.random() < 0.2:
        found.append(odd_keys[int(rng.integers(len(odd_keys)))])
    return [
        BlockObject(key, BlockHash(block), int(rng.integers(0, 5000)), float(rng.choice(times)))
        for key in found
    ]


def _scenario(seed: int) -> tuple[Records, list[BlockObject], float]:
    """Random usage rows and a listing with every edge the planner has to get right."""
    rng = np.random.default_rng(seed)
    cutoff = 1000.0 if rng.random() < 0.85 else -5.0
    times = [cutoff - 10, cutoff, cutoff + 10, 0.0, -1.0, np.nextafter(cutoff, -np.inf)]
    found = {_key(rng) for _ in range(int(rng.integers(0, 60)))}
    found |= {k for k in (UNKNOWN_PARENT, ROOT_HASH) if rng.random() < 0.15}
    if seed % 25 == 0:  # no manifest at all
        found = set()
    keys = sorted(found)
    rows = np.zeros(len(keys), USAGE_DTYPE)
    if keys:
        rows["key"] = np.array(keys, "V16")
        parents = []
        for _ in keys:
            pick = rng.random()
            if pick < 0.1:
                parents.append(UNKNOWN_PARENT)
            elif pick < 0.2:
                parents.append(ROOT_HASH)
            elif pick < 0.85:  # cycles and self-parents included
                parents.append(keys[int(rng.integers(len(keys)))])
            else:
                parents.append(_key(rng))
        rows["parent"] = np.array(parents, "V16")
        rows["last_used"] = rng.choice(times, len(keys))
        rows["pinned"] = rng.random(len(keys)) < 0.15
        rows["size"] = rng.integers(0, 5000, len(keys))
    objects = [obj for key in keys for obj in _objects_of(rng, key, times)]
    strangers = [_key(rng) for _ in range(int(rng.integers(0, 15)))]
    objects += [obj for key in strangers for obj in _objects_of(rng, key, times)]
    head = blocks_prefix(PREFIX, FP)
    for i in range(int(rng.integers(0, 4))):
        objects.append(BlockObject(f"{head}zz/foreign-{i}", None, i, float(rng.choice(times))))
    shorts = [BlockHash(rng.bytes(15)) for _ in range(int(rng.integers(0, 3)))]
    for i, short in enumerate(shorts * 2):  # a key that parses to a 15-byte "hash", twice
        size, modified = int(rng.integers(0, 50)), float(rng.choice(times))
        objects.append(BlockObject(f"{head}{short.hex()[:2]}/x{i}", short, size, modified))
    if rng.random() < 0.7:
        objects.sort(key=lambda o: o.key)  # listing order
    else:
        objects = [objects[i] for i in rng.permutation(len(objects))]
    return rows, objects, cutoff


class _Deletes(DelegatingBackend):
    """Refuses some keys; raises for every batch after the first ``healthy_batches``."""

    def __init__(self, refuse: set[str], healthy_batches: int | None) -> None:
        super().__init__(MemoryBackend())
        self.refuse, self.healthy_batches = refuse, healthy_batches
        self.batches: list[list[str]] = []

    def delete_many(self, keys: Iterable[str]) -> DeleteResult:
        batch = list(keys)
        self.batches.append(batch)
        if self.healthy_batches is not None and len(self.batches) > self.healthy_batches:
            raise StorageError("bucket on fire")
        failed = {key: "AccessDenied" for key in batch if key in self.refuse}
        return DeleteResult([key for key in batch if key not in failed], failed)


def _reference_execute(
    delete: list[BlockObject], backend: _Deletes, batch_size: int
) -> tuple[list[BlockObject], list[BlockObject], list[BlockObject], list[tuple[str, str]]]:
    """The deletion loop as it was: (deleted, failed, not attempted, failures)."""
    deleted: list[BlockObject] = []
    failed: list[BlockObject] = []
    failures: list[tuple[str, str]] = []
    pending = list(delete)
    while pending:
        batch, pending = pending[:batch_size], pending[batch_size:]
        try:
            result = backend.delete_many([obj.key for obj in batch])
        except StorageError as exc:
            failed.extend(batch)
            failures.append((batch[0].key, f"batch of {len(batch)} failed: {exc}"))
            break
        for obj in batch:
            if obj.key in result.failed:
                failed.append(obj)
                failures.append((obj.key, result.failed[obj.key]))
            else:
                deleted.append(obj)
    return deleted, failed, pending, failures[:10]


def _tally(objects: Sequence[BlockObject]) -> Tally:
    return Tally(len(objects), sum(o.size for o in objects))


@pytest.mark.parametrize("small_chunks", [True, False])
def test_plan_and_execute_match_the_per_key_reference(
    monkeypatch: pytest.MonkeyPatch, small_chunks: bool
) -> None:
    if small_chunks:  # chunk, walk-slice and iteration boundaries everywhere
        monkeypatch.setattr(prune, "_CHUNK", 3)
        monkeypatch.setattr(prune, "_SLICE", 2)
        monkeypatch.setattr(prune, "_BATCH", 4)
    dropped: list[list[bytes]] = []

    def fake_compact(*_: object, drop_keys: Collection[bytes], **__: object) -> SimpleNamespace:
        dropped.append(list(drop_keys))
        return SimpleNamespace(lost_race=False, generation=1, keys_dropped=len(drop_keys))

    monkeypatch.setattr(prune, "compact", fake_compact)
    for seed in range(250):
        rows, objects, cutoff = _scenario(seed)
        monkeypatch.setattr(scope, "load_usage", lambda *_, rows=rows: UsageTable(rows))
        monkeypatch.setattr(prune, "list_blocks", lambda *_, objects=objects: iter(objects))
        now = cutoff + WEEK
        plan = plan_prune(MemoryBackend(), PREFIX, [Fingerprint(FP)], older_than=WEEK,
                          clock=lambda now=now: now)  # fmt: skip
        (fp,) = plan.fingerprints
        delete, forget, kept = _reference_plan(rows, objects, cutoff)
        assert list(fp.delete) == delete, seed
        assert fp.delete == tuple(delete)
        assert [fp.delete[i] for i in range(-len(delete), len(delete))] == delete * 2
        assert list(fp.forget) == forget, seed
        assert fp.to_delete == _tally(delete)
        got = {
            "recent": fp.kept_recent,
            "pinned": fp.kept_pinned,
            "ancestor": fp.kept_ancestor,
            "foreign": fp.kept_foreign,
        }
        assert {reason: (t.objects, t.bytes) for reason, t in got.items()} == kept, seed

        # Execution: the same batches, outcome and manifest drop as the per-key loop.
        rng = np.random.default_rng(seed)
        refuse = {o.key for o in delete if rng.random() < 0.2}
        healthy = None if rng.random() < 0.7 else int(rng.integers(0, 3))
        batch_size = int(rng.integers(1, 5))
        expected = _Deletes(refuse, healthy)
        ref_deleted, ref_failed, ref_pending, ref_failures = _reference_execute(
            delete, expected, batch_size
        )
        backend = _Deletes(refuse, healthy)
        dropped.clear()
        report = execute_prune(backend, plan, prefix=PREFIX, fpr=0.01, batch_size=batch_size)
        (outcome,) = report.outcomes
        assert backend.batches == expected.batches, seed
        assert (outcome.deleted, outcome.failed) == (_tally(ref_deleted), _tally(ref_failed))
        assert outcome.not_attempted == _tally(ref_pending)
        assert list(outcome.failures) == ref_failures
        drop = [o.block for o in ref_deleted if o.block is not None and len(o.block) == 16]
        drop += forget
        stopped = healthy is not None and len(expected.batches) > healthy
        assert dropped == ([] if stopped or not drop else [drop]), seed


def test_block_objects_is_a_compact_sequence() -> None:
    head = blocks_prefix(PREFIX, FP)
    blocks = [BlockHash(bytes([i]) * 16) for i in range(6)]
    objects = [BlockObject(block_object_key(PREFIX, FP, b), b, 10 * i, 1.5 * i)
               for i, b in enumerate(blocks)]  # fmt: skip
    objects[2] = BlockObject(f"{head}0/{blocks[2].hex()}", blocks[2], 20, 3.0)  # odd key
    objects[4] = BlockObject(f"{head}zz/not-a-block", None, 40, 6.0)  # foreign
    packed = BlockObjects.of(PREFIX, FP, objects)
    assert isinstance(packed, Sequence)
    assert packed == objects == list(packed)
    assert packed == tuple(objects)
    assert packed != objects[:-1]
    assert BlockObjects.of(PREFIX, FP, []) == ()
    assert packed[-1] == objects[-1]
    assert packed[2] is objects[2]
    for cut in (slice(1, 5), slice(None, None, 2), slice(None, None, -1), slice(4, 0, -3)):
        assert list(packed[cut]) == objects[cut]
        assert Tally.of(packed[cut]) == Tally(len(objects[cut]), sum(o.size for o in objects[cut]))
    with pytest.raises(IndexError):
        packed[6]
    assert Tally.of(packed) == packed.tally == Tally(6, 150)
    assert hash(packed) == hash(tuple(objects))
    everything = np.ones(len(packed), np.bool_)
    assert list(packed.hashes_where(everything)) == [b for i, b in enumerate(blocks) if i != 4]
    assert repr(packed) == "BlockObjects(6 objects, 150 bytes)"


def test_block_hashes_is_a_compact_sequence() -> None:
    keys = [BlockHash(bytes([i]) * 16) for i in range(5)]
    packed = BlockHashes.of(keys)
    assert packed == keys == list(packed)
    assert packed == tuple(keys)
    assert packed[1:3] == keys[1:3]
    assert packed[-1] == keys[-1]
    assert keys[3] in packed
    assert b"\x09" * 16 not in packed
    assert np.asarray(packed).dtype == np.dtype("V16")
    assert BlockHashes.of([]) == ()
    with pytest.raises(ValueError, match="16-byte"):
        BlockHashes.of([b"short"])


def test_planning_memory_is_tens_of_bytes_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """100k keys, all stale: the planner's peak beyond the usage rows (the old one: ~650 B)."""
    n = 100_000
    rng = np.random.default_rng(7)
    keys = np.frombuffer(rng.bytes(16 * n), "V16")
    halves = keys.view(">u8").reshape(-1, 2)
    keys = keys[np.lexsort((halves[:, 1], halves[:, 0]))]
    rows = np.zeros(n, USAGE_DTYPE)
    rows["key"], rows["parent"], rows["last_used"], rows["size"] = keys, ROOT_HASH, 1.0, 1 << 20
    rows["parent"][1:] = keys[:-1]  # one long chain: pin its end, keep all of it
    rows["pinned"][n // 2] = 1
    head = blocks_prefix(PREFIX, FP)

    def listing(*_: object) -> Iterator[BlockObject]:
        for block in keys.tolist():
            hex_hash = block.hex()
            yield BlockObject(f"{head}{hex_hash[:2]}/{hex_hash}", block, 1 << 20, 1.0)

    monkeypatch.setattr(scope, "load_usage", lambda *_: UsageTable(rows))
    monkeypatch.setattr(prune, "list_blocks", listing)
    tracemalloc.start()
    try:
        plan = plan_prune(MemoryBackend(), PREFIX, [Fingerprint(FP)], older_than=WEEK,
                          clock=lambda: 10 * WEEK)  # fmt: skip
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    (fp,) = plan.fingerprints
    assert (fp.kept_pinned.objects, fp.kept_ancestor.objects) == (1, n // 2)
    assert fp.to_delete.objects == n - n // 2 - 1
    assert peak / n < 200, f"{peak / n:.0f} bytes a key"
