"""Tensor parallelism for the emulated runtime: one process per rank, gloo collectives.

TensorRT-LLM runs one executor per rank in lockstep: every rank schedules the same requests
and allocates the same block ids (each rank's pool holds its own KV heads), the connector
scheduler lives on rank 0, and its answers reach the other ranks by ``mpi_broadcast``;
``get_finished`` results are ``mpi_allgather``-ed. :func:`run_tensor_parallel` reproduces
that with :func:`s3kv.testing.emulator.tp.spawn_ranks` and installs, in every rank, a
:class:`GlooCollectives` as the process's :mod:`s3kv.connector.comm` collectives, so the
connector's own ``broadcast`` / ``allgather`` calls reach the other ranks too.

Example::

    def rank_main(rank: int, world_size: int, prompts: list[list[int]]) -> list[int]:
        model = PagedLlama.from_hf(load_hf(), tp_rank=rank, tp_size=world_size)
        executor = PyExecutorEmulator(
            TorchLlmArgs(tensor_parallel_size=world_size), model, num_blocks=64,
            connector_scheduler_cls=S3Scheduler, connector_worker_cls=S3Worker,
        )
        return [list(r.output_tokens) for r in executor.generate(prompts, 8)]

    per_rank = run_tensor_parallel(2, rank_main, prompts)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch import distributed as dist

from s3kv.connector.comm import install_collectives
from s3kv.testing.emulator.tp import spawn_ranks

T = TypeVar("T")


class GlooCollectives:
    """:class:`s3kv.connector.comm.Collectives` over a dedicated gloo process group.

    A separate group keeps the connector's object collectives off the model's all-reduce
    group, whatever backend that one uses. Creating it is a collective: every rank of the
    default group must construct one, in the same order.
    """

    def __init__(self) -> None:
        self._group = dist.new_group(backend="gloo")
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self._world_size

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        """``root``'s ``obj`` on every rank (pickled on the way, as ``mpi_broadcast``)."""
        box = [obj]
        dist.broadcast_object_list(box, src=root, group=self._group)
        return box[0]

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order."""
        out: list[Any] = [None] * self._world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out


def run_tensor_parallel(
    world_size: int, fn: Callable[..., T], *args: Any, timeout: float = 300.0
) -> list[T]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` spawned ranks with collectives.

    Each rank has a gloo default process group (for the model's all-reduces, pass
    ``process_group=None`` to :meth:`PagedLlama.from_hf`) and :class:`GlooCollectives`
    installed with :func:`s3kv.connector.comm.install_collectives` before ``fn`` runs.

    Args:
        world_size: Ranks, >= 1.
        fn: A module-level function (pickled by reference); it returns plain data.
        *args: Picklable arguments after ``rank, world_size``.
        timeout: Seconds for the whole run.

    Returns:
        ``fn``'s return value per rank, in rank order.

    Raises:
        s3kv.testing.emulator.tp.RankError: A rank raised or died (its traceback is in the message).
        TimeoutError: A rank did not finish in time.
    """
    return spawn_ranks(_rank_entry, world_size, fn, args, timeout=timeout)


def _rank_entry(rank: int, world_size: int, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    install_collectives(GlooCollectives())
    try:
        return fn(rank, world_size, *args)
    finally:
        install_collectives(None)


__all__ = ["GlooCollectives", "run_tensor_parallel"]
