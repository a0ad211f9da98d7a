"""Rank and collectives as the connector sees them.

Under TensorRT-LLM these are ``tensorrt_llm._utils.mpi_rank/mpi_broadcast/mpi_allgather``;
s3kv's emulated runtime installs its own (torch.distributed over gloo) with
:func:`install_collectives`; otherwise the process is a single rank.
"""

from __future__ import annotations

from typing import Any, Protocol

from s3kv.connector.api import trtllm_utils


class Collectives(Protocol):
    """The three things the connector needs from the runtime's process group."""

    @property
    def rank(self) -> int:
        """This process's rank (0 hosts the scheduler)."""
        ...

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        ...

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        """Return ``obj`` from ``root`` on every rank (a collective: all ranks must call)."""
        ...

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (a collective: all ranks must call)."""
        ...


class SingleProcess:
    """One rank: broadcast is the identity, allgather a one-element list."""

    rank = 0
    world_size = 1

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]


class TrtllmMpi:  # pragma: no cover - needs tensorrt_llm
    """TensorRT-LLM's MPI helpers."""

    def __init__(self, utils: Any) -> None:
        self._utils = utils

    @property
    def rank(self) -> int:
        return int(self._utils.mpi_rank())

    @property
    def world_size(self) -> int:
        return int(self._utils.mpi_world_size())

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        return self._utils.mpi_broadcast(obj, root=root)

    def allgather(self, obj: Any) -> list[Any]:
        return list(self._utils.mpi_allgather(obj))


_installed: Collectives | None = None


def install_collectives(collectives: Collectives | None) -> None:
    """Use ``collectives`` for this process (the emulated runtime calls this per rank)."""
    global _installed  # noqa: PLW0603 - one per-process setting, set by the runtime
    _installed = collectives


def get_collectives() -> Collectives:
    """The installed collectives, else TensorRT-LLM's MPI, else a single process."""
    if _installed is not None:
        return _installed
    utils = trtllm_utils()
    if utils is None:
        return SingleProcess()
    return TrtllmMpi(utils)  # pragma: no cover - needs tensorrt_llm


__all__ = [
    "Collectives",
    "SingleProcess",
    "TrtllmMpi",
    "get_collectives",
    "install_collectives",
]
