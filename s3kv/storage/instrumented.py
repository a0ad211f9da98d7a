"""A backend wrapper: counts and times requests, bytes and errors; feeds the circuit breaker."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple, TypeVar

from s3kv.errors import ObjectTooLargeError, StorageError
from s3kv.metrics import Metrics
from s3kv.storage.base import DELETE_BATCH, Backend, DelegatingBackend, DeleteResult, ObjectInfo
from s3kv.storage.breaker import NEUTRAL_KINDS, BreakerState, CircuitBreaker

__all__ = ["InstrumentedBackend", "Recorded"]

T = TypeVar("T")

#: The ``breaker_state`` gauge's value per state (higher is worse).
_BREAKER_VALUES = {BreakerState.CLOSED: 0.0, BreakerState.HALF_OPEN: 1.0, BreakerState.OPEN: 2.0}


class Recorded(NamedTuple):
    """A request made elsewhere, for :meth:`InstrumentedBackend.record_many`."""

    seconds: float
    error: StorageError | None
    received: int = 0
    sent: int = 0


class InstrumentedBackend(DelegatingBackend):
    """Delegates to ``inner``; counts ``requests{op}``, ``request_errors{op,kind}`` and bytes.

    A ``list`` or ``list_dirs`` counts one request per page of 1000 names (as S3 bills it);
    ``delete_many`` one per batch. Every request made is timed into the histogram
    ``request_seconds{op}`` (a listing per page, a ``delete_many`` per call; requests the
    breaker refused are not timed). With a ``breaker``, every request first asks it for
    admission (raising :class:`~s3kv.storage.breaker.CircuitOpenError` while open, without
    touching the network) and reports its outcome to it; its state is the gauge
    ``breaker_state`` (0 closed, 1 half-open, 2 open) and its openings the counter
    ``breaker_trips``.
    """

    def __init__(
        self, inner: Backend, metrics: Metrics, *, breaker: CircuitBreaker | None = None
    ) -> None:
        super().__init__(inner)
        self.metrics = metrics
        self.breaker = breaker
        if breaker is not None:
            metrics.watch("breaker_state", lambda: _BREAKER_VALUES[breaker.state])
            metrics.watch("breaker_trips", lambda: breaker.trips, counter=True)

    @property
    def healthy(self) -> bool:
        """False while the circuit breaker is open (or half-open)."""
        return self.breaker is None or self.breaker.healthy

    def requests(self) -> int:
        """Total requests made through this wrapper so far."""
        return int(self.metrics.total("requests"))

    def _call(self, op: str, fn: Callable[[], T], count: int = 1) -> T:
        try:
            if self.breaker is not None:
                self.breaker.before_request()
            self.metrics.inc("requests", count, op=op)
            start = time.perf_counter()
            try:
                result = fn()
            finally:
                self.metrics.observe("request_seconds", time.perf_counter() - start, op=op)
        except StorageError as exc:
            self._failed(op, exc)
            raise
        if self.breaker is not None:
            self.breaker.record_success()
        return result

    def _failed(self, op: str, exc: StorageError) -> None:
        self.metrics.inc("request_errors", op=op, kind=exc.kind)
        if self.breaker is None:
            return
        if isinstance(exc, ObjectTooLargeError):
            self.breaker.record_success()  # NOTE: the server answered; the object is bad
        elif exc.kind not in NEUTRAL_KINDS:
            self.breaker.record_failure()

    def admit_many(self, op: str, count: int) -> int:
        """Ask the breaker to admit ``count`` requests other processes will make for this
        backend: how many may be made (the first ones). The refused are counted as failed
        ``op`` requests (kind ``circuit_open``), as a local refusal is. Never raises."""
        if self.breaker is None:
            return count
        admitted = self.breaker.admit_many(count)
        if admitted < count:
            self.metrics.inc("request_errors", count - admitted, op=op, kind="circuit_open")
        return admitted

    def withdraw(self) -> None:
        """An admitted request will not be made (see :meth:`admit_many`)."""
        if self.breaker is not None:
            self.breaker.cancel()

    def record(
        self,
        op: str,
        seconds: float,
        error: StorageError | None,
        *,
        received: int = 0,
        sent: int = 0,
    ) -> None:
        """Count, time and report to the breaker a request made elsewhere (after
        :meth:`admit_many`), exactly as if it had been made here."""
        self.metrics.inc("requests", op=op)
        self.metrics.observe("request_seconds", seconds, op=op)
        if error is not None:
            self._failed(op, error)
            return
        if self.breaker is not None:
            self.breaker.record_success()
        if received:
            self.metrics.inc("bytes_received", received)
        if sent:
            self.metrics.inc("bytes_sent", sent)

    def record_many(self, op: str, results: Sequence[Recorded]) -> None:
        """:meth:`record` for many requests, in order, with one registry lock per metric."""
        if not results:
            return
        self._count(op, [r.seconds for r in results])
        breaker = self.breaker
        received = sent = 0
        succeeded = False  # NOTE: a run of successes is reported once, in its place
        for result in results:
            if result.error is not None:
                if succeeded and breaker is not None:
                    breaker.record_success()
                succeeded = False
                self._failed(op, result.error)
                continue
            succeeded = True
            received += result.received
            sent += result.sent
        if succeeded and breaker is not None:
            breaker.record_success()
        self.metrics.inc_many({"bytes_received": received, "bytes_sent": sent})

    def record_succeeded(
        self, op: str, seconds: Sequence[float], *, received: int = 0, sent: int = 0
    ) -> None:
        """:meth:`record_many` for requests that all succeeded, taking ``seconds[i]`` each and
        ``received`` / ``sent`` bytes in all: no object per request."""
        if not seconds:
            return
        self._count(op, seconds)
        if self.breaker is not None:
            self.breaker.record_success()
        self.metrics.inc_many({"bytes_received": received, "bytes_sent": sent})

    def _count(self, op: str, seconds: Sequence[float]) -> None:
        self.metrics.inc("requests", len(seconds), op=op)
        self.metrics.observe_many("request_seconds", seconds, op=op)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        # NOTE: an object refused for max_bytes counts as request_errors{op=get,
        # kind=too_large}, and as a success for the breaker: the server answered.
        data = self._call("get", lambda: self.inner.get(key, max_bytes=max_bytes))
        if data is not None:
            self.metrics.inc("bytes_received", len(data))
        return data

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        written = self._call("put", lambda: self.inner.put(key, data, if_absent=if_absent))
        if written:
            self.metrics.inc("bytes_sent", len(data))
        return written

    def head(self, key: str) -> ObjectInfo | None:
        return self._call("head", lambda: self.inner.head(key))

    def delete_many(self, keys: Iterable[str]) -> DeleteResult:
        key_list = list(keys)
        batches = max(1, (len(key_list) + DELETE_BATCH - 1) // DELETE_BATCH)
        return self._call("delete", lambda: self.inner.delete_many(key_list), batches)

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        # NOTE: streamed, so listing a huge prefix holds one page at a time.
        return self._paged("list", lambda: self.inner.list(prefix, start_after=start_after))

    def list_dirs(self, prefix: str) -> Iterator[str]:
        return self._paged("list", lambda: self.inner.list_dirs(prefix))

    def _paged(self, op: str, items: Callable[[], Iterator[T]]) -> Iterator[T]:
        # NOTE: one request is counted per page of 1000 items (as S3 bills a listing), and
        # the outcome reaches the breaker at the end. Each page is timed from the time spent
        # producing its items (not the caller's time between them).
        if self.breaker is not None:
            try:
                self.breaker.before_request()
            except StorageError as exc:
                self._failed(op, exc)
                raise
        self.metrics.inc("requests", op=op)
        spent = 0.0
        try:
            start = time.perf_counter()
            iterator = iter(items())
            spent = time.perf_counter() - start
            n = 0
            while True:
                start = time.perf_counter()
                try:
                    item = next(iterator)
                except StopIteration:
                    break
                finally:
                    spent += time.perf_counter() - start
                n += 1
                if n % DELETE_BATCH == 0:
                    self.metrics.observe("request_seconds", spent, op=op)
                    spent = 0.0
                    self.metrics.inc("requests", op=op)
                yield item
        except StorageError as exc:
            self._failed(op, exc)
            raise
        finally:
            # NOTE: the last page, also when the caller stopped early or it failed.
            self.metrics.observe("request_seconds", spent, op=op)
        if self.breaker is not None:
            self.breaker.record_success()

    def check(self) -> None:
        self._call("head_bucket", self.inner.check)
