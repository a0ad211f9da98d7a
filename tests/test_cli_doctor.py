"""``s3kv doctor`` and ``s3kv local-s3`` through the CLI runner.

The denied-permission case runs against its own SeaweedFS server configured with two
identities, one of them read-only (SeaweedFS reads identities at startup only).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from cli_support import READ_ONLY, assert_one_error_line, invoke, parse_json

from s3kv.storage import S3Backend
from s3kv.testing import local_s3
from s3kv.testing._procutil import alive
from s3kv.testing.local_s3 import LocalS3, free_port, stop_from_state


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
    assert result.exit_code == 2  # a settings error, as for every command
    (check,) = parse_json(result)["checks"]
    assert check["status"] == "fail"
    assert "io_threads" in check["detail"]


def test_doctor_prints_brackets_in_settings_and_messages_as_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # rich parsed "[/x]" in a table cell as a closing tag and crashed with a traceback.
    monkeypatch.setenv("TLLM_S3KV_BUCKET", "[/x]")
    monkeypatch.setenv("TLLM_S3KV_PREFIX", "[bold]p")
    result = invoke(["doctor"])
    assert "Traceback" not in result.output
    assert "[/x]" in result.output
    assert_one_error_line(result, "failed checks: settings", code=2)


@pytest.mark.seaweedfs
def test_doctor_reports_denied_permissions(
    read_only_seaweedfs: LocalS3, aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", READ_ONLY[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", READ_ONLY[1])
    args = ["--bucket", read_only_seaweedfs.bucket, "--endpoint-url",
            read_only_seaweedfs.endpoint]  # fmt: skip
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


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A loopback TCP server that accepts connections and never answers."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        for conn in held:
            conn.close()
        server.close()


def test_doctor_gives_up_on_a_silent_endpoint_within_its_deadline(
    silent_endpoint: str, aws_env: None
) -> None:
    # NOTE: 10 s: on a loaded CI machine the credential chain alone took over 3 s of a 4 s
    # deadline; the bucket probe is sized to what is left (see the test below).
    args = ["doctor", "--timeout", "10", "--bucket", "b-x", "--endpoint-url", silent_endpoint]
    start = time.monotonic()
    human = invoke(args)
    assert time.monotonic() - start < 10 + 3
    assert human.exit_code == 1, human.output
    # Progress on stderr, a line as each step starts and ends; the failure in one line.
    progress = [line for line in human.stderr.splitlines() if line.startswith("doctor: ")]
    assert f"doctor: bucket: reaching s3://b-x/s3kv at {silent_endpoint} ..." in progress
    (failed,) = [line for line in progress if line.startswith("doctor: bucket: FAIL")]
    assert f"{silent_endpoint} accepted the connection but sent no answer" in failed
    last = human.stderr.splitlines()[-1]
    assert last.startswith(f"Error: failed checks: bucket at {silent_endpoint}")

    # With --json: the same verdict, and nothing on stderr but the one error line.
    start = time.monotonic()
    result = invoke([*args, "--json"])
    assert time.monotonic() - start < 10 + 3
    doc = parse_json(result)
    assert (doc["endpoint"], doc["timeout_s"]) == (silent_endpoint, 10.0)
    bucket = _checks(doc)["bucket"]
    assert bucket["status"] == "fail"
    assert silent_endpoint in str(bucket["detail"])
    assert "\n" not in str(bucket["detail"])
    assert _checks(doc)["permissions"]["status"] == "skip"
    assert_one_error_line(result, "failed checks: bucket", silent_endpoint)


def test_a_slow_credential_chain_still_leaves_a_diagnosis(
    silent_endpoint: str, aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bucket step's requests are sized to what the earlier steps left of the deadline,
    so a silent endpoint is still named as such (not a bare overrun) after a slow step."""
    from s3kv.ops import doctor

    real = doctor._credentials

    def slow(run: Any) -> Any:
        time.sleep(3.5)
        return real(run)

    monkeypatch.setattr(doctor, "_credentials", slow)
    human = invoke(
        ["doctor", "--timeout", "6", "--bucket", "b-x", "--endpoint-url", silent_endpoint]
    )
    assert human.exit_code == 1, human.output
    (failed,) = [line for line in human.stderr.splitlines() if "doctor: bucket: FAIL" in line]
    assert f"{silent_endpoint} accepted the connection but sent no answer within" in failed


def test_doctor_shows_the_effective_endpoint_and_region(
    moto_backend: S3Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = str(moto_backend.client.meta.endpoint_url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-central-1")
    result = invoke(["doctor", "--json", "--role", "reader", "--bucket", moto_backend.bucket])
    assert result.exit_code == 0, result.output
    doc = parse_json(result)
    assert (doc["endpoint"], doc["region"], doc["role"]) == (endpoint, "eu-central-1", "reader")
    effective = {s["name"]: (s["value"], s["source"]) for s in doc["settings"]}
    assert effective["endpoint (effective)"] == (endpoint, "env AWS_ENDPOINT_URL_S3")
    assert effective["region (effective)"] == ("eu-central-1", "env AWS_DEFAULT_REGION")
    human = invoke(["doctor", "--role", "reader", "--bucket", moto_backend.bucket])
    assert human.exit_code == 0, human.output
    assert "region (effective)" in human.stdout
    assert f"doctor: endpoint {endpoint}, region eu-central-1, role reader" in human.stderr


@pytest.mark.seaweedfs
@pytest.mark.parametrize(
    ("key_id", "secret", "says"),
    [
        ("seaweed", "wrong-secret-0123456789", "wrong secret key for access key id"),
        ("AKIAUNKNOWNKEY000001", "whatever-secret-0123456789", "unknown access key id"),
    ],
)
def test_doctor_tells_a_wrong_secret_from_an_unknown_key_id(
    seaweedfs: LocalS3,
    aws_env: None,
    monkeypatch: pytest.MonkeyPatch,
    key_id: str,
    secret: str,
    says: str,
) -> None:
    key_id = seaweedfs.access_key if key_id == "seaweed" else key_id
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    args = ["--bucket", seaweedfs.bucket, "--endpoint-url", seaweedfs.endpoint]
    result = invoke(["doctor", "--json", *args])
    assert result.exit_code == 1, result.output
    bucket = _checks(parse_json(result))["bucket"]
    detail, remedy = str(bucket["detail"]), str(bucket["remedy"])
    assert bucket["status"] == "fail"
    assert detail.startswith(says), detail
    assert key_id[-4:] in detail
    assert key_id not in detail  # masked
    assert seaweedfs.endpoint in detail
    code = "SignatureDoesNotMatch" if "secret" in says else "InvalidAccessKeyId"
    assert f"({code})" in detail
    assert ("AWS_SECRET_ACCESS_KEY" in remedy) == (code == "SignatureDoesNotMatch")
    assert secret not in result.output
    assert seaweedfs.secret_key not in result.output
    human = invoke(["doctor", *args])
    (line,) = [x for x in human.stdout.splitlines() if x.startswith("FAIL bucket: ")]
    assert line == f"FAIL bucket: {remedy}"


@pytest.mark.seaweedfs
def test_doctor_passes_a_read_only_identity_for_the_reader_role(
    read_only_seaweedfs: LocalS3, aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", READ_ONLY[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", READ_ONLY[1])
    args = ["--bucket", read_only_seaweedfs.bucket, "--endpoint-url",
            read_only_seaweedfs.endpoint]  # fmt: skip
    reader = invoke(["doctor", "--json", "--role", "reader", *args])
    assert reader.exit_code == 0, reader.output
    checks = _checks(parse_json(reader))
    assert [checks[n]["status"] for n in ("bucket", "list", "get", "latency")] == ["ok"] * 4
    assert [checks[n]["status"] for n in ("put", "delete", "conditional write")] == ["skip"] * 3
    engine = invoke(["doctor", "--json", "--role", "engine", *args])
    assert engine.exit_code == 1
    checks = _checks(parse_json(engine))
    assert checks["put"]["status"] == checks["delete"]["status"] == "fail"
    assert "engines write blocks and manifest segments" in str(checks["put"]["remedy"])
    assert "/manifest/*" in str(checks["delete"]["remedy"])  # an engine deletes only those
