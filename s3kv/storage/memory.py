"""The in-memory backend: a dict behind a lock, for unit tests and the CPU demo."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from s3kv.storage.base import Backend, Capabilities, DeleteResult, ObjectInfo, refuse_oversized

__all__ = ["MemoryBackend"]


class MemoryBackend(Backend):
    """A thread-safe in-process backend for unit tests and the CPU demo.

    Args:
        clock: Returns seconds since the epoch; injectable so tests control ``last_modified``.
        conditional_put: Whether to declare (and honour) atomic create-if-absent.
    """

    def __init__(
        self, *, clock: Callable[[], float] = time.time, conditional_put: bool = True
    ) -> None:
        #: key -> (bytes, last modified, version tag)
        self._objects: dict[str, tuple[bytes, float, str]] = {}
        self._versions = itertools.count(1)
        self._lock = threading.Lock()
        self._clock = clock
        self._caps = Capabilities(conditional_put=conditional_put, remote=False)

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    @property
    def description(self) -> str:
        return "memory"

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        with self._lock:
            entry = self._objects.get(key)
        if entry is None:
            return None
        refuse_oversized(f"get memory://{key}", len(entry[0]), max_bytes)
        return entry[0]

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        payload = bytes(data)
        with self._lock:
            if if_absent and self._caps.conditional_put and key in self._objects:
                return False
            self._objects[key] = (payload, self._clock(), f"v{next(self._versions)}")
        return True

    def head(self, key: str) -> ObjectInfo | None:
        with self._lock:
            entry = self._objects.get(key)
        return None if entry is None else ObjectInfo(key, len(entry[0]), entry[1], entry[2])

    def delete_many(self, keys: Iterable[str]) -> DeleteResult:
        result = DeleteResult()
        with self._lock:
            for key in keys:
                self._objects.pop(key, None)
                result.deleted.append(key)
        return result

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        with self._lock:
            items = sorted(
                (k, len(v[0]), v[1], v[2]) for k, v in self._objects.items() if k.startswith(prefix)
            )
        for key, size, modified, etag in items:
            if start_after is None or key > start_after:
                yield ObjectInfo(key, size, modified, etag)

    def list_dirs(self, prefix: str) -> Iterator[str]:
        with self._lock:
            rests = [k[len(prefix) :] for k in self._objects if k.startswith(prefix)]
        yield from sorted({rest.split("/", 1)[0] for rest in rests if "/" in rest})
