"""A codec process: ``python -m s3kv.offload.child FD``, started by :class:`CodecProcesses`.

It reads pickled lists of ``(job_id, job)`` from the socket ``FD`` (a
:class:`~s3kv.offload.jobs.SaveJobs` item holds several jobs, numbered from ``job_id`` on),
runs them on its own threads (its own interpreter, its own GIL, its own bucket client) and
writes back pickled :class:`~s3kv.offload.jobs.Outcomes`, as many as are ready per message.

Each job is two steps (:mod:`s3kv.offload.work`): a request and codec work. They run on two
kinds of threads: ``threads`` request threads (GET, PUT: they wait on the network) and
``codec_threads`` codec threads (decode, encode: CPU). NOTE: why: a block GET waits a round
trip at least, so a long link needs many GETs in flight (on a 10 Gbit/s link 10 ms away, 8
in all staged 610 MB/s of blocks, 32 up to 1,460), while the CPUs the codec may take from
the engine's host are few. On one kind of thread, every GET in flight was also a CPU that
could code at once.

The first message is the setup: ``(config, secrets, sealing_id, accept_unsigned, threads,
codec_threads)``. Then it answers ``("ready",)``, or ``("setup_failed", line)`` and exits.

It exits when the socket closes (its store closed, or its process died) — at once: a
job still running then has nobody left to answer and nothing of it is needed.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from s3kv.arena import SlabArena
from s3kv.auth import Keyring
from s3kv.config import S3KVConfig
from s3kv.offload import work
from s3kv.offload.jobs import Failure, FetchJob, Job, Outcome, Outcomes, SaveJob, SaveJobs
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


class _Get(NamedTuple):
    job_id: int
    job: FetchJob


class _Decode(NamedTuple):
    job_id: int
    job: FetchJob
    fetched: work.Fetched


class _Encode(NamedTuple):
    job_id: int
    job: SaveJob


class _Put(NamedTuple):
    job_id: int
    job: SaveJob
    encoded: work.Encoded


class _Steps:
    """The jobs of this process between their steps, handed to its two kinds of threads.

    Fetches go first: a load may wait on a fetch, nobody waits on a save. The codec threads
    decode before they encode. The request threads GET before they PUT, except that while
    PUTs wait, one of them is always being made (a PUT is taken when none is running and the
    last request taken was a GET): under a long run of loads saves still go on, one at a
    time, and their in-flight bytes drain.

    At most ``ahead`` fetches are between the start of their GET and the end of their
    decode, and at most ``ahead`` saves between the start of their encode and the end of
    their PUT, so neither kind runs further ahead of the other than that: the objects held
    between the steps are at most ``ahead`` each way.

    Never stuck: a decode or a PUT, which end a job, is never gated; only the steps that
    start one (a GET, an encode) wait for room. Every event below makes at most one more
    step takeable and wakes one thread of the kind that takes it, and a thread waits only
    when it found none.
    """

    def __init__(self, ahead: int) -> None:
        lock = threading.Lock()
        self._requests = threading.Condition(lock)  # a GET or a PUT may be taken
        self._codecs = threading.Condition(lock)  # a decode or an encode may be taken
        self._ahead = ahead
        self._gets: deque[_Get] = deque()
        self._puts: deque[_Put] = deque()
        self._decodes: deque[_Decode] = deque()
        self._encodes: deque[_Encode] = deque()
        self._fetching = 0  # NOTE: GETs taken whose fetch has not ended
        self._saving = 0  # NOTE: encodes taken whose save has not ended
        self._putting = 0  # NOTE: PUTs taken and not done (only picks GET or PUT first)
        self._last_get = False  # NOTE: the last request taken was a GET

    def add(self, job_id: int, job: Job) -> None:
        """A job received: a fetch starts with its GET, a save with its encode."""
        with self._requests:
            if isinstance(job, FetchJob):
                self._gets.append(_Get(job_id, job))
                self._requests.notify()
            else:
                self._encodes.append(_Encode(job_id, job))
                self._codecs.notify()

    def next_request(self) -> _Get | _Put:
        """The next request to make (waits for one)."""
        with self._requests:
            self._requests.wait_for(self._request_ready)
            put_due = bool(self._puts) and not self._putting and self._last_get
            if self._gets and self._fetching < self._ahead and not put_due:
                self._fetching += 1
                self._last_get = True
                return self._gets.popleft()
            self._putting += 1
            self._last_get = False
            return self._puts.popleft()

    def next_codec(self) -> _Decode | _Encode:
        """The next codec work to do (waits for some)."""
        with self._codecs:
            self._codecs.wait_for(self._codec_ready)
            if self._decodes:
                return self._decodes.popleft()
            self._saving += 1
            return self._encodes.popleft()

    def fetched(self, step: _Decode) -> None:
        """A GET brought its object: decode it."""
        with self._codecs:
            self._decodes.append(step)
            self._codecs.notify()

    def encoded(self, step: _Put) -> None:
        """An encode made its object: PUT it."""
        with self._requests:
            self._puts.append(step)
            self._requests.notify()

    def fetch_ended(self) -> None:
        """A fetch ended: at its GET (failed, or nothing stored) or at its decode."""
        with self._requests:
            self._fetching -= 1
            self._requests.notify()  # NOTE: room for a GET

    def save_ended(self, *, put: bool) -> None:
        """A save ended: at its encode (failed), or at its PUT (``put``)."""
        with self._codecs:
            if put:
                self._putting -= 1
            self._saving -= 1
            self._codecs.notify()  # NOTE: room for an encode

    def _request_ready(self) -> bool:
        return bool(self._puts) or (bool(self._gets) and self._fetching < self._ahead)

    def _codec_ready(self) -> bool:
        return bool(self._decodes) or (bool(self._encodes) and self._saving < self._ahead)


def _request_thread(steps: _Steps, replies: _Replies, backend: Backend) -> None:
    while True:
        step = steps.next_request()
        if isinstance(step, _Get):
            try:
                got = work.get(step.job_id, step.job, backend)
            except Exception as exc:  # NOTE: one broken job must not stop the others
                got = _crash_outcome(step.job_id, step.job, exc)
            if isinstance(got, Outcome):
                steps.fetch_ended()
                replies.put(got, urgent=True)
            else:
                steps.fetched(_Decode(step.job_id, step.job, got))
        else:
            try:
                outcome = work.put(step.job_id, step.job, step.encoded, backend)
            except Exception as exc:
                outcome = _crash_outcome(step.job_id, step.job, exc)
            steps.save_ended(put=True)
            replies.put(outcome, urgent=False)


def _codec_thread(
    steps: _Steps, replies: _Replies, arenas: _Arenas, keyring: Keyring | None
) -> None:
    while True:
        step = steps.next_codec()
        job = step.job
        if isinstance(step, _Decode):
            try:
                arena = arenas.get(job.arena, job.slot_bytes)
                outcome = work.decode(step.job_id, step.job, step.fetched, arena, keyring)
            except Exception as exc:
                outcome = _crash_outcome(step.job_id, job, exc)
            steps.fetch_ended()
            replies.put(outcome, urgent=True)
            continue
        try:
            arena = arenas.get(job.arena, job.slot_bytes)
            encoded = work.encode(step.job_id, step.job, arena, keyring)
        except Exception as exc:
            encoded = _crash_outcome(step.job_id, job, exc)
        if isinstance(encoded, Outcome):
            steps.save_ended(put=False)
            replies.put(encoded, urgent=False)
        else:
            steps.encoded(_Put(step.job_id, step.job, encoded))


#: The exit status of a process whose thread met a BaseException (EX_SOFTWARE).
_THREAD_DIED = 70


def _or_exit(loop: Callable[..., None], *args: Any) -> None:
    """Run a thread's loop, which never returns; if anything escapes it (a BaseException:
    the loops turn every Exception of a step into its job's outcome), end the process.

    NOTE: why: a dead thread leaves its job without an outcome and the steps' counts one
    too high; with 2 codec threads, two such deaths stop every decode while the store
    waits for outcomes that never come. A process that exits instead fails its jobs in the
    store once it is gone (its slots then free), and the store says so.
    """
    try:
        loop(*args)
    except BaseException:
        os._exit(_THREAD_DIED)


def _start(
    replies: _Replies,
    backend: Backend,
    keyring: Keyring | None,
    *,
    threads: int,
    codec_threads: int,
) -> _Steps:
    """Start the process's request and codec threads; jobs added to the result run."""
    steps = _Steps(ahead=threads + codec_threads)
    arenas = _Arenas()
    for i in range(threads):
        threading.Thread(
            target=_or_exit,
            args=(_request_thread, steps, replies, backend),
            name=f"s3kv-request-{i}",
            daemon=True,
        ).start()
    for i in range(codec_threads):
        threading.Thread(
            target=_or_exit,
            args=(_codec_thread, steps, replies, arenas, keyring),
            name=f"s3kv-codec-{i}",
            daemon=True,
        ).start()
    return steps


def _setup(message: Any) -> tuple[Backend, Keyring | None, int, int]:
    config, secrets, sealing_id, accept_unsigned, threads, codec_threads = message
    if not isinstance(config, S3KVConfig):
        raise TypeError("the first message is not a setup")
    keyring = Keyring(dict(secrets), sealing_id, accept_unsigned) if secrets else None
    # NOTE: opened without I/O: "auto" would probe the bucket here, and a process started
    # while the bucket is down (a degraded start) would fail for good. The store's probe
    # decides instead: each SaveJob says whether to PUT conditionally (if_absent).
    config = dataclasses.replace(config, conditional_put="on")
    return open_backend(config), keyring, max(1, int(threads)), max(1, int(codec_threads))


def main(fd: int) -> None:
    # NOTE: set for this process's own start only (see CodecProcesses._spawn); a process it
    # starts (e.g. a credential_process helper) imports as usual.
    os.environ.pop("PYTHONSAFEPATH", None)
    conn = Connection(fd)
    try:
        backend, keyring, threads, codec_threads = _setup(pickle.loads(conn.recv_bytes()))
    except EOFError:
        return
    except Exception as exc:  # NOTE: reported to the store, which logs one line
        conn.send_bytes(pickle.dumps(("setup_failed", f"{type(exc).__name__}: {exc}")))
        return
    conn.send_bytes(pickle.dumps(("ready",)))
    replies = _Replies(conn)
    threading.Thread(target=replies.run, name="s3kv-codec-send", daemon=True).start()
    steps = _start(replies, backend, keyring, threads=threads, codec_threads=codec_threads)
    while True:
        try:
            batch = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)  # NOTE: daemon threads may be mid-request: leave without waiting
        replies.expect(sum(len(job) if isinstance(job, SaveJobs) else 1 for _, job in batch))
        for first, job in batch:
            if isinstance(job, SaveJobs):  # NOTE: many saves in one item; ids follow on
                for row, save in enumerate(job.jobs()):
                    steps.add(first + row, save)
            else:
                steps.add(first, job)


__all__ = ["main"]

if __name__ == "__main__":
    main(int(sys.argv[1]))
