"""S3Backend specifics: client settings, the conditional-PUT probe, error translation.

The storage contract itself is in test_backend_contract.py; this file covers what only the
S3 backend has: how it builds its client, what it probes, and how every foreign error
becomes a one-line, credential-free :class:`~s3kv.errors.StorageError`.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import botocore.exceptions as bce
import pytest
import urllib3.exceptions
from botocore.stub import Stubber
from conftest import s3_config, unique_bucket

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
from s3kv.storage import (
    DELETE_BATCH,
    S3Backend,
    make_client,
    probe_conditional_put,
    translate_error,
)
from s3kv.testing.local_s3 import LocalS3, free_port

# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------


def client_error(code: str, status: int, message: str = "", op: str = "PutObject") -> Any:
    response: Any = {
        "Error": {"Code": code, "Message": message},
        "ResponseMetadata": {"HTTPStatusCode": status, "RetryAttempts": 0},
    }
    return bce.ClientError(response, op)


def count_calls(backend: S3Backend, operation: str) -> list[dict[str, Any]]:
    """Record the parameters of every ``operation`` call the backend's client makes."""
    calls: list[dict[str, Any]] = []

    def record(params: dict[str, Any], **_: Any) -> None:
        calls.append(params)

    backend.client.meta.events.register(f"provide-client-params.s3.{operation}", record)
    return calls


def assert_one_line(message: str, *needles: str) -> None:
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)


@pytest.fixture
def stubbed() -> Iterator[tuple[Any, Stubber]]:
    """A real client with botocore's Stubber: no network, scripted responses."""
    cfg = S3KVConfig(bucket="stub-bucket", endpoint_url="http://127.0.0.1:9", region="us-east-1")
    client = make_client(cfg, access_key="k", secret_key="s")
    with Stubber(client) as stub:
        yield client, stub
        stub.assert_no_pending_responses()


# ----------------------------------------------------------------------------------------
# client construction
# ----------------------------------------------------------------------------------------


class TestClientSettings:
    def test_checksums_off_and_path_style_for_custom_endpoint(self, aws_env: None) -> None:
        client = make_client(
            S3KVConfig(bucket="bkt", endpoint_url="http://127.0.0.1:9", io_threads=16)
        )
        config = client.meta.config
        assert config.s3 is not None
        assert config.s3["addressing_style"] == "path"
        assert config.s3["payload_signing_enabled"] is False
        assert config.request_checksum_calculation == "when_required"
        assert config.response_checksum_validation == "when_required"
        assert config.max_pool_connections == 32
        # cfg.max_attempts counts attempts; botocore's "max_attempts" would count retries.
        assert config.retries == {"total_max_attempts": 3, "mode": "standard"}

    def test_auto_addressing_follows_endpoint_env(
        self, aws_env: None, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        def style() -> str:
            s3 = make_client(S3KVConfig(bucket="bkt", addressing_style="auto")).meta.config.s3
            assert s3 is not None
            return str(s3["addressing_style"])

        assert style() == "auto"  # AWS itself: botocore decides
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
        assert style() == "path"

    def test_explicit_virtual_style_is_kept(self, aws_env: None) -> None:
        cfg = S3KVConfig(bucket="bkt", endpoint_url="http://h:9", addressing_style="virtual")
        s3 = make_client(cfg).meta.config.s3
        assert s3 is not None
        assert s3["addressing_style"] == "virtual"

    def test_min_pool_size(self, aws_env: None) -> None:
        client = make_client(S3KVConfig(bucket="bkt", io_threads=1))
        assert client.meta.config.max_pool_connections == 10

    def test_missing_bucket_setting(self) -> None:
        with pytest.raises(ConfigError, match="TLLM_S3KV_BUCKET"):
            S3Backend.from_config(S3KVConfig(bucket=""))

    def test_unknown_profile_is_access_denied(self, aws_env: None) -> None:
        with pytest.raises(AccessDeniedError, match="no-such-profile"):
            make_client(S3KVConfig(bucket="bkt", profile="no-such-profile"))

    def test_clients_share_the_parsed_models_and_nothing_grows(
        self, aws_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
    ) -> None:
        # Each boto3 session used to parse botocore's S3 model again (~36,000 objects).
        from s3kv.storage import s3 as s3_module

        def model(client: Any) -> Any:
            return client.meta.service_model._service_description

        monkeypatch.delenv("AWS_DATA_PATH", raising=False)
        # NOTE: the loaders this test makes are dropped after it (a parsed model is MBs).
        monkeypatch.setattr(s3_module, "_LOADERS", dict(s3_module._LOADERS))
        cfg = S3KVConfig(bucket="bkt", endpoint_url="http://127.0.0.1:9")
        first = make_client(cfg)
        paths = len(s3_module._LOADERS[""].search_paths)
        assert all(model(make_client(cfg)) is model(first) for _ in range(3))
        assert len(s3_module._LOADERS[""].search_paths) == paths, "boto3's path added again"
        # A session's own data path (AWS_DATA_PATH) still gets a loader that searches it.
        monkeypatch.setenv("AWS_DATA_PATH", str(tmp_path))
        assert model(make_client(cfg)) is not model(first)
        assert str(tmp_path) in s3_module._LOADERS[str(tmp_path)].search_paths

    def test_description(self, moto_backend: S3Backend, moto_server: str) -> None:
        assert moto_backend.description == f"s3://{moto_backend.bucket}/s3kv at {moto_server}"

    def test_import_s3kv_does_not_import_boto3(self) -> None:
        code = (
            "import sys, s3kv, s3kv.storage, s3kv.testing.local_s3; "
            "bad = [m for m in ('boto3', 'botocore') if m in sys.modules]; "
            "sys.exit(f'imported {bad}' if bad else 0)"
        )
        result = subprocess.run(
            [sys.executable, "-c", code], check=False, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr + result.stdout


# ----------------------------------------------------------------------------------------
# conditional PUT: probe and capability
# ----------------------------------------------------------------------------------------


class TestConditionalPut:
    def test_moto_supports_it(self, moto_backend: S3Backend) -> None:
        # moto 5.2.5 answers the second If-None-Match PUT with 412 PreconditionFailed.
        assert moto_backend.capabilities.conditional_put is True
        assert list(moto_backend.list("s3kv/.s3kv-probe/")) == []  # scratch key removed

    def test_seaweedfs_supports_it(self, seaweed_backend: S3Backend) -> None:
        # SeaweedFS 4.48 answers the second If-None-Match PUT with 412 PreconditionFailed.
        assert seaweed_backend.capabilities.conditional_put is True
        assert list(seaweed_backend.list("s3kv/.s3kv-probe/")) == []

    def test_if_absent_sends_if_none_match(self, moto_backend: S3Backend) -> None:
        puts = count_calls(moto_backend, "PutObject")
        moto_backend.put("k", b"1", if_absent=True)
        moto_backend.put("k", b"2")
        assert [p.get("IfNoneMatch") for p in puts] == ["*", None]

    def test_off_means_plain_put(self, moto_server: str, moto_backend: S3Backend) -> None:
        cfg = s3_config(moto_server, moto_backend.bucket, conditional_put="off")
        plain = S3Backend.from_config(cfg, client=moto_backend.client)
        puts = count_calls(plain, "PutObject")
        assert plain.capabilities.conditional_put is False
        assert puts == []  # no probe
        plain.put("k", b"1")
        assert plain.put("k", b"2", if_absent=True) is True
        assert plain.get("k") == b"2"
        assert "IfNoneMatch" not in puts[-1]

    def test_on_skips_the_probe(self, moto_server: str, moto_backend: S3Backend) -> None:
        cfg = s3_config(moto_server, moto_backend.bucket, conditional_put="on")
        calls = count_calls(moto_backend, "PutObject")
        backend = S3Backend.from_config(cfg, client=moto_backend.client)
        assert backend.capabilities.conditional_put is True
        assert calls == []

    def test_probe_server_ignoring_header(self, stubbed: tuple[Any, Stubber]) -> None:
        client, stub = stubbed
        stub.add_response("put_object", {})
        stub.add_response("put_object", {})  # second create "succeeds": header ignored
        stub.add_response("delete_object", {})
        assert probe_conditional_put(client, "stub-bucket", "pre") is False

    @pytest.mark.parametrize(("code", "status"), [("NotImplemented", 501), ("BadRequest", 400)])
    def test_probe_server_rejecting_header(
        self, stubbed: tuple[Any, Stubber], code: str, status: int
    ) -> None:
        client, stub = stubbed
        stub.add_client_error("put_object", service_error_code=code, http_status_code=status)
        assert probe_conditional_put(client, "stub-bucket", "pre") is False

    def test_probe_conflict_counts_as_support(self, stubbed: tuple[Any, Stubber]) -> None:
        client, stub = stubbed
        stub.add_response("put_object", {})
        stub.add_client_error(
            "put_object", service_error_code="ConditionalRequestConflict", http_status_code=409
        )
        stub.add_response("delete_object", {})
        assert probe_conditional_put(client, "stub-bucket", "pre") is True

    def test_probe_key_is_under_prefix_and_removed(self, stubbed: tuple[Any, Stubber]) -> None:
        client, stub = stubbed
        stub.add_response("put_object", {})
        stub.add_client_error("put_object", "PreconditionFailed", http_status_code=412)
        stub.add_response("delete_object", {})
        keys: list[str] = []
        client.meta.events.register(
            "provide-client-params.s3.*", lambda params, **_: keys.append(params["Key"])
        )
        assert probe_conditional_put(client, "stub-bucket", "/pre/fix/") is True
        assert len(keys) == 3
        assert len(set(keys)) == 1  # put, put, delete: one scratch key
        assert keys[0].startswith("pre/fix/.s3kv-probe/")

    def test_put_conflict_409_means_present(self, stubbed: tuple[Any, Stubber]) -> None:
        client, stub = stubbed
        backend = S3Backend(client, bucket="stub-bucket", conditional_put=True)
        stub.add_client_error("put_object", "ConditionalRequestConflict", http_status_code=409)
        assert backend.put("k", b"v", if_absent=True) is False

    def test_put_412_without_if_absent_is_an_error(self, stubbed: tuple[Any, Stubber]) -> None:
        client, stub = stubbed
        backend = S3Backend(client, bucket="stub-bucket", conditional_put=True)
        stub.add_client_error("put_object", "PreconditionFailed", http_status_code=412)
        with pytest.raises(PreconditionFailedError):
            backend.put("k", b"v")


# ----------------------------------------------------------------------------------------
# request batching
# ----------------------------------------------------------------------------------------


class TestBatching:
    def test_delete_many_uses_batches_of_1000(self, moto_backend: S3Backend) -> None:
        keys = [f"d/{i:05d}" for i in range(DELETE_BATCH + 5)]
        deletes = count_calls(moto_backend, "DeleteObjects")
        result = moto_backend.delete_many(keys)  # absent keys: no need to write them first
        assert [len(call["Delete"]["Objects"]) for call in deletes] == [DELETE_BATCH, 5]
        assert all(call["Delete"]["Quiet"] is True for call in deletes)
        assert result.deleted == keys

    def test_delete_many_reports_per_key_errors(self, stubbed: tuple[Any, Stubber]) -> None:
        client, stub = stubbed
        backend = S3Backend(client, bucket="stub-bucket", conditional_put=False)
        stub.add_response(
            "delete_objects",
            {"Errors": [{"Key": "b", "Code": "AccessDenied", "Message": "nope"}]},
        )
        result = backend.delete_many(["a", "b", "c"])
        assert result.deleted == ["a", "c"]
        assert result.failed == {"b": "AccessDenied: nope"}


# ----------------------------------------------------------------------------------------
# errors against real servers
# ----------------------------------------------------------------------------------------


class TestErrorsFromServers:
    def test_missing_bucket(self, moto_server: str, aws_env: None) -> None:
        bucket = unique_bucket()
        cfg = s3_config(moto_server, bucket, conditional_put="off", s3_client="boto3")
        backend = S3Backend.from_config(cfg)
        with pytest.raises(BucketNotFoundError) as info:
            backend.check()
        assert_one_line(str(info.value), repr(bucket), moto_server, "TLLM_S3KV_BUCKET")
        with pytest.raises(BucketNotFoundError) as got:
            backend.get("k")
        assert isinstance(got.value.__cause__, bce.ClientError)  # raise ... from exc
        with pytest.raises(BucketNotFoundError):
            list(backend.list(""))
        with pytest.raises(BucketNotFoundError):
            backend.delete_many(["k"])

    def test_missing_bucket_at_open_with_auto_probe(
        self, seaweedfs: LocalS3, aws_env: None
    ) -> None:
        # SeaweedFS answers a PUT into a missing bucket with 403, so open checks first.
        bucket = unique_bucket()
        cfg = s3_config(seaweedfs.endpoint, bucket)
        client = make_client(cfg, access_key=seaweedfs.access_key, secret_key=seaweedfs.secret_key)
        with pytest.raises(BucketNotFoundError, match=bucket):
            S3Backend.from_config(cfg, client=client)

    @pytest.mark.parametrize("wrong", ["secret", "access_key"])
    def test_bad_credentials(self, seaweedfs: LocalS3, aws_env: None, wrong: str) -> None:
        cfg = s3_config(seaweedfs.endpoint, seaweedfs.bucket, conditional_put="off")
        assert seaweedfs.secret_key is not None
        bad_secret = "wrong-" + seaweedfs.secret_key
        access = "no-such-key" if wrong == "access_key" else seaweedfs.access_key
        backend = S3Backend.from_config(
            cfg, client=make_client(cfg, access_key=access, secret_key=bad_secret)
        )
        for call in (backend.check, lambda: backend.get("k"), lambda: backend.put("k", b"")):
            with pytest.raises(AccessDeniedError) as info:
                call()
            message = str(info.value)
            assert_one_line(message, seaweedfs.bucket, "credentials")
            assert bad_secret not in message
            assert seaweedfs.secret_key not in message

    def test_missing_credentials(
        self, moto_server: str, aws_env: None, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        backend = S3Backend.from_config(s3_config(moto_server, "bkt", conditional_put="off"))
        with pytest.raises(AccessDeniedError, match="AWS_ACCESS_KEY_ID"):
            backend.get("k")

    def test_closed_port_is_endpoint_error_quickly(self, aws_env: None) -> None:
        endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        cfg = s3_config(endpoint, "bkt", connect_timeout=0.5, max_attempts=1, conditional_put="off")
        backend = S3Backend.from_config(cfg)
        started = time.monotonic()
        with pytest.raises(EndpointError) as info:
            backend.get("some/key")
        assert time.monotonic() - started < 3.0
        assert_one_line(str(info.value), endpoint, "some/key", "TLLM_S3KV_ENDPOINT_URL")
        with pytest.raises(EndpointError):
            backend.check()
        with pytest.raises(EndpointError):
            S3Backend.from_config(cfg.replace(conditional_put="auto"))


# ----------------------------------------------------------------------------------------
# translate_error unit tests
# ----------------------------------------------------------------------------------------


def translate(exc: BaseException, key: str | None = "k/1") -> StorageError:
    return translate_error(exc, op="put", key=key, bucket="bkt", endpoint="http://e:1")


class TestTranslateError:
    @pytest.mark.parametrize(
        ("code", "status"),
        [
            ("SlowDown", 503),
            ("ServiceUnavailable", 503),
            ("Throttling", 400),
            ("RequestLimitExceeded", 400),
            ("TooManyRequests", 429),
            ("", 503),
        ],
    )
    def test_throttling(self, code: str, status: int) -> None:
        error = translate(client_error(code, status))
        assert type(error) is ThrottledError
        assert_one_line(str(error), "put", "s3://bkt/k/1", "http://e:1", "TLLM_S3KV_IO_THREADS")

    @pytest.mark.parametrize(
        ("code", "status"),
        [("AccessDenied", 403), ("InvalidAccessKeyId", 403), ("SignatureDoesNotMatch", 403),
         ("ExpiredToken", 400), ("403", 403)],
    )  # fmt: skip
    def test_access_denied(self, code: str, status: int) -> None:
        error = translate(client_error(code, status))
        assert type(error) is AccessDeniedError
        assert_one_line(str(error), "s3://bkt/k/1", "IAM")

    def test_no_such_bucket(self) -> None:
        error = translate(client_error("NoSuchBucket", 404))
        assert type(error) is BucketNotFoundError
        assert_one_line(str(error), "bucket 'bkt' does not exist at http://e:1", "create it")

    def test_bare_404_on_bucket_operation_is_missing_bucket(self) -> None:
        assert type(translate(client_error("404", 404), key=None)) is BucketNotFoundError
        assert type(translate(client_error("404", 404))) is StorageError

    @pytest.mark.parametrize(
        ("code", "status"), [("PreconditionFailed", 412), ("ConditionalRequestConflict", 409)]
    )
    def test_precondition(self, code: str, status: int) -> None:
        assert type(translate(client_error(code, status))) is PreconditionFailedError

    def test_server_error_is_plain_storage_error(self) -> None:
        error = translate(client_error("InternalError", 500, "We encountered an internal error"))
        assert type(error) is StorageError
        assert_one_line(str(error), "InternalError", "HTTP 500", "internal error")

    def test_wrong_region(self) -> None:
        exc = client_error("PermanentRedirect", 301)
        exc.response["ResponseMetadata"]["HTTPHeaders"] = {"x-amz-bucket-region": "eu-west-1"}
        assert_one_line(str(translate(exc)), "TLLM_S3KV_REGION=eu-west-1")

    @pytest.mark.parametrize(
        "exc",
        [
            bce.EndpointConnectionError(endpoint_url="http://e:1/bkt/k/1"),
            bce.ConnectTimeoutError(endpoint_url="http://e:1/bkt/k/1"),
            bce.ReadTimeoutError(endpoint_url="http://e:1/bkt/k/1"),
            bce.ConnectionClosedError(endpoint_url="http://e:1/bkt/k/1"),
            bce.SSLError(endpoint_url="http://e:1", error="certificate verify failed"),
            urllib3.exceptions.ProtocolError("Connection aborted."),
            ConnectionResetError(104, "Connection reset by peer"),
        ],
        ids=lambda exc: type(exc).__name__,
    )
    def test_transport_errors_are_endpoint_errors(self, exc: BaseException) -> None:
        error = translate(exc)
        assert type(error) is EndpointError
        assert_one_line(str(error), "put s3://bkt/k/1 at http://e:1")

    def test_read_timeout_names_the_setting(self) -> None:
        error = translate(bce.ReadTimeoutError(endpoint_url="http://e:1"))
        assert "TLLM_S3KV_READ_TIMEOUT" in str(error)

    @pytest.mark.parametrize(
        "exc",
        [bce.NoCredentialsError(), bce.PartialCredentialsError(provider="env", cred_var="x")],
    )
    def test_credentials_missing(self, exc: BaseException) -> None:
        assert type(translate(exc)) is AccessDeniedError

    def test_param_validation(self) -> None:
        error = translate(bce.ParamValidationError(report="Invalid bucket name 'A B'"))
        assert type(error) is StorageError
        assert_one_line(str(error), "Invalid bucket name")

    def test_other_os_error(self) -> None:
        assert type(translate(PermissionError(13, "Permission denied"))) is StorageError

    def test_storage_error_passes_through(self) -> None:
        original = ThrottledError("already translated")
        assert translate(original) is original

    def test_retries_are_reported(self) -> None:
        exc = client_error("SlowDown", 503)
        exc.response["ResponseMetadata"]["RetryAttempts"] = 2
        assert "after 2 retries" in str(translate(exc))

    def test_secrets_are_scrubbed(self, monkeypatch: pytest.MonkeyPatch) -> None:
        secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
        error = translate(client_error("SignatureDoesNotMatch", 403, f"calculated {secret}\nx"))
        assert secret not in str(error)
        assert "***" in str(error)
        assert "\n" not in str(error)
