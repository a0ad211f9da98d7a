"""Host-side plumbing for the shaped link: names, stale cleanup, ``tc tbf``, CPU counters.

Every name a run creates carries its pid (``s3kvwan-<pid>-<K>``, ``s3kw<pid>h``/``n``,
``/tmp/s3kvwan-<pid>-*``), so :func:`remove_stale` can delete what a run killed outright
left behind, and nothing of a live run.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

NS_PREFIX = "s3kvwan-"
LINK_PREFIX = "s3kw"
SUBNET = "10.231"
TMP_PREFIX = "s3kvwan-"
_NS_RE = re.compile(rf"^{NS_PREFIX}(\d+)-(\d+)$")
_LINK_RE = re.compile(rf"^{LINK_PREFIX}(\d+)[hn]$")
_TMP_RE = re.compile(rf"^{TMP_PREFIX}(\d+)-")


class NetShapeError(Exception):
    """The shaped path could not be built (no root, no ``ip``/``tc``, no tbf, no netns)."""


@dataclass(frozen=True)
class LinkSpec:
    """A link: bandwidth each way, round-trip time, per-connection window.

    Attributes:
        gbit: Rate in Gbit/s (10^9 bits), each direction.
        rtt_ms: Round trip added by the relay (half each way).
        window: Bytes a connection may have in flight per direction over one RTT.
        queue: Bytes the link's queue holds each way before it drops (tbf's limit, at least
            50 ms at the rate). TCP Small Queues lets each connection put up to 4 MB in it.
    """

    gbit: float
    rtt_ms: float
    window: int = 6 * 1024 * 1024
    queue: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.gbit <= 0 or self.rtt_ms < 0 or self.window < 64 * 1024:
            raise NetShapeError(
                f"link: need gbit > 0, rtt_ms >= 0, window >= 64 KiB; got {self.gbit} Gbit/s, "
                f"{self.rtt_ms} ms, {self.window} B"
            )

    @property
    def bytes_per_s(self) -> float:
        return self.gbit * 1e9 / 8


def run(*argv: str) -> str:
    """Run a plumbing command; one-line NetShapeError naming it on failure."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except FileNotFoundError as exc:
        raise NetShapeError(f"{argv[0]} not found: install iproute2") from exc
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or ["no message"])[0]
        raise NetShapeError(f"`{' '.join(argv)}` failed: {first}")
    return done.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete namespaces, veths and data directories of runs whose creating pid is gone."""
    removed = []
    for line in run("ip", "netns", "list").splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NS_RE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            with contextlib.suppress(NetShapeError):
                run("ip", "netns", "del", name)
                removed.append(name)
    for line in run("ip", "-o", "link", "show").splitlines():
        parts = line.split(":")
        name = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        match = _LINK_RE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            with contextlib.suppress(NetShapeError):
                run("ip", "link", "del", name)
                removed.append(name)
    for path in Path(tempfile.gettempdir()).glob(f"{TMP_PREFIX}*"):
        match = _TMP_RE.match(path.name)
        if match and path.is_dir() and not _pid_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


def free_subnet() -> int:
    """A third octet K with no 10.231.K.* address on this host."""
    used = set(re.findall(rf"inet {re.escape(SUBNET)}\.(\d+)\.", run("ip", "-o", "addr")))
    for k in [(os.getpid() + i) % 256 for i in range(256)]:
        if str(k) not in used:
            return k
    raise NetShapeError(f"every {SUBNET}.K.0/30 subnet is in use: remove stale namespaces")


def tbf(link: LinkSpec) -> list[str]:
    rate = link.bytes_per_s
    # NOTE: the bucket must hold a timer tick's worth of bytes (4 ms covers HZ=250) and a
    # 64 KiB GSO packet, or tbf cannot reach the rate. The queue is deep so that it
    # drops rarely (see the package docstring); TCP Small Queues (4 MB per socket here)
    # bounds what each connection puts in it, so 16 busy connections fill 64 MiB.
    burst = int(max(rate * 0.004, 256 * 1024))
    limit = int(max(rate * 0.050, link.queue)) + burst
    return ["tbf", "rate", f"{int(link.gbit * 1e9)}bit", "burst", str(burst), "limit", str(limit)]


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on the host's 127.0.0.1 a moment ago."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of all cores from /proc/stat, for machine utilisation."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    total = sum(fields[:8])
    return total - idle, total


def sigterm_as_exit() -> None:
    """Make SIGTERM raise SystemExit in the main thread, so ``finally``/``with`` clean up."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def die_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
