"""Save and stage over a link shaped like a real network (bandwidth + RTT), side by side.

SeaweedFS runs in a private network namespace behind a veth shaped with ``tc tbf`` and a
userspace delay line (``netshape.py`` says how and why). Needs root; otherwise prints one
``wan.skipped`` line and exits 0. For each link, (1 Gbit/s, 20 ms) and (10 Gbit/s, 10 ms),
in this one process (and its codec processes), against the same server and the same real
SmolLM2 bf16 KV blocks (64 tokens, 1.47 MB each, cycled under distinct keys; 128 per pass,
an 8K-token prompt) in the layout the connector hands to the store, TensorRT-LLM's HND pages
``[layers, 2, heads, tokens, head_dim]``:

* ``wan.rtt_measured_ms`` / ``wan.link_measured_Gbps``: a 1-byte ping and a raw bulk
  transfer (4 streams, each direction) through the same relay and veth.
* ``wan.save_MBps``: KVStore.save_many (encode + PUT on the I/O pool, ``--threads`` threads,
  or in ``--codec-processes`` codec processes from the save arena, as the connector hands
  blocks over) of all blocks, until the last block's PUT returned (with processes: until
  the store has recorded the last outcome; the manifest segment
  that ``flush`` then writes is not timed: production writes it on a timer).
  ``wan.uncompressed_put_MBps``: the same blocks PUT raw with the same thread count.
  ``wan.seed_save_MBps``: TensorRT-LLM's example connector's way, serially ``torch.save``
  each block and PUT it.
* ``wan.stage_MBps``: KVStore.prefetch + wait_staged (GET + verify + decode into staging;
  with codec processes, into the staging arena). ``client_cores`` counts the codec
  processes' CPU too (from ``/proc``, in 10 ms ticks: about half a core coarse over a
  0.2 s phase with 8 processes).
  ``wan.uncompressed_get_MBps`` / ``wan.seed_load_MBps``: parallel raw GET / serial GET +
  ``torch.load``.
* ``wan.save_over_uncompressed`` (target 1.3), ``wan.stage_over_uncompressed`` (1.3),
  ``wan.save_over_seed`` (4), ``wan.stage_over_seed`` (4): ratios of the above.
* ``wan.stored_get_MBps``: the objects the stage pass read, GET raw (no verify, no decode)
  at the same concurrency through this process's client, counted in raw bytes like
  ``wan.stage_MBps``: what the link and the server give for those objects.
  ``wan.stage_over_stored_get`` (no target): the share of that the stage path gets; near 1,
  what bounds staging is on the other side of the client (the link, the relay, the server).

s3kv's rows name their ``codec`` (the configured one, or each ``--codec`` given, timed in
turn within every round, each round starting with the next one, against the same baselines: a
side-by-side comparison).

MB/s are raw (uncompressed) bytes per second, best of the rounds. Every row carries the
link (``link_Gbps``, ``rtt_ms``); throughput rows add ``wire_Gbps`` (bytes on the veth,
headers included), ``link_util`` (wire / link rate), ``tbf_dropped`` and
``tcp_retransmitted`` (packets the link's queue dropped in the phase's direction, TCP
segments the client side resent: each can stall a connection for a 200 ms timeout) and
``cpu_busy`` (share of all cores
busy machine-wide, other processes included). A ratio's ``cpu_bound`` is true when either
side ran with the machine's cores at least 90 % busy: then the link was not what limited it
(client, relay and server share this machine's cores, and other work on the machine counts);
its ``link_util`` gives both sides' share of the link, ours first, and ``link_ceiling`` the
ratio s3kv's side would reach if its bytes crossed as fast as the raw bulk transfer's (near
it, the link and the codec's ratio bound the figure, not s3kv's client; the bulk rate counts
payload and the phase's wire bytes count headers too, so it is a few percent low).

Usage: ``sudo python benchmarks/bench_wan.py [--quick] [--threads N] [--codec-processes N]
[--blocks N] [--link GBIT ...] [--codec NAME ...] [--kv-file KV.npy] [--clean]``.
``--kv-file`` takes the KV array from a ``.npy`` that ``kv_array`` wrote (or a prefix of its
tokens), for a machine without the model wheel; rows then name the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, get_args

import numpy as np
import numpy.typing as npt
from bench_s3 import get_raw, identity, parallel, put_raw, seed_load, seed_save
from netshape import LinkSpec, NetShapeError, ShapedS3, cpu_times, remove_stale, sigterm_as_exit

from s3kv.arena import SlabArena
from s3kv.config import CodecName
from s3kv.storage import Backend, DelegatingBackend, open_backend
from s3kv.store import KVStore

LINKS = (LinkSpec(1.0, 20.0), LinkSpec(10.0, 10.0))
#: Blocks per pass: an 8K-token prompt of SmolLM2 (128 blocks of 64 tokens, 188 MB raw; 1.5 s /
#: 0.15 s at the links' rates), the prompt size the GPU A/B uses. ``--blocks`` overrides it.
BLOCKS = 128
CPU_BOUND = 0.9
#: The token that sets the untimed warm-up blocks' keys apart from the timed ones'.
WARM_TOKEN = 1_000_003
TOKENS_PER_BLOCK = 64
#: SmolLM2-135M's KV geometry (layers, KV heads, head dim), as ``bench_s3.identity`` says.
SMOLLM2_KV = (30, 3, 64)
#: The codecs ``--codec`` takes (S3KVConfig.codec's choices).
CODECS: tuple[CodecName, ...] = get_args(CodecName)


def emit(metric: str, value: float, unit: str, **extra: Any) -> None:
    print(json.dumps({"metric": metric, "value": round(value, 3), "unit": unit, **extra}))
    sys.stdout.flush()


@dataclass(frozen=True)
class Phase:
    """One timed transfer: wall seconds, bytes on the wire, machine and per-process CPU."""

    seconds: float
    raw_bytes: int
    wire_bytes: int
    cpu_busy: float
    cpu_s: dict[str, float]
    dropped: int  # NOTE: packets tbf dropped in the phase's direction
    retransmitted: int  # NOTE: TCP segments the client's namespace retransmitted

    @property
    def mbps(self) -> float:
        return self.raw_bytes / self.seconds / 1e6

    def fields(self, link: LinkSpec) -> dict[str, Any]:
        wire_gbps = self.wire_bytes * 8 / self.seconds / 1e9
        return {
            "wire_Gbps": round(wire_gbps, 3),
            "link_util": round(wire_gbps / link.gbit, 3),
            "cpu_busy": round(self.cpu_busy, 3),
            "tbf_dropped": self.dropped,
            "tcp_retransmitted": self.retransmitted,
            **{f"{k}_cores": round(v / self.seconds, 2) for k, v in self.cpu_s.items()},
        }


def measure(
    net: ShapedS3,
    raw_bytes: int,
    upload: bool,
    fn: Callable[[], object],
    children: Sequence[int] = (),
) -> Phase:
    """Time ``fn``; the client's CPU counts its codec processes (``children``) too."""
    up0, down0, re0 = net.losses()
    busy0, total0 = cpu_times()
    tx0, rx0 = net.wire_bytes()
    procs0, cpu0 = net.process_cpu(), time.process_time() + pids_cpu_s(children)
    started = time.perf_counter()
    fn()
    seconds = time.perf_counter() - started
    cpu = {"client": time.process_time() + pids_cpu_s(children) - cpu0}
    cpu.update({k: v - procs0.get(k, 0.0) for k, v in net.process_cpu().items()})
    tx1, rx1 = net.wire_bytes()
    busy1, total1 = cpu_times()
    up1, down1, re1 = net.losses()
    return Phase(
        seconds=seconds,
        raw_bytes=raw_bytes,
        wire_bytes=(tx1 - tx0) if upload else (rx1 - rx0),
        cpu_busy=(busy1 - busy0) / max(total1 - total0, 1.0),
        cpu_s=cpu,
        dropped=(up1 - up0) if upload else (down1 - down0),
        retransmitted=re1 - re0,
    )


def pids_cpu_s(pids: Sequence[int]) -> float:
    """User + system CPU seconds used so far by the processes ``pids`` (gone ones: 0)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rpartition(")")[2].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def codec_pids(store: KVStore, processes: int) -> list[int]:
    """The store's codec processes, once every one is set up (start-up is not timed), with
    its staging arena's pages backed as CUDA registration leaves them; none when
    ``processes`` is 0. Exits when the store runs fewer than asked (it fell back to its
    threads, or some did not start): the rows would be mislabelled."""
    if not processes:
        return []
    offload = store._offload
    if offload is None or offload.wait_ready(120) != processes:
        raise SystemExit(f"--codec-processes {processes}: the store did not start them all")
    arena = store.staging.allocator
    if isinstance(arena, SlabArena):
        arena.populate()
    return offload.pids


def saved_from(store: KVStore, blocks: Sequence[npt.NDArray[Any]]) -> list[npt.NDArray[Any]]:
    """The blocks as the engine hands them over: slots of the save arena with codec
    processes (copied there before the timed pass, as the device copy would), else as is."""
    arena = store.save_arena(blocks[0].nbytes, len(blocks) * blocks[0].nbytes)
    if arena is None:
        return list(blocks)
    slots = []
    for block in blocks:
        slot = arena.allocate(block.nbytes)
        slot[:] = block.reshape(-1).view(np.uint8)
        slots.append(slot)
    return slots


def until_saved(store: KVStore, count: int, timeout: float) -> None:
    """Wait until ``count`` saves have ended (completed, failed or found existing), polling
    the store's counters; exit unless every one completed."""
    ended = ("save_completed", "save_failed", "save_skipped_existing", "save_dropped")
    deadline = time.monotonic() + timeout
    while sum(store.metrics.value(name) for name in ended) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"saves did not end in {timeout:.0f} s")
        time.sleep(0.0005)
    completed = store.metrics.value("save_completed")
    if completed != count:
        raise SystemExit(f"only {completed:.0f} of {count} saves completed")


class BlockPuts(DelegatingBackend):
    """Sets :attr:`done` once every expected block key's PUT has returned.

    NOTE: the save phase ends when the last block is stored, not after ``KVStore.flush``,
    whose manifest segment PUT production makes on a timer, off the save path; in a pass of
    32 blocks that one extra request would be about a tenth of the time at 1 Gbit/s.
    """

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self._waiting: set[str] = set()
        self.done = threading.Event()

    def expect(self, keys: Iterable[str]) -> None:
        with self._lock:
            self._waiting = set(keys)
            self.done.clear()

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        stored = self.inner.put(key, data, if_absent=if_absent)
        with self._lock:
            if key in self._waiting:
                self._waiting.discard(key)
                if not self._waiting:
                    self.done.set()
        return stored


def run_link(
    link: LinkSpec,
    base: list[npt.NDArray[Any]],
    *,
    rounds: int,
    seed_rounds: int,
    count: int,
    threads: int,
    tag: int,
    kv: str,
    processes: int,
    codecs: Sequence[CodecName],
) -> None:
    from s3kv.config import S3KVConfig
    from s3kv.keys import ROOT_HASH, BlockHash, hash_block
    from s3kv.staging import NumpyAllocator

    blocks = [base[i % len(base)] for i in range(count)]
    warm_count = min(threads, count)  # NOTE: one block per connection the pass can use
    raw_bytes = sum(b.nbytes for b in blocks)
    where = {"link_Gbps": link.gbit, "rtt_ms": link.rtt_ms, "queue_MiB": link.queue >> 20}
    bulk_gbps: dict[str, float] = {}
    with ShapedS3(link) as net:
        os.environ.update(net.env())
        rtt = net.measure_rtt()
        emit("wan.rtt_measured_ms", rtt, "ms", **where)
        bulk = int(min(link.bytes_per_s * 0.5, 256e6))
        for direction in ("down", "up"):
            gbps = bulk_gbps[direction] = net.measure_bulk(direction, bulk)
            emit("wan.link_measured_Gbps", gbps, "Gbit/s", direction=direction, streams=4,
                 MB=round(bulk / 1e6), **where)  # fmt: skip
        cfg = S3KVConfig.load(
            io_threads=threads, codec_processes=processes, staging_bytes=2 * raw_bytes,
            max_inflight_save_bytes=2 * raw_bytes,
        )  # fmt: skip
        configs = {name: cfg.replace(codec=name) for name in codecs or [cfg.codec]}
        backend = open_backend(cfg)
        puts = BlockPuts(backend)
        # NOTE: with codec processes, staging and save buffers are shared-memory arenas (the
        # processes read and write them in place); without, plain numpy buffers.
        # A store given its backend keeps the codec in its threads: with processes, each
        # store opens its own (the processes open theirs) and saves end on their outcomes.
        own: dict[str, Any] = {}
        if not processes:
            own = {"allocator": NumpyAllocator(), "backend": puts}
        best: dict[str, Phase] = {}

        def keep(name: str, phase: Phase) -> None:
            if name not in best or phase.mbps > best[name].mbps:
                best[name] = phase

        def save_and_stage(config: S3KVConfig, label: str, tokens: list[int], name: str) -> None:
            """One s3kv save pass and one stage pass with ``config``, kept under ``name``."""
            keys = [hash_block(ROOT_HASH, [*tokens, i]) for i in range(len(blocks))]
            # NOTE: an engine's store is long-lived, its connections open and past TCP's slow
            # start, as the baselines' client is by the time it runs; each pass opens a new
            # store, so a few blocks under other keys go through it first, untimed.
            warm = [hash_block(ROOT_HASH, [*tokens, WARM_TOKEN, i]) for i in range(warm_count)]
            store = KVStore.open(config, identity(label), **own)
            sources = saved_from(store, blocks)
            children = codec_pids(store, processes)
            store.save_many(
                [(k, ROOT_HASH, source, None) for k, source in zip(warm, sources, strict=False)],
                dtype="bfloat16",
                shape=blocks[0].shape,
            )
            until_saved(store, len(warm), 300)

            def save_all(
                store: KVStore = store,
                keys: list[BlockHash] = keys,
                sources: list[npt.NDArray[Any]] = sources,
                children: list[int] = children,
            ) -> None:
                puts.expect(store.object_key(k) for k in keys)
                pairs = zip(keys, sources, strict=True)
                batch = [(k, ROOT_HASH, source, None) for k, source in pairs]
                store.save_many(batch, dtype="bfloat16", shape=blocks[0].shape)
                if children:  # NOTE: the codec processes PUT: their outcomes say when
                    until_saved(store, len(warm) + len(keys), 300)
                elif not puts.done.wait(300):
                    raise SystemExit("block PUTs did not finish in 300 s")

            keep(f"save:{name}", measure(net, raw_bytes, True, save_all, children))
            store.flush(timeout=300)
            completed = store.metrics.value("save_completed")
            if completed != len(warm) + len(blocks):
                raise SystemExit(f"only {completed:.0f} of {len(blocks)} saves completed")
            store.close()
            reader = KVStore.open(config, identity(label), **own)
            children = codec_pids(reader, processes)
            reader.prefetch(warm)
            if reader.wait_staged(warm, timeout=300) != len(warm):
                raise SystemExit("not every warm-up block staged")

            def stage_all(reader: KVStore = reader, keys: list[BlockHash] = keys) -> None:
                reader.prefetch(keys)
                if reader.wait_staged(keys, timeout=300) != len(keys):
                    raise SystemExit("not every block staged")

            keep(f"stage:{name}", measure(net, raw_bytes, False, stage_all, children))
            for key, block in zip(keys, blocks, strict=True):
                staged = reader.staged(key)
                if staged is None or staged.tobytes() != block.tobytes():
                    raise SystemExit("a staged block differs from the saved one")
            # NOTE: the same objects GET raw (no verify, no decode) at the same concurrency
            # through this process's client: what the link and the server give for them.
            stored = [reader.object_key(k) for k in keys]
            get_stored = functools.partial(get_raw, backend, stored)
            run = functools.partial(parallel, threads, get_stored, len(stored))
            keep(f"stored_get:{name}", measure(net, raw_bytes, False, run))
            reader.close()

        named = list(configs.items())
        for r in range(rounds):
            # NOTE: each round starts with the next codec, so none always runs right after
            # another's transfers (the server and client share this machine's cores).
            turn = r % len(named)
            for codec, config in named[turn:] + named[:turn]:
                c = list(configs).index(codec)
                save_and_stage(config, f"wan{tag}-r{r}-{codec}", [tag, r, c], codec)
            label = f"wan{tag}-r{r}"
            raw_keys = [f"raw/{label}/{i}" for i in range(len(blocks))]
            seed_keys = [f"seed/{label}/{i}" for i in range(len(blocks))]
            n = len(blocks)
            put_one = functools.partial(put_raw, backend, raw_keys, blocks)
            get_one = functools.partial(get_raw, backend, raw_keys)
            others: list[tuple[str, bool, Callable[[], object]]] = [
                ("put", True, functools.partial(parallel, threads, put_one, n)),
                ("get", False, functools.partial(parallel, threads, get_one, n)),
            ]
            if r < seed_rounds:  # NOTE: serial and latency-bound: one pass is steady enough.
                others += [
                    ("seed_save", True, functools.partial(seed_save, backend, seed_keys, blocks)),
                    ("seed_load", False, functools.partial(seed_load, backend, seed_keys)),
                ]
            for phase_name, upload, run in others:
                keep(phase_name, measure(net, raw_bytes, upload, run))
        backend.close()

    common = {**where, "rtt_measured_ms": round(rtt, 2), "rounds": rounds, "threads": threads,
              "blocks": len(blocks), "block_MB": round(blocks[0].nbytes / 1e6, 3),
              "distinct_blocks": len(base), "kv": kv, "cores": os.cpu_count(),
              "codec_processes": processes, "warm_blocks": warm_count}  # fmt: skip
    names = {"put": "wan.uncompressed_put_MBps", "seed_save": "wan.seed_save_MBps",
             "get": "wan.uncompressed_get_MBps", "seed_load": "wan.seed_load_MBps"}  # fmt: skip
    for phase_name, metric in names.items():
        phase = best[phase_name]
        emit(metric, phase.mbps, "MB/s", **phase.fields(link), **common)
    for codec in configs:
        for what in ("save", "stage", "stored_get"):
            phase = best[f"{what}:{codec}"]
            emit(f"wan.{what}_MBps", phase.mbps, "MB/s", **phase.fields(link), **common,
                 codec=codec)  # fmt: skip
    for codec, (metric, what, theirs, target) in itertools.product(configs, (
        ("wan.save_over_uncompressed", "save", "put", 1.3),
        ("wan.stage_over_uncompressed", "stage", "get", 1.3),
        ("wan.save_over_seed", "save", "seed_save", 4.0),
        ("wan.stage_over_seed", "stage", "seed_load", 4.0),
    )):  # fmt: skip
        ours = f"{what}:{codec}"
        ratio = best[ours].mbps / best[theirs].mbps
        cpu_bound = max(best[ours].cpu_busy, best[theirs].cpu_busy) >= CPU_BOUND
        utils = [best[x].fields(link)["link_util"] for x in (ours, theirs)]
        # NOTE: the ratio s3kv's phase would reach with its bytes on the wire moving as fast
        # as the raw bulk transfer's did: near it, the link (not s3kv) is what bounds it.
        wire = best[ours].fields(link)["wire_Gbps"]
        ceiling = ratio * bulk_gbps["up" if what == "save" else "down"] / wire if wire else 0.0
        emit(metric, ratio, "x", target=target, met=ratio >= target, cpu_bound=cpu_bound,
             link_util=utils, link_ceiling=round(ceiling, 3), **where,
             rtt_measured_ms=round(rtt, 2), codec=codec)  # fmt: skip
    for codec in configs:
        stage, stored = best[f"stage:{codec}"], best[f"stored_get:{codec}"]
        emit("wan.stage_over_stored_get", stage.mbps / stored.mbps, "x", **where,
             link_util=[stage.fields(link)["link_util"], stored.fields(link)["link_util"]],
             rtt_measured_ms=round(rtt, 2), codec=codec)  # fmt: skip


def kv_blocks(kv_file: str) -> list[npt.NDArray[Any]]:
    """SmolLM2's real KV in blocks of TOKENS_PER_BLOCK as the connector hands them over,
    ``[layers, 2, kv_heads, tokens, head_dim]`` (HND pages), from ``kv_file`` (a ``.npy`` of
    ``[layers, 2, tokens, kv_heads, head_dim]``, as ``kv_array`` caches it), else computed."""
    return [np.ascontiguousarray(block.transpose(0, 1, 3, 2, 4)) for block in nhd_blocks(kv_file)]


def nhd_blocks(kv_file: str) -> list[npt.NDArray[Any]]:
    """The blocks in ``kv_array``'s token-major layout (see :func:`kv_blocks`)."""
    if not kv_file:
        from s3kv.testing.smollm2 import kv_blocks as computed

        return computed(tokens_per_block=TOKENS_PER_BLOCK)
    kv = np.load(kv_file, allow_pickle=False)
    layers, heads, dim = SMOLLM2_KV
    if (
        kv.dtype != np.uint16
        or kv.ndim != 5
        or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != (layers, 2, heads, dim)
        or kv.shape[2] < TOKENS_PER_BLOCK
    ):
        raise SystemExit(
            f"--kv-file: expected uint16 bf16 bits [{layers}, 2, tokens >= {TOKENS_PER_BLOCK}, "
            f"{heads}, {dim}] (SmolLM2's, as kv_array writes them), got {kv.dtype} {kv.shape}"
        )
    return [np.ascontiguousarray(kv[:, :, i : i + TOKENS_PER_BLOCK])
            for i in range(0, kv.shape[2] - TOKENS_PER_BLOCK + 1, TOKENS_PER_BLOCK)]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds, seed way once")
    parser.add_argument("--threads", type=int, default=16, help="I/O threads (both paths)")
    parser.add_argument("--blocks", type=int, default=BLOCKS, help="blocks per pass (64 tokens)")
    parser.add_argument(
        "--link", type=float, action="append", default=[], help="only this link (Gbit/s)"
    )
    parser.add_argument(
        "--codec-processes",
        type=int,
        default=0,
        help="s3kv's codec_processes (0: encode and decode on the I/O threads)",
    )
    parser.add_argument(
        "--codec",
        action="append",
        default=[],
        choices=CODECS,
        help="s3kv's codec (repeat to compare codecs side by side; default: the configured)",
    )
    parser.add_argument(
        "--queue-mb", type=int, default=64,
        help="the link's queue each way, MiB (tbf's limit; 4 MB per busy connection fills it)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-file", default="", help="a .npy of SmolLM2's KV ([layers, 2, tokens, heads, dim])"
    )
    parser.add_argument(
        "--clean", action="store_true", help="only remove what killed runs left behind"
    )
    args = parser.parse_args()
    if args.blocks < 1:
        parser.error(f"--blocks: need at least 1 block, got {args.blocks}")
    unknown = sorted(set(args.link) - {link.gbit for link in LINKS})
    if unknown:
        known = ", ".join(f"{link.gbit:g}" for link in LINKS)
        parser.error(f"--link: no link of {unknown[0]:g} Gbit/s; the links are {known}")
    if os.geteuid() != 0:
        print(json.dumps({"metric": "wan.skipped", "reason": "needs root for network namespaces"}))
        return 0
    if args.clean:
        for name in remove_stale():
            print(f"removed {name}")
        return 0
    sigterm_as_exit()
    base = kv_blocks(args.kv_file)
    rounds, seed_rounds = (2, 1) if args.quick else (4, 2)
    for tag, link in enumerate(LINKS):
        if args.link and link.gbit not in args.link:
            continue
        try:
            queued = dataclasses.replace(link, queue=args.queue_mb << 20)
            run_link(queued, base, rounds=rounds, seed_rounds=seed_rounds, count=args.blocks,
                     threads=args.threads,
                     tag=tag, kv=args.kv_file or "computed",
                     processes=args.codec_processes, codecs=args.codec)  # fmt: skip
        except NetShapeError as exc:
            print(json.dumps({"metric": "wan.skipped", "reason": str(exc),
                              "link_Gbps": link.gbit, "rtt_ms": link.rtt_ms}))  # fmt: skip
            return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
