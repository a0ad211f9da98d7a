"""Rank-asymmetric faults under tensor parallelism, through the whole emulated runtime.

Two rank processes (gloo, the tiny model split in two) serve a saved system prompt while one
worker entry point fails on one rank only: the load enqueue, the save, or the
``get_finished`` poll (once after recording the ids, or every time). Each rank must produce
the tokens of a TP=2 run without the connector — the claimed loads happen on every rank —
and no rank may hang in a collective the other skipped, or trip TensorRT-LLM's bookkeeping
(``extract_by_id``). Registration faults are covered in ``test_connector_tp_faults.py``.

One spawn runs every case in sequence, to keep the suite fast.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _emulator import prompt, tiny_model

from s3kv.connector import device, worker
from s3kv.connector.shared import process_state
from s3kv.testing.emulator.executor import PyExecutorEmulator
from s3kv.testing.emulator.instance import S3KV_CONNECTOR
from s3kv.testing.emulator.llm_args import KvCacheConfig, TorchLlmArgs
from s3kv.testing.emulator.parallel import run_tensor_parallel

TPB = 8
SYSTEM = prompt(4 * TPB, seed=61)
PROMPTS = [SYSTEM + prompt(5, seed=62), SYSTEM + prompt(6, seed=63)]


def _raises(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("injected fault")


def _record_then_raise_once(real: Callable[..., Any]) -> Callable[..., Any]:
    failed: list[bool] = []

    def finished(self: Any, ids: Any) -> Any:
        if ids and not failed:
            failed.append(True)
            self._awaiting.update(int(i) for i in ids)
            raise RuntimeError("injected fault")
        return real(self, ids)

    return finished


FAULTS: dict[str, tuple[Any, str, Callable[[Any], Any]]] = {
    "start_load_kv": (device.DeferredCopyEngine, "load", lambda real: _raises),
    "wait_for_save": (worker.WorkerCore, "save_after_forward", lambda real: _raises),
    "get_finished.poll": (worker.WorkerCore, "_drain", lambda real: _raises),
    "get_finished.after_recording": (worker.WorkerCore, "finished", _record_then_raise_once),
}


def _engine(world: int, rank: int, connector: bool) -> PyExecutorEmulator:
    args = TorchLlmArgs(
        tensor_parallel_size=world,
        kv_cache_config=KvCacheConfig(tokens_per_block=TPB, enable_partial_reuse=False),
        kv_connector_config=S3KV_CONNECTOR if connector else None,
    )
    return PyExecutorEmulator(
        args, tiny_model(TPB, tp_rank=rank, tp_size=world), num_blocks=64, stall_timeout_s=20
    )


def _serve(executor: PyExecutorEmulator) -> tuple[list[list[int]], int]:
    results = executor.generate(PROMPTS, 4)
    executor.drain()
    return [list(r.output_tokens) for r in results], sum(r.connector_tokens for r in results)


def _rank_main(rank: int, world: int, env: dict[str, str]) -> dict[str, Any]:
    os.environ.update(env)
    report: dict[str, Any] = {"reference": _serve(_engine(world, rank, connector=False))[0]}
    _serve(_engine(world, rank, connector=True))  # the writer: saves every shard
    process_state().close_all()
    for name, (owner, attribute, make) in FAULTS.items():
        for fault_rank in range(world):
            real = getattr(owner, attribute)
            if rank == fault_rank:
                setattr(owner, attribute, make(real))
            try:
                executor = _engine(world, rank, connector=True)
                outputs, claimed = _serve(executor)
                manager = executor.connector_manager
                assert manager is not None
                report[f"{name}@{fault_rank}"] = (outputs, claimed, manager.has_pending_transfers())
            finally:
                setattr(owner, attribute, real)
                process_state().close_all()
    return report


def test_worker_faults_on_one_rank_keep_every_rank_correct(tmp_path: Path) -> None:
    root = tmp_path / "bucket"
    root.mkdir()
    env = {
        "TLLM_S3KV_ENDPOINT_URL": f"file://{root}", "TLLM_S3KV_BUCKET": "tp-faults",
        "TLLM_S3KV_MODEL_REVISION": "tiny", "TLLM_S3KV_MANIFEST_FLUSH_INTERVAL": "0.05",
    }  # fmt: skip
    per_rank = run_tensor_parallel(2, _rank_main, env, timeout=240)
    for rank, report in enumerate(per_rank):
        expected = report.pop("reference")
        assert expected == per_rank[0].get("reference", expected)
        for case, (outputs, claimed, pending) in report.items():
            assert claimed == len(PROMPTS) * len(SYSTEM), f"rank {rank}, {case}: no claim"
            assert outputs == expected, f"rank {rank}, fault {case}: wrong tokens"
            assert not pending, f"rank {rank}, fault {case}: a transfer never completed"
