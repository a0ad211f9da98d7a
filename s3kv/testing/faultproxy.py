"""A fault-injecting HTTP/1.1 reverse proxy: a hostile network between s3kv and an S3 server.

:class:`FaultProxy` listens on ``127.0.0.1`` (an OS-chosen port) in front of one upstream
``http://host:port`` endpoint (a local SeaweedFS, moto) and forwards every request,
unchanged (the ``Host`` header too, so SigV4 signatures still verify), over one upstream
connection per client connection. Client connections are kept alive as long as the client
wants (boto3 reuses them); a fault that breaks a connection closes it, as a real network
would. Stdlib only (the wire format lives in :mod:`s3kv.testing._wire`)::

    with FaultProxy("http://127.0.0.1:8333", seed=7).start() as proxy:
        rule = proxy.add(Fault.error(503), method="GET", path=r"/blocks/", times=3)
        ...  # point the client at proxy.endpoint
        assert rule.applied == 3
        proxy.remove(rule)

Contract:

* **Rules** (:meth:`FaultProxy.add`) match a request by method, a regex searched in the raw
  path and, optionally, one searched in the raw query string. The first active rule that
  matches, and fires (``probability``, drawn from the proxy's seeded RNG), decides the
  request's fate; ``times`` bounds how many requests a rule applies to (``None``: until
  removed). Rules change at runtime, from any thread.
* **Faults** (:class:`Fault`): ``error`` answers a status code with an S3 XML error body
  (503 ``SlowDown``, 500 ``InternalError``...) without asking the upstream; ``delay`` waits,
  then forwards; ``cut`` breaks a body in the middle: a request body (PUT, POST) is sent
  upstream only in part before both connections close, a response body is sent with its
  real ``Content-Length`` but only in part before the client connection closes (a response
  without a body, to HEAD, is cut inside its status line);
  ``corrupt`` flips bytes of the body in transit, same length (request body for
  PUT/POST, response body otherwise); ``truncate`` shortens the body and its
  ``Content-Length`` consistently; ``reset`` aborts the client connection with a TCP RST
  (``SO_LINGER`` 0) instead of answering; ``blackhole`` never answers, until the rule is
  removed (or the proxy closes), then closes the connection. ``error``, ``reset`` and
  ``blackhole`` may first forward the request (``upstream=True``: its effect lands, the
  answer is lost).
* **Latency** (:attr:`FaultProxy.latency`, seconds) delays every request before it is
  forwarded, faulted or not: a pass-through shaped like a WAN.
* **Records**: every request that reached the proxy is a :class:`Record` (method, path,
  query, status sent, fault applied), in arrival-of-outcome order, the last 100 000 kept.
* **Shutdown**: :meth:`FaultProxy.close` releases blackholes and delays, closes every
  connection and joins every thread it started (daemon threads; bounded wait). Upstream
  failures (refused, timed out) answer 502 to the client.

Bodies are held in memory whole (test objects are small); requests with
``Transfer-Encoding: chunked`` are forwarded de-chunked with a ``Content-Length``, and
``Expect: 100-continue`` is answered by the proxy itself.
"""

from __future__ import annotations

import contextlib
import enum
import http.client
import logging
import random
import re
import socket
import struct
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from urllib.parse import urlsplit

from s3kv.testing._wire import (
    Request,
    Response,
    Upstream,
    error_response,
    read_request,
    send_response,
)

__all__ = ["Fault", "FaultKind", "FaultProxy", "Record", "Rule"]

logger = logging.getLogger(__name__)

_ERROR_CODES = {500: "InternalError", 502: "BadGateway", 503: "SlowDown", 429: "SlowDown"}
_MAX_RECORDS = 100_000
_JOIN_TIMEOUT = 5.0


class FaultKind(enum.Enum):
    """What a :class:`Fault` does to a request (see the module docstring)."""

    ERROR = "error"
    DELAY = "delay"
    CUT = "cut"
    CORRUPT = "corrupt"
    TRUNCATE = "truncate"
    RESET = "reset"
    BLACKHOLE = "blackhole"


@dataclass(frozen=True)
class Fault:
    """One fault; build it with the class methods (``Fault.error(503)``, ``Fault.cut()``...).

    Attributes:
        kind: What happens.
        status: ``error``: the status code answered.
        code: ``error``: the S3 error code in the body (default from the status).
        seconds: ``delay``: how long the request waits before it is forwarded.
        keep: ``cut``/``truncate``: the fraction of the body that gets through (0 to 1).
        flips: ``corrupt``: how many bytes are flipped (at seeded random positions).
        upstream: ``error``/``reset``/``blackhole``: forward the request first.
    """

    kind: FaultKind
    status: int = 503
    code: str = ""
    seconds: float = 0.0
    keep: float = 0.5
    flips: int = 1
    upstream: bool = False

    def __post_init__(self) -> None:
        if not 100 <= self.status <= 599:
            raise ValueError(f"status: must be an HTTP status (100-599), got {self.status}")
        if self.seconds < 0:
            raise ValueError(f"seconds: must be >= 0, got {self.seconds}")
        if not 0.0 <= self.keep <= 1.0:
            raise ValueError(f"keep: must be a fraction within [0, 1], got {self.keep}")
        if self.flips < 1:
            raise ValueError(f"flips: must be >= 1, got {self.flips}")

    @classmethod
    def error(cls, status: int = 503, code: str = "", *, upstream: bool = False) -> Fault:
        """Answer ``status`` with an S3 XML error body (503: ``SlowDown``)."""
        return cls(FaultKind.ERROR, status=status, code=code, upstream=upstream)

    @classmethod
    def delay(cls, seconds: float) -> Fault:
        """Wait ``seconds``, then forward (a delay past the client's read timeout)."""
        return cls(FaultKind.DELAY, seconds=seconds)

    @classmethod
    def cut(cls, keep: float = 0.5) -> Fault:
        """Break the body after ``keep`` of it; the connection closes."""
        return cls(FaultKind.CUT, keep=keep)

    @classmethod
    def corrupt(cls, flips: int = 1) -> Fault:
        """Flip ``flips`` bytes of the body in transit (same length)."""
        return cls(FaultKind.CORRUPT, flips=flips)

    @classmethod
    def truncate(cls, keep: float = 0.5) -> Fault:
        """Shorten the body to ``keep`` of it, with a matching ``Content-Length``."""
        return cls(FaultKind.TRUNCATE, keep=keep)

    @classmethod
    def reset(cls, *, upstream: bool = False) -> Fault:
        """Abort the connection with a TCP RST instead of answering."""
        return cls(FaultKind.RESET, upstream=upstream)

    @classmethod
    def blackhole(cls, *, upstream: bool = False) -> Fault:
        """Never answer until the rule is removed; then close the connection."""
        return cls(FaultKind.BLACKHOLE, upstream=upstream)


class Rule:
    """A fault applied to matching requests; made by :meth:`FaultProxy.add`.

    Attributes:
        fault: What happens to a matching request.
        applied: Requests it was applied to so far.
    """

    def __init__(
        self,
        fault: Fault,
        method: str | None,
        path: str,
        query: str | None,
        times: int | None,
        probability: float,
    ) -> None:
        if times is not None and times < 0:
            raise ValueError(f"times: must be >= 0 or None, got {times}")
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"probability: must be within [0, 1], got {probability}")
        self.fault = fault
        self.method = method.upper() if method else None
        self.path = re.compile(path)
        self.query = re.compile(query) if query is not None else None
        self.probability = probability
        self.applied = 0
        self._remaining = times
        self._released = threading.Event()

    @property
    def active(self) -> bool:
        """Whether it may still apply (not removed, ``times`` not used up)."""
        return not self._released.is_set() and self._remaining != 0

    def matches(self, method: str, path: str, query: str) -> bool:
        """Whether a request with this method, raw path and raw query string matches."""
        return (
            (self.method is None or self.method == method)
            and self.path.search(path) is not None
            and (self.query is None or self.query.search(query) is not None)
        )

    def _take(self) -> None:
        self.applied += 1
        if self._remaining is not None:
            self._remaining -= 1

    def __repr__(self) -> str:
        return (
            f"Rule({self.fault.kind.value}, method={self.method}, path={self.path.pattern!r}, "
            f"applied={self.applied})"
        )


@dataclass(frozen=True)
class Record:
    """One request the proxy handled.

    Attributes:
        method: HTTP method.
        path: Raw request path (percent-encoded, without the query).
        query: Raw query string ('' if none).
        status: Status code sent to the client; ``None`` if no status line was sent.
        fault: The fault applied, or ``None``.
    """

    method: str
    path: str
    query: str
    status: int | None
    fault: FaultKind | None


class FaultProxy:
    """The proxy; see the module docstring for the contract.

    Args:
        upstream: ``http://host:port`` of the real server.
        seed: Seeds the RNG behind ``probability`` and ``corrupt`` positions.
        latency: Seconds every request waits before it is forwarded (also :attr:`latency`).
        upstream_timeout: Socket timeout towards the upstream, seconds.

    Attributes:
        connections: Client connections accepted so far.
    """

    def __init__(
        self,
        upstream: str,
        *,
        seed: int = 0,
        latency: float = 0.0,
        upstream_timeout: float = 30.0,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or parts.port is None:
            raise ValueError(f"upstream: must be http://host:port, got {upstream!r}")
        self.upstream = upstream
        self.latency = latency
        self._target = (parts.hostname, parts.port)
        self._upstream_timeout = upstream_timeout
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._rules: list[Rule] = []
        self._records: deque[Record] = deque(maxlen=_MAX_RECORDS)
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._clients: dict[socket.socket, threading.Thread] = {}
        self._upstreams: set[Upstream] = set()
        self._threads: list[threading.Thread] = []
        self.connections = 0

    # --- lifecycle ---

    def start(self) -> FaultProxy:
        """Listen on ``127.0.0.1`` (OS-chosen port) and serve in daemon threads; returns self."""
        if self._listener is not None:
            return self
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        listener.settimeout(0.1)  # NOTE: the accept loop polls the stop flag this often
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept_loop, name="faultproxy", daemon=True)
        self._acceptor.start()
        return self

    @property
    def port(self) -> int:
        """The port it listens on (after :meth:`start`)."""
        if self._listener is None:
            raise RuntimeError("FaultProxy: not started; call start() first")
        return int(self._listener.getsockname()[1])

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:<port>``: the endpoint URL to give the client."""
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> bool:
        """Release every fault, close every connection, join the threads. Idempotent.

        Returns:
            ``True`` if every thread it started ended within the bounded wait.
        """
        self._stopping.set()
        with self._lock:
            for rule in self._rules:
                rule._released.set()
            clients = dict(self._clients)
            upstreams = set(self._upstreams)
        for sock in clients:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for upstream in upstreams:
            upstream.shutdown()
        threads = [t for t in (self._acceptor, *clients.values()) if t is not None]
        for thread in threads:
            thread.join(_JOIN_TIMEOUT)
        if self._listener is not None:
            self._listener.close()
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            logger.warning("faultproxy: threads still running after close: %s", alive)
        return not alive

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- rules and records ---

    def add(
        self,
        fault: Fault,
        *,
        method: str | None = None,
        path: str = "",
        query: str | None = None,
        times: int | None = None,
        probability: float = 1.0,
    ) -> Rule:
        """Apply ``fault`` to matching requests from now on (after the rules added before).

        Args:
            fault: What happens.
            method: HTTP method to match (any if ``None``).
            path: Regex searched in the raw path ('' matches every path).
            query: Regex searched in the raw query string (any if ``None``).
            times: Apply to this many requests at most (``None``: until removed).
            probability: Chance that a matching request gets the fault.
        """
        rule = Rule(fault, method, path, query, times, probability)
        with self._lock:
            self._rules.append(rule)
        return rule

    def remove(self, rule: Rule) -> None:
        """Stop applying ``rule`` and release the requests it blackholes. Idempotent."""
        rule._released.set()
        with self._lock:
            if rule in self._rules:
                self._rules.remove(rule)

    def clear(self) -> None:
        """Remove every rule."""
        with self._lock:
            rules, self._rules = self._rules, []
        for rule in rules:
            rule._released.set()

    @contextlib.contextmanager
    def injected(
        self,
        fault: Fault,
        *,
        method: str | None = None,
        path: str = "",
        query: str | None = None,
        times: int | None = None,
        probability: float = 1.0,
    ) -> Iterator[Rule]:
        """:meth:`add` for the duration of a ``with`` block, then :meth:`remove`."""
        rule = self.add(
            fault, method=method, path=path, query=query, times=times, probability=probability
        )
        try:
            yield rule
        finally:
            self.remove(rule)

    @property
    def records(self) -> list[Record]:
        """Every request handled so far (the last 100 000), oldest first."""
        with self._lock:
            return list(self._records)

    def clear_records(self) -> None:
        """Forget the records so far."""
        with self._lock:
            self._records.clear()

    def _record(self, req: Request, status: int | None, fault: Fault | None) -> None:
        with self._lock:
            kind = fault.kind if fault is not None else None
            self._records.append(Record(req.method, req.path, req.query, status, kind))

    def _choose(self, req: Request) -> Rule | None:
        with self._lock:
            for rule in self._rules:
                if not (rule.active and rule.matches(req.method, req.path, req.query)):
                    continue
                if rule.probability < 1.0 and self._rng.random() >= rule.probability:
                    continue
                rule._take()
                return rule
        return None

    def _flip(self, data: bytes, flips: int) -> bytes:
        """``data`` with ``flips`` distinct bytes inverted (at most all of them)."""
        out = bytearray(data)
        with self._lock:
            positions = self._rng.sample(range(len(out)), min(flips, len(out)))
        for i in positions:
            out[i] ^= 0xFF
        return bytes(out)

    # --- serving ---

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stopping.is_set():
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            thread = threading.Thread(
                target=self._serve, args=(sock,), name=f"faultproxy-{self.connections}", daemon=True
            )
            with self._lock:
                if self._stopping.is_set():
                    sock.close()
                    return
                self._clients[sock] = thread
                self.connections += 1
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        reader = sock.makefile("rb")
        upstream = Upstream(*self._target, self._upstream_timeout)
        with self._lock:
            self._upstreams.add(upstream)
        try:
            while not self._stopping.is_set():
                req = read_request(reader, sock)
                if req is None or not self._handle(sock, req, upstream) or req.close:
                    break
        except (OSError, ValueError, http.client.HTTPException) as exc:
            logger.debug("faultproxy: connection ended: %s", exc)
        finally:
            upstream.close()
            reader.close()
            sock.close()
            with self._lock:
                self._upstreams.discard(upstream)
                self._clients.pop(sock, None)

    def _handle(self, sock: socket.socket, req: Request, upstream: Upstream) -> bool:
        """Answer (or not) one request; ``False`` when the connection must close."""
        rule = self._choose(req)
        fault = rule.fault if rule is not None else None
        delay = fault.seconds if fault is not None and fault.kind is FaultKind.DELAY else 0.0
        if self.latency + delay > 0:
            self._stopping.wait(self.latency + delay)
        if self._stopping.is_set():
            return False
        if rule is None or rule.fault.kind is FaultKind.DELAY:
            response = self._forward(req, req.body, upstream)
            self._record(req, response.status, fault)
            send_response(sock, req, response, keep_alive=not req.close)
            return True
        if rule.fault.kind in (FaultKind.ERROR, FaultKind.RESET, FaultKind.BLACKHOLE):
            return self._refuse(sock, req, upstream, rule)
        return self._garble(sock, req, upstream, rule.fault)

    def _refuse(self, sock: socket.socket, req: Request, upstream: Upstream, rule: Rule) -> bool:
        """``error``, ``reset``, ``blackhole``: no answer from the upstream reaches the client."""
        fault = rule.fault
        if fault.upstream:
            self._forward(req, req.body, upstream)
        if fault.kind is FaultKind.ERROR:
            code = fault.code or _ERROR_CODES.get(fault.status, "InternalError")
            message = f"injected by faultproxy ({fault.status})"
            response = error_response(fault.status, code, req.path, message)
            self._record(req, response.status, fault)
            send_response(sock, req, response, keep_alive=not req.close)
            return True
        self._record(req, None, fault)
        if fault.kind is FaultKind.RESET:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return False
        while not rule._released.wait(0.1) and not self._stopping.is_set():
            pass  # NOTE: polled, so that close() ends a blackhole even if a rule was lost
        return False

    def _garble(self, sock: socket.socket, req: Request, upstream: Upstream, fault: Fault) -> bool:
        """``cut``, ``corrupt``, ``truncate``: of the request body (PUT, POST) or the answer's."""
        if req.method in ("PUT", "POST"):
            if fault.kind is FaultKind.CUT:
                self._record(req, None, fault)
                upstream.send_partial(req, int(len(req.body) * fault.keep))
                return False
            response = self._forward(req, self._mangle(req.body, fault), upstream)
            self._record(req, response.status, fault)
            send_response(sock, req, response, keep_alive=not req.close)
            return True
        response = self._forward(req, req.body, upstream)
        self._record(req, response.status, fault)
        if fault.kind is FaultKind.CUT:
            send_response(sock, req, response, keep_alive=False, cut=fault.keep)
            return False
        response.body = self._mangle(response.body, fault)
        send_response(sock, req, response, keep_alive=not req.close)
        return True

    def _mangle(self, body: bytes, fault: Fault) -> bytes:
        if fault.kind is FaultKind.TRUNCATE:
            return body[: int(len(body) * fault.keep)]
        return self._flip(body, fault.flips)

    def _forward(self, req: Request, body: bytes, upstream: Upstream) -> Response:
        try:
            return upstream.exchange(req, body)
        except (OSError, http.client.HTTPException) as exc:
            logger.debug("faultproxy: upstream %s failed: %s", self.upstream, exc)
            return error_response(502, "BadGateway", req.path, str(exc))
