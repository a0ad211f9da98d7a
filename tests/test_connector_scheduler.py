"""The scheduler core: what it claims, what it plans, when it lets go of pins."""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest

from s3kv.config import S3KVConfig
from s3kv.connector.api import RequestData
from s3kv.connector.completion import CompletionBoard
from s3kv.connector.metadata import ConnectorMetadata
from s3kv.connector.requests import RequestView, honoured_tokens
from s3kv.connector.requests import request_view as view
from s3kv.connector.scheduler import SchedulerCore
from s3kv.connector.shared import ShardStores
from s3kv.errors import KeyDerivationError
from s3kv.keys import ROOT_HASH, KeyChain, ModelIdentity, chain_hashes
from s3kv.manifest.filters import KeyFilter
from s3kv.pool import IOPool, Priority
from s3kv.staging import NumpyAllocator
from s3kv.storage import MemoryBackend
from s3kv.store import KVStore

TPB = 4
SHAPE = (2, 2, 8)


@dataclass
class FakeRequest:
    """The attributes of TensorRT-LLM's LlmRequest binding the scheduler reads."""

    request_id: int
    tokens: list[int]
    cache_salt_id: int | None = None
    lora_task_id: int | None = None
    multimodal_hashes: list[list[int]] | None = field(default=None)

    @property
    def prompt_len(self) -> int:
        return len(self.tokens)

    def get_tokens(self, beam: int) -> list[int]:
        return list(self.tokens)


def identity(rank: int = 0, tp: int = 1) -> ModelIdentity:
    return ModelIdentity(
        model_id="m", weights_revision="r", dtype="bfloat16", kv_dtype="bfloat16",
        quantization="none", tokens_per_block=TPB, kv_factor=2, block_elems=8, num_layers=2,
        layout="t", tp_size=tp, tp_rank=rank,
    )  # fmt: skip


def make_store(
    backend: MemoryBackend, rank: int = 0, tp: int = 1, pool: IOPool | None = None, **cfg: object
) -> KVStore:
    config = S3KVConfig.load(environ={}, bucket="bkt", manifest_refresh_interval=0, **cfg)
    return KVStore.open(
        config, identity(rank, tp), backend=backend, allocator=NumpyAllocator(),
        pool=pool or IOPool(0), start_background=False,
    )  # fmt: skip


def block(seed: int) -> np.ndarray:  # type: ignore[type-arg]
    return np.random.default_rng(seed).integers(0, 2**16, size=SHAPE, dtype=np.uint16)


def put_blocks(store: KVStore, tokens: list[int], n: int) -> None:
    keys = chain_hashes(tokens, TPB)
    parent = ROOT_HASH
    for i, key in enumerate(keys[:n]):
        store.save(key, parent, block(i), dtype="bfloat16", shape=SHAPE)
        parent = key
    store.flush()


def core_for(*stores: KVStore, **cfg: object) -> SchedulerCore:
    config = S3KVConfig.load(environ={}, bucket="bkt", **cfg)
    core = SchedulerCore(config, TPB)
    core.attach(ShardStores(list(stores)), board=CompletionBoard.private(), manager="v1")
    return core


PROMPT = list(range(100, 117))  # 17 tokens: 4 full blocks + 1


def staged_core(n_blocks: int = 4, **cfg: object) -> tuple[SchedulerCore, KVStore]:
    backend = MemoryBackend()
    put_blocks(make_store(backend), PROMPT, n_blocks)
    store = make_store(backend)
    store.prefetch(chain_hashes(PROMPT, TPB)[:n_blocks])
    return core_for(store, **cfg), store


def test_claims_staged_whole_blocks() -> None:
    core, store = staged_core()
    assert core.get_num_new_matched_tokens(view(FakeRequest(1, PROMPT)), 0) == 16
    # Claimed blocks are pinned: eviction cannot take them before the load.
    assert store.staging.pin_leading(chain_hashes(PROMPT, TPB)) == 4


def test_loads_of_a_request_left_one_token_are_awaited_whole() -> None:
    # main may run a final one-token context in a decode CUDA graph: no layer hook runs.
    core, _ = staged_core()
    assert core.get_num_new_matched_tokens(view(FakeRequest(1, PROMPT)), 0) == 16
    core.update_state_after_alloc(1, [0, 1, 2, 3, 4])
    meta = core.build_connector_meta([first_report(1, PROMPT, [0, 1, 2, 3, 4], 0, 1)], [])
    assert len(meta.loads) == 4
    assert meta.whole_loads
    core, _ = staged_core()
    assert core.get_num_new_matched_tokens(view(FakeRequest(2, PROMPT[:16])), 0) == 12
    core.update_state_after_alloc(2, [0, 1, 2, 3])
    meta = core.build_connector_meta([first_report(2, PROMPT[:16], [0, 1, 2, 3], 0, 4)], [])
    assert len(meta.loads) == 3
    assert not meta.whole_loads, "four tokens to compute: a context pass, hooks run"


def test_never_claims_the_whole_prompt() -> None:
    core, _ = staged_core()
    # 16 tokens = exactly 4 blocks: at most 15 may be claimed, so only 3 whole blocks.
    assert core.get_num_new_matched_tokens(view(FakeRequest(1, PROMPT[:16])), 0) == 12


def test_device_match_inside_a_block_claims_nothing() -> None:
    core, _ = staged_core()
    assert core.get_num_new_matched_tokens(view(FakeRequest(1, PROMPT)), 2) == 0


def test_claim_starts_after_the_device_match() -> None:
    core, _ = staged_core()
    assert core.get_num_new_matched_tokens(view(FakeRequest(1, PROMPT)), 8) == 8


def test_bloom_positive_tail_is_prefetched_not_claimed() -> None:
    backend = MemoryBackend()
    put_blocks(make_store(backend), PROMPT, 4)
    reader = make_store(backend)
    core = core_for(reader)
    requests_before = reader.backend.requests()
    assert core.get_num_new_matched_tokens(view(FakeRequest(1, PROMPT)), 0) == 0
    # The claim made no request itself, and its prefetch waits for the forward pass.
    assert reader.metrics.value("prefetch_scheduled") == 0
    assert core.shards is not None
    assert core.shards.held_walks == 1
    core.shards.start_walks()  # the worker's wait_for_save (inline pool: walked at once)
    assert reader.metrics.value("prefetch_scheduled") == 4
    assert reader.backend.requests() > requests_before
    assert core.get_num_new_matched_tokens(view(FakeRequest(2, PROMPT)), 0) == 16


def test_a_prefetch_no_forward_pass_started_is_started_by_the_next_iteration() -> None:
    backend = MemoryBackend()
    put_blocks(make_store(backend), PROMPT, 4)
    reader = make_store(backend)
    core = core_for(reader)
    assert core.get_num_new_matched_tokens(view(FakeRequest(1, PROMPT)), 0) == 0
    core.build_connector_meta([], [])  # this iteration: its forward pass would start it
    assert reader.metrics.value("prefetch_scheduled") == 0
    core.build_connector_meta([], [])  # none ran (an empty batch): the next one starts it
    assert reader.metrics.value("prefetch_scheduled") == 4
    assert core.shards is not None
    assert core.shards.held_walks == 0


def test_claims_every_iteration_without_a_forward_pass_never_pile_up_walks() -> None:
    backend = MemoryBackend()
    put_blocks(make_store(backend), PROMPT, 4)
    reader = make_store(backend, pool=GatedPool())  # NOTE: walks queued, never run
    core = core_for(reader)
    assert core.shards is not None
    for step in range(5):  # NOTE: a request re-offered every iteration, never scheduled
        core.get_num_new_matched_tokens(view(FakeRequest(1, PROMPT)), 0)
        assert core.shards.held_walks == min(step + 1, 2)  # NOTE: this one and the last one
        core.build_connector_meta([], [])
        assert core.shards.held_walks == 1, f"step {step}: earlier iterations' walks started"


def test_salted_request_does_not_match() -> None:
    core, _ = staged_core()
    assert core.get_num_new_matched_tokens(view(FakeRequest(1, PROMPT, cache_salt_id=7)), 0) == 0


def test_tensor_parallel_claim_needs_every_shard() -> None:
    backend = MemoryBackend()
    put_blocks(make_store(backend, 0, 2), PROMPT, 4)
    put_blocks(make_store(backend, 1, 2), PROMPT, 2)  # rank 1 has only 2 blocks
    shard0, shard1 = make_store(backend, 0, 2), make_store(backend, 1, 2)
    keys = chain_hashes(PROMPT, TPB)
    shard0.prefetch(keys)
    shard1.prefetch(keys)
    core = core_for(shard0, shard1)
    assert core.get_num_new_matched_tokens(view(FakeRequest(1, PROMPT)), 0) == 8
    # Rank 0's extra staged blocks were not left pinned by the failed part of the claim.
    assert shard0.staging.pin_leading(keys) == 4
    shard0.unpin(keys)
    assert not shard0.staging.remove(keys[0]), "claimed block 0 stays pinned"
    assert shard0.staging.remove(keys[3]), "unclaimed block 3 is not pinned"


def test_unhealthy_store_claims_nothing() -> None:
    core, store = staged_core()
    assert store.backend.breaker is not None
    for _ in range(store.config.breaker_failures):
        store.backend.breaker.record_failure()
    assert core.get_num_new_matched_tokens(view(FakeRequest(1, PROMPT)), 0) == 0


def first_report(rid: int, tokens: list[int], blocks: list[int], computed: int, scheduled: int):  # type: ignore[no-untyped-def]
    return RequestData(rid, list(tokens), list(blocks), computed, scheduled)


def cached_report(rid: int, computed: int) -> RequestData:
    return RequestData(rid, [], [], computed, 1)


def test_metadata_loads_claims_and_saves_the_rest() -> None:
    core, _ = staged_core(n_blocks=2)
    request = FakeRequest(1, PROMPT)
    assert core.get_num_new_matched_tokens(view(request), 0) == 8
    core.update_state_after_alloc(request.request_id, [10, 11, 12, 13, 14])
    meta = core.build_connector_meta([first_report(1, PROMPT, [10, 11, 12, 13, 14], 0, 9)], [])
    assert isinstance(meta, ConnectorMetadata)
    assert [op.block_id for op in meta.loads] == [10, 11]
    # Blocks 2 and 3 become full in this forward pass; block 4 (1 token) does not.
    assert [op.block_id for op in meta.saves] == [12, 13]
    keys = chain_hashes(PROMPT, TPB)
    assert meta.saves[0].parent == keys[1]
    assert len(pickle.dumps(meta)) < 1024
    assert core.request_finished(request.request_id) is True


def test_chunked_prefill_saves_each_block_once_full() -> None:
    backend = MemoryBackend()
    core = core_for(make_store(backend))
    request = FakeRequest(1, PROMPT)
    assert core.get_num_new_matched_tokens(view(request), 0) == 0
    core.update_state_after_alloc(request.request_id, [0, 1, 2, 3, 4])
    first = core.build_connector_meta([first_report(1, PROMPT, [0, 1, 2, 3, 4], 0, 6)], [])
    assert [op.block_id for op in first.saves] == [0]
    second = core.build_connector_meta([], [RequestData(1, [], [], 6, 6)])
    assert [op.block_id for op in second.saves] == [1, 2]
    third = core.build_connector_meta([], [RequestData(1, [], [], 12, 5)])
    assert [op.block_id for op in third.saves] == [3]
    # Decode blocks are not saved by default.
    decode = core.build_connector_meta([], [RequestData(1, [7, 8, 9], [5], 19, 1)])
    assert decode.saves == ()


def test_decode_reports_of_a_request_with_its_prompt_planned_skip_planning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every running request is reported every step: a decode batch of 256 cost 0.50 ms a
    # step in save planning that could find nothing (decode blocks are not saved), 27 us
    # after (bench_scheduler.py's decode_step_us on the 2-core machine).
    backend = MemoryBackend()
    store = make_store(backend)
    core = core_for(store)
    request = FakeRequest(1, PROMPT)
    core.get_num_new_matched_tokens(view(request), 0)
    core.update_state_after_alloc(request.request_id, [0, 1, 2, 3, 4])
    first = core.build_connector_meta([first_report(1, PROMPT, [0, 1, 2, 3, 4], 0, 6)], [])
    assert [op.block_id for op in first.saves] == [0], "the prompt is not all planned yet"
    rest = core.build_connector_meta([], [RequestData(1, [], [], 6, 11)])
    assert [op.block_id for op in rest.saves] == [1, 2, 3]

    def no_planning(*args: object, **kwargs: object) -> object:
        raise AssertionError("planned again")

    monkeypatch.setattr(core, "_plan_request_saves", no_planning)
    for position in range(17, 57):
        decode = core.build_connector_meta([], [RequestData(1, [7], [5], position, 1)])
        assert decode.saves == ()
    assert store.metrics.value("connector_save_planning_errors") == 0
    assert core.tracked_requests == 1


def test_a_prompt_computed_while_the_store_was_unhealthy_is_saved_once_it_recovers() -> None:
    # Planning nothing while the breaker is open must not mark the request done saving.
    store = make_store(MemoryBackend())
    core = core_for(store)
    breaker = store.backend.breaker
    assert breaker is not None
    for _ in range(store.config.breaker_failures):
        breaker.record_failure()
    request = FakeRequest(1, PROMPT)
    core.get_num_new_matched_tokens(view(request), 0)
    core.update_state_after_alloc(request.request_id, [0, 1, 2, 3, 4])
    prefill = core.build_connector_meta([first_report(1, PROMPT, [0, 1, 2, 3, 4], 0, 17)], [])
    assert prefill.saves == ()
    breaker.record_success()
    decode = core.build_connector_meta([], [RequestData(1, [7], [], 17, 1)])
    assert [op.block_id for op in decode.saves] == [0, 1, 2, 3]


def test_a_prompt_whose_block_ids_arrive_late_is_still_saved_whole() -> None:
    # Whether a request is done saving is decided on the blocks it could plan, not on the
    # tokens computed: a report without all the prompt's block ids leaves it open.
    core = core_for(make_store(MemoryBackend()))
    request = FakeRequest(1, PROMPT)
    core.get_num_new_matched_tokens(view(request), 0)
    first = core.build_connector_meta([first_report(1, PROMPT, [0, 1], 0, 17)], [])
    assert [op.block_id for op in first.saves] == [0, 1]
    later = core.build_connector_meta([], [RequestData(1, [], [2, 3, 4], 17, 1)])
    assert [op.block_id for op in later.saves] == [2, 3]


def test_decode_blocks_saved_when_configured() -> None:
    backend = MemoryBackend()
    core = core_for(make_store(backend), save_decode_blocks=True)
    request = FakeRequest(1, PROMPT)
    core.get_num_new_matched_tokens(view(request), 0)
    core.update_state_after_alloc(request.request_id, [0, 1, 2, 3, 4])
    core.build_connector_meta([first_report(1, PROMPT, [0, 1, 2, 3, 4], 0, 17)], [])
    decode = core.build_connector_meta([], [RequestData(1, [7, 8, 9], [], 19, 1)])
    assert [op.block_id for op in decode.saves] == [4]
    expected = chain_hashes([*PROMPT, 7, 8, 9], TPB)[4]
    assert decode.saves[0].key == expected


def test_blocks_already_in_the_bucket_are_not_saved_again() -> None:
    core, _ = staged_core(n_blocks=4)
    request = FakeRequest(1, PROMPT)
    # The device matched everything locally: the connector claims nothing...
    assert core.get_num_new_matched_tokens(view(request), 16) == 0
    core.update_state_after_alloc(request.request_id, [0, 1, 2, 3, 4])
    meta = core.build_connector_meta([first_report(1, PROMPT, [0, 1, 2, 3, 4], 16, 1)], [])
    assert meta.saves == (), "...and does not copy out blocks the manifest already has"
    assert core.request_finished(request.request_id) is False


def put_chain_without(store: KVStore, tokens: list[int], n: int, hole: int) -> None:
    keys = chain_hashes(tokens, TPB)
    for i in range(n):
        if i != hole:
            store.save(keys[i], keys[i - 1] if i else ROOT_HASH, block(i), dtype="bfloat16",
                       shape=SHAPE)  # fmt: skip
    store.flush()


def test_a_chain_is_saved_from_the_first_block_the_bucket_lacks_past_a_hole_too() -> None:
    backend = MemoryBackend()
    put_chain_without(make_store(backend), PROMPT, 4, hole=2)
    core = core_for(make_store(backend))
    request = FakeRequest(1, PROMPT)
    assert core.get_num_new_matched_tokens(view(request), 0) == 0  # nothing staged
    core.update_state_after_alloc(request.request_id, [0, 1, 2, 3, 4])
    meta = core.build_connector_meta([first_report(1, PROMPT, [0, 1, 2, 3, 4], 0, 17)], [])
    keys = chain_hashes(PROMPT, TPB)
    # Blocks 0 and 1 exist; 2 is the hole; 3 exists past it and is written again (keys
    # chain: only a failed save leaves such a block, and a rewrite of it is harmless).
    assert [op.block_id for op in meta.saves] == [2, 3]
    assert [op.parent for op in meta.saves] == [keys[1], keys[2]]


def test_a_cold_prompt_asks_the_filter_one_key_not_a_pass_over_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = MemoryBackend()
    put_blocks(make_store(backend), list(range(500, 517)), 4)  # the filter is not empty
    core = core_for(make_store(backend))
    passes: list[int] = []
    real = KeyFilter.contains_many
    monkeypatch.setattr(
        KeyFilter, "contains_many", lambda self, keys: passes.append(len(keys)) or real(self, keys)
    )
    request = FakeRequest(1, PROMPT)
    core.get_num_new_matched_tokens(view(request), 0)
    core.update_state_after_alloc(request.request_id, [0, 1, 2, 3, 4])
    meta = core.build_connector_meta([first_report(1, PROMPT, [0, 1, 2, 3, 4], 0, 17)], [])
    assert [op.block_id for op in meta.saves] == [0, 1, 2, 3]
    assert passes == []


def test_a_cold_prompts_keys_past_the_claims_lookup_go_to_the_workers_unhashed(
    hashed: list[int],
) -> None:
    core = core_for(make_store(MemoryBackend()))
    prompt = list(range(1000, 1000 + 100 * TPB + 1))  # 100 full blocks
    request = FakeRequest(1, prompt)
    core.get_num_new_matched_tokens(view(request), 0)
    blocks = list(range(101))
    core.update_state_after_alloc(request.request_id, blocks)
    meta = core.build_connector_meta([first_report(1, prompt, blocks, 0, len(prompt))], [])
    assert sum(hashed) == KeyChain.STEP  # NOTE: only what the lookups asked for
    wire = pickle.loads(pickle.dumps(meta))
    assert wire.saves.unhashed == 100 - KeyChain.STEP
    keys = chain_hashes(prompt, TPB)
    assert [op.key for op in wire.saves] == keys[:100]
    assert [op.parent for op in wire.saves] == [ROOT_HASH, *keys[:99]]
    assert [op.block_id for op in wire.saves] == blocks[:100]


def test_blocks_without_a_page_are_skipped_and_the_rest_keep_their_parents() -> None:
    core = core_for(make_store(MemoryBackend()))
    request = FakeRequest(1, PROMPT)
    core.get_num_new_matched_tokens(view(request), 0)
    core.update_state_after_alloc(request.request_id, [-1, 6, -1, 8, 9])
    meta = core.build_connector_meta([first_report(1, PROMPT, [-1, 6, -1, 8, 9], 0, 17)], [])
    keys = chain_hashes(PROMPT, TPB)
    assert [(op.block_id, op.key, op.parent) for op in meta.saves] == [
        (6, keys[1], keys[0]), (8, keys[3], keys[2])
    ]  # fmt: skip


def test_a_sliding_windows_saved_blocks_are_not_saved_again_behind_its_pageless_ones() -> None:
    backend = MemoryBackend()
    put_chain_without(make_store(backend), PROMPT, 4, hole=0)  # block 0: never a page
    core = core_for(make_store(backend))
    request = FakeRequest(1, PROMPT)
    core.get_num_new_matched_tokens(view(request), 0)
    core.update_state_after_alloc(request.request_id, [-1, 6, 7, 8, 9])
    meta = core.build_connector_meta([first_report(1, PROMPT, [-1, 6, 7, 8, 9], 0, 17)], [])
    assert meta.saves == ()  # NOTE: blocks 1-3 are in the bucket; block 0 cannot be saved


def test_pins_are_held_until_every_rank_reports_the_copies_completed() -> None:
    # Defect 1 (overlap scheduler): the next scheduler step is no proof that the device
    # copies of this step's loads have run; only the completion board is.
    core, store = staged_core(n_blocks=4)
    keys = chain_hashes(PROMPT, TPB)
    request = FakeRequest(1, PROMPT)
    core.get_num_new_matched_tokens(view(request), 0)
    core.update_state_after_alloc(request.request_id, [0, 1, 2, 3, 4])
    meta = core.build_connector_meta([first_report(1, PROMPT, [0, 1, 2, 3, 4], 0, 1)], [])
    assert meta.load_seq == 1
    assert not store.staging.remove(keys[0]), "pinned during the iteration that loads it"
    core.build_connector_meta([], [])
    core.build_connector_meta([], [])
    assert not store.staging.remove(keys[0]), "still pinned: no rank reported completion"
    core.board.publish(0, meta.load_seq)
    core.build_connector_meta([], [])
    assert store.staging.remove(keys[0]), "released once the copies completed"
    assert core.held_load_batches == 0


def test_tensor_parallel_pins_wait_for_the_slowest_rank() -> None:
    core, store = staged_core(n_blocks=4)
    assert core.shards is not None
    core.attach(core.shards, board=CompletionBoard.private(world_size=2), manager="v1")
    keys = chain_hashes(PROMPT, TPB)
    request = FakeRequest(1, PROMPT)
    core.get_num_new_matched_tokens(view(request), 0)
    core.update_state_after_alloc(request.request_id, [0, 1, 2, 3, 4])
    meta = core.build_connector_meta([first_report(1, PROMPT, [0, 1, 2, 3, 4], 0, 1)], [])
    core.board.publish(0, meta.load_seq)
    core.build_connector_meta([], [])
    assert not store.staging.remove(keys[0]), "rank 1 has not finished copying"
    core.board.publish(1, meta.load_seq)
    core.build_connector_meta([], [])
    assert store.staging.remove(keys[0])


def test_a_failed_save_plan_keeps_the_claimed_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    # Defect 4: the engine counts claimed tokens as computed before build_connector_meta;
    # a failure while planning saves must never cost a load.
    core, _ = staged_core(n_blocks=4)
    request = FakeRequest(1, PROMPT)
    assert core.get_num_new_matched_tokens(view(request), 0) == 16
    core.update_state_after_alloc(request.request_id, [0, 1, 2, 3, 4])

    def broken(*args: object, **kwargs: object) -> list[object]:
        raise RuntimeError("injected")

    monkeypatch.setattr(core, "_plan_saves", broken)
    meta = core.build_connector_meta([first_report(1, PROMPT, [0, 1, 2, 3, 4], 0, 1)], [])
    assert [op.block_id for op in meta.loads] == [0, 1, 2, 3]


def test_take_metadata_hands_out_loads_planned_before_a_failure() -> None:
    # The adapter's fallback when build_connector_meta raises outright.
    core, _ = staged_core(n_blocks=4)
    request = FakeRequest(1, PROMPT)
    core.get_num_new_matched_tokens(view(request), 0)
    core.update_state_after_alloc(request.request_id, [7, 8, 9, 10, 11])
    meta = core.take_metadata()
    assert [op.block_id for op in meta.loads] == [7, 8, 9, 10]
    assert core.take_metadata().loads == (), "each load is handed out once"


def test_loads_are_planned_from_the_first_report_when_alloc_state_was_lost() -> None:
    core, _ = staged_core(n_blocks=4)
    request = FakeRequest(1, PROMPT)
    core.get_num_new_matched_tokens(view(request), 0)  # update_state_after_alloc never arrived
    meta = core.build_connector_meta([first_report(1, PROMPT, [5, 6, 7, 8, 9], 0, 1)], [])
    assert [op.block_id for op in meta.loads] == [5, 6, 7, 8]


def test_requests_freed_without_request_finished_are_forgotten() -> None:
    # Defect 6: TensorRT-LLM frees cancelled and failed requests without request_finished.
    core, store = staged_core(n_blocks=4)
    cancelled = FakeRequest(1, PROMPT)
    core.get_num_new_matched_tokens(view(cancelled), 0)  # claimed and pinned, never scheduled
    running = FakeRequest(2, [1, 2, 3, 4, 5])
    core.get_num_new_matched_tokens(view(running), 0)
    for _ in range(SchedulerCore.STALE_STEPS + 1):
        core.build_connector_meta([], [cached_report(2, 5)])
    assert core.tracked_requests == 1, "the running request is kept"
    assert store.staging.remove(chain_hashes(PROMPT, TPB)[0]), "the cancelled claim unpinned"
    assert store.metrics.value("connector_forgotten_requests") == 1


def test_a_request_gone_from_a_steady_batch_is_forgotten_after_stale_steps() -> None:
    # The scan for stale requests runs only from the step the oldest could be stale.
    core = core_for(make_store(MemoryBackend()))
    for rid in (1, 2):
        core.get_num_new_matched_tokens(view(FakeRequest(rid, PROMPT)), 0)
    for _ in range(100):
        core.build_connector_meta([], [cached_report(1, 17), cached_report(2, 17)])
    for _ in range(SchedulerCore.STALE_STEPS):
        core.build_connector_meta([], [cached_report(2, 17)])
    assert core.tracked_requests == 2, "missing for STALE_STEPS steps: kept"
    core.build_connector_meta([], [cached_report(2, 17)])
    assert core.tracked_requests == 1, "one step more: forgotten"
    core.get_num_new_matched_tokens(view(FakeRequest(3, PROMPT)), 0)
    for _ in range(SchedulerCore.STALE_STEPS + 1):
        core.build_connector_meta([], [cached_report(2, 17)])
    assert core.tracked_requests == 1, "a request claimed later and never reported: forgotten"


def test_stale_steps_changed_between_scans_takes_effect(monkeypatch: pytest.MonkeyPatch) -> None:
    core = core_for(make_store(MemoryBackend()))
    core.get_num_new_matched_tokens(view(FakeRequest(1, PROMPT)), 0)
    core.build_connector_meta([], [])
    monkeypatch.setattr(SchedulerCore, "STALE_STEPS", 2)
    for _ in range(3):
        core.build_connector_meta([], [])
    assert core.tracked_requests == 0


@pytest.mark.parametrize(
    ("attrs", "reason"),
    [
        ({"lora_task_id": 3}, "a LoRA task id with no configured adapter revision"),
        ({"prompt_embedding_table": object()}, "a p-tuning prompt table"),
    ],
)
def test_requests_with_invisible_key_inputs_are_neither_claimed_nor_saved(
    attrs: dict[str, object], reason: str
) -> None:
    # Defect 8: inputs the connector cannot see must not share a key.
    core, _ = staged_core(n_blocks=4)
    request = FakeRequest(1, PROMPT)
    for name, value in attrs.items():
        setattr(request, name, value)
    assert core.get_num_new_matched_tokens(view(request), 0) == 0, reason
    core.update_state_after_alloc(request.request_id, [0, 1, 2, 3, 4])
    meta = core.build_connector_meta([first_report(1, PROMPT, [0, 1, 2, 3, 4], 0, 17)], [])
    assert meta.saves == (), reason
    assert meta.loads == (), reason


def test_lora_requests_key_on_the_configured_adapter_revision() -> None:
    backend = MemoryBackend()
    store = make_store(backend)
    config = S3KVConfig.load(environ={}, bucket="bkt", lora_revisions="3=commit:abc, 4=commit:def")
    core = SchedulerCore(config, TPB)
    core.attach(ShardStores([store]), board=CompletionBoard.private(), manager="v1")
    lora = config.lora_revision_map()
    request = FakeRequest(1, PROMPT, lora_task_id=3)
    core.get_num_new_matched_tokens(view(request, lora), 0)
    core.update_state_after_alloc(request.request_id, [0, 1, 2, 3, 4])
    meta = core.build_connector_meta([first_report(1, PROMPT, [0, 1, 2, 3, 4], 0, 17)], [])
    keys_3 = [op.key for op in meta.saves]
    assert len(keys_3) == 4
    assert keys_3 != [bytes(k) for k in chain_hashes(PROMPT, TPB)]
    other = FakeRequest(2, PROMPT, lora_task_id=4)
    core.get_num_new_matched_tokens(view(other, lora), 0)
    meta = core.build_connector_meta([first_report(2, PROMPT, [5, 6, 7, 8, 9], 0, 17)], [])
    assert {op.key for op in meta.saves}.isdisjoint(keys_3), "another adapter, other keys"


def test_v2_loads_exactly_the_honoured_blocks_and_unpins_the_rest() -> None:
    # Defect 5: KVCacheManagerV2 may honour fewer tokens than offered
    # (commit_new_matched_tokens sets py_num_connector_matched_tokens before the alloc call).
    core, store = staged_core(n_blocks=4)
    assert core.shards is not None
    core.attach(core.shards, board=core.board, manager="v2")
    keys = chain_hashes(PROMPT, TPB)
    request = FakeRequest(1, PROMPT)
    assert core.get_num_new_matched_tokens(view(request), 0) == 16
    request.py_num_connector_matched_tokens = 8  # type: ignore[attr-defined]
    core.update_state_after_alloc(request.request_id, [0, 1, 2], honoured_tokens(request))
    meta = core.build_connector_meta([first_report(1, PROMPT, [0, 1, 2], 0, 4)], [])
    assert [op.block_id for op in meta.loads] == [0, 1]
    assert store.staging.remove(keys[2]), "the unhonoured tail is unpinned"
    assert store.staging.remove(keys[3])
    assert not store.staging.remove(keys[0])


def test_unscheduled_claim_is_released_at_finish() -> None:
    core, store = staged_core(n_blocks=4)
    request = FakeRequest(1, PROMPT)
    core.get_num_new_matched_tokens(view(request), 0)
    core.request_finished(request.request_id)
    assert store.staging.remove(chain_hashes(PROMPT, TPB)[0])
    assert core.tracked_requests == 0


@pytest.mark.parametrize("computed", [0, 4, 8, 12, 16])
def test_claim_bound_holds_for_every_device_match(computed: int) -> None:
    core, _ = staged_core()
    claimed = core.get_num_new_matched_tokens(view(FakeRequest(1, PROMPT)), computed)
    assert claimed % TPB == 0
    assert claimed <= len(PROMPT) - 1 - computed


# --- the scheduler's path for long prompts: keys hashed once, the tail handed over in one step


class GatedPool(IOPool):
    """Holds every task until run, to see what the claim queued."""

    def __init__(self) -> None:
        super().__init__(0)
        self.tasks: list[Callable[[], None]] = []

    def submit_many(self, priority: Priority, tasks: Sequence[Callable[[], None]]) -> bool:
        self.tasks.extend(tasks)  # NOTE: submit comes here too
        return True

    def run_all(self) -> None:
        while self.tasks:
            self.tasks.pop(0)()


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Blocks hashed by every KeyChain, step by step."""
    steps: list[int] = []
    original = KeyChain._hash

    def counting(chain: KeyChain, have: int, upto: int) -> None:
        steps.append(upto - have)
        original(chain, have, upto)

    monkeypatch.setattr(KeyChain, "_hash", counting)
    return steps


def test_a_request_asked_again_and_its_saves_reuse_its_keys(hashed: list[int]) -> None:
    core, _ = staged_core(n_blocks=2)
    request = FakeRequest(1, PROMPT)
    assert core.get_num_new_matched_tokens(view(request), 0) == 8
    assert sum(hashed) == 4, "the prompt's 4 blocks, once"
    # The engine asks again about a request it did not schedule: same answer, no hashing.
    assert core.get_num_new_matched_tokens(view(request), 0) == 8
    core.update_state_after_alloc(request.request_id, [10, 11, 12, 13, 14])
    meta = core.build_connector_meta([first_report(1, PROMPT, [10, 11, 12, 13, 14], 0, 17)], [])
    assert [op.key for op in meta.saves] == [bytes(k) for k in chain_hashes(PROMPT, TPB)[2:4]]
    assert sum(hashed) == 4, "the save path used the claim's keys"


def test_a_reused_request_id_with_another_prompt_gets_its_own_keys() -> None:
    core, _ = staged_core(n_blocks=4)
    other = [t + 1000 for t in PROMPT]
    assert core.get_num_new_matched_tokens(view(FakeRequest(1, other)), 0) == 0
    # Same id, no request_finished in between, another prompt of the same length.
    assert core.get_num_new_matched_tokens(view(FakeRequest(1, PROMPT)), 0) == 16


def test_request_keys_are_dropped_at_finish_and_do_not_grow() -> None:
    core, _ = staged_core(n_blocks=4)
    for rid in range(200):
        prompt = [rid * 1000 + t for t in range(64 + 1)]
        request = FakeRequest(rid, prompt)
        core.get_num_new_matched_tokens(view(request), 0)
        core.update_state_after_alloc(rid, list(range(17)))
        core.build_connector_meta([first_report(rid, prompt, list(range(17)), 0, 65)], [])
        assert 0 < core.key_cache_bytes < 16 * 100, "one request's keys"
        core.request_finished(rid)
        assert core.key_cache_bytes == 0
    assert core.tracked_requests == 0


def test_long_prompt_claim_hashes_one_step_and_queues_one_task(hashed: list[int]) -> None:
    # Defect (issue 12, item 11): a 128K-token prompt cost ~110 ms on the scheduler's path,
    # mostly queueing one prefetch per Bloom-positive block, under the block manager's lock.
    pool = GatedPool()
    config = S3KVConfig.load(environ={}, bucket="bkt", manifest_refresh_interval=0)
    store = KVStore.open(config, identity(), backend=MemoryBackend(), allocator=NumpyAllocator(),
                         pool=pool, start_background=False)  # fmt: skip
    prompt = list(range(4 * 1000 + 1))
    keys = chain_hashes(prompt, TPB)
    parent = ROOT_HASH
    for key in keys:  # the filter says "maybe" for every block; nothing is staged
        store.manifest.record_write(key, parent, 1)
        parent = key
    core = core_for(store)
    assert core.get_num_new_matched_tokens(view(FakeRequest(1, prompt)), 0) == 0
    assert sum(hashed) <= KeyChain.STEP, "hashed as far as the claim needs, not 1000 blocks"
    assert core.shards is not None
    assert core.shards.held_walks == 1
    core.shards.start_walks()  # once the forward pass is queued
    assert len(pool.tasks) == 1, "the tail went to the I/O side in one step"
    pool.run_all()  # there: the rest is hashed, filtered, and every block fetched (misses)
    assert sum(hashed) == 1000
    assert store.metrics.value("prefetch_scheduled") == 1000
    assert store.metrics.value("prefetch_not_found") == 1000


def test_a_malformed_prompt_raises_before_any_pin() -> None:
    # Keys are hashed while the claim counts the staged run, before it pins anything.
    core, store = staged_core(n_blocks=4)
    prompt = [*PROMPT[:12], -1, *PROMPT[13:]]  # blocks 0..2 staged, block 3 malformed
    with pytest.raises(KeyDerivationError, match="tokens"):
        core.get_num_new_matched_tokens(view(FakeRequest(1, prompt)), 0)
    assert store.staging.remove(chain_hashes(PROMPT, TPB)[0]), "nothing was left pinned"


def test_a_cold_prompts_tokens_are_converted_by_whoever_hashes_their_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Converting 8K tokens cost the scheduler ~90 us before the forward pass; the workers
    # convert them when they hash the keys, after it is queued.
    import s3kv.keys

    converted: list[int] = []
    original = s3kv.keys._token_bytes
    monkeypatch.setattr(
        s3kv.keys, "_token_bytes", lambda tokens: converted.append(len(tokens)) or original(tokens)
    )
    core = core_for(make_store(MemoryBackend()))
    prompt = list(range(1000, 1000 + 100 * TPB + 1))  # 100 full blocks
    core.get_num_new_matched_tokens(view(FakeRequest(1, prompt)), 0)
    blocks = list(range(101))
    core.update_state_after_alloc(1, blocks)
    meta = core.build_connector_meta([first_report(1, prompt, blocks, 0, len(prompt))], [])
    assert sum(converted) <= KeyChain.STEP * TPB, "only the tokens of the claim's lookup"
    assert [op.key for op in meta.saves] == chain_hashes(prompt, TPB)[:100]
    assert sum(converted) >= 100 * TPB


def test_a_reports_token_list_is_neither_kept_nor_changed() -> None:
    # A prompt's ints held in a list across iterations cost every garbage collection a pass
    # over them; the keys' chain holds the prompt, decode tokens go to it when saved.
    core = core_for(make_store(MemoryBackend()), save_decode_blocks=True)
    core.get_num_new_matched_tokens(view(FakeRequest(1, PROMPT)), 0)
    core.update_state_after_alloc(1, [0, 1, 2, 3, 4])
    report = first_report(1, PROMPT, [0, 1, 2, 3, 4], 0, 17)
    tokens = report.new_tokens
    held = sys.getrefcount(tokens)
    core.build_connector_meta([report], [])
    after = sys.getrefcount(tokens)  # NOTE: outside the assert, which holds its operands
    assert after == held, "the report's list is not kept"
    decode_tokens = [7, 8, 9]
    held = sys.getrefcount(decode_tokens)
    decode = core.build_connector_meta([], [RequestData(1, decode_tokens, [], 19, 1)])
    after = sys.getrefcount(decode_tokens)
    assert after == held
    assert report.new_tokens == PROMPT, "nor changed"
    assert decode_tokens == [7, 8, 9]
    assert decode.saves[0].key == chain_hashes([*PROMPT, 7, 8, 9], TPB)[4]


def test_a_request_view_keeps_the_bindings_fresh_list_when_it_is_the_prompt() -> None:
    tokens = list(PROMPT)

    class Binding(FakeRequest):
        def get_tokens(self, beam: int) -> list[int]:
            return tokens  # NOTE: the binding converts afresh each call; this is that list

    assert view(Binding(1, PROMPT)).prompt is tokens
    longer = Binding(2, PROMPT)
    tokens.append(5)  # a generated token: the view is the prompt alone
    assert list(view(longer).prompt) == PROMPT


def tracked_sequences(root: object, at_least: int) -> list[int]:
    """Lengths of the garbage-collected lists and tuples of ``at_least`` items or more that
    ``root`` reaches through s3kv's objects and plain containers."""
    import gc
    import types

    seen: set[int] = set()
    found: list[int] = []
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, type | types.ModuleType | types.FunctionType):
            continue
        seen.add(id(obj))
        if isinstance(obj, list | tuple) and len(obj) >= at_least and gc.is_tracked(obj):
            found.append(len(obj))
            continue
        module = type(obj).__module__
        if module.startswith("s3kv") or isinstance(obj, list | tuple | dict | set):
            todo.extend(gc.get_referents(obj))
    return found


def test_after_the_forward_pass_no_prompt_is_held_in_a_list_the_collector_scans() -> None:
    # Every collection that finds such a list young pays a pass over its ints: a cold 8K
    # prompt's two added 0.15 ms of collections before its first token (gpu_ab.py).
    core = core_for(make_store(MemoryBackend()))
    prompt = list(range(1000, 1000 + 100 * TPB + 1))
    core.get_num_new_matched_tokens(view(FakeRequest(1, prompt)), 0)
    blocks = list(range(101))
    core.update_state_after_alloc(1, blocks)
    meta = core.build_connector_meta([first_report(1, prompt, blocks, 0, len(prompt))], [])
    assert tracked_sequences(core, len(prompt) // 2), "held until the pass is queued"
    core.after_forward()
    assert tracked_sequences(core, len(prompt) // 2) == []
    assert tracked_sequences(meta, len(prompt) // 2) == []
    assert [op.key for op in meta.saves] == chain_hashes(prompt, TPB)[:100]


BAD_TAIL = [*range(1000, 1000 + 20 * TPB), -5, *range(1, 4 * TPB + 1)]  # bad past the lookup


def test_under_tp_a_bad_token_costs_its_requests_saves_not_the_broadcast() -> None:
    # The broadcast pickles the metadata on rank 0's engine thread, outside every guard: a
    # run whose tokens cannot be read must fail where its saves are planned, not there.
    backend = MemoryBackend()
    core = core_for(make_store(backend, 0, 2), make_store(backend, 1, 2))
    good = list(range(5000, 5000 + 20 * TPB + 1))
    for rid, tokens in ((1, BAD_TAIL), (2, good)):
        core.get_num_new_matched_tokens(view(FakeRequest(rid, tokens)), 0)
        core.update_state_after_alloc(rid, list(range(100 * rid, 100 * rid + 30)))
    meta = core.build_connector_meta(
        [
            first_report(1, BAD_TAIL, list(range(100, 130)), 0, len(BAD_TAIL)),
            first_report(2, good, list(range(200, 230)), 0, len(good)),
        ],
        [],
    )
    wire = pickle.loads(pickle.dumps(meta))  # NOTE: what mpi_broadcast does
    assert set(wire.saves.request_ids) == {2}
    assert [op.key for op in wire.saves] == chain_hashes(good, TPB)[:20]
    assert core.shards is not None
    assert core.shards.metrics.value("connector_save_planning_errors") == 1


def test_with_one_rank_saves_whose_keys_cannot_be_derived_still_pickle() -> None:
    core = core_for(make_store(MemoryBackend()))
    core.get_num_new_matched_tokens(view(FakeRequest(1, BAD_TAIL)), 0)
    core.update_state_after_alloc(1, list(range(30)))
    meta = core.build_connector_meta([first_report(1, BAD_TAIL, list(range(30)), 0, 99)], [])
    assert len(meta.saves) == 24, "planned: the bad token is read only when hashed"
    assert pickle.loads(pickle.dumps(meta.saves)) == (), "not sent rather than raised"


def test_a_finished_request_leaves_no_prompt_behind_before_any_forward_pass() -> None:
    core = core_for(make_store(MemoryBackend()))
    prompt = list(range(1000, 1000 + 100 * TPB + 1))
    for rid in range(3):
        core.get_num_new_matched_tokens(view(FakeRequest(rid, prompt)), 0)
    core.request_finished(0)
    core.abandon(1)
    assert core.shards is not None
    core.shards.start_walks()  # NOTE: the claims' held walks hold their chains until then
    assert tracked_sequences(core, len(prompt) // 2) == [len(prompt)], "request 2's alone"


def test_decode_keys_stop_where_the_chain_cannot_grow_and_the_prompt_is_still_saved() -> None:
    core = core_for(make_store(MemoryBackend()), save_decode_blocks=True)
    extra = list(range(len(PROMPT)))
    request = RequestView(1, PROMPT, {"extra_ids": extra})  # NOTE: per-token extra ids
    core.get_num_new_matched_tokens(request, 0)
    core.update_state_after_alloc(1, [0, 1, 2, 3, 4])
    first = core.build_connector_meta([first_report(1, PROMPT, [0, 1, 2, 3, 4], 0, 17)], [])
    assert [op.block_id for op in first.saves] == [0, 1, 2, 3]
    decode = core.build_connector_meta([], [RequestData(1, [7, 8, 9], [], 19, 1)])
    assert decode.saves == ()
    assert core.shards is not None
    assert core.shards.metrics.value("connector_save_planning_errors") == 0
