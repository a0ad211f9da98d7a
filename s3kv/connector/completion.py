"""The completion board: which loads have *completed* on every rank.

The scheduler (rank 0) pins the staged bytes of a claim; the workers (every rank) copy them
into their pools asynchronously. Under the overlap loop the host runs ahead of the device, so
"the next scheduler step" is not proof that a copy has run: ``_executor_loop_overlap``
(``tensorrt_llm/_torch/pyexecutor/py_executor.py`` @``00043967``) builds iteration N+1's
metadata before it synchronises on iteration N, and on an H100 a recycled staging slot fed a
claimed block (``benchmarks/gpu_load_race.py``). Instead each load batch carries a sequence number
(``ConnectorMetadata.load_seq``); each worker writes, in its own cell of the board, the newest
sequence number whose copies' event has completed; the scheduler releases a batch's pins once
the minimum over all cells has reached it.

Each cell has exactly one writer and values only grow, so no lock is needed: a reader may see
an older value, which only delays a release. Under tensor parallelism the board is anonymous
shared memory (``memfd``) that the other ranks open through rank 0's file descriptor, like the
staging arenas (one host only); with one rank it is ordinary memory.
"""

from __future__ import annotations

import mmap
import os

import numpy as np


class CompletionBoard:
    """Per rank, the newest load sequence number whose device copies have completed.

    Args:
        cells: ``int64[world_size]`` backing array (zeros at creation).
        path: Where other processes open it ('' for a process-private board).
    """

    def __init__(self, cells: np.ndarray, path: str = "") -> None:
        self._cells = cells
        self.path = path
        self._keep: list[object] = []  # the mmap and fd behind a shared board

    @classmethod
    def private(cls, world_size: int = 1) -> CompletionBoard:
        """A board in this process's memory (one rank, or tests)."""
        return cls(np.zeros(world_size, dtype=np.int64))

    @classmethod
    def shared(cls, world_size: int) -> CompletionBoard:
        """A board other ranks of this host can :meth:`attach` to."""
        fd = os.memfd_create("s3kv-completion", os.MFD_CLOEXEC)
        os.ftruncate(fd, 8 * world_size)
        return cls._map(fd, f"/proc/{os.getpid()}/fd/{fd}")

    @classmethod
    def attach(cls, path: str) -> CompletionBoard:
        """Open a board created by :meth:`shared` in another process (read-write)."""
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        return cls._map(fd, path)

    @classmethod
    def _map(cls, fd: int, path: str) -> CompletionBoard:
        size = os.fstat(fd).st_size
        region = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
        board = cls(np.frombuffer(region, dtype=np.int64), path)
        board._keep = [region, fd]
        return board

    @property
    def world_size(self) -> int:
        """Number of cells."""
        return int(self._cells.shape[0])

    def publish(self, rank: int, seq: int) -> None:
        """Rank ``rank``'s loads up to ``seq`` have completed (values never go back)."""
        if seq > int(self._cells[rank]):
            self._cells[rank] = seq

    def completed(self) -> int:
        """The newest sequence number completed on every rank."""
        return int(self._cells.min())

    def published(self, rank: int) -> int:
        """What ``rank`` has published."""
        return int(self._cells[rank])


__all__ = [
    "CompletionBoard",
]
