"""Shared host memory for tensor-parallel staging: one process stages, every rank reads.

Under tensor parallelism every rank holds its own shard of each KV block, so a block may be
claimed only when *every* shard is staged. The scheduler lives on rank 0 only, so rank 0
stages all shards, each into a :class:`SlabArena`: anonymous shared memory (``memfd``) cut
into fixed-size slots (all blocks of one shard have the same size). The metadata carries,
per load, the slot index of each rank's shard; each worker maps the arena read-only and
copies its slot into its own GPU block. The slot stays pinned in rank 0's staging until every
rank has published, on the completion board, that its copy has completed.

The memory has no name in any filesystem: other ranks open it through rank 0's file
descriptor (``/proc/<pid>/fd/<fd>``), and the kernel frees it when the last process holding
it exits — also when rank 0 is killed, so nothing can leak into ``/dev/shm``. Pages are
allocated as they are first written, not up front.

Where CUDA is available every process's mapping — the owner's and each reader's — is
registered as page-locked (``cudaHostRegister``), so host→GPU copies on every rank are
asynchronous and run at full PCIe/NVLink-C2C speed. Asynchronous means the slot must not be
recycled when the copy is enqueued but only once it has completed: see
:mod:`s3kv.connector.completion`.

This works for all ranks of one node. Ranks on other nodes cannot map rank 0's memory; see
the connector README for the multi-node design.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from typing import Any

import numpy as np

from s3kv.errors import ConfigError
from s3kv.staging import HostBuffer

logger = logging.getLogger(__name__)

#: Linux's MADV_POPULATE_WRITE (5.14+), absent from older Pythons' ``mmap`` module.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _register_pinned(view: memoryview) -> bool:
    """Page-lock ``view`` for CUDA in *this process's* mapping; True on success.

    Page-locking is per mapping: rank 0 registering its mapping does nothing for the other
    ranks' mappings of the same memory, whose copies would otherwise be synchronous copies
    from pageable memory. Every process that copies from an arena registers its own.
    """
    import sys

    torch: Any = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return False
    array = np.frombuffer(view, dtype=np.uint8)
    try:
        result = torch.cuda.cudart().cudaHostRegister(array.ctypes.data, array.nbytes, 0)
    except (RuntimeError, AttributeError) as exc:  # pragma: no cover - needs CUDA
        logger.warning("s3kv: cannot pin the staging arena: %s", exc)
        return False
    if int(result) != 0:  # pragma: no cover - needs CUDA
        logger.warning(
            "s3kv: cudaHostRegister of the staging arena failed (error %s); host→GPU "
            "loads will be synchronous",
            int(result),
        )
        return False
    return True  # pragma: no cover - needs CUDA


def _unregister_pinned(address: int) -> None:
    import sys

    torch: Any = sys.modules.get("torch")
    if torch is None:
        return
    try:  # pragma: no cover - needs CUDA
        torch.cuda.cudart().cudaHostUnregister(address)
    except (RuntimeError, AttributeError):  # pragma: no cover - needs CUDA
        logger.debug("s3kv: cudaHostUnregister failed", exc_info=True)


class SlabArena:
    """Fixed-size slots in one shared-memory region; a :class:`~s3kv.staging.HostAllocator`.

    Args:
        path: Where other processes open the region (``/proc/<pid>/fd/<fd>`` of the owner).
        fd: The region's file descriptor, in this process.
        slot_bytes: Size of every slot (one block shard).
        slots: Number of slots.
        owner: True in the creating process (the only writer).
    """

    def __init__(self, path: str, fd: int, slot_bytes: int, slots: int, *, owner: bool) -> None:
        self.path = path
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.owner = owner
        self._fd = fd
        # NOTE: readers map it writable too: cudaHostRegister needs a writable mapping (its
        # read-only flag is not supported everywhere). Only the owner ever writes.
        self._mmap = mmap.mmap(fd, slot_bytes * slots, access=mmap.ACCESS_WRITE)
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        self._base: int = self._array.__array_interface__["data"][0]
        self.pinned = _register_pinned(memoryview(self._mmap))
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()

    @classmethod
    def create(cls, slot_bytes: int, budget_bytes: int, *, tag: str = "") -> SlabArena:
        """A new region with as many slots as fit in ``budget_bytes`` (at least one).

        Raises:
            ConfigError: the region cannot be created (no ``memfd_create``, or memory limits):
                names the setting to lower.
        """
        slots = max(1, budget_bytes // slot_bytes)
        try:
            fd = os.memfd_create(f"s3kv-staging-{tag}", os.MFD_CLOEXEC)
            os.ftruncate(fd, slot_bytes * slots)
        except (OSError, AttributeError) as exc:
            raise ConfigError(
                f"staging_bytes: cannot create {slot_bytes * slots} bytes of shared memory "
                f"({exc}); lower TLLM_S3KV_STAGING_BYTES"
            ) from exc
        return cls(f"/proc/{os.getpid()}/fd/{fd}", fd, slot_bytes, slots, owner=True)

    @classmethod
    def attach(cls, path: str, slot_bytes: int) -> SlabArena:
        """Map a region created by another process of this host (page-locked under CUDA)."""
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        size = os.fstat(fd).st_size
        return cls(path, fd, slot_bytes, size // slot_bytes, owner=False)

    # --- HostAllocator ---

    def allocate(self, nbytes: int) -> HostBuffer:
        """A free slot as a writable view; ``nbytes`` must equal :attr:`slot_bytes`.

        Raises:
            MemoryError: no free slot (the staging budget should prevent this).
            ValueError: wrong size.
        """
        if nbytes != self.slot_bytes:
            raise ValueError(f"arena slots hold {self.slot_bytes} bytes, asked for {nbytes}")
        with self._lock:
            if not self._free:
                raise MemoryError("staging arena has no free slot")
            slot = self._free.pop()
        return self.view(slot)

    def free(self, buffer: HostBuffer) -> None:
        """Return the slot behind ``buffer``."""
        with self._lock:
            self._free.append(self.slot_of(buffer))

    # --- addressing ---

    def slot_of(self, buffer: HostBuffer) -> int:
        """The slot index of a view returned by :meth:`allocate`/:meth:`view`.

        Raises:
            ValueError: ``buffer`` is not exactly one slot of this arena.
        """
        slot = self.slot_at(buffer)
        if slot is None:
            raise ValueError("buffer is not a slot of this arena")
        return slot

    def slot_at(self, buffer: HostBuffer) -> int | None:
        """The slot ``buffer`` is exactly (a whole slot, from its start, contiguous), else ``None``.

        Cheap (no exception, no ctypes): the store asks it for every block it saves.
        """
        offset = int(buffer.__array_interface__["data"][0]) - self._base
        if (
            not buffer.flags.c_contiguous  # NOTE: a strided view orders the bytes otherwise
            or buffer.nbytes != self.slot_bytes
            or offset % self.slot_bytes
            or not 0 <= offset < self.slot_bytes * self.slots
        ):
            return None
        return offset // self.slot_bytes

    def populate(self) -> None:
        """Back every page now (``MADV_POPULATE_WRITE``, else one write per page).

        Registering the arena with CUDA does this already; without CUDA the first write to
        each page faults it in, and processes filling slots of one region at once contend on
        its page allocation. Benchmarks call this to measure the steady state.
        """
        try:
            self._mmap.madvise(_MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            pages = self._array[:: mmap.PAGESIZE]
            pages[:] = pages  # NOTE: a write per page faults it in; the bytes are unchanged

    def view(self, slot: int) -> HostBuffer:
        """The bytes of ``slot``."""
        start = slot * self.slot_bytes
        return self._array[start : start + self.slot_bytes]

    def span(self, slot: int, count: int) -> HostBuffer:
        """The bytes of ``count`` consecutive slots from ``slot`` (one view of them all).

        Raises:
            ValueError: the run does not lie within the arena.
        """
        if count < 1 or not 0 <= slot <= self.slots - count:
            raise ValueError(f"slots {slot}..{slot + count - 1} are not within the arena")
        start = slot * self.slot_bytes
        return self._array[start : start + count * self.slot_bytes]

    def close(self) -> None:
        """Unmap and close; the memory is freed once no process holds it any more."""
        if self.pinned:
            _unregister_pinned(self._array.ctypes.data)
            self.pinned = False
        del self._array
        try:
            self._mmap.close()
        except BufferError:  # views still exported; the OS unmaps at exit
            logger.debug("s3kv: arena %s still has live views at close", self.path)
        os.close(self._fd)


__all__ = [
    "SlabArena",
]
