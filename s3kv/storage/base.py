"""The storage interface every backend implements, and its value types.

The interface is deliberately narrow (after zarr's ``Store``):

* ``get`` returns ``None`` **only** for "not found"; every other failure raises a
  :class:`~s3kv.errors.StorageError` subclass, so an outage never looks like a miss.
  ``get(key, max_bytes=n)`` refuses an object longer than ``n`` *before* reading its body
  (:class:`~s3kv.errors.ObjectTooLargeError`), so junk under a known key costs no memory.
* ``put(..., if_absent=True)`` is a conditional create where
  :attr:`Capabilities.conditional_put` says the server supports it; elsewhere it is a plain
  PUT (harmless: objects are content-addressed, so an overwrite writes the same bytes).
* ``delete_many`` works in batches of at most :data:`DELETE_BATCH` keys and reports failures
  per key instead of raising for them.
* ``list_dirs`` answers "which names sit directly below this prefix" in one cheap listing
  (S3's delimiter listing) where the backend can; the default reads the whole prefix.
* Capabilities are declared, not probed by callers; :meth:`Backend.probe_conditional_put` is
  for diagnosis (``s3kv doctor``), asking the server itself where its answer can change.

Backends are thread-safe: the store calls them from its I/O pool.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from s3kv.errors import ObjectTooLargeError

__all__ = [
    "DELETE_BATCH",
    "Backend",
    "Capabilities",
    "Credentials",
    "DelegatingBackend",
    "DeleteResult",
    "ObjectInfo",
    "refuse_oversized",
]

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
        etag: An opaque tag of the object's version (S3's ETag without quotes): two
            answers with equal non-empty tags saw the same version. ``""`` where the
            backend cannot tell. Not compared by ``==``.
    """

    key: str
    size: int
    last_modified: float
    etag: str = field(default="", compare=False)


@dataclass(frozen=True)
class DeleteResult:
    """Outcome of :meth:`Backend.delete_many`.

    Attributes:
        deleted: Keys removed (or already absent: S3 delete is idempotent).
        failed: Key → reason for keys the server refused.
    """

    deleted: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Credentials:
    """Which credentials a backend would use; never the secret.

    Attributes:
        source: Where they come from (boto3's provider: ``env``, ``shared-credentials-file``,
            ``sso``, ``iam-role``...), or why none are needed.
        access_key_id: Masked to its last four characters; empty where none are needed.
        required: Whether the backend authenticates at all (a ``file://`` directory does not).
    """

    source: str
    access_key_id: str
    required: bool = True


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
    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        """The object's bytes, or ``None`` if no object has that key.

        Args:
            key: Object key.
            max_bytes: The longest object the caller accepts. A longer one is refused
                before its body is read (S3: from the response's Content-Length; the
                connection is closed rather than drained), so reading it costs no memory.

        Raises:
            ObjectTooLargeError: the object is longer than ``max_bytes``.
            StorageError: any other failure, except "not found".
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

    def list_dirs(self, prefix: str) -> Iterator[str]:
        """Names ``d`` such that some key starts with ``prefix + d + "/"``, sorted, each once.

        S3's ``CommonPrefixes`` of a ``Delimiter="/"`` listing, without the prefix and the
        trailing ``/``. This default lists every key under ``prefix``; backends override it
        with a cheaper listing (S3: one request per 1000 names).

        Args:
            prefix: ``""`` (the bucket root) or a key prefix ending in ``/``.

        Raises:
            StorageError: a listing request failed.
        """
        names = {
            rest.split("/", 1)[0]
            for rest in (info.key[len(prefix) :] for info in self.list(prefix))
            if "/" in rest
        }
        yield from sorted(names)

    def probe_conditional_put(self, prefix: str) -> bool:
        """Whether the server really honours ``put(if_absent=True)``, for diagnosis.

        Backends whose answer is fixed return :attr:`Capabilities.conditional_put`; the S3
        backend asks the server, with scratch objects under ``<prefix>/.s3kv-probe/`` that it
        deletes again.

        Raises:
            StorageError: the probe failed for a reason other than lack of support.
        """
        return self.capabilities.conditional_put

    def check(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Verify the bucket exists and the credentials work; raise a clear error if not.

        Raises:
            BucketNotFoundError, AccessDeniedError, EndpointError: with a one-line remedy.
        """

    def close(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Release connections. Further calls are undefined."""


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

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        return self.inner.get(key, max_bytes=max_bytes)

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        return self.inner.put(key, data, if_absent=if_absent)

    def head(self, key: str) -> ObjectInfo | None:
        return self.inner.head(key)

    def delete_many(self, keys: Iterable[str]) -> DeleteResult:
        return self.inner.delete_many(keys)

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix, start_after=start_after)

    def list_dirs(self, prefix: str) -> Iterator[str]:
        return self.inner.list_dirs(prefix)

    def probe_conditional_put(self, prefix: str) -> bool:
        return self.inner.probe_conditional_put(prefix)

    def check(self) -> None:
        self.inner.check()

    def close(self) -> None:
        self.inner.close()


def refuse_oversized(where: str, size: int, max_bytes: int | None) -> None:
    """Raise :class:`~s3kv.errors.ObjectTooLargeError` if ``size`` is over ``max_bytes``.

    For backends implementing :meth:`Backend.get`; ``where`` names the object for the
    message (``"get s3://bucket/key"``).
    """
    if max_bytes is not None and size > max_bytes:
        raise ObjectTooLargeError(
            f"{where}: the object is {size} bytes, more than the {max_bytes} its reader "
            "allows; not read (a foreign or corrupt object: `s3kv verify` reports block "
            "objects like it)"
        )
