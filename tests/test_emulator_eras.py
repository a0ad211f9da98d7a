"""The runtime matrix {1.2, main} x {plain, overlap} x {V1, V2}, cancellation and errors.

Era differences (trtllm-notes.md sections 1, 3, 8): the 1.2-era executor never calls
``wait_for_initialization`` and calls ``handle_metadata`` only inside
``_kv_connector_start_batch``; main calls it every iteration as well; ``KVCacheManagerV2``
exists only on main. Cancellation and ``_handle_errors`` follow section 2 (py_executor.py @
``00043967``): no connector call for a cancelled or failed request.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _emulator import llm_args, one_torch_thread, prompt, tiny_model
from _memconnector import MemScheduler, MemWorker, fresh_store

from s3kv.testing.emulator.executor import PyExecutorEmulator, UnsupportedConfiguration
from s3kv.testing.emulator.recording import RecordingConnector
from s3kv.testing.emulator.request import FinishReason

RUNTIMES = pytest.mark.parametrize("runtime", ["1.2", "main"])
OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
MANAGER = pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def make(
    classes: tuple[Any, Any] | None = None,
    *,
    runtime: str = "main",
    overlap: bool = False,
    v2: bool = False,
    num_blocks: int = 64,
    **overrides: Any,
) -> PyExecutorEmulator:
    """An executor on the tiny model (``classes``: ``(scheduler_cls, worker_cls)``)."""
    args = llm_args(kvcache_use_kv_cache_manager_v2=v2, **overrides)
    kw: dict[str, Any] = {}
    if classes is not None:
        kw = {"connector_scheduler_cls": classes[0], "connector_worker_cls": classes[1]}
    return PyExecutorEmulator(
        args,
        tiny_model(args.kv_cache_config.tokens_per_block),
        num_blocks=num_blocks,
        overlap=overlap,
        runtime=runtime,  # type: ignore[arg-type]
        stall_timeout_s=10.0,
        **kw,
    )


def prompts() -> list[list[int]]:
    shared = prompt(200, seed=1)
    return [shared, prompt(100, seed=2), shared[:150] + prompt(20, seed=3)]


CHUNKED = {"enable_chunked_prefill": True, "max_num_tokens": 64}


# --- the matrix ---


@RUNTIMES
@OVERLAP
@MANAGER
def test_matrix_tokens_equal_a_run_without_connector(runtime: str, overlap: bool, v2: bool) -> None:
    if runtime == "1.2" and v2:
        with pytest.raises(UnsupportedConfiguration, match="use_kv_cache_manager_v2"):
            make((MemScheduler, MemWorker), runtime=runtime, v2=True)
        return
    ps = prompts()
    baseline = [r.output_tokens for r in make(overlap=overlap, **CHUNKED).generate(ps, 6)]
    fresh_store()
    writer = make((MemScheduler, MemWorker), runtime=runtime, overlap=overlap, v2=v2, **CHUNKED)
    assert [r.output_tokens for r in writer.generate(ps, 6)] == baseline
    writer.drain()
    reader = make((MemScheduler, MemWorker), runtime=runtime, overlap=overlap, v2=v2, **CHUNKED)
    results = reader.generate(ps, 6)
    assert [r.output_tokens for r in results] == baseline
    assert results[0].connector_tokens == 192  # 6 stored blocks of the 199 usable tokens
    assert results[1].connector_tokens == 96
    assert results[2].connector_tokens + results[2].reused_tokens >= 128  # the shared prefix


@MANAGER
@OVERLAP
def test_matrix_recording_connector_offering_nothing(overlap: bool, v2: bool) -> None:
    ps = prompts()
    baseline = [r.output_tokens for r in make(overlap=overlap, **CHUNKED).generate(ps, 5)]
    rec = RecordingConnector()
    ex = make(rec.classes(), overlap=overlap, v2=v2, **CHUNKED)
    assert [r.output_tokens for r in ex.generate(ps, 5)] == baseline
    assert rec.scheduler.get_num_new_matched_tokens.call_count == 3  # once per allocation
    assert rec.scheduler.update_state_after_alloc.call_count == 3
    assert rec.scheduler.request_finished.call_count == 3


# --- era differences ---


@RUNTIMES
def test_wait_for_initialization_only_on_main(runtime: str) -> None:
    rec = RecordingConnector()
    make(rec.classes(), runtime=runtime)
    assert rec.scheduler.wait_for_initialization.call_count == (runtime == "main")
    assert rec.worker.register_kv_caches.call_count == 1


@RUNTIMES
@OVERLAP
def test_handle_metadata_on_empty_iterations_only_on_main(runtime: str, overlap: bool) -> None:
    rec = RecordingConnector()
    rec.scheduler.get_num_new_matched_tokens.return_value = (32, True)
    held: list[int] = []
    polls = [0]

    def late(saving: list[int], loading: list[int]) -> tuple[list[int], list[int]]:
        held.extend(loading)  # NOTE: each id is passed once; return it on the 4th poll
        polls[0] += 1
        if polls[0] < 4:
            return [], []
        done = list(held)
        held.clear()
        return [], done

    rec.worker.get_finished.side_effect = late
    ex = make(rec.classes(), runtime=runtime, overlap=overlap)
    (result,) = ex.generate([prompt(40)], 4)
    assert result.loaded_async
    manager = ex.connector_manager
    assert manager is not None
    starts = rec.worker.start_load_kv.call_count
    assert ex.iterations > starts  # the parked iterations ran no batch
    # Bound metadata once per non-empty batch in both eras.
    assert (
        rec.worker.bind_connector_meta.call_count == rec.scheduler.build_connector_meta.call_count
    )
    if runtime == "main":
        assert manager.handle_metadata_calls == ex.iterations + starts
    else:
        assert manager.handle_metadata_calls == starts


def test_v2_on_the_12_runtime_is_rejected() -> None:
    with pytest.raises(UnsupportedConfiguration):
        make(RecordingConnector().classes(), runtime="1.2", v2=True)
    with pytest.raises(ValueError, match="runtime"):
        make(runtime="1.3")


# --- cancellation ---


def _free_everything(ex: PyExecutorEmulator, num_blocks: int) -> None:
    assert ex.kv_cache_manager.sequences() == {}
    assert ex.kv_cache_manager.get_num_free_blocks() == num_blocks


@OVERLAP
@MANAGER
def test_cancel_frees_without_request_finished(overlap: bool, v2: bool) -> None:
    rec = RecordingConnector()
    ex = make(rec.classes(), overlap=overlap, v2=v2)
    rid = ex.submit(prompt(40), 20)
    while len(ex._loop.tracked[rid].request.get_tokens(0)) < 43:
        ex.step()
    ex.cancel(rid)
    ex.run_until_complete([rid])
    result = ex.result(rid)
    assert result.finish_reason is FinishReason.CANCELLED
    assert 3 <= len(result.output_tokens) < 20
    assert rec.scheduler.request_finished.call_count == 0
    _free_everything(ex, 64)
    ex.drain()
    # The executor keeps serving: a later request is unaffected.
    (again,) = ex.generate([prompt(40)], 5)
    (ref,) = make(overlap=overlap).generate([prompt(40)], 5)
    assert again.output_tokens == ref.output_tokens
    assert again.finish_reason is FinishReason.LENGTH


@OVERLAP
@MANAGER
def test_cancel_a_request_parked_in_an_async_load(overlap: bool, v2: bool) -> None:
    rec = RecordingConnector()
    rec.scheduler.get_num_new_matched_tokens.side_effect = lambda req, n: (
        (32, True) if req.prompt_len == 70 else (0, False)
    )
    held: list[int] = []
    release = [False]

    def get_finished(saving: list[int], loading: list[int]) -> tuple[list[int], list[int]]:
        held.extend(loading)
        if release[0]:
            done = list(held)
            held.clear()
            return [], done
        return [], []

    rec.worker.get_finished.side_effect = get_finished
    ex = make(rec.classes(), overlap=overlap, v2=v2)
    parked = ex.submit(prompt(70, seed=4), 5)
    other = ex.submit(prompt(30, seed=5), 12)
    ex.step()
    assert held == [parked]
    ex.cancel(parked)
    while not ex.is_finished(parked):
        ex.step()
    assert ex.result(parked).finish_reason is FinishReason.CANCELLED
    assert not ex.kv_cache_manager.has_sequence(ex._loop.tracked[parked].request)
    release[0] = True
    ex.run_until_complete([other])
    ex.drain()
    finished = [c.args[0].request_id for c in rec.scheduler.request_finished.call_args_list]
    assert finished == [other]
    _free_everything(ex, 64)


@OVERLAP
def test_cancel_after_an_async_save_keeps_blocks_until_get_finished(overlap: bool) -> None:
    rec = RecordingConnector()
    rec.scheduler.request_finished.return_value = True
    release = [False]
    held: list[int] = []

    def get_finished(saving: list[int], loading: list[int]) -> tuple[list[int], list[int]]:
        held.extend(saving)
        if release[0]:
            done = list(held)
            held.clear()
            return done, []
        return [], []

    rec.worker.get_finished.side_effect = get_finished
    ex = make(rec.classes(), overlap=overlap)
    (result,) = ex.generate([prompt(40)], 4)
    ex.cancel(result.request_id)
    ex.step()
    ex.step()
    assert ex.kv_cache_manager.sequences()  # still saving
    release[0] = True
    ex.drain()
    assert ex.result(result.request_id).finish_reason is FinishReason.LENGTH
    _free_everything(ex, 64)


# --- errors ---


@OVERLAP
@MANAGER
def test_fail_all_terminates_without_connector_calls(overlap: bool, v2: bool) -> None:
    rec = RecordingConnector()
    rec.scheduler.get_num_new_matched_tokens.side_effect = lambda req, n: (
        (32, True) if req.prompt_len == 70 else (0, False)
    )
    held: list[int] = []
    release = [False]

    def get_finished(saving: list[int], loading: list[int]) -> tuple[list[int], list[int]]:
        held.extend(loading)
        if not release[0]:
            return [], []
        done = list(held)
        held.clear()
        return [], done

    rec.worker.get_finished.side_effect = get_finished
    ex = make(rec.classes(), overlap=overlap, v2=v2)
    ids = [ex.submit(prompt(70, seed=4), 5), ex.submit(prompt(30, seed=5), 12)]
    ex.step()
    ex.step()
    names_before = len(rec.log)
    assert sorted(ex.fail_all("boom")) == sorted(ids)
    assert len(rec.log) == names_before  # no connector call at all
    for rid in ids:
        result = ex.result(rid)
        assert result.finish_reason is FinishReason.ERROR
        assert result.error == "boom"
    _free_everything(ex, 64)
    # The async load is still pending in the connector manager until the worker returns it.
    assert ex.connector_manager is not None
    assert ex.connector_manager.has_pending_transfers()
    release[0] = True
    ex.drain()
    assert rec.scheduler.request_finished.call_count == 0
    (again,) = ex.generate([prompt(30, seed=5)], 4)
    (ref,) = make(overlap=overlap).generate([prompt(30, seed=5)], 4)
    assert again.output_tokens == ref.output_tokens


# --- fault injection: get_finished bookkeeping ---


@OVERLAP
def test_get_finished_returning_an_id_twice_raises_key_error(overlap: bool) -> None:
    rec = RecordingConnector()
    rec.scheduler.request_finished.return_value = True
    seen: list[int] = []

    def twice(saving: list[int], loading: list[int]) -> tuple[list[int], list[int]]:
        seen.extend(saving)
        return list(seen), []  # NOTE: returns every id again on every call

    rec.worker.get_finished.side_effect = twice
    ex = make(rec.classes(), overlap=overlap)
    manager = ex.connector_manager
    assert manager is not None
    ex.submit(prompt(40), 3)

    def run() -> None:
        for _ in range(20):
            ex.step()
            manager.check_bookkeeping()

    with pytest.raises(KeyError):
        run()
    assert len(seen) == 1


def test_get_finished_returning_an_unknown_id_raises_key_error() -> None:
    rec = RecordingConnector()
    rec.worker.get_finished.return_value = ([12345], [])
    ex = make(rec.classes())
    ex.submit(prompt(40), 3)
    with pytest.raises(KeyError):
        ex.step()


def test_check_bookkeeping_flags_an_id_held_twice() -> None:
    rec = RecordingConnector()
    ex = make(rec.classes())
    manager = ex.connector_manager
    assert manager is not None
    manager.check_bookkeeping()
    manager.new_async_requests.saving[7] = object()
    manager.pending_async_requests.saving[7] = object()
    with pytest.raises(AssertionError, match="held twice"):
        manager.check_bookkeeping()
