"""Rank-asymmetric faults in the entry points that hold a collective (``register_kv_caches``).

Two ranks run as threads of one process with barrier collectives (tests/_emulator.py's
``ThreadRanks``), so a rank that skips a collective shows up as a broken barrier within
seconds instead of a hang. The rule under test (issue: a failure on rank 0 inside
``register_kv_caches`` desynchronised the collectives): fallible work runs under a guard,
then the collectives run on every rank, and the connector ends up on everywhere or off
everywhere.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
from _emulator import ThreadRanks
from test_connector_trtllm import bucket_env, llm_args, pool  # noqa: F401 - fixture

from s3kv.connector import trtllm
from s3kv.connector.shared import ProcessState
from s3kv.connector.trtllm import S3KVConnectorScheduler, S3KVConnectorWorker

_local = threading.local()


def current_rank() -> int:
    return int(getattr(_local, "rank", -1))


def faulty(fault_rank: int, real: Callable[..., Any]) -> Callable[..., Any]:
    """``real``, except that it raises on ``fault_rank``."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if current_rank() == fault_rank:
            raise OSError(f"injected fault on rank {fault_rank}")
        return real(*args, **kwargs)

    return call


def fault_every_store_opener(monkeypatch: pytest.MonkeyPatch, fault_rank: int) -> None:
    """Under TP rank 0 opens the layout's stores, the others stores relayed to rank 0's."""
    for name in ("open_store", "open_layout", "open_relayed_store"):
        monkeypatch.setattr(ProcessState, name, faulty(fault_rank, getattr(ProcessState, name)))


FAULTS: dict[str, Callable[[pytest.MonkeyPatch, int], None]] = {
    # rank 0 derives the weights revision inside registration (an unreadable checkpoint)
    "weights_revision": lambda mp, r: mp.setattr(
        trtllm, "weights_revision", faulty(r, trtllm.weights_revision)
    ),
    # a rank cannot describe its pool (a bug, an odd tensor)
    "describe": lambda mp, r: mp.setattr(
        S3KVConnectorWorker, "_describe", faulty(r, S3KVConnectorWorker._describe)
    ),
    # a rank cannot open its store (not an S3KVError: an unexpected failure)
    "open_store": fault_every_store_opener,
    # rank 0's scheduler cannot start (after the all-gather)
    "scheduler_initialize": lambda mp, r: mp.setattr(
        S3KVConnectorScheduler, "initialize", faulty(r, S3KVConnectorScheduler.initialize)
    ),
}


def register_two_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[S3KVConnectorScheduler | None, list[S3KVConnectorWorker]]:
    ranks = ThreadRanks(2)
    ranks._barrier = threading.Barrier(2, timeout=10)  # a skipped collective fails fast
    monkeypatch.setattr(trtllm, "get_collectives", lambda: ranks.collectives(current_rank()))
    args = llm_args()
    args.tensor_parallel_size = 2
    schedulers: list[S3KVConnectorScheduler] = []

    def rank_main(rank: int) -> S3KVConnectorWorker:
        _local.rank = rank
        if rank == 0:
            schedulers.append(S3KVConnectorScheduler(args))
        ranks.allgather(rank, None)  # both constructed before registration, as upstream
        worker = S3KVConnectorWorker(args)
        worker.register_kv_caches(pool())
        ranks.allgather(rank, None)  # the next collective after registration still pairs
        return worker

    workers = ranks.run(rank_main)
    return (schedulers[0] if schedulers else None), workers


@pytest.mark.usefixtures("bucket_env")
def test_two_healthy_ranks_come_up_together(monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler, workers = register_two_ranks(monkeypatch)
    assert scheduler is not None
    assert scheduler.core is not None
    assert all(w.core is not None for w in workers)
    assert scheduler.core.board.path, "a shared completion board for the TP workers"
    # Rank 0 stages every shard into arenas the other ranks map: rank 1's own store (it only
    # saves) gets no staging budget, which with codec processes would be a whole arena
    # page-locked at start on every rank.
    stores = trtllm.process_state().stores
    shard_stores = [store for name, store in stores.items() if "@" in name]
    (relayed,) = [store for name, store in stores.items() if "@" not in name]
    assert len(shard_stores) == 2
    assert relayed.metrics.value("staging_capacity_bytes") == 0
    assert all(s.metrics.value("staging_capacity_bytes") > 0 for s in shard_stores)


@pytest.mark.usefixtures("bucket_env")
@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("fault_rank", [0, 1])
def test_a_fault_on_one_rank_turns_the_connector_off_on_every_rank(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    fault: str, fault_rank: int,
) -> None:  # fmt: skip
    if fault in ("weights_revision", "scheduler_initialize") and fault_rank == 1:
        pytest.skip("runs on rank 0 only")
    caplog.set_level(logging.ERROR)
    FAULTS[fault](monkeypatch, fault_rank)
    scheduler, workers = register_two_ranks(monkeypatch)  # no broken barrier: no desync
    assert scheduler is not None
    assert scheduler.core is None, "the scheduler claims nothing"
    # Faults after the all-gather (rank 0's scheduler opening the shard stores) leave the
    # other ranks' workers idle: with the scheduler off nothing is ever planned for them.
    after_gather = fault == "scheduler_initialize" or (fault == "open_store" and fault_rank == 0)
    if not after_gather:
        assert [w.core for w in workers] == [None, None], "off on every rank, not half"
    assert workers[0].core is None
    assert any("injected fault" in r.getMessage() or r.exc_info for r in caplog.records)
