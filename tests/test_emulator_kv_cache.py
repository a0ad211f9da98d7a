"""The emulated V1 block manager and scheduler: reuse, eviction order, chunking, capacity.

These pin the behaviours of ``kvCacheManager.cpp`` / ``llmRequest.h`` that decide what a
connector is asked and what its blocks contain; the last tests check that none of it
changes the model's output (reuse, chunking and the overlap loop are all exact).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _emulator import executor, one_torch_thread, prompt

from s3kv.testing.emulator.blocks import BlockPool
from s3kv.testing.emulator.kv_cache_manager import KVCacheManager
from s3kv.testing.emulator.recording import RecordingConnector
from s3kv.testing.emulator.request import LlmRequest, LlmRequestState
from s3kv.testing.emulator.scheduler import RequestScheduler


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def _manager(num_blocks: int, tpb: int = 4, **kwargs: Any) -> KVCacheManager:
    pool = torch.zeros(num_blocks, 1, 2, 8)
    return KVCacheManager(num_blocks=num_blocks, tokens_per_block=tpb, pool=pool, **kwargs)


def test_free_queue_order_non_reusable_first_then_lru() -> None:
    pool = BlockPool(4, lambda src, dst: None)
    taken = [pool.take_free() for _ in range(3)]
    assert taken == [0, 1, 2]
    pool.store((None, None), [((1, 2, 3, 4), 0), ((5, 6, 7, 8), 1)])
    for block in reversed(taken):  # released last block first, as removeSequence does
        pool.release(block)
    # Block 2 is not reusable: evicted first. Then the never-used 3, then the leaf 1
    # (released before its parent 0), which drops it from the tree.
    assert [pool.take_free() for _ in range(3)] == [2, 3, 1]
    matched = pool.match(
        (None, None),
        [(1, 2, 3, 4), (5, 6, 7, 8)],
        partial_reuse=True,
        copy_on_partial_reuse=True,
    )
    assert [m.block_id for m in matched] == [0]


def test_blocks_are_never_zeroed() -> None:
    kv = _manager(1, tpb=4)  # one block: the second request must get the first one's
    first = LlmRequest(0, [1, 2, 3], 1)
    kv.add_sequence(first)
    (block,) = kv.get_cache_indices(first)
    kv.get_unique_primary_pool()[block] = 7.0
    kv.free_resources(first)
    other = LlmRequest(1, [9, 9, 9], 1)  # no prefix in common: evicts and reuses it
    kv.add_sequence(other)
    (again,) = kv.get_cache_indices(other)
    assert bool((kv.get_unique_primary_pool()[again] == 7.0).all())


@pytest.mark.parametrize(("partial", "expected"), [(True, 6), (False, 4)])
def test_partial_match_of_a_shared_block_is_copied(partial: bool, expected: int) -> None:
    kv = _manager(8, tpb=4, enable_partial_reuse=partial)
    owner = LlmRequest(0, list(range(10)), 1)
    kv.add_sequence(owner)
    owner.context_chunk_size = 10
    owner.move_to_next_context_chunk()
    kv.store_context_blocks(owner)  # blocks [0..4) and [4..8) become reusable
    source = kv.get_cache_indices(owner)
    kv.get_unique_primary_pool()[source[1]] = 3.0
    reader = LlmRequest(1, [0, 1, 2, 3, 4, 5, 99, 98], 1)  # matches 4 + 2 tokens
    kv.add_sequence(reader)
    blocks = kv.get_cache_indices(reader)
    assert reader.prepopulated_prompt_len == expected
    assert blocks[0] == source[0]  # a full match is shared
    assert blocks[1] != source[1]  # the owner still uses it: never handed out twice
    copied = bool((kv.get_unique_primary_pool()[blocks[1]] == 3.0).all())
    assert copied is partial


def test_prepopulation_moves_cursor_and_ends_chunk_on_block_boundary() -> None:
    req = LlmRequest(0, list(range(256)), 1)
    req.context_chunk_size = 128
    req.set_prepopulated_prompt_len(40, 32)
    assert (req.context_current_position, req.context_chunk_size) == (40, 120)
    assert req.is_first_context_chunk
    assert not req.is_last_context_chunk
    whole = LlmRequest(1, list(range(256)), 1)
    whole.context_chunk_size = 256
    whole.set_prepopulated_prompt_len(100, 32)
    assert (whole.context_current_position, whole.context_chunk_size) == (100, 156)
    assert whole.is_last_context_chunk


def test_capacity_is_first_come_first_served() -> None:
    kv = _manager(6, tpb=32)
    scheduler = RequestScheduler(
        kv, max_batch_size=8, max_num_tokens=4096, enable_chunked_prefill=False, tokens_per_block=32
    )
    big = LlmRequest(0, list(range(100)), 20)  # 4 blocks to completion
    medium = LlmRequest(1, list(range(60)), 20)  # 3 blocks: does not fit in the other 2
    small = LlmRequest(2, list(range(10)), 2)  # 1 block: fits, but may not overtake
    batch = scheduler.schedule([big, medium, small])
    assert batch.context_requests == [big]
    kv.add_sequence(big)
    big.state = LlmRequestState.GENERATION_IN_PROGRESS
    # big holds its 4 blocks; medium still does not fit in the other 2, so small waits too.
    batch = scheduler.schedule([big, medium, small])
    assert batch.generation_requests == [big]
    assert batch.context_requests == []


def test_chunked_prefill_budget_is_whole_blocks() -> None:
    kv = _manager(64, tpb=32)
    scheduler = RequestScheduler(
        kv, max_batch_size=8, max_num_tokens=100, enable_chunked_prefill=True, tokens_per_block=32
    )
    running = LlmRequest(0, list(range(10)), 8)
    kv.add_sequence(running)
    running.state = LlmRequestState.GENERATION_IN_PROGRESS
    new = LlmRequest(1, list(range(300)), 8)
    batch = scheduler.schedule([running, new])
    assert batch.generation_requests == [running]
    assert batch.context_requests_chunking == [new]
    assert new.context_chunk_size == 96  # (100 - 1) rounded down to whole blocks


def test_reuse_chunking_and_overlap_do_not_change_outputs() -> None:
    prompts = [prompt(150), prompt(70, seed=2), [*prompt(150)[:96], *prompt(30, seed=5)]]
    reference = [r.output_tokens for r in executor(overlap=False).generate(prompts, 6)]
    variants = {
        "overlap": executor(overlap=True),
        "chunked": executor(enable_chunked_prefill=True, max_num_tokens=64),
        "no-reuse": executor(kvcache_enable_block_reuse=False),
    }
    for name, ex in variants.items():
        assert [r.output_tokens for r in ex.generate(prompts, 6)] == reference, name
    reused = executor()
    reused.generate(prompts[:1], 6)
    again = reused.generate(prompts, 6)  # the first and third now reuse the first's blocks
    assert [r.output_tokens for r in again] == reference
    assert again[0].reused_tokens == 149
    assert again[2].reused_tokens == 96


def test_a_claim_without_a_load_changes_the_output() -> None:
    # Blocks are not zeroed and the cursor moves past claimed tokens: a connector that
    # claims and does not load produces wrong tokens, which the e2e tests rely on seeing.
    good = executor().generate([prompt(100)], 8)[0].output_tokens
    rec = RecordingConnector()
    rec.scheduler.get_num_new_matched_tokens.return_value = (96, False)
    ex = executor(rec, num_blocks=4)
    ex.generate([prompt(100, seed=9)], 1)  # leaves unrelated KV in all 4 blocks
    (bad,) = ex.generate([prompt(100)], 8)
    assert bad.computed_tokens == 4
    assert bad.output_tokens != good
