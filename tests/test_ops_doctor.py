"""``s3kv.ops.doctor.run_doctor`` on a ``file://`` directory and on injected backends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from s3kv.config import S3KVConfig
from s3kv.errors import AccessDeniedError
from s3kv.ops.doctor import run_doctor
from s3kv.storage import Backend, MemoryBackend


class NoPut(MemoryBackend):
    """A bucket that refuses writes, as a read-only role does."""

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        raise AccessDeniedError(f"PutObject {key}: access denied")


def _ticks(step: float) -> Iterator[float]:
    now = 0.0
    while True:
        yield now
        now += step


def test_a_file_directory_passes_every_check(tmp_path: Path) -> None:
    report = run_doctor(environ={}, overrides={"endpoint_url": f"file://{tmp_path}"}, samples=2)
    status = {c.name: c.status for c in report.checks}
    assert report.ok, report.checks
    assert status["credentials"] == "skip"
    assert all(status[op] == "ok" for op in ("bucket", "list", "put", "get", "delete"))
    assert status["latency"] == "ok"
    sources = {s.name: s.source for s in report.settings}
    assert sources["endpoint_url"] == "command line"
    assert sources["bucket"] == "default"
    assert list(tmp_path.rglob("doctor-*")) == []  # the scratch object is deleted


def test_no_bucket_and_bad_settings_fail_with_a_remedy() -> None:
    report = run_doctor(environ={})
    assert not report.ok
    (bucket,) = [c for c in report.checks if c.name == "bucket"]
    assert bucket.remedy is not None
    assert "TLLM_S3KV_BUCKET" in bucket.remedy

    bad = run_doctor(environ={"TLLM_S3KV_IO_THREADS": "0"})
    assert [(c.name, c.status) for c in bad.checks] == [("settings", "fail")]
    assert "io_threads" in bad.checks[0].detail


def test_denied_writes_name_the_grant_and_slow_heads_warn(tmp_path: Path) -> None:
    opened: list[S3KVConfig] = []

    def factory(cfg: S3KVConfig) -> Backend:
        opened.append(cfg)
        return NoPut()

    ticks = _ticks(0.3)  # every timed request takes 300 ms
    report = run_doctor(
        environ={},
        overrides={"endpoint_url": f"file://{tmp_path}"},
        open_backend=factory,
        timer=lambda: next(ticks),
        samples=3,
    )
    checks = {c.name: c for c in report.checks}
    assert not report.ok
    assert checks["put"].status == "fail"
    assert "s3:PutObject" in (checks["put"].remedy or "")
    assert checks["conditional write"].status == "skip"
    assert checks["latency"].status == "warn"
    assert checks["latency"].latency_ms == pytest.approx(300.0)
    assert opened[0].conditional_put == "off"  # opening does no I/O
