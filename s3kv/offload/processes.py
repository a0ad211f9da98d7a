"""The store's side of its codec processes: start them, hand them jobs, deliver outcomes.

Why processes: a block's codec work is C calls separated by Python glue, and the glue needs
the one GIL of the engine's process. With 8 codec threads the engine's own thread (the
forward loop) and the codec threads queue for it: decoding scaled 3.1× at 8 threads where
the same code in 8 processes scaled 7.6×, and a decode step slowed by 40-300% while a
prompt's blocks were being encoded (``benchmarks/results/``). A codec process does the GET
or PUT too, so block bytes never pass through the engine's process: it reads and writes
slots of shared memory (:class:`~s3kv.arena.SlabArena`) the store's process maps too.

Costs here, per block: a share of one item of a message (:meth:`CodecProcesses.submit_batch`,
from any thread; a batch of saves is one :class:`~s3kv.offload.jobs.SaveJobs` per process),
a share of one pickled message each way, and its share of one callback on the
reader thread. Jobs and outcomes are batched per message; outcomes travel column by column
(:class:`~s3kv.offload.jobs.Outcomes`), so a message unpickles as a few lists, not an object
per job. One reader thread serves every process: each time it wakes it reads one message
from every process that has one, and the outcomes of a batch submitted together
(:meth:`CodecProcesses.submit_batch`) reach their callback together, once per wake-up. So
the busier the processes, the more outcomes the engine's interpreter handles per pass, and
no thread per process competes for its GIL.

Safety: a slot given to a job is written (or read) by that job's process until its outcome
arrives, so the caller must not reuse it before. When a process dies, its outstanding jobs
fail only once it has exited: a slot is never handed back while a process could still write
it. No job ever waits on a timer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing import connection
from multiprocessing.connection import Connection

from s3kv.auth import Keyring
from s3kv.config import CODEC_THREADS_PER_PROCESS, S3KVConfig
from s3kv.offload import affinity
from s3kv.offload.jobs import Failure, Job, Outcome, Outcomes, SaveJobs

logger = logging.getLogger(__name__)

#: Allocations up to this size stay in a codec process's heap when freed (glibc).
_MALLOC_THRESHOLD = 64 * 1024 * 1024

#: Seconds :meth:`CodecProcesses.close` gives a process to exit after its socket closes.
_EXIT_GRACE = 5.0

#: Called with some of a batch's jobs each time: their indices in the batch, and their
#: outcomes in the same order.
BatchDone = Callable[[Sequence[int], Outcomes], None]
#: Who waits for a job: its batch's callback and the job's index in the batch.
_Waiter = tuple[BatchDone, int]


@dataclass(eq=False)
class _Child:
    index: int
    process: subprocess.Popen[bytes]
    conn: Connection
    sock: socket.socket
    alive: bool = True
    ready: bool = False  # NOTE: set up (bucket client open); jobs go to ready ones first
    outbox: list[tuple[int, Job | SaveJobs]] = field(default_factory=list)
    pending: dict[int, _Waiter] = field(default_factory=dict)


def _pin(pids: Sequence[int], cpus: frozenset[int]) -> None:
    """Pin each process to ``cpus``, at once after its start (before its threads exist, so
    they inherit it); where that is refused, say so once and leave them as they are."""
    for pid in pids:
        refused = affinity.apply(pid, cpus)
        if refused is not None:
            logger.warning(
                "s3kv: %s: %s; the codec processes keep the engine's CPUs",
                affinity.SETTING,
                refused,
            )
            return


class CodecProcesses:
    """``processes`` codec processes, each with ``threads`` requests in flight at most and
    its codec work on at most :data:`~s3kv.config.CODEC_THREADS_PER_PROCESS` threads
    (:mod:`s3kv.offload.child` says why the two are apart).

    Args:
        config: Settings; each process opens its own bucket client from them.
        processes: How many processes (>= 1).
        threads: GETs and PUTs each process makes at once (its request threads).
        keyring: Block keys, handed to the processes over their private sockets.
        cpus: The CPUs the processes may run on (:mod:`s3kv.offload.affinity`); None keeps
            the mask they inherit from this process.
        name: Prefix of the threads here.

    Starting does not wait for the processes: jobs submitted meanwhile wait in their socket.
    A process that fails its setup or dies is logged once and not replaced; its outstanding
    jobs fail (as requests, kind ``codec``) once it has exited; :meth:`submit` then returns
    ``False`` when no process is left, and the store does the work itself.
    """

    def __init__(
        self,
        config: S3KVConfig,
        *,
        processes: int,
        threads: int,
        keyring: Keyring | None = None,
        cpus: frozenset[int] | None = None,
        name: str = "s3kv-codec",
    ) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # the sender: jobs to send, or closing
        self._changed = threading.Condition(self._lock)  # a process set up, drained or died
        self._next_id = 0  # NOTE: job ids, under the lock
        self._closing = False
        #: Requests each process makes at once, and threads it decodes and encodes on.
        self.threads = max(1, threads)
        self.codec_threads = min(self.threads, CODEC_THREADS_PER_PROCESS)
        secrets = dict(keyring.secrets) if keyring is not None else {}
        setup = (
            config,
            secrets,
            keyring.sealing_id if keyring is not None else "",
            keyring.accept_unsigned if keyring is not None else False,
            self.threads,
            self.codec_threads,
        )
        self._children = [self._spawn(i) for i in range(max(1, processes))]
        if cpus is not None:
            _pin([child.process.pid for child in self._children], cpus)
        # NOTE: sent after the pinning: a process starts its threads only once it has its
        # setup, so every one of them inherits the mask.
        message = pickle.dumps(setup, pickle.HIGHEST_PROTOCOL)
        for child in self._children:
            with contextlib.suppress(OSError):  # NOTE: the reader sees it died
                child.conn.send_bytes(message)
        self._funerals: list[threading.Thread] = []  # NOTE: each waits for a process's exit
        self._reader = threading.Thread(target=self._read_loop, name=f"{name}-read", daemon=True)
        self._reader.start()
        self._sender = threading.Thread(target=self._send_loop, name=f"{name}-send", daemon=True)
        self._sender.start()

    @staticmethod
    def _spawn(index: int) -> _Child:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # NOTE: the child imports s3kv from wherever this process did (a source tree too):
        # that folder first, then this process's path ('' is its working directory). Not
        # from its own working directory, which ``-m`` would put first (Python >= 3.11;
        # the child drops the variable again): an s3kv checkout of another version there
        # would speak another protocol.
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([here, *(p or os.getcwd() for p in sys.path)])
        env["PYTHONSAFEPATH"] = "1"
        # NOTE: glibc serves each GET's body (over its 128 KiB mmap threshold) from fresh
        # pages and unmaps them on free: ~250 page faults per block in the process. Kept in
        # its heap instead, the next block reuses them (1.5x staging per process measured).
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(_MALLOC_THRESHOLD))
        env.setdefault("MALLOC_TRIM_THRESHOLD_", str(4 * _MALLOC_THRESHOLD))
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "s3kv.offload.child", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
                close_fds=True,
            )
        finally:
            theirs.close()
        # NOTE: the connection reads and writes a duplicate; the socket itself stays here so
        # close() can shut its sending side, which ends the process's input.
        conn = Connection(os.dup(ours.fileno()))
        return _Child(index, process, conn, ours)

    # --- queries ---

    @property
    def alive(self) -> int:
        """Processes still working."""
        with self._lock:
            return sum(child.alive for child in self._children)

    @property
    def outstanding(self) -> int:
        """Jobs submitted whose outcome has not been delivered yet."""
        with self._lock:
            return sum(len(child.pending) for child in self._children)

    @property
    def pids(self) -> list[int]:
        """Process ids of the live processes."""
        with self._lock:
            return [child.process.pid for child in self._children if child.alive]

    def wait_ready(self, timeout: float) -> int:
        """Wait up to ``timeout`` for every live process to be set up; how many are ready."""
        with self._lock:
            self._changed.wait_for(
                lambda: all(c.ready or not c.alive for c in self._children), timeout=timeout
            )
            return sum(c.ready and c.alive for c in self._children)

    def _takers(self) -> list[_Child]:
        """Live processes that take new jobs: the set-up ones, or all while none is yet."""
        live = [child for child in self._children if child.alive]
        return [child for child in live if child.ready] or live

    # --- jobs ---

    def submit_batch(self, jobs: Sequence[Job] | SaveJobs, done: BatchDone) -> bool:
        """Queue ``jobs``, spread over the live processes: one lock, one wake-up.

        A :class:`~s3kv.offload.jobs.SaveJobs` goes as one item per process (a contiguous
        share of its rows), the cheap form for a prompt's saves.

        ``done(indices, outcomes)`` runs with indices into ``jobs`` and their outcomes, row by
        row, on the reader thread (or, for a process that died, the thread that saw it exit;
        so two calls for one batch may run at once, each with other indices): every job's
        outcome is in exactly one call, and a call holds all of them that arrived together
        (so, usually, many). All or nothing: ``False`` (``done`` never called) when closing
        or no process is alive. ``done`` must not raise nor call :meth:`close`.
        """
        with self._lock:
            live = sorted(self._takers(), key=lambda c: len(c.pending))
            if self._closing or not live:
                return False
            if isinstance(jobs, SaveJobs):
                # NOTE: a contiguous share of rows per process, one item each; its jobs'
                # ids are consecutive from the item's (the process numbers them so).
                count, shares = len(jobs), min(len(live), len(jobs))
                for k, child in enumerate(live[:shares]):
                    start, stop = k * count // shares, (k + 1) * count // shares
                    first = self._next_id
                    self._next_id += stop - start
                    child.pending.update(
                        (first + row, (done, start + row)) for row in range(stop - start)
                    )
                    child.outbox.append((first, jobs.rows(start, stop)))
            else:
                for i, job in enumerate(jobs):
                    child = live[i % len(live)]
                    child.pending[self._next_id] = (done, i)
                    child.outbox.append((self._next_id, job))
                    self._next_id += 1
            self._wake.notify()
        return True

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                self._wake.wait_for(lambda: self._closing or any(c.outbox for c in self._children))
                batches = [(c, c.outbox) for c in self._children if c.outbox]
                for child, _ in batches:
                    child.outbox = []
                if self._closing and not batches:
                    return
            for child, batch in batches:
                try:
                    child.conn.send_bytes(pickle.dumps(batch, pickle.HIGHEST_PROTOCOL))
                except OSError:
                    # NOTE: the reader sees the end too; _died fails what is outstanding.
                    logger.debug("s3kv: codec process %d: send failed", child.index)

    def _read_loop(self) -> None:
        """Read every process's messages until none is left; deliver per wake-up."""
        live = {child.conn: child for child in self._children}
        while live:
            # NOTE: only _died closes a connection, after it has left ``live``
            ready = connection.wait(list(live))
            arrived: list[tuple[Outcomes, list[_Waiter | None]]] = []
            for conn in ready:
                child = live[conn]  # type: ignore[index]
                ended = self._read_one(child, arrived)
                if ended is not None:
                    del live[child.conn]
                    self._bury(child, ended)
            # NOTE: one pass of callbacks and one notification per wake-up, however many
            # messages arrived: this thread shares the engine's interpreter.
            if arrived:
                _deliver_all(
                    Outcomes.joined([o for o, _ in arrived]), [w for _, ws in arrived for w in ws]
                )
            with self._lock:
                self._changed.notify_all()

    def _read_one(
        self, child: _Child, arrived: list[tuple[Outcomes, list[_Waiter | None]]]
    ) -> str | None:
        """Read one message of ``child``: its outcomes and their waiters go to ``arrived``.
        Returns why the process ended when it did, else None."""
        try:
            message = pickle.loads(child.conn.recv_bytes())
            if isinstance(message, tuple) and message[:1] == ("setup_failed",):
                return f"failed to start: {message[1]}"
            if isinstance(message, tuple) and message[:1] == ("ready",):
                with self._lock:
                    child.ready = True
                return None
            if not isinstance(message, Outcomes) or not message.well_formed():
                raise TypeError(f"not outcomes: {type(message).__name__}")
        except (EOFError, OSError):
            return "exited"
        except Exception as exc:  # NOTE: one garbled process must not stop the reader
            return f"sent an unreadable message ({type(exc).__name__}: {exc})"
        with self._lock:
            pop = child.pending.pop
            waiters = [pop(job_id, None) for job_id in message.job_id]
        arrived.append((message, waiters))
        return None

    def _bury(self, child: _Child, reason: str) -> None:
        """Stop giving ``child`` jobs now; fail its outstanding ones once it has exited (on a
        thread of its own: the reader serves the others meanwhile)."""
        with self._lock:
            child.alive = False
            funeral = threading.Thread(
                target=self._died, args=(child, reason), name="s3kv-codec-exit", daemon=True
            )
            self._funerals.append(funeral)
        funeral.start()

    def _died(self, child: _Child, reason: str) -> None:
        with self._lock:
            closing = self._closing
        # NOTE: only once the process is gone may its slots be handed back.
        if child.process.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(_EXIT_GRACE if closing else 0.0)
            if child.process.poll() is None:
                child.process.kill()
                child.process.wait()
        with self._lock:
            orphans, child.pending = child.pending, {}
            child.outbox = []
            self._changed.notify_all()
        if not closing or orphans:
            logger.warning(
                "s3kv: codec process %d (pid %d) %s (exit code %s); %d job(s) failed, %d "
                "process(es) left",
                child.index,
                child.process.pid,
                reason,
                child.process.returncode,
                len(orphans),
                self.alive,
            )
        failure = Failure("StorageError", f"codec process {reason}", "codec")
        _deliver_all(
            Outcomes.of(Outcome(i, False, 0.0, failure, False, 0, None) for i in orphans),
            list(orphans.values()),
        )
        child.conn.close()
        child.sock.close()

    # --- lifecycle ---

    def close(self, timeout: float = 30.0) -> bool:
        """Wait up to ``timeout`` for outstanding jobs, then stop every process.

        Jobs still outstanding then fail (once their process has exited). Returns ``True``
        when nothing was outstanding at the end. Idempotent.
        """
        with self._lock:
            drained = self._changed.wait_for(
                lambda: all(not c.pending for c in self._children), timeout=timeout
            )
            self._closing = True
            self._wake.notify_all()
        self._sender.join(timeout=_EXIT_GRACE)
        for child in self._children:
            with contextlib.suppress(OSError):  # NOTE: the process exits on end of input
                child.sock.shutdown(socket.SHUT_WR)
        self._reader.join(_EXIT_GRACE * 2)
        with self._lock:
            funerals = list(self._funerals)
        for funeral in funerals:
            funeral.join(_EXIT_GRACE * 2)  # NOTE: _died waits for the exit, then kills
        return drained


def _deliver_all(outcomes: Outcomes, waiters: Sequence[_Waiter | None]) -> None:
    """Each batch's callback once, with the rows of ``outcomes`` that are its jobs'
    (``waiters[i]`` waits for row ``i``; None: nobody does any more)."""
    batches: dict[int, tuple[BatchDone, list[int], list[int]]] = {}
    for row, waiter in enumerate(waiters):
        if waiter is None:
            continue
        done, index = waiter
        batch = batches.get(id(done))
        if batch is None:  # NOTE: not setdefault: it would build a tuple for every outcome
            batch = batches[id(done)] = (done, [], [])
        batch[1].append(index)
        batch[2].append(row)
    for done, indices, rows in batches.values():
        # NOTE: one batch's whole message (the usual case) is passed as it came
        _call(done, indices, outcomes if len(rows) == len(outcomes) else outcomes.take(rows))


def _call(done: BatchDone, indices: Sequence[int], outcomes: Outcomes) -> None:
    try:
        done(indices, outcomes)
    except Exception:  # NOTE: a failing callback must not stop the reader
        logger.exception("s3kv: handling a codec process's outcome failed")


__all__ = ["CodecProcesses"]
