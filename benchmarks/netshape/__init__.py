"""A bucket behind a link shaped like a real network: bandwidth with ``tc tbf``, RTT in userspace.

Linux, root only. :class:`ShapedS3` builds, for one benchmark run::

    benchmark process (host namespace), 10.231.K.1/30 on veth s3kw<pid>h
        │   tbf rate R on s3kw<pid>h egress (client → server: PUT bodies)
        ▼
    namespace s3kvwan-<pid>-<K>, 10.231.K.2/30 on veth s3kw<pid>n
        │   tbf rate R on s3kw<pid>n egress (server → client: GET bodies)
        relay (``relay.py``): listens on 10.231.K.2 and holds every byte of
        each direction RTT/2 before passing it on, then
        ├─ weed server (SeaweedFS, S3 gateway) on the namespace's own 127.0.0.1
        └─ a test service (ping, bulk upload and download) to verify the shaping

The S3 server binds only the namespace's loopback, so the relay and the shaped veth are the
only way in. Nothing is sent anywhere but the addresses made here.

Why the delay is a userspace relay: ``netem`` is not available and ``tbf``/``htb`` only limit
rate. The relay is a delay line, not a per-request sleep: every chunk it reads is stamped and
written RTT/2 later, each direction on its own, so a connection keeps streaming at the link
rate while its bytes are in flight (a sleep per request would serialise requests and halve
the bandwidth). Each connection holds at most ``window / 2`` bytes per direction in the
line, so it carries at most ``window / RTT`` like a TCP connection with that window
(default 6 MiB, Linux's default ``tcp_rmem`` maximum). The tbf queues are deep (64 MiB)
so a saturated link queues instead of dropping: TCP between client and relay sees a ~0 ms
RTT, and a dropped tail segment would wait out the 200 ms minimum RTO, a stall a real
20 ms path recovers from far sooner. What it does not model: the TCP handshake (the relay
accepts at once, so a new connection costs no RTT; boto3 keeps its connections alive),
loss, slow start and TLS. asyncio's timers round up to the millisecond, so the measured RTT
runs about 1 ms over the asked one (``wan.rtt_measured_ms``). The relay is Python on one
core: at 10 Gbit/s it may be what limits the path, which :meth:`ShapedS3.measure_bulk` shows.

Cleanup: names carry the creating pid; :func:`remove_stale` (run by every start) deletes
namespaces, veths and data directories whose pid is gone, and :meth:`ShapedS3.stop` runs on
exit, exceptions, Ctrl-C and (through :func:`sigterm_as_exit`) SIGTERM. The server and the
relay die with their parent (``PR_SET_PDEATHSIG``) if it is killed outright.
"""

from netshape.plumbing import LinkSpec, NetShapeError, cpu_times, remove_stale, sigterm_as_exit
from netshape.shaped import ShapedS3

__all__ = ["LinkSpec", "NetShapeError", "ShapedS3", "cpu_times", "remove_stale",
           "sigterm_as_exit"]  # fmt: skip
