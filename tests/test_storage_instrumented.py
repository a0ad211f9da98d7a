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


def test_requests_recorded_in_bulk_count_as_one_by_one_and_keep_the_breaker_order() -> None:
    from s3kv.errors import EndpointError
    from s3kv.storage import Recorded

    def run(bulk: bool, results: list[Recorded]) -> tuple[dict[str, float], BreakerState]:
        breaker = CircuitBreaker(failures=2, cooldown=60.0, clock=lambda: 0.0)
        metrics = Metrics()
        backend = InstrumentedBackend(MemoryBackend(), metrics, breaker=breaker)
        if bulk:
            backend.record_many("put", results)
        else:
            for r in results:
                backend.record("put", r.seconds, r.error, received=r.received, sent=r.sent)
        return metrics.snapshot(), breaker.state

    down = EndpointError("connection refused")
    ok = Recorded(0.01, None, 0, 100)
    for results in (
        [ok, Recorded(0.2, down), ok, Recorded(0.3, down)],  # successes between: closed
        [ok, Recorded(0.2, down), Recorded(0.3, down)],  # two in a row: open
        [Recorded(0.2, down), ok, ok],
    ):
        assert run(True, results) == run(False, results)


def test_a_batch_admitted_at_once_is_all_closed_one_probe_half_open_none_open() -> None:
    now = [0.0]
    breaker = CircuitBreaker(failures=1, cooldown=10.0, clock=lambda: now[0])
    metrics = Metrics()
    backend = InstrumentedBackend(MemoryBackend(), metrics, breaker=breaker)
    assert backend.admit_many("put", 5) == 5
    breaker.record_failure()
    assert backend.admit_many("put", 5) == 0
    assert metrics.value("request_errors", op="put", kind="circuit_open") == 5
    now[0] = 11.0
    assert backend.admit_many("put", 5) == 1  # NOTE: the probe
    assert backend.admit_many("put", 5) == 0  # NOTE: while it is out
    backend.withdraw()
    assert backend.admit_many("put", 2) == 1
