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


def test_allocate_many_gives_what_room_there_is_reusing_then_evicting() -> None:
    metrics = Metrics()
    cache = StagingCache(500, allocator=NumpyAllocator(), metrics=metrics)
    ks = keys(3)
    for i, key in enumerate(ks):
        assert fill(cache, key, 100, i)
    cache.pin_leading(ks[:1])  # NOTE: the oldest entry is pinned: never evicted
    spare = cache.allocate(100)
    assert spare is not None
    cache.release(spare)  # NOTE: a recycled buffer, reused first
    got = cache.allocate_many(100, 4)
    assert len(got) == 4  # the recycled one, one fresh (room for 500), two evicted entries
    assert any(buffer is spare for buffer in got)
    assert len({id(buffer) for buffer in got}) == 4
    assert cache.count_leading(ks[:1]) == 1
    assert ks[1] not in cache
    assert ks[2] not in cache
    assert cache.used_bytes == 500
    assert cache.allocate_many(100, 3) == []  # NOTE: the budget is held: 4 out, 1 pinned
    assert metrics.value("staging_bytes") == 500


def test_a_failed_allocation_gives_back_the_room_reserved_for_the_rest() -> None:
    made: list[int] = []

    class FailingAllocator(NumpyAllocator):
        def allocate(self, nbytes: int) -> np.ndarray:  # type: ignore[type-arg]
            if len(made) == 2:
                raise MemoryError("no pinned memory left")
            made.append(nbytes)
            return super().allocate(nbytes)

    cache = StagingCache(1000, allocator=FailingAllocator())
    got = cache.allocate_many(100, 5)
    assert len(got) == 2
    assert cache.used_bytes == 200  # NOTE: the three never made are not counted as held


def test_insert_many_keeps_the_first_of_duplicates_and_release_many_recycles() -> None:
    cache = StagingCache(1000, allocator=NumpyAllocator())
    ks = keys(3)
    buffers = cache.allocate_many(100, 4)
    for value, buffer in enumerate(buffers):
        buffer[:] = value
    cache.insert_many([(ks[0], buffers[0]), (ks[1], buffers[1]), (ks[0], buffers[2])])
    cache.release_many([buffers[3]])
    assert cache.count_leading(ks) == 2
    first = cache.get(ks[0])
    assert first is not None
    assert int(first[0]) == 0  # NOTE: a duplicate keeps the first
    assert cache.used_bytes == 400  # NOTE: the duplicate and the released are recycled
    again = cache.allocate_many(100, 2)
    assert {id(b) for b in again} == {id(buffers[2]), id(buffers[3])}


class CountingAllocator(NumpyAllocator):
    def __init__(self) -> None:
        self.freed = 0

    def free(self, buffer: np.ndarray) -> None:  # type: ignore[override]
        self.freed += 1


def test_drop_unpinned_frees_every_entry_and_pooled_buffer_but_the_pinned() -> None:
    allocator = CountingAllocator()
    metrics = Metrics()
    cache = StagingCache(1000, allocator=allocator, metrics=metrics)
    k = keys(3)
    for i, key in enumerate(k):
        assert fill(cache, key, 100, i)
    spare = cache.allocate(100)
    assert spare is not None
    cache.release(spare)  # NOTE: recycled into the free pool
    assert cache.pin_leading(k[:1]) == 1
    assert cache.drop_unpinned() == 1
    assert [key in cache for key in k] == [True, False, False]
    assert allocator.freed == 3
    assert cache.used_bytes == 100
    assert metrics.value("staging_blocks") == 1
    assert metrics.value("staging_bytes") == 100
