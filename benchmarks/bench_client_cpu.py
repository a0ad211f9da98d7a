"""Client CPU per byte and per request: s3kv vs raw GET/PUT, boto3 vs awscrt. JSON lines.

What bounds one process's throughput on a real NIC is the CPU its client spends per byte and
per request, not loopback MB/s. This measures the CPU time of this process (all threads,
user + system, ``time.process_time``) against a loopback SeaweedFS (a separate process, not
counted), on the same real SmolLM2 bf16 KV blocks as bench_s3.py (64 tokens, 1.47 MB), with
``--threads`` I/O threads, in one run:

* ``client.cpu_s_per_GB``: CPU-seconds per GB (10^9 raw bytes) for ``path`` =
  ``s3kv_save`` (KVStore.save: encode + PUT, then flush), ``s3kv_stage`` (KVStore.prefetch:
  GET + verify + decode into staging), ``raw_put`` / ``raw_get`` (the same blocks
  uncompressed through the same backend). ``per_wire_GB`` divides by the bytes that crossed
  the socket instead (s3kv stores fewer).
* ``client.cpu_ms_per_request``: CPU-ms per 4 KiB GET / PUT, where the request, not the
  byte, dominates.
* ``client.cores_for_100gbit``: cores that path needs to move a 100 Gbit/s NIC's worth of
  stored bytes (12.5 GB/s on the wire) = CPU-s per wire GB × 12.5. ``requests_per_s`` is the
  request rate that takes with these blocks and ``request_cores`` the part of the cores that
  the per-request cost (4 KiB figure) alone explains.

Each row names its ``client``: s3kv's S3Backend with ``s3_client`` = ``boto3`` (every request
through boto3) or ``crt`` (object GET/PUT through awscrt's S3 client, the one LMCache uses:
:mod:`s3kv.storage.crt`; list, HEAD and deletes stay on boto3), both opened by
``open_backend`` as the store opens its own. awscrt rows appear when ``awscrt`` imports.
``client.store_path_client`` names the client the default settings (``s3_client=auto``) pick
for the store path. Loopback TCP charges the kernel's copies to this process much as a NIC's
socket path would; the figures are the best of ``--passes``, because another process on the
machine only ever adds to them.

Usage: ``python benchmarks/bench_client_cpu.py [--quick] [--threads N]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy.typing as npt
from bench_s3 import identity

from s3kv.config import S3KVConfig
from s3kv.keys import ROOT_HASH, BlockHash, hash_block
from s3kv.staging import NumpyAllocator
from s3kv.storage import Backend, open_backend
from s3kv.store import KVStore
from s3kv.testing.local_s3 import LocalS3
from s3kv.testing.smollm2 import kv_blocks

NIC_BYTES_PER_S = 12.5e9  # 100 Gbit/s
SMALL = 4096
TOKENS_PER_BLOCK = 64


def emit(metric: str, value: float, unit: str, **extra: Any) -> None:
    print(json.dumps({"metric": metric, "value": round(value, 4), "unit": unit, **extra}))
    sys.stdout.flush()


@dataclass(frozen=True)
class Cost:
    """CPU and wall seconds of one pass over ``requests`` requests."""

    cpu_s: float
    wall_s: float
    raw_bytes: int
    wire_bytes: int
    requests: int


def timed(fn: Callable[[], object], raw: int, wire: int, requests: int) -> Cost:
    """Run ``fn`` and charge this process's CPU (all threads, user + system) to it."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    fn()
    return Cost(time.process_time() - cpu0, time.perf_counter() - wall0, raw, wire, requests)


def in_parallel(threads: int, fn: Callable[[int], object], n: int) -> None:
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fn, range(n)))


class Paths:
    """The passes of one client; each times only the transfers (opening a store is not)."""

    def __init__(self, cfg: S3KVConfig, backend: Backend, client: str,
                 blocks: list[npt.NDArray[Any]], threads: int) -> None:  # fmt: skip
        self.cfg, self.backend, self.client = cfg, backend, client
        self.blocks, self.threads = blocks, threads
        self.raw = sum(b.nbytes for b in blocks)
        self._round = 0
        self._salt = int.from_bytes(os.urandom(4), "big")  # distinct keys for each client
        self._keys: list[BlockHash] = []
        self._label = ""

    def _next(self) -> str:
        self._round += 1
        return f"{self.client}-{self._round}-{self._salt}"

    def _open(self) -> KVStore:
        return KVStore.open(self.cfg, identity(self._label), backend=self.backend,
                            allocator=NumpyAllocator())  # fmt: skip

    def s3kv_save(self) -> Cost:
        self._label = self._next()
        self._keys = [hash_block(ROOT_HASH, [self._round, self._salt, i])
                      for i in range(len(self.blocks))]  # fmt: skip
        store = self._open()

        def save() -> None:
            for key, block in zip(self._keys, self.blocks, strict=True):
                store.save(key, ROOT_HASH, block, dtype="bfloat16", shape=block.shape)
            store.flush()

        cost = timed(save, self.raw, 0, len(self.blocks))
        done = store.metrics.value("save_completed")
        stored = int(store.metrics.value("save_stored_bytes"))
        store.close()
        if done != len(self.blocks):
            raise SystemExit(f"{self.client}: {done:.0f} of {len(self.blocks)} saves completed")
        return dataclasses.replace(cost, wire_bytes=stored)

    def s3kv_stage(self) -> Cost:
        store = self._open()
        staged = 0

        def stage() -> None:
            nonlocal staged
            store.prefetch(self._keys)
            staged = store.wait_staged(self._keys, timeout=300)

        cost = timed(stage, self.raw, 0, len(self._keys))
        stored = int(store.metrics.value("stage_stored_bytes"))
        store.close()
        if staged != len(self._keys):
            raise SystemExit(f"{self.client}: {staged} of {len(self._keys)} blocks staged")
        return dataclasses.replace(cost, wire_bytes=stored)

    def raw_put(self) -> Cost:
        self._label = self._next()
        bodies = [b.tobytes() for b in self.blocks]  # NOTE: as the store's blobs, made before

        def put(i: int) -> None:
            self.backend.put(f"raw/{self._label}/{i}", bodies[i])

        n = len(self.blocks)
        return timed(lambda: in_parallel(self.threads, put, n), self.raw, self.raw, n)

    def raw_get(self) -> Cost:
        def get(i: int) -> None:
            if self.backend.get(f"raw/{self._label}/{i}") is None:
                raise SystemExit(f"{self.client}: raw/{self._label}/{i} missing")

        n = len(self.blocks)
        return timed(lambda: in_parallel(self.threads, get, n), self.raw, self.raw, n)

    def small_put(self, count: int) -> Cost:
        self._label = self._next()
        body = os.urandom(SMALL)

        def put(i: int) -> None:
            self.backend.put(f"small/{self._label}/{i}", body)

        size = SMALL * count
        return timed(lambda: in_parallel(self.threads, put, count), size, size, count)

    def small_get(self, count: int) -> Cost:
        def get(i: int) -> None:
            if self.backend.get(f"small/{self._label}/{i}") is None:
                raise SystemExit(f"{self.client}: small/{self._label}/{i} missing")

        size = SMALL * count
        return timed(lambda: in_parallel(self.threads, get, count), size, size, count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="2 passes, 32 blocks, 300 small")
    parser.add_argument("--threads", type=int, default=8, help="I/O threads (s3kv's default)")
    args = parser.parse_args()
    passes, small_count, copies = (2, 300, 1) if args.quick else (4, 1000, 2)
    blocks = kv_blocks(tokens_per_block=TOKENS_PER_BLOCK) * copies  # 32 blocks: 47 MB raw
    raw_bytes = sum(b.nbytes for b in blocks)
    try:
        import awscrt

        crt_version: str | None = awscrt.__version__
    except ImportError:
        crt_version = None

    with tempfile.TemporaryDirectory(prefix="s3kv-cpu-") as tmp:
        server = LocalS3.start(Path(tmp), bucket="cpu", die_with_parent=True)
        try:
            os.environ.update(server.env())
            cfg = S3KVConfig.load(io_threads=args.threads, staging_bytes=2 * raw_bytes,
                                  max_inflight_save_bytes=2 * raw_bytes)  # fmt: skip
            # NOTE: what the store opens with the default settings (s3_client=auto).
            default = open_backend(cfg)
            picked = str(getattr(default, "transport", type(default).__name__))
            default.close()
            clients: dict[str, Backend] = {"boto3": open_backend(cfg.replace(s3_client="boto3"))}
            if crt_version is not None:
                clients["awscrt"] = open_backend(cfg.replace(s3_client="crt"))
            paths = {name: Paths(cfg, b, name, blocks, args.threads) for name, b in clients.items()}
            best: dict[tuple[str, str], Cost] = {}

            def keep(client: str, path: str, cost: Cost) -> None:
                if (client, path) not in best or cost.cpu_s < best[client, path].cpu_s:
                    best[client, path] = cost

            for _ in range(passes):
                # NOTE: clients alternate inside each pass so that a burst of load from
                # another process on this machine lands on both, not on one.
                for name, p in paths.items():
                    keep(name, "s3kv_save", p.s3kv_save())
                    keep(name, "s3kv_stage", p.s3kv_stage())
                    keep(name, "raw_put", p.raw_put())
                    keep(name, "raw_get", p.raw_get())
                    keep(name, "small_put", p.small_put(small_count))
                    keep(name, "small_get", p.small_get(small_count))
            for backend in clients.values():
                backend.close()
        finally:
            server.stop(grace=2.0)

    common = {"threads": args.threads, "passes": passes, "link": "loopback",
              "awscrt": crt_version}  # fmt: skip
    emit("client.store_path_client", 1, "picked", client=picked, s3_client=cfg.s3_client,
         **common)  # fmt: skip
    for client in clients:
        extra = {"client": client, **common}
        per_request = {}
        for op in ("put", "get"):
            cost = best[client, f"small_{op}"]
            per_request[op] = cost.cpu_s / cost.requests * 1e3
            emit("client.cpu_ms_per_request", per_request[op], "ms", op=op, object_bytes=SMALL,
                 wall_req_per_s=round(cost.requests / cost.wall_s), **extra)  # fmt: skip
        for path in ("s3kv_save", "s3kv_stage", "raw_put", "raw_get"):
            cost = best[client, path]
            per_raw = cost.cpu_s / (cost.raw_bytes / 1e9)
            per_wire = cost.cpu_s / (cost.wire_bytes / 1e9)
            emit("client.cpu_s_per_GB", per_raw, "cpu-s/GB", path=path,
                 per_wire_GB=round(per_wire, 4),
                 cpu_ms_per_block=round(cost.cpu_s / cost.requests * 1e3, 3),
                 wall_MBps=round(cost.raw_bytes / cost.wall_s / 1e6, 1), **extra)  # fmt: skip
            requests_per_s = NIC_BYTES_PER_S / (cost.wire_bytes / cost.requests)
            op = "put" if path in ("s3kv_save", "raw_put") else "get"
            emit("client.cores_for_100gbit", per_wire * NIC_BYTES_PER_S / 1e9, "cores",
                 path=path, requests_per_s=round(requests_per_s),
                 request_cores=round(requests_per_s * per_request[op] / 1e3, 2),
                 raw_GBps=round(NIC_BYTES_PER_S * cost.raw_bytes / cost.wire_bytes / 1e9, 2),
                 **extra)  # fmt: skip


if __name__ == "__main__":
    main()
