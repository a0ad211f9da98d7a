"""InstrumentedBackend: requests counted as S3 bills them, the breaker consulted for each."""

from __future__ import annotations

import pytest

from s3kv.metrics import Metrics
from s3kv.storage import (
    DELETE_BATCH,
    BreakerState,
    CircuitBreaker,
    CircuitOpenError,
    InstrumentedBackend,
    MemoryBackend,
)


def test_listings_count_one_request_per_page() -> None:
    inner = MemoryBackend()
    for i in range(DELETE_BATCH + 1):
        inner.put(f"kv/{i:05d}/x", b"")
    metrics = Metrics()
    backend = InstrumentedBackend(inner, metrics)

    # list and list_dirs are lazy: nothing is counted until iterated.
    pending = backend.list_dirs("kv/")
    assert metrics.value("requests", op="list") == 0
    assert len(list(pending)) == DELETE_BATCH + 1
    assert metrics.value("requests", op="list") == 2  # 1001 names: two pages
    assert len(list(backend.list("kv/"))) == DELETE_BATCH + 1
    assert metrics.value("requests", op="list") == 4


def test_an_open_breaker_refuses_listings_without_asking_the_backend() -> None:
    breaker = CircuitBreaker(failures=1, cooldown=60.0, clock=lambda: 0.0)
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    metrics = Metrics()
    backend = InstrumentedBackend(MemoryBackend(), metrics, breaker=breaker)
    with pytest.raises(CircuitOpenError):
        list(backend.list_dirs(""))
    assert metrics.value("requests", op="list") == 0
    assert metrics.value("request_errors", op="list", kind="circuit_open") == 1
