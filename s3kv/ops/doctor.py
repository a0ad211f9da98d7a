"""Doctor: is this machine set up to use the bucket, and if not, what to change.

Checks, in order (a failed reachability check skips the ones that need the bucket), after
a look at this machine's codec (``codec``: the native plane kernel, or why the Python codec
runs, a warning where I/O threads would code blocks under the GIL):

1. **settings** — every setting with the place it came from (default, ``TLLM_S3KV_*``,
   the TOML file, the command line), then the *effective* endpoint and region the client
   uses (where they came from when s3kv's settings leave them open). Settings hold no
   secrets; URLs are shown without any ``user:password@``. A setting that does not parse
   fails here, with its fix.
2. **credentials** — which link of the AWS chain supplied them (env, profile, SSO, role),
   with the access key id masked to its last four characters; never the secret (skipped
   for a ``file://`` directory, which needs none).
3. **bucket** — HeadBucket: reachable, exists, credentials accepted (with its latency). A
   refusal is explained in one line: an access key id the server does not know
   (``InvalidAccessKeyId``), a wrong secret for a known key id (``SignatureDoesNotMatch``),
   an expired session, or valid credentials that the policy denies. (HeadBucket answers a
   bare 403 without the reason, so doctor asks once more with a listing, which carries it.)
4. **list / put / get / delete** — the permissions actually held, tried on keys shaped like
   the ones each role writes: a scratch *manifest* object
   ``<prefix>/.s3kv-doctor/manifest/doctor-<random>`` (written, read back, deleted) and,
   where the role deletes blocks, a never-written *block* key
   ``<prefix>/.s3kv-doctor/blocks/doctor-<random>`` (deleting an absent key is allowed and
   proves the permission). ``.s3kv-doctor`` is not a fingerprint, so no command takes these
   for data; they match the ``<prefix>/*/manifest/*`` and ``<prefix>/*`` grants of
   ``infra/aws/`` and not the ``.s3kv-probe/`` scratch grant, so an engine's right to delete
   manifest objects is really tried. Each refusal names the IAM action and resource to grant.
5. **conditional write** — whether ``If-None-Match: *`` is honoured
   (:meth:`s3kv.storage.Backend.probe_conditional_put`, under ``<prefix>/.s3kv-probe/``).
6. **latency** — median and worst of a few HEAD requests, and, over a network, how many block
   GETs a second ``io_threads`` allows at that round trip.

``role`` narrows steps 4-5 to what one role needs (the others are reported as skipped):

* ``engine`` — list; get and put of blocks and manifest objects; conditional write (block
  and segment creates, the compactor election); delete of manifest objects (the elected
  compactor deletes folded segments and superseded deltas/snapshots).
* ``pruner`` (``prune``, ``compact``, ``pin``) — list; get and put of manifest objects;
  delete of blocks and manifest objects; conditional write (the operator lease is a
  conditional create of the next log entry).
* ``reader`` (``stats``, ``verify`` without deletes) — list and get.
* ``all`` (default) — everything above.

**Deadline.** The whole run ends within ``timeout`` seconds (default 20) whatever the
endpoint does: the backend is built with short per-request timeouts (connect and read
timeouts at most a quarter of the deadline, at most 2 attempts, via ``cfg.replace``), and
each step runs in a worker thread that is abandoned once the deadline passes; what has not
run by then is reported as skipped. ``progress`` receives one line as each step starts and
one as it ends, so a person watching sees which request is waiting on which endpoint.

Everything goes through :mod:`s3kv.storage` (:func:`~s3kv.storage.open_backend`,
:func:`~s3kv.storage.whoami`), so a ``file://`` directory is checked like a bucket.
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from s3kv import _zstd
from s3kv.config import S3KVConfig
from s3kv.errors import AccessDeniedError, ConfigError, EndpointError, StorageError
from s3kv.offload import auto_here
from s3kv.storage import Backend, Credentials, is_file_url, open_backend, whoami

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ROLES",
    "Check",
    "DoctorReport",
    "Setting",
    "run_doctor",
]

_T = TypeVar("_T")
_USERINFO = re.compile(r"(?<=://)[^/@]*@")
_CODE_IN_MESSAGE = re.compile(r"\[([A-Za-z][A-Za-z0-9.]*), HTTP \d+")
_SLOW_MS = 200.0
#: Where the permission probes write (not a fingerprint: 32 hex digits).
_DOCTOR_DIR = ".s3kv-doctor/"
#: Where the conditional-write probe writes (:mod:`s3kv.storage`).
_PROBE_DIR = ".s3kv-probe/"

#: The overall deadline of a run, in seconds, unless the caller gives one.
DEFAULT_TIMEOUT_S = 20.0
#: The roles ``role`` accepts: what each needs is in the module docstring.
ROLES: tuple[str, ...] = ("all", "engine", "pruner", "reader")
#: Attempts per request during a doctor run (at most; fewer if the settings say so).
_MAX_ATTEMPTS = 2


def _no_progress(line: str) -> None:
    """The default progress callback: report nothing."""


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
    """Settings with their sources, and the checks in the order run.

    Attributes:
        settings: Every setting with its source, then the effective endpoint and region.
        checks: The checks in the order run (skipped ones included).
        role: The role whose permissions were checked (:data:`ROLES`).
        timeout_s: The overall deadline.
        endpoint: The endpoint the client talks to (a directory URL for ``file://``),
            ``None`` if the backend could not be built.
        region: The region the client signs for, ``None`` where there is none.
    """

    settings: tuple[Setting, ...]
    checks: tuple[Check, ...]
    role: str = "all"
    timeout_s: float = DEFAULT_TIMEOUT_S
    endpoint: str | None = None
    region: str | None = None

    @property
    def ok(self) -> bool:
        """No check failed (warnings allowed)."""
        return all(c.status != "fail" for c in self.checks)


class _DeadlineError(Exception):
    """The overall deadline passed."""


class _Deadline:
    """Runs steps in a worker thread each, none past the overall deadline."""

    def __init__(self, seconds: float, clock: Callable[[], float]) -> None:
        self.seconds = seconds
        self._clock = clock
        self._end = clock() + seconds
        self.expired = False

    def left(self) -> float:
        return self._end - self._clock()

    def run(self, fn: Callable[[], _T]) -> _T:
        """``fn()``, or :class:`_DeadlineError` once the deadline passes (``fn`` is abandoned).

        Raises:
            _DeadlineError: the deadline passed before or while ``fn`` ran.
            BaseException: whatever ``fn`` raised.
        """
        left = self.left()
        if self.expired or left <= 0:
            self.expired = True
            raise _DeadlineError
        box: list[tuple[bool, Any]] = []

        def target() -> None:
            try:
                box.append((True, fn()))
            except BaseException as exc:  # handed to the waiting thread
                box.append((False, exc))

        # NOTE: a daemon thread: one stuck on a socket must not keep the process alive;
        # its own socket timeouts end it soon after.
        worker = threading.Thread(target=target, name="s3kv-doctor-step", daemon=True)
        worker.start()
        worker.join(left)
        if not box:
            self.expired = True
            raise _DeadlineError
        ok, value = box[0]
        if ok:
            result: _T = value
            return result
        raise value


@dataclass
class _Run:
    """The state of one doctor run: settings, deadline, progress and the checks so far."""

    cfg: S3KVConfig
    deadline: _Deadline
    progress: Callable[[str], None]
    timer: Callable[[], float]
    role: str
    checks: list[Check] = field(default_factory=list)
    endpoint: str | None = None
    credentials: Credentials | None = None
    #: Seconds the backend's requests were sized for (what was left of the deadline).
    probe_budget: float = 0.0

    def step(self, name: str, what: str, fn: Callable[[], Check]) -> Check:
        """Run one check under the deadline, with a progress line before and after."""
        if self.deadline.expired or self.deadline.left() <= 0:
            self.deadline.expired = True
            check = Check(name, "skip", f"the {self.deadline.seconds:g} s deadline had passed")
            self.checks.append(check)
            return check
        self.progress(f"doctor: {name}: {what} ...")
        start = time.monotonic()
        try:
            check = self.deadline.run(fn)
        except _DeadlineError:
            check = self.overrun(name)
        took = time.monotonic() - start
        self.checks.append(check)
        mark = {"ok": "ok", "warn": "WARN", "fail": "FAIL", "skip": "skip"}.get(check.status)
        self.progress(f"doctor: {name}: {mark or check.status} after {took:.1f} s: {check.detail}")
        return check

    def overrun(self, name: str) -> Check:
        """The check of a step the deadline cut short."""
        if name == "credentials":
            return Check(
                name,
                "fail",
                f"the AWS credential chain did not answer within the "
                f"{self.deadline.seconds:g} s deadline",
                "a profile's SSO or credential_process, or the instance metadata service, "
                "hangs: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or fix the profile",
            )
        where = self.endpoint or "the endpoint"
        return Check(
            name,
            "fail",
            f"no answer from {where} within the {self.deadline.seconds:g} s deadline",
            f"check that {where} is an S3 endpoint (not a proxy or another service) and "
            "that it is healthy; a slow but working endpoint needs a longer --timeout",
        )


def run_doctor(
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    open_backend: Callable[[S3KVConfig], Backend] | None = None,
    timer: Callable[[], float] = time.perf_counter,
    samples: int = 5,
    role: str = "all",
    timeout: float = DEFAULT_TIMEOUT_S,
    progress: Callable[[str], None] = _no_progress,
    monotonic: Callable[[], float] = time.monotonic,
) -> DoctorReport:
    """Run the checks; never raises for a problem it can report; ends within ``timeout``.

    Args:
        environ: Environment to read settings from (default ``os.environ``).
        overrides: Command-line settings (``bucket``, ``prefix``...; ``None`` values ignored).
        open_backend: Builds the backend (default: :func:`s3kv.storage.open_backend`). Called
            with ``conditional_put="off"`` (so that opening does no I/O) and short
            per-request timeouts (see the module docstring).
        timer: Monotonic seconds, for latencies.
        samples: HEAD requests for the latency check.
        role: Whose permissions to check: one of :data:`ROLES`.
        timeout: The overall deadline in seconds (> 0).
        progress: Called with one line as each step starts and as it ends (for people;
            the CLI prints them on stderr).
        monotonic: Monotonic seconds, for the deadline.

    Raises:
        ValueError: an unknown ``role`` or a ``timeout`` that is not positive.
    """
    if role not in ROLES:
        raise ValueError(f"role: expected one of {', '.join(ROLES)}, got {role!r}")
    if not timeout > 0:
        raise ValueError(f"timeout: must be > 0, got {timeout!r}")
    deadline = _Deadline(timeout, monotonic)
    env = os.environ if environ is None else environ
    try:
        cfg, sources = S3KVConfig.load_with_sources(environ=environ, **dict(overrides or {}))
    except ConfigError as exc:
        check = Check("settings", "fail", str(exc), "fix the setting named")
        return DoctorReport((), (check,), role, timeout)
    settings = list(_settings(cfg, sources))
    run = _Run(cfg, deadline, progress, timer, role)
    run.checks.append(Check("settings", "ok", f"{len(sources)} set, the rest defaults"))
    run.checks.append(_codec(cfg))
    region: str | None = None

    def report() -> DoctorReport:
        return DoctorReport(tuple(settings), tuple(run.checks), role, timeout, run.endpoint, region)

    if not cfg.bucket and not is_file_url(cfg.endpoint_url):
        run.checks.append(
            Check("bucket", "fail", "no bucket configured", "set TLLM_S3KV_BUCKET or pass --bucket")
        )
        return report()
    what = "none needed" if is_file_url(cfg.endpoint_url) else "the AWS credential chain"
    run.step("credentials", what, lambda: _credentials(run))
    # NOTE: requests sized to what the earlier steps left of the deadline, so that a silent
    # endpoint is diagnosed by their own timeouts before the deadline cuts the step short
    # (a credential chain that took seconds used to leave the bucket step a bare overrun).
    run.probe_budget = max(0.0, deadline.left())
    try:
        backend = deadline.run(lambda: _open(cfg, open_backend, run.probe_budget))
    except _DeadlineError:
        run.checks.append(run.overrun("bucket"))
        return report()
    except StorageError as exc:
        run.checks.append(Check("bucket", "fail", str(exc), _remedy(exc)))
        return report()
    except ConfigError as exc:
        run.checks.append(Check("bucket", "fail", str(exc), "fix the setting named"))
        return report()
    run.endpoint, region = _location(backend)
    settings.extend(_effective(cfg, sources, env, run.endpoint, region))
    progress(
        f"doctor: endpoint {_safe(run.endpoint)}, region {region or '-'}, role {role}, "
        f"deadline {timeout:g} s"
    )
    try:
        _bucket_checks(run, backend, samples)
    finally:
        _close(backend, deadline)
    return report()


def _codec_processes_here(cfg: S3KVConfig) -> tuple[int, str]:
    """The codec processes a GPU rank on this host runs with ``cfg``, and how it got them."""
    if cfg.codec_processes == "auto":
        choice = auto_here(on_gpu=True, stores=1, tp_size=1)
        return choice.processes, (
            f"codec_processes auto: {choice.processes} per GPU rank here ({choice.reason})"
        )
    return cfg.codec_processes, f"codec_processes {cfg.codec_processes}"


def _codec(cfg: S3KVConfig) -> Check:
    """Whether the byte-plane codec runs in its native kernel here, and where a GPU rank's
    blocks are coded: codec processes or the I/O threads (no I/O)."""
    problem = _zstd.kernel_problem()
    processes, where = _codec_processes_here(cfg)
    if problem is None:
        return Check("codec", "ok", f"native plane kernel; {where}")
    if processes:
        return Check("codec", "ok", f"Python plane codec ({problem}), off the GIL; {where}")
    return Check(
        "codec",
        "warn",
        f"Python plane codec ({problem}) in the I/O threads ({where}): they contend for the "
        "GIL (at 8 threads about 0.6x the kernel's encode MB/s)",
        "reinstall s3kv-cache where a C compiler and CPython >= 3.11 are present, or set "
        "codec_processes",
    )


def _probe_config(cfg: S3KVConfig, timeout: float) -> S3KVConfig:
    """``cfg`` with no open-time I/O and requests short enough for the deadline."""
    per_request = max(0.5, round(timeout / 4, 1))
    return cfg.replace(
        conditional_put="off",
        connect_timeout=min(cfg.connect_timeout, per_request),
        read_timeout=min(cfg.read_timeout, per_request),
        max_attempts=min(cfg.max_attempts, _MAX_ATTEMPTS),
    )


def _open(
    cfg: S3KVConfig, factory: Callable[[S3KVConfig], Backend] | None, timeout: float
) -> Backend:
    return (factory or open_backend)(_probe_config(cfg, timeout))


def _close(backend: Backend, deadline: _Deadline) -> None:
    if not deadline.expired:
        backend.close()
        return
    # NOTE: an abandoned step may still hold a connection: close without waiting for it.
    threading.Thread(target=_close_quietly, args=(backend,), daemon=True).start()


def _close_quietly(backend: Backend) -> None:
    with contextlib.suppress(Exception):  # best effort: the report is complete
        backend.close()


def _safe(value: object) -> str:
    return _USERINFO.sub("***@", str(value))


def _settings(cfg: S3KVConfig, sources: Mapping[str, str]) -> tuple[Setting, ...]:
    return tuple(
        Setting(
            f.name,
            _safe(getattr(cfg, f.name)),
            sources.get(f.name, "default").replace("argument", "command line"),
        )
        for f in fields(cfg)
    )


def _location(backend: Backend) -> tuple[str | None, str | None]:
    """The endpoint and region a backend's client uses (``file://`` URL for a directory).

    NOTE: :mod:`s3kv.storage` does not expose these on :class:`~s3kv.storage.Backend`; the
    S3 backend's ``client.meta`` has them (read duck-typed, through delegating wrappers).
    """
    seen: object = backend
    for _ in range(8):
        meta = getattr(getattr(seen, "client", None), "meta", None)
        if meta is not None:
            endpoint = getattr(meta, "endpoint_url", None)
            region = getattr(meta, "region_name", None)
            return (str(endpoint) if endpoint else None, str(region) if region else None)
        inner = getattr(seen, "inner", None)
        if inner is None:
            break
        seen = inner
    return backend.description.split(" at ")[-1], None


def _effective(
    cfg: S3KVConfig,
    sources: Mapping[str, str],
    env: Mapping[str, str],
    endpoint: str | None,
    region: str | None,
) -> tuple[Setting, ...]:
    def source(name: str, env_names: tuple[str, ...], fallback: str) -> str:
        if getattr(cfg, name):
            return sources.get(name, "default").replace("argument", "command line")
        for env_name in env_names:
            if env.get(env_name):
                return f"env {env_name}"
        return fallback

    if is_file_url(cfg.endpoint_url):
        return (Setting("endpoint (effective)", _safe(endpoint), "endpoint_url"),)
    return (
        Setting(
            "endpoint (effective)",
            _safe(endpoint or "?"),
            source(
                "endpoint_url",
                ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
                "AWS, from the region",
            ),
        ),
        Setting(
            "region (effective)",
            region or "-",
            source(
                "region",
                ("AWS_REGION", "AWS_DEFAULT_REGION"),
                "the AWS profile, else the default",
            ),
        ),
    )


def _credentials(run: _Run) -> Check:
    try:
        creds = whoami(run.cfg)
    except StorageError as exc:
        return Check("credentials", "fail", str(exc), _remedy(exc))
    run.credentials = creds
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


def _error_code(exc: BaseException) -> str | None:
    """The S3 error code behind a :class:`~s3kv.errors.StorageError`, if it carries one.

    NOTE: StorageError has no code attribute; the translated botocore error (``__cause__``)
    has it in ``response``, and the message repeats it as ``[Code, HTTP nnn]``.
    """
    response = getattr(exc.__cause__, "response", None)
    if isinstance(response, dict):
        code = (response.get("Error") or {}).get("Code")
        if code:
            return str(code)
    match = _CODE_IN_MESSAGE.search(str(exc))
    return match.group(1) if match else None


def _timed(timer: Callable[[], float], fn: Callable[[], _T]) -> tuple[_T, float]:
    start = timer()
    result = fn()
    return result, (timer() - start) * 1000


@dataclass(frozen=True)
class _Need:
    """One permission a role needs: the IAM action, on what, and who uses it."""

    action: str
    resource: str
    who: str


_BUCKET_ARN = "arn:aws:s3:::{bucket}"
_ANY_ARN = "arn:aws:s3:::{bucket}/{prefix}*"
_MANIFEST_ARN = "arn:aws:s3:::{bucket}/{prefix}*/manifest/*"

#: role -> check -> what it needs. A check a role does not list is skipped for it.
_NEEDS: dict[str, dict[str, _Need]] = {
    "all": {
        "list": _Need("s3:ListBucket", _BUCKET_ARN, "every role"),
        "put": _Need("s3:PutObject", _ANY_ARN,
                     "engines; prune, compact and pin write the manifest"),
        "get": _Need("s3:GetObject", _ANY_ARN, "every role"),
        "delete": _Need("s3:DeleteObject", _ANY_ARN,
                        "prune and compact; engines delete manifest objects"),
        "conditional write": _Need("s3:PutObject", _ANY_ARN, "engines and the operator lease"),
    },
    "engine": {
        "list": _Need("s3:ListBucket", _BUCKET_ARN, "engines list manifest segments and the log"),
        "put": _Need("s3:PutObject", _ANY_ARN, "engines write blocks and manifest segments"),
        "get": _Need("s3:GetObject", _ANY_ARN, "engines read blocks and the manifest"),
        "delete": _Need("s3:DeleteObject", _MANIFEST_ARN,
                        "the engines' elected compactor deletes folded manifest objects"),
        "conditional write": _Need("s3:PutObject", _ANY_ARN, "engines create blocks once"),
    },
    "pruner": {
        "list": _Need("s3:ListBucket", _BUCKET_ARN, "prune lists blocks and the manifest"),
        "put": _Need("s3:PutObject", _MANIFEST_ARN, "prune, compact and pin write the manifest"),
        "get": _Need("s3:GetObject", _MANIFEST_ARN, "prune and compact read the manifest"),
        "delete": _Need("s3:DeleteObject", _ANY_ARN,
                        "prune deletes blocks, compaction folded manifest objects"),
        "conditional write": _Need("s3:PutObject", _MANIFEST_ARN,
                                   "the operator lease is a conditional create"),
    },
    "reader": {
        "list": _Need("s3:ListBucket", _BUCKET_ARN, "readers (stats, verify)"),
        "get": _Need("s3:GetObject", _ANY_ARN, "readers (stats, verify)"),
    },
}  # fmt: skip
#: Roles that delete blocks (the others delete manifest objects at most).
_DELETES_BLOCKS = frozenset({"all", "pruner"})


def _denied(run: _Run, op: str, exc: BaseException | str) -> Check:
    need = _NEEDS[run.role][op]
    prefix = run.cfg.key_prefix + "/" if run.cfg.key_prefix else ""
    where = need.resource.format(bucket=run.cfg.bucket, prefix=prefix)
    return Check(
        op,
        "fail",
        f"denied: {exc}",
        f"grant {need.action} on {where} (needed by {need.who}); see infra/aws/",
    )


def _bucket_checks(run: _Run, backend: Backend, samples: int) -> None:
    root = run.cfg.key_prefix + "/" if run.cfg.key_prefix else ""
    bucket = run.step(
        "bucket", f"reaching {backend.description}", lambda: _bucket(run, backend, root)
    )
    if bucket.status != "ok":
        run.checks.append(Check("permissions", "skip", "the bucket is not reachable"))
        return
    token = uuid.uuid4().hex
    scratch = f"{root}{_DOCTOR_DIR}manifest/doctor-{token}"
    block_like = f"{root}{_DOCTOR_DIR}blocks/doctor-{token}"
    doomed = [scratch, block_like] if run.role in _DELETES_BLOCKS else [scratch]
    payload = b"s3kv doctor scratch object\n"
    needs = _NEEDS[run.role]
    put_ok = False
    for op, what, call in (
        ("list", f"list {root}{_DOCTOR_DIR}",
         lambda: next(iter(backend.list(root + _DOCTOR_DIR)), None)),
        ("put", f"put {scratch}", lambda: backend.put(scratch, payload)),
        ("get", f"get {scratch}", lambda: backend.get(scratch)),
        ("delete", f"delete {', '.join(doomed)}", lambda: backend.delete_many(doomed)),
    ):  # fmt: skip
        if op not in needs:
            run.checks.append(Check(op, "skip", f"not needed by --role {run.role}"))
            continue
        ok = put_ok

        def probe(op: str = op, call: Callable[[], object] = call, ok: bool = ok) -> Check:
            return _permission(run, op, call, ok, payload, scratch)

        check = run.step(op, what, probe)
        put_ok = put_ok or (op == "put" and check.status == "ok")
    if "conditional write" in needs:
        run.step(
            "conditional write",
            f"PUT If-None-Match: * twice under {root}{_PROBE_DIR}",
            lambda: _conditional(backend, run.cfg, put_ok),
        )
    else:
        run.checks.append(Check("conditional write", "skip", f"not needed by --role {run.role}"))
    run.step(
        "latency",
        f"{max(1, samples)} HEAD requests",
        lambda: _latency(backend, scratch, run.timer, samples, run.cfg),
    )


def _bucket(run: _Run, backend: Backend, root: str) -> Check:
    try:
        _, ms = _timed(run.timer, backend.check)
    except AccessDeniedError as exc:
        return _bucket_denied(run, backend, root, exc)
    except EndpointError as exc:
        return _unreachable(run, exc)
    except StorageError as exc:
        return Check("bucket", "fail", str(exc), _remedy(exc))
    return Check("bucket", "ok", f"{backend.description} reachable", latency_ms=ms)


def _unreachable(run: _Run, exc: EndpointError) -> Check:
    cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else ""
    if "Timeout" not in cause and "timed out" not in str(exc):
        return Check("bucket", "fail", str(exc), _remedy(exc))
    where = run.endpoint or "the endpoint"
    cfg = _probe_config(run.cfg, run.probe_budget or run.deadline.seconds)
    if "Connect" in cause:
        detail = f"could not connect to {where} within {cfg.connect_timeout:g} s"
    else:
        detail = f"{where} accepted the connection but sent no answer within {cfg.read_timeout:g} s"
    return Check(
        "bucket",
        "fail",
        f"{detail} ({cfg.max_attempts} attempts, {cause or 'timeout'})",
        f"check that {where} is an S3 endpoint (not a proxy or another service) and that "
        "it is healthy; a slow but working endpoint needs a longer --timeout",
    )


#: S3 error code -> (what it means, with {key}; what to change).
_CREDENTIAL_CODES: dict[str, tuple[str, str]] = {
    "InvalidAccessKeyId": (
        "unknown access key id {key}: {endpoint} has no such key (InvalidAccessKeyId)",
        "use an access key id this endpoint knows (AWS_ACCESS_KEY_ID, AWS_PROFILE or "
        "TLLM_S3KV_PROFILE); a key made for another endpoint or account, or deleted, "
        "is refused like this",
    ),
    "SignatureDoesNotMatch": (
        "wrong secret key for access key id {key}: {endpoint} knows the key id but the "
        "request signature does not match (SignatureDoesNotMatch)",
        "set AWS_SECRET_ACCESS_KEY (or the profile's aws_secret_access_key) to the secret "
        "of that key id; a proxy that rewrites requests causes this too",
    ),
    "ExpiredToken": (
        "the session credentials of access key id {key} have expired (ExpiredToken)",
        "refresh them (aws sso login, a new STS session, or restart on the instance role)",
    ),
    "TokenRefreshRequired": (
        "the session credentials of access key id {key} must be refreshed (TokenRefreshRequired)",
        "refresh them (aws sso login, a new STS session, or restart on the instance role)",
    ),
    "InvalidToken": (
        "the session token does not belong to access key id {key} (InvalidToken)",
        "set AWS_SESSION_TOKEN from the same STS response as the key pair, or unset it",
    ),
}


def _bucket_denied(run: _Run, backend: Backend, root: str, exc: AccessDeniedError) -> Check:
    code = _error_code(exc)
    if code in (None, "403", "Forbidden", "AccessDenied"):
        # NOTE: HeadBucket answers a bare 403 (a HEAD response has no body); a listing
        # carries the error code that tells a wrong secret from an unknown key id.
        try:
            next(iter(backend.list(root)), None)
        except AccessDeniedError as listed:
            code, exc = _error_code(listed) or code, listed
        except StorageError:
            pass
    key = run.credentials.access_key_id if run.credentials else "?"
    where = run.endpoint or "the endpoint"
    if code in _CREDENTIAL_CODES:
        detail, remedy = _CREDENTIAL_CODES[code]
        return Check("bucket", "fail", detail.format(key=key, endpoint=where), remedy)
    if code == "AccessDenied":
        bucket = run.cfg.bucket
        return Check(
            "bucket",
            "fail",
            f"access key id {key} is valid but may not use bucket {bucket!r} at {where} "
            f"(AccessDenied): {exc}",
            f"grant s3:ListBucket on arn:aws:s3:::{bucket} (HeadBucket needs it); see infra/aws/",
        )
    return Check("bucket", "fail", str(exc), _remedy(exc))


def _permission(
    run: _Run,
    op: str,
    call: Callable[[], object],
    put_ok: bool,
    payload: bytes,
    scratch: str,
) -> Check:
    try:
        result, ms = _timed(run.timer, call)
    except AccessDeniedError as exc:
        return _denied(run, op, exc)
    except StorageError as exc:
        return Check(op, "fail", str(exc), _remedy(exc))
    if op == "delete" and getattr(result, "failed", None):
        failed: dict[str, str] = result.failed  # type: ignore[attr-defined]
        kinds = " and ".join(
            kind for kind, part in (("manifest", "/manifest/"), ("block", "/blocks/"))
            if any(part in key for key in failed)
        )  # fmt: skip
        check = _denied(run, op, f"{kinds} objects: {next(iter(failed.values()))}")
        if put_ok and scratch in failed:
            remedy = f"{check.remedy}; then delete the scratch object {scratch}"
            return Check(check.name, check.status, check.detail, remedy)
        return check
    if op == "get" and put_ok and result != payload:
        return Check(
            op,
            "fail",
            "read back different bytes than written",
            "the endpoint or a proxy alters objects; check it",
        )
    detail = "allowed" if op != "get" or put_ok else "allowed (scratch object absent)"
    if op == "delete":
        blocks = run.role in _DELETES_BLOCKS
        detail += " on block and manifest objects" if blocks else " on manifest objects"
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


def _latency(
    backend: Backend, key: str, timer: Callable[[], float], samples: int, cfg: S3KVConfig
) -> Check:
    """HEAD round trips, and what they allow the GETs a GPU rank here runs at once (each one
    round trip at least, however short the transfer): at 10 ms, 8 keep 1 MB blocks under
    6.4 Gbit/s (on a 10 Gbit/s link 10 ms away 8 GETs at once staged 610 MB/s, 32 up to
    1,460; README, WAN figures)."""
    times = []
    try:
        for _ in range(max(1, samples)):
            times.append(_timed(timer, lambda: backend.head(key))[1])
    except StorageError as exc:
        return Check("latency", "fail", str(exc), _remedy(exc))
    median = statistics.median(times)
    detail = f"HEAD median {median:.1f} ms, worst {max(times):.1f} ms over {len(times)}"
    if median >= 1.0:  # NOTE: a network round trip, not a local folder or loopback
        at_once = cfg.io_concurrency(_codec_processes_here(cfg)[0])
        per_s = at_once * 1000 / median
        detail += (
            f"; {at_once} GETs at once (io_threads {cfg.io_threads}) allow at most "
            f"{per_s:,.0f} block GETs a second "
            f"({per_s * 8e6 / 1e9:,.1f} Gbit/s of 1 MB blocks); raise it where the link is faster"
        )
    if median > _SLOW_MS:
        return Check(
            "latency",
            "warn",
            detail,
            "engines pay this on every block GET: run them in the bucket's region",
            latency_ms=median,
        )
    return Check("latency", "ok", detail, latency_ms=median)
