"""Log a recurring failure loudly once, then quietly, per kind (a leaf: imports nothing of s3kv).

Background threads (the store's I/O pool, the manifest's flush and refresh) see the same
failure every round during an outage; a WARNING per round would bury the log. The first
failure of each kind goes out at WARNING, repeats at DEBUG; :meth:`LogOnce.rearm` makes a
kind loud again once it has recovered, so the next outage is reported too.
"""

from __future__ import annotations

import logging
import threading

__all__ = ["LogOnce"]


class LogOnce:
    """Logs the first message of each kind at WARNING, the rest at DEBUG. Thread-safe.

    Args:
        logger: Where the messages go (the caller's module logger).
    """

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, kind: str, message: str, *args: object) -> None:
        """Log ``message % args`` at WARNING the first time ``kind`` is seen, else at DEBUG."""
        with self._lock:
            first = kind not in self._seen
            self._seen.add(kind)
        self._logger.log(logging.WARNING if first else logging.DEBUG, message, *args)

    def rearm(self, prefix: str) -> None:
        """Make every kind starting with ``prefix`` log at WARNING again (it recovered)."""
        with self._lock:
            self._seen = {kind for kind in self._seen if not kind.startswith(prefix)}
