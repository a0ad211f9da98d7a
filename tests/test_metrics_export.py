"""One export per process: every store labelled, the shared manifest once, valid exposition.

Stores are opened for real (a TP=2 layout through :class:`ProcessState`, the ``file://``
backend) and scraped over HTTP from an endpoint on a free loopback port; the exposition is
parsed with prometheus_client's parsers (the Prometheus text format and the stricter
OpenMetrics one).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from s3kv.config import S3KVConfig
from s3kv.connector.shared import ProcessState, _rank_metrics
from s3kv.errors import ConfigError, EndpointError
from s3kv.keys import ROOT_HASH, ModelIdentity, chain_hashes, layout_fingerprint
from s3kv.manifest import CompactionPolicy, Manifest
from s3kv.metrics import (
    HELP,
    MANIFEST_GAUGES,
    MANIFEST_HELP,
    Exporter,
    Metrics,
    exporter,
)
from s3kv.pool import IOPool
from s3kv.staging import NumpyAllocator
from s3kv.storage import CircuitBreaker, InstrumentedBackend, MemoryBackend
from s3kv.store import KVStore

ROOT = Path(__file__).resolve().parent.parent
SHAPE = (2, 2, 4, 1, 8)
BLOCK_ELEMS = 4 * 1 * 8
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def identity(rank: int = 0, size: int = 1) -> ModelIdentity:
    return ModelIdentity(
        model_id="test/metrics",
        weights_revision="r1",
        dtype="bfloat16",
        kv_dtype="bfloat16",
        quantization="none",
        tokens_per_block=4,
        kv_factor=2,
        block_elems=BLOCK_ELEMS,
        num_layers=2,
        layout="test",
        tp_size=size,
        tp_rank=rank,
    )


def file_config(root: Path, **changes: Any) -> S3KVConfig:
    base: dict[str, Any] = {
        "bucket": "metrics",
        "endpoint_url": f"file://{root}",
        "manifest_refresh_interval": 0,
        "io_threads": 1,
    }
    base.update(changes)
    return S3KVConfig.load(environ={}, **base)


def memory_store(config: S3KVConfig) -> KVStore:
    """A store over an in-memory bucket with no background threads."""
    return KVStore.open(
        config,
        identity(),
        backend=MemoryBackend(),
        allocator=NumpyAllocator(),
        pool=IOPool(0),
        start_background=False,
    )


def scrape(port: int, host: str = "127.0.0.1", accept: str | None = None) -> str:
    request = urllib.request.Request(f"http://{host}:{port}/metrics")
    if accept:
        request.add_header("Accept", accept)
    with urllib.request.urlopen(request, timeout=5) as response:
        return str(response.read().decode())


def parse(text: str) -> dict[str, Any]:
    """Families by name, parsed as the Prometheus text format (raises on malformed text)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {family.name: family for family in text_string_to_metric_families(text)}


def parse_openmetrics(text: str) -> dict[str, Any]:
    """Families by name, parsed by the strict OpenMetrics parser."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    return {family.name: family for family in text_string_to_metric_families(text)}


def samples(families: dict[str, Any], family: str, sample: str | None = None) -> list[Any]:
    found = families.get(family)
    if found is None:
        return []
    return [s for s in found.samples if sample is None or s.name == sample]


def check_exposition(text: str) -> None:
    """Every ``s3kv_`` family has a HELP and a TYPE line; no series appears twice."""
    helps = dict(re.findall(r"^# HELP (s3kv_\w+) (.*)$", text, re.M))
    types = dict(re.findall(r"^# TYPE (s3kv_\w+) (\w+)$", text, re.M))
    assert helps, "s3kv series exported"
    assert set(helps) == set(types)
    assert all(help_text.strip() for help_text in helps.values())
    assert not [n for n, h in helps.items() if "(undocumented)" in h], "a help text per name"
    series = [line.rsplit(" ", 1)[0] for line in text.splitlines() if line.startswith("s3kv_")]
    assert len(series) == len(set(series)), "no series twice"


def save_one(store: KVStore, seed: int) -> None:
    rng = np.random.default_rng(seed)
    block = rng.integers(0, 2**16, size=SHAPE, dtype=np.uint16)
    key = chain_hashes(list(range(4 * (seed + 1))), 4)[-1]
    store.save(key, ROOT_HASH, block, dtype="bfloat16", shape=SHAPE)
    assert store.flush(timeout=10)


@pytest.fixture
def s3kv_logger() -> Iterator[logging.Logger]:
    """The ``s3kv`` logger, its level and handlers restored afterwards."""
    logger = logging.getLogger("s3kv")
    level, handlers = logger.level, list(logger.handlers)
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers


# --- one endpoint, every store ------------------------------------------------------------


def test_a_tp_layout_is_exported_whole_from_one_endpoint(tmp_path: Path) -> None:
    port = free_port()
    config = file_config(tmp_path, metrics_port=port)
    ids = [identity(0, 2), identity(1, 2)]
    layout = layout_fingerprint(ids)
    state = ProcessState()
    try:
        opened = state.open_layout(config, ids, [NumpyAllocator(), NumpyAllocator()])
        for seed, store in enumerate(opened.stores):
            save_one(store, seed)
        text = scrape(port)
        strict = parse_openmetrics(scrape(port, accept=OPENMETRICS))
    finally:
        state.close_all()
    families = parse(text)
    check_exposition(text)
    assert strict["s3kv_requests"].type == "counter"

    # Every store's series, labelled with its fingerprint and shard (the TP rank).
    # NOTE: the exporter is the process's; stores other tests left unclosed stay in it until
    # collected, so only this layout's fingerprints are looked at.
    ours = {layout, *(i.fingerprint() for i in ids)}
    shards = {
        (s.labels["fingerprint"], s.labels["shard"])
        for s in samples(families, "s3kv_save_completed", "s3kv_save_completed_total")
        if s.labels["fingerprint"] in ours
    }
    assert shards == {(ids[0].fingerprint(), "0"), (ids[1].fingerprint(), "1")}
    for name in ("s3kv_staging_bytes", "s3kv_inflight_save_bytes", "s3kv_breaker_state"):
        assert families[name].type == "gauge"
        assert {s.labels["shard"] for s in samples(families, name)} == {"0", "1"}, name

    # Latency histograms per operation: buckets up to +Inf, a count and a sum.
    assert families["s3kv_request_seconds"].type == "histogram"
    buckets = samples(families, "s3kv_request_seconds", "s3kv_request_seconds_bucket")
    assert {s.labels["op"] for s in buckets} >= {"get", "put", "head", "list", "head_bucket"}
    assert {s.labels["le"] for s in buckets} >= {"0.005", "1.0", "+Inf"}
    put_count = [
        s.value
        for s in samples(families, "s3kv_request_seconds", "s3kv_request_seconds_count")
        if s.labels["op"] == "put" and s.labels["shard"] == "1"
    ]
    assert put_count
    assert put_count[0] >= 1

    # The layout's one shared manifest, once, under the layout fingerprint (not a shard's).
    versions = samples(families, "s3kv_manifest_version")
    assert [s.labels for s in versions if s.labels["fingerprint"] in ours] == [
        {"fingerprint": layout}
    ]
    completed = samples(families, "s3kv_manifest_shard_writes_completed")
    assert [s.labels["fingerprint"] for s in completed if s.labels["fingerprint"] in ours] == [
        layout
    ]
    assert families["s3kv_manifest_pending_records"].type == "gauge"


def test_ranks_above_0_serve_on_their_own_port() -> None:
    config = S3KVConfig(metrics_port=9400)
    assert _rank_metrics(config, 0) is config, "rank 0's process: the configured port"
    assert _rank_metrics(config, 3).metrics_port == 9403
    assert _rank_metrics(S3KVConfig(), 3).metrics_port == 0, "off stays off"
    assert _rank_metrics(S3KVConfig(metrics_port=65535), 1).metrics_port == 0


def test_closed_stores_leave_the_export(tmp_path: Path) -> None:
    store = KVStore.open(
        file_config(tmp_path), identity(), allocator=NumpyAllocator(), start_background=False
    )
    fingerprint = store.fingerprint
    rendered = exporter().render()
    assert f'fingerprint="{fingerprint}"' in rendered
    store.close()
    assert f'fingerprint="{fingerprint}"' not in exporter().render()


def test_the_address_setting_is_honoured() -> None:
    assert S3KVConfig.load(environ={}).metrics_address == "127.0.0.1", "loopback by default"
    host = "127.0.0.2"  # on Linux all of 127/8 is loopback: bound there, not on 127.0.0.1
    try:
        port = free_port(host)
    except OSError:
        pytest.skip("127.0.0.2 is not a local address here")
    config = S3KVConfig.load(
        environ={
            "TLLM_S3KV_BUCKET": "test",
            "TLLM_S3KV_METRICS_PORT": str(port),
            "TLLM_S3KV_METRICS_ADDRESS": host,
        }
    )
    store = memory_store(config)
    try:
        text = scrape(port, host)
        assert f'fingerprint="{store.fingerprint}"' in text
        with pytest.raises(urllib.error.URLError):
            scrape(port, "127.0.0.1")
    finally:
        store.close()


def test_a_port_in_use_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        local = Exporter()
        caplog.set_level(logging.WARNING, logger="s3kv")
        # NOTE: a private exporter: its collector joins the default registry like the real
        # one's would, so it must not serve (it must fail binding) to keep that registry clean.
        assert not local.serve(port, "127.0.0.1")
        assert not local.serve(port, "127.0.0.1"), "remembered: one warning"
    warnings = [r for r in caplog.records if "cannot serve metrics" in r.getMessage()]
    assert len(warnings) == 1


# --- the exporter ---------------------------------------------------------------------------


class FakeManifest:
    def __init__(self, version: float = 0.0) -> None:
        self.version = version

    def stats(self) -> dict[str, float]:
        return {"version": self.version, "refreshes": 3.0, "pending_records": 2.0}


def test_registries_and_manifests_are_labelled_and_deduplicated() -> None:
    local = Exporter()
    a, b = Metrics(), Metrics()
    a.inc("requests", op="get")
    b.inc("requests", 2, op="get")
    a.observe("request_seconds", 0.02, op="get")
    local.add_store(a, fingerprint="fa", shard="0")
    local.add_store(a, fingerprint="fa", shard="0")  # the same registration: once
    handle = local.add_store(b, fingerprint="fb", shard="1")
    manifest = FakeManifest(version=1)
    local.add_manifest("layout", manifest.stats)
    local.add_manifest("layout", FakeManifest(version=9).stats)  # a second view: ignored
    text = local.render()
    families = parse(text)
    check_exposition(text)
    requests = {
        (s.labels["fingerprint"], s.labels["shard"], s.value)
        for s in samples(families, "s3kv_requests", "s3kv_requests_total")
    }
    assert requests == {("fa", "0", 1.0), ("fb", "1", 2.0)}
    assert [s.value for s in samples(families, "s3kv_manifest_version")] == [1.0]
    assert families["s3kv_manifest_refreshes"].type == "counter"
    assert families["s3kv_manifest_pending_records"].type == "gauge"
    count = samples(families, "s3kv_request_seconds", "s3kv_request_seconds_count")
    assert [(s.labels, s.value) for s in count] == [
        ({"fingerprint": "fa", "shard": "0", "op": "get"}, 1.0)
    ]
    handle.close()
    handle.close()  # idempotent
    assert 'fingerprint="fb"' not in local.render()
    del a, manifest
    assert "s3kv_requests" not in local.render(), "sources are held weakly"


def test_the_manifest_reports_its_lag_once_it_applied_an_entry() -> None:
    mono = [100.0]
    backend = MemoryBackend()
    manifest = Manifest.open(backend, "kv", "fp", capacity=1000, fpr=1e-6,
                             monotonic=lambda: mono[0])  # fmt: skip
    assert "lag_seconds" not in manifest.stats(), "no lag before the first log entry"
    holder = Manifest.open(backend, "kv", "fp", capacity=1000, fpr=1e-6,
                           compaction=CompactionPolicy())  # fmt: skip
    assert holder.compact_once() == "takeover"
    manifest.refresh()
    mono[0] = 130.0
    local = Exporter()
    local.add_manifest("fp", manifest.stats)
    families = parse(local.render())
    assert [s.value for s in samples(families, "s3kv_manifest_lag_seconds")] == [30.0]


def test_a_reported_lag_is_exported() -> None:
    local = Exporter()
    local.add_manifest("fp", lambda: {"version": 3.0, "lag_seconds": 7.5})
    families = parse(local.render())
    assert [s.value for s in samples(families, "s3kv_manifest_lag_seconds")] == [7.5]


# --- the instrumented backend -----------------------------------------------------------------


def test_requests_are_timed_per_operation_and_list_per_page() -> None:
    metrics = Metrics()
    backend = InstrumentedBackend(MemoryBackend(), metrics)
    backend.put("a", b"x")
    backend.get("a")
    backend.head("a")
    for i in range(1001):
        backend.inner.put(f"p/{i:05d}", b"")
    assert len(list(backend.list("p/"))) == 1001
    for op in ("put", "get", "head"):
        histogram = metrics.histogram("request_seconds", op=op)
        assert histogram is not None
        assert histogram.count == 1, op
    listing = metrics.histogram("request_seconds", op="list")
    assert listing is not None
    assert listing.count == metrics.value("requests", op="list") == 2, "one per page"
    cumulative = listing.cumulative()
    assert cumulative[-1] == (float("inf"), 2)
    assert [c for _, c in cumulative] == sorted(c for _, c in cumulative)
    snapshot = metrics.snapshot()
    assert snapshot['request_seconds_count{op="get"}'] == 1


def test_breaker_state_is_a_gauge_and_refused_requests_are_not_timed() -> None:
    clock = [0.0]
    breaker = CircuitBreaker(1, 10.0, clock=lambda: clock[0])

    class Down(MemoryBackend):
        def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
            raise EndpointError("down")

    metrics = Metrics()
    backend = InstrumentedBackend(Down(), metrics, breaker=breaker)
    assert metrics.value("breaker_state") == 0
    with pytest.raises(EndpointError):
        backend.get("k")
    assert metrics.value("breaker_state") == 2
    assert metrics.value("breaker_trips") == 1
    with pytest.raises(Exception, match="unhealthy"):
        backend.get("k")
    histogram = metrics.histogram("request_seconds", op="get")
    assert histogram is not None
    assert histogram.count == 1, "the refused request made no request"
    clock[0] = 11.0
    assert metrics.value("breaker_state") == 1, "half-open after the cooldown"


# --- settings -------------------------------------------------------------------------------


def test_log_level_is_applied_to_the_s3kv_logger_only(s3kv_logger: logging.Logger) -> None:
    root_level = logging.getLogger().level
    config = S3KVConfig.load(environ={"TLLM_S3KV_BUCKET": "tst", "TLLM_S3KV_LOG_LEVEL": "DEBUG"})
    assert config.log_level == "debug"
    store = memory_store(config)
    store.close()
    assert s3kv_logger.level == logging.DEBUG
    assert logging.getLogger().level == root_level, "the root logger is the application's"
    KVStore.open(
        dataclasses.replace(config, log_level="warning"),
        identity(),
        backend=MemoryBackend(),
        allocator=NumpyAllocator(),
        pool=IOPool(0),
        start_background=False,
    ).close()
    assert s3kv_logger.level == logging.WARNING


def test_an_empty_log_level_leaves_the_logger_alone(s3kv_logger: logging.Logger) -> None:
    s3kv_logger.setLevel(logging.ERROR)
    config = S3KVConfig.load(environ={"TLLM_S3KV_BUCKET": "tst"})
    assert config.log_level == ""
    memory_store(config).close()
    assert s3kv_logger.level == logging.ERROR


def test_log_level_adds_a_handler_only_when_nothing_would_print(
    s3kv_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    from s3kv._logsetup import apply_log_level

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    s3kv_logger.handlers[:] = []
    apply_log_level("info")
    apply_log_level("debug")
    assert len(s3kv_logger.handlers) == 1, "one stderr handler, added once"
    assert root.handlers == [], "never on the root logger"


@pytest.mark.parametrize(
    ("env", "setting"),
    [
        ({"TLLM_S3KV_LOG_LEVEL": "verbose"}, "log_level"),
        ({"TLLM_S3KV_LOG_LEVEL": "10"}, "log_level"),
        ({"TLLM_S3KV_METRICS_ADDRESS": "0.0.0.0:9400"}, "metrics_address"),
        ({"TLLM_S3KV_METRICS_ADDRESS": ""}, "metrics_address"),
        ({"TLLM_S3KV_METRICS_ADDRESS": "two words"}, "metrics_address"),
        ({"TLLM_S3KV_METRICS_PORT": "70000"}, "metrics_port"),
    ],
)
def test_bad_observability_settings_fail_in_one_line_naming_the_setting(
    env: dict[str, str], setting: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        S3KVConfig.load(environ=env)
    message = str(raised.value)
    assert message.startswith(f"{setting}:")
    assert "\n" not in message


@pytest.mark.parametrize("address", ["127.0.0.1", "0.0.0.0", "::", "::1", "localhost", "pod.ns"])
def test_good_addresses_are_accepted(address: str) -> None:
    assert S3KVConfig(metrics_address=address).metrics_address == address


# --- the README ------------------------------------------------------------------------------


def test_the_readme_lists_every_metric_with_its_type() -> None:
    readme = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| `(s3kv_\w+)` \| (\w+) \|", readme, re.M))
    gauges = {
        "staging_bytes", "staging_blocks", "staging_capacity_bytes", "inflight_save_bytes",
        "inflight_save_limit_bytes", "breaker_state", "warm_blocks_planned",
        "warm_blocks_staged", "warm_ready", "store_pending",
    }  # fmt: skip
    expected = {}
    for name in HELP:
        kind = "histogram" if name == "request_seconds" else "gauge" if name in gauges else ""
        expected[f"s3kv_{name}" if kind else f"s3kv_{name}_total"] = kind or "counter"
    for name in MANIFEST_HELP:
        if name in MANIFEST_GAUGES:
            expected[f"s3kv_manifest_{name}"] = "gauge"
        else:
            expected[f"s3kv_manifest_{name}_total"] = "counter"
    assert rows == expected


def test_exported_types_match_the_readme(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| `(s3kv_\w+)` \| (\w+) \|", readme, re.M))
    store = KVStore.open(
        file_config(tmp_path), identity(), allocator=NumpyAllocator(), start_background=False
    )
    try:
        save_one(store, 0)
        local = Exporter()
        local.add_store(store.metrics, fingerprint=store.fingerprint, shard="0")
        local.add_manifest(store.manifest_fingerprint, store.manifest.stats)
        families = parse(local.render())
    finally:
        store.close()
    for name, family in families.items():
        exposed = f"{name}_total" if family.type == "counter" else name
        assert rows.get(exposed) == family.type, name
