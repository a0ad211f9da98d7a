"""HTTP/1.1 messages on a socket, for :mod:`s3kv.testing.faultproxy` (stdlib only).

Reading requests from a client connection (``Expect: 100-continue`` answered, chunked bodies
de-chunked), writing responses to it (whole, or cut), and one kept-alive connection to the
upstream server. Bodies are held in memory whole.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
from dataclasses import dataclass
from typing import BinaryIO
from urllib.parse import urlsplit

__all__ = ["Request", "Response", "Upstream", "error_response", "read_request", "send_response"]

#: Headers that describe one hop, not the message: never forwarded as received.
HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "expect", "te",
     "content-length", "upgrade", "trailer"}
)  # fmt: skip
_MAX_LINE = 65536


@dataclass
class Request:
    """One request as received: ``target`` raw, split into raw ``path`` and ``query``;
    ``close`` when the client asked to close the connection after it."""

    method: str
    target: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes
    close: bool


@dataclass
class Response:
    """One answer, as the upstream gave it (hop-by-hop headers are dropped on sending)."""

    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes


class Upstream:
    """One kept-alive connection to the upstream, reopened after a failure."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self._host, self._port, self._timeout = host, port, timeout
        self._conn: http.client.HTTPConnection | None = None

    def _send(self, req: Request, body: bytes, length: int) -> http.client.HTTPConnection:
        conn = self._conn or http.client.HTTPConnection(self._host, self._port, self._timeout)
        self._conn = conn
        conn.putrequest(req.method, req.target, skip_host=True, skip_accept_encoding=True)
        for name, value in req.headers:
            if name.lower() not in HOP_HEADERS:
                conn.putheader(name, value)
        if length or req.method in ("PUT", "POST"):
            conn.putheader("Content-Length", str(length))
        conn.endheaders(body or None)
        return conn

    def exchange(self, req: Request, body: bytes) -> Response:
        """Forward ``req`` with ``body``; retried once when a reused connection was stale.

        Raises:
            OSError, http.client.HTTPException: the upstream failed.
        """
        for attempt in (1, 2):
            reused = self._conn is not None
            try:
                conn = self._send(req, body, len(body))
                response = conn.getresponse()
                data = response.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()
                if reused and attempt == 1:
                    continue
                raise
            except (OSError, http.client.HTTPException):
                self.close()
                raise
            if response.will_close:
                self.close()
            return Response(response.status, response.reason, response.getheaders(), data)
        raise AssertionError("unreachable")  # pragma: no cover

    def send_partial(self, req: Request, keep: int) -> None:
        """Send the head with the real ``Content-Length`` and ``keep`` body bytes, then close."""
        try:
            conn = self._send(req, b"", len(req.body))
            conn.send(req.body[:keep])
        except (OSError, http.client.HTTPException):
            pass
        finally:
            self.close()

    def shutdown(self) -> None:
        """Unblock a thread waiting on the upstream (from another thread)."""
        sock = self._conn.sock if self._conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


def read_request(reader: BinaryIO, sock: socket.socket) -> Request | None:
    """The next request on a connection, or ``None`` at its end."""
    line = reader.readline(_MAX_LINE)
    while line in (b"\r\n", b"\n"):  # NOTE: RFC 9112 lets a client send stray CRLFs
        line = reader.readline(_MAX_LINE)
    if not line:
        return None
    method, target, version = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    headers: list[tuple[str, str]] = []
    while True:
        raw = reader.readline(_MAX_LINE)
        if raw in (b"\r\n", b"\n", b""):
            break
        name, _, value = raw.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
    fields = {name.lower(): value for name, value in headers}
    if fields.get("expect", "").lower() == "100-continue":
        sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    if "chunked" in fields.get("transfer-encoding", "").lower():
        body = _read_chunked(reader)
    else:
        body = _read_exactly(reader, int(fields.get("content-length", "0") or 0))
    connection = fields.get("connection", "").lower()
    close = connection == "close" or (version == "HTTP/1.0" and connection != "keep-alive")
    parts = urlsplit(target)
    return Request(method.upper(), target, parts.path, parts.query, headers, body, close)


def _read_exactly(reader: BinaryIO, n: int) -> bytes:
    data = reader.read(n) if n else b""
    if len(data) != n:
        raise ValueError(f"request body ended after {len(data)} of {n} bytes")
    return data


def _read_chunked(reader: BinaryIO) -> bytes:
    chunks: list[bytes] = []
    while True:
        size = int(reader.readline(_MAX_LINE).split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while reader.readline(_MAX_LINE) not in (b"\r\n", b"\n", b""):
                pass  # NOTE: trailers are dropped (the body is forwarded de-chunked)
            return b"".join(chunks)
        chunks.append(_read_exactly(reader, size))
        reader.readline(_MAX_LINE)


def error_response(status: int, code: str, path: str, message: str) -> Response:
    """An S3-style XML error answer."""
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{_xml_escape(message)}</Message>"
        f"<Resource>{_xml_escape(path)}</Resource><RequestId>faultproxy</RequestId></Error>"
    ).encode()
    reason = http.client.responses.get(status, "Error")
    return Response(status, reason, [("Content-Type", "application/xml")], body)


def _xml_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def send_response(
    sock: socket.socket,
    req: Request,
    response: Response,
    *,
    keep_alive: bool,
    cut: float | None = None,
) -> None:
    """Write ``response``; with ``cut``, only that fraction of its body (of its status line
    when it has no body)."""
    lines = [f"HTTP/1.1 {response.status} {response.reason}"]
    length: str | None = str(len(response.body))
    for name, value in response.headers:
        lower = name.lower()
        if lower == "content-length" and req.method == "HEAD":
            length = value  # NOTE: a HEAD answer names the object's size, with no body
        elif lower not in HOP_HEADERS:
            lines.append(f"{name}: {value}")
    if response.status in (204, 304) or response.status < 200:
        length = None
    if length is not None:
        lines.append(f"Content-Length: {length}")
    lines.append("Connection: keep-alive" if keep_alive else "Connection: close")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    body = b"" if req.method == "HEAD" else response.body
    if cut is not None:
        if body:
            sock.sendall(head + body[: int(len(body) * cut)])
        else:  # NOTE: clients take a head cut between two headers for a whole one
            sock.sendall(head[: max(1, int(head.index(b"\r\n") * cut))])
        return
    sock.sendall(head + body)
