"""``s3kv.ops.doctor.run_doctor`` on a ``file://`` directory and on injected backends."""

from __future__ import annotations

import fnmatch
import json
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from s3kv import _zstd
from s3kv.config import S3KVConfig
from s3kv.errors import AccessDeniedError
from s3kv.ops.doctor import DoctorReport, run_doctor
from s3kv.storage import Backend, DeleteResult, MemoryBackend, ObjectInfo


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
        overrides={"endpoint_url": f"file://{tmp_path}", "io_threads": 8},
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
    # 8 GETs at once, each a 300 ms round trip at least: 27 a second, 0.2 Gbit/s of 1 MB blocks
    assert "8 GETs at once (io_threads 8) allow at most 27 block GETs a second (0.2 Gbit/s" in (
        checks["latency"].detail
    )
    assert opened[0].conditional_put == "off"  # opening does no I/O


class Recording(MemoryBackend):
    """Records each request as (IAM action, key or listing prefix)."""

    def __init__(self, *, hang: threading.Event | None = None) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []
        self._hang = hang

    @property
    def description(self) -> str:
        return "s3://b/s3kv at http://127.0.0.1:9"

    def check(self) -> None:
        self.calls.append(("s3:ListBucket", ""))
        if self._hang is not None:
            self._hang.wait()  # an endpoint that accepts and never answers

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        self.calls.append(("s3:GetObject", key))
        return super().get(key, max_bytes=max_bytes)

    def head(self, key: str) -> ObjectInfo | None:
        self.calls.append(("s3:GetObject", key))
        return super().head(key)

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        self.calls.append(("s3:PutObject", key))
        return super().put(key, data, if_absent=if_absent)

    def delete_many(self, keys: Iterable[str]) -> DeleteResult:
        keys = list(keys)
        self.calls.extend(("s3:DeleteObject", k) for k in keys)
        return super().delete_many(keys)

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        self.calls.append(("s3:ListBucket", prefix))
        return super().list(prefix, start_after=start_after)


def _doctor(backend: Backend, **kwargs: Any) -> DoctorReport:
    return run_doctor(
        environ={}, overrides={"bucket": "bkt", "endpoint_url": "http://127.0.0.1:9"},
        open_backend=lambda cfg: backend, samples=1, **kwargs,
    )  # fmt: skip


def test_a_silent_endpoint_ends_at_the_deadline_with_progress_lines(aws_env: None) -> None:
    release = threading.Event()
    lines: list[str] = []
    opened: list[S3KVConfig] = []
    hung = Recording(hang=release)

    def factory(cfg: S3KVConfig) -> Backend:
        opened.append(cfg)
        return hung

    start = time.monotonic()
    try:
        report = run_doctor(
            environ={}, overrides={"bucket": "bkt", "endpoint_url": "http://127.0.0.1:9"},
            open_backend=factory, timeout=1.0, progress=lines.append,
        )  # fmt: skip
    finally:
        release.set()
    assert time.monotonic() - start < 1.0 + 1.0
    checks = {c.name: c for c in report.checks}
    assert checks["bucket"].status == "fail"
    assert "no answer from http://127.0.0.1:9 within the 1 s deadline" in checks["bucket"].detail
    assert "--timeout" in (checks["bucket"].remedy or "")
    assert not report.ok
    # Per-request limits fit the deadline; opening does no I/O.
    (cfg,) = opened
    assert (cfg.conditional_put, cfg.max_attempts) == ("off", 2)
    assert cfg.connect_timeout <= 0.5
    assert cfg.read_timeout <= 0.5
    # One line as each step starts and one as it ends, the endpoint named.
    assert lines[0] == "doctor: credentials: the AWS credential chain ..."
    assert lines[1].startswith("doctor: credentials: ")
    assert "endpoint http://127.0.0.1:9" in lines[2]
    assert lines[3] == "doctor: bucket: reaching s3://b/s3kv at http://127.0.0.1:9 ..."
    assert lines[4].startswith("doctor: bucket: FAIL after ")
    assert lines[4].endswith(": no answer from http://127.0.0.1:9 within the 1 s deadline")
    assert len(lines) == 5
    assert (report.endpoint, report.timeout_s) == ("http://127.0.0.1:9", 1.0)


def test_steps_after_the_deadline_are_skipped(aws_env: None) -> None:
    now = [0.0]

    class Slow(Recording):
        def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
            now[0] += 30.0  # the deadline's clock jumps past 20 s while get runs
            return super().get(key, max_bytes=max_bytes)

    report = _doctor(Slow(), monotonic=lambda: now[0])
    status = {c.name: c.status for c in report.checks}
    assert [status[n] for n in ("list", "put", "get")] == ["ok", "ok", "ok"]
    assert status["delete"] == status["conditional write"] == status["latency"] == "skip"
    (delete,) = [c for c in report.checks if c.name == "delete"]
    assert "20 s deadline had passed" in delete.detail


PROBE_KINDS = {"s3:ListBucket", "s3:GetObject", "s3:PutObject", "s3:DeleteObject"}


@pytest.mark.parametrize(
    ("role", "run", "skipped"),
    [
        ("all", {"list", "put", "get", "delete", "conditional write"}, set()),
        ("engine", {"list", "put", "get", "delete", "conditional write"}, set()),
        ("pruner", {"list", "put", "get", "delete", "conditional write"}, set()),
        ("reader", {"list", "get"}, {"put", "delete", "conditional write"}),
    ],
)
def test_a_role_checks_what_it_needs(
    role: str, run: set[str], skipped: set[str], aws_env: None
) -> None:
    backend = Recording()
    report = _doctor(backend, role=role)
    assert report.ok, report.checks
    assert report.role == role
    status = {c.name: c.status for c in report.checks}
    assert {n for n in run | skipped if status[n] == "ok"} == run
    for name in skipped:
        (check,) = [c for c in report.checks if c.name == name]
        assert (check.status, check.detail) == ("skip", f"not needed by --role {role}")
    actions = {action for action, _ in backend.calls}
    deleted = [key for action, key in backend.calls if action == "s3:DeleteObject"]
    if role == "reader":
        assert actions == {"s3:ListBucket", "s3:GetObject"}  # no write at all
    elif role == "engine":
        assert deleted
        assert all("/manifest/" in key for key in deleted)  # never a block
    else:
        assert any("/blocks/" in key for key in deleted)
    assert not list(backend.list(""))  # nothing left behind


def test_the_infra_policies_grant_what_their_role_is_checked_for(aws_env: None) -> None:
    """``--role engine``/``pruner`` pass with infra/aws's engine/pruner policy, and only
    because of the grants meant for them (manifest deletes for engines)."""
    infra = Path(__file__).resolve().parent.parent / "infra" / "aws"

    def allowed(policy: dict[str, Any], action: str, key: str) -> bool:
        arn = "arn:aws:s3:::b" + ("" if action == "s3:ListBucket" else f"/{key}")
        for statement in policy["Statement"]:
            actions = statement["Action"]
            resources = statement["Resource"]
            actions = [actions] if isinstance(actions, str) else actions
            resources = [resources] if isinstance(resources, str) else resources
            if action in actions and any(
                fnmatch.fnmatchcase(arn, r.replace("BUCKET", "b")) for r in resources
            ):  # fmt: skip
                return True
        return False

    for role in ("engine", "pruner"):
        policy = json.loads((infra / f"{role}-policy.json").read_text())
        backend = Recording()
        assert _doctor(backend, role=role).ok
        for action, key in backend.calls:
            assert allowed(policy, action, key), (role, action, key)
        if role == "engine":  # the manifest-delete grant is what allows the delete probe
            (key,) = [k for a, k in backend.calls if a == "s3:DeleteObject"]
            del policy["Statement"][-1]
            assert not allowed(policy, "s3:DeleteObject", key)


def test_denied_deletes_name_the_grant_of_the_role(aws_env: None) -> None:
    class NoBlockDeletes(Recording):
        def delete_many(self, keys: Iterable[str]) -> DeleteResult:
            keys = list(keys)
            result = super().delete_many([k for k in keys if "/blocks/" not in k])
            result.failed.update({k: "AccessDenied: no" for k in keys if "/blocks/" in k})
            return result

    pruner = {c.name: c for c in _doctor(NoBlockDeletes(), role="pruner").checks}
    assert pruner["delete"].status == "fail"
    assert "block objects" in pruner["delete"].detail
    assert "grant s3:DeleteObject on arn:aws:s3:::bkt/s3kv/*" in (pruner["delete"].remedy or "")
    engine = {c.name: c for c in _doctor(NoBlockDeletes(), role="engine").checks}
    assert engine["delete"].status == "ok"  # an engine never deletes blocks
    assert engine["delete"].detail == "allowed on manifest objects"


def test_an_unknown_role_or_deadline_is_refused() -> None:
    with pytest.raises(ValueError, match="role"):
        run_doctor(environ={}, role="admin")
    with pytest.raises(ValueError, match="timeout"):
        run_doctor(environ={}, timeout=0)


def test_the_codec_check_says_whether_the_native_kernel_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A codec in Python makes I/O threads contend for the GIL: doctor warns, with the fix,
    unless codec processes keep it off the engine's interpreter."""

    def codec_check(**overrides: object) -> tuple[str, str, str | None]:
        report = run_doctor(environ={}, overrides=overrides)  # NOTE: no bucket: no I/O
        (check,) = [c for c in report.checks if c.name == "codec"]
        return check.status, check.detail, check.remedy

    from s3kv.offload import sizing

    # NOTE: as this 2-core machine, which has no GPU
    monkeypatch.setattr(sizing, "cpu_budget", lambda: sizing.CpuBudget(2, whole_host=True))
    monkeypatch.setattr(sizing, "host_gpus", lambda: 0)
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                 "SLURM_NTASKS_PER_NODE"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    if _zstd._KERNEL is not None:
        status, detail, remedy = codec_check()
        assert (status, remedy) == ("ok", None)
        assert detail.startswith("native plane kernel; codec_processes auto: 0 per GPU rank here")
        assert "2 CPUs for 1 GPU rank on this host leave fewer than 4 per process" in detail
    monkeypatch.setattr(_zstd, "_KERNEL", None)
    monkeypatch.setattr(_zstd, "_NO_KERNEL", "s3kv._planes_native is not built (no C compiler)")
    status, detail, remedy = codec_check()
    assert status == "warn"
    assert "not built (no C compiler)" in detail
    assert "in the I/O threads (codec_processes auto: 0 per GPU rank here" in detail
    assert remedy is not None
    assert "C compiler" in remedy
    assert codec_check(codec_processes=2) == (
        "ok",
        "Python plane codec (s3kv._planes_native is not built (no C compiler)), off the GIL; "
        "codec_processes 2",
        None,
    )
    # an H200 host's 16 CPUs, one GPU: auto runs 4
    monkeypatch.setattr(sizing, "cpu_budget", lambda: sizing.CpuBudget(16, whole_host=True))
    monkeypatch.setattr(sizing, "host_gpus", lambda: 1)
    status, detail, _ = codec_check()
    assert status == "ok"
    assert detail.endswith(
        "off the GIL; codec_processes auto: 4 per GPU rank here "
        "(4 for its store: 16 CPUs for 1 GPU rank on this host)"
    )
