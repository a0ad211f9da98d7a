"""The overlap-loop load race on the CPU: claimed blocks never receive recycled staging bytes.

Under TensorRT-LLM's overlap loop (its default) iteration N+1 calls ``build_connector_meta``
before the host synchronises on iteration N, so the host→device copies ``start_load_kv``
enqueued in iteration N may not have run yet. The emulated runtime reproduces that with its
late device (queued work runs only when the host synchronises). A scheduler subclass plays
the worst-case neighbour: right after every ``build_connector_meta`` it evicts every staged
block it may evict and overwrites the freed buffers with garbage, as a prefetch refilling
the slots would.

* ``completion`` (s3kv's rule): pins are released once every rank has published that the
  copies' event completed, so the claimed bytes cannot be recycled: outputs equal a run
  without the connector.
* ``next_step`` (the rule before the fix, forced by making the completion board report
  everything complete): the same run gives wrong tokens. This proves the test can fail.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from _emulator import one_torch_thread, prompt, tiny_model

from s3kv.connector.completion import CompletionBoard
from s3kv.connector.shared import process_state
from s3kv.connector.trtllm import S3KVConnectorScheduler, S3KVConnectorWorker
from s3kv.testing.emulator.executor import PyExecutorEmulator
from s3kv.testing.emulator.llm_args import KvCacheConfig, TorchLlmArgs

TPB = 8
SYSTEM = prompt(6 * TPB, seed=41)
QUESTION = prompt(5, seed=42)


class RecyclingScheduler(S3KVConnectorScheduler):
    """Recycles every evictable staging buffer right after each ``build_connector_meta``."""

    recycled = 0

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        core = self.core
        if core is not None and core.shards is not None:
            staging = core.shards.stores[0].staging
            for key in list(staging._entries):
                nbytes = staging._entries[key].buffer.nbytes
                if staging.remove(key):  # unpinned: its buffer goes back to the free pool
                    buffer = staging.allocate(nbytes)  # a prefetch takes the buffer...
                    assert buffer is not None
                    buffer.fill(0x7B)  # ...and writes another block's bytes into it
                    staging.release(buffer)
                    type(self).recycled += 1
        return meta


def engine(*, connector: bool, overlap: bool = True) -> PyExecutorEmulator:
    args = TorchLlmArgs(
        kv_cache_config=KvCacheConfig(tokens_per_block=TPB, enable_partial_reuse=False),
        disable_overlap_scheduler=not overlap,
    )
    classes: dict[str, Any] = {}
    if connector:
        classes = {
            "connector_scheduler_cls": RecyclingScheduler,
            "connector_worker_cls": S3KVConnectorWorker,
        }
    return PyExecutorEmulator(args, tiny_model(TPB), num_blocks=64, overlap=overlap, **classes)


def serve(executor: PyExecutorEmulator, tokens: list[int]) -> tuple[list[int], int]:
    (result,) = executor.generate([tokens], 6)
    executor.drain()
    return list(result.output_tokens), result.connector_tokens


@pytest.mark.parametrize("policy", ["completion", "next_step"])
def test_claimed_blocks_never_receive_recycled_staging_bytes(
    file_bucket: Path, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    with one_torch_thread():
        expected, _ = serve(engine(connector=False), SYSTEM + QUESTION)
        # Instance A computes the system prompt and saves it, then exits.
        serve(engine(connector=True), SYSTEM + prompt(5, seed=43))
        process_state().close_all()
        if policy == "next_step":
            monkeypatch.setattr(CompletionBoard, "completed", lambda self: 1 << 62)
        # Instance B (overlap loop, late device) warms from the bucket and claims.
        RecyclingScheduler.recycled = 0
        reader = engine(connector=True)
        tokens, claimed = serve(reader, SYSTEM + QUESTION)
    assert claimed == len(SYSTEM)
    if policy == "completion":
        assert tokens == expected, "a claimed block received recycled bytes"
        manager = reader.connector_manager
        assert manager is not None
        assert manager.scheduler is not None
        assert manager.scheduler.core.held_load_batches == 0, "pins released once complete"
    else:
        assert RecyclingScheduler.recycled >= len(SYSTEM) // TPB
        assert tokens != expected, "the old rule must lose the race on the late device"


def test_plain_loop_is_correct_too(file_bucket: Path) -> None:
    with one_torch_thread():
        expected, _ = serve(engine(connector=False, overlap=False), SYSTEM + QUESTION)
        serve(engine(connector=True, overlap=False), SYSTEM + prompt(5, seed=43))
        process_state().close_all()
        tokens, claimed = serve(engine(connector=True, overlap=False), SYSTEM + QUESTION)
    assert claimed == len(SYSTEM)
    assert tokens == expected


def _tp_rank(rank: int, world: int, env: dict[str, str]) -> dict[str, Any]:
    """One TP rank: reference, writer, then readers under both release policies."""
    import os

    os.environ.update(env)

    def tp_engine(connector: bool) -> PyExecutorEmulator:
        args = TorchLlmArgs(
            tensor_parallel_size=world,
            kv_cache_config=KvCacheConfig(tokens_per_block=TPB, enable_partial_reuse=False),
        )
        classes: dict[str, Any] = {}
        if connector:
            classes = {
                "connector_scheduler_cls": RecyclingScheduler,
                "connector_worker_cls": S3KVConnectorWorker,
            }
        model = tiny_model(TPB, tp_rank=rank, tp_size=world)
        return PyExecutorEmulator(args, model, num_blocks=64, overlap=True, **classes)

    report: dict[str, Any] = {"expected": serve(tp_engine(False), SYSTEM + QUESTION)[0]}
    serve(tp_engine(True), SYSTEM + prompt(5, seed=43))
    process_state().close_all()
    for policy in ("completion", "next_step"):
        real = CompletionBoard.completed
        if policy == "next_step":
            CompletionBoard.completed = lambda self: 1 << 62  # type: ignore[method-assign]
        try:
            report[policy] = serve(tp_engine(True), SYSTEM + QUESTION)
        finally:
            CompletionBoard.completed = real  # type: ignore[method-assign]
            process_state().close_all()
    return report


def test_tensor_parallel_arena_slots_are_not_recycled_under_a_load(file_bucket: Path) -> None:
    # The same race on the TP path: rank 0 stages every shard into shared arenas, each rank
    # copies its own slot; a slot may be recycled only once *every* rank's copy completed.
    from s3kv.testing.emulator.parallel import run_tensor_parallel

    env = {k: v for k, v in os.environ.items() if k.startswith("TLLM_S3KV_")}
    per_rank = run_tensor_parallel(2, _tp_rank, env, timeout=240)
    for report in per_rank:
        tokens, claimed = report["completion"]
        assert claimed == len(SYSTEM)
        assert tokens == report["expected"], "a claimed block received a recycled slot"
    assert any(r["next_step"][0] != r["expected"] for r in per_rank), "the old rule loses"
