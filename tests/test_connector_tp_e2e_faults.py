"""Rank-asymmetric faults under tensor parallelism, through the whole emulated runtime.

Two rank processes (gloo, the tiny model split in two) serve a saved system prompt while one
worker entry point fails on one rank only: the load enqueue, the save, or the
``get_finished`` poll (once after recording the ids, or every time). Each rank must produce
the tokens of a TP=2 run without the connector — the claimed loads happen on every rank —
and no rank may hang in a collective the other skipped, or trip TensorRT-LLM's bookkeeping
(``extract_by_id``). Registration faults are covered in ``test_connector_tp_faults.py``.

One spawn runs every case in sequence, to keep the suite fast.

A save that fails on one rank only is the other asymmetric fault: the layout's one manifest
(``s3kv.manifest.shards``) must advertise a block only once *both* shards are written, so a
later instance claims up to the first half-written block, and saving it again heals it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _emulator import prompt, tiny_model

from s3kv.connector import device, worker
from s3kv.connector.shared import process_state
from s3kv.errors import StorageError
from s3kv.keys import chain_hashes
from s3kv.storage import FileBackend
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


#: Rank 1 cannot write its shard of this block of ``SYSTEM`` (shard 0 can).
HALF_WRITTEN = 2


def _serve_claims(world: int, rank: int, tokens: list[int]) -> tuple[list[int], int]:
    executor = _engine(world, rank, connector=True)
    (result,) = executor.generate([tokens], 4)
    executor.drain()
    return list(result.output_tokens), result.connector_tokens


def _store_stats() -> list[dict[str, float]]:
    return [store.stats() for store in process_state().stores.values()]


def _advertised(url: str, tokens: list[int]) -> list[bool]:
    """Per block of ``tokens``, whether a new reader of the bucket's one manifest has it."""
    from s3kv.manifest import Manifest

    backend = FileBackend.from_url(url)
    (manifest_dir,) = {key.split("/manifest/")[0] for key in _keys(backend) if "/manifest/" in key}
    prefix, layout = manifest_dir.rsplit("/", 1)
    reader = Manifest.open(backend, prefix, layout, capacity=1000, fpr=1e-6)
    try:
        return [reader.may_contain(key) for key in chain_hashes(tokens, TPB)]
    finally:
        reader.close(flush=False)


def _keys(backend: FileBackend) -> list[str]:
    return [info.key for info in backend.list("")]


def _half_written_rank_main(rank: int, world: int, env: dict[str, str]) -> dict[str, Any]:
    os.environ.update(env)
    victim = chain_hashes(SYSTEM, TPB)[HALF_WRITTEN].hex()
    real_put = FileBackend.put

    def put(self: FileBackend, key: str, data: Any, *, if_absent: bool = False) -> bool:
        if "/blocks/" in key and key.endswith(victim):
            raise StorageError("injected: rank 1 cannot write this block")
        return real_put(self, key, data, if_absent=if_absent)

    report: dict[str, Any] = {}
    # Instance A saves SYSTEM; rank 1's PUT of block HALF_WRITTEN fails.
    if rank == 1:
        FileBackend.put = put  # type: ignore[method-assign]
    try:
        _serve_claims(world, rank, PROMPTS[0])
        report["writer_stats"] = _store_stats()
    finally:
        FileBackend.put = real_put  # type: ignore[method-assign]
        process_state().close_all()
    if rank == 0:
        report["advertised"] = _advertised(env["TLLM_S3KV_ENDPOINT_URL"], SYSTEM)
    # Instance B: claims only the blocks both shards wrote, and saves the missing shard.
    executor = _engine(world, rank, connector=False)
    (reference,) = executor.generate([PROMPTS[1]], 4)
    report["reference"] = list(reference.output_tokens)
    report["healing"] = _serve_claims(world, rank, PROMPTS[1])
    process_state().close_all()
    # Instance C: every block of SYSTEM is whole again.
    report["healed"] = _serve_claims(world, rank, PROMPTS[1])
    process_state().close_all()
    return report


def test_a_block_counts_only_once_every_shard_is_written(file_bucket: Path) -> None:
    import json

    env = {k: v for k, v in os.environ.items() if k.startswith("TLLM_S3KV_")}
    rank0, rank1 = run_tensor_parallel(2, _half_written_rank_main, env, timeout=240)
    # One manifest for the TP=2 layout, not one per shard: the shards' objects sit under
    # their own fingerprints, the manifest under the layout's (with its identity.json).
    manifests = sorted(p.parent for p in file_bucket.rglob("manifest") if p.is_dir())
    assert len(manifests) == 1, f"expected one manifest, found {manifests}"
    layout = manifests[0]
    shard_dirs = sorted(p.parent for p in file_bucket.rglob("blocks") if p.is_dir())
    assert len(shard_dirs) == 2
    assert layout not in shard_dirs
    described = json.loads((layout / "identity.json").read_text())
    assert described["tp_size"] == 2
    assert described["tp_rank"] is None
    assert sorted(described["shard_fingerprints"]) == sorted(p.name for p in shard_dirs)
    # Rank 1's process opened no manifest: its writes were relayed to rank 0's.
    (relayed,) = rank1["writer_stats"]
    assert relayed["manifest_relay_reports"] >= len(SYSTEM) // TPB - 1
    assert relayed["manifest_relay_dropped"] == 0
    assert all("manifest_shard_pending" in stats for stats in rank0["writer_stats"])
    # After A, a new reader sees every block but the one only shard 0 wrote.
    assert rank0["advertised"] == [i != HALF_WRITTEN for i in range(len(SYSTEM) // TPB)]
    for rank, report in enumerate((rank0, rank1)):
        # B claims the blocks before the half-written one, and answers correctly.
        outputs, claimed = report["healing"]
        assert claimed == HALF_WRITTEN * TPB, f"rank {rank}: claimed {claimed} tokens"
        assert outputs == report["reference"], f"rank {rank}: wrong tokens"
        # B's save of the missing shard completed the block: C claims all of SYSTEM.
        outputs, claimed = report["healed"]
        assert claimed == len(SYSTEM), f"rank {rank}: the block was not healed"
        assert outputs == report["reference"], f"rank {rank}: wrong tokens after healing"
