"""Small process and port helpers for :mod:`s3kv.testing.local_s3` (Linux first, POSIX fallback).

Everything here acts on one given pid or port; nothing searches for processes by name.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

LOOPBACK = "127.0.0.1"


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct TCP ports that were free on ``host`` a moment ago."""
    # NOTE: all sockets stay open until every port is chosen, so the ports are distinct.
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def port_open(port: int, host: str = LOOPBACK) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (a zombie has already exited)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The state follows the parenthesised command name, which may contain spaces.
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:  # no procfs (macOS): fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def cmdline(pid: int) -> list[bytes] | None:
    """The argv of ``pid`` from procfs, or ``None`` where procfs is unavailable."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None


def interrupt_then_kill(pid: int, grace: float, *, kill_wait: float = 10.0) -> bool:
    """SIGINT ``pid`` (not necessarily our child), wait ``grace`` s, then SIGKILL it.

    Returns:
        ``True`` once the process is gone, ``False`` if it survived SIGKILL for
        ``kill_wait`` seconds.
    """
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGKILL, kill_wait)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not alive(pid):
            return True
    return False


def parent_death_signal() -> Callable[[], None]:
    """A ``preexec_fn`` asking Linux to SIGKILL the child when its parent *thread* exits."""
    # NOTE: resolved in the parent so that the forked child only makes one libc call.
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)

    return preexec
