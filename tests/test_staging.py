"""Host staging: budget, LRU eviction, pins, buffer recycling."""

from __future__ import annotations

import numpy as np

from s3kv.keys import ROOT_HASH, BlockHash, hash_block
from s3kv.metrics import Metrics
from s3kv.staging import NumpyAllocator, StagingCache


def keys(n: int) -> list[BlockHash]:
    return [hash_block(ROOT_HASH, [i]) for i in range(n)]


def fill(cache: StagingCache, key: BlockHash, nbytes: int, value: int) -> bool:
    buf = cache.allocate(nbytes)
    if buf is None:
        return False
    buf[:] = value
    cache.insert(key, buf)
    return True


def test_leading_counts_and_reads() -> None:
    cache = StagingCache(1000, allocator=NumpyAllocator())
    k = keys(3)
    assert fill(cache, k[0], 100, 1)
    assert fill(cache, k[2], 100, 3)
    assert cache.count_leading(k) == 1
    got = cache.get(k[0])
    assert got is not None
    assert np.all(got == 1)
    assert cache.count_leading([]) == 0


def test_lru_eviction_respects_budget() -> None:
    metrics = Metrics()
    cache = StagingCache(300, allocator=NumpyAllocator(), metrics=metrics)
    k = keys(4)
    for i in range(3):
        assert fill(cache, k[i], 100, i)
    cache.get(k[0])  # k[0] becomes most recent; k[1] is now the LRU entry
    assert fill(cache, k[3], 100, 3)
    assert k[1] not in cache
    assert all(x in cache for x in (k[0], k[2], k[3]))
    assert cache.used_bytes <= 300
    assert metrics.value("staging_evictions") == 1


def test_pinned_entries_are_never_evicted() -> None:
    cache = StagingCache(200, allocator=NumpyAllocator())
    k = keys(3)
    assert fill(cache, k[0], 100, 0)
    assert fill(cache, k[1], 100, 1)
    assert cache.pin_leading(k) == 2
    assert cache.allocate(100) is None, "no room: everything is pinned"
    cache.unpin(k[:1])
    assert fill(cache, k[2], 100, 2)
    assert k[0] not in cache
    assert k[1] in cache
    assert not cache.remove(k[1]), "pinned entries cannot be removed"


def test_pin_leading_stops_at_first_gap() -> None:
    cache = StagingCache(1000, allocator=NumpyAllocator())
    k = keys(3)
    fill(cache, k[0], 10, 0)
    fill(cache, k[2], 10, 0)
    assert cache.pin_leading(k) == 1


def test_oversized_block_is_refused() -> None:
    cache = StagingCache(100, allocator=NumpyAllocator())
    assert cache.allocate(101) is None


def test_released_buffers_are_recycled() -> None:
    calls: list[int] = []

    class CountingAllocator(NumpyAllocator):
        def allocate(self, nbytes: int) -> np.ndarray:  # type: ignore[type-arg]
            calls.append(nbytes)
            return super().allocate(nbytes)

    cache = StagingCache(1000, allocator=CountingAllocator())
    buf = cache.allocate(100)
    assert buf is not None
    cache.release(buf)
    again = cache.allocate(100)
    assert again is buf
    assert calls == [100]
    assert cache.used_bytes == 100


def test_duplicate_insert_keeps_first() -> None:
    cache = StagingCache(1000, allocator=NumpyAllocator())
    k = keys(1)[0]
    fill(cache, k, 10, 1)
    fill(cache, k, 10, 2)
    got = cache.get(k)
    assert got is not None
    assert int(got[0]) == 1
    assert len(cache) == 1
