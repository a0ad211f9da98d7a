"""Shared host memory for tensor-parallel staging: one process stages, every rank reads.

Under tensor parallelism every rank holds its own shard of each KV block, so a block may be
claimed only when *every* shard is staged. The scheduler lives on rank 0 only, so rank 0
stages all shards, each into a :class:`SlabArena`: a file in ``/dev/shm`` cut into fixed-size
slots (all blocks of one shard have the same size). The metadata carries, per load, the slot
index of each rank's shard; each worker maps the arena read-only and copies its slot into its
own GPU block. The slot stays pinned in rank 0's staging until the next scheduler step, by
which point every rank has finished the forward pass that consumed it (the executor's
``get_finished`` all-gather orders the ranks).

Where CUDA is available the mapping is registered as page-locked (``cudaHostRegister``) so
host→GPU copies are asynchronous and run at full PCIe/NVLink-C2C speed.

This works for all ranks of one node. Ranks on other nodes cannot map rank 0's memory; see
the connector README for the multi-node design.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from s3kv.errors import ConfigError
from s3kv.staging import HostBuffer

logger = logging.getLogger(__name__)

_SHM_DIR = Path("/dev/shm")


def _arena_dir() -> Path:
    return _SHM_DIR if _SHM_DIR.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def _register_pinned(view: memoryview) -> bool:
    """Page-lock ``view`` for CUDA if torch with CUDA is loaded; True on success."""
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
    return int(result) == 0  # pragma: no cover - needs CUDA


class SlabArena:
    """Fixed-size slots in one shared-memory file; a :class:`~s3kv.staging.HostAllocator`.

    Args:
        path: The backing file (in ``/dev/shm`` normally).
        slot_bytes: Size of every slot (one block shard).
        slots: Number of slots.
        owner: True in the creating process (it unlinks the file on :meth:`close`).
    """

    def __init__(self, path: Path, slot_bytes: int, slots: int, *, owner: bool) -> None:
        self.path = path
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.owner = owner
        with open(path, "r+b" if owner else "rb") as fh:
            access = mmap.ACCESS_WRITE if owner else mmap.ACCESS_READ
            self._mmap = mmap.mmap(fh.fileno(), slot_bytes * slots, access=access)
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.pinned = _register_pinned(memoryview(self._mmap)) if owner else False
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()

    @classmethod
    def create(cls, slot_bytes: int, budget_bytes: int, *, tag: str = "") -> SlabArena:
        """A new arena with as many slots as fit in ``budget_bytes`` (at least one).

        Raises:
            ConfigError: the shared-memory file cannot be created at that size (e.g. a
                container's small ``/dev/shm``): names the setting to lower.
        """
        slots = max(1, budget_bytes // slot_bytes)
        path = _arena_dir() / f"s3kv-{os.getpid()}-{tag}{uuid.uuid4().hex[:8]}"
        try:
            with open(path, "wb") as fh:
                os.posix_fallocate(fh.fileno(), 0, slot_bytes * slots)
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise ConfigError(
                f"staging_bytes: cannot allocate {slot_bytes * slots} bytes of shared memory "
                f"in {path.parent} ({exc.strerror}); lower TLLM_S3KV_STAGING_BYTES or "
                "enlarge /dev/shm (docker run --shm-size)"
            ) from exc
        return cls(path, slot_bytes, slots, owner=True)

    @classmethod
    def attach(cls, path: str, slot_bytes: int) -> SlabArena:
        """Map an arena created by another process, read-only."""
        size = os.path.getsize(path)
        return cls(Path(path), slot_bytes, size // slot_bytes, owner=False)

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
        """The slot index of a view returned by :meth:`allocate`/:meth:`view`."""
        offset = buffer.ctypes.data - self._array.ctypes.data
        if offset % self.slot_bytes or not 0 <= offset < self.slot_bytes * self.slots:
            raise ValueError("buffer is not a slot of this arena")
        return offset // self.slot_bytes

    def view(self, slot: int) -> HostBuffer:
        """The bytes of ``slot``."""
        start = slot * self.slot_bytes
        return self._array[start : start + self.slot_bytes]

    def close(self) -> None:
        """Unmap; the owner also removes the file (mappings elsewhere stay valid)."""
        if self.owner:
            self.path.unlink(missing_ok=True)
        del self._array
        try:
            self._mmap.close()
        except BufferError:  # views still exported; the OS unmaps at exit
            logger.debug("s3kv: arena %s still has live views at close", self.path)
