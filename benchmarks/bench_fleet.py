"""A fleet of instances sharing one manifest, simulated in one process. JSON lines.

Every figure below comes from real :class:`~s3kv.manifest.Manifest` objects (and, for the
large fleets, light writers that PUT segments through the real ``SegmentWriter``) over an
in-memory bucket wrapped by a backend that counts GET / PUT / LIST / DELETE separately.
Time is simulated: a heap of events calls ``flush()``, ``refresh()`` and ``compact_once()``
by hand in time order, with the default intervals (flush 60 s, compaction cycle 20 s,
refresh 10 s, lease 60 s), each instance at its own random phase. No threads, no sleeping.

* ``fleet.startup_requests``: requests a NEW instance's ``Manifest.open`` issues after a
  simulated day of 100 busy writers (every writer PUTs one segment of new keys a minute:
  144k segments), with no operator action. Target <= 10. (``--quick``: 6 simulated hours.)
* ``fleet.startup_ms_sim``: round trips of that open x 20 ms. The open is run again with
  20 ms slept per request and the library's own thread pool; the rounds are the longest
  chain of requests each started after the previous one ended (parallel GETs count once).
* ``fleet.refresh_requests_per_instance``: requests of one instance's refresh (one refresh
  interval), at W = 1, 100, 1000 writers. Must not grow with W.
* ``fleet.requests_per_s``: fleet-wide requests per second at W = 1, 100, 1000 (W
  instances, each a writer and a reader, plus the elected compactor). Readers are a few
  real Manifests; the fleet's reader requests are W times their per-instance rate.
* ``fleet.usd_per_month``: those requests at AWS S3 Standard list prices, W = 1000.
* ``fleet.visibility_s``: from ``record_write`` on one instance until ``may_contain`` is
  true on another (worst, with the mean), over sampled keys of the day-long run.
* ``fleet.compactor_handover_s``: the lease holder vanishes; seconds until another
  instance holds the lease (worst over trials). Target <= 2 x lease.
* ``fleet.bloom_fpr`` / ``fleet.bloom_bytes_per_key``: the key filter of a snapshot written
  by the real compaction path, loaded as readers load it (``KeyFilter``), probed with
  random non-member keys; 1M keys (and 10M, 100M without ``--quick``).
* ``fleet.s3_startup_requests`` / ``fleet.s3_startup_ms``: a small fleet (5 writers, 2
  readers) on a real local S3 server (SeaweedFS), then a new instance's open, wall clock.

Simulation notes. The manifest measures lease and heartbeat ages with its injectable
``monotonic`` clock, which the benchmark sets to the simulated clock; it also points the
``time`` name of the manifest modules at that clock while it simulates. With an in-memory
bucket the library's thread pool for parallel GETs is pure overhead, so the simulation maps
serially (the same requests); ``fleet.startup_ms_sim`` and the S3 run use the real pool.

Usage: ``python benchmarks/bench_fleet.py [--quick]``.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

import s3kv.manifest.snapshot as snapshot_module
from s3kv.keys import ROOT_HASH, BlockHash
from s3kv.manifest import (
    KIND_WRITE,
    RECORD_DTYPE,
    CompactionPolicy,
    KeyFilter,
    Manifest,
    ManifestIO,
    ManifestLog,
    SegmentWriter,
    compact,
)
from s3kv.manifest.filters import shard_of
from s3kv.manifest.snapshot import read_filters, shard_bits_for
from s3kv.manifest.xorfilter import XorFilter
from s3kv.storage import Backend, DelegatingBackend, DeleteResult, MemoryBackend, ObjectInfo

PREFIX, FP = "fleet", "fp-fleet"
FPR = 1e-6
CAPACITY = 1 << 16
T0 = 1_700_000_000.0
FLUSH_S, COMPACT_S, REFRESH_S, LEASE_S = 60.0, 20.0, 10.0, 60.0
BLOCK_BYTES = 4 << 20
LATENCY_S = 0.020
#: Timers drift: each period is this much longer or shorter (uniform), so the phases of
#: writers, compactor and readers wander over a run as real threads' do.
JITTER_S = 0.25
LIST_PAGE = DELETE_BATCH = 1000
#: AWS S3 Standard list prices (us-east-1), dollars per request.
USD_PUT_LIST = 0.005 / 1000  # PUT, COPY, POST, LIST
USD_GET = 0.0004 / 1000  # GET, HEAD and all other requests
MONTH_S = 30 * 86400.0
SHARD_KEYS = CompactionPolicy().shard_keys

T = TypeVar("T")
R = TypeVar("R")
Keys = npt.NDArray[np.void]


def emit(metric: str, value: float, unit: str, **extra: Any) -> None:
    # NOTE: 3 decimals as the other benches, but rates such as 3e-7 keep 4 significant digits
    shown = round(value, 3) if value == 0 or abs(value) >= 0.01 else float(f"{value:.4g}")
    print(json.dumps({"metric": metric, "value": shown, "unit": unit, **extra}))
    sys.stdout.flush()


def skip(metric: str, unit: str, reason: str) -> None:
    print(json.dumps({"metric": metric, "value": None, "unit": unit, "skipped": reason}))
    sys.stdout.flush()


# --- simulated time ------------------------------------------------------------------------


class SimClock:
    """A settable epoch clock."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class _SimTime:
    """Stands in for the ``time`` module inside the manifest modules while simulating."""

    def __init__(self, clock: SimClock) -> None:
        self._clock = clock

    def monotonic(self) -> float:
        return self._clock()

    def time(self) -> float:
        return self._clock()

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def _serial(fn: Callable[[T], R], items: Sequence[T], workers: int = 0) -> list[R]:
    return [fn(item) for item in items]


@contextmanager
def simulated(clock: SimClock, *, serial: bool) -> Iterator[None]:
    """Point the manifest modules' ``time`` at ``clock`` (and, if asked, map serially)."""
    saved: list[tuple[ModuleType, str, object]] = []
    modules = [m for name, m in list(sys.modules.items()) if name.startswith("s3kv.manifest")]
    pooled = snapshot_module.parallel
    for module in modules:
        if getattr(module, "time", None) is time:
            saved.append((module, "time", time))
            module.time = _SimTime(clock)  # type: ignore[attr-defined]
        if serial and getattr(module, "parallel", None) is pooled:
            saved.append((module, "parallel", pooled))
            module.parallel = _serial  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


# --- counting -------------------------------------------------------------------------------


class Tally:
    """Requests by (role, operation); ``role`` is set by whoever is about to call."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self.role = "setup"
        self.total = 0
        self._lock = threading.Lock()

    def add(self, op: str, n: int = 1) -> None:
        with self._lock:
            self.counts[(self.role, op)] += n
            self.total += n

    def ops(
        self, roles: Callable[[str], bool], since: Counter[tuple[str, str]] | None = None
    ) -> Counter[str]:
        """Requests by operation of the roles selected (minus ``since``)."""
        found: Counter[str] = Counter()
        base = since or Counter()
        for (role, op), n in self.counts.items():
            if roles(role) and n > base[(role, op)]:
                found[op] += n - base[(role, op)]
        return found


class CountingBackend(DelegatingBackend):
    """Counts GET / PUT / LIST (per page of 1000) / DELETE (per batch of 1000) / HEAD.

    With ``latency_s``, every request also sleeps that long in the calling thread.
    """

    def __init__(self, inner: Backend, tally: Tally, latency_s: float = 0.0) -> None:
        super().__init__(inner)
        self.tally = tally
        self.latency_s = latency_s
        self.timeline: list[tuple[float, float]] = []  # (start, end) with latency_s only
        self._lock = threading.Lock()

    def _op(self, op: str, n: int = 1) -> None:
        self.tally.add(op, n)
        if self.latency_s:
            started = time.perf_counter()
            time.sleep(self.latency_s)
            with self._lock:
                self.timeline.append((started, time.perf_counter()))

    def rounds(self) -> int:
        """Round trips on the critical path: the longest chain of requests each of which
        started after the one before it ended (requests in flight together count once)."""
        spans = sorted(self.timeline)
        depth: list[int] = []
        for i, (start, _) in enumerate(spans):
            before = [depth[j] for j in range(i) if spans[j][1] <= start]
            depth.append(1 + max(before, default=0))
        return max(depth, default=0)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        self._op("GET")
        return self.inner.get(key, max_bytes=max_bytes)

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        self._op("PUT")
        return self.inner.put(key, data, if_absent=if_absent)

    def head(self, key: str) -> ObjectInfo | None:
        self._op("HEAD")
        return self.inner.head(key)

    def delete_many(self, keys: Iterable[str]) -> DeleteResult:
        batch = list(keys)
        self._op("DELETE", max(1, -(-len(batch) // DELETE_BATCH)))
        return self.inner.delete_many(batch)

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        self._op("LIST")
        return self._pages(self.inner.list(prefix, start_after=start_after))

    def _pages(self, items: Iterator[ObjectInfo]) -> Iterator[ObjectInfo]:
        for seen, info in enumerate(items, start=1):
            if seen % LIST_PAGE == 0:
                self._op("LIST")
            yield info

    def list_dirs(self, prefix: str) -> Iterator[str]:
        self._op("LIST")
        return self.inner.list_dirs(prefix)


def monthly_usd(per_s: Counter[str] | dict[str, float], *, delete_billed: bool = False) -> float:
    """Dollars per 30 days of ``per_s`` requests per second, by operation."""
    put_like = per_s.get("PUT", 0.0) + per_s.get("LIST", 0.0)
    if delete_billed:  # DeleteObjects is a POST; AWS lists DELETE requests as free
        put_like += per_s.get("DELETE", 0.0)
    get_like = per_s.get("GET", 0.0) + per_s.get("HEAD", 0.0)
    return (put_like * USD_PUT_LIST + get_like * USD_GET) * MONTH_S


# --- the fleet ------------------------------------------------------------------------------


@dataclass
class FleetSpec:
    """Who is in the fleet.

    Attributes:
        writers: W, the writers (the first ``full_writers`` are real Manifests, the rest
            PUT segments through ``SegmentWriter``).
        full_writers: Writers that are real Manifests (refresh, compaction candidates).
        observers: Real Manifests that only read (and are compaction candidates); the
            visibility of other instances' writes is measured on them.
        keys_per_flush: New keys each writer writes per flush interval.
        sample_every: One written key in this many is followed for visibility.
        seed: Randomness of phases and keys.
    """

    writers: int
    full_writers: int
    observers: int
    keys_per_flush: int = 4
    sample_every: int = 10
    seed: int = 0


class Fleet:
    """Instances over one bucket, driven by a heap of simulated-time events."""

    def __init__(self, spec: FleetSpec, inner: Backend | None = None, start: float = T0):
        self.spec = spec
        self.clock = SimClock(start)
        self.tally = Tally()
        self.inner = inner if inner is not None else MemoryBackend(clock=self.clock)
        self.backend = CountingBackend(self.inner, self.tally)
        self.rng = np.random.default_rng(spec.seed)
        random.seed(spec.seed)  # NOTE: Manifest's takeover jitter
        self.policy = CompactionPolicy(interval_s=COMPACT_S, lease_s=LEASE_S)
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.instances: list[Instance] = []
        self.light: list[LightWriter] = []
        self.holder = ""
        self.holder_since = start
        self.holders: list[tuple[float, str]] = []
        self.visibility: list[float] = []
        self.keys_written = 0
        self.probes: list[tuple[float, int, int, int]] = []  # (hour, requests, shards, deltas)
        self.mark_counts: Counter[tuple[str, str]] = Counter()
        self.mark_time = start

    @property
    def now(self) -> float:
        return self.clock.now

    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._seq), fn))

    def every(
        self, first: float, period: float, fn: Callable[[], None], alive: Callable[[], bool]
    ) -> None:
        """``fn`` at ``first``, then every ``period`` ± ``JITTER_S`` while ``alive()``."""

        def tick() -> None:
            if not alive():
                return
            fn()
            self.at(self.now + period + self.jitter(), tick)

        self.at(first, tick)

    def writer_loop(
        self, write: Callable[[], None], flush: Callable[[], None], alive: Callable[[], bool]
    ) -> None:
        """A busy writer: flush every ``FLUSH_S`` (± jitter), having written once before each
        flush at a uniformly random time since the previous one."""

        def write_tick() -> None:
            if alive():
                write()

        def flush_tick() -> None:
            if not alive():
                return
            flush()
            due = self.now + FLUSH_S + self.jitter()
            self.at(float(self.rng.uniform(self.now, due)), write_tick)
            self.at(due, flush_tick)

        first = self.now + float(self.rng.uniform(0, FLUSH_S))
        self.at(float(self.rng.uniform(self.now, first)), write_tick)
        self.at(first, flush_tick)

    def jitter(self) -> float:
        return float(self.rng.uniform(-JITTER_S, JITTER_S))

    def run_until(self, until: float, stop: Callable[[], bool] | None = None) -> None:
        """Run the events up to ``until`` (or until ``stop()`` says so after one)."""
        while self._events and self._events[0][0] <= until:
            when, _, fn = heapq.heappop(self._events)
            self.clock.now = when
            fn()
            if stop is not None and stop():
                return
        self.clock.now = until

    def populate(self) -> None:
        """Open every real instance (at the start time), then schedule everyone."""
        spec = self.spec
        for i in range(spec.full_writers):
            self.instances.append(Instance(self, f"w{i:04d}", writer=True, observer=False))
        for i in range(spec.observers):
            self.instances.append(Instance(self, f"r{i:04d}", writer=False, observer=True))
        for i in range(spec.full_writers, spec.writers):
            self.light.append(LightWriter(self, f"w{i:04d}"))
        for instance in self.instances:
            instance.schedule()
        for writer in self.light:
            writer.schedule()

    def new_keys(self, writer: str) -> list[bytes]:
        """``keys_per_flush`` fresh keys; every ``sample_every``-th is followed."""
        raw = self.rng.bytes(16 * self.spec.keys_per_flush)
        keys = [raw[i : i + 16] for i in range(0, len(raw), 16)]
        for key in keys:
            self.keys_written += 1
            if self.keys_written % self.spec.sample_every == 0:
                for instance in self.instances:
                    if instance.observer and instance.alive and instance.name != writer:
                        instance.waiting[key] = (self.now, writer)
        return keys

    def note_holder(self, instance: Instance) -> None:
        if instance.manifest.is_compactor and self.holder != instance.name:
            self.holder, self.holder_since = instance.name, self.now
            self.holders.append((self.now, instance.name))

    def mark(self) -> None:
        """Start the measurement window now."""
        self.mark_counts = Counter(self.tally.counts)
        self.mark_time = self.now

    def window_ops(self, roles: Callable[[str], bool]) -> Counter[str]:
        return self.tally.ops(roles, self.mark_counts)


class Instance:
    """One real Manifest: refreshes, takes part in compaction, and maybe writes."""

    def __init__(self, fleet: Fleet, name: str, *, writer: bool, observer: bool) -> None:
        self.fleet = fleet
        self.name = name
        self.writer = writer
        self.observer = observer
        self.alive = True
        self.waiting: dict[bytes, tuple[float, str]] = {}  # others' keys -> (written, by)
        self.refreshes: list[tuple[float, int, bool]] = []  # (time, requests, was holder)
        fleet.tally.role = f"open:{name}"
        self.manifest = Manifest.open(fleet.backend, PREFIX, FP, capacity=CAPACITY, fpr=FPR,
                                      instance_id=name, clock=fleet.clock,
                                      monotonic=fleet.clock,
                                      compaction=fleet.policy)  # fmt: skip

    def schedule(self) -> None:
        fleet, phase = self.fleet, self.fleet.rng.uniform
        now = fleet.now

        def alive() -> bool:
            return self.alive

        fleet.every(now + phase(0, REFRESH_S), REFRESH_S, self.refresh, alive)
        fleet.at(now + phase(0, REFRESH_S), self.compact)
        if self.writer:
            fleet.writer_loop(self.write, self.flush, alive)

    def refresh(self) -> None:
        tally = self.fleet.tally
        before = tally.total
        tally.role = f"reader:{self.name}"
        version = self.manifest.version
        self.manifest.refresh()
        self.refreshes.append((self.fleet.now, tally.total - before, self.manifest.is_compactor))
        if self.manifest.version != version:  # NOTE: keys only arrive with a new entry
            self.check_visibility()

    def compact(self) -> None:
        """``compact_once`` on the schedule of ``Manifest._run_compactor``."""
        if not self.alive:
            return
        self.fleet.tally.role = f"compactor:{self.name}"
        version = self.manifest.version
        self.manifest.compact_once()
        self.fleet.note_holder(self)
        holder = self.manifest.is_compactor
        if holder and self.manifest.version != version:  # the holder applies its own entries
            self.check_visibility()
        wait = COMPACT_S if holder else min(COMPACT_S, REFRESH_S)
        self.fleet.at(self.fleet.now + wait + self.fleet.jitter(), self.compact)

    def write(self) -> None:
        for key in self.fleet.new_keys(self.name):
            self.manifest.record_write(BlockHash(key), ROOT_HASH, BLOCK_BYTES)

    def flush(self) -> None:
        self.fleet.tally.role = f"writer:{self.name}"
        self.manifest.flush(force=False)

    def check_visibility(self) -> None:
        if not self.waiting:
            return
        now = self.fleet.now
        for key in [k for k in self.waiting if self.manifest.may_contain(k)]:
            self.fleet.visibility.append(now - self.waiting.pop(key)[0])


class LightWriter:
    """A writer that only PUTs segments (``SegmentWriter``), as a Manifest's flush does."""

    def __init__(self, fleet: Fleet, name: str) -> None:
        self.fleet = fleet
        self.name = name
        self.segments = SegmentWriter(ManifestIO(fleet.backend, PREFIX, FP), name, fleet.clock)
        self.pending: list[tuple[bytes, float]] = []

    def schedule(self) -> None:
        self.fleet.writer_loop(self.write, self.flush, lambda: True)

    def write(self) -> None:
        now = self.fleet.now
        self.pending.extend((key, now) for key in self.fleet.new_keys(self.name))

    def flush(self) -> None:
        if not self.pending:
            return
        records = np.zeros(len(self.pending), RECORD_DTYPE)
        records["key"] = np.frombuffer(b"".join(k for k, _ in self.pending), "V16")
        records["parent"] = np.frombuffer(ROOT_HASH, "V16")[0]
        records["time"] = [t for _, t in self.pending]
        records["size"], records["kind"], records["count"] = BLOCK_BYTES, KIND_WRITE, 1
        self.fleet.tally.role = f"writer:{self.name}"
        self.segments.write(records)
        self.pending.clear()


# --- fleet runs -----------------------------------------------------------------------------


@dataclass
class Rates:
    """What one fleet run measured over its window."""

    writers: int
    window_s: float
    refresh_mean: float  # requests per refresh call of a non-holder instance
    refresh_max: int
    refresh_calls: int
    reader_per_instance_s: dict[str, float]
    writers_s: dict[str, float]
    compactor_s: dict[str, float]
    fleet_s: dict[str, float]
    readers: int

    @property
    def total_s(self) -> float:
        return sum(self.fleet_s.values())


def measure_rates(fleet: Fleet) -> Rates:
    """Fleet-wide requests/s over the window: W readers, W writers, one compactor."""
    window = fleet.now - fleet.mark_time
    ever_held = {name for _, name in fleet.holders}
    plain = [i for i in fleet.instances if i.name not in ever_held]
    calls = [n for i in plain for t, n, _ in i.refreshes if t > fleet.mark_time]
    reader_roles = {f"reader:{i.name}" for i in plain}
    reader_ops = fleet.window_ops(lambda role: role in reader_roles)
    per_instance = {op: n / len(plain) / window for op, n in reader_ops.items()}
    writer_ops = fleet.window_ops(lambda role: role.startswith("writer:"))
    compactor_ops = fleet.window_ops(lambda role: role.startswith("compactor:"))
    writers_s = {op: n / window for op, n in writer_ops.items()}
    compactor_s = {op: n / window for op, n in compactor_ops.items()}
    w = fleet.spec.writers
    ops = set(per_instance) | set(writers_s) | set(compactor_s)
    total = {
        op: w * per_instance.get(op, 0.0) + writers_s.get(op, 0.0) + compactor_s.get(op, 0.0)
        for op in sorted(ops)
    }
    return Rates(
        writers=w,
        window_s=window,
        refresh_mean=statistics.fmean(calls),
        refresh_max=max(calls),
        refresh_calls=len(calls),
        reader_per_instance_s=per_instance,
        writers_s=writers_s,
        compactor_s=compactor_s,
        fleet_s=total,
        readers=len(plain),
    )


def _rounded(values: dict[str, float], digits: int = 4) -> dict[str, float]:
    return {k: round(v, digits) for k, v in sorted(values.items())}


def run_fleet(
    spec: FleetSpec, hours: float, warmup_s: float, probe_every_s: float = 0.0
) -> tuple[Fleet, Rates, float]:
    """Simulate ``hours``; measure rates after ``warmup_s``. Returns (fleet, rates, wall s).

    With ``probe_every_s``, a new instance opens that often (uncounted by the fleet) and
    its requests go to ``fleet.probes``.
    """
    started = time.perf_counter()
    fleet = Fleet(spec)
    end = T0 + hours * 3600
    with simulated(fleet.clock, serial=True):
        fleet.populate()
        fleet.run_until(T0 + warmup_s)
        fleet.mark()
        if probe_every_s:
            when = T0 + probe_every_s
            while when <= end:
                if when >= fleet.now:
                    fleet.run_until(when)
                    probe_open(fleet)
                when += probe_every_s
        fleet.run_until(end)
    return fleet, measure_rates(fleet), time.perf_counter() - started


def probe_open(fleet: Fleet) -> None:
    """Open a new (non-compacting) instance now; note its requests, shards and deltas."""
    tally = Tally()
    manifest = Manifest.open(CountingBackend(fleet.inner, tally), PREFIX, FP, capacity=CAPACITY,
                             fpr=FPR, instance_id="probe", clock=fleet.clock,
                             monotonic=fleet.clock)  # fmt: skip
    entry = ManifestLog(ManifestIO(fleet.inner, PREFIX, FP)).latest()
    assert entry is not None
    assert manifest.open_requests == tally.total
    shards = len(entry.snapshot.shard_keys) if entry.snapshot else 0
    hours = (fleet.now - T0) / 3600
    fleet.probes.append((hours, tally.total, shards, len(entry.deltas)))


def startup_after(fleet: Fleet, hours: float, wall_s: float, note: str) -> None:
    """A new instance opens the bucket the fleet left: requests, then 20 ms-latency wall."""
    tally = Tally()
    tally.role = "open"
    with simulated(fleet.clock, serial=True):
        fresh = Manifest.open(CountingBackend(fleet.inner, tally), PREFIX, FP, capacity=CAPACITY,
                              fpr=FPR, instance_id="newcomer", clock=fleet.clock,
                              monotonic=fleet.clock, compaction=fleet.policy)  # fmt: skip
    entry = ManifestLog(ManifestIO(fleet.inner, PREFIX, FP)).latest()
    assert entry is not None
    snapshot = entry.snapshot
    shards = len(snapshot.shard_keys) if snapshot else 0
    by_op = {op: n for (_, op), n in sorted(tally.counts.items())}
    assert fresh.open_requests == tally.total, (fresh.open_requests, tally.total)
    objects = Counter(info.key.split("/manifest/", 1)[-1].split("/", 1)[0]
                      for info in fleet.inner.list(""))  # fmt: skip
    emit("fleet.startup_requests", tally.total, "requests", target=10, by_op=by_op,
         writers=fleet.spec.writers, sim_hours=hours, segments_written=_segments(fleet),
         keys_written=fleet.keys_written, log_version=entry.version, shards=shards,
         deltas=len(entry.deltas), snapshot_keys=snapshot.keys if snapshot else 0,
         generation=snapshot.generation if snapshot else 0, objects_left=dict(objects),
         hourly_requests=[n for _, n, _, _ in fleet.probes],
         hourly_max=max((n for _, n, _, _ in fleet.probes), default=None),
         hourly_deltas=[d for _, _, _, d in fleet.probes],
         sim_wall_s=round(wall_s, 1), note=note)  # fmt: skip

    # The same open with 20 ms per request and the real thread pool (real time, real sleeps).
    def timed_open(latency: float) -> tuple[float, int, int]:
        best, requests, rounds = math.inf, 0, 0
        for _ in range(3):
            counting = CountingBackend(fleet.inner, Tally(), latency)
            started = time.perf_counter()
            manifest = Manifest.open(counting, PREFIX, FP, capacity=CAPACITY, fpr=FPR,
                                     instance_id="newcomer", clock=fleet.clock)  # fmt: skip
            best = min(best, time.perf_counter() - started)
            requests, rounds = manifest.open_requests, counting.rounds()
        return best * 1e3, requests, rounds

    cpu_ms, _, _ = timed_open(0.0)
    wall_ms, requests, rounds = timed_open(LATENCY_S)
    ideal = 3 + (1 if shards or entry.deltas else 0)
    emit("fleet.startup_ms_sim", rounds * LATENCY_S * 1e3, "ms", latency_ms=LATENCY_S * 1e3,
         requests=requests, rounds=rounds, rounds_ideal=ideal, ideal_ms=ideal * LATENCY_S * 1e3,
         wall_ms=round(wall_ms, 1), cpu_ms=round(cpu_ms, 1), shards=shards,
         deltas=len(entry.deltas),
         note="rounds x 20 ms; rounds measured: the open ran with 20 ms slept per request and "
              "the library's own thread pool, rounds = longest chain of requests each started "
              "after the previous ended; wall_ms adds the client CPU; rounds_ideal = LATEST, "
              "entry, probe, then ONE parallel round of shard filters + deltas")  # fmt: skip


def _segments(fleet: Fleet) -> int:
    return sum(n for (role, op), n in fleet.tally.counts.items()
               if role.startswith("writer:") and op == "PUT")  # fmt: skip


def report_visibility(fleet: Fleet, hours: float) -> None:
    seen = sorted(fleet.visibility)
    waiting = [fleet.now - t for i in fleet.instances for t, _ in i.waiting.values()]
    emit("fleet.visibility_s", seen[-1], "s", target=120, mean_s=round(statistics.fmean(seen), 1),
         p50_s=round(seen[len(seen) // 2], 1), p99_s=round(seen[int(len(seen) * 0.99)], 1),
         keys=len(seen), still_waiting=len(waiting),
         oldest_waiting_s=round(max(waiting, default=0.0), 1), writers=fleet.spec.writers,
         sim_hours=hours, intervals_s={"flush": FLUSH_S, "compaction": COMPACT_S,
                                       "refresh": REFRESH_S})  # fmt: skip


def report_rates(runs: list[tuple[Rates, float, float]]) -> None:
    base = runs[0][0].refresh_mean
    for rates, hours, _wall in runs:
        emit("fleet.refresh_requests_per_instance", rates.refresh_mean, "requests",
             writers=rates.writers, interval_s=REFRESH_S, max=rates.refresh_max,
             vs_w1=round(rates.refresh_mean / base, 3), refreshes=rates.refresh_calls,
             readers_measured=rates.readers, sim_hours=hours)  # fmt: skip
    for rates, hours, wall in runs:
        emit("fleet.requests_per_s", rates.total_s, "req/s", writers=rates.writers,
             by_op=_rounded(rates.fleet_s, 3),
             reader_per_instance=_rounded(rates.reader_per_instance_s),
             writers_total=_rounded(rates.writers_s, 3),
             compactor=_rounded(rates.compactor_s, 3),
             usd_per_month=round(monthly_usd(rates.fleet_s), 2), window_h=round(
                 rates.window_s / 3600, 2), sim_hours=hours, sim_wall_s=round(wall, 1),
             note=f"{rates.readers} real reader Manifests measured; fleet readers = W x "
                  "per-instance rate (every instance refreshes); writers and compactor as "
                  "simulated")  # fmt: skip
    rates = runs[-1][0]
    emit("fleet.usd_per_month", monthly_usd(rates.fleet_s), "USD", target=640,
         writers=rates.writers, month_days=30,
         if_delete_billed_as_post=round(monthly_usd(rates.fleet_s, delete_billed=True), 2),
         by_op_usd=_rounded({op: monthly_usd({op: v}) for op, v in rates.fleet_s.items()}, 2),
         prices="S3 Standard: PUT/COPY/POST/LIST $0.005/1k, GET and others $0.0004/1k, "
                "DELETE free")  # fmt: skip


# --- compactor handover ---------------------------------------------------------------------


def handover_trial(seed: int, *, graceful: bool) -> tuple[float, int, float]:
    """Kill (or close) the holder at a random time; seconds until another holds the lease.

    Returns (seconds, log entries published in the 5 minutes after, the oldest key of a live
    writer that a live observer still does not see then).
    """
    fleet = Fleet(FleetSpec(writers=10, full_writers=2, observers=3, seed=seed))
    with simulated(fleet.clock, serial=True):
        fleet.populate()
        kill_at = T0 + 300 + float(fleet.rng.uniform(0, 2 * COMPACT_S))
        fleet.run_until(kill_at)
        victim = next(i for i in fleet.instances if i.name == fleet.holder)
        victim.alive = False  # its refresh, flush and compaction events stop: it vanished
        if graceful:
            fleet.tally.role = f"compactor:{victim.name}"
            victim.manifest.close(flush=True)
        fleet.run_until(kill_at + 20 * LEASE_S, stop=lambda: fleet.holder != victim.name)
        assert fleet.holder != victim.name, "nobody took the lease over"
        seconds = fleet.holder_since - kill_at
        watcher = next(i for i in fleet.instances if i.alive and i.name != fleet.holder)
        before = watcher.manifest.version
        fleet.run_until(fleet.now + 300)
        # Keys of live writers still unseen by a live observer (the victim's unflushed
        # writes vanished with it): the new holder must have folded everything else.
        unseen = [fleet.now - t for i in fleet.instances if i.alive
                  for t, by in i.waiting.values() if by != victim.name]  # fmt: skip
    return seconds, watcher.manifest.version - before, max(unseen, default=0.0)


def report_handover(trials: int) -> None:
    started = time.perf_counter()
    killed = [handover_trial(seed, graceful=False) for seed in range(trials)]
    closed = [handover_trial(1000 + seed, graceful=True) for seed in range(max(3, trials // 3))]
    seconds = [s for s, _, _ in killed]
    assert all(published > 0 for _, published, _ in killed + closed), "no publishing after"
    emit("fleet.compactor_handover_s", max(seconds), "s", target=2 * LEASE_S, lease_s=LEASE_S,
         mean_s=round(statistics.fmean(seconds), 1), min_s=round(min(seconds), 1),
         trials=trials, graceful_close_worst_s=round(max(s for s, _, _ in closed), 1),
         graceful_trials=len(closed), entries_5min_after=min(p for _, p, _ in killed),
         oldest_unseen_key_after_s=round(max(u for _, _, u in killed + closed), 1),
         sim_wall_s=round(time.perf_counter() - started, 1),
         note="seconds from the holder vanishing (no more refresh/flush/compact_once) until "
              "another instance's is_compactor; graceful: Manifest.close() releases")  # fmt: skip


# --- key filter false-positive rate ------------------------------------------------------


def random_keys(rng: np.random.Generator, n: int) -> Keys:
    keys: Keys = np.frombuffer(rng.bytes(16 * n), dtype="V16")
    return keys


def false_positives(keyfilter: KeyFilter, probes: int, rng: np.random.Generator) -> int:
    """Positives among ``probes`` random keys (non-members but for a 2**-128 chance)."""
    found, chunk = 0, 500_000
    for start in range(0, probes, chunk):
        raw = rng.bytes(16 * min(chunk, probes - start))
        batch = [raw[i : i + 16] for i in range(0, len(raw), 16)]
        found += int(np.count_nonzero(keyfilter.contains_many(batch)))
    return found


def poisson_upper95(events: int) -> float:
    """One-sided 95% upper bound of a Poisson mean after observing ``events`` (bisection)."""

    def cdf(mean: float) -> float:
        term = total = math.exp(-mean)
        for k in range(1, events + 1):
            term *= mean / k
            total += term
        return total

    low, high = 0.0, 10.0 + 3.0 * events
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) > 0.05 else (low, mid)
    return high


def report_filter(label: str, keyfilter: KeyFilter, n_keys: int, members: Keys, probes: int,
                  rng: np.random.Generator, **extra: Any) -> None:  # fmt: skip
    sample = [bytes(k) for k in members[:: max(1, len(members) // 10_000)]]
    assert keyfilter.contains_many(sample).all(), "the filter lost member keys"
    started = time.perf_counter()
    fp = false_positives(keyfilter, probes, rng)
    probe_s = time.perf_counter() - started
    emit("fleet.bloom_fpr", fp / probes, "ratio", keys=n_keys, label=label, target=FPR,
         false_positives=fp, probes=probes,
         upper95=float(f"{poisson_upper95(fp) / probes:.3g}"), probe_s=round(probe_s, 1),
         **extra)  # fmt: skip
    emit("fleet.bloom_bytes_per_key", keyfilter.nbytes / n_keys, "bytes", keys=n_keys,
         label=label, filter_mb=round(keyfilter.nbytes / 1e6, 1), **extra)  # fmt: skip


def bloom_via_compaction(
    n_keys: int, probes: int, rng: np.random.Generator, growth: float = 0.0, live_probes: int = 0
) -> None:
    """Segments of ``n_keys`` written, ``compact()``ed, the shard filters loaded as readers do."""
    started = time.perf_counter()
    backend = MemoryBackend()
    io = ManifestIO(backend, PREFIX, FP)
    writer = SegmentWriter(io, "bulk", lambda: T0)
    keys = random_keys(rng, n_keys)
    per_segment = 250_000
    for start in range(0, n_keys, per_segment):
        part = keys[start : start + per_segment]
        records = np.zeros(len(part), RECORD_DTYPE)
        records["key"], records["time"], records["size"] = part, T0, BLOCK_BYTES
        records["kind"], records["count"] = KIND_WRITE, 1
        writer.write(records)
    report = compact(backend, PREFIX, FP, fpr=FPR, clock=lambda: T0 + 1)
    assert report.keys == n_keys, report
    entry = ManifestLog(io).latest()
    assert entry is not None
    assert entry.snapshot is not None
    shards, rebuilt = read_filters(io, entry.snapshot)
    assert not rebuilt
    growth_capacity = max(CAPACITY, entry.snapshot.keys // 8)  # as a reader's reload sizes it
    keyfilter = KeyFilter(FPR, shards, entry.snapshot.shard_bits, growth_capacity=growth_capacity)
    build_s = time.perf_counter() - started
    fp_bits = shards[0].fp_bits
    report_filter("snapshot", keyfilter, n_keys, keys, probes, rng, shards=len(shards),
                  fp_bits=fp_bits, rate_fp_bits=2.0**-fp_bits, build_s=round(build_s, 1),
                  note="snapshot written by compact(), shard filters loaded with "
                       "read_filters into a KeyFilter as a reader's reload does")  # fmt: skip
    if growth:
        # What a reader holds just before the next snapshot: the snapshot plus the keys of
        # the deltas since (a snapshot is due at snapshot_ratio x its keys) in the growth
        # partitions (scalable Bloom filters).
        extra = random_keys(rng, round(growth * n_keys))
        keyfilter.add_array(extra)
        report_filter("live", keyfilter, n_keys + len(extra), np.concatenate([keys, extra]),
                      live_probes or probes, rng, shards=len(shards), growth_keys=len(extra),
                      partitions=keyfilter.partitions,
                      note="the snapshot filter plus snapshot_ratio x keys added as deltas "
                           "(growth partitions): a reader just before the next "
                           "snapshot")  # fmt: skip


def bloom_sharded(n_keys: int, probes: int, rng: np.random.Generator) -> None:
    """``n_keys`` as the real shard layout, each shard's XorFilter built one at a time."""
    started = time.perf_counter()
    bits = shard_bits_for(n_keys, SHARD_KEYS)
    fp_bits = XorFilter.fp_bits_for(FPR)
    filters: list[XorFilter] = []
    members: list[Keys] = []
    for shard in range(1 << bits):
        raw = np.frombuffer(rng.bytes(16 * (n_keys >> bits)), np.uint8).reshape(-1, 16).copy()
        # NOTE: the leading `bits` bits name the shard (shard_of), as the compactor assigns
        if bits:
            raw[:, 0] = (raw[:, 0] & (0xFF >> bits)) | (shard << (8 - bits))
        keys: Keys = raw.view("V16").ravel()
        assert (shard_of(keys[:100], bits) == shard).all()
        filters.append(XorFilter.build(keys, fp_bits))
        members.append(keys[:1000].copy())
        del raw, keys
    keyfilter = KeyFilter(FPR, filters, bits)
    build_s = time.perf_counter() - started
    report_filter("xor_shards", keyfilter, n_keys, np.concatenate(members), probes, rng,
                  shards=len(filters), fp_bits=fp_bits, rate_fp_bits=2.0**-fp_bits,
                  build_s=round(build_s, 1),
                  note="the real shard layout (shard_bits_for at 8M keys per shard), each "
                       "shard's XorFilter built one at a time, in a KeyFilter")  # fmt: skip


# --- a real local S3 server -----------------------------------------------------------------


def s3_fleet(minutes: float) -> None:
    """5 writers and 2 readers on a local SeaweedFS for ``minutes`` (simulated), then a new
    instance opens: its requests and its real wall-clock time."""
    try:
        from s3kv.config import S3KVConfig
        from s3kv.storage import S3Backend
        from s3kv.testing.local_s3 import LocalS3
    except ImportError as exc:
        skip("fleet.s3_startup_requests", "requests", f"import: {exc}")
        return
    with tempfile.TemporaryDirectory(prefix="s3kv-fleet-") as tmp:
        try:
            server = LocalS3.start(Path(tmp), bucket="fleet", die_with_parent=True)
        except Exception as exc:
            skip("fleet.s3_startup_requests", "requests", f"{type(exc).__name__}: {exc}")
            skip("fleet.s3_startup_ms", "ms", "no local S3 server")
            return
        try:
            cfg = S3KVConfig(bucket=server.bucket, endpoint_url=server.endpoint,
                             region="us-east-1", addressing_style="path",
                             conditional_put="auto")  # fmt: skip
            backend = S3Backend.from_config(cfg, client=server.client())
            if not backend.capabilities.conditional_put:
                skip("fleet.s3_startup_requests", "requests", "server lacks conditional PUT")
                return
            start = time.time()
            spec = FleetSpec(writers=5, full_writers=5, observers=2, keys_per_flush=16,
                             sample_every=1)  # fmt: skip
            fleet = Fleet(spec, inner=backend, start=start)
            started = time.perf_counter()
            with simulated(fleet.clock, serial=False):
                fleet.populate()
                fleet.run_until(start + minutes * 60)
            sim_wall = time.perf_counter() - started
            tally = Tally()
            counting = CountingBackend(backend, tally)
            walls, requests = [], 0
            for attempt in range(5):
                tally.role = f"open{attempt}"
                before = tally.total
                began = time.perf_counter()
                fresh = Manifest.open(counting, PREFIX, FP, capacity=CAPACITY, fpr=FPR,
                                      instance_id="newcomer", clock=fleet.clock)  # fmt: skip
                walls.append((time.perf_counter() - began) * 1e3)
                requests = tally.total - before
                assert fresh.open_requests == requests
            entry = fresh.version
            by_op = {op: n for (role, op), n in sorted(tally.counts.items()) if role == "open0"}
            emit("fleet.s3_startup_requests", requests, "requests", target=10, by_op=by_op,
                 writers=5, readers=2, sim_minutes=minutes, log_version=entry,
                 keys_written=fleet.keys_written, fleet_requests=fleet.tally.total,
                 sim_wall_s=round(sim_wall, 1), server="SeaweedFS on loopback")  # fmt: skip
            seen = sorted(fleet.visibility)
            emit("fleet.s3_startup_ms", statistics.median(walls), "ms", opens=len(walls),
                 min_ms=round(min(walls), 1), max_ms=round(max(walls), 1),
                 visibility_worst_s=round(seen[-1], 1) if seen else None,
                 visibility_keys=len(seen),
                 note="real wall clock of Manifest.open against the local server")  # fmt: skip
            backend.close()
        finally:
            server.stop(grace=2.0)


# --- main -----------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter runs, 1M-key filter only")
    args = parser.parse_args()
    quick = args.quick
    rng = np.random.default_rng(2024)

    # A day of 100 busy writers, then a newcomer; W = 100 rates and visibility from it.
    day = 6.0 if quick else 24.0
    note = ("100 writers: 2 real Manifests + 98 SegmentWriters (the same segment count), 2 "
            "reader Manifests, every real instance a compaction candidate; a probe instance "
            "opened every ~hour gives hourly_requests")  # fmt: skip
    if quick:
        note += ("; QUICK: 6 of the 24 h simulated (the state repeats: one snapshot per >=100k "
                 "records, 1..6 deltas; open = 3 + shards + deltas, shards = 1 below 8M keys); "
                 "run without --quick for the full day")  # fmt: skip
    spec = FleetSpec(writers=100, full_writers=2, observers=2, keys_per_flush=4,
                     sample_every=100)  # fmt: skip
    fleet, rates100, wall100 = run_fleet(spec, hours=day, warmup_s=3600, probe_every_s=3620)
    startup_after(fleet, day, wall100, note=note)
    report_visibility(fleet, day)
    del fleet

    h1, h1000 = (2.0, 0.5) if quick else (24.0, 4.0)
    _, rates1, wall1 = run_fleet(FleetSpec(writers=1, full_writers=1, observers=2),
                                 hours=h1, warmup_s=600)  # fmt: skip
    _, rates1000, wall1000 = run_fleet(
        FleetSpec(writers=1000, full_writers=2, observers=2, sample_every=1000),
        hours=h1000,
        warmup_s=600,
    )
    report_rates([(rates1, h1, wall1), (rates100, day, wall100), (rates1000, h1000, wall1000)])

    report_handover(10 if quick else 40)

    probes = 10_000_000
    growth = CompactionPolicy().snapshot_ratio
    # NOTE: probing the growth partitions (Bloom) is ~4x slower than the xor shards
    bloom_via_compaction(1_000_000, probes, rng, growth=growth,
                         live_probes=4_000_000 if quick else probes)  # fmt: skip
    if not quick:
        bloom_via_compaction(10_000_000, probes, rng, growth=growth)
        bloom_sharded(100_000_000, probes, rng)

    s3_fleet(5.0 if quick else 15.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
