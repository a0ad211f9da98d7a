"""Run a function on several tensor-parallel ranks, one new process each.

:func:`spawn_ranks` starts ``world_size`` new processes (see :func:`_rank_context`), joins
them into a ``torch.distributed`` default group (gloo on loopback by default) and returns
what ``fn`` returned on each rank. A rank that raises, dies, or outlives the timeout fails
the whole call, and the other ranks are terminated: a rank left waiting in a collective for
a dead peer would otherwise hang forever.
"""

from __future__ import annotations

import atexit
import datetime
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, NamedTuple, TypeVar

import torch.multiprocessing as mp
from torch import distributed as dist

T = TypeVar("T")

#: Seconds to wait for the other ranks' reports once one rank has failed.
_FAILURE_GRACE_S = 5.0


class RankError(RuntimeError):
    """A rank raised or died; the message carries its traceback text when there is one."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, then close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def spawn_ranks(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    backend: str = "gloo",
    threads_per_rank: int | None = None,
) -> list[T]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks.

    Each rank runs ``torch.distributed.init_process_group(backend, init_method=
    "tcp://127.0.0.1:PORT")`` before ``fn``, so ``fn`` may use the default group
    (``process_group=None``), and destroys it afterwards. With ``backend="nccl"`` rank ``r``
    first selects CUDA device ``r``.

    Args:
        fn: A module-level (picklable by reference) function. Its return value travels back
            by ``pickle``: return CPU tensors or plain data.
        world_size: Number of ranks, >= 1.
        *args: Passed to ``fn`` after ``rank, world_size``; must be picklable.
        timeout: Seconds for the whole call, including process start-up (~2 s for torch).
        backend: ``torch.distributed`` backend.
        threads_per_rank: ``torch.set_num_threads`` in each rank; ``None`` divides the
            machine's cores among the ranks so that they do not oversubscribe them.

    Returns:
        ``fn``'s return value for rank 0, 1, ... in rank order.

    Raises:
        RankError: A rank raised (its traceback is in the message) or exited without a result.
        TimeoutError: Not every rank answered within ``timeout``.
        ValueError: ``world_size < 1``.
    """
    if world_size < 1:
        raise ValueError(f"world_size: must be >= 1, got {world_size}")
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // world_size)
    ctx = _rank_context(world_size, backend)
    port = free_port()
    # NOTE: a fork server's children inherit *its* environment and CPUs, taken when it
    # started; each rank gets the caller's, as a spawned process would. (Its directory and
    # import path multiprocessing already sends with every process it starts.)
    setting = _Setting(dict(os.environ), _cpus())
    # NOTE: one pipe per rank rather than a shared queue: the parent can then block on
    # "a result or a process exit" with connection.wait, without polling.
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                rank,
                world_size,
                port,
                backend,
                threads_per_rank,
                timeout,
                fn,
                args,
                send,
                setting,
            ),
            name=f"s3kv-tp-rank{rank}",
            daemon=True,
        )
        for rank, (_, send) in enumerate(pipes)
    ]
    for proc in procs:
        proc.start()
    for _, send in pipes:
        send.close()  # NOTE: only the child holds the write end, so its exit reads as EOF
    grace = 0.0
    try:
        results = _collect([recv for recv, _ in pipes], procs, timeout)
        grace = _EXIT_GRACE_S  # NOTE: every rank answered: let them run their exit handlers
        return results
    finally:
        for proc in procs:
            proc.join(grace)
            if proc.is_alive():
                proc.terminate()
            proc.join()
        for recv, _ in pipes:
            recv.close()


#: Modules the fork server imports once, so that a rank starts in milliseconds instead of the
#: ~3 s (two cores) that importing torch and the emulator takes in every spawned process.
_PRELOAD = ("torch", "torch.distributed", "s3kv.testing.emulator.instance")

#: Seconds ranks that have answered get to finish their exit handlers before being stopped.
_EXIT_GRACE_S = 30.0


class _Setting(NamedTuple):
    """What a rank takes from its caller before anything else (see :func:`_rank_context`)."""

    environ: dict[str, str]
    cpus: set[int] | None


def _cpus() -> set[int] | None:
    getter = getattr(os, "sched_getaffinity", None)
    return set(getter(0)) if getter is not None else None


def _rank_context(world_size: int, backend: str) -> Any:
    """How ranks start: a fork server for one CPU rank, ``spawn`` otherwise.

    One rank (an engine instance, most end-to-end runs) starts from a ``forkserver`` whose
    heavy imports are done once. It is still a new process that shares no state with its
    caller: the server is a fresh interpreter that has only imported modules (no CUDA context,
    no connector state) when it forks the rank; the rank then takes the caller's environment
    and CPUs (:class:`_Setting`; multiprocessing sends the directory and import path; resource
    limits, umask and standard streams stay the server's). NOTE: not ``fork`` from the
    caller, which may hold threads, locks, a CUDA context or a test's state.

    Several ranks are spawned, each its own interpreter, as an MPI launcher starts ranks:
    forked ranks would share the server's string-hash seed, so a rank-dependent iteration
    order (sets of keys before a collective) could never show in a test. CUDA ranks (nccl)
    are spawned too, so that no import in a server can ever hold a CUDA context they inherit.
    """
    if world_size > 1 or backend != "gloo":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def _collect(conns: list[Connection], procs: list[Any], timeout: float) -> list[Any]:
    results: dict[int, Any] = {}
    failures: list[tuple[float, int, str]] = []  # (when, rank, what)
    pending = dict(enumerate(conns))
    deadline = time.monotonic() + timeout
    in_grace = False
    while pending:
        remaining = deadline - time.monotonic()
        ready = wait(list(pending.values()), timeout=max(0.0, remaining))
        if not ready:
            if failures:
                break  # the grace period for secondary failures is over
            raise TimeoutError(f"ranks {sorted(pending)} did not finish within {timeout} s")
        for rank, conn in list(pending.items()):
            if conn not in ready:
                continue
            del pending[rank]
            try:
                status, when, payload = pickle.loads(conn.recv_bytes())
            except EOFError:
                procs[rank].join()
                status, when = "error", time.time()
                payload = f"exited with code {procs[rank].exitcode} without a result"
            if status == "ok":
                results[rank] = payload
            else:
                failures.append((when, rank, payload))
        if failures and not in_grace:
            # NOTE: one failing rank usually makes its peers fail in their next collective
            # ("connection closed by peer"). Give them a moment to report, then name the
            # rank that failed first, whose traceback is the cause.
            deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
            in_grace = True
    if failures:
        failures.sort()
        _, rank, what = failures[0]
        others = "".join(f"\n\nrank {r} also failed:\n{w}" for _, r, w in failures[1:])
        raise RankError(f"rank {rank} failed:\n{what}{others}")
    return [results[rank] for rank in range(len(conns))]


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    threads: int,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    conn: Connection,
    setting: _Setting,
) -> None:
    try:
        _take(setting)
        import torch

        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        result = fn(rank, world_size, *args)
        payload = pickle.dumps(("ok", time.time(), result))
    except BaseException:
        # NOTE: BaseException too: a KeyboardInterrupt or SystemExit in fn must still reach
        # the parent as a failure rather than as a silent exit. The report goes out before
        # the group is torn down, so its timestamp precedes the peers' consequent failures.
        payload = pickle.dumps(("error", time.time(), traceback.format_exc()))
    try:
        conn.send_bytes(payload)
        conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        # NOTE: a fork server's child leaves through os._exit; run the exit handlers (the
        # connector drains its saves and flushes its manifest there) as an exiting
        # interpreter does. They run once: the list is empty afterwards.
        atexit._run_exitfuncs()


def _take(setting: _Setting) -> None:
    """The caller's environment and CPUs, in this rank."""
    os.environ.clear()
    os.environ.update(setting.environ)
    setter = getattr(os, "sched_setaffinity", None)
    if setting.cpus is not None and setter is not None:
        setter(0, setting.cpus)


__all__ = ["RankError", "free_port", "spawn_ranks"]
