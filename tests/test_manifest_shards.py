"""One manifest per TP layout: the all-shards rule, own-shard lookups, bounds, usage once.

Most tests drive :class:`ShardedPresence` over a recording stand-in for the manifest, so that
what reaches the manifest (and how often) is asserted exactly; one scenario runs it over a
real :class:`~s3kv.manifest.Manifest` on an in-memory bucket, with a second instance reading.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from s3kv.keys import ROOT_HASH, BlockHash, hash_block
from s3kv.manifest import Manifest
from s3kv.manifest.shards import ShardedPresence, ShardView
from s3kv.storage import MemoryBackend
from s3kv.store import ManifestLike

PREFIX = "s3kv"
LAYOUT_FP = "ab" * 16


def key(i: int) -> BlockHash:
    return hash_block(ROOT_HASH, [i, i + 1, i + 2])


class RecordingManifest:
    """The Manifest methods a presence uses, recording every call."""

    def __init__(self) -> None:
        self.present: set[bytes] = set()
        self.writes: list[tuple[bytes, bytes, int]] = []
        self.hits: list[bytes] = []
        self.pins: list[bytes] = []
        self.unpins: list[bytes] = []
        self.closes: list[tuple[bool, float | None]] = []
        self.flushes = 0
        self.filter_passes = 0
        self.started: dict[str, Any] | None = None

    def may_contain(self, key: bytes) -> bool:
        return bytes(key) in self.present

    def count_leading(self, keys: Sequence[bytes]) -> int:
        n = 0
        while n < len(keys) and bytes(keys[n]) in self.present:
            n += 1
        return n

    def contains_many(self, keys: Sequence[bytes]) -> np.ndarray:
        self.filter_passes += 1
        return np.array([bytes(k) in self.present for k in keys], dtype=bool)

    def record_write(self, key: BlockHash, parent: BlockHash, size: int) -> None:
        self.present.add(bytes(key))
        self.writes.append((bytes(key), bytes(parent), size))

    def record_writes(self, writes: Sequence[tuple[BlockHash, BlockHash, int]]) -> None:
        for key, parent, size in writes:
            self.record_write(key, parent, size)

    def record_hits(self, keys: Sequence[BlockHash]) -> None:
        self.hits.extend(bytes(k) for k in keys)

    def record_pin(self, keys: Sequence[BlockHash]) -> None:
        self.pins.extend(bytes(k) for k in keys)

    def record_unpin(self, keys: Sequence[BlockHash]) -> None:
        self.unpins.extend(bytes(k) for k in keys)

    def flush(self) -> int:
        self.flushes += 1
        return 0

    def close(self, flush: bool = True, timeout: float | None = None) -> None:
        self.closes.append((flush, timeout))

    def start(self, **kwargs: Any) -> None:
        self.started = kwargs

    def stats(self) -> dict[str, float]:
        return {"segments_written": 0.0}


def presence(shards: int = 2, **kwargs: Any) -> tuple[ShardedPresence, RecordingManifest]:
    manifest = RecordingManifest()
    return ShardedPresence(manifest, shards, **kwargs), manifest  # type: ignore[arg-type]


def test_a_block_is_recorded_once_every_shard_wrote_it() -> None:
    p, manifest = presence(3)
    views = [p.view(i) for i in range(3)]
    views[0].record_write(key(1), ROOT_HASH, 100)
    views[2].record_write(key(1), ROOT_HASH, 120)
    assert manifest.writes == [], "two of three shards are not a block"
    views[1].record_write(key(1), ROOT_HASH, 110)
    # Recorded once, with the largest shard's stored size.
    assert manifest.writes == [(bytes(key(1)), bytes(ROOT_HASH), 120)]
    assert p.pending == 0
    views[0].record_write(key(1), ROOT_HASH, 100)  # a late re-save of a recorded block
    assert len(manifest.writes) == 1
    assert p.pending == 0


def test_a_shard_sees_its_own_writes_and_the_others_do_not() -> None:
    p, _ = presence(2)
    v0, v1 = p.view(0), p.view(1)
    v0.record_write(key(1), ROOT_HASH, 10)
    # Shard 0 never re-saves what it wrote; shard 1 still must save its part.
    assert v0.may_contain(key(1))
    assert not v1.may_contain(key(1))
    # Taken over every shard (what the connector asks) the block is not there yet.
    assert not all(v.may_contain(key(1)) for v in (v0, v1))
    v1.record_write(key(1), ROOT_HASH, 10)
    assert v0.may_contain(key(1))
    assert v1.may_contain(key(1))


def test_count_leading_mixes_the_manifest_and_own_writes() -> None:
    p, _ = presence(2)
    v0, v1 = p.view(0), p.view(1)
    chain = [key(i) for i in range(5)]
    for k in chain[:2]:  # complete blocks
        v0.record_write(k, ROOT_HASH, 1)
        v1.record_write(k, ROOT_HASH, 1)
    v0.record_write(chain[2], ROOT_HASH, 1)  # shard 0 only
    v0.record_write(chain[3], ROOT_HASH, 1)
    v1.record_write(chain[3], ROOT_HASH, 1)  # complete again
    assert v0.count_leading(chain) == 4
    assert v1.count_leading(chain) == 2, "shard 1 stops where its part is missing"
    assert min(v.count_leading(chain) for v in (v0, v1)) == 2


def test_count_leading_makes_one_filter_pass_however_many_pending_keys() -> None:
    # On the scheduler's path: linear in the prompt (it once re-tested the rest per key).
    p, manifest = presence(2)
    v0 = p.view(0)
    chain = [key(i) for i in range(200)]
    for k in chain:  # shard 0 wrote the whole chain; shard 1 has not reported yet
        v0.record_write(k, ROOT_HASH, 1)
    manifest.filter_passes = 0
    assert v0.count_leading(chain) == 200
    assert manifest.filter_passes == 1


def test_waiting_keys_are_bounded_oldest_first_and_counted() -> None:
    p, manifest = presence(2, max_pending=3)
    v0, v1 = p.view(0), p.view(1)
    for i in range(5):  # shard 1's saves of these blocks never arrive
        v0.record_write(key(i), ROOT_HASH, 1)
    assert p.pending == 3
    assert p.stats()["shard_pending_evicted"] == 2
    assert not v0.may_contain(key(0)), "the oldest waiting key was forgotten"
    assert v0.may_contain(key(4))
    # A forgotten key starts over: shard 1 alone does not complete it.
    v1.record_write(key(0), ROOT_HASH, 1)
    assert manifest.writes == []
    v1.record_write(key(4), ROOT_HASH, 1)
    assert [w[0] for w in manifest.writes] == [bytes(key(4))]


def test_hits_and_pins_are_recorded_once_per_claim() -> None:
    p, manifest = presence(2)
    views = [p.view(0), p.view(1)]
    for view in views:  # what ShardStores.record_hits does: every shard's store
        view.record_hits([key(1), key(2)])
        view.record_pin([key(1)])
        view.record_unpin([key(2)])
    assert manifest.hits == [bytes(key(1)), bytes(key(2))]
    assert manifest.pins == [bytes(key(1))]
    assert manifest.unpins == [bytes(key(2))]


def test_the_last_view_closes_the_manifest_once() -> None:
    p, manifest = presence(2)
    v0, v1 = p.view(0), p.view(1)
    v0.close(timeout=1.0)
    v0.close(timeout=1.0)  # a store closed twice releases once
    assert manifest.closes == []
    assert not p.closed
    v1.close(flush=True, timeout=2.0)
    assert manifest.closes == [(True, 2.0)]
    assert p.closed
    v1.close()
    assert manifest.closes == [(True, 2.0)]
    with pytest.raises(RuntimeError):
        p.view(0)


def test_views_are_what_a_store_needs_and_stats_add_the_pending_gauge() -> None:
    p, manifest = presence(2)
    view: ManifestLike = p.view(1)
    assert isinstance(view, ShardView)
    view.record_write(key(1), ROOT_HASH, 5)
    stats = view.stats()
    assert stats["segments_written"] == 0
    assert stats["shard_pending"] == 1
    assert stats["shard_writes_completed"] == 0
    view.flush()
    assert manifest.flushes == 1
    p.start(refresh_interval=1.0, flush_interval=2.0, flush_keys=3)
    assert manifest.started == {"refresh_interval": 1.0, "flush_interval": 2.0, "flush_keys": 3}


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="shards"):
        presence(0)
    with pytest.raises(ValueError, match="max_pending"):
        presence(2, max_pending=0)
    p, _ = presence(2)
    with pytest.raises(ValueError, match="shard"):
        p.view(2)
    with pytest.raises(ValueError, match="16 bytes"):
        p.view(0).record_write(BlockHash(b"short"), ROOT_HASH, 1)


def test_concurrent_shards_record_every_block_exactly_once() -> None:
    p, manifest = presence(4)
    keys = [key(i) for i in range(500)]

    def shard(i: int) -> None:
        view = p.view(i)
        for k in keys:
            view.record_write(k, ROOT_HASH, i)

    threads = [threading.Thread(target=shard, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(w[0] for w in manifest.writes) == sorted(bytes(k) for k in keys)
    assert p.pending == 0


def test_another_instance_sees_a_block_only_once_every_shard_is_written() -> None:
    backend = MemoryBackend()

    def reader() -> Manifest:
        return Manifest.open(backend, PREFIX, LAYOUT_FP, capacity=1000, fpr=1e-6)

    writer = ShardedPresence(
        Manifest.open(backend, PREFIX, LAYOUT_FP, capacity=1000, fpr=1e-6, instance_id="w"), 2
    )
    v0, v1 = writer.view(0), writer.view(1)
    # Step 1: shard 0 writes blocks 1 and 2, shard 1 only block 1; the segment is flushed.
    v0.record_write(key(1), ROOT_HASH, 10)
    v0.record_write(key(2), key(1), 10)
    v1.record_write(key(1), ROOT_HASH, 11)
    v0.flush()
    # Step 2: a new instance opens the layout's manifest: block 1 only.
    other = reader()
    assert other.may_contain(key(1))
    assert not other.may_contain(key(2))
    other.close(flush=False)
    # Step 3: shard 1 writes block 2; the last view's close flushes it.
    v1.record_write(key(2), key(1), 12)
    v0.close()
    v1.close()
    later = reader()
    assert later.count_leading([key(1), key(2)]) == 2
    later.close(flush=False)


def test_contains_many_answers_as_may_contain_in_one_filter_pass() -> None:
    p, manifest = presence(2)
    v0, v1 = p.view(0), p.view(1)
    v0.record_write(key(1), ROOT_HASH, 10)  # pending: shard 0 only
    v0.record_write(key(2), ROOT_HASH, 10)
    v1.record_write(key(2), ROOT_HASH, 10)  # recorded: every shard
    keys = [key(1), key(2), key(3)]
    passes = manifest.filter_passes
    for view in (v0, v1):
        assert view.contains_many(keys).tolist() == [view.may_contain(k) for k in keys]
    assert manifest.filter_passes == passes + 2  # one per call, whatever the keys
