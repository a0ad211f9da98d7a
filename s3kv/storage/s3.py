"""The S3 backend: the only module in s3kv that imports boto3/botocore (KMS aside).

:class:`S3Backend` implements :class:`~s3kv.storage.Backend` over one boto3 client, for AWS S3
and S3-compatible servers (MinIO, SeaweedFS, Ceph RGW); with ``s3_client`` ``auto`` or ``crt``
its object GETs and PUTs go through awscrt instead (:mod:`s3kv.storage.crt`: a fraction of
boto3's CPU per request), with the same endpoint, credentials, retries and errors.
:func:`translate_error` is the one place where foreign exceptions (botocore, urllib3, OS
errors, awscrt's) become the :class:`~s3kv.errors.StorageError` tree; every boto3 and awscrt
call in this module goes through it. awscrt's errors are read by their attributes, so this
module never imports awscrt.
:func:`whoami` reports where boto3's credential chain finds credentials (for ``s3kv doctor``).
Callers reach all of this through :mod:`s3kv.storage`, which imports this module lazily.

Client settings, and why:

* ``request_checksum_calculation``/``response_checksum_validation`` are ``when_required`` and
  payload signing is off. NOTE: every s3kv object carries its own xxh3 checksum over the raw
  bytes in its header, verified on every read; botocore's CRC32 on PUT/GET plus SHA-256
  payload signing over plain http would hash every byte twice more and cost 2-4x the client
  CPU per GB (perf-anchors §3.2). Operations whose API *requires* a checksum (DeleteObjects)
  still get one.
* Retries: botocore's ``standard`` mode with ``max_attempts`` attempts in all (botocore's
  ``total_max_attempts``), so throttling (503 SlowDown) and transient 5xx/connection errors
  are retried there, with backoff, and an error reaching :func:`translate_error` is final.
* No ``Expect: 100-continue`` on PutObject (see :func:`make_client`): a round trip per PUT.
* ``addressing_style="auto"`` with a custom endpoint (``endpoint_url`` or the
  ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` variables) means path style: MinIO, SeaweedFS
  and Ceph serve ``http://host:port/bucket/key`` but rarely have wildcard DNS for
  ``bucket.host``. Against AWS, "auto" keeps botocore's choice (virtual hosted).

Conditional PUT (``conditional_put="auto"``) is probed once when the backend is opened: a
scratch key ``<prefix>/.s3kv-probe/<uuid>`` is PUT twice with ``If-None-Match: *``; the
capability is on only if the second PUT is refused with 412 (or 409, a concurrent
conditional write). A server that ignores the header (second PUT succeeds) or rejects it
(501 NotImplemented, 400) gets the capability off; the scratch key is deleted either way.
Measured: moto 5.2.5 and SeaweedFS 4.48 both answer the second PUT with 412
PreconditionFailed, so the probe turns the capability on for both.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from html import unescape
from itertools import islice
from typing import TYPE_CHECKING, Any

import boto3
import botocore.credentials
import botocore.exceptions as bce
import botocore.handlers
import botocore.httpsession
import botocore.loaders
import botocore.session
import urllib3.exceptions
from botocore.config import Config

from s3kv._logsetup import install_redaction
from s3kv.config import S3KVConfig
from s3kv.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    ConfigError,
    EndpointError,
    PreconditionFailedError,
    StorageError,
    ThrottledError,
)
from s3kv.storage.base import (
    DELETE_BATCH,
    Backend,
    Capabilities,
    Credentials,
    DeleteResult,
    ObjectInfo,
    refuse_oversized,
)

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

    from s3kv.storage.crt import CrtTransport

logger = logging.getLogger(__name__)

#: Exceptions a boto3 call can raise that :func:`translate_error` turns into StorageError.
FOREIGN_ERRORS: tuple[type[BaseException], ...] = (
    bce.BotoCoreError,
    bce.ClientError,
    urllib3.exceptions.HTTPError,
    OSError,
)

_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_NO_BUCKET_CODES = frozenset({"NoSuchBucket"})
_DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
        "AccountProblem",
        "InvalidSecurity",
        "403",
        "Forbidden",
    }
)
_THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "RequestThrottledException",
        "ProvisionedThroughputExceededException",
        "BandwidthLimitExceeded",
        "ServiceUnavailable",
        "503",
    }
)
_PRECONDITION_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "412"})
_UNSUPPORTED_CODES = frozenset({"NotImplemented", "501", "InvalidArgument", "InvalidRequest"})

#: Environment variables whose values must never appear in an error message.
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")

_PROBE_DIR = ".s3kv-probe"


def translate_error(
    exc: BaseException,
    *,
    op: str,
    key: str | None,
    bucket: str | None = None,
    endpoint: str | None = None,
) -> StorageError:
    """Turn a foreign exception into the s3kv :class:`~s3kv.errors.StorageError` tree.

    The one place foreign errors are translated. The caller raises the result ``from exc``.
    The message is one line naming the operation, bucket, key and endpoint and a remedy; it
    never contains credentials (known secret values are scrubbed from server text too).

    Args:
        exc: What boto3/botocore/urllib3/the OS raised.
        op: The backend operation (``"get"``, ``"put"``, ``"check"``...).
        key: Object key, or ``None`` for bucket-level operations (list, delete_many, check),
            where a bare 404 means the bucket is missing.
        bucket: Bucket name, for the message.
        endpoint: Endpoint URL, for the message.

    Returns:
        The matching subclass: ``BucketNotFoundError``, ``AccessDeniedError``,
        ``EndpointError``, ``ThrottledError``, ``PreconditionFailedError``, or
        ``StorageError`` for anything else. A ``StorageError`` is returned unchanged.
    """
    if isinstance(exc, StorageError):
        return exc
    where = _where(op, key, bucket, endpoint)
    response = exc.response if isinstance(exc, bce.ClientError) else _crt_response(exc)
    if response is not None:
        return _translate_client_error(
            response, op=op, key=key, bucket=bucket, where=where, endpoint=endpoint
        )
    return _translate_transport_error(exc, where=where)


def _where(op: str, key: str | None, bucket: str | None, endpoint: str | None) -> str:
    target = f"s3://{bucket or '?'}/{key}" if key is not None else f"s3://{bucket or '?'}"
    return f"{op} {target}" + (f" at {endpoint}" if endpoint else "")


def _translate_client_error(
    response: Mapping[str, Any],
    *,
    op: str,
    key: str | None,
    bucket: str | None,
    where: str,
    endpoint: str | None,
) -> StorageError:
    error: dict[str, Any] = dict(response.get("Error", {}))
    meta: dict[str, Any] = dict(response.get("ResponseMetadata", {}))
    code = str(error.get("Code", "") or "")
    status = int(meta.get("HTTPStatusCode", 0) or 0)
    retries = int(meta.get("RetryAttempts", 0) or 0)
    detail = f"{code or 'error'}, HTTP {status or '?'}"
    if retries:
        detail += f", after {retries} retries"
    server_text = _scrub(str(error.get("Message", "") or ""))
    said = f" ({server_text})" if server_text and server_text != code else ""

    if code in _NO_BUCKET_CODES or (status == 404 and key is None):
        return BucketNotFoundError(
            f"bucket {bucket!r} does not exist{_at(endpoint)} [{op}: {detail}]: "
            "create it or set TLLM_S3KV_BUCKET"
        )
    if code in _DENIED_CODES or status == 403:
        return AccessDeniedError(
            f"access denied on {where} [{detail}]{said}: check the credentials "
            "(AWS_ACCESS_KEY_ID/AWS_PROFILE or TLLM_S3KV_PROFILE) and the IAM/bucket policy"
        )
    if code in _THROTTLE_CODES or status in (429, 503):
        return ThrottledError(
            f"throttled on {where} [{detail}]{said}: the server asked to slow down; "
            "lower TLLM_S3KV_IO_THREADS or raise TLLM_S3KV_MAX_ATTEMPTS"
        )
    if code in _PRECONDITION_CODES or status in (409, 412):
        return PreconditionFailedError(
            f"precondition failed on {where} [{detail}]: the key already exists "
            "(or a concurrent conditional write won)"
        )
    if status == 301 or code == "PermanentRedirect":
        region = _header(meta, "x-amz-bucket-region") or "the bucket's region"
        return EndpointError(f"wrong region for {where} [{detail}]: set TLLM_S3KV_REGION={region}")
    if status >= 500:
        return StorageError(
            f"server error on {where} [{detail}]{said}: the S3 server failed; "
            "check its health and logs"
        )
    if code in _NOT_FOUND_CODES or status == 404:
        return StorageError(f"not found: {where} [{detail}]")
    return StorageError(f"{where} failed [{detail}]{said}: see the server's error code")


def _translate_transport_error(exc: BaseException, *, where: str) -> StorageError:
    text = _scrub(str(exc)) or type(exc).__name__
    kind = type(exc).__name__
    failure = _crt_failure(exc) if _is_crt(exc) else _failure(exc)
    if failure == "credentials":
        return AccessDeniedError(
            f"no usable AWS credentials for {where} ({text}): set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE/TLLM_S3KV_PROFILE, or an instance role"
        )
    if failure == "profile":
        return AccessDeniedError(
            f"{text} for {where}: fix TLLM_S3KV_PROFILE/AWS_PROFILE or ~/.aws/config"
        )
    if failure == "tls":
        return EndpointError(
            f"TLS error on {where} ({kind}: {text}): set TLLM_S3KV_CA_BUNDLE to the CA that "
            "signed the endpoint's certificate"
        )
    if failure == "read_timeout":
        return EndpointError(
            f"timed out reading the response to {where} ({kind}): the server is overloaded "
            "or slow; check it or raise TLLM_S3KV_READ_TIMEOUT"
        )
    if failure == "unreachable":
        return EndpointError(
            f"cannot reach the endpoint for {where} ({kind}: {text}): check "
            "TLLM_S3KV_ENDPOINT_URL/AWS_ENDPOINT_URL_S3 and that the server is running"
        )
    if failure == "invalid":
        return StorageError(f"invalid request for {where} ({text}): check the bucket name and key")
    if failure == "os":
        return StorageError(f"I/O error on {where} ({kind}: {text})")
    return StorageError(f"{where} failed ({kind}: {text})")


def _failure(exc: BaseException) -> str:
    """What kind of transport failure a botocore, urllib3 or OS exception is ("" if unknown)."""
    if isinstance(exc, bce.NoCredentialsError | bce.PartialCredentialsError):
        return "credentials"
    if isinstance(exc, bce.ProfileNotFound):
        return "profile"
    if isinstance(exc, bce.SSLError | urllib3.exceptions.SSLError):
        return "tls"
    if isinstance(exc, bce.ReadTimeoutError | urllib3.exceptions.ReadTimeoutError):
        return "read_timeout"
    if isinstance(
        exc,
        bce.EndpointConnectionError
        | bce.ConnectTimeoutError
        | bce.ConnectionClosedError
        | bce.HTTPClientError
        | bce.ResponseStreamingError
        | bce.IncompleteReadError
        | urllib3.exceptions.HTTPError
        | ConnectionError
        | TimeoutError,
    ):
        return "unreachable"
    if isinstance(exc, bce.ParamValidationError):
        return "invalid"
    return "os" if isinstance(exc, OSError) else ""


# --- awscrt's errors (s3kv.storage.crt), read by duck typing: only that module imports awscrt

#: awscrt errors that stand for a server's answer awscrt did not keep: (code, HTTP status).
_CRT_ANSWERS = {
    "AWS_ERROR_S3_SLOW_DOWN": ("SlowDown", 503),
    "AWS_ERROR_S3_INTERNAL_ERROR": ("InternalError", 500),
}


def _is_crt(exc: BaseException) -> bool:
    return type(exc).__module__.partition(".")[0] == "awscrt"


def _crt_response(exc: BaseException) -> dict[str, Any] | None:
    """botocore's error-response shape for an awscrt error that is a server's answer.

    awscrt's ``S3ResponseError`` carries the status, headers and XML body; a throttling or
    internal error that outlived the retries may carry only its name (``_CRT_ANSWERS``).
    """
    if not _is_crt(exc):
        return None
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and status > 0:
        body = bytes(getattr(exc, "body", None) or b"")
        pairs = getattr(exc, "headers", None) or []
        return {
            # NOTE: botocore's code for an answer without a body is the status, as text.
            "Error": {"Code": _xml_text(body, "Code") or str(status),
                      "Message": _xml_text(body, "Message")},
            "ResponseMetadata": {"HTTPStatusCode": status,
                                 "HTTPHeaders": {str(k).lower(): str(v) for k, v in pairs}},
        }  # fmt: skip
    answer = _CRT_ANSWERS.get(str(getattr(exc, "name", "")))
    if answer is None:
        return None
    return {"Error": {"Code": answer[0]}, "ResponseMetadata": {"HTTPStatusCode": answer[1]}}


def _xml_text(body: bytes, tag: str) -> str:
    match = re.search(rb"<%s>([^<]*)</%s>" % (tag.encode(), tag.encode()), body)
    return unescape(match[1].decode("utf-8", "replace")) if match else ""


def _crt_failure(exc: BaseException) -> str:
    """What kind of transport failure an awscrt error is, from its name (see _failure)."""
    name = str(getattr(exc, "name", ""))
    if name.startswith("AWS_AUTH_"):
        return "credentials"
    if "_TLS_" in name:
        return "tls"
    if name in ("AWS_ERROR_HTTP_RESPONSE_FIRST_BYTE_TIMEOUT", "AWS_ERROR_S3_REQUEST_TIMEOUT"):
        return "read_timeout"
    if name.startswith(("AWS_IO_SOCKET_", "AWS_IO_DNS_", "AWS_ERROR_HTTP_")):
        return "unreachable"
    return ""


def _at(endpoint: str | None) -> str:
    return f" at {endpoint}" if endpoint else ""


def _header(meta: dict[str, Any], name: str) -> str | None:
    headers = meta.get("HTTPHeaders") or {}
    value = headers.get(name) if isinstance(headers, dict) else None
    return str(value) if value else None


def _scrub(text: str) -> str:
    """One line, bounded, with any known secret value replaced."""
    for name in _SECRET_ENV:
        secret = os.environ.get(name)
        if secret and len(secret) >= 8:
            text = text.replace(secret, "***")
    line = " ".join(text.split())
    return line if len(line) <= 300 else line[:297] + "..."


def _error_code(exc: BaseException) -> tuple[str, int]:
    """The server's error code and HTTP status in a botocore or awscrt error; ("", 0) if none."""
    response = exc.response if isinstance(exc, bce.ClientError) else _crt_response(exc)
    if response is None:
        return "", 0
    code = str(response.get("Error", {}).get("Code", "") or "")
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def ensure_bucket(client: S3Client, bucket: str) -> bool:
    """Create ``bucket`` unless it exists (tests, the local server, ``s3kv`` tooling).

    Returns:
        ``True`` if this call created it, ``False`` if it already existed.

    Raises:
        StorageError: the bucket could not be created.
    """
    region = client.meta.region_name
    try:
        if region and region != "us-east-1":
            # NOTE: outside us-east-1, AWS requires the region to be repeated in the body.
            client.create_bucket(
                Bucket=bucket,
                CreateBucketConfiguration={"LocationConstraint": region},  # type: ignore[typeddict-item]
            )
        else:
            client.create_bucket(Bucket=bucket)
    except bce.ClientError as exc:
        if _error_code(exc)[0] in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            return False
        raise translate_error(
            exc, op="create_bucket", key=None, bucket=bucket, endpoint=str(client.meta.endpoint_url)
        ) from exc
    except FOREIGN_ERRORS as exc:
        raise translate_error(
            exc, op="create_bucket", key=None, bucket=bucket, endpoint=str(client.meta.endpoint_url)
        ) from exc
    return True


def _custom_endpoint(cfg: S3KVConfig) -> bool:
    """Whether the client will talk to a non-AWS endpoint (config or boto3's env vars)."""
    if cfg.endpoint_url:
        return True
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true":
        return False
    return bool(os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))


class _PathsOnce(list[str]):
    """A loader's search paths, where a path appended again is kept once."""

    def append(self, path: str) -> None:
        if path not in self:
            super().append(path)


_LOADERS: dict[str, botocore.loaders.Loader] = {}
_LOADERS_LOCK = threading.Lock()


def _botocore_session(profile: str | None) -> botocore.session.Session:
    """A new botocore session (its own profile, credentials and settings) whose service
    models come from one loader per process and data path.

    NOTE: why: each session's own loader parses botocore's S3 model and endpoint rules
    again: about 120 ms of CPU and 36,000 objects per client on a 2-core machine, left to
    the garbage collector when the client goes (in the engine's process). The parsed models
    are shared read-only, as the clients of one session always share them, and kept for the
    life of the process (what any session loaded: a few MB). Clients made at the same time
    on a cold loader may each parse a model once (botocore's cache takes no lock); the last
    one is kept. boto3 appends its data path to the loader's search paths for every
    session: kept once.
    """
    session = botocore.session.Session(profile=profile)
    data_path = session.get_config_variable("data_path") or ""
    with _LOADERS_LOCK:
        loader = _LOADERS.get(data_path)
        if loader is None:
            # NOTE: AWS_DATA_PATH read as botocore.loaders.create_loader reads it; that
            # function takes no list of our own, which _PathsOnce needs to be.
            paths = _PathsOnce(
                os.path.expanduser(os.path.expandvars(p)) for p in data_path.split(os.pathsep) if p
            )
            loader = _LOADERS[data_path] = botocore.loaders.Loader(extra_search_paths=paths)
    session.register_component("data_loader", loader)
    return session


def make_client(
    cfg: S3KVConfig, *, access_key: str | None = None, secret_key: str | None = None
) -> S3Client:
    """A boto3 S3 client configured for s3kv (see the module docstring for the reasons).

    Args:
        cfg: Endpoint, region, profile, addressing and transport settings.
        access_key: Explicit credentials (the local test server); default: boto3's chain.
        secret_key: See ``access_key``.

    Raises:
        StorageError: the profile does not exist or the settings are unusable.
    """
    install_redaction()  # NOTE: botocore logs signing headers at DEBUG (s3kv._logsetup)
    style = cfg.addressing_style
    if style == "auto" and _custom_endpoint(cfg):
        style = "path"
    botocore_config = Config(
        s3={"addressing_style": style, "payload_signing_enabled": False},
        # NOTE: botocore's retries["max_attempts"] counts *retries* (it becomes
        # total_max_attempts = max_attempts + 1); cfg.max_attempts counts attempts.
        retries={"total_max_attempts": cfg.max_attempts, "mode": "standard"},
        connect_timeout=cfg.connect_timeout,
        read_timeout=cfg.read_timeout,
        max_pool_connections=max(10, 2 * cfg.io_concurrency()),
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    try:
        session = boto3.session.Session(
            botocore_session=_botocore_session(cfg.profile), profile_name=cfg.profile
        )
        client = session.client(
            "s3",
            endpoint_url=cfg.endpoint_url or None,
            region_name=cfg.region or None,
            verify=cfg.ca_bundle or True,
            config=botocore_config,
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
        )
    except FOREIGN_ERRORS as exc:
        raise translate_error(
            exc, op="open", key=None, bucket=cfg.bucket, endpoint=cfg.endpoint_url
        ) from exc
    # NOTE: botocore sends `Expect: 100-continue` with every PutObject body (handlers.py's
    # add_expect_header on before-call.s3): the body then waits a round trip for the 100.
    # At 20 ms RTT a 1.47 MB block PUT took 84-132 ms with it, 45-55 ms without. s3kv sends
    # whole objects from memory, so a refused PUT costs one resent body at most.
    client.meta.events.unregister("before-call.s3", botocore.handlers.add_expect_header)
    return client


class S3Backend(Backend):
    """A :class:`~s3kv.storage.Backend` over one S3 bucket.

    Keys are full object keys (the caller includes the prefix). Thread-safe: boto3 clients
    and the awscrt transport are, and this class keeps no mutable state after construction.

    Build it with :meth:`from_config`; the constructor does no I/O.

    Args:
        client: A boto3 S3 client (shared by all threads).
        bucket: Bucket name.
        conditional_put: Whether ``put(if_absent=True)`` sends ``If-None-Match: *``.
        prefix: The config's key prefix, for :attr:`description` only.
        crt: An awscrt transport (:mod:`s3kv.storage.crt`) for ``get`` and ``put``; ``None``:
            boto3 carries every request.
    """

    def __init__(
        self,
        client: S3Client,
        *,
        bucket: str,
        conditional_put: bool,
        prefix: str = "",
        crt: CrtTransport | None = None,
    ) -> None:
        self._client = client
        self._bucket = bucket
        self._prefix = prefix.strip("/")
        self._endpoint = str(client.meta.endpoint_url)
        self._caps = Capabilities(conditional_put=conditional_put, remote=True)
        self._crt = crt
        self._foreign = FOREIGN_ERRORS if crt is None else FOREIGN_ERRORS + crt.errors

    @classmethod
    def from_config(cls, cfg: S3KVConfig, *, client: S3Client | None = None) -> S3Backend:
        """Open the bucket named by ``cfg``.

        With ``conditional_put="auto"`` this does I/O: :meth:`check` (HeadBucket), then the
        conditional-PUT probe (three requests). With ``"on"``/``"off"`` it does none.

        ``get``/``put`` go through awscrt (:mod:`s3kv.storage.crt`) when ``cfg.s3_client`` is
        ``crt``, or ``auto`` with awscrt installed and no ``client`` passed in, and the
        boto3 client has credentials (without, boto3 reports their absence at the first
        request); everything else goes through boto3.

        Args:
            cfg: Settings (bucket, endpoint, transport, ``conditional_put``, ``s3_client``).
            client: A ready boto3 client to use instead of building one (tests inject spies);
                with ``s3_client="auto"`` it then carries every request.

        Raises:
            ConfigError: no bucket is configured, or ``s3_client="crt"`` without awscrt.
            StorageError: ("auto" only) the bucket is missing or unreachable, or the probe
                failed for a reason other than lack of support.
        """
        if not cfg.bucket:
            raise ConfigError("bucket: no bucket configured; set TLLM_S3KV_BUCKET")
        s3 = client if client is not None else make_client(cfg)
        crt = _open_crt(cfg, s3) if _wants_crt(cfg, injected=client is not None) else None
        conditional = cfg.conditional_put == "on"
        if cfg.conditional_put == "auto":
            # NOTE: check first: probing a missing bucket is meaningless, and some servers
            # (SeaweedFS) answer a PUT into a missing bucket with 403 rather than NoSuchBucket.
            cls(s3, bucket=cfg.bucket, conditional_put=False).check()
            conditional = probe_conditional_put(s3, cfg.bucket, cfg.key_prefix)
        return cls(
            s3, bucket=cfg.bucket, conditional_put=conditional, prefix=cfg.key_prefix, crt=crt
        )

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    @property
    def description(self) -> str:
        path = f"s3://{self._bucket}/{self._prefix}" if self._prefix else f"s3://{self._bucket}"
        return f"{path} at {self._endpoint}"

    @property
    def bucket(self) -> str:
        """The bucket name."""
        return self._bucket

    @property
    def client(self) -> S3Client:
        """The underlying boto3 client (for tests and tools; not part of the interface)."""
        return self._client

    @property
    def transport(self) -> str:
        """The client carrying ``get`` and ``put``: ``"awscrt"`` or ``"boto3"``."""
        return "boto3" if self._crt is None else "awscrt"

    def _error(self, exc: BaseException, op: str, key: str | None) -> StorageError:
        return translate_error(exc, op=op, key=key, bucket=self._bucket, endpoint=self._endpoint)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        try:
            if self._crt is not None:
                return self._crt.get(key, max_bytes=max_bytes)
            response = self._client.get_object(Bucket=self._bucket, Key=key)
            return self._read_body(response, key, max_bytes)
        except self._foreign as exc:
            if _error_code(exc)[0] in _NOT_FOUND_CODES:
                return None
            raise self._error(exc, "get", key) from exc

    def _read_body(self, response: Any, key: str, max_bytes: int | None) -> bytes:
        """The body of a GetObject response, refused unread when over ``max_bytes``.

        NOTE: the bound is checked against Content-Length before any of the body is read,
        and a refused body is closed, not drained: its connection is dropped (the next
        request opens another) instead of receiving the object. A Range GET of
        ``max_bytes + 1`` would read that much junk first, and S3 answers a Range on an
        empty object with 416. Without a Content-Length (a proxy's chunked reply) at most
        ``max_bytes + 1`` bytes are read.
        """
        body = response["Body"]
        if max_bytes is None:
            data: bytes = body.read()
            return data
        where = f"get s3://{self._bucket}/{key}"
        length = response.get("ContentLength")
        if length is not None and int(length) > max_bytes:
            body.close()
            refuse_oversized(where, int(length), max_bytes)
        parts: list[bytes] = []
        remaining = max_bytes + 1
        while remaining > 0 and (chunk := body.read(remaining)):
            parts.append(chunk)
            remaining -= len(chunk)
        if remaining == 0:
            body.close()
            refuse_oversized(where, max_bytes + 1, max_bytes)
        return b"".join(parts)

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        conditional = if_absent and self._caps.conditional_put
        try:
            if self._crt is not None:
                self._crt.put(key, data, if_none_match=conditional)
            else:
                self._put_boto3(key, data, conditional=conditional)
        except self._foreign as exc:
            code, status = _error_code(exc)
            # 412: the key exists. 409 ConditionalRequestConflict: a concurrent conditional
            # write to the same key is in flight; it will create the object, so "present".
            if conditional and (code in _PRECONDITION_CODES or status in (409, 412)):
                return False
            raise self._error(exc, "put", key) from exc
        return True

    def _put_boto3(self, key: str, data: bytes | memoryview, *, conditional: bool) -> None:
        # NOTE: botocore accepts bytes/bytearray/file objects but not memoryview; one copy
        # costs ~0.1 ms/MiB, under 2 % of a loopback PUT (perf-anchors §0).
        body = data if isinstance(data, bytes) else bytes(data)
        if conditional:
            self._client.put_object(Bucket=self._bucket, Key=key, Body=body, IfNoneMatch="*")
        else:
            self._client.put_object(Bucket=self._bucket, Key=key, Body=body)

    def head(self, key: str) -> ObjectInfo | None:
        # NOTE: HEAD responses have no body, so a missing *bucket* is a bare 404 here too and
        # reads as "absent"; check() is what reports a missing bucket.
        try:
            response = self._client.head_object(Bucket=self._bucket, Key=key)
        except bce.ClientError as exc:
            if _error_code(exc)[0] in _NOT_FOUND_CODES:
                return None
            raise self._error(exc, "head", key) from exc
        except FOREIGN_ERRORS as exc:
            raise self._error(exc, "head", key) from exc
        return ObjectInfo(
            key,
            int(response["ContentLength"]),
            response["LastModified"].timestamp(),
            str(response.get("ETag", "")).strip('"'),
        )

    def delete_many(self, keys: Iterable[str]) -> DeleteResult:
        result = DeleteResult()
        it = iter(keys)
        while batch := list(islice(it, DELETE_BATCH)):
            try:
                response = self._client.delete_objects(
                    Bucket=self._bucket,
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
                )
            except FOREIGN_ERRORS as exc:
                raise self._error(exc, "delete_many", None) from exc
            failed = {
                str(err.get("Key")): f"{err.get('Code', 'error')}: {err.get('Message', '')}"
                for err in response.get("Errors", [])
            }
            result.failed.update(failed)
            result.deleted.extend(k for k in batch if k not in failed)
        return result

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        kwargs: dict[str, Any] = {"Bucket": self._bucket, "Prefix": prefix}
        if start_after is not None:
            kwargs["StartAfter"] = start_after
        pages = self._client.get_paginator("list_objects_v2").paginate(**kwargs)
        try:
            for page in pages:
                for item in page.get("Contents", []):
                    yield ObjectInfo(
                        item["Key"],
                        int(item["Size"]),
                        item["LastModified"].timestamp(),
                        str(item.get("ETag", "")).strip('"'),
                    )
        except FOREIGN_ERRORS as exc:
            raise self._error(exc, "list", None) from exc

    def list_dirs(self, prefix: str) -> Iterator[str]:
        if prefix and not prefix.endswith("/"):
            yield from super().list_dirs(prefix)
            return
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self._bucket, Prefix=prefix, Delimiter="/"
        )
        try:
            for page in pages:
                for common in page.get("CommonPrefixes", []):
                    yield str(common.get("Prefix", ""))[len(prefix) :].rstrip("/")
        except FOREIGN_ERRORS as exc:
            raise self._error(exc, "list", None) from exc

    def probe_conditional_put(self, prefix: str) -> bool:
        return probe_conditional_put(self._client, self._bucket, prefix)

    def check(self) -> None:
        try:
            self._client.head_bucket(Bucket=self._bucket)
        except FOREIGN_ERRORS as exc:
            raise self._error(exc, "check", None) from exc

    def close(self) -> None:
        self._client.close()
        if self._crt is not None:
            self._crt.close()


def _wants_crt(cfg: S3KVConfig, *, injected: bool) -> bool:
    return cfg.s3_client == "crt" or (cfg.s3_client == "auto" and not injected)


def _open_crt(cfg: S3KVConfig, client: S3Client) -> CrtTransport | None:
    """The awscrt transport for ``client``'s bucket, or ``None`` (see ``S3Backend.from_config``).

    Raises:
        ConfigError: ``s3_client="crt"`` and awscrt does not import.
    """
    try:
        from s3kv.storage.crt import CrtSettings, CrtTransport
    except ImportError as exc:
        if cfg.s3_client == "crt":
            raise ConfigError(
                f"s3_client: 'crt' needs awscrt ({exc}); pip install 's3kv-cache[crt]' or "
                "set TLLM_S3KV_S3_CLIENT=boto3"
            ) from None
        return None
    # NOTE: boto3's own client supplies the credentials, as boto3.crt does: the same chain,
    # profile and explicit keys, and botocore refreshes temporary ones (a private accessor
    # that boto3 and s3transfer use for exactly this).
    credentials = client._get_credentials()  # type: ignore[attr-defined]
    if credentials is None:
        logger.info("no AWS credentials found: object GET/PUT stay on boto3, which says so")
        return None
    region = client.meta.region_name or "us-east-1"
    endpoint = str(client.meta.endpoint_url)
    s3_options: dict[str, Any] = getattr(client.meta.config, "s3", None) or {}
    settings = CrtSettings(
        endpoint_url=endpoint,
        region=region,
        bucket=cfg.bucket,
        addressing_style=str(s3_options.get("addressing_style") or "auto"),
        ca_bundle=_ca_bundle(cfg) if endpoint.startswith("https:") else None,
        connect_timeout=cfg.connect_timeout,
        read_timeout=cfg.read_timeout,
        max_attempts=cfg.max_attempts,
    )
    refreshing = isinstance(credentials, botocore.credentials.RefreshableCredentials)
    return CrtTransport(settings, _frozen(credentials, bucket=cfg.bucket), refreshing=refreshing)


def _ca_bundle(cfg: S3KVConfig) -> str | None:
    """The CA bundle boto3 verifies with: ``ca_bundle``, ``AWS_CA_BUNDLE``, else botocore's
    default (certifi's bundle where installed), so that both clients trust the same CAs."""
    path = cfg.ca_bundle or os.environ.get("AWS_CA_BUNDLE") or ""
    return path or str(botocore.httpsession.get_cert_path(True))


def _frozen(credentials: Any, *, bucket: str) -> Callable[[], tuple[str, str, str | None]]:
    """``credentials``' current values; on a failed refresh, the last ones (logged)."""
    last: list[tuple[str, str, str | None]] = []

    def current() -> tuple[str, str, str | None]:
        # NOTE: awscrt calls this from its event loop, where an exception only prints: a
        # refresh failure is logged and the last credentials go out; the server's answer
        # (ExpiredToken, 403) then reaches the caller as AccessDeniedError.
        try:
            frozen = credentials.get_frozen_credentials()
            values = (str(frozen.access_key), str(frozen.secret_key), frozen.token or None)
        except FOREIGN_ERRORS as exc:
            error = translate_error(exc, op="credentials", key=None, bucket=bucket)
            logger.warning("refreshing AWS credentials failed (%s); using the last ones", error)
            return last[0] if last else ("", "", None)
        last[:] = [values]
        return values

    return current


def probe_conditional_put(client: S3Client, bucket: str, prefix: str) -> bool:
    """Whether the server honours ``If-None-Match: *`` on PutObject (see module docstring).

    PUTs a scratch key under ``<prefix>/.s3kv-probe/`` twice and deletes it.

    Returns:
        ``True`` only if the second conditional PUT was refused with 412/409. ``False`` if
        the server ignored or rejected the header, or (logged) if the credentials may not
        write: a read-only principal can still use the bucket.

    Raises:
        StorageError: the bucket is missing, the endpoint is unreachable, or any other failure.
    """
    key = "/".join(p for p in (prefix.strip("/"), _PROBE_DIR, uuid.uuid4().hex) if p)
    endpoint = str(client.meta.endpoint_url)
    written = False
    try:
        for attempt in (1, 2):
            try:
                client.put_object(Bucket=bucket, Key=key, Body=b"", IfNoneMatch="*")
                written = True
            except bce.ClientError as exc:
                code, status = _error_code(exc)
                if attempt == 2 and (code in _PRECONDITION_CODES or status in (409, 412)):
                    logger.info("conditional PUT supported by %s", endpoint)
                    return True
                if code in _UNSUPPORTED_CODES or status in (400, 501):
                    logger.info("conditional PUT not supported by %s (%s)", endpoint, code)
                    return False
                error = translate_error(exc, op="probe", key=key, bucket=bucket, endpoint=endpoint)
                if isinstance(error, AccessDeniedError):
                    logger.warning("cannot probe conditional PUT (%s); assuming off", error)
                    return False
                raise error from exc
            except FOREIGN_ERRORS as exc:
                raise translate_error(
                    exc, op="probe", key=key, bucket=bucket, endpoint=endpoint
                ) from exc
        logger.warning(
            "%s ignores If-None-Match on PUT: conditional PUT off (saves may overwrite)",
            endpoint,
        )
        return False
    finally:
        if written:
            _delete_quietly(client, bucket, key)


def whoami(cfg: S3KVConfig) -> Credentials | None:
    """Where boto3's chain finds credentials for ``cfg.profile``; ``None`` if it finds none.

    The access key id is masked to its last four characters; the secret is never read out.

    Raises:
        AccessDeniedError: the profile does not exist or its configuration is unusable.
        StorageError: another failure of the credential chain.
    """
    try:
        install_redaction()  # the chain may log STS replies at DEBUG
        creds = boto3.session.Session(profile_name=cfg.profile).get_credentials()
        key_id = "" if creds is None else str(getattr(creds, "access_key", "") or "")
    except FOREIGN_ERRORS as exc:
        raise translate_error(exc, op="credentials", key=None, bucket=cfg.bucket) from exc
    if creds is None:
        return None
    masked = "*" * max(0, len(key_id) - 4) + key_id[-4:]
    return Credentials(source=str(creds.method), access_key_id=masked)


def _delete_quietly(client: S3Client, bucket: str, key: str) -> None:
    try:
        client.delete_object(Bucket=bucket, Key=key)
    except FOREIGN_ERRORS as exc:
        logger.warning(
            "could not delete probe object s3://%s/%s: %s",
            bucket,
            key,
            translate_error(exc, op="delete", key=key, bucket=bucket),
        )


__all__ = [
    "FOREIGN_ERRORS",
    "S3Backend",
    "ensure_bucket",
    "make_client",
    "probe_conditional_put",
    "translate_error",
    "whoami",
]
