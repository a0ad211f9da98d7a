"""The delay line: a TCP relay that holds each direction's bytes for a fixed time. Stdlib only.

Run inside the namespace by :class:`netshape.ShapedS3` (``python relay.py --listen ...``):
listens on ``--listen``:``--s3-port`` for the S3 server on the namespace's 127.0.0.1 and on
``--test-port`` for a built-in test service (ping, bulk up and down), each through the same
line. Every chunk read is stamped and written ``--delay-ms`` later (half the RTT each way),
so connections stream while their bytes are in flight; at most ``--window / 2`` bytes wait
in a connection's line per direction, so a connection carries at most window / RTT, as TCP
with that window. Stops on SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import signal
import socket

_CHUNK = 1 << 20
_DATA, _EOF, _CLOSE = 0, 1, 2


class _Half(asyncio.Protocol):
    """One TCP connection of a relayed pair: what it reads reaches its peer ``delay`` later.

    The line is a FIFO of (due time, kind, chunk) drained by one timer, so order is kept
    and a connection streams while its bytes are in flight. Reading pauses while the line
    holds ``limit`` bytes or the peer's socket is backed up (its transport called
    pause_writing); the kernel's socket buffers then push back on the sender, as TCP does.
    """

    def __init__(self, delay: float, limit: int) -> None:
        self.delay, self.limit = delay, limit
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.peer: _Half | None = None
        self.line: collections.deque[tuple[float, int, bytes]] = collections.deque()
        self.held = 0
        self.peer_blocked = False
        self.reading = True
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=1 << 20)

    def _push(self, kind: int, chunk: bytes = b"") -> None:
        self.line.append((self.loop.time() + self.delay, kind, chunk))
        self.held += len(chunk)
        if self.timer is None:
            self.timer = self.loop.call_at(self.line[0][0], self._drain)
        self._throttle()

    def data_received(self, data: bytes) -> None:
        self._push(_DATA, data)

    def eof_received(self) -> bool:
        self._push(_EOF)
        return True  # keep our side open: the peer may still answer (half-close)

    def connection_lost(self, exc: Exception | None) -> None:
        self._push(_CLOSE)

    def _drain(self) -> None:
        self.timer = None
        now = self.loop.time()
        peer = self.peer.transport if self.peer is not None else None
        while self.line and self.line[0][0] <= now:
            _, kind, chunk = self.line.popleft()
            self.held -= len(chunk)
            if peer is None or peer.is_closing():
                continue
            if kind == _DATA:
                peer.write(chunk)
            elif kind == _EOF and peer.can_write_eof():
                peer.write_eof()
            else:
                peer.close()
        if self.line:
            self.timer = self.loop.call_at(self.line[0][0], self._drain)
        self._throttle()

    def _throttle(self) -> None:
        if self.transport is None or self.transport.is_closing() or self.peer is None:
            return
        pause = self.held >= self.limit or self.peer_blocked
        if pause and self.reading:
            self.transport.pause_reading()
        elif not pause and not self.reading:
            self.transport.resume_reading()
        self.reading = not pause

    def pause_writing(self) -> None:
        if self.peer is not None:
            self.peer.peer_blocked = True
            self.peer._throttle()

    def resume_writing(self) -> None:
        if self.peer is not None:
            self.peer.peer_blocked = False
            self.peer._throttle()


class _Downstream(_Half):
    """The accepted side: reads nothing until its upstream connection is made."""

    def __init__(self, delay: float, limit: int, upstream_port: int) -> None:
        super().__init__(delay, limit)
        self.upstream_port = upstream_port

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert self.transport is not None
        self.transport.pause_reading()
        self.reading = False
        self.loop.create_task(self._connect())

    async def _connect(self) -> None:
        assert self.transport is not None
        try:
            _, upstream = await self.loop.create_connection(
                lambda: _Half(self.delay, self.limit), "127.0.0.1", self.upstream_port
            )
        except OSError:
            self.transport.close()
            return
        self.peer, upstream.peer = upstream, self
        self._throttle()


async def _test_service(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Ping: ``p`` → ``p``. Download: ``d`` + n → n bytes. Upload: ``u`` + n + n bytes → ``k``."""
    zeros = bytes(_CHUNK)
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
        while True:
            op = await reader.readexactly(1)
            if op == b"p":
                writer.write(b"p")
            elif op == b"d":
                left = int.from_bytes(await reader.readexactly(8), "big")
                while left:
                    writer.write(zeros[: min(left, _CHUNK)])
                    left -= min(left, _CHUNK)
                    await writer.drain()
            elif op == b"u":
                left = int.from_bytes(await reader.readexactly(8), "big")
                while left:
                    got = await reader.read(min(left, _CHUNK))
                    if not got:
                        return
                    left -= len(got)
                writer.write(b"k")
            else:
                return
            await writer.drain()
    writer.close()


async def _serve_relay(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    delay, limit = args.delay_ms / 1e3, max(args.window // 2, 64 * 1024)
    test = await asyncio.start_server(_test_service, "127.0.0.1", 0)
    test_inner = test.sockets[0].getsockname()[1]
    servers = [
        await loop.create_server(
            lambda: _Downstream(delay, limit, args.upstream_port), args.listen, args.s3_port
        ),
        await loop.create_server(
            lambda: _Downstream(delay, limit, test_inner), args.listen, args.test_port
        ),
    ]
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in [*servers, test]:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="delay-line relay (run inside the namespace)")
    parser.add_argument("--listen", required=True)
    parser.add_argument("--s3-port", type=int, required=True)
    parser.add_argument("--upstream-port", type=int, required=True)
    parser.add_argument("--test-port", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--window", type=int, required=True)
    asyncio.run(_serve_relay(parser.parse_args()))


if __name__ == "__main__":
    main()
