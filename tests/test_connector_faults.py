"""Faults injected into every guarded entry point, on the emulated runtime (both loops).

A reader instance claims a saved system prompt while one of its cores fails — in the
scheduler (claim, allocation, metadata, finish) or in the worker (load enqueue, save, the
``get_finished`` poll). Whatever fails, the guards' fallbacks must keep TensorRT-LLM's
bookkeeping intact — the emulated ``KvCacheConnectorManager.get_finished`` raises ``KeyError``
from ``extract_by_id`` for an id returned twice, and the executor raises ``EmulatorStall``
for a save that is never reported — and the tokens must equal a run without the connector:
a claimed load is never dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _emulator import one_torch_thread, prompt, tiny_model

from s3kv.connector import device, scheduler, worker
from s3kv.connector.shared import process_state
from s3kv.testing.emulator.executor import PyExecutorEmulator
from s3kv.testing.emulator.instance import S3KV_CONNECTOR
from s3kv.testing.emulator.llm_args import KvCacheConfig, TorchLlmArgs

TPB = 8
SYSTEM = prompt(5 * TPB, seed=51)


def raises(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("injected fault")


def record_then_raise(real: Callable[..., Any]) -> Callable[..., Any]:
    """``finished`` fails once with ids given, after recording them; later calls are real."""
    failed: list[bool] = []

    def finished(self: Any, ids: Any) -> Any:
        if ids and not failed:
            failed.append(True)
            self._awaiting.update(int(i) for i in ids)  # recorded, then it fails
            raise RuntimeError("injected fault")
        return real(self, ids)

    return finished


#: entry point -> (class, attribute, replacement factory given the real attribute)
FAULTS: dict[str, tuple[type, str, Callable[[Any], Any]]] = {
    "get_num_new_matched_tokens": (
        scheduler.SchedulerCore, "get_num_new_matched_tokens", lambda real: raises),
    "update_state_after_alloc": (
        scheduler.SchedulerCore, "update_state_after_alloc", lambda real: raises),
    "build_connector_meta": (
        scheduler.SchedulerCore, "build_connector_meta", lambda real: raises),
    "build_connector_meta.saves": (
        scheduler.SchedulerCore, "_plan_saves", lambda real: raises),
    "request_finished": (scheduler.SchedulerCore, "request_finished", lambda real: raises),
    "start_load_kv.enqueue_deferred": (device.DeferredCopyEngine, "load", lambda real: raises),
    "start_load_kv.enqueue_sync": (device.SyncCopyEngine, "load", lambda real: raises),
    "wait_for_save": (worker.WorkerCore, "save_after_forward", lambda real: raises),
    "get_finished.poll": (worker.WorkerCore, "_drain", lambda real: raises),
    "get_finished.after_recording": (worker.WorkerCore, "finished", record_then_raise),
}  # fmt: skip


def engine(*, connector: bool, overlap: bool) -> PyExecutorEmulator:
    args = TorchLlmArgs(
        kv_cache_config=KvCacheConfig(tokens_per_block=TPB, enable_partial_reuse=False),
        kv_connector_config=S3KV_CONNECTOR if connector else None,
        disable_overlap_scheduler=not overlap,
    )
    return PyExecutorEmulator(args, tiny_model(TPB), num_blocks=96, stall_timeout_s=10)


def serve(executor: PyExecutorEmulator, prompts: list[list[int]]) -> list[tuple[int, ...]]:
    results = executor.generate(prompts, 4)
    executor.drain()  # raises EmulatorStall if a save is never reported finished
    return [r.output_tokens for r in results]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_failing_entry_point_keeps_outputs_and_bookkeeping(
    file_bucket: Path, monkeypatch: pytest.MonkeyPatch, fault: str, overlap: bool
) -> None:
    prompts = [SYSTEM + prompt(5, seed=s) for s in (52, 53)] + [prompt(21, seed=54)]
    with one_torch_thread():
        expected = serve(engine(connector=False, overlap=overlap), prompts)
        serve(engine(connector=True, overlap=overlap), [SYSTEM + prompt(3, seed=55)])
        process_state().close_all()
        owner, name, make = FAULTS[fault]
        monkeypatch.setattr(owner, name, make(getattr(owner, name)))
        reader = engine(connector=True, overlap=overlap)
        assert serve(reader, prompts) == expected
        # A second round on the same instance: nothing leaked that breaks later requests.
        assert serve(reader, prompts) == expected
    manager = reader.connector_manager
    assert manager is not None
    assert not manager.has_pending_transfers()


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_rank_0_worker_that_cannot_start_turns_the_scheduler_off(
    file_bucket: Path, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    # Rank 0 builds its worker after the scheduler opened the stores: if that fails, a
    # scheduler left on would claim tokens that no worker loads (wrong outputs).
    from s3kv.connector import trtllm

    prompts = [SYSTEM + prompt(5, seed=s) for s in (52, 53)]
    with one_torch_thread():
        expected = serve(engine(connector=False, overlap=overlap), prompts)
        serve(engine(connector=True, overlap=overlap), [SYSTEM + prompt(3, seed=55)])
        process_state().close_all()
        monkeypatch.setattr(trtllm, "WorkerCore", raises)
        reader = engine(connector=True, overlap=overlap)
        results = reader.generate(prompts, 4)
        reader.drain()
    assert [r.output_tokens for r in results] == expected
    assert [r.connector_tokens for r in results] == [0, 0], "nothing claimed"
