"""Which CPUs the codec processes run on (``codec_cpus``).

A child process inherits its parent's CPU affinity. Launchers often pin each engine rank to
one core or a few (``taskset``, ``numactl``, ``mpirun --bind-to core``, Kubernetes' static
CPU manager); codec processes that inherit such a mask share the engine's own cores, and a
launch-bound decode step then ran 2.7-6.6x slower while blocks were encoded beside it (H100
host, ``benchmarks/results/``). So by default (``auto``) the processes keep the engine's
mask only where it leaves room for them, and otherwise go to the CPUs outside it.

Values of the setting:

* ``auto`` — the engine's mask when it holds at least ``processes + 2`` CPUs (the kernel
  spreads everything); otherwise the CPUs outside it that the process may use (its cgroup's
  cpuset, else the online CPUs), and where there are none, the engine's mask with one
  WARNING that the codec will slow the engine.
* ``inherit`` — the engine's mask, whatever it is.
* a CPU list such as ``8-15`` or ``4,5,12-15`` — exactly those CPUs (they must be available
  to the process).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from s3kv.config import parse_cpu_list
from s3kv.errors import ConfigError

logger = logging.getLogger(__name__)

SETTING = "codec_cpus"
#: Free CPUs the engine keeps beside its codec processes before ``auto`` moves them away:
#: its forward loop and its own helper threads.
ENGINE_ROOM = 2
_ONLINE = Path("/sys/devices/system/cpu/online")
_CGROUP = Path("/sys/fs/cgroup")


def format_cpus(cpus: frozenset[int]) -> str:
    """``cpus`` as a CPU list (``0-3,8``), the form the setting takes."""
    runs: list[str] = []
    ordered = sorted(cpus)
    start = prev = ordered[0] if ordered else 0
    for cpu in [*ordered[1:], -2]:
        if cpu != prev + 1:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            start = cpu
        prev = cpu
    return ",".join(runs) if ordered else ""


def online_cpus() -> frozenset[int]:
    """The host's online CPUs (sysfs), or ``0..cpu_count-1`` where sysfs does not say."""
    try:
        return parse_cpu_list(_ONLINE.read_text().strip())
    except (OSError, ValueError):
        return frozenset(range(os.cpu_count() or 1))


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may be given: its cgroup's cpuset (cgroup v2, as containers
    and Kubernetes' CPU manager set it), else the host's online CPUs."""
    online = online_cpus()
    try:
        text = read_cgroup("cpuset.cpus.effective")
        allowed = parse_cpu_list(text.strip()) & online
    except (OSError, ValueError):
        return online
    return allowed or online


def read_cgroup(name: str) -> str:
    """The text of this process's cgroup (v2) file ``name``.

    Raises:
        OSError: no cgroup v2 hierarchy, or no such file in the process's cgroup.
    """
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    paths = [line.split(":", 2)[2] for line in lines if line.startswith("0::")]
    if not paths:
        raise FileNotFoundError("no cgroup v2 entry in /proc/self/cgroup")
    return (_CGROUP / paths[0].strip().lstrip("/") / name).read_text()


@dataclass(frozen=True)
class Placement:
    """Where the codec processes go: ``cpus`` (None: inherit ``engine``, the engine's mask)
    and why."""

    cpus: frozenset[int] | None
    reason: str
    engine: frozenset[int]


def choose_cpus(
    setting: str,
    processes: int,
    *,
    engine: frozenset[int] | None = None,
    available: frozenset[int] | None = None,
) -> Placement:
    """The placement ``setting`` gives ``processes`` codec processes beside the engine.

    ``engine`` is the engine process's CPU mask (default: this process's), ``available`` the
    CPUs it may be given (default: :func:`allowed_cpus`). Pure apart from those defaults.

    Raises:
        ConfigError: ``codec_cpus`` names CPUs this process cannot be given (one line).
    """
    engine = frozenset(os.sched_getaffinity(0)) if engine is None else engine
    available = allowed_cpus() if available is None else available
    if setting == "inherit":
        return Placement(None, "inherit: the engine's CPUs", engine)
    if setting != "auto":
        try:
            wanted = parse_cpu_list(setting)
        except ValueError as exc:
            raise ConfigError(f"{SETTING}: {exc}") from None
        missing = wanted - available
        if missing:
            raise ConfigError(
                f"{SETTING}: CPUs {format_cpus(missing)} are not available to this process "
                f"(available: {format_cpus(available)}); name CPUs from that list, or auto"
            )
        return Placement(wanted, f"CPUs {format_cpus(wanted)} as set", engine)
    if len(engine) >= processes + ENGINE_ROOM:
        return Placement(None, f"auto: the engine's {len(engine)} CPUs leave room", engine)
    others = available - engine
    if others:
        return Placement(
            others,
            f"auto: the engine is pinned to CPUs {format_cpus(engine)}; the codec runs on "
            f"CPUs {format_cpus(others)} (set {SETTING} to choose)",
            engine,
        )
    return Placement(None, f"auto: no CPU outside the engine's {format_cpus(engine)}", engine)


def crowds_engine(placement: Placement, processes: int) -> bool:
    """Whether ``placement`` leaves the codec sharing too few CPUs with the engine."""
    engine = placement.engine
    cpus = engine if placement.cpus is None else placement.cpus
    return len(cpus | engine) < processes + ENGINE_ROOM and bool(cpus & engine)


def apply(pid: int, cpus: frozenset[int]) -> str | None:
    """Pin process ``pid`` to ``cpus``; None, or the one-line reason it could not be done.

    A container's cpuset can forbid CPUs this host has online (EINVAL): the caller says so
    once and lets the process keep the mask it inherited.
    """
    try:
        os.sched_setaffinity(pid, cpus)
    except OSError as exc:
        return f"cannot pin to CPUs {format_cpus(cpus)}: {exc.strerror or exc}"
    return None


def log_placement(placement: Placement, processes: int) -> None:
    """One line on where the codec processes run: a WARNING where they crowd the engine."""
    if crowds_engine(placement, processes):
        logger.warning(
            "s3kv: %s: %d codec processes share CPUs %s with the engine (%s); they will slow "
            "its forward loop: give them other CPUs with %s, or lower codec_processes",
            SETTING,
            processes,
            format_cpus(placement.engine),
            placement.reason,
            SETTING,
        )
    elif placement.cpus is not None:
        logger.info("s3kv: %s: %s", SETTING, placement.reason)


__all__ = [
    "ENGINE_ROOM",
    "SETTING",
    "Placement",
    "allowed_cpus",
    "apply",
    "choose_cpus",
    "crowds_engine",
    "format_cpus",
    "log_placement",
    "online_cpus",
    "read_cgroup",
]
