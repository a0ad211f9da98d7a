"""A backend wrapper that counts requests, bytes and errors into :class:`Metrics`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from s3kv.backend import DELETE_BATCH, Backend, Capabilities, DeleteResult, ObjectInfo
from s3kv.errors import StorageError
from s3kv.metrics import Metrics


class InstrumentedBackend(Backend):
    """Delegates to ``inner``; counts ``requests{op}``, ``request_errors{op,kind}`` and bytes.

    A ``list`` counts one request per page of 1000 keys (as S3 bills it); ``delete_many`` one
    per batch.
    """

    def __init__(self, inner: Backend, metrics: Metrics) -> None:
        self.inner = inner
        self.metrics = metrics

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    @property
    def description(self) -> str:
        return self.inner.description

    def requests(self) -> int:
        """Total requests made through this wrapper so far."""
        return int(self.metrics.total("requests"))

    def _fail(self, op: str, exc: StorageError) -> None:
        self.metrics.inc("request_errors", op=op, kind=exc.kind)

    def get(self, key: str) -> bytes | None:
        self.metrics.inc("requests", op="get")
        try:
            data = self.inner.get(key)
        except StorageError as exc:
            self._fail("get", exc)
            raise
        if data is not None:
            self.metrics.inc("bytes_received", len(data))
        return data

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        self.metrics.inc("requests", op="put")
        try:
            written = self.inner.put(key, data, if_absent=if_absent)
        except StorageError as exc:
            self._fail("put", exc)
            raise
        if written:
            self.metrics.inc("bytes_sent", len(data))
        return written

    def head(self, key: str) -> ObjectInfo | None:
        self.metrics.inc("requests", op="head")
        try:
            return self.inner.head(key)
        except StorageError as exc:
            self._fail("head", exc)
            raise

    def delete_many(self, keys: Iterable[str]) -> DeleteResult:
        key_list = list(keys)
        batches = (len(key_list) + DELETE_BATCH - 1) // DELETE_BATCH
        self.metrics.inc("requests", batches, op="delete")
        try:
            return self.inner.delete_many(key_list)
        except StorageError as exc:
            self._fail("delete", exc)
            raise

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        self.metrics.inc("requests", op="list")
        try:
            for n, info in enumerate(self.inner.list(prefix, start_after=start_after), 1):
                if n % DELETE_BATCH == 0:
                    self.metrics.inc("requests", op="list")
                yield info
        except StorageError as exc:
            self._fail("list", exc)
            raise

    def check(self) -> None:
        self.metrics.inc("requests", op="head_bucket")
        self.inner.check()

    def close(self) -> None:
        self.inner.close()
