"""How many codec processes ``codec_processes = auto`` runs: the connector's choice per store.

Why processes by default on a GPU host: with the codec in the engine's I/O threads, the
engine's forward loop shares one GIL with them. On an H200 host SmolLM2's decode steps took
7.25 ms while a cold 8K prompt's blocks were saved, against 3.08 ms without the connector;
with 4 codec processes they cost 0.25-0.79 % more (``gpu_2026-11-29-native-kernel.jsonl``).

The rule, per store of one GPU rank:

* The KV cache is not on a GPU (the CPU emulator, tests, tools): 0, the I/O threads.
* ``share``: the CPUs this process may use divided by the GPU ranks that share them. The CPUs
  are its cgroup's cpuset (else the host's online CPUs), bounded by the cgroup's CPU quota
  where that is lower (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``; a Kubernetes CPU limit). The
  ranks are the launcher's count of ranks on this host, at least the TP size; where neither a
  cpuset nor a quota narrows the host (every engine process here shares its CPUs), at least
  the host's GPUs too, so independent engines (one server per GPU) do not each size from
  the whole host.
* ``per rank = min(4, share // 4)``: one process per 4 CPUs of the rank's share (the engine's
  threads keep the rest), at most 4, the number measured above; 0 where the share is under 4.
* Per store: ``per rank // stores``, at least 1 where ``per rank`` is; rank 0 under tensor
  parallelism opens one store per shard (so with TP above 4 it runs one per shard).

So the processes that size from the same CPUs run at most half of them: a rank at most a
quarter of its share, and rank 0 at most one per shard (shards <= ranks <= CPUs / 4).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

from s3kv.config import S3KVConfig
from s3kv.offload.affinity import allowed_cpus, online_cpus, read_cgroup

__all__ = [
    "AutoChoice",
    "CpuBudget",
    "auto_here",
    "auto_processes",
    "cpu_budget",
    "host_gpus",
    "local_ranks",
    "resolve_codec_processes",
]

logger = logging.getLogger(__name__)

#: Processes per GPU rank at most (the number measured on an H200 host, see the module doc).
MAX_PER_RANK = 4
#: CPUs of a rank's share per codec process.
CPUS_PER_PROCESS = 4
#: Launchers' variables for the ranks on this host (torchrun, Open MPI, MPICH/Hydra, Slurm).
_LOCAL_RANKS_ENV = (
    "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
    "SLURM_NTASKS_PER_NODE",
)
#: Where cgroup v1 mounts its cpu controller; one folder per GPU the NVIDIA driver knows.
_CGROUP_V1 = Path("/sys/fs/cgroup")
_NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


@dataclass(frozen=True)
class AutoChoice:
    """What ``auto`` chose: ``processes`` per store, and why (one phrase, for the log)."""

    processes: int
    reason: str


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may use (``cpus``), and whether they are the whole host's
    (``whole_host``: no cpuset or quota narrows them, so every process here shares them)."""

    cpus: int
    whole_host: bool


def cpu_budget() -> CpuBudget:
    """CPUs this process may use: its cgroup's cpuset (else the online CPUs), bounded by the
    cgroup's CPU quota rounded down, at least 1."""
    allowed = allowed_cpus()
    cpus = len(allowed)
    quota = _cpu_quota()
    if quota is not None and quota < cpus:
        cpus = max(1, math.floor(quota))
    return CpuBudget(max(1, cpus), cpus >= len(online_cpus()))


def _cpu_quota() -> float | None:
    """CPUs' worth of the cgroup's CPU quota (v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us``
    where the cpu controller is mounted), or None where there is none."""
    try:
        quota, _, period = read_cgroup("cpu.max").partition(" ")
        if quota.strip() == "max":
            return None
        return _ratio(quota, period)
    except OSError:
        pass
    for controller in ("cpu,cpuacct", "cpu"):
        folder = _CGROUP_V1 / controller
        try:
            quota = (folder / "cpu.cfs_quota_us").read_text()
            period = (folder / "cpu.cfs_period_us").read_text()
        except OSError:
            continue
        return _ratio(quota, period)
    return None


def _ratio(quota: str, period: str) -> float | None:
    """``quota / period`` where both are positive integers (-1 is v1's "no limit")."""
    try:
        numerator, denominator = int(quota), int(period)
    except ValueError:
        return None
    return numerator / denominator if numerator > 0 and denominator > 0 else None


def host_gpus() -> int:
    """NVIDIA GPUs on this host by the driver (``/proc/driver/nvidia/gpus``; 0 where absent),
    whatever ``CUDA_VISIBLE_DEVICES`` shows this process."""
    try:
        return len(os.listdir(_NVIDIA_GPUS))
    except OSError:
        return 0


def local_ranks(tp_size: int) -> int:
    """GPU ranks on this host: the launcher's count where it sets one, at least ``tp_size``
    (s3kv's tensor-parallel ranks share one host)."""
    counts = [tp_size]
    for name in _LOCAL_RANKS_ENV:
        text = os.environ.get(name, "").strip()
        if text.isascii() and text.isdigit():
            counts.append(int(text))
    return max(1, *counts)


def auto_processes(*, on_gpu: bool, stores: int, ranks: int, cpus: int) -> AutoChoice:
    """Codec processes per store for ``codec_processes = auto`` (the rule in the module doc).

    Args:
        on_gpu: The KV cache is on a GPU.
        stores: Stores this process opens (rank 0 under tensor parallelism: one per shard).
        ranks: GPU ranks on this host.
        cpus: CPUs this process may use (:func:`cpu_budget`).
    """
    if not on_gpu:
        return AutoChoice(0, "the KV cache is not on a GPU")
    share = cpus // max(1, ranks)
    per_rank = min(MAX_PER_RANK, share // CPUS_PER_PROCESS)
    where = f"{cpus} CPUs for {ranks} GPU rank{'s' if ranks != 1 else ''} on this host"
    if per_rank == 0:
        return AutoChoice(0, f"{where} leave fewer than {CPUS_PER_PROCESS} per process")
    per_store = max(1, per_rank // max(1, stores))
    each = f" each of {stores} stores" if stores > 1 else ""
    return AutoChoice(per_store, f"{per_store} for{each or ' its store'}: {where}")


def auto_here(*, on_gpu: bool, stores: int, tp_size: int) -> AutoChoice:
    """:func:`auto_processes` for this process: its CPUs and the ranks that share them."""
    budget = cpu_budget()
    ranks = local_ranks(tp_size)
    if budget.whole_host:
        ranks = max(ranks, host_gpus())
    return auto_processes(on_gpu=on_gpu, stores=stores, ranks=ranks, cpus=budget.cpus)


def resolve_codec_processes(
    config: S3KVConfig, *, on_gpu: bool, stores: int, tp_size: int
) -> S3KVConfig:
    """``config`` with ``codec_processes = auto`` made a number for this process's stores
    (one INFO line says what and why); any other value unchanged."""
    if config.codec_processes != "auto":
        return config
    choice = auto_here(on_gpu=on_gpu, stores=stores, tp_size=tp_size)
    logger.info("s3kv: codec_processes auto: %d (%s)", choice.processes, choice.reason)
    return config.replace(codec_processes=choice.processes)
