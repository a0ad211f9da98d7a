"""Doctor: is this machine set up to use the bucket, and if not, what to change.

Checks, in order (a failed reachability check skips the ones that need the bucket):

1. **settings** — every setting with the place it came from (default, ``TLLM_S3KV_*``,
   the TOML file, the command line). Settings hold no secrets; URLs are shown without any
   ``user:password@``. A setting that does not parse fails here, with its fix.
2. **credentials** — which link of the AWS chain supplied them (env, profile, SSO, role),
   with the access key id masked to its last four characters; never the secret (skipped
   for a ``file://`` directory, which needs none).
3. **bucket** — HeadBucket: reachable, exists, credentials accepted (with its latency).
4. **list / put / get / delete** — the permissions actually held, tried on a scratch key
   ``<prefix>/.s3kv-probe/doctor-<random>`` that is deleted afterwards (the scratch area
   the conditional-write probe uses too; ``infra/aws/`` grants it to every role); each
   refusal names the IAM action to grant.
5. **conditional write** — whether ``If-None-Match: *`` is honoured
   (:meth:`s3kv.storage.Backend.probe_conditional_put`).
6. **latency** — median and worst of a few HEAD requests.

Everything goes through :mod:`s3kv.storage` (:func:`~s3kv.storage.open_backend`,
:func:`~s3kv.storage.whoami`), so a ``file://`` directory is checked like a bucket.
"""

from __future__ import annotations

import os
import re
import statistics
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from s3kv.config import S3KVConfig
from s3kv.errors import AccessDeniedError, ConfigError, StorageError
from s3kv.storage import Backend, is_file_url, open_backend, whoami

__all__ = ["Check", "DoctorReport", "Setting", "run_doctor"]

_T = TypeVar("_T")
_USERINFO = re.compile(r"(?<=://)[^/@]*@")
_SLOW_MS = 200.0
#: The scratch area under the prefix (shared with the conditional-write probe).
_SCRATCH_DIR = ".s3kv-probe/"


@dataclass(frozen=True)
class Setting:
    """One effective setting and where it came from."""

    name: str
    value: str
    source: str


@dataclass(frozen=True)
class Check:
    """One check.

    Attributes:
        name: What was checked.
        status: ``"ok"``, ``"warn"``, ``"fail"`` or ``"skip"``.
        detail: What was found.
        remedy: What to change (for warn/fail).
        latency_ms: Duration of the request(s), where one was made.
    """

    name: str
    status: str
    detail: str
    remedy: str | None = None
    latency_ms: float | None = None


@dataclass(frozen=True)
class DoctorReport:
    """Settings with their sources, and the checks in the order run."""

    settings: tuple[Setting, ...]
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        """No check failed (warnings allowed)."""
        return all(c.status != "fail" for c in self.checks)


def run_doctor(
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    open_backend: Callable[[S3KVConfig], Backend] | None = None,
    timer: Callable[[], float] = time.perf_counter,
    samples: int = 5,
) -> DoctorReport:
    """Run every check; never raises for a problem it can report.

    Args:
        environ: Environment to read settings from (default ``os.environ``).
        overrides: Command-line settings (``bucket``, ``prefix``...; ``None`` values ignored).
        open_backend: Builds the backend (default: :func:`s3kv.storage.open_backend`). Called
            with ``conditional_put="off"`` so that opening does no I/O.
        timer: Monotonic seconds, for latencies.
        samples: HEAD requests for the latency check.
    """
    try:
        cfg, sources = S3KVConfig.load_with_sources(environ=environ, **dict(overrides or {}))
    except ConfigError as exc:
        return DoctorReport((), (Check("settings", "fail", str(exc), "fix the setting named"),))
    settings = _settings(cfg, sources, os.environ if environ is None else environ)
    checks: list[Check] = [Check("settings", "ok", f"{len(sources)} set, the rest defaults")]
    if not cfg.bucket and not is_file_url(cfg.endpoint_url):
        checks.append(
            Check("bucket", "fail", "no bucket configured", "set TLLM_S3KV_BUCKET or pass --bucket")
        )
        return DoctorReport(settings, tuple(checks))
    checks.append(_credentials(cfg))
    try:
        backend = _open(cfg, open_backend)
    except StorageError as exc:
        checks.append(Check("bucket", "fail", str(exc), _remedy(exc)))
        return DoctorReport(settings, tuple(checks))
    try:
        checks.extend(_bucket_checks(backend, cfg, timer, samples))
    finally:
        backend.close()
    return DoctorReport(settings, tuple(checks))


def _open(cfg: S3KVConfig, factory: Callable[[S3KVConfig], Backend] | None) -> Backend:
    return (factory or open_backend)(cfg.replace(conditional_put="off"))


def _safe(value: object) -> str:
    return _USERINFO.sub("***@", str(value))


def _settings(
    cfg: S3KVConfig, sources: Mapping[str, str], environ: Mapping[str, str]
) -> tuple[Setting, ...]:
    found = [
        Setting(
            f.name,
            _safe(getattr(cfg, f.name)),
            sources.get(f.name, "default").replace("argument", "command line"),
        )
        for f in fields(cfg)
    ]
    if not cfg.endpoint_url:
        for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
            if environ.get(name):
                found.append(Setting("endpoint (effective)", _safe(environ[name]), f"env {name}"))
                break
    return tuple(found)


def _credentials(cfg: S3KVConfig) -> Check:
    try:
        creds = whoami(cfg)
    except StorageError as exc:
        return Check("credentials", "fail", str(exc), _remedy(exc))
    if creds is None:
        return Check(
            "credentials",
            "fail",
            "no AWS credentials found",
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE or "
            "TLLM_S3KV_PROFILE, or run with an instance/container role",
        )
    if not creds.required:
        return Check("credentials", "skip", creds.source)
    return Check("credentials", "ok", f"from {creds.source}, access key id {creds.access_key_id}")


def _remedy(exc: StorageError) -> str:
    # NOTE: translate_error messages already end in ": <remedy>"; repeat it as the remedy.
    text = str(exc)
    return text.rsplit(": ", 1)[-1] if ": " in text else "see the message"


def _timed(timer: Callable[[], float], fn: Callable[[], _T]) -> tuple[_T, float]:
    start = timer()
    result = fn()
    return result, (timer() - start) * 1000


_GRANT = {
    "list": ("s3:ListBucket", "arn:aws:s3:::{bucket}", "every role"),
    "put": ("s3:PutObject", "arn:aws:s3:::{bucket}/{prefix}*",
            "engines; prune, compact and pin write the manifest"),
    "get": ("s3:GetObject", "arn:aws:s3:::{bucket}/{prefix}*", "every role"),
    "delete": ("s3:DeleteObject", "arn:aws:s3:::{bucket}/{prefix}*", "prune and compact"),
}  # fmt: skip


def _denied(op: str, cfg: S3KVConfig, exc: BaseException | str) -> Check:
    action, resource, who = _GRANT[op]
    prefix = cfg.key_prefix + "/" if cfg.key_prefix else ""
    where = resource.format(bucket=cfg.bucket, prefix=prefix)
    return Check(
        op, "fail", f"denied: {exc}", f"grant {action} on {where} (needed by {who}); see infra/aws/"
    )


def _bucket_checks(
    backend: Backend, cfg: S3KVConfig, timer: Callable[[], float], samples: int
) -> list[Check]:
    try:
        _, ms = _timed(timer, backend.check)
    except StorageError as exc:
        return [
            Check("bucket", "fail", str(exc), _remedy(exc)),
            Check("permissions", "skip", "the bucket is not reachable"),
        ]
    checks = [Check("bucket", "ok", f"{backend.description} reachable", latency_ms=ms)]
    root = cfg.key_prefix + "/" if cfg.key_prefix else ""
    scratch = f"{root}{_SCRATCH_DIR}doctor-{uuid.uuid4().hex}"
    payload = b"s3kv doctor scratch object\n"
    put_ok = False
    for op, call in (
        ("list", lambda: next(iter(backend.list(root + _SCRATCH_DIR)), None)),
        ("put", lambda: backend.put(scratch, payload)),
        ("get", lambda: backend.get(scratch)),
        ("delete", lambda: backend.delete_many([scratch])),
    ):
        checks.append(_permission(op, call, cfg, timer, put_ok, payload))
        put_ok = put_ok or (op == "put" and checks[-1].status == "ok")
    checks.append(_conditional(backend, cfg, put_ok))
    checks.append(_latency(backend, scratch, timer, samples))
    return checks


def _permission(
    op: str,
    call: Callable[[], object],
    cfg: S3KVConfig,
    timer: Callable[[], float],
    put_ok: bool,
    payload: bytes,
) -> Check:
    try:
        result, ms = _timed(timer, call)
    except AccessDeniedError as exc:
        return _denied(op, cfg, exc)
    except StorageError as exc:
        return Check(op, "fail", str(exc), _remedy(exc))
    if op == "delete" and getattr(result, "failed", None):
        return _denied(op, cfg, next(iter(result.failed.values())))  # type: ignore[attr-defined]
    if op == "get" and put_ok and result != payload:
        return Check(
            op,
            "fail",
            "read back different bytes than written",
            "the endpoint or a proxy alters objects; check it",
        )
    detail = "allowed" if op != "get" or put_ok else "allowed (scratch object absent)"
    return Check(op, "ok", detail, latency_ms=ms)


def _conditional(backend: Backend, cfg: S3KVConfig, put_ok: bool) -> Check:
    if not put_ok:
        return Check("conditional write", "skip", "needs put permission")
    try:
        supported = backend.probe_conditional_put(cfg.key_prefix)
    except StorageError as exc:
        return Check("conditional write", "fail", str(exc), _remedy(exc))
    if supported:
        return Check("conditional write", "ok", "If-None-Match: * honoured (blocks written once)")
    return Check(
        "conditional write",
        "warn",
        "If-None-Match: * not honoured",
        "racing engines may write a block twice (same bytes: harmless, costs PUTs); "
        "use a server with conditional writes (AWS S3, MinIO, SeaweedFS 4.x)",
    )


def _latency(backend: Backend, key: str, timer: Callable[[], float], samples: int) -> Check:
    times = []
    try:
        for _ in range(max(1, samples)):
            times.append(_timed(timer, lambda: backend.head(key))[1])
    except StorageError as exc:
        return Check("latency", "fail", str(exc), _remedy(exc))
    median = statistics.median(times)
    detail = f"HEAD median {median:.1f} ms, worst {max(times):.1f} ms over {len(times)}"
    if median > _SLOW_MS:
        return Check(
            "latency",
            "warn",
            detail,
            "engines pay this on every block GET: run them in the bucket's region",
            latency_ms=median,
        )
    return Check("latency", "ok", detail, latency_ms=median)
