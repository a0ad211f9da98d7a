"""TensorRT-LLM's connector integration tests, replayed against the emulated runtime.

Each test mirrors one test of ``tests/integration/defs/llmapi/test_llm_api_connector.py``
(NVIDIA/TensorRT-LLM @ ``00e9b8a7``): same prompts and lengths, same connector answers (a
:class:`RecordingConnector` instead of ``MagicMock``), same assertions, for both executor
loops. Extra assertions that the upstream test does not make are marked "beyond upstream".
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
from _emulator import executor, one_torch_thread, prompt

from s3kv.testing.emulator.recording import RecordingConnector, echo_finished


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


OVERLAP = pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])


@OVERLAP
def test_connector_simple(overlap: bool) -> None:
    num_tokens = 8
    rec = RecordingConnector()
    ex = executor(rec, overlap=overlap)
    sched, worker = rec.scheduler, rec.worker
    assert worker.register_kv_caches.call_count == 1

    ex.generate([prompt(4)], num_tokens)  # "Hello, world": a few tokens, one block

    assert sched.update_state_after_alloc.call_count == 1
    assert len(sched.update_state_after_alloc.call_args.args[1]) == 1
    # One SchedulerOutput per forward pass, the same count under both loops.
    assert sched.build_connector_meta.call_count == num_tokens
    for i, out in enumerate(rec.scheduler_outputs()):
        if i == 0:
            assert (len(out.new_requests), len(out.cached_requests)) == (1, 0)
        elif i == 1 and overlap:
            # The first generation step is scheduled before the first token is known.
            assert (len(out.new_requests), len(out.cached_requests)) == (0, 1)
            assert len(out.cached_requests[0].new_tokens) == 0
        else:
            assert (len(out.new_requests), len(out.cached_requests)) == (0, 1)
            assert len(out.cached_requests[0].new_tokens) == 1
    assert worker.start_load_kv.call_count == num_tokens
    assert sched.get_num_new_matched_tokens.call_count == 1
    num_layers = max(call.args[0] for call in worker.wait_for_layer_load.call_args_list) + 1
    assert num_layers == 2  # beyond upstream: the tiny model's depth
    assert worker.wait_for_layer_load.call_count == num_layers * num_tokens
    assert worker.save_kv_layer.call_count == num_layers * num_tokens
    for i, call in enumerate(worker.wait_for_layer_load.call_args_list):
        assert call.args[0] == i % num_layers
    for i, call in enumerate(worker.save_kv_layer.call_args_list):
        assert call.args[0] == i % num_layers
    assert worker.wait_for_save.call_count == num_tokens
    assert sched.request_finished.call_count == 1
    assert len(sched.request_finished.call_args.args[1]) == 1
    # Once per iteration, plus the overlap loop's extra iteration that commits the last token.
    assert worker.get_finished.call_count == num_tokens + int(overlap)


@OVERLAP
def test_connector_async_onboard(overlap: bool) -> None:
    num_tokens = 8
    rec = RecordingConnector()
    ex = executor(rec, overlap=overlap)
    rec.scheduler.get_num_new_matched_tokens.return_value = (16, True)
    rec.worker.get_finished.side_effect = echo_finished

    (result,) = ex.generate([prompt(26)], num_tokens)  # the "Lorem ipsum ..." sentence

    # Once for the parked iteration (no forward pass), then once per token (+1 overlap).
    assert rec.worker.get_finished.call_count == num_tokens + 1 + int(overlap)
    assert len(rec.worker.get_finished.call_args_list[0].args[1]) == 1
    # Beyond upstream: the parked iteration reported nothing, the request's first report
    # comes after the load and its computed_position includes the 16 loaded tokens.
    first, second = rec.scheduler_outputs()[:2]
    assert first.new_requests == []
    assert first.cached_requests == []
    assert second.new_requests[0].computed_position == 16
    assert second.new_requests[0].num_scheduled_tokens == 26 - 16
    assert result.loaded_async
    assert result.connector_tokens == 16


@OVERLAP
def test_connector_async_save(overlap: bool) -> None:
    num_tokens = 8
    rec = RecordingConnector()
    ex = executor(rec, overlap=overlap)
    rec.scheduler.request_finished.return_value = True
    rec.worker.get_finished.side_effect = echo_finished

    ex.generate([prompt(4)], num_tokens)

    assert rec.scheduler.request_finished.call_count == 1
    assert len(rec.scheduler.request_finished.call_args.args[1]) == 1
    calls = rec.worker.get_finished.call_args_list
    assert len(calls) == num_tokens + int(overlap)
    for call in calls[:-1]:
        assert call.args == ([], [])
    finished_request = rec.scheduler.request_finished.call_args.args[0]
    assert calls[-1].args[0] == [finished_request.request_id]


@OVERLAP
def test_connector_scheduler_output(overlap: bool) -> None:
    num_input, num_tokens, block = 48, 32, 32
    rec = RecordingConnector()
    ex = executor(rec, overlap=overlap)
    sched = rec.scheduler

    ex.generate([[0] * num_input], num_tokens)

    assert sched.update_state_after_alloc.call_count == 1
    assert len(sched.update_state_after_alloc.call_args.args[1]) == math.ceil(num_input / block)
    assert sched.build_connector_meta.call_count == num_tokens
    for i, out in enumerate(rec.scheduler_outputs()):
        if i == 0:
            assert (len(out.new_requests), len(out.cached_requests)) == (1, 0)
            req = out.new_requests[0]
            assert len(req.new_tokens) == num_input
            assert len(req.new_block_ids) == math.ceil(num_input / block)
            assert req.computed_position == 0
            assert req.num_scheduled_tokens == num_input
        elif i == 1 and overlap:
            assert (len(out.new_requests), len(out.cached_requests)) == (0, 1)
            assert len(out.cached_requests[0].new_tokens) == 0
            assert out.cached_requests[0].num_scheduled_tokens == 1
        else:
            assert (len(out.new_requests), len(out.cached_requests)) == (0, 1)
            req = out.cached_requests[0]
            assert len(req.new_tokens) == 1
            # A new block exactly when the position being written starts one.
            if (req.computed_position + int(overlap)) % block == 0:
                assert len(req.new_block_ids) == 1
            else:
                assert req.new_block_ids == []
            assert req.num_scheduled_tokens == 1

    sched.build_connector_meta.reset_mock()
    sched.get_num_new_matched_tokens.return_value = (8, False)
    assert len(sched.request_finished.call_args.args[1]) == math.ceil(
        (num_input + num_tokens) / block
    )
    ex.generate([[1] * num_input], num_tokens)
    # The first report counts only the device match: the connector's 8 tokens are not in it.
    assert (
        sched.build_connector_meta.call_args_list[0].args[0].new_requests[0].computed_position == 0
    )


@OVERLAP
def test_connector_scheduler_output_chunked_context(overlap: bool) -> None:
    chunk, block = 128, 32
    rec = RecordingConnector()
    ex = executor(rec, overlap=overlap, enable_chunked_prefill=True, max_num_tokens=chunk)

    ex.generate([[0] * (chunk * 2)], block)

    sched = rec.scheduler
    assert sched.update_state_after_alloc.call_count == 1
    assert len(sched.update_state_after_alloc.call_args.args[1]) == math.ceil(chunk * 2 / block)
    for i, out in enumerate(rec.scheduler_outputs()):
        if i == 0:
            assert (len(out.new_requests), len(out.cached_requests)) == (1, 0)
            req = out.new_requests[0]
        else:
            assert (len(out.new_requests), len(out.cached_requests)) == (0, 1)
            req = out.cached_requests[0]
        if i == 0:
            # All prompt tokens and all prompt blocks up front, one chunk scheduled.
            assert req.computed_position == 0
            assert len(req.new_tokens) == chunk * 2
            assert len(req.new_block_ids) == math.ceil(chunk * 2 / block)
            assert req.num_scheduled_tokens == chunk
        elif i == 1:
            assert req.computed_position == chunk
            assert len(req.new_tokens) == 0
            assert len(req.new_block_ids) == 0
            assert req.num_scheduled_tokens == chunk
        elif i == 2 and overlap:
            assert len(req.new_tokens) == 0
            assert req.num_scheduled_tokens == 1
        else:
            assert len(req.new_tokens) == 1
            assert req.num_scheduled_tokens == 1
    assert len(sched.request_finished.call_args.args[1]) == math.ceil((chunk * 2 + block) / block)


@pytest.mark.parametrize("save_async", [False, True])
def test_connector_disagg_prefill_context_phase(save_async: bool) -> None:
    # Upstream runs a context-only request on a prefill worker with a cache transceiver.
    # Transceivers are not emulated; the connector-visible part is one context pass of a
    # request that then finishes, which max_new_tokens=1 reproduces on the plain loop.
    rec = RecordingConnector()
    ex = executor(rec, overlap=False)
    rec.scheduler.request_finished.return_value = save_async
    if save_async:
        rec.worker.get_finished.side_effect = echo_finished

    ex.generate([[0] * 48], 1)

    assert rec.scheduler.build_connector_meta.call_count == 1
    (out,) = rec.scheduler_outputs()
    assert (len(out.new_requests), len(out.cached_requests)) == (1, 0)
    req = out.new_requests[0]
    assert (req.computed_position, req.num_scheduled_tokens, len(req.new_tokens)) == (0, 48, 48)
    assert rec.scheduler.request_finished.call_count == 1


def test_connector_multi_request() -> None:
    # KvCacheConfig(max_tokens=120) at 32 tokens per block: a 4-block pool.
    rec = RecordingConnector()
    ex = executor(rec, overlap=False, num_blocks=4)
    rec.scheduler.request_finished.return_value = True
    rec.worker.get_finished.side_effect = echo_finished

    first = [ex.submit([0] * 48, 4), ex.submit([1] * 48, 3)]
    ex.run_until_complete(first)
    # The KV cache of both prior requests is freed, allowing the third request to run.
    (third,) = ex.generate([[2] * 110], 4)
    assert len(third.output_tokens) == 4
    assert ex.kv_cache_manager.get_num_free_blocks() == 4  # beyond upstream


def test_connector_multi_request_waits_for_async_saves() -> None:
    # Beyond upstream: submitted together, the 4-block request is admitted only once both
    # earlier requests' async saves were reported finished (so their blocks were freed).
    rec = RecordingConnector()
    ex = executor(rec, overlap=False, num_blocks=4)
    rec.scheduler.request_finished.return_value = True
    handed_over: list[int] = []
    returned_at: dict[int, int] = {}

    def one_call_late(saving: list[int], loading: list[int]) -> tuple[list[int], list[int]]:
        done = list(handed_over)  # NOTE: each save finishes on the call after its hand-over
        handed_over[:] = saving
        for rid in done:
            returned_at[rid] = len(rec.log) - 1
        return done, loading

    rec.worker.get_finished.side_effect = one_call_late
    ids = [ex.submit([0] * 48, 4), ex.submit([1] * 48, 3), ex.submit([2] * 110, 4)]
    ex.run_until_complete(ids)

    allocs = [i for i, (name, _) in enumerate(rec.log) if name == "update_state_after_alloc"]
    assert len(allocs) == 3
    assert allocs[2] > max(returned_at[ids[0]], returned_at[ids[1]])


@pytest.mark.parametrize("matched_tokens", [0, 32])
def test_connector_num_matched_tokens(matched_tokens: int) -> None:
    rec = RecordingConnector()
    ex = executor(rec, overlap=False)
    rec.scheduler.get_num_new_matched_tokens.return_value = (matched_tokens, False)

    ex.generate([[1] * 64], 8)

    request_after = rec.scheduler.update_state_after_alloc.call_args.args[0]
    assert hasattr(request_after, "num_connector_matched_tokens")
    assert request_after.num_connector_matched_tokens == matched_tokens
    # The request the scheduler was asked about is the C++ view of the same request.
    request_before = rec.scheduler.get_num_new_matched_tokens.call_args.args[0]
    assert request_before.request_id == request_after.request_id
