"""The runtime contract a connector relies on, beyond TensorRT-LLM's integration tests.

Call order inside an iteration, the forward-pass callable, the errors TensorRT-LLM raises on
bad answers (``(0, True)``, over-claiming), the silent "block reuse off" case, what the
device match passed to ``get_num_new_matched_tokens`` is, configuration rejections, metadata
pickling, and blocks held by async saves until ``get_finished`` returns them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _emulator import executor, llm_args, one_torch_thread, prompt, tiny_model

from s3kv.testing.emulator import recording
from s3kv.testing.emulator.executor import (
    EmulatorStall,
    PyExecutorEmulator,
    UnsupportedConfiguration,
)
from s3kv.testing.emulator.llm_args import CapacitySchedulerPolicy, KvCacheConnectorConfig
from s3kv.testing.emulator.recording import RecordingConnector


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def test_call_order_of_one_iteration() -> None:
    # _prepare_and_schedule -> prepare_resources (alloc, update_state_after_alloc, output)
    # -> _kv_connector_start_batch -> forward with hooks -> callable -> wait_for_save
    # -> request_finished -> get_finished (plain loop, one-token request: one iteration).
    rec = RecordingConnector()
    ex = executor(rec, overlap=False)
    rec.log.clear()  # construction: register_kv_caches, wait_for_initialization
    ex.generate([prompt(40)], 1)
    assert rec.names() == [
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "bind_connector_meta",
        "start_load_kv",
        "wait_for_layer_load",
        "save_kv_layer",
        "wait_for_layer_load",
        "save_kv_layer",
        "forward_pass",
        "wait_for_save",
        "request_finished",
        "get_finished",
    ]


def test_construction_calls() -> None:
    rec = RecordingConnector()
    ex = executor(rec, overlap=False, num_blocks=16)
    assert sorted(role for role, _ in rec.constructed) == ["scheduler", "worker"]
    assert all(args is ex.llm_args for _, args in rec.constructed)
    assert rec.names() == ["register_kv_caches", "wait_for_initialization"]
    (pool,) = rec.worker.register_kv_caches.call_args.args
    assert tuple(pool.shape) == ex.model.geometry.pool_shape(16)  # [blocks, layers, 2, elems]


@pytest.mark.parametrize("overlap", [True, False])
def test_forward_pass_callable_once_per_forward(overlap: bool) -> None:
    # test_pytorch_model_engine.py::test_forward_pass_callable_on_cuda_graph_off
    rec = RecordingConnector()
    ex = executor(rec, overlap=overlap)
    ex.generate([prompt(10), prompt(50, seed=2)], 5)
    assert rec.worker.forward_pass.call_count == ex.forward_passes == 5


@pytest.mark.parametrize("overlap", [True, False])
def test_cuda_graphs_replay_decode_only_batches_without_layer_hooks(overlap: bool) -> None:
    # Main accepts CUDA graphs with a connector (py_executor_creator.py @ 000429d5 has no
    # refusal; cuda_graph_config is on by default): a decode-only batch replays a graph,
    # which runs no Python layer hook; a batch with a context request runs eagerly.
    rec = RecordingConnector()
    ex = executor(rec, overlap=overlap, cuda_graph_config=object())
    ex.generate([prompt(10)], 5)
    layers = ex.model.geometry.num_layers
    hooks = [name for name, _ in rec.log if name in ("wait_for_layer_load", "wait_for_save")]
    passes: list[int] = []  # layer hooks before each pass's wait_for_save
    count = 0
    for name in hooks:
        if name == "wait_for_layer_load":
            count += 1
        else:
            passes.append(count)
            count = 0
    assert passes == [layers] + [0] * (ex.forward_passes - 1), "the prefill alone is eager"
    assert rec.worker.forward_pass.call_count == ex.forward_passes == 5
    assert [name for name, _ in rec.log].count("save_kv_layer") == layers


def test_cuda_graphs_with_a_connector_are_refused_on_the_1_2_runtime_only() -> None:
    with pytest.raises(UnsupportedConfiguration, match="CUDA graphs"):
        executor(RecordingConnector(), runtime="1.2", cuda_graph_config=object())
    executor(RecordingConnector(), cuda_graph_config=object())


def test_no_forward_pass_callable_is_fine() -> None:
    rec = RecordingConnector(provide_forward_pass_callable=False)
    executor(rec).generate([prompt(10)], 3)
    assert rec.worker.forward_pass.call_count == 0


def test_zero_tokens_async_raises() -> None:
    rec = RecordingConnector()
    rec.scheduler.get_num_new_matched_tokens.return_value = (0, True)
    with pytest.raises(RuntimeError, match="load_kv_async must be False when num_tokens is 0!"):
        executor(rec).generate([prompt(40)], 2)


def test_over_claim_raises_like_cpp() -> None:
    # setPrepopulatedPromptLen: TLLM_CHECK(prepopulatedPromptLen < promptLen).
    rec = RecordingConnector()
    rec.scheduler.get_num_new_matched_tokens.return_value = (40, False)
    with pytest.raises(RuntimeError, match=r"prepopulatedPromptLen \(40\) >= promptLen \(40\)"):
        executor(rec).generate([prompt(40)], 2)
    # prompt_len - 1 is the most a connector may claim: the last token is always computed.
    rec = RecordingConnector()
    rec.scheduler.get_num_new_matched_tokens.return_value = (39, False)
    (result,) = executor(rec).generate([prompt(40)], 2)
    assert (result.connector_tokens, result.computed_tokens) == (39, 1)


def test_block_reuse_disabled_never_consults_connector() -> None:
    rec = RecordingConnector()
    rec.scheduler.get_num_new_matched_tokens.return_value = (32, False)
    ex = executor(rec, kvcache_enable_block_reuse=False)
    first, second = ex.generate([prompt(70)], 3), ex.generate([prompt(70)], 3)
    assert rec.scheduler.get_num_new_matched_tokens.call_count == 0
    assert rec.scheduler.update_state_after_alloc.call_count == 2  # still told the blocks
    assert second[0].reused_tokens == second[0].connector_tokens == 0
    assert first[0].output_tokens == second[0].output_tokens


@pytest.mark.parametrize(("partial", "expected"), [(True, 69), (False, 64)])
def test_device_match_is_passed_to_the_connector(partial: bool, expected: int) -> None:
    # The second, identical prompt matches locally over prompt_len - 1 tokens: two full
    # blocks, plus the partial third block's 5 tokens only with partial reuse.
    rec = RecordingConnector()
    ex = executor(rec, kvcache_enable_partial_reuse=partial)
    ex.generate([prompt(70)], 3)
    (second,) = ex.generate([prompt(70)], 3)
    assert rec.scheduler.get_num_new_matched_tokens.call_args.args[1] == expected
    assert second.reused_tokens == expected


def test_first_report_counts_device_match_only() -> None:
    # Local reuse of 64 tokens, then the connector claims 32 more: the first report's
    # computed_position is 64 and the request computes the rest.
    rec = RecordingConnector()
    ex = executor(rec, kvcache_enable_partial_reuse=False)
    shared = prompt(64)
    ex.generate([[*shared, *prompt(10, seed=3)]], 2)
    rec.scheduler.get_num_new_matched_tokens.return_value = (32, False)
    rec.scheduler.build_connector_meta.reset_mock()
    (result,) = ex.generate([[*shared, *prompt(40, seed=4)]], 2)
    report = rec.scheduler_outputs()[0].new_requests[0]
    assert (report.computed_position, report.num_scheduled_tokens) == (64, 104 - 96)
    assert len(report.new_block_ids) == 4
    assert len(report.new_tokens) == 104
    assert (result.reused_tokens, result.connector_tokens, result.computed_tokens) == (64, 32, 8)


def test_request_view_hides_python_only_attributes() -> None:
    seen: dict[str, object] = {}

    def probe(request: object, num_computed: int) -> tuple[int, bool]:
        for name in ("py_request_id", "cache_salt"):
            with pytest.raises(AttributeError):
                getattr(request, name)
        seen["salt"] = request.cache_salt_id  # type: ignore[attr-defined]
        seen["tokens"] = request.get_tokens(0)  # type: ignore[attr-defined]
        return 0, False

    rec = RecordingConnector()
    rec.scheduler.get_num_new_matched_tokens.side_effect = probe
    executor(rec).generate([prompt(12)], 1, cache_salt="tenant-a")
    assert isinstance(seen["salt"], int)
    assert seen["tokens"] == prompt(12)


def test_cache_salt_isolates_local_reuse() -> None:
    ex = executor(None)
    ex.generate([prompt(70)], 2, cache_salt="a")
    (other,) = ex.generate([prompt(70)], 2, cache_salt="b")
    (same,) = ex.generate([prompt(70)], 2, cache_salt="a")
    assert other.reused_tokens == 0
    assert same.reused_tokens == 69


def test_metadata_is_pickled_on_the_way_to_the_worker() -> None:
    rec = RecordingConnector()
    meta = {"loads": [(1, 2)]}
    rec.scheduler.build_connector_meta.return_value = meta
    executor(rec).generate([prompt(8)], 1)
    bound = rec.worker.bind_connector_meta.call_args.args[0]
    assert bound == meta
    assert bound is not meta
    rec = RecordingConnector()
    rec.scheduler.build_connector_meta.return_value = lambda: None  # not picklable
    with pytest.raises((AttributeError, TypeError, ValueError)):
        executor(rec).generate([prompt(8)], 1)


def test_async_save_holds_blocks_until_get_finished() -> None:
    rec = RecordingConnector()
    rec.scheduler.request_finished.return_value = True
    handed_over: list[int] = []

    def still_saving(saving: list[int], loading: list[int]) -> tuple[list[int], list[int]]:
        handed_over.extend(saving)
        return [], loading

    rec.worker.get_finished.side_effect = still_saving
    ex = executor(rec, num_blocks=8, stall_timeout_s=0.2)
    (result,) = ex.generate([prompt(70)], 2)  # finished generating; its 3 blocks stay held
    assert ex.kv_cache_manager.get_num_free_blocks() == 5
    assert handed_over == [result.request_id]
    with pytest.raises(EmulatorStall, match="get_finished never returned them"):
        ex.drain()  # the save never finishes: the emulator says so instead of hanging

    def finish_now(saving: list[int], loading: list[int]) -> tuple[list[int], list[int]]:
        done = handed_over + saving
        handed_over.clear()
        return done, loading

    rec.worker.get_finished.side_effect = finish_now
    ex.drain()
    assert ex.kv_cache_manager.get_num_free_blocks() == 8
    assert rec.worker.get_finished.call_args.args == ([], [])  # each id handed over once


@pytest.mark.parametrize(
    "overrides",
    [
        {"pipeline_parallel_size": 2},
        {"context_parallel_size": 2},
        {"max_beam_width": 2},
        {"enable_attention_dp": True},
        {"kvcache_host_cache_size": 1 << 30},
        {"cuda_graph_config": object(), "runtime": "1.2"},
    ],
    ids=["pp", "cp", "beam", "adp", "host-cache", "cuda-graphs-1.2"],
)
def test_envelope_rejections(overrides: dict[str, Any]) -> None:
    with pytest.raises(UnsupportedConfiguration) as info:
        executor(RecordingConnector(), **overrides)
    assert isinstance(info.value, NotImplementedError)
    assert isinstance(info.value, ValueError)


def test_capacity_policy_must_be_guaranteed_no_evict() -> None:
    args = llm_args()
    args.scheduler_config.capacity_scheduler_policy = CapacitySchedulerPolicy.MAX_UTILIZATION
    scheduler_cls, worker_cls = RecordingConnector().classes()
    with pytest.raises(UnsupportedConfiguration, match="guaranteed no evict"):
        PyExecutorEmulator(
            args,
            tiny_model(),
            num_blocks=8,
            connector_scheduler_cls=scheduler_cls,
            connector_worker_cls=worker_cls,
        )


def test_connector_classes_imported_from_llm_args(monkeypatch: pytest.MonkeyPatch) -> None:
    # py_executor_creator: importlib.import_module(connector_module) + getattr(class names).
    rec = RecordingConnector()
    monkeypatch.setattr(recording, "DEFAULT", rec)
    args = llm_args(
        kv_connector_config=KvCacheConnectorConfig(
            "s3kv.testing.emulator.recording", "RecordingScheduler", "RecordingWorker"
        )
    )
    ex = PyExecutorEmulator(args, tiny_model(), num_blocks=8, overlap=False)
    ex.generate([prompt(8)], 2)
    assert rec.worker.register_kv_caches.call_count == 1
    assert rec.scheduler.build_connector_meta.call_count == 2
