"""The TensorRT-LLM adapter classes, driven by hand in one process (moto as the bucket).

The emulated runtime (tests/test_connector_e2e.py) drives them the way PyExecutor does; here
each contract is pinned on its own: registration checks, never raising, a save-then-load
round trip through a fresh instance, warm start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import unique_bucket

from s3kv.connector.api import RequestData, SchedulerOutput
from s3kv.connector.metadata import ConnectorMetadata
from s3kv.connector.shared import process_state
from s3kv.connector.trtllm import S3KVConnectorScheduler, S3KVConnectorWorker

TPB = 4
LAYERS = 2
ELEMS = 2 * TPB * 8  # 2 kv heads x 4 tokens x head_dim 8


def llm_args(**kv_overrides: Any) -> SimpleNamespace:
    kv = {"tokens_per_block": TPB, "enable_block_reuse": True, "enable_partial_reuse": False,
          "host_cache_size": 0, "dtype": "auto"}  # fmt: skip
    kv.update(kv_overrides)
    return SimpleNamespace(
        model="test/tiny", revision=None, dtype="bfloat16", tensor_parallel_size=1,
        pipeline_parallel_size=1, context_parallel_size=1, max_beam_width=1,
        enable_attention_dp=False, kv_cache_config=SimpleNamespace(**kv),
        scheduler_config=SimpleNamespace(capacity_scheduler_policy="GUARANTEED_NO_EVICT"),
    )  # fmt: skip


@dataclass
class Request:
    request_id: int
    tokens: list[int]
    cache_salt_id: int | None = None
    lora_task_id: int | None = None
    multimodal_hashes: Any = field(default=None)

    @property
    def prompt_len(self) -> int:
        return len(self.tokens)

    def get_tokens(self, beam: int) -> list[int]:
        return list(self.tokens)


@pytest.fixture
def bucket_env(moto_server: str, aws_env: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    from s3kv.config import S3KVConfig
    from s3kv.storage import ensure_bucket, make_client

    bucket = unique_bucket()
    env = {
        "TLLM_S3KV_BUCKET": bucket, "TLLM_S3KV_ENDPOINT_URL": moto_server,
        "TLLM_S3KV_REGION": "us-east-1", "TLLM_S3KV_MODEL_REVISION": "test-rev",
        "TLLM_S3KV_MANIFEST_FLUSH_INTERVAL": "0.05", "TLLM_S3KV_STAGING_BYTES": "64MiB",
        "TLLM_S3KV_WARM_START_TIMEOUT": "20",
    }  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ensure_bucket(make_client(S3KVConfig.load()), bucket)
    yield bucket
    process_state().close_all()


def pool(blocks: int = 8, fill: float | None = None) -> torch.Tensor:
    if fill is None:
        return torch.zeros(blocks, LAYERS, 2, ELEMS, dtype=torch.bfloat16)
    return torch.full((blocks, LAYERS, 2, ELEMS), fill, dtype=torch.bfloat16)


def instance(
    kv: torch.Tensor, **kv_overrides: Any
) -> tuple[S3KVConnectorScheduler, S3KVConnectorWorker]:
    args = llm_args(**kv_overrides)
    scheduler = S3KVConnectorScheduler(args)
    worker = S3KVConnectorWorker(args)
    worker.register_kv_caches(kv)
    scheduler.wait_for_initialization()
    return scheduler, worker


def step(scheduler: S3KVConnectorScheduler, worker: S3KVConnectorWorker,
         output: SchedulerOutput) -> ConnectorMetadata:  # fmt: skip
    meta = scheduler.build_connector_meta(output)
    worker.bind_connector_meta(meta)
    worker.start_load_kv(None)
    worker.wait_for_save(None)
    return meta


PROMPT = list(range(1, 18))  # 17 tokens: 4 full blocks


def warm_instance_loads_the_prompt(kv_a: torch.Tensor) -> torch.Tensor:
    """A new instance with an empty pool: warm start stages PROMPT's 4 blocks, which the
    instance that wrote ``kv_a`` saved from its blocks [3, 1, 4, 5]; it claims 16 tokens and
    loads them into blocks [0, 2, 4, 6], leaving the tail block alone. Returns its pool."""
    kv_b = pool()
    scheduler_b, worker_b = instance(kv_b)
    assert scheduler_b.warm is not None
    assert scheduler_b.warm.staged == 4
    request_b = Request(7, PROMPT)
    assert scheduler_b.get_num_new_matched_tokens(request_b, 0) == (16, False)
    scheduler_b.update_state_after_alloc(request_b, [0, 2, 4, 6, 7])
    meta_b = step(scheduler_b, worker_b, SchedulerOutput(
        new_requests=[RequestData(7, PROMPT, [0, 2, 4, 6, 7], 0, 1)]))  # fmt: skip
    assert [op.block_id for op in meta_b.loads] == [0, 2, 4, 6]
    for src, dst in zip([3, 1, 4, 5], [0, 2, 4, 6], strict=True):
        assert torch.equal(kv_b[dst], kv_a[src])
    return kv_b


def test_save_then_a_fresh_instance_warms_claims_and_loads(bucket_env: str) -> None:
    # Instance A computes the prompt (its pool holds distinct values per block) and saves.
    kv_a = pool()
    for b in range(8):
        kv_a[b] = float(b + 1)
    scheduler, worker = instance(kv_a)
    request = Request(1, PROMPT)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    scheduler.update_state_after_alloc(request, [3, 1, 4, 5, 2])
    meta = step(scheduler, worker, SchedulerOutput(
        new_requests=[RequestData(1, PROMPT, [3, 1, 4, 5, 2], 0, 17)]))  # fmt: skip
    assert len(meta.saves) == 4
    assert scheduler.request_finished(request, [3, 1, 4, 5, 2]) is True
    assert worker.get_finished([1], []) == ([1], [])
    process_state().close_all()  # instance A exits: saves drained, manifest flushed

    # Instance B: a new scheduler/worker pair with an empty pool; warm start stages the chain.
    kv_b = warm_instance_loads_the_prompt(kv_a)
    assert torch.count_nonzero(kv_b[7]) == 0, "the unclaimed tail block is not touched"


@pytest.mark.parametrize("save_fails", [False, True])
def test_a_claims_prefetch_starts_once_the_forward_pass_is_queued(
    bucket_env: str, monkeypatch: pytest.MonkeyPatch, save_fails: bool
) -> None:
    _save_prompt(pool(fill=1.0))
    monkeypatch.setenv("TLLM_S3KV_WARM_START_BYTES", "0")  # B stages nothing at startup
    scheduler_b, worker_b = instance(pool())
    assert scheduler_b.core is not None
    assert scheduler_b.core.shards is not None
    shards = scheduler_b.core.shards
    request_b = Request(7, PROMPT)
    assert scheduler_b.get_num_new_matched_tokens(request_b, 0) == (0, False)
    assert shards.held_walks == 1, "the tail's prefetch waits while the iteration is planned"
    scheduler_b.update_state_after_alloc(request_b, [0, 2, 4, 6, 7])
    meta = scheduler_b.build_connector_meta(SchedulerOutput(
        new_requests=[RequestData(7, PROMPT, [0, 2, 4, 6, 7], 0, 17)]))  # fmt: skip
    worker_b.bind_connector_meta(meta)
    worker_b.start_load_kv(None)
    assert shards.held_walks == 1
    if save_fails:  # NOTE: the walk still starts, and nothing raises into the engine
        assert worker_b.core is not None
        monkeypatch.setattr(worker_b.core, "save_after_forward", _raise_injected)
    worker_b.wait_for_save(None)  # the forward pass is queued
    assert shards.held_walks == 0
    deadline = time.monotonic() + 30
    while scheduler_b.get_num_new_matched_tokens(Request(8, PROMPT), 0) != (16, False):
        assert time.monotonic() < deadline, "the tail was prefetched and staged"
        time.sleep(0.01)


def _raise_injected(*args: object, **kwargs: object) -> None:
    raise RuntimeError("injected")


def test_salted_request_gets_nothing_from_another_tenant(bucket_env: str) -> None:
    kv = pool(fill=1.0)
    scheduler, worker = instance(kv)
    request = Request(1, PROMPT, cache_salt_id=11)
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, [0, 1, 2, 3, 4])
    step(
        scheduler,
        worker,
        SchedulerOutput(new_requests=[RequestData(1, PROMPT, [0, 1, 2, 3, 4], 0, 17)]),
    )
    process_state().close_all()
    scheduler_b, _ = instance(pool())
    assert scheduler_b.get_num_new_matched_tokens(Request(2, PROMPT, cache_salt_id=12), 0) == (
        0,
        False,
    )
    assert scheduler_b.get_num_new_matched_tokens(Request(3, PROMPT), 0) == (0, False)
    assert scheduler_b.get_num_new_matched_tokens(Request(4, PROMPT, cache_salt_id=11), 0) == (
        16,
        False,
    )


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (torch.zeros(8, LAYERS, ELEMS, dtype=torch.bfloat16), "one [blocks, layers, kv_factor"),
        (torch.zeros(8, LAYERS, 2, ELEMS, dtype=torch.float64), "dtype"),
        (torch.zeros(8, LAYERS, 2, ELEMS * 2, dtype=torch.bfloat16)[..., ::2], "contiguous"),
    ],
)
def test_unservable_layouts_turn_the_connector_off(
    bucket_env: str, tensor: torch.Tensor, message: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    scheduler, worker = instance(tensor)
    assert worker.core is None
    assert scheduler.core is None
    assert any(message in r.getMessage() for r in caplog.records)
    assert scheduler.get_num_new_matched_tokens(Request(1, PROMPT), 0) == (0, False)
    assert worker.get_finished([5], []) == ([5], [])


def test_several_pools_are_refused(bucket_env: str, tmp_path: Any) -> None:
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 3}')
    args = llm_args()
    args.model = str(tmp_path)
    worker = S3KVConnectorWorker(args)
    worker.register_kv_caches(pool())
    assert worker.core is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"enable_block_reuse": False}, "enable_block_reuse"),
        ({"host_cache_size": 1 << 30}, "host_cache_size"),
    ],
)
def test_outside_the_envelope_turns_off_with_a_message(
    bucket_env: str, overrides: dict[str, Any], message: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    scheduler, worker = instance(pool(), **overrides)
    assert scheduler.core is None
    assert worker.core is None
    assert any(message in r.getMessage() for r in caplog.records)


def test_nothing_raises_into_the_engine(bucket_env: str, monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler, worker = instance(pool())
    assert scheduler.core is not None
    assert worker.core is not None

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("bug")

    monkeypatch.setattr(scheduler.core, "get_num_new_matched_tokens", boom)
    monkeypatch.setattr(scheduler.core, "build_connector_meta", boom)
    monkeypatch.setattr(scheduler.core, "request_finished", boom)
    monkeypatch.setattr(worker.core, "start_load", boom)
    monkeypatch.setattr(worker.core, "save_after_forward", boom)
    monkeypatch.setattr(worker.core, "finished", boom)
    assert scheduler.get_num_new_matched_tokens(Request(1, PROMPT), 0) == (0, False)
    assert isinstance(scheduler.build_connector_meta(SchedulerOutput()), ConnectorMetadata)
    # On failure the blocks are kept until every worker reports its copies done (safe).
    assert scheduler.request_finished(Request(1, PROMPT), []) is True
    worker.bind_connector_meta(ConnectorMetadata())
    worker.start_load_kv(None)
    worker.wait_for_save(None)
    # Defect 3: the fallback returns nothing; returning the ids given would return them a
    # second time later, and TensorRT-LLM's extract_by_id raises KeyError out of its loop.
    assert worker.get_finished([3], [4]) == ([], [])


def test_get_finished_returns_each_id_exactly_once_across_a_failure(
    bucket_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, worker = instance(pool())
    core = worker.core
    assert core is not None
    real = core.finished

    def fails_after_recording(ids: list[int]) -> list[int]:
        core._awaiting.update(ids)  # what the real method does first
        raise RuntimeError("injected after the ids were recorded")

    monkeypatch.setattr(core, "finished", fails_after_recording)
    assert worker.get_finished([3], []) == ([], [])
    monkeypatch.setattr(core, "finished", real)
    returned = [worker.get_finished([], [])[0] for _ in range(3)]
    assert returned == [[3], [], []], "returned once, later, and never again"


def test_finished_keeps_ids_when_polling_the_device_fails(
    bucket_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, worker = instance(pool())
    core = worker.core
    assert core is not None

    def broken(*, block: bool) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(core, "_drain", broken)
    assert worker.get_finished([5], []) == ([5], [])
    assert worker.get_finished([], []) == ([], [])


def test_missing_bucket_turns_off_not_raises(
    moto_server: str, aws_env: None, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    monkeypatch.setenv("TLLM_S3KV_BUCKET", "no-such-bucket-here")
    monkeypatch.setenv("TLLM_S3KV_ENDPOINT_URL", moto_server)
    monkeypatch.setenv("TLLM_S3KV_MODEL_REVISION", "r")
    caplog.set_level(logging.ERROR)
    try:
        scheduler, _ = instance(pool())
        assert scheduler.get_num_new_matched_tokens(Request(1, PROMPT), 0) == (0, False)
        assert any("no-such-bucket-here" in r.getMessage() for r in caplog.records)
    finally:
        process_state().close_all()


def test_staging_arena_is_shared_and_leaves_nothing_behind(tmp_path: Any) -> None:
    import os
    import subprocess
    import sys

    from s3kv.arena import SlabArena

    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    arena = SlabArena.create(16, 64, tag="t")
    slot = arena.allocate(16)
    slot[:] = 7
    index = arena.slot_of(slot)
    # Another process maps the region by rank 0's descriptor path and reads the slot.
    code = (
        "from s3kv.arena import SlabArena; "
        f"a = SlabArena.attach({arena.path!r}, 16); print(a.view({index}).tolist())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str([7] * 16)
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert after == before, "no named shared-memory file may exist (it would leak on a crash)"
    del slot
    arena.close()


def _save_prompt(kv: torch.Tensor) -> None:
    """Instance A computes PROMPT into blocks [3, 1, 4, 5, 2] and saves it, then exits."""
    scheduler, worker = instance(kv)
    request = Request(1, PROMPT)
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, [3, 1, 4, 5, 2])
    step(scheduler, worker, SchedulerOutput(
        new_requests=[RequestData(1, PROMPT, [3, 1, 4, 5, 2], 0, 17)]))  # fmt: skip
    scheduler.request_finished(request, [3, 1, 4, 5, 2])
    worker.get_finished([1], [])
    process_state().close_all()


def test_a_warm_start_larger_than_the_prefetch_queue_stages_every_block(
    bucket_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store drops prefetches past max_prefetch_queue: a warm start planning more blocks
    than that (6 GiB of 1 MiB blocks against the default 4,096) staged only the first ones,
    and the prefixes past them missed. It now stages window by window."""
    kv_a = pool()
    for b in range(8):
        kv_a[b] = float(b + 1)
    _save_prompt(kv_a)
    monkeypatch.setenv("TLLM_S3KV_MAX_PREFETCH_QUEUE", "2")  # 4 blocks planned, 2 at once
    scheduler_b, _ = instance(pool())
    assert scheduler_b.warm is not None
    assert scheduler_b.warm.wait()
    assert (scheduler_b.warm.planned, scheduler_b.warm.staged) == (4, 4)
    assert scheduler_b.get_num_new_matched_tokens(Request(7, PROMPT), 0) == (16, False)


def test_warm_start_is_awaited_without_wait_for_initialization(bucket_env: str) -> None:
    # Defect 7: the 1.2-era executor never calls wait_for_initialization, so the first
    # request after a redeploy would find nothing staged. Registration waits instead.
    kv_a = pool()
    for b in range(8):
        kv_a[b] = float(b + 1)
    _save_prompt(kv_a)
    args = llm_args()
    scheduler = S3KVConnectorScheduler(args)
    worker = S3KVConnectorWorker(args)
    worker.register_kv_caches(pool())  # ...and no wait_for_initialization, as in 1.2
    assert scheduler.warm is not None
    assert scheduler.warm.done.is_set()
    assert scheduler.get_num_new_matched_tokens(Request(7, PROMPT), 0) == (16, False)


@dataclass
class Layout:
    """The part of TensorRT-LLM's ``KvCacheLayout`` the connector reads."""

    tensor: torch.Tensor | None
    groups: tuple[object, ...] = (object(),)

    def as_single_pool_tensor(self) -> torch.Tensor | None:
        return self.tensor


def test_v2_layout_with_one_pool_is_registered(bucket_env: str) -> None:
    # Defect 5: KVCacheManagerV2 calls register_kv_cache_layout instead of register_kv_caches.
    args = llm_args()
    scheduler = S3KVConnectorScheduler(args)
    worker = S3KVConnectorWorker(args)
    worker.register_kv_cache_layout(Layout(pool()))
    assert worker.core is not None
    assert scheduler.core is not None
    assert scheduler.core.manager == "v2"


def test_v2_layout_with_several_regions_turns_off_without_raising(
    bucket_env: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    args = llm_args()
    scheduler = S3KVConnectorScheduler(args)
    worker = S3KVConnectorWorker(args)
    worker.register_kv_cache_layout(Layout(None, groups=(object(), object())))  # no raise
    assert worker.core is None
    assert scheduler.core is None
    assert any("layer group" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("quant", "files", "on"),
    [
        (None, {}, False),  # an int8 pool and no word of INT8 KV: NVFP4-packed data
        (SimpleNamespace(quant_algo=None, kv_cache_quant_algo="INT8"), {}, True),
        (None, {"hf_quant_config.json": '{"quantization": {"kv_cache_quant_algo": "INT8"}}'}, True),
        (
            None,
            {"hf_quant_config.json": '{"quantization": {"kv_cache_quant_algo": "NVFP4"}}'},
            False,
        ),
        (
            None,
            {"config.json": '{"quantization_config": {"kv_cache_quant_algo": "FP8"}}'},
            False,
        ),  # FP8 KV is an fp8 pool; int8 bytes then are not what the config says
    ],
)
def test_int8_pools_need_int8_kv_quantization(
    bucket_env: str, tmp_path: Any, caplog: pytest.LogCaptureFixture,
    quant: Any, files: dict[str, str], on: bool,
) -> None:  # fmt: skip
    # Defect 9: NVFP4 KV is allocated as an int8 pool; its block scales live elsewhere.
    caplog.set_level(logging.ERROR)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    args = llm_args()
    args.model = str(tmp_path)
    args.quant_config = quant
    scheduler = S3KVConnectorScheduler(args)
    worker = S3KVConnectorWorker(args)
    worker.register_kv_caches(torch.zeros(8, LAYERS, 2, ELEMS, dtype=torch.int8))
    assert (worker.core is not None) is on
    assert (scheduler.core is not None) is on


def test_fp4_kv_quantization_is_refused_at_construction(
    bucket_env: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    args = llm_args()
    args.quant_config = SimpleNamespace(quant_algo="NVFP4", kv_cache_quant_algo="NVFP4")
    scheduler = S3KVConnectorScheduler(args)
    assert scheduler.core is None
    assert any("FP4" in r.getMessage() for r in caplog.records)


def test_nvfp4_shaped_pools_turn_the_connector_off(
    bucket_env: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The emulator's NVFP4 shapes: an int8 pool of packed values (V1), and a V2 layout whose
    # block scales sit in a second region.
    from s3kv.testing.emulator.layout import nvfp4_layout, nvfp4_pool

    caplog.set_level(logging.ERROR)
    args = llm_args()
    scheduler = S3KVConnectorScheduler(args)
    worker = S3KVConnectorWorker(args)
    worker.register_kv_caches(nvfp4_pool(8, LAYERS, ELEMS))
    assert worker.core is None
    assert scheduler.core is None
    process_state().close_all()
    scheduler = S3KVConnectorScheduler(args)
    worker = S3KVConnectorWorker(args)
    worker.register_kv_cache_layout(nvfp4_layout(8, LAYERS, ELEMS, TPB))
    assert worker.core is None
    assert scheduler.core is None
    assert any("NVFP4" in r.getMessage() for r in caplog.records)


def test_an_unexpected_failure_in_a_constructor_turns_off_not_raises(
    bucket_env: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from s3kv.connector import trtllm

    def broken(llm_args: Any) -> list[str]:
        raise TypeError("unexpected llm_args shape")

    caplog.set_level(logging.ERROR)
    monkeypatch.setattr(trtllm, "envelope_problems", broken)
    scheduler = S3KVConnectorScheduler(llm_args())  # no exception into the engine
    assert scheduler.core is None
    assert any("unexpected llm_args shape" in r.getMessage() for r in caplog.records)


def test_a_load_whose_fallback_also_fails_keeps_its_sources_pinned(
    bucket_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from s3kv.connector import device
    from s3kv.connector import worker as worker_module

    _save_prompt(pool(fill=1.0))
    scheduler, worker = instance(pool())
    assert scheduler.core is not None
    assert worker.core is not None
    request = Request(7, PROMPT)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (16, False)
    scheduler.update_state_after_alloc(request, [0, 1, 2, 3, 4])
    monkeypatch.setattr(device.SyncCopyEngine, "load", lambda *a, **k: 1 / 0)
    monkeypatch.setattr(worker_module.WorkerCore, "_load_synchronously", lambda *a, **k: 1 / 0)
    step(scheduler, worker, SchedulerOutput(
        new_requests=[RequestData(7, PROMPT, [0, 1, 2, 3, 4], 0, 1)]))  # fmt: skip
    for _ in range(3):
        worker.get_finished([], [])
        scheduler.build_connector_meta(SchedulerOutput())
    assert scheduler.core.held_load_batches == 1, "copies of unknown fate: sources stay pinned"


@pytest.mark.parametrize(("on_gpu", "cpus", "expected"), [(True, 8, 2), (False, 64, 0)])
def test_auto_codec_processes_follow_the_kv_cache_and_the_cpus(
    bucket_env: str, monkeypatch: pytest.MonkeyPatch, on_gpu: bool, cpus: int, expected: int
) -> None:
    # codec_processes defaults to auto: a KV cache on a GPU gets one process per 4 CPUs (at
    # most 4), which keeps the codec off the engine's GIL; elsewhere the I/O threads do it.
    from s3kv.connector import trtllm
    from s3kv.offload import sizing

    monkeypatch.setattr(trtllm, "on_gpu", lambda kv: on_gpu)
    monkeypatch.setattr(sizing, "cpu_budget", lambda: sizing.CpuBudget(cpus, whole_host=False))
    kv_a = pool()
    for b in range(8):
        kv_a[b] = float(b + 1)
    scheduler, worker = instance(kv_a)
    (store,) = process_state().stores.values()
    assert store.metrics.value("codec_processes_alive") == expected
    request = Request(1, PROMPT)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    scheduler.update_state_after_alloc(request, [3, 1, 4, 5, 2])
    step(scheduler, worker, SchedulerOutput(
        new_requests=[RequestData(1, PROMPT, [3, 1, 4, 5, 2], 0, 17)]))  # fmt: skip
    scheduler.request_finished(request, [3, 1, 4, 5, 2])
    process_state().close_all()  # NOTE: drains the saves, wherever they run
    assert store.metrics.value("save_completed") == 4

    warm_instance_loads_the_prompt(kv_a)
