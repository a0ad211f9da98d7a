"""Counters and gauges, readable in-process and exposed to Prometheus on demand.

s3kv keeps its own tiny registry (a dict under a lock) so that counting costs a dict update
and ``import s3kv`` does not import ``prometheus_client``. :func:`serve_prometheus` registers a
collector that reads the registry at scrape time and starts the HTTP endpoint.

Names are flat strings; labels are folded into the name as ``name{label="value"}`` so an
in-process reader can use plain dict lookups (``metrics.value("requests", op="get")``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Any

logger = logging.getLogger(__name__)

_HELP: Mapping[str, str] = {
    "lookup_calls": "Lookups answered (zero network calls each).",
    "lookup_blocks_staged": "Leading blocks found staged in host memory by lookups.",
    "lookup_blocks_maybe": "Further blocks the manifest says may exist, by lookups.",
    "prefetch_scheduled": "Block GETs scheduled into staging.",
    "prefetch_dropped": "Prefetches dropped because the prefetch queue was full.",
    "prefetch_staged": "Blocks fetched, verified and decoded into staging.",
    "prefetch_not_found": "Prefetched keys absent in the bucket (Bloom false positive, pruned).",
    "prefetch_no_room": "Prefetched blocks dropped: staging full of pinned entries.",
    "prefetch_failed": "Prefetches that failed (storage error or corrupt object).",
    "prefetch_skipped_unhealthy": "Prefetches skipped while the circuit breaker was open.",
    "save_dropped_unhealthy": "Saves dropped while the circuit breaker was open.",
    "save_submitted": "Blocks accepted for saving.",
    "save_skipped_existing": "Saves skipped because the key is already written.",
    "save_dropped": "Saves dropped by back-pressure (in-flight bytes at the bound).",
    "save_completed": "Blocks written to the bucket.",
    "save_failed": "Block writes that failed (a future miss, never an error).",
    "save_raw_bytes": "Raw (uncompressed) bytes of blocks written.",
    "save_stored_bytes": "Stored (encoded) bytes of blocks written.",
    "stage_raw_bytes": "Raw bytes decoded into staging.",
    "stage_stored_bytes": "Stored bytes fetched for staging.",
    "staging_evictions": "Staged blocks evicted (LRU) to make room.",
    "connector_requests": "Requests the connector was asked about (rank 0).",
    "connector_prompt_tokens": "Prompt tokens of those requests.",
    "connector_claimed_tokens": "Prompt tokens claimed (loaded from staging instead of computed).",
    "connector_loaded_blocks": "Blocks copied from host staging into the KV pool.",
    "connector_copied_blocks": "Full blocks copied from the KV pool to host and handed to saves.",
    "connector_save_buffers_full": "Saves dropped because the host copy buffers were exhausted.",
    "connector_save_errors": "Saves dropped because handing them to the store failed.",
    "connector_save_planning_errors": "Requests whose save planning failed (saves dropped).",
    "connector_uncacheable_requests": (
        "Requests neither claimed nor saved: key inputs s3kv cannot see (unmapped LoRA task "
        "id, p-tuning prompt table)."
    ),
    "connector_forgotten_requests": (
        "Requests forgotten after missing from the scheduler output (cancelled or failed "
        "requests TensorRT-LLM frees without request_finished)."
    ),
    "connector_unhonoured_blocks": (
        "Claimed blocks KVCacheManagerV2 did not honour (unpinned, computed instead)."
    ),
    "warm_blocks_planned": "Blocks warm start chose to stage (gauge).",
    "warm_blocks_staged": "Blocks warm start staged (gauge).",
    "warm_ready": "1 once warm start finished (gauge).",
    "requests": "Object-store requests by operation.",
    "request_errors": "Object-store request failures by operation and kind.",
    "corrupt_objects": "Objects that failed verification, by kind (treated as misses).",
    "staging_bytes": "Bytes currently held in host staging (gauge).",
    "staging_blocks": "Blocks currently held in host staging (gauge).",
    "inflight_save_bytes": "Raw bytes of saves queued or uploading (gauge).",
}


def metric_name(name: str, labels: Mapping[str, str]) -> str:
    """The registry key for ``name`` with ``labels`` (sorted, Prometheus text style)."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


class Metrics:
    """A thread-safe registry of counters and gauges.

    Counters only go up (:meth:`inc`); gauges are set (:meth:`set`). Reads return a consistent
    copy (:meth:`snapshot`).
    """

    def __init__(self, namespace: str = "s3kv") -> None:
        self.namespace = namespace
        self._values: dict[str, float] = {}
        self._gauges: set[str] = set()
        self._lock = threading.Lock()

    def inc(self, name: str, amount: float = 1, **labels: str) -> None:
        """Add ``amount`` to the counter ``name{labels}``."""
        key = metric_name(name, labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount

    def set(self, name: str, value: float, **labels: str) -> None:
        """Set the gauge ``name{labels}`` to ``value``."""
        key = metric_name(name, labels)
        with self._lock:
            self._values[key] = value
            self._gauges.add(key)

    def value(self, name: str, **labels: str) -> float:
        """Current value of ``name{labels}`` (0 if never touched)."""
        with self._lock:
            return self._values.get(metric_name(name, labels), 0)

    def total(self, name: str) -> float:
        """Sum of ``name`` over all label values."""
        with self._lock:
            return sum(v for k, v in self._values.items() if k.split("{", 1)[0] == name)

    def snapshot(self) -> dict[str, float]:
        """A copy of every value, keyed by ``name{labels}``."""
        with self._lock:
            return dict(self._values)

    def items(self) -> Iterator[tuple[str, float, bool]]:
        """``(key, value, is_gauge)`` for every metric (a consistent copy)."""
        with self._lock:
            rows = [(k, v, k in self._gauges) for k, v in self._values.items()]
        yield from rows


def _parse_key(key: str) -> tuple[str, dict[str, str]]:
    if "{" not in key:
        return key, {}
    name, rest = key.split("{", 1)
    labels: dict[str, str] = {}
    for part in rest.rstrip("}").split(","):
        label, _, value = part.partition("=")
        labels[label] = value.strip('"')
    return name, labels


class _Collector:
    """A prometheus_client collector reading a :class:`Metrics` registry at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families: dict[str, Any] = {}
        for key, value, is_gauge in self._metrics.items():
            name, labels = _parse_key(key)
            full = f"{self._metrics.namespace}_{name}"
            family = families.get(full)
            if family is None:
                cls = GaugeMetricFamily if is_gauge else CounterMetricFamily
                family = cls(full, _HELP.get(name, name), labels=sorted(labels))
                families[full] = family
            family.add_metric([labels[k] for k in sorted(labels)], value)
        yield from families.values()


_served: dict[int, Metrics] = {}
_served_lock = threading.Lock()


def serve_prometheus(metrics: Metrics, port: int, addr: str = "0.0.0.0") -> bool:
    """Expose ``metrics`` on ``http://addr:port/metrics``; idempotent per port.

    Returns:
        ``True`` if serving (now or already), ``False`` if the port could not be bound (logged).
    """
    with _served_lock:
        if port in _served:
            return True
        from prometheus_client import REGISTRY, start_http_server

        REGISTRY.register(_Collector(metrics))
        try:
            start_http_server(port, addr=addr)
        except OSError as exc:
            logger.warning("s3kv: cannot serve metrics on port %d: %s", port, exc)
            return False
        _served[port] = metrics
        return True


__all__ = [
    "Metrics",
    "metric_name",
    "serve_prometheus",
]
