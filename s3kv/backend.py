"""The storage interface every backend implements, and the in-memory backend.

The interface is deliberately narrow (after zarr's ``Store``):

* ``get`` returns ``None`` **only** for "not found"; every other failure raises a
  :class:`~s3kv.errors.StorageError` subclass, so an outage never looks like a miss.
* ``put(..., if_absent=True)`` is a conditional create where
  :attr:`Capabilities.conditional_put` says the server supports it; elsewhere it is a plain
  PUT (harmless: objects are content-addressed, so an overwrite writes the same bytes).
* ``delete_many`` works in batches of at most :data:`DELETE_BATCH` keys and reports failures
  per key instead of raising for them.
* Capabilities are declared, not probed by callers.

Backends are thread-safe: the store calls them from its I/O pool.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

#: DeleteObjects accepts at most this many keys per request.
DELETE_BATCH = 1000


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; declared by the backend, never probed by callers.

    Attributes:
        conditional_put: ``put(if_absent=True)`` really is atomic create-if-absent.
        remote: Operations cross a network (affects what the store counts as requests).
    """

    conditional_put: bool
    remote: bool


@dataclass(frozen=True)
class ObjectInfo:
    """Metadata of one stored object.

    Attributes:
        key: Full object key.
        size: Size in bytes.
        last_modified: Seconds since the epoch.
    """

    key: str
    size: int
    last_modified: float


@dataclass(frozen=True)
class DeleteResult:
    """Outcome of :meth:`Backend.delete_many`.

    Attributes:
        deleted: Keys removed (or already absent: S3 delete is idempotent).
        failed: Key → reason for keys the server refused.
    """

    deleted: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


class Backend(ABC):
    """A flat key → bytes object store."""

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities:
        """What this backend supports."""

    @property
    @abstractmethod
    def description(self) -> str:
        """Where the data lives, for logs (never includes credentials)."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The object's bytes, or ``None`` if no object has that key.

        Raises:
            StorageError: any failure other than "not found".
        """

    @abstractmethod
    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        """Store ``data`` under ``key`` atomically (readers see all of it or nothing).

        Args:
            key: Object key.
            data: The full object.
            if_absent: Create only if no object has ``key`` (where supported).

        Returns:
            ``True`` if written; ``False`` only when ``if_absent`` found the key present.

        Raises:
            StorageError: the write failed.
        """

    @abstractmethod
    def head(self, key: str) -> ObjectInfo | None:
        """Metadata of ``key``, or ``None`` if absent.

        Raises:
            StorageError: any failure other than "not found".
        """

    @abstractmethod
    def delete_many(self, keys: Iterable[str]) -> DeleteResult:
        """Delete ``keys`` in batches of :data:`DELETE_BATCH`; absent keys count as deleted.

        Raises:
            StorageError: a whole batch failed (per-key refusals go to ``failed``).
        """

    @abstractmethod
    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """Objects whose key starts with ``prefix``, in key order, after ``start_after``.

        Raises:
            StorageError: a listing request failed.
        """

    def check(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Verify the bucket exists and the credentials work; raise a clear error if not.

        Raises:
            BucketNotFoundError, AccessDeniedError, EndpointError: with a one-line remedy.
        """

    def close(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Release connections. Further calls are undefined."""


class MemoryBackend(Backend):
    """A thread-safe in-process backend for unit tests and the CPU demo.

    Args:
        clock: Returns seconds since the epoch; injectable so tests control ``last_modified``.
        conditional_put: Whether to declare (and honour) atomic create-if-absent.
    """

    def __init__(
        self, *, clock: Callable[[], float] = time.time, conditional_put: bool = True
    ) -> None:
        self._objects: dict[str, tuple[bytes, float]] = {}
        self._lock = threading.Lock()
        self._clock = clock
        self._caps = Capabilities(conditional_put=conditional_put, remote=False)

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    @property
    def description(self) -> str:
        return "memory"

    def get(self, key: str) -> bytes | None:
        with self._lock:
            entry = self._objects.get(key)
        return None if entry is None else entry[0]

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        payload = bytes(data)
        with self._lock:
            if if_absent and self._caps.conditional_put and key in self._objects:
                return False
            self._objects[key] = (payload, self._clock())
        return True

    def head(self, key: str) -> ObjectInfo | None:
        with self._lock:
            entry = self._objects.get(key)
        return None if entry is None else ObjectInfo(key, len(entry[0]), entry[1])

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
                (k, len(v[0]), v[1]) for k, v in self._objects.items() if k.startswith(prefix)
            )
        for key, size, modified in items:
            if start_after is None or key > start_after:
                yield ObjectInfo(key, size, modified)


class DelegatingBackend(Backend):
    """Passes every call to ``inner``; subclass it to observe or alter a few operations."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    @property
    def description(self) -> str:
        return self.inner.description

    def get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        return self.inner.put(key, data, if_absent=if_absent)

    def head(self, key: str) -> ObjectInfo | None:
        return self.inner.head(key)

    def delete_many(self, keys: Iterable[str]) -> DeleteResult:
        return self.inner.delete_many(keys)

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix, start_after=start_after)

    def check(self) -> None:
        self.inner.check()

    def close(self) -> None:
        self.inner.close()
