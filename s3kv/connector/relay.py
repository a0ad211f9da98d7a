"""The write relay: how the other TP ranks' writes reach rank 0's shared manifest.

Under tensor parallelism each rank saves its own shard of every block, from its own process,
while the layout's one manifest (:mod:`s3kv.manifest.shards`) lives in rank 0's process and
advertises a block only once *every* shard is written. So rank 0 must hear of each other
rank's writes. :class:`WriteRelay` is the channel: one ring per rank in anonymous shared
memory that rank 0 creates (``memfd``; the other ranks open it through
``/proc/<pid>/fd/<fd>``, like the completion board and the staging arenas: one host only,
which the connector already requires).

* A rank > 0's store gets a :class:`RelayedManifest` instead of a manifest: each written
  block (key, parent, stored size) becomes one report in that rank's ring. The worker
  attaches it to rank 0's relay the first time the metadata names it (saves carry it).
* Rank 0 drains the rings into the shared manifest: a :class:`RelayPump` thread every
  ``interval`` seconds (there is no cross-process wake-up, so it polls shared memory), and
  once more at close.
* Shutdown: a rank's store drains its saves, then :meth:`RelayedManifest.close` marks its
  ring finished; rank 0's pump waits (bounded) for every ring that was attached to finish
  before the manifest's last flush, so an instance's last saves are advertised too.

Bounds and failure policy: a ring holds ``capacity`` reports; a report that finds it full is
dropped and counted (``relay_dropped``), and so is one made before the attach. A lost report
costs one more save of that block later (its other shards wait, bounded, in rank 0's
pending masks), never wrong data. A ``flock`` on the shared file orders the rings' updates
between processes (a full barrier on weakly ordered CPUs too); a lock orders threads.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from s3kv._logonce import LogOnce
from s3kv.errors import ConfigError
from s3kv.keys import HASH_BYTES, BlockHash

logger = logging.getLogger(__name__)

#: Reports one rank's ring holds (40 bytes each: 640 KiB per rank).
DEFAULT_CAPACITY: Final = 16_384

_MAGIC: Final = 0x7333_6B76_7265_6C31  # "s3kvrel1"
_RECORD: Final = np.dtype([("key", "u1", (HASH_BYTES,)), ("parent", "u1", (HASH_BYTES,)),
                           ("size", "<i8")])  # fmt: skip
# Per-rank control cells: head (the rank writes), tail (rank 0 writes), state, dropped.
_HEAD, _TAIL, _STATE, _DROPPED = range(4)
_ATTACHED, _FINISHED = 1, 2

#: A report as rank 0 receives it: (rank, key, parent, stored size).
Sink = Callable[[int, BlockHash, BlockHash, int], None]


class WriteRelay:
    """Per rank, a ring of write reports in shared memory; rank 0 creates and drains it.

    Layout: ``int64[4]`` header (magic, world size, capacity, 0), ``int64[world, 4]``
    control cells, then ``world × capacity`` records. Use :meth:`create` / :meth:`attach`.
    """

    def __init__(self, fd: int, path: str) -> None:
        self.path = path
        self._fd = fd
        self._mmap = mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_WRITE)
        header = np.frombuffer(self._mmap, dtype=np.int64, count=4)
        if int(header[0]) != _MAGIC:
            raise ValueError(f"{path} is not an s3kv write relay")
        self.world_size, self.capacity = int(header[1]), int(header[2])
        offset = header.nbytes
        self._cells = np.frombuffer(
            self._mmap, dtype=np.int64, count=4 * self.world_size, offset=offset
        ).reshape(self.world_size, 4)
        offset += self._cells.nbytes
        self._rings = np.frombuffer(
            self._mmap, dtype=_RECORD, count=self.world_size * self.capacity, offset=offset
        ).reshape(self.world_size, self.capacity)
        self._lock = threading.Lock()

    @classmethod
    def create(cls, world_size: int, capacity: int = DEFAULT_CAPACITY) -> WriteRelay:
        """A new relay for ``world_size`` ranks (rank 0's process).

        Raises:
            ConfigError: the shared memory cannot be created (as the staging arenas say).
        """
        size = 8 * 4 + 8 * 4 * world_size + _RECORD.itemsize * world_size * capacity
        try:
            fd = os.memfd_create("s3kv-relay", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        except (OSError, AttributeError) as exc:
            raise ConfigError(
                f"tp: cannot create the {size}-byte write relay in shared memory ({exc}); "
                "s3kv needs memfd_create for tensor parallelism"
            ) from exc
        with mmap.mmap(fd, 8 * 4, access=mmap.ACCESS_WRITE) as region:
            region[:] = np.array([_MAGIC, world_size, capacity, 0], dtype=np.int64).tobytes()
        return cls(fd, f"/proc/{os.getpid()}/fd/{fd}")

    @classmethod
    def attach(cls, path: str) -> WriteRelay:
        """Open a relay that :meth:`create` made in another process (or this one).

        Raises:
            OSError: the path cannot be opened (rank 0 is gone, another host).
            ValueError: the file is not a relay.
        """
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            return cls(fd, path)
        except BaseException:
            os.close(fd)
            raise

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # NOTE: flock excludes other *open file descriptions*, i.e. other processes (each
        # opens its own); the thread lock excludes this process's other threads.
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    # --- a rank > 0 ------------------------------------------------------------------------

    def join(self, rank: int) -> None:
        """Mark ``rank``'s ring as in use: rank 0 waits for it to :meth:`finish` at close."""
        with self._locked():
            self._cells[rank, _STATE] = _ATTACHED

    def report(self, rank: int, key: bytes, parent: bytes, size: int) -> bool:
        """Queue one write report of ``rank``; False (and counted) if its ring is full."""
        with self._locked():
            cells = self._cells[rank]
            head = int(cells[_HEAD])
            if head - int(cells[_TAIL]) >= self.capacity:
                cells[_DROPPED] += 1
                return False
            record = self._rings[rank, head % self.capacity]
            record["key"] = np.frombuffer(key, dtype=np.uint8)
            record["parent"] = np.frombuffer(parent, dtype=np.uint8)
            record["size"] = size
            cells[_HEAD] = head + 1
            return True

    def finish(self, rank: int) -> None:
        """``rank`` will report nothing more (its store is closed)."""
        with self._locked():
            self._cells[rank, _STATE] |= _FINISHED

    # --- rank 0 ----------------------------------------------------------------------------

    def drain(self, rank: int) -> list[tuple[bytes, bytes, int]]:
        """Take every report waiting in ``rank``'s ring, oldest first."""
        with self._locked():
            cells = self._cells[rank]
            tail, head = int(cells[_TAIL]), int(cells[_HEAD])
            out = []
            for seq in range(tail, head):
                record = self._rings[rank, seq % self.capacity]
                out.append((record["key"].tobytes(), record["parent"].tobytes(),
                            int(record["size"])))  # fmt: skip
            cells[_TAIL] = head
            return out

    def unfinished(self) -> list[int]:
        """Ranks that joined and have not finished."""
        with self._locked():
            states = self._cells[:, _STATE].copy()
        return [rank for rank, state in enumerate(states) if state == _ATTACHED]

    def dropped(self) -> int:
        """Reports dropped on full rings, over every rank."""
        return int(self._cells[:, _DROPPED].sum())

    def close(self) -> None:
        """Unmap and close this process's handle (idempotent)."""
        if self._fd < 0:
            return
        # NOTE: drop the numpy views first: an mmap with exported buffers cannot close.
        del self._cells, self._rings
        self._mmap.close()
        os.close(self._fd)
        self._fd = -1


class RelayedManifest:
    """The manifest of a rank > 0's store under TP: writes go to rank 0, nothing else does.

    The scheduler on rank 0 decides what to save, against the layout's shared manifest, so
    this rank admits every planned save (:meth:`may_contain` is always False): a block
    planned again because some shard was missing is PUT again (conditionally where the
    server supports it) and reported again, which also heals a lost report. Hits and pins
    are recorded by rank 0. Thread-safe; a :class:`~s3kv.store.ManifestLike`.

    Args:
        rank: This rank (> 0).
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._relay: WriteRelay | None = None
        self._failed = ""  # a relay path that could not be opened (not retried)
        self._lock = threading.Lock()
        self._reports = 0
        self._dropped = 0
        self._closed = False
        self._log_once = LogOnce(logger)

    def attach(self, path: str) -> None:
        """Report to the relay at ``path`` from now on (idempotent; failures are logged)."""
        with self._lock:
            if self._relay is not None and self._relay.path == path:
                return
            # NOTE: this runs in the forward-pass hook: a path that failed is not retried.
            if self._closed or path == self._failed:
                return
            try:
                relay = WriteRelay.attach(path)
                relay.join(self.rank)
            except (OSError, ValueError) as exc:
                self._failed = path
                self._log_once("attach", "s3kv: cannot open the write relay %s: %s", path, exc)
                return
            if self._relay is not None:
                self._relay.finish(self.rank)
                self._relay.close()
            self._relay = relay

    def may_contain(self, key: bytes) -> bool:
        """Always False: rank 0 decides what is saved."""
        return False

    def count_leading(self, keys: Sequence[bytes]) -> int:
        """Always 0 (this rank never claims)."""
        return 0

    def contains_many(self, keys: Sequence[bytes]) -> npt.NDArray[np.bool_]:
        """All False, as :meth:`may_contain`."""
        return np.zeros(len(keys), dtype=bool)

    def record_write(self, key: BlockHash, parent: BlockHash, size: int) -> None:
        """Report the write to rank 0 (dropped and counted if not attached or full)."""
        with self._lock:
            relay = self._relay
            if relay is not None and relay.report(self.rank, bytes(key), bytes(parent), size):
                self._reports += 1
                return
            self._dropped += 1
        self._log_once("dropped", "s3kv: a write report to rank 0 was dropped (counted)")

    def record_writes(self, writes: Sequence[tuple[BlockHash, BlockHash, int]]) -> None:
        """:meth:`record_write` of each ``(key, parent, size)``."""
        for key, parent, size in writes:
            self.record_write(key, parent, size)

    def record_hits(self, keys: Sequence[BlockHash]) -> None:
        """Nothing: rank 0 records hits."""

    def flush(self) -> int:
        """Nothing to flush (reports are in shared memory at once); 0."""
        return 0

    def close(self, flush: bool = True, timeout: float | None = None) -> None:
        """Mark this rank's ring finished and unmap it (idempotent)."""
        with self._lock:
            relay, self._relay, self._closed = self._relay, None, True
        if relay is not None:
            relay.finish(self.rank)
            relay.close()

    def stats(self) -> dict[str, float]:
        """``relay_reports`` (writes reported) and ``relay_dropped`` (lost before rank 0)."""
        with self._lock:
            return {"relay_reports": float(self._reports), "relay_dropped": float(self._dropped)}


class RelayPump:
    """Rank 0: drains every rank's ring into ``sink`` in a background thread.

    Args:
        relay: The relay rank 0 created.
        sink: Receives each report as ``(rank, key, parent, size)``.
        interval: Seconds between drains.
    """

    def __init__(self, relay: WriteRelay, sink: Sink, interval: float) -> None:
        self.relay = relay
        self._sink = sink
        self._interval = max(0.01, interval)
        self._stop = threading.Event()
        self._drain_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="s3kv-relay", daemon=True)
        self._closed = False
        self._log_once = LogOnce(logger)

    def start(self) -> None:
        """Begin draining in the background."""
        self._thread.start()

    def pump(self) -> int:
        """Drain every ring once into the sink; the reports delivered."""
        delivered = 0
        with self._drain_lock:
            if self._closed:
                return 0
            for rank in range(1, self.relay.world_size):
                for key, parent, size in self.relay.drain(rank):
                    try:
                        self._sink(rank, BlockHash(key), BlockHash(parent), size)
                    except ValueError as exc:  # a malformed report: never into the loop
                        self._log_once("sink", "s3kv: dropping a write report: %s", exc)
                        continue
                    delivered += 1
        return delivered

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            # NOTE: this thread must outlive any bug in one round, or writes of the other
            # ranks would silently stop being advertised.
            try:
                self.pump()
            except Exception:
                logger.exception("s3kv: draining the write relay failed")

    def close(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for every joined rank to finish, drain, stop (idempotent).

        Returns:
            True if every joined rank finished in time.
        """
        with self._drain_lock:
            if self._closed:
                return True
        deadline = time.monotonic() + max(0.0, timeout)
        while self.relay.unfinished() and time.monotonic() < deadline:
            self.pump()
            time.sleep(min(self._interval, max(0.0, deadline - time.monotonic())))
        done = not self.relay.unfinished()
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=max(1.0, self._interval * 4))
        self.pump()
        with self._drain_lock:
            if not self._closed:
                self._closed = True
                self.relay.close()
        if not done:
            logger.warning("s3kv: closing before every rank reported its last writes")
        return done


__all__ = [
    "DEFAULT_CAPACITY",
    "RelayPump",
    "RelayedManifest",
    "Sink",
    "WriteRelay",
]
