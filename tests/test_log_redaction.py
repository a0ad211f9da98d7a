"""Secrets never reach the log (issue 12, item 13), DEBUG on for every logger.

With DEBUG on everywhere botocore printed the session token (``x-amz-security-token``) six
times per run: in the prepared request's headers, the canonical request and the signature
lines. s3kv installs a redacting filter on the third-party loggers it drives (botocore,
boto3, urllib3, s3transfer, awscrt) when it opens an S3 client; these tests run real
requests against moto with recognisable credentials and search everything logged.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator

import pytest
from conftest import s3_config, unique_bucket

from s3kv._logsetup import REDACTED, REDACTED_LOGGERS, RedactingFilter, install_redaction, redact
from s3kv.storage import ensure_bucket, make_client, open_backend

#: Recognisable credentials: a leak of any of them (or of a signature) fails the test.
ACCESS_KEY = "AKIAS3KVREDACTIONTEST"
SECRET_KEY = "s3kv-secret-" + secrets.token_hex(12)
SESSION_TOKEN = "FwoGZXIvYXdzS3KV//" + secrets.token_hex(24) + "+token=="


@pytest.fixture
def debug_everywhere(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """DEBUG on the root and on every logger that exists; levels restored afterwards."""
    manager = logging.Logger.manager
    loggers = [logging.getLogger(name) for name in list(manager.loggerDict)]
    saved = [(logger, logger.level, logger.propagate) for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.DEBUG)
        logger.propagate = True
    caplog.set_level(logging.DEBUG)
    try:
        yield caplog
    finally:
        for logger, level, propagate in saved:
            logger.setLevel(level)
            logger.propagate = propagate


@pytest.fixture
def session_credentials(aws_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_SESSION_TOKEN", SESSION_TOKEN)


def everything_logged(caplog: pytest.LogCaptureFixture) -> str:
    """Every record as a handler would write it: formatted message and exception text."""
    formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
    return "\n".join(formatter.format(record) for record in caplog.records)


def test_real_requests_at_debug_leak_no_credentials(
    moto_server: str, session_credentials: None, debug_everywhere: pytest.LogCaptureFixture
) -> None:
    cfg = s3_config(moto_server, unique_bucket(), conditional_put="auto")
    ensure_bucket(make_client(cfg), cfg.bucket)
    backend = open_backend(cfg)  # HeadBucket + the conditional-PUT probe
    try:
        backend.put("s3kv/k1", b"block bytes")
        assert backend.get("s3kv/k1") == b"block bytes"
        assert [info.key for info in backend.list("s3kv/")] == ["s3kv/k1"]
        backend.delete_many(["s3kv/k1"])
        assert backend.get("s3kv/k1") is None
    finally:
        backend.close()
    logged = everything_logged(debug_everywhere)
    # The test can fail: botocore did log the signing material, redacted.
    assert "x-amz-security-token" in logged.lower()
    assert REDACTED in logged
    for secret in (SECRET_KEY, SESSION_TOKEN, SESSION_TOKEN[:24]):
        assert secret not in logged
    assert "Signature=" not in logged.replace(f"Signature={REDACTED}", "")


def test_the_filter_is_installed_once_per_logger(
    moto_server: str, session_credentials: None
) -> None:
    cfg = s3_config(moto_server, unique_bucket(), conditional_put="off")
    for _ in range(3):
        make_client(cfg)
        install_redaction()
    names = [n for n in logging.Logger.manager.loggerDict if n.split(".")[0] in REDACTED_LOGGERS]
    assert {"botocore", "botocore.auth", "botocore.endpoint", "urllib3.connectionpool"} <= set(
        names
    )
    for name in names:
        filters = [f for f in logging.getLogger(name).filters if isinstance(f, RedactingFilter)]
        assert len(filters) == 1, name


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        # botocore.endpoint: the prepared request's headers (a dict repr of bytes values)
        ("headers={'X-Amz-Security-Token': b'FwoTOKEN/abc+=', 'Authorization': b'AWS4-HMAC-"
         "SHA256 Credential=AKIAXX/20260101/us-east-1/s3/aws4_request, SignedHeaders=host, "
         "Signature=0123abcd'}", ("FwoTOKEN", "AKIAXX", "0123abcd")),
        # botocore.auth: the canonical request and the signature line
        ("CanonicalRequest:\nGET\n/b/k\n\nhost:h\nx-amz-security-token:FwoTOKEN/abc+=\n",
         ("FwoTOKEN",)),
        ("Signature:\n9f86d081884c7d659a2feaa0c55ad015", ("9f86d081884c7d659a2feaa0c55ad015",)),
        # urllib3: a presigned URL in the request line
        ('"GET /b/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAXX%2F2026&'
         'X-Amz-Security-Token=FwoTOKEN%2Fabc&X-Amz-Signature=deadbeef HTTP/1.1" 200',
         ("AKIAXX", "FwoTOKEN", "deadbeef")),
        # STS / container credentials / KMS replies in botocore.parsers' response body
        ("b'<Credentials><SecretAccessKey>wJalrSECRET</SecretAccessKey><SessionToken>FwoTOKEN"
         "</SessionToken></Credentials>'", ("wJalrSECRET", "FwoTOKEN")),
        ('b\'{"AccessKeyId": "ASIAX", "SecretAccessKey": "wJalrSECRET", "Token": "FwoTOKEN"}\'',
         ("wJalrSECRET", "FwoTOKEN")),
        ('{"KeyId": "arn:aws:kms:k", "Plaintext": "c2VjcmV0LWRhdGEta2V5"}',
         ("c2VjcmV0LWRhdGEta2V5",)),
        # a shared config file or environment dump
        ("aws_secret_access_key = wJalrSECRET\naws_session_token=FwoTOKEN",
         ("wJalrSECRET", "FwoTOKEN")),
    ],
)  # fmt: skip
def test_redact_scrubs_every_form_botocore_logs(text: str, secret: tuple[str, ...]) -> None:
    scrubbed = redact(text)
    for value in secret:
        assert value not in scrubbed, scrubbed
    assert REDACTED in scrubbed


def test_redact_leaves_ordinary_messages_alone() -> None:
    for text in (
        "Found credentials in environment variables.",
        "Event before-sign.s3.PutObject: calling handler <function f>",
        '"PUT /bucket/s3kv/ab/cd HTTP/1.1" 200 0',
        "Starting new HTTP connection (1): 127.0.0.1:9000",
    ):
        assert redact(text) == text


def test_the_filter_rewrites_args_and_lets_the_record_through() -> None:
    record = logging.LogRecord(
        "botocore.endpoint", logging.DEBUG, __file__, 1, "Sending http request: %s",
        ({"X-Amz-Security-Token": b"FwoTOKEN"},), None,
    )  # fmt: skip
    assert RedactingFilter().filter(record) is True
    assert "FwoTOKEN" not in record.getMessage()
    assert record.args is None
