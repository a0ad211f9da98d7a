"""Counters, gauges and latency histograms, readable in-process and served to Prometheus.

Each store keeps its own :class:`Metrics` (a dict under a lock) so that counting costs a dict
update and ``import s3kv`` does not import ``prometheus_client``. Names are flat strings;
labels are folded into the name as ``name{label="value"}`` so an in-process reader can use
plain dict lookups (``metrics.value("requests", op="get")``).

Export is per *process*: :func:`exporter` is the one :class:`Exporter` of the process. Every
opened store adds its registry to it with its ``fingerprint`` and ``shard`` (TP rank) labels,
and every manifest is added once, under the fingerprint it lives under (a TP layout's shared
manifest: the layout fingerprint). :meth:`Exporter.serve` registers one collector with
prometheus_client's default registry, read at scrape time, and starts one HTTP endpoint per
address and port. Every series carries help text (:data:`HELP`, :data:`MANIFEST_HELP`); the
README's metrics table lists them all.
"""

from __future__ import annotations

import bisect
import logging
import re
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

#: The endpoint's default listen address: loopback only (a scraper elsewhere needs an
#: explicit ``metrics_address``, e.g. ``0.0.0.0``).
DEFAULT_ADDRESS = "127.0.0.1"
#: Upper bounds (seconds) of the latency histograms' buckets (+Inf is implied).
DEFAULT_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
#: Exported names start with this (``s3kv_requests_total``).
NAMESPACE = "s3kv"
#: Labels every store series carries.
STORE_LABELS = ("fingerprint", "shard")

#: Help text of every store series, by name (without the namespace).
HELP: Mapping[str, str] = {
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
    "connector_save_buffers_withheld": (
        "Save buffers kept out of the pool for good: a failed device copy may still write them."
    ),
    "connector_save_planning_errors": "Requests whose save planning failed (saves dropped).",
    "connector_saves_queued_idle": (
        "Save copies queued by the idle saver: the engine made no call for a while (TensorRT-"
        "LLM stops calling the connector when no request is left)."
    ),
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
    "corrupt_objects": (
        "Objects that failed verification, by kind (treated as misses); with auth_keys, "
        "kinds unsigned, forged and unknown_key count blocks that did not authenticate."
    ),
    "prefetch_quarantined": (
        "Prefetches answered as misses without a GET: the key's object failed verification "
        "recently (quarantined for 10 minutes)."
    ),
    "save_rewrote_quarantined": "Saves that overwrote an object which had failed verification.",
    "staging_bytes": "Bytes currently held in host staging (gauge).",
    "staging_blocks": "Blocks currently held in host staging (gauge).",
    "inflight_save_bytes": "Raw bytes of saves queued or uploading (gauge).",
    "staging_capacity_bytes": "Host staging budget in bytes (the staging_bytes setting; gauge).",
    "inflight_save_limit_bytes": (
        "Bound on raw bytes of saves queued or uploading (max_inflight_save_bytes; gauge)."
    ),
    "bytes_received": "Object bytes received by GETs.",
    "bytes_sent": "Object bytes sent by PUTs that wrote.",
    "request_seconds": (
        "Object-store request latency in seconds by operation (a LIST: per page of 1000 "
        "names; a DELETE: per call)."
    ),
    "breaker_state": (
        "Circuit breaker state: 0 closed (healthy), 1 half-open (one probe allowed), 2 open "
        "(requests skipped; gauge)."
    ),
    "breaker_trips": "Times the circuit breaker opened.",
    "store_pending": (
        "1 while the store waits for a bucket that did not answer at startup (it claims and "
        "saves nothing until then; gauge)."
    ),
}

#: Help text of the manifest series (``s3kv_manifest_<name>``), by ``stats()`` key.
MANIFEST_HELP: Mapping[str, str] = {
    "segments_written": "Manifest segments (batches of write, hit and pin records) written.",
    "segments_read": "Manifest segments read by refreshes (before the manifest has a log).",
    "segments_corrupt": "Manifest segments or deltas skipped as corrupt.",
    "records_flushed": "Records written in manifest segments.",
    "records_dropped": "Records dropped at the pending bound before a flush (hits first).",
    "flush_errors": "Manifest flushes that failed (retried at the next flush).",
    "refresh_errors": "Manifest refreshes that failed (what is loaded keeps serving).",
    "refreshes": "Manifest refreshes completed.",
    "reloads": "Key filters rebuilt from a snapshot (startup, a new snapshot).",
    "deltas_read": "Manifest deltas (compacted key batches) read.",
    "snapshots_corrupt": "Corrupt log entries or snapshot shards skipped or rebuilt.",
    "thread_errors": "Unexpected errors in the manifest's background threads (logged).",
    "compaction_cycles": "Compaction cycles run while holding the compaction lease.",
    "compaction_errors": "Compaction rounds that failed.",
    "takeovers": "Times this process took the compaction lease.",
    "fenced": "Compaction cycles whose entry was not published (another compactor moved on).",
    "requests": "Object-store requests made by the manifest.",
    "pending_records": "Records waiting for the next manifest flush (gauge).",
    "keys_in_filter": "Keys inserted in the key filter, an upper bound on distinct keys (gauge).",
    "bloom_bytes": "Bytes held by the manifest's key filters (gauge).",
    "generation": "Snapshot generation loaded, 0 for none (gauge).",
    "version": "Manifest log version applied, 0 before the log exists (gauge).",
    "compactor": "1 while this process holds the compaction lease (gauge).",
    "open_requests": "Object-store requests the manifest's first load issued (gauge).",
    "lag_seconds": (
        "Seconds since the manifest last applied a new log entry (gauge; absent before the "
        "first entry)."
    ),
    "shard_pending": "Keys written by some but not all TP shards, not yet advertised (gauge).",
    "shard_pending_evicted": "Keys forgotten at the bound while waiting for other shards.",
    "shard_writes_completed": "Keys advertised once every TP shard was written.",
    "relay_reports": "Writes this rank reported to rank 0's shared manifest.",
    "relay_dropped": "Writes lost before reaching rank 0's shared manifest (ring full).",
}
#: Manifest ``stats()`` keys that are gauges (the rest are counters).
MANIFEST_GAUGES = frozenset(
    {
        "pending_records",
        "keys_in_filter",
        "bloom_bytes",
        "generation",
        "version",
        "compactor",
        "open_requests",
        "lag_seconds",
        "shard_pending",
    }
)
#: Gauges that keep the worst value, not the sum, when two registries share a label set.
_MAX_GAUGES = frozenset({"breaker_state", "warm_ready", "store_pending"})
_NAME_RE = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(name: str, labels: Mapping[str, str]) -> str:
    """The registry key for ``name`` with ``labels`` (sorted, Prometheus text style)."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


@dataclass(frozen=True)
class HistogramValue:
    """A histogram read from a :class:`Metrics` registry.

    Attributes:
        bounds: Upper bounds of the buckets (``+Inf`` implied after the last).
        counts: Observations per bucket (not cumulative), one more than ``bounds``.
        sum: Sum of the observed values.
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        """Number of observations."""
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations <= it)`` per bucket, ending with ``+Inf``."""
        total, out = 0, []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            out.append((bound, total))
        return out

    def merged(self, other: HistogramValue) -> HistogramValue:
        """The sum of two histograms with the same bounds."""
        counts = tuple(a + b for a, b in zip(self.counts, other.counts, strict=True))
        return HistogramValue(self.bounds, counts, self.sum + other.sum)


class _Histogram:
    __slots__ = ("counts", "sum")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * (buckets + 1)
        self.sum = 0.0


class Metrics:
    """A thread-safe registry of counters, gauges and histograms.

    Counters only go up (:meth:`inc`); gauges are set (:meth:`set`) or read from a function
    at read time (:meth:`watch`); histograms count observations into fixed buckets
    (:meth:`observe`). Reads return a consistent copy (:meth:`snapshot`).

    Args:
        namespace: Prefix of the exported names.
        buckets: Upper bounds of every histogram's buckets (seconds for latencies).
    """

    def __init__(
        self, namespace: str = NAMESPACE, buckets: tuple[float, ...] = DEFAULT_BUCKETS
    ) -> None:
        self.namespace = namespace
        self.buckets = tuple(sorted(buckets))
        self._values: dict[str, float] = {}
        self._gauges: set[str] = set()
        self._watched: dict[str, tuple[Callable[[], float], bool]] = {}
        self._histograms: dict[str, _Histogram] = {}
        self._lock = threading.Lock()

    def inc(self, name: str, amount: float = 1, **labels: str) -> None:
        """Add ``amount`` to the counter ``name{labels}``."""
        key = metric_name(name, labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount

    def inc_many(self, amounts: Mapping[str, float]) -> None:
        """:meth:`inc` of each unlabelled counter by its amount, under one lock (batches)."""
        with self._lock:
            values = self._values
            for name, amount in amounts.items():
                if amount:
                    values[name] = values.get(name, 0) + amount

    def set(self, name: str, value: float, **labels: str) -> None:
        """Set the gauge ``name{labels}`` to ``value``."""
        key = metric_name(name, labels)
        with self._lock:
            self._values[key] = value
            self._gauges.add(key)

    def watch(
        self, name: str, read: Callable[[], float], *, counter: bool = False, **labels: str
    ) -> None:
        """Make ``name{labels}`` a gauge (or, with ``counter``, a counter) read by ``read``.

        ``read`` runs at every read of the registry (a snapshot, a scrape): keep it cheap and
        let it not raise. Replaces an earlier ``watch`` of the same name and labels.
        """
        with self._lock:
            self._watched[metric_name(name, labels)] = (read, not counter)

    def observe(self, name: str, value: float, **labels: str) -> None:
        """Count ``value`` (seconds, for latencies) into the histogram ``name{labels}``."""
        key = metric_name(name, labels)
        index = bisect.bisect_left(self.buckets, value)
        with self._lock:
            histogram = self._histograms.get(key)
            if histogram is None:
                histogram = self._histograms[key] = _Histogram(len(self.buckets))
            histogram.counts[index] += 1
            histogram.sum += value

    def observe_many(self, name: str, values: Sequence[float], **labels: str) -> None:
        """:meth:`observe` of each of ``values``, under one lock (batches)."""
        if not values:
            return
        key = metric_name(name, labels)
        indices = [bisect.bisect_left(self.buckets, value) for value in values]
        with self._lock:
            histogram = self._histograms.get(key)
            if histogram is None:
                histogram = self._histograms[key] = _Histogram(len(self.buckets))
            for index in indices:
                histogram.counts[index] += 1
            histogram.sum += sum(values)

    def value(self, name: str, **labels: str) -> float:
        """Current value of the counter or gauge ``name{labels}`` (0 if never touched)."""
        key = metric_name(name, labels)
        with self._lock:
            watched = self._watched.get(key)
            if watched is None:
                return self._values.get(key, 0)
        return _read(watched[0])

    def histogram(self, name: str, **labels: str) -> HistogramValue | None:
        """The histogram ``name{labels}``, or ``None`` before its first observation."""
        with self._lock:
            histogram = self._histograms.get(metric_name(name, labels))
            if histogram is None:
                return None
            return HistogramValue(self.buckets, tuple(histogram.counts), histogram.sum)

    def total(self, name: str) -> float:
        """Sum of the counter or gauge ``name`` over all label values."""
        return sum(v for k, v, _ in self.items() if k.split("{", 1)[0] == name)

    def snapshot(self) -> dict[str, float]:
        """A copy of every value, keyed by ``name{labels}``.

        A histogram appears as its ``<name>_count{labels}`` and ``<name>_sum{labels}``.
        """
        values = {key: value for key, value, _ in self.items()}
        for key, histogram in self.histograms():
            name, _, labels = key.partition("{")
            suffix = "{" + labels if labels else ""
            values[f"{name}_count{suffix}"] = float(histogram.count)
            values[f"{name}_sum{suffix}"] = histogram.sum
        return values

    def items(self) -> Iterator[tuple[str, float, bool]]:
        """``(key, value, is_gauge)`` for every counter and gauge (a consistent copy)."""
        with self._lock:
            rows = [(k, v, k in self._gauges) for k, v in self._values.items()]
            watched = list(self._watched.items())
        rows.extend((key, _read(read), gauge) for key, (read, gauge) in watched)
        yield from rows

    def histograms(self) -> Iterator[tuple[str, HistogramValue]]:
        """``(key, histogram)`` for every histogram (a consistent copy)."""
        with self._lock:
            rows = [
                (key, HistogramValue(self.buckets, tuple(h.counts), h.sum))
                for key, h in self._histograms.items()
            ]
        yield from rows


def _read(read: Callable[[], float]) -> float:
    try:
        return float(read())
    except Exception:  # a broken reader must not break a scrape
        logger.debug("s3kv: a watched metric could not be read", exc_info=True)
        return float("nan")


def _parse_key(key: str) -> tuple[str, dict[str, str]]:
    if "{" not in key:
        return key, {}
    name, rest = key.split("{", 1)
    labels: dict[str, str] = {}
    for part in rest.rstrip("}").split(","):
        label, _, value = part.partition("=")
        labels[label] = value.strip('"')
    return name, labels


# --- the process's exporter ---------------------------------------------------------------


@dataclass
class _Family:
    """One exported metric family being assembled: type, help and samples by label set."""

    kind: str  # "counter", "gauge" or "histogram"
    help: str
    samples: dict[tuple[tuple[str, str], ...], Any]

    def add(self, name: str, labels: Mapping[str, str], value: Any) -> None:
        key = tuple(sorted(labels.items()))
        old = self.samples.get(key)
        if old is None:
            self.samples[key] = value
        elif isinstance(old, HistogramValue):
            self.samples[key] = old.merged(value) if old.bounds == value.bounds else old
        elif self.kind == "gauge" and name in _MAX_GAUGES:
            self.samples[key] = max(old, value)
        else:  # NOTE: two live registries with one label set (tests, embedders): summed
            self.samples[key] = old + value


@dataclass
class _ManifestEntry:
    fingerprint: str
    read: Callable[[], Callable[[], Mapping[str, float]] | None]


class Export:
    """A registration with the :class:`Exporter`; :meth:`close` withdraws it (idempotent)."""

    def __init__(self, exporter: Exporter, token: int) -> None:
        self._exporter = exporter
        self._token = token

    def close(self) -> None:
        """Stop exporting what was added (its series disappear from the next scrape)."""
        self._exporter._remove(self._token)


class Exporter:
    """The process's one export registry: every store's metrics and every manifest's stats.

    Sources are held weakly (a store that is dropped without :meth:`KVStore.close` stops
    being exported once collected). Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._stores: dict[int, tuple[weakref.ref[Metrics], dict[str, str]]] = {}
        self._manifests: dict[int, _ManifestEntry] = {}
        self._serve_lock = threading.Lock()  # NOTE: not _lock: registering collects
        self._servers: dict[tuple[str, int], bool] = {}
        self._collector: _Collector | None = None

    def add_store(self, metrics: Metrics, **labels: str) -> Export:
        """Export ``metrics`` with ``labels`` added to every series (a store's: fingerprint
        and shard); the same registry with the same labels is exported once."""
        with self._lock:
            for token, (ref, known) in self._stores.items():
                if ref() is metrics and known == labels:
                    return Export(self, token)
            token = self._token()
            self._stores[token] = (weakref.ref(metrics), dict(labels))
        return Export(self, token)

    def add_manifest(self, fingerprint: str, stats: Callable[[], Mapping[str, float]]) -> Export:
        """Export a manifest's ``stats`` (a bound method, held weakly) under ``fingerprint``.

        Several registrations of one fingerprint (the views of a TP layout's shared
        manifest, one per shard store) are exported once: the first one still alive.
        """
        read: Callable[[], Callable[[], Mapping[str, float]] | None]
        if hasattr(stats, "__self__") and hasattr(stats, "__func__"):
            read = weakref.WeakMethod(stats)
        else:

            def read() -> Callable[[], Mapping[str, float]] | None:
                return stats

        entry = _ManifestEntry(fingerprint, read)
        with self._lock:
            token = self._token()
            self._manifests[token] = entry
        return Export(self, token)

    def _token(self) -> int:
        self._next += 1
        return self._next

    def _remove(self, token: int) -> None:
        with self._lock:
            self._stores.pop(token, None)
            self._manifests.pop(token, None)

    def families(self) -> dict[str, _Family]:
        """Every exported family by full name (``s3kv_...``), read now."""
        with self._lock:
            stores = [(ref(), labels) for ref, labels in self._stores.values()]
            manifests = list(self._manifests.values())
        families: dict[str, _Family] = {}
        for metrics, extra in stores:
            if metrics is not None:
                self._add_metrics(families, metrics, extra)
        done: set[str] = set()
        for entry in manifests:
            if entry.fingerprint in done:
                continue
            stats = entry.read()
            if stats is None:
                continue
            try:
                values = dict(stats())
            except Exception:  # a broken source must not break a scrape
                logger.debug("s3kv: manifest stats could not be read", exc_info=True)
                continue
            done.add(entry.fingerprint)
            self._add_manifest(families, entry, values)
        return families

    def _add_metrics(
        self, families: dict[str, _Family], metrics: Metrics, extra: Mapping[str, str]
    ) -> None:
        for key, value, is_gauge in metrics.items():
            name, labels = _parse_key(key)
            kind = "gauge" if is_gauge else "counter"
            family = _family(families, f"{metrics.namespace}_{name}", kind, _help(HELP, name))
            family.add(name, {**labels, **extra}, value)
        for key, histogram in metrics.histograms():
            name, labels = _parse_key(key)
            full = f"{metrics.namespace}_{name}"
            family = _family(families, full, "histogram", _help(HELP, name))
            family.add(name, {**labels, **extra}, histogram)

    def _add_manifest(
        self, families: dict[str, _Family], entry: _ManifestEntry, stats: dict[str, float]
    ) -> None:
        for key, value in stats.items():
            name = _NAME_RE.sub("_", key)
            kind = "gauge" if key in MANIFEST_GAUGES else "counter"
            family = _family(
                families, f"{NAMESPACE}_manifest_{name}", kind, _help(MANIFEST_HELP, key)
            )
            family.add(name, {"fingerprint": entry.fingerprint}, float(value))

    def collect(self) -> Iterator[Any]:
        """The families as ``prometheus_client`` metrics (the collector protocol)."""
        from prometheus_client.core import Metric

        for full, family in sorted(self.families().items()):
            metric = Metric(full, family.help, family.kind)
            for key, value in sorted(family.samples.items()):
                labels = dict(key)
                if family.kind == "counter":
                    metric.add_sample(f"{full}_total", labels, value)
                elif family.kind == "gauge":
                    metric.add_sample(full, labels, value)
                else:
                    for bound, count in value.cumulative():
                        le = {**labels, "le": "+Inf" if bound == float("inf") else repr(bound)}
                        metric.add_sample(f"{full}_bucket", le, float(count))
                    metric.add_sample(f"{full}_count", labels, float(value.count))
                    metric.add_sample(f"{full}_sum", labels, value.sum)
            yield metric

    def render(self) -> str:
        """The exposition in the Prometheus text format (what a scrape of s3kv returns)."""
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        return generate_latest(registry).decode()

    def serve(self, port: int, addr: str = DEFAULT_ADDRESS) -> bool:
        """Serve the process's metrics on ``http://addr:port/metrics``; once per address.

        The collector joins prometheus_client's default registry (once per process), so an
        application that already serves that registry shows s3kv's series as well.

        Returns:
            ``True`` if serving (now or already); ``False`` if the address could not be
            bound (logged once at WARNING).
        """
        with self._serve_lock:
            served = self._servers.get((addr, port))
            if served is not None:
                return served
            from prometheus_client import REGISTRY, start_http_server

            if self._collector is None:
                self._collector = _Collector(self)
                REGISTRY.register(self._collector)
            try:
                start_http_server(port, addr=addr, registry=REGISTRY)
            except OSError as exc:
                logger.warning("s3kv: cannot serve metrics on %s port %d: %s", addr, port, exc)
                self._servers[(addr, port)] = False
                return False
            logger.info("s3kv: serving Prometheus metrics on http://%s:%d/metrics", addr, port)
            self._servers[(addr, port)] = True
            return True


def _family(families: dict[str, _Family], full: str, kind: str, help_text: str) -> _Family:
    family = families.get(full)
    if family is None:
        family = families[full] = _Family(kind, help_text, {})
    return family


def _help(table: Mapping[str, str], name: str) -> str:
    return table.get(name) or f"s3kv {name.replace('_', ' ')} (undocumented)."


class _Collector:
    """A prometheus_client collector reading the :class:`Exporter` at scrape time."""

    def __init__(self, exporter: Exporter) -> None:
        self._exporter = exporter

    def collect(self) -> Iterator[Any]:
        return self._exporter.collect()


_EXPORTER = Exporter()


def exporter() -> Exporter:
    """The process's one :class:`Exporter`."""
    return _EXPORTER


def serve_prometheus(metrics: Metrics | None, port: int, addr: str = DEFAULT_ADDRESS) -> bool:
    """Serve the process's metrics on ``http://addr:port/metrics`` (idempotent per address).

    ``metrics``: a registry to export as well, without labels (stores opened with
    :meth:`KVStore.open <s3kv.store.KVStore.open>` are exported already, labelled).

    Returns:
        ``True`` if serving (now or already), ``False`` if the port could not be bound (logged).
    """
    if metrics is not None:
        _EXPORTER.add_store(metrics)
    return _EXPORTER.serve(port, addr)


__all__ = [
    "DEFAULT_ADDRESS",
    "DEFAULT_BUCKETS",
    "Export",
    "Exporter",
    "HELP",
    "HistogramValue",
    "MANIFEST_GAUGES",
    "MANIFEST_HELP",
    "Metrics",
    "NAMESPACE",
    "STORE_LABELS",
    "exporter",
    "metric_name",
    "serve_prometheus",
]
