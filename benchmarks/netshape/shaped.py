"""``ShapedS3``: SeaweedFS in a private namespace behind a shaped veth and a delay line."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from netshape.plumbing import (
    LINK_PREFIX,
    NS_PREFIX,
    SUBNET,
    TMP_PREFIX,
    LinkSpec,
    NetShapeError,
    die_with_parent,
    free_ports,
    free_subnet,
    remove_stale,
    run,
    tbf,
)

_CHUNK = 1 << 20
_RELAY = Path(__file__).resolve().with_name("relay.py")


@dataclass
class ShapedS3:
    """SeaweedFS in a private namespace behind a shaped veth and a delay line.

    Use as a context manager (or :meth:`start` / :meth:`stop`). :meth:`env` points boto3
    and s3kv at it; :attr:`host_link` is the veth whose counters count the wire bytes.
    """

    link: LinkSpec
    bucket: str = "wan"
    timeout: float = 60.0
    ns: str = ""
    host_link: str = ""
    ns_link: str = ""
    client_ip: str = ""
    server_ip: str = ""
    s3_port: int = 0
    test_port: int = 0
    data_dir: Path | None = None
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)
    _weed_ports: list[int] = field(default_factory=list, repr=False)
    _stopped: bool = field(default=False, repr=False)

    @property
    def endpoint(self) -> str:
        return f"http://{self.server_ip}:{self.s3_port}"

    def env(self) -> dict[str, str]:
        """Environment for boto3 and s3kv (open-mode server: any credentials work)."""
        from s3kv.testing.local_s3 import OPEN_ACCESS_KEY, OPEN_SECRET_KEY

        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ACCESS_KEY_ID": OPEN_ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": OPEN_SECRET_KEY,
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "TLLM_S3KV_BUCKET": self.bucket,
            "TLLM_S3KV_ENDPOINT_URL": self.endpoint,
            "TLLM_S3KV_ADDRESSING_STYLE": "path",
        }

    def start(self) -> ShapedS3:
        """Build the namespace, veth, shaping, server and relay; wait until a PUT works.

        Raises:
            NetShapeError: not root, or a plumbing command failed (the message names it).
        """
        if os.geteuid() != 0:
            raise NetShapeError("needs root for network namespaces")
        remove_stale()
        atexit.register(self.stop)
        try:
            self._plumb()
            self._spawn()
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _plumb(self) -> None:
        pid, k = os.getpid(), free_subnet()
        self.ns = f"{NS_PREFIX}{pid}-{k}"
        self.host_link, self.ns_link = f"{LINK_PREFIX}{pid}h", f"{LINK_PREFIX}{pid}n"
        self.client_ip, self.server_ip = f"{SUBNET}.{k}.1", f"{SUBNET}.{k}.2"
        run("ip", "netns", "add", self.ns)
        run("ip", "link", "add", self.host_link, "type", "veth", "peer", "name", self.ns_link)
        run("ip", "link", "set", self.ns_link, "netns", self.ns)
        run("ip", "addr", "add", f"{self.client_ip}/30", "dev", self.host_link)
        run("ip", "link", "set", self.host_link, "up")
        run("ip", "-n", self.ns, "addr", "add", f"{self.server_ip}/30", "dev", self.ns_link)
        run("ip", "-n", self.ns, "link", "set", self.ns_link, "up")
        run("ip", "-n", self.ns, "link", "set", "lo", "up")
        run("tc", "qdisc", "replace", "dev", self.host_link, "root", *tbf(self.link))
        run("tc", "-n", self.ns, "qdisc", "replace", "dev", self.ns_link, "root",
             *tbf(self.link))  # fmt: skip

    def _spawn(self) -> None:
        from s3kv.testing.local_s3 import find_weed_binary

        # NOTE: the namespace's ports are private, but weed names Unix sockets in the shared
        # /tmp after its ports; ports free on the host keep those names from colliding.
        ports = free_ports(10)
        self._weed_ports = ports[:8]
        self.s3_port, self.test_port = ports[8], ports[9]
        master, mgrpc, volume, vgrpc, filer, fgrpc, s3grpc, weed_s3 = self._weed_ports
        self.data_dir = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-"))
        weed = [
            str(find_weed_binary()), "server", f"-dir={self.data_dir}", "-filer", "-s3",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-master.port.grpc={mgrpc}",
            f"-volume.port={volume}", f"-volume.port.grpc={vgrpc}",
            f"-filer.port={filer}", f"-filer.port.grpc={fgrpc}",
            f"-s3.port={weed_s3}", f"-s3.port.grpc={s3grpc}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
            "-volume.max=0", "-master.volumeSizeLimitMB=256", "-volume.preStopSeconds=0",
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env["WEED_MASTER_VOLUME_GROWTH_COPY_1"] = "1"
        relay = [
            sys.executable, str(_RELAY),
            "--listen", self.server_ip, "--s3-port", str(self.s3_port),
            "--upstream-port", str(weed_s3), "--test-port", str(self.test_port),
            "--delay-ms", str(self.link.rtt_ms / 2), "--window", str(self.link.window),
        ]  # fmt: skip
        with open(self.data_dir / "weed.log", "ab") as log:
            for argv in (weed, relay):
                self._procs.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", self.ns, *argv],
                        cwd=self.data_dir,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # NOTE: Ctrl-C reaches us, and we stop them.
                        preexec_fn=die_with_parent,  # noqa: PLW1509
                    )
                )

    def _wait_ready(self) -> None:
        from s3kv.config import S3KVConfig
        from s3kv.errors import StorageError
        from s3kv.storage import FOREIGN_ERRORS, ensure_bucket, make_client
        from s3kv.testing.local_s3 import OPEN_ACCESS_KEY, OPEN_SECRET_KEY

        cfg = S3KVConfig(bucket=self.bucket, endpoint_url=self.endpoint, region="us-east-1",
                         addressing_style="path", connect_timeout=1.0, read_timeout=5.0,
                         max_attempts=1)  # fmt: skip
        client = make_client(cfg, access_key=OPEN_ACCESS_KEY, secret_key=OPEN_SECRET_KEY)
        retryable: tuple[type[BaseException], ...] = (StorageError, *FOREIGN_ERRORS)
        deadline, last = time.monotonic() + self.timeout, "no answer yet"
        try:
            while time.monotonic() < deadline:
                for name, proc in zip(("weed", "relay"), self._procs, strict=True):
                    if proc.poll() is not None:
                        raise NetShapeError(f"{name} exited: {self._log_tail()}")
                try:
                    ensure_bucket(client, self.bucket)
                    client.put_object(Bucket=self.bucket, Key=".ready", Body=b"")
                    client.delete_object(Bucket=self.bucket, Key=".ready")
                    return
                except retryable as exc:
                    last = f"{type(exc).__name__}: {exc}"
                time.sleep(0.2)
        finally:
            client.close()
        raise NetShapeError(f"S3 behind the shaped link not ready ({last}): {self._log_tail()}")

    def _log_tail(self) -> str:
        if self.data_dir is None:
            return "(no log)"
        with contextlib.suppress(OSError):
            return " | ".join((self.data_dir / "weed.log").read_text().splitlines()[-6:])
        return "(no log)"

    def stop(self) -> None:
        """Stop the relay and server (own pids only), delete the namespace and veth. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in reversed(self._procs):
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if self.ns:
            with contextlib.suppress(NetShapeError):
                run("ip", "netns", "del", self.ns)
        if self.host_link:
            with contextlib.suppress(NetShapeError):
                if self.host_link in run("ip", "-o", "link", "show"):
                    run("ip", "link", "del", self.host_link)
        for port in self._weed_ports:
            for service in ("master-grpc", "volume-grpc", "s3", "s3-grpc", "filer", "filer-grpc"):
                with contextlib.suppress(OSError):
                    Path(f"/tmp/seaweedfs-{service}-{port}.sock").unlink()
        if self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)

    def __enter__(self) -> ShapedS3:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # --- verification: through the same relay and shaped veth ---------------------------

    def wire_bytes(self) -> tuple[int, int]:
        """(sent, received) bytes on the host veth: client → server and server → client."""
        stats = Path(f"/sys/class/net/{self.host_link}/statistics")
        return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())

    def losses(self) -> tuple[int, int, int]:
        """So far: packets tbf dropped on the upload queue (client → server) and on the
        download queue, and TCP segments this (the client's) namespace retransmitted. A
        saturated queue that drops shows here; each drop of a segment can stall its
        connection for TCP's 200 ms minimum retransmission timeout."""
        up = _tbf_dropped(["tc", "-s", "qdisc", "show", "dev", self.host_link])
        down = _tbf_dropped(["tc", "-n", self.ns, "-s", "qdisc", "show", "dev", self.ns_link])
        return up, down, _retransmitted()

    def process_cpu(self) -> dict[str, float]:
        """CPU seconds used so far by the S3 server (``server``) and the relay (``relay``)."""
        tick = os.sysconf("SC_CLK_TCK")
        used = {}
        for name, proc in zip(("server", "relay"), self._procs, strict=False):
            try:
                stat = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            used[name] = (int(stat[11]) + int(stat[12])) / tick  # utime + stime
        return used

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self.server_ip, self.test_port), timeout=30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def measure_rtt(self, count: int = 20) -> float:
        """Median round trip of a 1-byte ping through the relay, in ms."""
        with self._connect() as sock:
            samples = []
            for _ in range(count + 1):
                started = time.perf_counter()
                sock.sendall(b"p")
                if sock.recv(1) != b"p":
                    raise NetShapeError("test service answered a ping wrongly")
                samples.append((time.perf_counter() - started) * 1e3)
        samples = sorted(samples[1:])  # the first includes the relay's upstream connect
        return samples[len(samples) // 2]

    def measure_bulk(self, direction: str, nbytes: int, streams: int = 4) -> float:
        """Gbit/s of ``nbytes`` moved raw over ``streams`` connections; ``direction`` is
        ``"down"`` (server → client, as GET bodies) or ``"up"`` (as PUT bodies)."""
        per_stream = nbytes // streams
        socks = [self._connect() for _ in range(streams)]
        errors: list[BaseException] = []

        def one(sock: socket.socket) -> None:
            try:
                if direction == "down":
                    sock.sendall(b"d" + per_stream.to_bytes(8, "big"))
                    buf, left = bytearray(_CHUNK), per_stream
                    while left:
                        got = sock.recv_into(buf, min(left, _CHUNK))
                        if not got:
                            raise NetShapeError("test service closed mid-transfer")
                        left -= got
                else:
                    sock.sendall(b"u" + per_stream.to_bytes(8, "big"))
                    chunk, left = memoryview(bytes(_CHUNK)), per_stream
                    while left:
                        left -= sock.send(chunk[: min(left, _CHUNK)])
                    if sock.recv(1) != b"k":
                        raise NetShapeError("test service did not acknowledge the upload")
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(s,)) for s in socks]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - started
        for sock in socks:
            sock.close()
        if errors:
            raise errors[0]
        return per_stream * streams * 8 / elapsed / 1e9


def _tbf_dropped(command: list[str]) -> int:
    """Packets dropped so far by the qdiscs ``tc -s qdisc show`` lists (-1: unreadable)."""
    try:
        text = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return -1
    return sum(int(n) for n in re.findall(r"dropped (\d+)", text))


def _retransmitted() -> int:
    """TCP segments this network namespace has retransmitted (``RetransSegs``; -1: unknown)."""
    try:
        lines = [line.split() for line in Path("/proc/net/snmp").read_text().splitlines()]
    except OSError:
        return -1
    names, values = [row for row in lines if row and row[0] == "Tcp:"][:2]
    return int(values[names.index("RetransSegs")])
