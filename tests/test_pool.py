"""The I/O pool: priority, then submission order; batches queued at once; shutdown."""

from __future__ import annotations

import threading

from s3kv.pool import IOPool, Priority


def test_a_batch_runs_in_order_after_work_of_a_higher_priority_queued_behind_it() -> None:
    pool = IOPool(1)
    started, gate, ran = threading.Event(), threading.Event(), []

    def hold() -> None:
        started.set()
        gate.wait()

    pool.submit(Priority.BACKGROUND, hold)
    assert started.wait(5)  # NOTE: the only worker is now held
    assert pool.submit_many(Priority.SAVE, [lambda i=i: ran.append(f"save{i}") for i in range(3)])
    assert pool.submit(Priority.PREFETCH, lambda: ran.append("prefetch"))
    gate.set()
    assert pool.shutdown(timeout=5)
    assert ran == ["prefetch", "save0", "save1", "save2"]


def test_every_worker_takes_part_in_one_batch() -> None:
    pool = IOPool(3)
    barrier = threading.Barrier(3, timeout=5)
    names: set[str] = set()

    def task() -> None:
        names.add(threading.current_thread().name)
        barrier.wait()  # NOTE: passes only with three tasks running at once

    assert pool.submit_many(Priority.SAVE, [task] * 3)
    assert pool.shutdown(timeout=5)
    assert len(names) == 3


def test_a_shut_down_pool_refuses_a_batch_and_runs_none_of_it() -> None:
    pool = IOPool(2)
    assert pool.shutdown(timeout=5)
    ran: list[int] = []
    assert not pool.submit_many(Priority.SAVE, [lambda: ran.append(1)] * 2)
    assert not pool.submit(Priority.SAVE, lambda: ran.append(1))
    assert ran == []


def test_an_inline_pool_runs_a_batch_at_once_in_order() -> None:
    pool = IOPool(0)
    ran: list[int] = []
    assert pool.submit_many(Priority.SAVE, [lambda i=i: ran.append(i) for i in range(4)])
    assert ran == [0, 1, 2, 3]


def test_a_batch_racing_shutdown_is_either_run_or_refused_never_stranded() -> None:
    def submit(pool: IOPool, go: threading.Event, ran: list[int], accepted: list[bool]) -> None:
        go.wait()
        accepted.append(pool.submit_many(Priority.SAVE, [lambda: ran.append(1)] * 3))

    for _ in range(50):
        pool, go = IOPool(2), threading.Event()
        ran: list[int] = []
        accepted: list[bool] = []
        thread = threading.Thread(target=submit, args=(pool, go, ran, accepted))
        thread.start()
        go.set()
        assert pool.shutdown(timeout=5)
        thread.join(5)
        assert ran == ([1, 1, 1] if accepted == [True] else [])
