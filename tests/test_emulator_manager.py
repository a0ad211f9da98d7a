"""``KvCacheConnectorManager`` replays of ``tests/unittest/_torch/test_connector.py``, and TP.

Upstream runs these on two MPI ranks (``mpi_pool_executor``); here two threads share
barrier-based collectives (:class:`_emulator.ThreadRanks`), which exercises the same
broadcast / allgather paths. The last test runs the whole executor on two spawned ranks with
gloo collectives (:func:`s3kv.testing.emulator.parallel.run_tensor_parallel`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _emulator import ThreadRanks, llm_args, one_torch_thread, prompt, tiny_model

from s3kv.testing.emulator.connector_manager import (
    AsyncRequests,
    KvCacheConnectorManager,
    SchedulerOutputManager,
)
from s3kv.testing.emulator.executor import PyExecutorEmulator
from s3kv.testing.emulator.parallel import run_tensor_parallel
from s3kv.testing.emulator.recording import RecordingConnector
from s3kv.testing.emulator.request import LlmRequest, LlmRequestState
from s3kv.testing.emulator.scheduler import ScheduledRequests


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def _manager(rec: RecordingConnector, ranks: ThreadRanks, rank: int) -> KvCacheConnectorManager:
    scheduler_cls, worker_cls = rec.classes()
    scheduler = scheduler_cls(None) if rank == 0 else None
    return KvCacheConnectorManager(worker_cls(None), scheduler, collectives=ranks.collectives(rank))


def test_connector_manager_get_finished_allgather() -> None:
    ranks = ThreadRanks(2)

    def body(rank: int) -> None:
        rec = RecordingConnector()
        rec.scheduler.request_finished.return_value = True
        manager = _manager(rec, ranks, rank)
        req = LlmRequest(42, [1, 2, 3], 1)
        manager.request_finished(req, [])
        get_finished = rec.worker.get_finished

        # To start, both workers return nothing.
        get_finished.return_value = ([], [])
        assert manager.get_finished() == []
        assert get_finished.call_count == 1
        assert get_finished.call_args.args == ([42], [])
        get_finished.reset_mock()

        # Only rank 0 returns it: still nothing, rank 1 is still saving.
        get_finished.return_value = ([42], []) if rank == 0 else ([], [])
        assert manager.get_finished() == []
        assert get_finished.call_count == 1
        assert get_finished.call_args.args == ([], [])

        # Now rank 1 returns it too: done on both ranks.
        get_finished.return_value = ([], []) if rank == 0 else ([42], [])
        assert manager.get_finished() == [req]

    ranks.run(body)


def test_connector_manager_num_matched_tokens() -> None:
    ranks = ThreadRanks(2)

    def body(rank: int) -> None:
        rec = RecordingConnector()
        rec.scheduler.get_num_new_matched_tokens.return_value = (16, True)
        manager = _manager(rec, ranks, rank)
        req = LlmRequest(42, list(range(64)), 1)
        assert manager.get_num_new_matched_tokens(req, 32) == 16  # on every rank
        expected = 1 if rank == 0 else 0  # the scheduler runs on rank 0 only
        assert rec.scheduler.get_num_new_matched_tokens.call_count == expected
        if rank == 0:
            assert rec.scheduler.get_num_new_matched_tokens.call_args.args == (req, 32)

    ranks.run(body)


def test_connector_manager_take_scheduled_requests() -> None:
    ranks = ThreadRanks(2)

    def body(rank: int) -> None:
        rec = RecordingConnector()
        manager = _manager(rec, ranks, rank)
        req0, req1 = LlmRequest(0, list(range(64)), 1), LlmRequest(1, list(range(64)), 1)
        rec.scheduler.get_num_new_matched_tokens.return_value = (16, True)
        assert manager.get_num_new_matched_tokens(req0, 0) == 16
        rec.scheduler.get_num_new_matched_tokens.return_value = (32, False)
        assert manager.get_num_new_matched_tokens(req1, 0) == 32
        batch = ScheduledRequests(context_requests_last_chunk=[req0, req1])
        manager.take_scheduled_requests_pending_load(batch)
        assert batch.context_requests_last_chunk == [req1]
        assert req0.state == LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS  # beyond

    ranks.run(body)


def test_scheduler_output_num_scheduled_tokens_with_mtp() -> None:
    class _Kv:
        def get_cache_indices(self, request: Any) -> list[int]:
            return [0, 1, 2]

    req = LlmRequest(42, [1, 2], 8)
    for token in (3, 4, 5):
        req.add_new_token(token)
    req.state = LlmRequestState.GENERATION_IN_PROGRESS
    req.py_draft_tokens = [100, 101, 102]
    batch = ScheduledRequests(generation_requests=[req])
    out = SchedulerOutputManager().build_scheduler_output(batch, AsyncRequests(), _Kv())  # type: ignore[arg-type]
    assert len(out.cached_requests) == 1
    assert out.cached_requests[0].num_scheduled_tokens == 1 + 3


def test_generation_only_requests_are_rejected() -> None:
    ranks = ThreadRanks(1)
    manager = _manager(RecordingConnector(), ranks, 0)
    req = LlmRequest(7, [1, 2, 3], 1, is_generation_only=True)
    with pytest.raises(RuntimeError, match="not supported for generation-only requests"):
        manager.get_num_new_matched_tokens(req, 0)


@pytest.mark.parametrize("rank", [0, 1])
def test_scheduler_only_on_rank_zero(rank: int) -> None:
    ranks = ThreadRanks(2)
    scheduler_cls, worker_cls = RecordingConnector().classes()
    wrong = None if rank == 0 else scheduler_cls(None)
    with pytest.raises(AssertionError, match="only exist on rank 0"):
        KvCacheConnectorManager(worker_cls(None), wrong, collectives=ranks.collectives(rank))


def _tp_rank(rank: int, world_size: int) -> dict[str, Any]:
    """One TP rank: rank 1's worker reports each save one get_finished call late."""
    rec = RecordingConnector()
    rec.scheduler.request_finished.return_value = True
    handed: list[int] = []
    returned: list[list[int]] = []  # what this rank's worker returned, per call (= step)
    snapshots: list[dict[int, list[int]]] = []

    def get_finished(saving: list[int], loading: list[int]) -> tuple[list[int], list[int]]:
        done = list(saving) if rank == 0 else list(handed)
        handed[:] = saving  # NOTE: rank 1 finishes on the call after the hand-over
        returned.append(done)
        return done, loading

    rec.worker.get_finished.side_effect = get_finished
    scheduler_cls, worker_cls = rec.classes()
    ex = PyExecutorEmulator(
        llm_args(tensor_parallel_size=world_size),
        tiny_model(tp_rank=rank, tp_size=world_size),
        num_blocks=16,
        overlap=False,
        connector_scheduler_cls=scheduler_cls,
        connector_worker_cls=worker_cls,
    )
    rec.worker.forward_pass.side_effect = lambda: snapshots.append(ex.kv_cache_manager.sequences())
    ids = [ex.submit(prompt(40), 3), ex.submit(prompt(70, seed=2), 5)]
    live: list[set[int]] = []  # request ids holding blocks after each step
    while not all(ex.is_finished(rid) for rid in ids) or ex.kv_cache_manager.sequences():
        ex.step()
        live.append(set(ex.kv_cache_manager.sequences()))
    return {
        "ids": ids,
        "outputs": [ex.result(rid).output_tokens for rid in ids],
        "returned": returned,
        "live": live,
        "snapshots": snapshots,
        "scheduler_calls": rec.scheduler.build_connector_meta.call_count,
        "pool_elems": int(ex.pool.shape[-1]),
    }


def _step_of(returned: list[list[int]], rid: int) -> int:
    return next(step for step, ids in enumerate(returned) if rid in ids)


def test_tensor_parallel_lockstep_and_get_finished_intersection() -> None:
    rank0, rank1 = run_tensor_parallel(2, _tp_rank, timeout=240)
    # Same tokens on both ranks, and the same as a single-rank run.
    single = PyExecutorEmulator(llm_args(), tiny_model(), num_blocks=16, overlap=False)
    expected = [r.output_tokens for r in single.generate([prompt(40)], 3)]
    expected += [r.output_tokens for r in single.generate([prompt(70, seed=2)], 5)]
    assert rank0["outputs"] == rank1["outputs"] == expected
    # Identical block decisions on every rank; each pool holds half of the KV heads.
    assert rank0["snapshots"] == rank1["snapshots"]
    assert rank0["pool_elems"] == rank1["pool_elems"] == single.pool.shape[-1] // 2
    assert rank0["scheduler_calls"] > 0
    assert rank1["scheduler_calls"] == 0
    # Rank 0's worker finished each save at once, rank 1's a call later: the blocks stayed
    # allocated (on both ranks) until the later one, then went on both at the same step.
    assert rank0["live"] == rank1["live"]
    for rid in rank0["ids"]:
        early, late = _step_of(rank0["returned"], rid), _step_of(rank1["returned"], rid)
        assert late == early + 1
        assert rid in rank0["live"][early]
        assert rid not in rank0["live"][late]
