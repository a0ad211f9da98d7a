"""Counters in-process and on a Prometheus endpoint."""

from __future__ import annotations

import socket
import urllib.request

from s3kv.metrics import Metrics, serve_prometheus


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_counters_gauges_and_labels() -> None:
    metrics = Metrics()
    metrics.inc("requests", op="get")
    metrics.inc("requests", 2, op="put")
    metrics.set("staging_bytes", 42)
    metrics.set("staging_bytes", 7)
    assert metrics.value("requests", op="put") == 2
    assert metrics.total("requests") == 3
    assert metrics.value("staging_bytes") == 7
    assert metrics.value("never_touched") == 0


def test_prometheus_endpoint_serves_the_registry() -> None:
    metrics = Metrics()
    metrics.inc("save_completed", 3)
    metrics.inc("request_errors", op="get", kind="endpoint")
    metrics.set("staging_bytes", 1024)
    port = free_port()
    assert serve_prometheus(metrics, port, addr="127.0.0.1")
    assert serve_prometheus(metrics, port, addr="127.0.0.1"), "idempotent per port"
    metrics.inc("save_completed")  # read at scrape time, not at registration
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    assert "s3kv_save_completed_total 4.0" in text
    assert 's3kv_request_errors_total{kind="endpoint",op="get"} 1.0' in text
    assert "s3kv_staging_bytes 1024.0" in text
