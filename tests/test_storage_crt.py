"""Object GET/PUT through awscrt (``s3_client``), and the wire shape of block PUTs.

The Backend contract itself runs against the awscrt transport on moto and SeaweedFS in
test_storage_contract.py; this file covers what only that transport has: how S3Backend
picks it, where it takes credentials, endpoint, region, TLS, timeouts and retries from, and
how its failures become the same one-line :class:`~s3kv.errors.StorageError` tree as
boto3's. A small recording S3 on loopback (:class:`FakeS3`) shows what goes on the wire.
"""

from __future__ import annotations

import datetime
import gc
import ipaddress
import logging
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import botocore.exceptions as bce
import pytest
from botocore.credentials import RefreshableCredentials
from conftest import s3_config, unique_bucket

from s3kv.config import S3KVConfig
from s3kv.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    ConfigError,
    EndpointError,
    ObjectTooLargeError,
    PreconditionFailedError,
    StorageError,
    ThrottledError,
)
from s3kv.metrics import Metrics
from s3kv.storage import (
    CircuitBreaker,
    CircuitOpenError,
    InstrumentedBackend,
    S3Backend,
    ensure_bucket,
    make_client,
    open_backend,
    translate_error,
)
from s3kv.testing.local_s3 import LocalS3, free_port

# ----------------------------------------------------------------------------------------
# A recording S3 on loopback
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recorded:
    """One request as the server read it (header names in lower case)."""

    method: str
    path: str
    headers: dict[str, str]


class FakeS3(ThreadingHTTPServer):
    """Just enough S3 for GET/PUT: objects in a dict, ranged GETs, and scripted failures.

    ``answer``: ``"store"`` (behave), ``"slowdown"`` (503 SlowDown to everything),
    ``"internal"`` (500 InternalError) or ``"silent"`` (read the request, never answer
    until :meth:`close`). Every request is appended to ``requests``.
    """

    daemon_threads = True

    def __init__(self, answer: str = "store", tls: ssl.SSLContext | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answer = answer
        self.requests: list[Recorded] = []
        self.objects: dict[str, bytes] = {}
        self.released = threading.Event()
        if tls is not None:
            # NOTE: the handshake runs in the request's thread (_Handler.setup), and a failed
            # one closes the connection at once, as a real server does on a TLS alert.
            self.socket = tls.wrap_socket(
                self.socket, server_side=True, do_handshake_on_connect=False
            )
        scheme = "https" if tls is not None else "http"
        self.endpoint = f"{scheme}://127.0.0.1:{self.server_address[1]}"
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a refused TLS handshake, a client gone: the test sees the client's side

    def close(self) -> None:
        self.released.set()
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=10)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeS3
    _ERRORS: ClassVar[dict[str, tuple[int, str]]] = {
        "slowdown": (503, "SlowDown"),
        "internal": (500, "InternalError"),
    }

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            self.request.do_handshake()
        super().setup()

    def _record(self) -> str | None:
        """Record the request; the object's path (query dropped), or None once answered."""
        headers = {name.lower(): value for name, value in self.headers.items()}
        self.server.requests.append(Recorded(self.command, self.path, headers))
        if self.server.answer == "silent":
            self.server.released.wait(timeout=30)
            self.close_connection = True
            return None
        if self.server.answer in self._ERRORS:
            status, code = self._ERRORS[self.server.answer]
            self._error(status, code)
            return None
        return self.path.split("?", 1)[0]

    def _error(self, status: int, code: str) -> None:
        body = f"<Error><Code>{code}</Code><Message>scripted {code}</Message></Error>".encode()
        self._reply(status, body, [("Content-Type", "application/xml")])

    def _reply(self, status: int, body: bytes, headers: list[tuple[str, str]] = []) -> None:  # noqa: B006
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        path = self._record()
        if path is not None:
            self.server.objects[path] = body
            self._reply(200, b"", [("ETag", '"fake"')])

    def do_GET(self) -> None:
        path = self._record()
        if path is None:
            return
        data = self.server.objects.get(path)
        if data is None:
            self._error(404, "NoSuchKey")
            return
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
        if match is None:
            self._reply(200, data, [("ETag", '"fake"')])
        elif not data:
            self._error(416, "InvalidRange")
        else:
            first, last = int(match[1]), min(int(match[2]), len(data) - 1)
            content_range = f"bytes {first}-{last}/{len(data)}"
            headers = [("Content-Range", content_range), ("ETag", '"fake"')]
            self._reply(206, data[first : last + 1], headers)


@pytest.fixture
def fake_s3() -> Iterator[FakeS3]:
    server = FakeS3()
    try:
        yield server
    finally:
        server.close()


def open_s3(endpoint: str, bucket: str = "bkt", **overrides: Any) -> S3Backend:
    """An S3Backend built as production builds it (no client passed in), probe off."""
    settings = {"conditional_put": "off", **overrides}
    return S3Backend.from_config(s3_config(endpoint, bucket, **settings))


# ----------------------------------------------------------------------------------------
# the wire: no Expect: 100-continue on block PUTs (a whole round trip per PUT at WAN RTT)
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("client", ["boto3", "crt"])
def test_put_sends_no_expect_100_continue(fake_s3: FakeS3, aws_env: None, client: str) -> None:
    backend = open_s3(fake_s3.endpoint, s3_client=client)
    for size in (0, 4096, 2 * 1024 * 1024):  # botocore asked for 100-continue on all of them
        assert backend.put(f"k{size}", os.urandom(size)) is True
    puts = [r for r in fake_s3.requests if r.method == "PUT"]
    assert len(puts) == 3
    assert [r.headers.get("expect") for r in puts] == [None, None, None]
    assert fake_s3.objects["/bkt/k4096"] is not None
    backend.close()


@pytest.mark.parametrize("client", ["boto3", "crt"])
def test_if_none_match_only_on_conditional_puts(
    fake_s3: FakeS3, aws_env: None, client: str
) -> None:
    backend = open_s3(fake_s3.endpoint, s3_client=client, conditional_put="on")
    backend.put("a", b"1", if_absent=True)
    backend.put("b", b"2")
    assert [r.headers.get("if-none-match") for r in fake_s3.requests] == ["*", None]


# ----------------------------------------------------------------------------------------
# which client carries GET/PUT
# ----------------------------------------------------------------------------------------


class TestSelection:
    def test_auto_picks_awscrt(self, fake_s3: FakeS3, aws_env: None) -> None:
        assert open_s3(fake_s3.endpoint).transport == "awscrt"
        assert open_s3(fake_s3.endpoint, s3_client="boto3").transport == "boto3"

    def test_the_store_path_picks_awscrt(self, fake_s3: FakeS3, aws_env: None) -> None:
        # open_backend is what KVStore.open and the CLI use.
        cfg = s3_config(fake_s3.endpoint, "bkt", conditional_put="off")
        backend = open_backend(cfg)
        assert isinstance(backend, S3Backend)
        assert backend.transport == "awscrt"
        assert backend.put("k", b"v") is True
        assert backend.get("k") == b"v"
        assert all("CRT" in r.headers.get("user-agent", "") for r in fake_s3.requests)

    def test_an_injected_client_carries_everything_unless_crt_is_asked(
        self, fake_s3: FakeS3, aws_env: None
    ) -> None:
        cfg = s3_config(fake_s3.endpoint, "bkt", conditional_put="off")
        client = make_client(cfg)
        assert S3Backend.from_config(cfg, client=client).transport == "boto3"
        crt = S3Backend.from_config(cfg.replace(s3_client="crt"), client=client)
        assert crt.transport == "awscrt"

    def test_crt_without_awscrt_names_the_fix(
        self, fake_s3: FakeS3, aws_env: None, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setitem(sys.modules, "s3kv.storage.crt", None)  # import now fails
        with pytest.raises(ConfigError, match=r"s3_client: .*s3kv-cache\[crt\].*S3_CLIENT=boto3"):
            open_s3(fake_s3.endpoint, s3_client="crt")
        assert open_s3(fake_s3.endpoint).transport == "boto3"  # auto falls back

    def test_no_credentials_leaves_get_put_to_boto3(
        self, moto_server: str, aws_env: None, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        backend = open_s3(moto_server, s3_client="crt")
        assert backend.transport == "boto3"
        with pytest.raises(AccessDeniedError, match="AWS_ACCESS_KEY_ID"):
            backend.get("k")

    def test_importing_s3kv_and_the_cli_does_not_import_awscrt(self) -> None:
        # NOTE: botocore itself imports awscrt where installed (botocore.compat), so the S3
        # module cannot be in this list; s3kv imports boto3 only on first S3 use.
        code = (
            "import sys, s3kv, s3kv.storage, s3kv.cli, s3kv.store, s3kv.connector; "
            "sys.exit('imported awscrt' if 'awscrt' in sys.modules else 0)"
        )
        result = subprocess.run(
            [sys.executable, "-c", code], check=False, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr + result.stdout


# ----------------------------------------------------------------------------------------
# the request: endpoint, addressing, region, signing (the same shape from both clients)
# ----------------------------------------------------------------------------------------


class TestRequestShape:
    @pytest.mark.parametrize("client", ["boto3", "crt"])
    @pytest.mark.parametrize("base", ["", "/s3"])
    def test_path_style_signed_for_the_region(
        self, fake_s3: FakeS3, aws_env: None, client: str, base: str
    ) -> None:
        backend = open_s3(fake_s3.endpoint + base, s3_client=client, region="eu-west-3")
        key = "kv/fp0/with space+plus/ü~"
        backend.put(key, b"payload")
        assert backend.get(key) == b"payload"
        put, get = fake_s3.requests
        assert put.path == f"{base}/bkt/kv/fp0/with%20space%2Bplus/%C3%BC~"
        assert get.path == put.path
        for request in (put, get):
            assert request.headers["host"] == fake_s3.endpoint.removeprefix("http://")
            assert "/eu-west-3/s3/aws4_request" in request.headers["authorization"]
            assert request.headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
            assert not [h for h in request.headers if h.startswith("x-amz-checksum")]
            assert "content-md5" not in request.headers

    def test_addressing(self) -> None:
        from s3kv.storage.crt import CrtSettings, _target

        def target(style: str, bucket: str = "my-bucket", path: str = "") -> tuple[str, str]:
            settings = CrtSettings("https://h", "us-east-1", bucket, addressing_style=style)
            return _target("s3.eu-west-1.amazonaws.com", path, settings)

        assert target("auto") == ("my-bucket.s3.eu-west-1.amazonaws.com", "/")
        assert target("virtual", path="/p/") == ("my-bucket.s3.eu-west-1.amazonaws.com", "/p/")
        assert target("auto", "my.bucket") == ("s3.eu-west-1.amazonaws.com", "/my.bucket/")
        assert target("path") == ("s3.eu-west-1.amazonaws.com", "/my-bucket/")

    def test_aws_endpoint_and_style_follow_the_boto3_client(self, aws_env: None) -> None:
        cfg = S3KVConfig(bucket="my-bucket", region="eu-west-1", conditional_put="off")
        backend = S3Backend.from_config(cfg)
        crt = backend._crt
        assert crt is not None
        assert crt.settings.endpoint_url == "https://s3.eu-west-1.amazonaws.com"
        assert crt.settings.region == "eu-west-1"
        assert crt.host == "my-bucket.s3.eu-west-1.amazonaws.com"


# ----------------------------------------------------------------------------------------
# credentials: boto3's chain, refreshed before every request
# ----------------------------------------------------------------------------------------


class TestCredentials:
    def test_from_the_environment(
        self, seaweedfs: LocalS3, aws_env: None, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.access_key or "")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweedfs.secret_key or "")
        backend = open_s3(seaweedfs.endpoint, seaweedfs.bucket)
        assert backend.transport == "awscrt"
        assert backend.put("env-creds", b"v") is True
        assert backend.get("env-creds") == b"v"

    @pytest.mark.parametrize("wrong", ["secret", "access_key"])
    def test_bad_credentials_are_access_denied(
        self, seaweedfs: LocalS3, aws_env: None, wrong: str
    ) -> None:
        assert seaweedfs.secret_key is not None
        bad_secret = "wrong-" + seaweedfs.secret_key
        access = "no-such-key" if wrong == "access_key" else seaweedfs.access_key
        cfg = s3_config(seaweedfs.endpoint, seaweedfs.bucket, conditional_put="off",
                        s3_client="crt")  # fmt: skip
        backend = S3Backend.from_config(
            cfg, client=make_client(cfg, access_key=access, secret_key=bad_secret)
        )
        for call in (lambda: backend.get("k"), lambda: backend.put("k", b"")):
            with pytest.raises(AccessDeniedError) as info:
                call()
            assert_one_line(str(info.value), seaweedfs.bucket, "credentials", "HTTP 403")
            assert bad_secret not in str(info.value)
            assert seaweedfs.secret_key not in str(info.value)

    def test_refreshable_credentials_are_read_before_every_request(
        self,
        seaweedfs: LocalS3,
        aws_env: None,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        # Temporary credentials that botocore must refresh at every use (inside its
        # mandatory-refresh window), rotated by the test through their source.
        assert seaweedfs.secret_key is not None
        source: dict[str, Any] = {"secret": seaweedfs.secret_key, "fail": False, "calls": 0}

        def refresh() -> dict[str, Any]:
            source["calls"] += 1
            if source["fail"]:
                raise bce.CredentialRetrievalError(provider="test", error_msg="STS is down")
            soon = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=5)
            return {"access_key": seaweedfs.access_key, "secret_key": source["secret"],
                    "token": None, "expiry_time": soon.isoformat()}  # fmt: skip

        credentials = RefreshableCredentials.create_from_metadata(refresh(), refresh, "test")
        cfg = s3_config(seaweedfs.endpoint, seaweedfs.bucket, conditional_put="off",
                        s3_client="crt")  # fmt: skip
        client = make_client(cfg)
        monkeypatch.setattr(client, "_get_credentials", lambda: credentials)
        backend = S3Backend.from_config(cfg, client=client)

        before = source["calls"]
        assert backend.put("rotating", b"v") is True
        assert backend.get("rotating") == b"v"
        assert source["calls"] >= before + 2  # one refresh per request
        source["secret"] = "rotated-to-a-wrong-secret"
        with pytest.raises(AccessDeniedError):
            backend.get("rotating")
        source["secret"] = seaweedfs.secret_key
        assert backend.get("rotating") == b"v"
        # A failed refresh is logged once per request and the last credentials go out.
        source["fail"] = True
        with caplog.at_level(logging.WARNING, logger="s3kv.storage.s3"):
            assert backend.get("rotating") == b"v"
        assert "STS is down" in caplog.text
        assert seaweedfs.secret_key not in caplog.text


# ----------------------------------------------------------------------------------------
# TLS
# ----------------------------------------------------------------------------------------


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "s3kv test CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.fixture
def tls_s3(tmp_path: Path) -> Iterator[tuple[FakeS3, Path]]:
    """A :class:`FakeS3` over HTTPS with a self-signed certificate; yields it and the CA."""
    cert, key = self_signed(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = FakeS3(tls=context)
    try:
        yield server, cert
    finally:
        server.close()


@pytest.mark.parametrize("client", ["boto3", "crt"])
def test_ca_bundle(tls_s3: tuple[FakeS3, Path], aws_env: None, client: str) -> None:
    server, ca = tls_s3
    trusted = open_s3(server.endpoint, s3_client=client, ca_bundle=str(ca), max_attempts=1)
    assert trusted.put("k", b"over TLS") is True
    assert trusted.get("k") == b"over TLS"
    sent = len(server.requests)
    untrusted = open_s3(server.endpoint, s3_client=client, max_attempts=1,
                        connect_timeout=1.0, read_timeout=1.0)  # fmt: skip
    with pytest.raises(EndpointError) as info:
        untrusted.get("k", max_bytes=1024)
    assert len(server.requests) == sent  # nothing went over the unverified connection
    # NOTE: s2n (awscrt's TLS) reports a failed handshake only after its 10-30 s "blinding"
    # delay, so awscrt's stall deadline answers first here; test_translate_awscrt_errors
    # shows the TLS message itself.
    assert_one_line(str(info.value), "get s3://bkt/k", server.endpoint)
    if client == "boto3":
        assert "TLLM_S3KV_CA_BUNDLE" in str(info.value)


# ----------------------------------------------------------------------------------------
# timeouts and retries (the same bounds from both clients)
# ----------------------------------------------------------------------------------------


def assert_one_line(message: str, *needles: str) -> None:
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)


@pytest.mark.parametrize("client", ["boto3", "crt"])
class TestTimeoutsAndRetries:
    def test_closed_port_is_endpoint_error_quickly(self, aws_env: None, client: str) -> None:
        endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        backend = open_s3(endpoint, s3_client=client, connect_timeout=0.5, max_attempts=1)
        for call in (lambda: backend.get("some/key"), lambda: backend.put("some/key", b"")):
            started = time.monotonic()
            with pytest.raises(EndpointError) as info:
                call()
            assert time.monotonic() - started < 3.0
            assert_one_line(str(info.value), endpoint, "some/key", "TLLM_S3KV_ENDPOINT_URL")

    def test_connect_timeout(self, aws_env: None, client: str) -> None:
        # A listener whose backlog is full: the kernel drops further SYNs, so connects hang.
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = [socket.socket() for _ in range(3)]
        for filler in fillers:
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))  # the first fills the backlog
        try:
            backend = open_s3(f"http://127.0.0.1:{port}", s3_client=client,
                              connect_timeout=0.3, read_timeout=5.0, max_attempts=1)  # fmt: skip
            started = time.monotonic()
            with pytest.raises(EndpointError, match="TLLM_S3KV_ENDPOINT_URL"):
                backend.get("k")
            assert time.monotonic() - started < 3.0
        finally:
            for sock in (*fillers, listener):
                sock.close()

    @pytest.mark.parametrize("op", ["get", "put"])
    def test_read_timeout(self, aws_env: None, client: str, op: str) -> None:
        server = FakeS3(answer="silent")
        try:
            backend = open_s3(server.endpoint, s3_client=client, connect_timeout=0.5,
                              read_timeout=0.5, max_attempts=1)  # fmt: skip
            started = time.monotonic()
            with pytest.raises(EndpointError) as info:
                # NOTE: a block's bound; awscrt allows 1 s per MiB awaited on top.
                backend.get("k", max_bytes=64 * 1024) if op == "get" else backend.put("k", b"x")
            assert time.monotonic() - started < 5.0
            assert_one_line(str(info.value), f"{op} s3://bkt/k", "TLLM_S3KV_READ_TIMEOUT")
        finally:
            server.close()

    @pytest.mark.parametrize("attempts", [1, 3])
    def test_throttling_is_retried_a_bounded_number_of_times(
        self, aws_env: None, client: str, attempts: int
    ) -> None:
        server = FakeS3(answer="slowdown")
        try:
            backend = open_s3(server.endpoint, s3_client=client, max_attempts=attempts)
            with pytest.raises(ThrottledError) as info:
                backend.put("k", b"x")
            assert_one_line(str(info.value), "SlowDown", "HTTP 503", "TLLM_S3KV_IO_THREADS")
            assert len(server.requests) == attempts
        finally:
            server.close()

    def test_server_error(self, aws_env: None, client: str) -> None:
        server = FakeS3(answer="internal")
        try:
            backend = open_s3(server.endpoint, s3_client=client, max_attempts=2)
            with pytest.raises(StorageError, match=r"server error .*HTTP 500") as info:
                backend.get("k")
            assert type(info.value) is StorageError
            assert len(server.requests) == 2
        finally:
            server.close()


# ----------------------------------------------------------------------------------------
# answers from real servers, and the wrappers
# ----------------------------------------------------------------------------------------


def crt_backend_on(endpoint: str, bucket: str, keys: tuple[str | None, str | None]) -> S3Backend:
    cfg = s3_config(endpoint, bucket, conditional_put="off", s3_client="crt")
    return S3Backend.from_config(cfg, client=make_client(cfg, access_key=keys[0],
                                                         secret_key=keys[1]))  # fmt: skip


def test_missing_bucket_on_moto(moto_server: str, aws_env: None) -> None:
    bucket = unique_bucket()
    backend = crt_backend_on(moto_server, bucket, (None, None))
    for call in (lambda: backend.get("k"), lambda: backend.put("k", b"v")):
        with pytest.raises(BucketNotFoundError) as info:
            call()
        assert_one_line(str(info.value), repr(bucket), moto_server, "TLLM_S3KV_BUCKET")
        assert type(info.value.__cause__).__module__.startswith("awscrt")  # raise ... from


def test_missing_bucket_on_seaweedfs(seaweedfs: LocalS3, aws_env: None) -> None:
    bucket = unique_bucket()
    backend = crt_backend_on(seaweedfs.endpoint, bucket, (seaweedfs.access_key,
                                                          seaweedfs.secret_key))  # fmt: skip
    with pytest.raises(BucketNotFoundError, match=bucket):
        backend.get("k")


def test_failed_requests_leave_nothing_alive(moto_server: str, aws_env: None) -> None:
    # Each failed awscrt request (a 404, a refused condition, a refused size) used to keep
    # its frames, and through them its backend and boto3 client, alive for good: a cycle
    # through awscrt's C side the garbage collector cannot see (see CrtTransport._wait).
    # A manifest polling for its next log entry gets a 404 every round.
    from awscrt import s3

    def live_requests() -> int:
        return sum(1 for o in gc.get_objects() if type(o) is s3.S3Request)

    bucket = unique_bucket()
    ensure_bucket(make_client(s3_config(moto_server, bucket)), bucket)
    gc.collect()
    before = live_requests()
    cfg = s3_config(moto_server, bucket, conditional_put="on", s3_client="crt")
    backend = S3Backend.from_config(cfg, client=make_client(cfg))
    assert backend.put("k", b"value") is True
    assert backend.put("empty", b"") is True
    for _ in range(3):  # a range GET of an empty object is answered 416: read as b""
        assert backend.get("empty") == b""
    for i in range(20):
        assert backend.get(f"missing/{i}") is None
    for _ in range(5):
        assert backend.put("k", b"other", if_absent=True) is False
        with pytest.raises(ObjectTooLargeError):
            backend.get("k", max_bytes=1)
    assert backend.get("k") == b"value"
    gone = weakref.ref(backend)
    del backend
    gc.collect()
    assert gone() is None, "a failed request keeps its backend alive"
    assert live_requests() == before


def test_an_encoded_view_is_put_as_is_and_reads_back(
    moto_server: str, aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The save path PUTs codec.encode_view's memoryview: awscrt reads it through
    # _BufferBody.readinto (numpy copies, without the GIL), not a BytesIO copy of it.
    import numpy as np

    from s3kv import codec
    from s3kv.storage import crt

    bucket = unique_bucket()
    ensure_bucket(make_client(s3_config(moto_server, bucket)), bucket)
    cfg = s3_config(moto_server, bucket, s3_client="crt")
    backend = S3Backend.from_config(cfg, client=make_client(cfg))
    words = (np.random.default_rng(3).normal(0, 1, 200_000).astype(np.float32).view(np.uint32)
             >> 16).astype(np.uint16)  # fmt: skip
    view = codec.encode_view(words, key="blk", dtype="bfloat16", shape=words.shape)
    assert isinstance(view.obj, np.ndarray)  # NOTE: the plane codec's own buffer

    bodies: list[Any] = []

    class Spy(crt._BufferBody):
        def __init__(self, data: memoryview) -> None:
            super().__init__(data)
            bodies.append(self)

    monkeypatch.setattr(crt, "_BufferBody", Spy)
    assert backend.put("blk", view) is True
    (body,) = bodies  # NOTE: read in place, not a copy
    assert np.shares_memory(body._data, np.frombuffer(view, np.uint8))
    assert backend.get("blk") == view
    assert backend.put("small", memoryview(b"abc")) is True
    assert backend.get("small") == b"abc"
    assert backend.put("empty", memoryview(b"")) is True
    assert backend.get("empty") == b""
    changing = bytearray(b"before")  # NOTE: a writable buffer is copied (awscrt may read late)
    assert backend.put("writable", changing) is True
    assert not np.shares_memory(bodies[-1]._data, np.frombuffer(changing, np.uint8))
    assert backend.get("writable") == b"before"


def test_the_put_body_reads_in_pieces_and_rewinds() -> None:
    from awscrt.io import InputStream  # type: ignore[import-untyped]

    from s3kv.storage.crt import _BufferBody

    # NOTE: as awscrt reads it: InputStream calls readinto with a writable byte view
    stream = InputStream(_BufferBody(memoryview(b"0123456789")))
    first, rest = memoryview(bytearray(4)), memoryview(bytearray(16))
    assert stream._read_into_memoryview(first) == 4
    assert stream._read_into_memoryview(rest) == 6
    assert (bytes(first), bytes(rest[:6])) == (b"0123", b"456789")
    assert stream._read_into_memoryview(rest) == 0  # NOTE: the end
    assert InputStream(_BufferBody(memoryview(b"")))._read_into_memoryview(first) == 0

    data = bytes(range(256)) * 40
    body = _BufferBody(memoryview(data))
    pieces = []
    while True:
        buffer = bytearray(3000)
        n = body.readinto(memoryview(buffer))
        if not n:
            break
        pieces.append(bytes(buffer[:n]))
    assert b"".join(pieces) == data
    assert [len(p) for p in pieces] == [3000, 3000, 3000, 1240]
    assert body.tell() == len(data)
    assert body.seek(-40, os.SEEK_END) == len(data) - 40
    assert body.read() == data[-40:]
    assert body.seek(0) == 0
    assert body.read(5) == data[:5]
    assert body.seek(5, os.SEEK_CUR) == 10
    with pytest.raises(ValueError, match="before the start"):
        body.seek(-11, os.SEEK_CUR)
    with pytest.raises(ValueError, match="whence 7"):
        body.seek(0, 7)
    words = memoryview(bytearray(8)).cast("H")  # NOTE: a typed buffer is filled by bytes
    assert body.seek(0) == 0
    assert body.readinto(words) == 8
    assert words.cast("B").tobytes() == data[:8]


def test_refusing_an_oversized_object_reads_at_most_max_bytes_plus_one(
    fake_s3: FakeS3, aws_env: None
) -> None:
    backend = open_s3(fake_s3.endpoint, s3_client="crt")
    backend.put("big", os.urandom(3 * 1024 * 1024))
    with pytest.raises(StorageError, match="more than the 1000"):
        backend.get("big", max_bytes=1000)
    (get,) = [r for r in fake_s3.requests if r.method == "GET"]
    assert get.headers["range"] == "bytes=0-1000"


def test_breaker_and_metrics_see_awscrt_failures(aws_env: None) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    backend = open_s3(endpoint, s3_client="crt", connect_timeout=0.5, max_attempts=1)
    assert backend.transport == "awscrt"
    metrics = Metrics()
    wrapped = InstrumentedBackend(backend, metrics, breaker=CircuitBreaker(2, 60.0))
    for call in (lambda: wrapped.get("k"), lambda: wrapped.put("k", b"v")):
        with pytest.raises(EndpointError):
            call()
    with pytest.raises(CircuitOpenError):
        wrapped.get("k")  # refused without touching the network
    assert metrics.value("request_errors", op="get", kind="endpoint") == 1
    assert metrics.value("request_errors", op="put", kind="endpoint") == 1
    assert not wrapped.healthy


# ----------------------------------------------------------------------------------------
# translate_error on awscrt's errors
# ----------------------------------------------------------------------------------------


def crt_response(status: int, code: str = "", headers: list[tuple[str, str]] = []) -> Any:  # noqa: B006
    from awscrt.s3 import S3ResponseError

    body = f"<Error><Code>{code}</Code><Message>said {code}</Message></Error>" if code else ""
    return S3ResponseError(code=14343, name="AWS_ERROR_S3_INVALID_RESPONSE_STATUS",
                           message="Invalid response status from request", status_code=status,
                           headers=headers, body=body.encode() or None)  # fmt: skip


def crt_failure(name: str) -> Any:
    from awscrt.exceptions import AwsCrtError

    return AwsCrtError(1, name, f"{name}: described")


@pytest.mark.parametrize(
    ("exc", "kind", "needle"),
    [
        (lambda: crt_response(403, "SignatureDoesNotMatch"), AccessDeniedError, "IAM"),
        (lambda: crt_response(404, "NoSuchBucket"), BucketNotFoundError, "TLLM_S3KV_BUCKET"),
        (lambda: crt_response(503, "SlowDown"), ThrottledError, "TLLM_S3KV_IO_THREADS"),
        (lambda: crt_response(412, "PreconditionFailed"), PreconditionFailedError, "exists"),
        (lambda: crt_response(301, "PermanentRedirect", [("x-amz-bucket-region", "eu-west-1")]),
         EndpointError, "TLLM_S3KV_REGION=eu-west-1"),
        (lambda: crt_response(500, "InternalError"), StorageError, "server error"),
        (lambda: crt_response(404), StorageError, "not found"),  # no body: code "404"
        (lambda: crt_failure("AWS_ERROR_S3_SLOW_DOWN"), ThrottledError, "SlowDown, HTTP 503"),
        (lambda: crt_failure("AWS_ERROR_S3_INTERNAL_ERROR"), StorageError, "HTTP 500"),
        (lambda: crt_failure("AWS_IO_SOCKET_CONNECTION_REFUSED"), EndpointError,
         "TLLM_S3KV_ENDPOINT_URL"),
        (lambda: crt_failure("AWS_IO_DNS_INVALID_NAME"), EndpointError, "TLLM_S3KV_ENDPOINT_URL"),
        (lambda: crt_failure("AWS_IO_TLS_ERROR_NEGOTIATION_FAILURE"), EndpointError,
         "TLLM_S3KV_CA_BUNDLE"),
        (lambda: crt_failure("AWS_ERROR_HTTP_RESPONSE_FIRST_BYTE_TIMEOUT"), EndpointError,
         "TLLM_S3KV_READ_TIMEOUT"),
        (lambda: crt_failure("AWS_AUTH_CREDENTIALS_PROVIDER_DELEGATE_FAILURE"),
         AccessDeniedError, "AWS_ACCESS_KEY_ID"),
        (lambda: crt_failure("AWS_ERROR_S3_EXCEEDS_MEMORY_LIMIT"), StorageError,
         "AWS_ERROR_S3_EXCEEDS_MEMORY_LIMIT"),
    ],
)  # fmt: skip
def test_translate_awscrt_errors(exc: Any, kind: type[StorageError], needle: str) -> None:
    error = translate_error(exc(), op="get", key="k/1", bucket="bkt", endpoint="http://e:1")
    assert type(error) is kind
    assert_one_line(str(error), needle, "s3://bkt" if kind is not BucketNotFoundError else "bkt")
