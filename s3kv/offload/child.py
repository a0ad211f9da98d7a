"""A codec process: ``python -m s3kv.offload.child FD``, started by :class:`CodecProcesses`.

It reads pickled lists of ``(job_id, job)`` from the socket ``FD`` (a
:class:`~s3kv.offload.jobs.SaveJobs` item holds several jobs, numbered from ``job_id`` on),
runs them on its own threads (its own interpreter, its own GIL, its own bucket client) and
writes back pickled :class:`~s3kv.offload.jobs.Outcomes`, as many as are ready per message.

The first message is the setup: ``(config, secrets, sealing_id, accept_unsigned, threads)``.
Then it answers ``("ready",)``, or ``("setup_failed", line)`` and exits.

It exits when the socket closes (its store closed, or its process died) — at once: a
job still running then has nobody left to answer and nothing of it is needed.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import queue
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from s3kv.arena import SlabArena
from s3kv.auth import Keyring
from s3kv.config import S3KVConfig
from s3kv.offload import work
from s3kv.offload.jobs import Failure, FetchJob, Job, Outcome, Outcomes, SaveJobs
from s3kv.storage import Backend, open_backend

#: How long the sender lets a fetch's outcome wait for others (far below a GET's time).
_COALESCE_S = 0.0005
#: How long, and up to how many, save outcomes gather before they are sent, unless the
#: process has no job left (then they go at once). Nothing waits on a save's outcome but its
#: buffer's return to the pool and its key's record; every message costs the store's process
#: a wake-up and a pass of bookkeeping on the engine's interpreter. Sent every 20 ms or 64,
#: a cold 8K prompt's outcomes took an H200 engine's reader 6.3-10.8 ms of CPU in 18-22
#: messages; at the end of each process's share (4 messages), 2.1-3.1 ms.
_SAVE_COALESCE_S = 0.1
_SAVE_BATCH = 256


class _Arenas:
    """The store's arenas, mapped on first use (by path)."""

    def __init__(self) -> None:
        self._mapped: dict[str, SlabArena] = {}
        self._lock = threading.Lock()

    def get(self, path: str, slot_bytes: int) -> SlabArena:
        with self._lock:
            arena = self._mapped.get(path)
            if arena is None:
                arena = SlabArena.attach(path, slot_bytes)
                self._mapped[path] = arena
            return arena


class _Replies:
    """Outcomes waiting to be sent; one sender thread coalesces them into messages."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._ready: list[Outcome] = []
        self._urgent = False
        self._busy = 0  # NOTE: jobs received whose outcome is not queued yet
        self._cond = threading.Condition()

    def expect(self, count: int) -> None:
        """``count`` more jobs were received (each will :meth:`put` one outcome)."""
        with self._cond:
            self._busy += count

    def put(self, outcome: Outcome, *, urgent: bool) -> None:
        """Queue ``outcome``; ``urgent`` (a fetch: a request may wait for it) sends it soon."""
        with self._cond:
            self._ready.append(outcome)
            self._busy -= 1
            self._urgent = self._urgent or urgent
            self._cond.notify()

    def run(self) -> None:
        # NOTE: outcomes that finish together go in one message: the store's process pays a
        # wake-up and two reads per message, on the engine's interpreter. Fetches wait at
        # most _COALESCE_S; saves (nobody waits on them) until no job is left, or up to
        # _SAVE_COALESCE_S.
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._ready))
                if not self._urgent:
                    self._cond.wait_for(
                        lambda: self._urgent or len(self._ready) >= _SAVE_BATCH or self._busy <= 0,
                        timeout=_SAVE_COALESCE_S,
                    )
            if self._urgent:
                time.sleep(_COALESCE_S)
            with self._cond:
                batch, self._ready, self._urgent = self._ready, [], False
            try:
                message = pickle.dumps(Outcomes.of(batch), pickle.HIGHEST_PROTOCOL)
                self._conn.send_bytes(message)
            except OSError:
                os._exit(0)  # NOTE: the store is gone; nobody needs the rest


def _crash_outcome(job_id: int, job: Job, exc: BaseException) -> Outcome:
    """An unexpected error in a job: reported as a request failure, never silent."""
    failure = Failure("StorageError", f"codec process: {type(exc).__name__}: {exc}", "codec")
    return Outcome(job_id, False, 0.0, failure, False, 0, None)


def _worker(
    jobs: queue.SimpleQueue[tuple[int, Job]],
    replies: _Replies,
    backend: Backend,
    arenas: _Arenas,
    keyring: Keyring | None,
) -> None:
    while True:
        job_id, job = jobs.get()
        try:
            arena = arenas.get(job.arena, job.slot_bytes)
            if isinstance(job, FetchJob):
                outcome = work.fetch(job_id, job, backend, arena, keyring)
            else:
                outcome = work.save(job_id, job, backend, arena, keyring)
        except Exception as exc:  # NOTE: one broken job must not stop the others
            outcome = _crash_outcome(job_id, job, exc)
        replies.put(outcome, urgent=isinstance(job, FetchJob))


def _setup(message: Any) -> tuple[Backend, Keyring | None, int]:
    config, secrets, sealing_id, accept_unsigned, threads = message
    if not isinstance(config, S3KVConfig):
        raise TypeError("the first message is not a setup")
    keyring = Keyring(dict(secrets), sealing_id, accept_unsigned) if secrets else None
    # NOTE: opened without I/O: "auto" would probe the bucket here, and a process started
    # while the bucket is down (a degraded start) would fail for good. The store's probe
    # decides instead: each SaveJob says whether to PUT conditionally (if_absent).
    config = dataclasses.replace(config, conditional_put="on")
    return open_backend(config), keyring, int(threads)


def main(fd: int) -> None:
    # NOTE: set for this process's own start only (see CodecProcesses._spawn); a process it
    # starts (e.g. a credential_process helper) imports as usual.
    os.environ.pop("PYTHONSAFEPATH", None)
    conn = Connection(fd)
    try:
        backend, keyring, threads = _setup(pickle.loads(conn.recv_bytes()))
    except EOFError:
        return
    except Exception as exc:  # NOTE: reported to the store, which logs one line
        conn.send_bytes(pickle.dumps(("setup_failed", f"{type(exc).__name__}: {exc}")))
        return
    conn.send_bytes(pickle.dumps(("ready",)))
    jobs: queue.SimpleQueue[tuple[int, Job]] = queue.SimpleQueue()
    replies = _Replies(conn)
    arenas = _Arenas()
    threading.Thread(target=replies.run, name="s3kv-codec-send", daemon=True).start()
    for i in range(max(1, threads)):
        threading.Thread(
            target=_worker,
            args=(jobs, replies, backend, arenas, keyring),
            name=f"s3kv-codec-{i}",
            daemon=True,
        ).start()
    while True:
        try:
            batch = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)  # NOTE: daemon threads may be mid-request: leave without waiting
        replies.expect(sum(len(job) if isinstance(job, SaveJobs) else 1 for _, job in batch))
        for first, job in batch:
            if isinstance(job, SaveJobs):  # NOTE: many saves in one item; ids follow on
                for row, save in enumerate(job.jobs()):
                    jobs.put((first + row, save))
            else:
                jobs.put((first, job))


__all__ = ["main"]

if __name__ == "__main__":
    main(int(sys.argv[1]))
