"""The Backend contract, run against every backend (memory, file, moto, SeaweedFS).

The tests themselves ship as :class:`s3kv.testing.storage.BackendTests`, for anyone writing
a backend; the ``backend`` fixture (tests/conftest.py) supplies each of s3kv's in turn, and
:class:`TestCrtBackendContract` runs it all again on moto and SeaweedFS with object GET/PUT
through awscrt (``s3_client="crt"``).
``get(max_bytes=...)`` and ``ObjectInfo.etag`` are checked here, through every backend and
through the wrappers (:class:`~s3kv.storage.InstrumentedBackend`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from conftest import s3_config, unique_bucket

from s3kv.errors import ObjectTooLargeError
from s3kv.metrics import Metrics
from s3kv.storage import Backend, CircuitBreaker, InstrumentedBackend
from s3kv.testing.storage import BackendTests, Quirk

#: What SeaweedFS 4.48 does differently from S3 (see :class:`Quirk`).
SEAWEEDFS_QUIRKS = frozenset({Quirk.LIST_ORDER_BY_DIRECTORY, Quirk.EMPTIED_DIRECTORIES_REMAIN})

KEY = "kv/fp0/blocks/0a/0a000001"


class TestBackendContract(BackendTests):
    @pytest.fixture
    def backend_quirks(self, request: pytest.FixtureRequest) -> frozenset[Quirk]:
        seaweedfs = request.node.callspec.params["backend"] == "seaweedfs"
        return SEAWEEDFS_QUIRKS if seaweedfs else frozenset()

    # --- get(max_bytes=...) --------------------------------------------------------------

    @pytest.mark.parametrize("size", [0, 1, 1000])
    def test_get_within_max_bytes_reads_the_object(self, backend: Backend, size: int) -> None:
        payload = os.urandom(size)
        backend.put(KEY, payload)
        assert backend.get(KEY, max_bytes=size) == payload  # exactly at the bound
        assert backend.get(KEY, max_bytes=size + 10**9) == payload
        assert backend.get(KEY, max_bytes=None) == payload

    def test_get_over_max_bytes_is_refused(self, backend: Backend) -> None:
        payload = os.urandom(1001)
        backend.put(KEY, payload)
        with pytest.raises(ObjectTooLargeError, match=r"1001 bytes, more than the 1000"):
            backend.get(KEY, max_bytes=1000)
        with pytest.raises(ObjectTooLargeError):
            backend.get(KEY, max_bytes=0)
        assert backend.get(KEY) == payload  # refused, not damaged

    def test_refusing_a_large_object_leaves_the_backend_usable(self, backend: Backend) -> None:
        # S3: the refused body is closed unread; the next requests need a working connection.
        big = os.urandom(8 * 1024 * 1024)
        backend.put(KEY, big)
        backend.put("kv/fp0/small", b"small")
        for _ in range(3):
            with pytest.raises(ObjectTooLargeError):
                backend.get(KEY, max_bytes=128 * 1024)
            assert backend.get("kv/fp0/small", max_bytes=5) == b"small"
        assert backend.get(KEY, max_bytes=len(big)) == big

    def test_get_missing_with_max_bytes_is_none(self, backend: Backend) -> None:
        assert backend.get("kv/fp0/blocks/00/missing", max_bytes=0) is None

    def test_instrumented_counts_a_refusal_and_keeps_the_breaker_closed(
        self, backend: Backend
    ) -> None:
        backend.put(KEY, b"x" * 100)
        metrics = Metrics()
        breaker = CircuitBreaker(1, 60.0)  # one real failure would open it
        wrapped = InstrumentedBackend(backend, metrics, breaker=breaker)
        with pytest.raises(ObjectTooLargeError):
            wrapped.get(KEY, max_bytes=99)
        assert metrics.value("request_errors", op="get", kind="too_large") == 1
        assert wrapped.healthy
        assert wrapped.get(KEY, max_bytes=100) == b"x" * 100
        assert metrics.value("bytes_received") == 100

    # --- etag ----------------------------------------------------------------------------

    def test_etag_names_the_version(self, backend: Backend) -> None:
        backend.put(KEY, b"first")
        first, again = backend.head(KEY), backend.head(KEY)
        assert first is not None
        assert again is not None
        assert first.etag
        assert first.etag == again.etag
        backend.put(KEY, b"second")
        changed = backend.head(KEY)
        assert changed is not None
        assert changed.etag != first.etag
        (listed,) = backend.list("kv/fp0/blocks/")
        assert listed.etag == changed.etag


@pytest.fixture(params=["moto-crt", pytest.param("seaweedfs-crt", marks=pytest.mark.seaweedfs)])
def crt_backend(request: pytest.FixtureRequest, aws_env: None) -> Iterator[Backend]:
    """An S3Backend on a fresh moto or SeaweedFS bucket, object GET/PUT through awscrt."""
    from s3kv.storage import S3Backend, ensure_bucket, make_client

    if request.param == "seaweedfs-crt":
        server = request.getfixturevalue("seaweedfs")
        endpoint, keys = server.endpoint, (server.access_key, server.secret_key)
    else:
        endpoint, keys = request.getfixturevalue("moto_server"), (None, None)
    cfg = s3_config(endpoint, unique_bucket(), s3_client="crt")
    client = make_client(cfg, access_key=keys[0], secret_key=keys[1])
    ensure_bucket(client, cfg.bucket)
    backend = S3Backend.from_config(cfg, client=client)
    assert backend.transport == "awscrt"
    try:
        yield backend
    finally:
        # moto keeps a bucket's objects for the session; SeaweedFS drops them with it.
        backend.delete_many([info.key for info in backend.list("")])
        client.delete_bucket(Bucket=cfg.bucket)
        backend.close()


class TestCrtBackendContract(TestBackendContract):
    """The same contract with object GET/PUT through awscrt (list, head, delete: boto3)."""

    @pytest.fixture
    def backend(self, crt_backend: Backend) -> Backend:
        return crt_backend

    @pytest.fixture
    def backend_quirks(self, request: pytest.FixtureRequest) -> frozenset[Quirk]:
        seaweedfs = request.node.callspec.params["crt_backend"] == "seaweedfs-crt"
        return SEAWEEDFS_QUIRKS if seaweedfs else frozenset()


# --- the S3 backend's bound without a Content-Length ------------------------------------


class _ChunkedBody:
    """A response body with no declared length (a proxy's chunked reply), counting reads."""

    def __init__(self, data: bytes) -> None:
        self.data, self.read_bytes, self.closed = data, 0, False

    def read(self, amt: int | None = None) -> bytes:
        amt = len(self.data) - self.read_bytes if amt is None else min(amt, 64 * 1024)
        chunk = self.data[self.read_bytes : self.read_bytes + amt]
        self.read_bytes += len(chunk)
        return chunk

    def close(self) -> None:
        self.closed = True


class _ChunkedClient:
    class meta:  # noqa: N801 - boto3's attribute name
        endpoint_url = "http://proxy.invalid"

    def __init__(self, data: bytes) -> None:
        self.body = _ChunkedBody(data)

    def get_object(self, **_: object) -> dict[str, object]:
        return {"Body": self.body}


@pytest.mark.parametrize("size", [0, 300 * 1024])
def test_s3_get_without_content_length_reads_at_most_max_bytes_plus_one(size: int) -> None:
    from s3kv.storage import S3Backend

    data = os.urandom(size)
    client = _ChunkedClient(data)
    backend = S3Backend(client, bucket="b", conditional_put=False)  # type: ignore[arg-type]
    assert backend.get("k", max_bytes=size) == data
    client = _ChunkedClient(data + b"x" * (10 * 1024 * 1024))
    backend = S3Backend(client, bucket="b", conditional_put=False)  # type: ignore[arg-type]
    with pytest.raises(ObjectTooLargeError):
        backend.get("k", max_bytes=size)
    assert client.body.read_bytes == size + 1
    assert client.body.closed
