"""The s3kv connector across the runtime matrix {1.2, main} x {plain, overlap} x {V1, V2}.

Every cell: instance A computes system prompts and saves them, instance B (fresh process
state, a file:// bucket) warms from the bucket and claims. B's tokens must equal a run
without the connector, B must claim the saved prefix, and nothing may stay pending. Chunked
prefill (a 24-token budget with 8-token blocks) makes KVCacheManagerV2 allocate per chunk;
a grow limit makes it honour fewer tokens than offered. Cancellation: requests TensorRT-LLM
frees without ``request_finished`` leave no scheduler state and no pins behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _emulator import prompt, tiny_model

from s3kv.connector.scheduler import SchedulerCore
from s3kv.connector.shared import process_state
from s3kv.connector.trtllm import S3KVConnectorScheduler, S3KVConnectorWorker
from s3kv.testing.emulator.executor import PyExecutorEmulator
from s3kv.testing.emulator.instance import S3KV_CONNECTOR
from s3kv.testing.emulator.kv_cache_manager_v2 import KVCacheManagerV2
from s3kv.testing.emulator.llm_args import KvCacheConfig, TorchLlmArgs

TPB = 8
SYSTEMS = [prompt(6 * TPB, seed=71), prompt(4 * TPB, seed=72)]


def engine(
    *,
    runtime: str,
    overlap: bool,
    v2: bool,
    connector: bool = True,
    chunked: bool = True,
    graphs: bool = False,
    copy: bool = True,
) -> PyExecutorEmulator:
    args = TorchLlmArgs(
        kv_cache_config=KvCacheConfig(
            tokens_per_block=TPB, enable_partial_reuse=False, use_kv_cache_manager_v2=v2
        ),
        kv_connector_config=S3KV_CONNECTOR if connector else None,
        enable_chunked_prefill=chunked,
        max_num_tokens=24 if chunked else 8192,
        disable_overlap_scheduler=not overlap,
        cuda_graph_config=object() if graphs else None,
    )
    return PyExecutorEmulator(
        args, tiny_model(TPB), num_blocks=96, runtime=runtime,  # type: ignore[arg-type]
        stall_timeout_s=10, copy_leader_results=copy,
    )  # fmt: skip


def serve(executor: PyExecutorEmulator, prompts: list[list[int]]) -> tuple[list[Any], list[int]]:
    results = executor.generate(prompts, 4)
    executor.drain()
    return [r.output_tokens for r in results], [r.connector_tokens for r in results]


CELLS = [
    (runtime, overlap, v2)
    for runtime in ("1.2", "main")
    for overlap in (False, True)
    for v2 in (False, True)
    if not (runtime == "1.2" and v2)  # KVCacheManagerV2 exists on main only
]


@pytest.mark.parametrize(
    ("runtime", "overlap", "v2"),
    CELLS,
    ids=[f"{r}-{'overlap' if o else 'plain'}-{'v2' if v else 'v1'}" for r, o, v in CELLS],
)
def test_redeploy_hits_with_identical_tokens(
    file_bucket: Path, runtime: str, overlap: bool, v2: bool
) -> None:
    asks = [SYSTEMS[0] + prompt(5, seed=73), SYSTEMS[1] + prompt(7, seed=74)]
    kw = {"runtime": runtime, "overlap": overlap, "v2": v2}
    expected, _ = serve(engine(connector=False, **kw), asks)
    serve(engine(**kw), [SYSTEMS[0] + prompt(3, seed=75), SYSTEMS[1] + prompt(3, seed=76)])
    process_state().close_all()
    reader = engine(**kw)
    tokens, claimed = serve(reader, asks)
    assert tokens == expected
    assert claimed == [len(SYSTEMS[0]), len(SYSTEMS[1])]
    manager = reader.connector_manager
    assert manager is not None
    assert not manager.has_pending_transfers()
    scheduler = manager.scheduler
    assert isinstance(scheduler, S3KVConnectorScheduler)
    assert scheduler.core is not None
    assert scheduler.core.manager == ("v2" if v2 else "v1")
    assert scheduler.core.tracked_requests == 0


@pytest.mark.parametrize(
    ("runtime", "overlap"), [("1.2", False), ("main", True)], ids=["1.2-plain", "main-overlap"]
)
def test_with_one_rank_the_workers_get_the_schedulers_metadata_itself_and_save_right(
    file_bucket: Path, monkeypatch: pytest.MonkeyPatch, runtime: str, overlap: bool
) -> None:
    # TensorRT-LLM's mpi_broadcast returns the object itself with one rank (_utils.py
    # @ed53795b): the workers hash the key runs the scheduler planned (KeyRun.deferred,
    # still referencing the request's tokens), never a pickled copy of them.
    sent: list[int] = []
    bound: list[int] = []
    build = S3KVConnectorScheduler.build_connector_meta
    bind = S3KVConnectorWorker.bind_connector_meta
    monkeypatch.setattr(
        S3KVConnectorScheduler, "build_connector_meta",
        lambda self, out: sent.append(id(meta := build(self, out))) or meta,
    )  # fmt: skip
    monkeypatch.setattr(
        S3KVConnectorWorker, "bind_connector_meta",
        lambda self, meta: bound.append(id(meta)) or bind(self, meta),
    )  # fmt: skip
    asks = [SYSTEMS[0] + prompt(5, seed=73), SYSTEMS[1] + prompt(7, seed=74)]
    kw = {"runtime": runtime, "overlap": overlap, "v2": False, "copy": False}
    expected, _ = serve(engine(connector=False, **kw), asks)
    serve(engine(**kw), [SYSTEMS[0] + prompt(3, seed=75), SYSTEMS[1] + prompt(3, seed=76)])
    assert sent
    assert set(bound) <= set(sent), "the worker was bound the very objects"
    process_state().close_all()
    tokens, claimed = serve(engine(**kw), asks)
    assert tokens == expected
    assert claimed == [len(SYSTEMS[0]), len(SYSTEMS[1])]


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_cuda_graph_decode_keeps_hits_identical_and_loads_awaited_per_layer(
    file_bucket: Path, overlap: bool, v2: bool
) -> None:
    # Main, CUDA graphs on (TensorRT-LLM's default): decode-only batches replay a graph and
    # run no layer hook. A hit after such steps must still load right, and its load must
    # still be awaited layer group by layer group (a replayed step proves nothing about the
    # hooks: before, it turned the per-layer waits off).
    asks = [SYSTEMS[0] + prompt(5, seed=73), SYSTEMS[1] + prompt(7, seed=74)]
    kw = {"runtime": "main", "overlap": overlap, "v2": v2, "graphs": True}
    plain = engine(connector=False, **kw)
    expected = [serve(plain, [ask])[0][0] for ask in asks]
    serve(engine(**kw), [SYSTEMS[0] + prompt(3, seed=75), SYSTEMS[1] + prompt(3, seed=76)])
    process_state().close_all()
    reader = engine(**kw)
    served = [serve(reader, [ask]) for ask in asks]
    assert [tokens[0] for tokens, _ in served] == expected
    assert [claimed[0] for _, claimed in served] == [len(SYSTEMS[0]), len(SYSTEMS[1])]
    manager = reader.connector_manager
    assert manager is not None
    assert not manager.has_pending_transfers()
    worker = manager.worker
    assert isinstance(worker, S3KVConnectorWorker)
    assert worker.core is not None
    assert worker.core.layer_waits, "the decode replays left the per-layer waits on"


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_hit_left_one_token_under_cuda_graphs_is_loaded_before_the_replayed_pass(
    file_bucket: Path, caplog: pytest.LogCaptureFixture, overlap: bool
) -> None:
    # A prompt of k blocks + 1 token, all k claimed: its one-token context runs in a decode
    # graph (no layer hook), so its loads must be awaited before the forward pass. Before,
    # after an eager pass they were left to hooks that never ran (awaited only at the end).
    system = SYSTEMS[0]
    ask = [system + prompt(1, seed=81)]
    kw = {"runtime": "main", "overlap": overlap, "v2": False, "graphs": True}
    expected, _ = serve(engine(connector=False, **kw), ask)
    serve(engine(**kw), [system + prompt(3, seed=82)])
    process_state().close_all()
    reader = engine(**kw)
    serve(reader, [prompt(20, seed=83)])  # an eager prefill first: per-layer waits on
    caplog.clear()
    tokens, claimed = serve(reader, ask)
    assert tokens == expected
    assert claimed == [len(system)]
    assert "did not run for every layer" not in caplog.text


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_hit_batched_with_decode_steps_under_cuda_graphs_runs_eagerly_with_per_layer_waits(
    file_bucket: Path, caplog: pytest.LogCaptureFixture, overlap: bool
) -> None:
    # A hit arriving while another request decodes: its context and the decode step share a
    # batch, which TensorRT-LLM runs eagerly (only decode-only batches, or final one-token
    # contexts, replay a graph). The hooks run, so the hit's loads are awaited layer group
    # by layer group, its tokens are those of a run without the connector, and the decode
    # replays before and after leave the per-layer waits on.
    ask = SYSTEMS[0] + prompt(5, seed=84)
    busy = prompt(20, seed=85)
    kw = {"runtime": "main", "overlap": overlap, "v2": False, "graphs": True, "chunked": False}
    expected, _ = serve(engine(connector=False, **kw), [ask])
    serve(engine(**kw), [SYSTEMS[0] + prompt(3, seed=86)])
    process_state().close_all()
    reader = engine(**kw)
    shapes: list[tuple[int, int]] = []
    forward = reader._loop._forward

    def recorded(batch: Any) -> Any:
        shapes.append((len(batch.context_requests), len(batch.generation_requests)))
        return forward(batch)

    reader._loop._forward = recorded  # type: ignore[method-assign]
    decoding = reader.submit(busy, 12)
    for _ in range(4):
        reader.step()
    caplog.clear()
    hit = reader.submit(ask, 4)
    reader.run_until_complete([decoding, hit])
    reader.drain()
    assert (1, 1) in shapes, shapes  # NOTE: the hit's context beside a decode step
    assert list(reader.result(hit).output_tokens) == list(expected[0])
    assert reader.result(hit).connector_tokens == len(SYSTEMS[0])
    assert "did not run for every layer" not in caplog.text
    manager = reader.connector_manager
    assert manager is not None
    worker = manager.worker
    assert isinstance(worker, S3KVConnectorWorker)
    assert worker.core is not None
    assert worker.core.layer_waits


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_v2_honouring_less_than_offered_loads_exactly_the_honoured_blocks(
    file_bucket: Path, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    ask = [SYSTEMS[0] + prompt(5, seed=77)]
    kw = {"runtime": "main", "overlap": overlap, "v2": True}
    expected, _ = serve(engine(connector=False, **kw), ask)
    serve(engine(**kw), [SYSTEMS[0] + prompt(3, seed=78)])
    process_state().close_all()
    # The chunk's pages cannot grow: V2 honours only what fits in the pages it has.
    real_init = KVCacheManagerV2.__init__

    def limited(self: KVCacheManagerV2, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **{**kwargs, "grow_limit_blocks": 0})

    monkeypatch.setattr(KVCacheManagerV2, "__init__", limited)
    reader = engine(**kw)
    tokens, claimed = serve(reader, ask)
    assert tokens == expected
    assert 0 < claimed[0] < len(SYSTEMS[0]), "honoured fewer tokens than offered"
    store = next(iter(process_state().stores.values()))
    assert store.metrics.value("connector_unhonoured_blocks") > 0
    assert store.metrics.value("connector_loaded_blocks") == claimed[0] // TPB


@pytest.mark.parametrize("runtime", ["1.2", "main"])
def test_cancelled_requests_leave_no_state_or_pins(
    file_bucket: Path, monkeypatch: pytest.MonkeyPatch, runtime: str
) -> None:
    kw = {"runtime": runtime, "overlap": True, "v2": False, "chunked": False}
    serve(engine(**kw), [SYSTEMS[0] + prompt(3, seed=79)])
    process_state().close_all()
    monkeypatch.setattr(SchedulerCore, "STALE_STEPS", 8)
    reader = engine(**kw)
    manager = reader.connector_manager
    assert manager is not None
    scheduler = manager.scheduler
    assert isinstance(scheduler, S3KVConnectorScheduler)
    assert scheduler.core is not None
    cancelled = reader.submit(SYSTEMS[0] + prompt(5, seed=80), 30)
    reader.step()  # claimed, allocated, loading
    reader.cancel(cancelled)  # freed by the executor without request_finished
    long = reader.submit(prompt(9, seed=81), 20)
    reader.run_until_complete([long])
    reader.drain()
    assert scheduler.core.tracked_requests == 0, "the cancelled request's state is gone"
    assert scheduler.core.held_load_batches == 0
    store = next(iter(process_state().stores.values()))
    assert store.metrics.value("connector_forgotten_requests") == 1
    key = scheduler.core.shards.stores[0].staging  # type: ignore[union-attr]
    assert all(entry.pins == 0 for entry in key._entries.values()), "no pin leaked"
