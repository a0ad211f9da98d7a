"""``s3kv doctor`` and ``s3kv local-s3`` through the CLI runner.

The denied-permission case runs against its own SeaweedFS server configured with two
identities, one of them read-only (SeaweedFS reads identities at startup only).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from botocore.config import Config
from cli_support import assert_one_error_line, invoke, parse_json

from s3kv.storage import S3Backend
from s3kv.testing import local_s3
from s3kv.testing._procutil import alive
from s3kv.testing.local_s3 import LocalS3, free_port, stop_from_state

READ_ONLY = ("s3kv-reader", "reader-secret-0123456789")


def _checks(doc: dict[str, object]) -> dict[str, dict[str, object]]:
    return {c["name"]: c for c in doc["checks"]}  # type: ignore[attr-defined,index]


def test_doctor_all_good_on_moto(moto_backend: S3Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TLLM_S3KV_PREFIX", "team-a/kv")
    endpoint = str(moto_backend.client.meta.endpoint_url)
    result = invoke(["doctor", "--json", "--bucket", moto_backend.bucket,
                     "--endpoint-url", endpoint])  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = parse_json(result)
    checks = _checks(doc)
    assert [checks[n]["status"] for n in ("bucket", "list", "put", "get", "delete")] == ["ok"] * 5
    assert checks["conditional write"]["status"] == "ok"  # moto answers 412
    assert "from env" in str(checks["credentials"]["detail"])
    assert checks["latency"]["latency_ms"] is not None
    sources = {s["name"]: s["source"] for s in doc["settings"]}
    assert sources["prefix"] == "env TLLM_S3KV_PREFIX"
    assert sources["bucket"] == sources["endpoint_url"] == "command line"
    assert sources["io_threads"] == "default"
    assert "testing-secret" not in result.output  # the secret key never appears
    # The scratch object is gone.
    assert not list(moto_backend.list("team-a/kv/"))
    human = invoke(["doctor", "--bucket", moto_backend.bucket, "--endpoint-url", endpoint])
    assert human.exit_code == 0
    assert "conditional write" in human.stdout


def test_doctor_reports_a_wrong_endpoint(aws_env: None) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    result = invoke(["doctor", "--json", "--bucket", "b-x", "--endpoint-url", dead])
    assert result.exit_code == 1
    checks = _checks(parse_json(result))
    assert checks["bucket"]["status"] == "fail"
    assert "cannot reach" in str(checks["bucket"]["detail"])
    assert "TLLM_S3KV_ENDPOINT_URL" in str(checks["bucket"]["remedy"])
    assert checks["permissions"]["status"] == "skip"
    assert_one_error_line(result, "failed checks: bucket")


def test_doctor_reports_a_bad_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TLLM_S3KV_IO_THREADS", "many")
    result = invoke(["doctor", "--json", "--bucket", "b-x"])
    assert result.exit_code == 1
    (check,) = parse_json(result)["checks"]
    assert check["status"] == "fail"
    assert "io_threads" in check["detail"]


@pytest.fixture(scope="module")
def two_identity_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalS3]:
    """A SeaweedFS server with an admin identity and a read-only one."""

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
        server = LocalS3.start(
            tmp_path_factory.mktemp("weed-ro"),
            access_key="s3kv-admin",
            secret_key="admin-secret-0123456789",
            die_with_parent=True,
        )
    try:
        yield server
    finally:
        server.stop(grace=2.0)


@pytest.mark.seaweedfs
def test_doctor_reports_denied_permissions(
    two_identity_server: LocalS3, aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", READ_ONLY[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", READ_ONLY[1])
    args = ["--bucket", two_identity_server.bucket, "--endpoint-url",
            two_identity_server.endpoint]  # fmt: skip
    result = invoke(["doctor", "--json", *args])
    assert result.exit_code == 1, result.output
    checks = _checks(parse_json(result))
    assert (checks["bucket"]["status"], checks["list"]["status"]) == ("ok", "ok")
    assert checks["get"]["status"] == "ok"
    assert checks["put"]["status"] == checks["delete"]["status"] == "fail"
    assert "s3:PutObject" in str(checks["put"]["remedy"])
    assert "s3:DeleteObject" in str(checks["delete"]["remedy"])
    assert checks["conditional write"]["status"] == "skip"
    assert READ_ONLY[1] not in result.output
    human = invoke(["doctor", *args])
    assert "FAIL put: grant s3:PutObject" in human.stdout


@pytest.mark.seaweedfs
def test_local_s3_starts_serves_and_stops(tmp_path: Path) -> None:
    data = tmp_path / "local"
    started = invoke(["local-s3", "start", "--dir", str(data)])
    try:
        assert started.exit_code == 0, started.output
        exports = dict(
            line.removeprefix("export ").split("=", 1)
            for line in started.stdout.splitlines() if line.startswith("export ")
        )  # fmt: skip
        status = parse_json(invoke(["local-s3", "status", "--json", "--dir", str(data)]))
        assert status["running"]
        assert status["answering"]
        pid = int(status["pid"])

        # It serves: a PUT and GET with the exported settings.
        client = boto3.client(
            "s3", endpoint_url=exports["AWS_ENDPOINT_URL_S3"], region_name="us-east-1",
            aws_access_key_id=exports["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=exports["AWS_SECRET_ACCESS_KEY"],
            config=Config(s3={"addressing_style": "path"}),
        )  # fmt: skip
        client.put_object(Bucket=exports["TLLM_S3KV_BUCKET"], Key="k", Body=b"v")
        assert client.get_object(Bucket="s3kv", Key="k")["Body"].read() == b"v"

        stopped = invoke(["local-s3", "stop", "--grace", "2", "--json", "--dir", str(data)])
        assert parse_json(stopped)["stopped"] is True
        assert not alive(pid)  # no process left behind
        after = invoke(["local-s3", "status", "--dir", str(data)])
        assert after.exit_code == 1
        assert "not running" in after.stdout
    finally:
        stop_from_state(data, grace=0)


@pytest.mark.seaweedfs
def test_local_s3_unreadable_state_is_one_error_line(tmp_path: Path) -> None:
    data = tmp_path / "local"
    data.mkdir()
    (data / local_s3.STATE_FILE).write_text("{not json")
    assert_one_error_line(invoke(["local-s3", "start", "--dir", str(data)]), "delete it")
