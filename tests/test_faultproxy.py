"""The fault-injecting proxy itself (``s3kv.testing.faultproxy``).

Byte-level behaviour is checked against a tiny stdlib upstream that remembers what reached
it; the S3 behaviour (signatures, keep-alive, error translation) against SeaweedFS through
the ``fault_proxy`` fixture.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest
from conftest import BucketProxy

from s3kv.errors import EndpointError, StorageError, ThrottledError
from s3kv.testing.faultproxy import Fault, FaultKind, FaultProxy

BODY = bytes(range(256)) * 16


class Upstream(ThreadingHTTPServer):
    """Stores PUT bodies by path, serves them on GET/HEAD; notes what each PUT delivered."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.objects: dict[str, bytes] = {}
        self.received: list[tuple[str, int, int]] = []  # (path, Content-Length, bytes got)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Upstream

    def do_GET(self) -> None:
        body = self.server.objects.get(urlsplit(self.path).path)
        self.send_response(404 if body is None else 200)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body or b"")

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_PUT(self) -> None:
        length = int(self.headers["Content-Length"])
        body = self.rfile.read(length)
        path = urlsplit(self.path).path
        self.server.received.append((path, length, len(body)))
        if len(body) < length:  # the client went away mid-body: store nothing
            self.close_connection = True
            return
        self.server.objects[path] = body
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    server = Upstream()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.objects["/obj"] = BODY
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def proxy(upstream: Upstream) -> Iterator[FaultProxy]:
    proxy = FaultProxy(upstream.endpoint, seed=3).start()
    try:
        yield proxy
    finally:
        assert proxy.close()


def connect(proxy: FaultProxy, timeout: float = 5.0) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=timeout)


def fetch(conn: http.client.HTTPConnection, path: str = "/obj") -> tuple[int, bytes]:
    conn.request("GET", path)
    response = conn.getresponse()
    return response.status, response.read()


def proxy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("faultproxy")]


# --- pass-through ---


def test_pass_through_keeps_the_connection_alive_and_records_requests(
    proxy: FaultProxy, upstream: Upstream
) -> None:
    conn = connect(proxy)
    conn.request("PUT", "/new?tag=1", body=b"payload")
    assert conn.getresponse().read() == b""
    for _ in range(3):
        assert fetch(conn, "/new") == (200, b"payload")
    conn.request("HEAD", "/obj")
    head = conn.getresponse()
    assert head.getheader("Content-Length") == str(len(BODY))
    assert head.read() == b""
    assert fetch(conn, "/missing")[0] == 404
    assert proxy.connections == 1  # one client connection served all six requests
    assert [(r.method, r.path, r.query, r.status, r.fault) for r in proxy.records] == [
        ("PUT", "/new", "tag=1", 200, None),
        *[("GET", "/new", "", 200, None)] * 3,
        ("HEAD", "/obj", "", 200, None),
        ("GET", "/missing", "", 404, None),
    ]


def test_expect_continue_and_chunked_uploads_are_forwarded(
    proxy: FaultProxy, upstream: Upstream
) -> None:
    conn = connect(proxy)
    conn.putrequest("PUT", "/chunked")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.putheader("Expect", "100-continue")
    conn.endheaders()
    conn.send(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
    assert conn.getresponse().status == 200  # http.client skips the interim 100
    assert upstream.objects["/chunked"] == b"hello world"


def test_an_unreachable_upstream_answers_502() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed below: nothing listens there
    with FaultProxy(f"http://127.0.0.1:{port}").start() as proxy:
        status, body = fetch(connect(proxy))
    assert status == 502
    assert b"<Code>BadGateway</Code>" in body


# --- rules ---


def test_rules_match_method_path_and_query_and_run_out(
    proxy: FaultProxy, upstream: Upstream
) -> None:
    rule = proxy.add(Fault.error(503), method="get", path=r"^/obj$", query=r"x=1", times=2)
    conn = connect(proxy)
    assert fetch(conn, "/obj")[0] == 200  # no query: no match
    conn.request("HEAD", "/obj?x=1")
    head = conn.getresponse()
    head.read()
    assert head.status == 200  # another method
    assert [fetch(conn, "/obj?x=1")[0] for _ in range(3)] == [503, 503, 200]  # times=2
    assert rule.applied == 2
    assert not rule.active
    faulted = [r for r in proxy.records if r.fault is not None]
    assert [(r.status, r.fault) for r in faulted] == [(503, FaultKind.ERROR)] * 2


def test_probability_draws_from_the_seeded_rng(upstream: Upstream) -> None:
    def pattern(seed: int) -> list[int]:
        with FaultProxy(upstream.endpoint, seed=seed).start() as proxy:
            proxy.add(Fault.error(500), probability=0.5)
            conn = connect(proxy)
            return [fetch(conn)[0] for _ in range(20)]

    first = pattern(7)
    assert first == pattern(7)
    assert set(first) == {200, 500}


def test_the_first_matching_rule_wins_and_removed_rules_stop(proxy: FaultProxy) -> None:
    first = proxy.add(Fault.error(500), path="/obj")
    proxy.add(Fault.error(503))
    conn = connect(proxy)
    assert fetch(conn)[0] == 500
    proxy.remove(first)
    assert fetch(conn)[0] == 503
    proxy.clear()
    assert fetch(conn)[0] == 200


def test_error_bodies_are_s3_xml(proxy: FaultProxy) -> None:
    conn = connect(proxy)
    with proxy.injected(Fault.error(503)):
        status, body = fetch(conn)
    assert status == 503
    assert b"<Code>SlowDown</Code>" in body
    with proxy.injected(Fault.error(500)):
        assert b"<Code>InternalError</Code>" in fetch(conn)[1]
    assert fetch(conn) == (200, BODY)  # the connection stays usable after an error


def test_upstream_first_lets_the_request_land(proxy: FaultProxy, upstream: Upstream) -> None:
    conn = connect(proxy)
    with proxy.injected(Fault.error(503, upstream=True)):
        conn.request("PUT", "/landed", body=b"x")
        assert conn.getresponse().status == 503
    assert upstream.objects["/landed"] == b"x"


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: Fault.error(42), "status"),
        (lambda: Fault.delay(-1), "seconds"),
        (lambda: Fault.cut(keep=1.5), "keep"),
        (lambda: Fault.corrupt(flips=0), "flips"),
    ],
    ids=["status", "seconds", "keep", "flips"],
)
def test_a_bad_fault_names_its_field(make: Callable[[], Fault], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        make()


def test_a_bad_rule_names_its_field(proxy: FaultProxy) -> None:
    with pytest.raises(ValueError, match=r"^times: "):
        proxy.add(Fault.reset(), times=-1)
    with pytest.raises(ValueError, match=r"^probability: "):
        proxy.add(Fault.reset(), probability=2)
    assert fetch(connect(proxy)) == (200, BODY)  # neither was added


# --- broken bodies ---


def test_cut_response_sends_the_real_length_and_part_of_the_body(proxy: FaultProxy) -> None:
    conn = connect(proxy)
    with proxy.injected(Fault.cut(keep=0.25)):
        conn.request("GET", "/obj")
        response = conn.getresponse()
        assert response.getheader("Content-Length") == str(len(BODY))
        with pytest.raises(http.client.IncompleteRead) as err:
            response.read()
    assert len(err.value.partial) == len(BODY) // 4
    assert fetch(connect(proxy)) == (200, BODY)


def test_cut_upload_reaches_the_upstream_in_part(proxy: FaultProxy, upstream: Upstream) -> None:
    conn = connect(proxy)
    with proxy.injected(Fault.cut(keep=0.5), method="PUT"):
        conn.request("PUT", "/half", body=BODY)
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
            conn.getresponse()
    deadline = time.monotonic() + 5
    while not upstream.received and time.monotonic() < deadline:
        time.sleep(0.01)
    assert upstream.received == [("/half", len(BODY), len(BODY) // 2)]
    assert "/half" not in upstream.objects


def test_corrupt_flips_bytes_and_keeps_the_length(proxy: FaultProxy, upstream: Upstream) -> None:
    conn = connect(proxy)
    with proxy.injected(Fault.corrupt(flips=3)):
        status, body = fetch(conn)
    assert status == 200
    assert len(body) == len(BODY)
    assert sum(a != b for a, b in zip(body, BODY, strict=True)) == 3
    with proxy.injected(Fault.corrupt(), method="PUT"):  # an upload is corrupted on its way
        conn.request("PUT", "/up", body=BODY)
        assert conn.getresponse().status == 200
    stored = upstream.objects["/up"]
    assert len(stored) == len(BODY)
    assert stored != BODY


def test_truncate_shortens_the_body_consistently(proxy: FaultProxy, upstream: Upstream) -> None:
    conn = connect(proxy)
    with proxy.injected(Fault.truncate(keep=0.5)):
        assert fetch(conn) == (200, BODY[: len(BODY) // 2])
        conn.request("PUT", "/short", body=BODY)
        assert conn.getresponse().status == 200
    assert upstream.objects["/short"] == BODY[: len(BODY) // 2]


# --- broken connections ---


def test_reset_aborts_the_connection(proxy: FaultProxy) -> None:
    with proxy.injected(Fault.reset()), pytest.raises(ConnectionResetError):
        fetch(connect(proxy))
    assert fetch(connect(proxy)) == (200, BODY)
    assert [r.fault for r in proxy.records] == [FaultKind.RESET, None]


def test_delay_past_the_client_timeout_then_pass(proxy: FaultProxy) -> None:
    with proxy.injected(Fault.delay(2.0), times=1):
        with pytest.raises(TimeoutError):
            fetch(connect(proxy, timeout=0.3))
        assert fetch(connect(proxy)) == (200, BODY)  # times=1: the next one passes


def test_latency_delays_every_request(proxy: FaultProxy) -> None:
    proxy.latency = 0.2
    conn = connect(proxy)
    start = time.monotonic()
    for _ in range(2):
        assert fetch(conn) == (200, BODY)
    assert time.monotonic() - start >= 0.4
    assert all(r.fault is None for r in proxy.records)


def test_blackhole_holds_until_removed(proxy: FaultProxy) -> None:
    rule = proxy.add(Fault.blackhole(), path="/obj")
    with pytest.raises(TimeoutError):
        fetch(connect(proxy, timeout=0.3))
    assert [(r.status, r.fault) for r in proxy.records] == [(None, FaultKind.BLACKHOLE)]
    assert len(proxy_threads()) == 2  # the acceptor and the held connection
    proxy.remove(rule)
    deadline = time.monotonic() + 5
    while len(proxy_threads()) > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(proxy_threads()) == 1  # released: the held connection ended
    assert fetch(connect(proxy)) == (200, BODY)


def test_close_releases_blackholes_and_delays_and_joins_every_thread(upstream: Upstream) -> None:
    proxy = FaultProxy(upstream.endpoint).start()
    proxy.add(Fault.blackhole(), path="/obj")
    proxy.add(Fault.delay(60), path="/other")
    idle = connect(proxy)
    assert fetch(idle, "/missing")[0] == 404  # an idle kept-alive connection
    held = []
    for path in ("/obj", "/other"):
        conn = connect(proxy, timeout=0.2)
        with pytest.raises(TimeoutError):
            fetch(conn, path)
        held.append(conn)
    assert len(proxy_threads()) == 4
    start = time.monotonic()
    assert proxy.close()
    assert time.monotonic() - start < 5  # bounded (the join limit), not the 60 s delay
    assert proxy_threads() == []


# --- S3 through the proxy ---

#: A read timeout that a loaded machine does not reach by accident.
PATIENT = 10.0


def test_boto3_signatures_and_keep_alive_pass_through(fault_proxy: BucketProxy) -> None:
    backend = fault_proxy.backend(read_timeout=PATIENT)
    backend.put("k/one", b"1")
    assert backend.get("k/one") == b"1"
    assert backend.head("k/one") is not None
    assert [info.key for info in backend.list("k/")] == ["k/one"]
    assert backend.get("k/none") is None
    assert fault_proxy.connections == 1
    assert len(fault_proxy.records) == 5


@pytest.mark.parametrize(
    ("fault", "error", "words"),
    [
        (Fault.error(503), ThrottledError, "SlowDown"),
        (Fault.error(500), StorageError, "server error"),
        (Fault.reset(), EndpointError, "cannot reach"),
        (Fault.cut(), EndpointError, "cannot reach"),
        (Fault.delay(3.0), EndpointError, "timed out"),
        (Fault.blackhole(), EndpointError, "timed out"),
    ],
    ids=["503", "500", "reset", "cut", "delay", "blackhole"],
)
def test_faults_reach_s3kv_as_storage_errors(
    fault_proxy: BucketProxy, fault: Fault, error: type[StorageError], words: str
) -> None:
    fault_proxy.backend(direct=True).put("obj", BODY)
    timeouts = fault.kind in (FaultKind.DELAY, FaultKind.BLACKHOLE)
    backend = fault_proxy.backend(read_timeout=1.0 if timeouts else PATIENT)
    with fault_proxy.injected(fault, method="GET"), pytest.raises(error, match=words):
        backend.get("obj")
    assert fault_proxy.backend(read_timeout=PATIENT).get("obj") == BODY  # passes again
