"""Object GET/PUT through awscrt's S3 client: the hot path of :class:`~s3kv.storage.S3Backend`.

The only module in s3kv that imports awscrt (the ``crt`` extra); :mod:`s3kv.storage.s3` loads
it when ``s3_client`` is ``auto`` or ``crt``. NOTE: why: boto3 spends its CPU per request in
Python (parameter validation, serialization, event hooks, SigV4 in pure Python), which caps a
process far below a 100 Gbit/s NIC's worth of blocks; awscrt does all of it in C. Measured on
loopback SeaweedFS (``benchmarks/bench_client_cpu.py``): 1.2/1.4 CPU-ms per 4 KiB PUT/GET with
boto3, 0.36/0.31 with awscrt. Listing, HEAD, deletes, the bucket check and the
conditional-PUT probe stay on boto3: they are few, and botocore parses their XML.

The requests have the shape :func:`~s3kv.storage.make_client` gives boto3's:

* SigV4 with an unsigned payload and no CRC checksums (every s3kv object carries its own
  checksum, verified on every read), signed for the boto3 client's region.
* The boto3 client's endpoint and addressing style (path style for a custom endpoint), and
  its credentials: static ones are copied once; refreshable ones (STS, SSO, instance and
  container roles) are read through a delegate before every request, so botocore refreshes
  them as it would for its own requests (as ``boto3.crt`` does).
* One PUT per object, however large (the multipart threshold is S3's single-PUT limit), so
  ``If-None-Match: *`` means what it means for PutObject. No ``Expect: 100-continue``.
* A GET reads the object in ranged parts of :data:`PART_SIZE` (in parallel for a large
  object). awscrt reports the headers once a first part has arrived, so ``max_bytes`` is
  enforced on that first part's Content-Range total, and the first part is cut to
  ``max_bytes + 1`` bytes: refusing an oversized object reads at most that many of its
  bytes (and at most :data:`PART_SIZE`), never the whole object. An empty object answers the
  first range with 416, which is read as ``b""``.
* Retries: awscrt's standard mode (exponential backoff with a retry quota), ``max_attempts``
  attempts in all; throttling, 5xx and connection failures are retried there.
* Timeouts: ``connect_timeout`` per connection. awscrt has no read timeout, and it reports
  progress only per whole part (a GET part received, a PUT body sent), so a request is
  cancelled and reported as :class:`~s3kv.errors.EndpointError` when no progress comes for
  ``connect_timeout + read_timeout`` plus one second per MiB of the part (or PUT) awaited: a
  connection slower than 1 MiB/s counts as stalled.
* TLS: the CA bundle in ``ca_bundle`` (s3kv.storage.s3 passes the one boto3 verifies with),
  else the system's trust store. NOTE: s2n, awscrt's TLS, reports a refused certificate only
  after its 10-30 s "blinding" delay (it cannot be turned off from Python).

Errors: awscrt's exceptions (``awscrt.exceptions.AwsCrtError`` and its ``S3ResponseError``)
leave this module unchanged and are translated by :func:`~s3kv.storage.translate_error`, the
one place that happens; the two errors s3kv itself detects here (an object over
``max_bytes``, a stalled request) are raised as s3kv errors.
"""

from __future__ import annotations

import io
import re
import urllib.parse
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import numpy as np
from awscrt import auth, http, s3  # type: ignore[import-untyped]
from awscrt import io as crt_io
from awscrt.exceptions import AwsCrtError  # type: ignore[import-untyped]

from s3kv.errors import EndpointError
from s3kv.storage.base import refuse_oversized

__all__ = ["CRT_ERRORS", "PART_SIZE", "CrtSettings", "CrtTransport", "FrozenCredentials"]

#: What a :class:`CrtTransport` call raises besides s3kv's own errors (for ``except``).
CRT_ERRORS: tuple[type[BaseException], ...] = (AwsCrtError,)

#: Ranged-GET part size: objects up to this size take one request.
PART_SIZE = 8 * 1024 * 1024

#: The slowest transfer that is not a stall (see the module docstring).
_SLOWEST_BYTES_PER_S = 1024 * 1024

#: S3's largest single PUT (5 GiB): every PUT is one PutObject, never a multipart upload.
_SINGLE_PUT_LIMIT = 5 * 1024**3

#: (access key id, secret access key, session token or None).
FrozenCredentials = tuple[str, str, str | None]

#: Bucket names that can be a DNS label under the endpoint's host (virtual-hosted style).
_DNS_BUCKET = re.compile(r"^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class CrtSettings:
    """Where and how the transport connects; :mod:`s3kv.storage.s3` fills it from the boto3
    client and the config so that both clients reach the same bucket the same way.

    Attributes:
        endpoint_url: ``http(s)://host[:port][/path]``, as the boto3 client resolved it.
        region: The signing region.
        bucket: Bucket name.
        addressing_style: ``path``, ``virtual`` or ``auto`` (virtual where the bucket name
            is a DNS label, as botocore decides).
        ca_bundle: CA bundle file for TLS; ``None``: the system's trust store.
        connect_timeout: Seconds to establish a connection.
        read_timeout: Seconds a request may show no progress (see the module docstring).
        max_attempts: Attempts per request in all, >= 1.
    """

    endpoint_url: str
    region: str
    bucket: str
    addressing_style: str = "path"
    ca_bundle: str | None = None
    connect_timeout: float = 5.0
    read_timeout: float = 30.0
    max_attempts: int = 3


class _Progress:
    """What a request's callbacks saw; the waiting thread reads ``events`` for progress."""

    def __init__(self, where: str, max_bytes: int | None) -> None:
        self.where = where
        self.max_bytes = max_bytes
        self.events = 0
        self.chunks: list[tuple[int, bytes]] = []

    def on_headers(self, status_code: int, headers: list[tuple[str, str]], **_: Any) -> None:
        self.events += 1
        if self.max_bytes is None or status_code >= 300:  # NOTE: only set with max_bytes
            return
        for name, value in headers:
            if name.lower() == "content-length":
                # NOTE: awscrt reports the whole object's length here, not the part's.
                # Raising makes awscrt cancel the request and hand this error back.
                refuse_oversized(self.where, int(value), self.max_bytes)
                return

    def on_body(self, chunk: memoryview, offset: int, **_: Any) -> None:
        self.events += 1
        self.chunks.append((offset, bytes(chunk)))

    def on_progress(self, progress: int, **_: Any) -> None:
        self.events += 1

    def body(self) -> bytes:
        if len(self.chunks) == 1:
            return self.chunks[0][1]
        return b"".join(chunk for _, chunk in sorted(self.chunks, key=lambda c: c[0]))


class CrtTransport:
    """GET and PUT of whole objects in one bucket through one awscrt ``S3Client``.

    Thread-safe: each call blocks its own thread until awscrt's event loop (the process's
    shared one) finishes the request, as the store's I/O pool expects. The constructor does
    no I/O.

    Args:
        settings: Endpoint, region, bucket, addressing, TLS, timeouts and retries.
        credentials: Returns the credentials to sign with; it must not raise.
        refreshing: Call ``credentials`` before every request (they may change); else once.

    Attributes:
        settings: As given.
        host: The Host header of every request (``bucket.host`` in virtual-hosted style).
        errors: The foreign exceptions its calls raise (:data:`CRT_ERRORS`).
    """

    errors = CRT_ERRORS

    def __init__(
        self,
        settings: CrtSettings,
        credentials: Callable[[], FrozenCredentials],
        *,
        refreshing: bool,
    ) -> None:
        self.settings = settings
        url = urllib.parse.urlsplit(settings.endpoint_url)
        self._tls = url.scheme == "https"
        self.host, self._base = _target(url.netloc, url.path, settings)
        self._stall_s = settings.connect_timeout + settings.read_timeout
        if refreshing:
            provider = auth.AwsCredentialsProvider.new_delegate(_Delegate(credentials))
        else:
            provider = auth.AwsCredentialsProvider.new_static(*credentials())
        signing = s3.create_default_s3_signing_config(
            region=settings.region, credential_provider=provider
        )
        if settings.max_attempts > 1:
            retries = s3.S3RetryConfig(max_retries=settings.max_attempts - 1)
        else:  # NOTE: max_retries=0 would mean awscrt's default (5), not "none".
            retries = s3.S3RetryConfig(retry_mode=s3.S3RetryMode.NONE)
        self._client = s3.S3Client(
            region=settings.region,
            tls_mode=s3.S3RequestTlsMode.ENABLED if self._tls else s3.S3RequestTlsMode.DISABLED,
            tls_connection_options=_tls_options(settings.ca_bundle) if self._tls else None,
            signing_config=signing,
            part_size=PART_SIZE,
            multipart_upload_threshold=_SINGLE_PUT_LIMIT,
            throughput_target_gbps=100.0,
            retry_config=retries,
            connect_timeout_ms=max(1, round(settings.connect_timeout * 1000)),
        )

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """The object's bytes (see :meth:`s3kv.storage.Backend.get`; "not found" raises).

        Raises:
            ObjectTooLargeError: the object is longer than ``max_bytes`` (not read).
            EndpointError: no progress for ``connect_timeout + read_timeout``.
            AwsCrtError: any other failure, "not found" included (an ``S3ResponseError``).
        """
        where = f"get s3://{self.settings.bucket}/{key}"
        progress = _Progress(where, max_bytes)
        headers = http.HttpHeaders([("Host", self.host)])
        part = PART_SIZE if max_bytes is None else min(max_bytes + 1, PART_SIZE)
        request = self._client.make_request(
            type=s3.S3RequestType.GET_OBJECT,
            request=http.HttpRequest("GET", self._path(key), headers),
            part_size=part,
            on_headers=None if max_bytes is None else progress.on_headers,
            on_body=progress.on_body,
        )
        error = self._wait(request, progress, part)
        del request  # NOTE: before raising: see _wait
        if error is None:
            return progress.body()
        # NOTE: only an empty object refuses a range from byte 0 (416). awscrt then asks
        # again with partNumber=1, which SeaweedFS 4.48 refuses with 416 too.
        if isinstance(error, s3.S3ResponseError) and error.status_code == 416:
            return b""
        raise error

    def put(self, key: str, data: bytes | memoryview, *, if_none_match: bool = False) -> None:
        """Store ``data`` under ``key`` in one PutObject, with ``If-None-Match: *`` if asked.

        Raises:
            EndpointError: no progress for ``connect_timeout + read_timeout``.
            AwsCrtError: the PUT failed (a refused condition is an ``S3ResponseError`` 412).
        """
        view = memoryview(data)
        if not view.readonly:
            # NOTE: awscrt reads the body from its own threads, possibly after a timeout
            # here has returned: a buffer the caller may change or resize is copied first.
            view = memoryview(bytes(view))
        fields = [("Host", self.host), ("Content-Length", str(view.nbytes))]
        if if_none_match:
            fields.append(("If-None-Match", "*"))
        body = _BufferBody(view)
        progress = _Progress(f"put s3://{self.settings.bucket}/{key}", None)
        request = self._client.make_request(
            type=s3.S3RequestType.PUT_OBJECT,
            request=http.HttpRequest("PUT", self._path(key), http.HttpHeaders(fields), body),
            on_progress=progress.on_progress,
        )
        error = self._wait(request, progress, view.nbytes)
        del request  # NOTE: before raising: see _wait
        if error is not None:
            raise error

    def close(self) -> None:
        """Let the client shut down (awscrt frees it once no request refers to it)."""
        self._client = None

    def _path(self, key: str) -> str:
        # NOTE: botocore's quoting of keys; SigV4 signs this path as is (S3's signing
        # config: no double encoding, no normalization).
        return self._base + urllib.parse.quote(key, safe="/~")

    def _wait(self, request: Any, progress: _Progress, awaited_bytes: int) -> BaseException | None:
        """Block until ``request`` finishes; what it failed with, or ``None``.

        The caller raises that error only after dropping its own reference to ``request``.
        NOTE: why: awscrt keeps the request's callback core (and through it the finished
        future and its exception) alive from C until the request's native shutdown, which
        follows the release of the Python request (microseconds later, on its own thread). An
        exception raised with a traceback through a frame that still holds the request
        closes a cycle through C that the garbage collector cannot see: every failed
        request (each 404 a manifest poll gets) kept its frames, its backend and its boto3
        client alive for the life of the process.

        Raises:
            EndpointError: no progress for the allowance: the request is cancelled.
        """
        done: futures.Future[None] = request.finished_future
        allowance = self._stall_s + awaited_bytes / _SLOWEST_BYTES_PER_S
        seen = 0
        while True:
            try:
                error = done.exception(timeout=allowance)
            except futures.TimeoutError:
                if progress.events != seen:
                    seen = progress.events
                    continue
                request.cancel()
                futures.wait((done,), timeout=self._stall_s)
                raise EndpointError(
                    f"timed out waiting for the response to {progress.where} at "
                    f"{self.settings.endpoint_url} (no progress in {allowance:.3g} s): the "
                    "server is overloaded or slow; check it or raise TLLM_S3KV_READ_TIMEOUT"
                ) from None
            return error


class _Delegate:
    """awscrt's credentials callback: boto3's current credentials, as awscrt's type.

    NOTE: awscrt calls it before every request; an AwsCredentials is built only when the
    credentials changed (refreshed), so the steady-state cost is one tuple comparison.
    """

    def __init__(self, credentials: Callable[[], FrozenCredentials]) -> None:
        self._credentials = credentials
        self._last: tuple[FrozenCredentials, Any] | None = None

    def __call__(self) -> Any:
        current = self._credentials()
        last = self._last
        if last is None or last[0] != current:
            last = (current, auth.AwsCredentials(*current))
            self._last = last
        return last[1]


class _BufferBody(io.RawIOBase):
    """A PUT body that awscrt reads straight out of the caller's buffer.

    awscrt reads a body through ``readinto`` from its own threads, taking the GIL for each
    call. A BytesIO copies into awscrt's buffer holding the GIL (and, built on a
    memoryview, copies the whole object once more first); here numpy copies, and lets go
    of the GIL for the copy. Seekable, as awscrt may rewind a body to send it again.
    """

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._data = np.frombuffer(data.cast("B"), np.uint8)
        self._at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        n = max(0, min(target.nbytes, self._data.size - self._at))
        if n:
            np.copyto(np.frombuffer(target, np.uint8, count=n), self._data[self._at : self._at + n])
            self._at += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        bases = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._data.size}
        if whence not in bases:
            raise ValueError(f"seek: whence {whence} is not SEEK_SET, SEEK_CUR or SEEK_END")
        base = bases[whence]
        if base + offset < 0:
            raise ValueError(f"seek to {base + offset}: before the start of the body")
        self._at = base + offset
        return self._at

    def tell(self) -> int:
        return self._at


def _target(netloc: str, path: str, settings: CrtSettings) -> tuple[str, str]:
    """The Host header and the path prefix of the bucket's keys."""
    base = path.rstrip("/")
    virtual = settings.addressing_style == "virtual" or (
        settings.addressing_style == "auto" and _DNS_BUCKET.match(settings.bucket) is not None
    )
    if virtual:
        return f"{settings.bucket}.{netloc}", base + "/"
    return netloc, f"{base}/{urllib.parse.quote(settings.bucket)}/"


def _tls_options(ca_bundle: str | None) -> Any:
    options = crt_io.TlsContextOptions()
    if ca_bundle:
        options.override_default_trust_store_from_path(ca_filepath=ca_bundle)
    return crt_io.ClientTlsContext(options).new_connection_options()
