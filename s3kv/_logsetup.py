"""The ``log_level`` setting applied to the ``s3kv`` logger (a leaf: imports nothing of s3kv).

Only the ``s3kv`` logger is touched, never the root logger: the application's own logging
setup stays in charge of everything else. When nothing would print the chosen level (no
handler on ``s3kv`` or any ancestor: Python's last-resort handler shows WARNING and above
only), one stderr handler is added to ``s3kv`` so that ``debug``/``info`` reach the log.
"""

from __future__ import annotations

import logging
import threading

__all__ = ["LOGGER_NAME", "apply_log_level"]

#: The logger every s3kv module logs below.
LOGGER_NAME = "s3kv"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_lock = threading.Lock()


class _S3KVHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The stderr handler :func:`apply_log_level` adds (recognised so it is added once)."""


def apply_log_level(level: str) -> None:
    """Set the ``s3kv`` logger to ``level`` (a lower-case ``logging`` level name).

    ``""`` leaves the logger alone (its level and handlers are the application's).

    Raises:
        ValueError: ``level`` is not a ``logging`` level name.
    """
    if not level:
        return
    number = logging.getLevelName(level.upper())
    if not isinstance(number, int):
        raise ValueError(f"log_level: unknown level {level!r}")
    logger = logging.getLogger(LOGGER_NAME)
    with _lock:
        logger.setLevel(number)
        if not logger.hasHandlers():
            handler = _S3KVHandler()
            handler.setFormatter(logging.Formatter(_FORMAT))
            logger.addHandler(handler)
