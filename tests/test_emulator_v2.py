"""``KVCacheManagerV2`` with a connector: per-chunk pages, query/commit, layouts.

Mirrors TensorRT-LLM's ``test_kv_connector_v2_prefix.py`` (stored-file id 57539656528) at the
executor level: the connector is asked once per allocation on the final batch, the runtime
honours at most the offer (clamped, shifted, or cut back to the pages that exist when a
grow fails), commits what it honoured, then reports the pages allocated so far.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _emulator import one_torch_thread, prompt
from _memconnector import MemScheduler, MemWorker, fresh_store
from test_emulator_eras import make

from s3kv.testing.emulator.kv_cache_manager_v2 import KVCacheManagerV2
from s3kv.testing.emulator.layout import (
    KvCacheLayout,
    layout_of_pool,
    nvfp4_layout,
    nvfp4_pool,
    register_kv_cache_layout,
)
from s3kv.testing.emulator.recording import RecordingConnector, RecordingWorker
from s3kv.testing.emulator.request import LlmRequest

CHUNKED = {"enable_chunked_prefill": True, "max_num_tokens": 64}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def v2(ex: Any) -> KVCacheManagerV2:
    assert isinstance(ex.kv_cache_manager, KVCacheManagerV2)
    return ex.kv_cache_manager


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_pages_are_allocated_per_chunk(overlap: bool) -> None:
    rec = RecordingConnector()
    ex = make(rec.classes(), v2=True, overlap=overlap, **CHUNKED)
    (result,) = ex.generate([prompt(256)], 8)

    (query,) = rec.scheduler.get_num_new_matched_tokens.call_args_list
    assert isinstance(query.args[0], LlmRequest)  # V2 hands the Python request over
    assert query.args[1] == 0
    (alloc,) = rec.scheduler.update_state_after_alloc.call_args_list
    assert len(alloc.args[1]) == 2  # the first 64-token chunk only
    outs = rec.scheduler_outputs()
    first = outs[0].new_requests[0]
    assert first.new_block_ids == list(alloc.args[1])
    assert first.new_block_ids_by_layer_group == [first.new_block_ids]
    assert (first.computed_position, first.num_scheduled_tokens) == (0, 64)
    assert first.block_hashes == []
    assert first.priorities is None
    chunks = [o.cached_requests[0] for o in outs[1:4]]
    assert [c.computed_position for c in chunks] == [64, 128, 192]
    assert [len(c.new_block_ids) for c in chunks] == [2, 2, 2]
    assert all(c.new_block_ids_by_layer_group == [c.new_block_ids] for c in chunks)
    (finished,) = rec.scheduler.request_finished.call_args_list
    assert len(finished.args[1]) == 9  # 256 + 8 tokens
    assert ex.kv_cache_manager.sequences() == {}
    (ref,) = make(overlap=overlap, **CHUNKED).generate([prompt(256)], 8)
    assert result.output_tokens == ref.output_tokens


def test_unchunked_allocation_covers_the_prompt_and_offer_is_clamped() -> None:
    rec = RecordingConnector()
    rec.scheduler.get_num_new_matched_tokens.return_value = (256, False)
    ex = make(rec.classes(), v2=True)
    (result,) = ex.generate([prompt(100)], 2)
    (alloc,) = rec.scheduler.update_state_after_alloc.call_args_list
    assert len(alloc.args[1]) == 4
    assert result.connector_tokens == 99  # the last prompt token stays local
    first = rec.scheduler_outputs()[0].new_requests[0]
    assert (first.computed_position, first.num_scheduled_tokens) == (0, 1)


@pytest.mark.parametrize(
    ("grow_limit", "honoured", "pages", "scheduled"),
    [(None, 128, 6, 64), (0, 32, 2, 32), (4, 128, 6, 64), (3, 32, 2, 32)],
)
def test_offer_beyond_the_chunk_grows_or_falls_back(
    grow_limit: int | None, honoured: int, pages: int, scheduled: int
) -> None:
    rec = RecordingConnector()
    rec.scheduler.get_num_new_matched_tokens.return_value = (128, False)
    ex = make(rec.classes(), v2=True, **CHUNKED)
    v2(ex).grow_limit_blocks = grow_limit
    rid = ex.submit(prompt(256), 2)
    ex.step()
    req = ex._loop.tracked[rid].request
    assert req.py_num_connector_matched_tokens == honoured  # the commit, not the offer
    (alloc,) = rec.scheduler.update_state_after_alloc.call_args_list
    assert len(alloc.args[1]) == pages
    first = rec.scheduler_outputs()[0].new_requests[0]
    # computed_position loses the HONOURED count on the commit iteration.
    assert first.computed_position == 0
    assert first.num_scheduled_tokens == scheduled
    ex.run_until_complete([rid])
    assert ex.result(rid).connector_tokens == honoured


def test_offer_inside_the_chunk_keeps_its_end() -> None:
    rec = RecordingConnector()
    rec.scheduler.get_num_new_matched_tokens.return_value = (32, False)
    ex = make(rec.classes(), v2=True, **CHUNKED)
    ex.submit(prompt(256), 2)
    ex.step()
    first = rec.scheduler_outputs()[0].new_requests[0]
    assert (first.computed_position, first.num_scheduled_tokens) == (0, 32)
    assert len(rec.scheduler.update_state_after_alloc.call_args.args[1]) == 2


def test_query_is_anchored_at_the_local_match_and_asked_once_per_allocation() -> None:
    rec = RecordingConnector()
    ex = make(rec.classes(), v2=True, **CHUNKED)
    shared = prompt(256)
    ex.generate([shared], 2)
    ex.generate([shared[:160] + prompt(40, seed=9)], 2)
    queries = [c.args[1] for c in rec.scheduler.get_num_new_matched_tokens.call_args_list]
    assert queries == [0, 160]
    assert rec.scheduler.update_state_after_alloc.call_count == 2


def test_async_load_parks_and_is_not_asked_again() -> None:
    rec = RecordingConnector()
    rec.scheduler.get_num_new_matched_tokens.return_value = (128, True)
    held: list[int] = []

    def get_finished(saving: list[int], loading: list[int]) -> tuple[list[int], list[int]]:
        held.extend(loading)
        done = list(held)
        held.clear()
        return [], done

    rec.worker.get_finished.side_effect = get_finished
    ex = make(rec.classes(), v2=True, **CHUNKED)
    v2(ex).grow_limit_blocks = 0
    (result,) = ex.generate([prompt(256)], 3)
    assert result.loaded_async
    assert result.connector_tokens == 32
    assert rec.scheduler.get_num_new_matched_tokens.call_count == 1
    assert rec.scheduler.update_state_after_alloc.call_count == 1
    assert rec.scheduler_outputs()[0].new_requests == []  # parked in the commit iteration
    first = next(o.new_requests[0] for o in rec.scheduler_outputs() if o.new_requests)
    # The first report comes after the load: nothing is subtracted any more.
    assert first.computed_position == 32


@pytest.mark.parametrize("grow_limit", [None, 0])
def test_a_second_instance_loads_what_was_honoured(grow_limit: int | None) -> None:
    fresh_store()
    ps = [prompt(200, seed=1), prompt(90, seed=2)]
    ref = [r.output_tokens for r in make(**CHUNKED).generate(ps, 6)]
    writer = make((MemScheduler, MemWorker), v2=True, **CHUNKED)
    assert [r.output_tokens for r in writer.generate(ps, 6)] == ref
    reader = make((MemScheduler, MemWorker), v2=True, **CHUNKED)
    v2(reader).grow_limit_blocks = grow_limit
    MemScheduler.offers.clear()
    results = reader.generate(ps, 6)
    assert [r.output_tokens for r in results] == ref
    if grow_limit is None:
        assert MemScheduler.offers == [(192, 192), (64, 64)]
    else:
        # The second request's first chunk is 32 tokens (the budget left): one page, so the
        # fallback cannot advance and nothing is honoured.
        assert MemScheduler.offers == [(192, 32), (64, 0)]
    assert [r.connector_tokens for r in results] == [o[1] for o in MemScheduler.offers]


# --- layouts ---


def test_layout_registration_default_hands_the_pool_to_register_kv_caches() -> None:
    rec = RecordingConnector()
    ex = make(rec.classes(), v2=True)
    (call,) = rec.worker.register_kv_caches.call_args_list
    tensor = call.args[0]
    assert tensor.shape == ex.pool.shape
    assert tensor.dtype == ex.pool.dtype
    assert tensor.data_ptr() == ex.pool.data_ptr()
    assert torch.equal(tensor, ex.pool)


def test_a_worker_with_register_kv_cache_layout_gets_the_layout() -> None:
    rec = RecordingConnector()
    got: list[Any] = []

    class LayoutWorker(RecordingWorker):
        recorder = rec

        def register_kv_cache_layout(self, layout: KvCacheLayout) -> None:
            got.append(layout)

    scheduler_cls, _ = rec.classes()
    ex = make((scheduler_cls, LayoutWorker), v2=True)
    (layout,) = got
    assert rec.worker.register_kv_caches.call_count == 0
    assert layout.tokens_per_block == 32
    assert layout.dtype == ex.pool.dtype
    (group,) = layout.groups
    assert group.layer_ids == (0, 1)
    assert group.window_size is None
    (region,) = group.regions
    assert region.num_slots == 64
    assert region.base == ex.pool.data_ptr()
    assert [(b.layer_id, b.role) for b in region.buffers] == [
        (0, "key"),
        (0, "value"),
        (1, "key"),
        (1, "value"),
    ]
    assert region.size == group.bytes_per_page == ex.pool[0].numel() * ex.pool.element_size()
    single = layout.as_single_pool_tensor()
    assert single is not None
    assert single.data_ptr() == ex.pool.data_ptr()
    with pytest.raises(IndexError):
        region.slot_tensor(-1)
    # V1 never calls it.
    got.clear()
    make((scheduler_cls, LayoutWorker))
    assert got == []


def test_nvfp4_shapes() -> None:
    pool = nvfp4_pool(8, 2, 256)
    assert pool.dtype == torch.int8
    assert tuple(pool.shape) == (8, 2, 2, 128)
    single = layout_of_pool(pool, 32).as_single_pool_tensor()
    assert single is not None
    assert torch.equal(single, pool)
    layout = nvfp4_layout(8, 2, 256, 32)
    (group,) = layout.groups
    assert len(group.regions) == 2
    assert group.regions[1].size == 2 * 2 * 256 // 16
    assert layout.as_single_pool_tensor() is None
    worker = RecordingConnector().classes()[1](None)
    with pytest.raises(NotImplementedError, match="1 layer group\\(s\\), 2 region\\(s\\)"):
        register_kv_cache_layout(worker, layout)
