"""Save and stage pipelines against a real S3 server (SeaweedFS on loopback), side by side.

Prints JSON lines. Every comparison runs in this one process against the same server and the
same real SmolLM2 bf16 KV blocks (64 tokens, 1.47 MB each):

* ``save.raw_MBps``: KVStore.save (encode + PUT on the I/O pool) of all blocks, then flush.
* ``save.uncompressed_put_MBps``: the same blocks PUT raw with the same thread count.
* ``save.seed_style_MBps``: TensorRT-LLM's example connector's way: serially
  ``torch.save`` each block and PUT it.
* ``stage.raw_MBps``: KVStore.prefetch (GET + verify + decode into staging) of all blocks.
* ``stage.uncompressed_get_MBps`` / ``stage.seed_style_MBps``: parallel raw GET /
  serial GET + ``torch.load``.
* ``lookup.head_per_block_ms_32k_tokens``: answering "how many blocks of a 32K-token prompt
  exist" with one HEAD per block (1000 blocks), the way peers do; compare with
  ``lookup.us_32k_tokens`` from bench_manifest.py.

MB/s are raw (uncompressed) bytes per second. Client and server share this machine's cores.
Every row says ``"link": "loopback"``: no bandwidth limit and no RTT, so these ratios show
CPU, not what compression buys on a network; bench_wan.py measures the same comparisons
behind a shaped link.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from s3kv.config import S3KVConfig
from s3kv.keys import ROOT_HASH, BlockHash, ModelIdentity, hash_block
from s3kv.staging import NumpyAllocator
from s3kv.storage import Backend, open_backend
from s3kv.store import KVStore
from s3kv.testing.local_s3 import LocalS3
from s3kv.testing.smollm2 import kv_blocks

TOKENS_PER_BLOCK = 64


def emit(metric: str, value: float, unit: str, **extra: Any) -> None:
    row = {"metric": metric, "value": round(value, 3), "unit": unit, **extra, "link": "loopback"}
    print(json.dumps(row))
    sys.stdout.flush()


def identity(tag: str) -> ModelIdentity:
    return ModelIdentity(
        model_id=f"bench/{tag}",
        weights_revision="bench",
        dtype="bfloat16",
        kv_dtype="bfloat16",
        quantization="none",
        tokens_per_block=TOKENS_PER_BLOCK,
        kv_factor=2,
        block_elems=3 * TOKENS_PER_BLOCK * 64,
        num_layers=30,
        layout="bench",
    )


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def parallel(threads: int, fn: Callable[[int], object], n: int) -> None:
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fn, range(n)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds = 2 if args.quick else 4
    blocks = kv_blocks(tokens_per_block=TOKENS_PER_BLOCK)
    raw_bytes = sum(b.nbytes for b in blocks)
    threads = 8

    with tempfile.TemporaryDirectory(prefix="s3kv-bench-") as tmp:
        server = LocalS3.start(Path(tmp), bucket="bench")
        try:
            os.environ.update(server.env())
            cfg = S3KVConfig.load(io_threads=threads, staging_bytes=4 * raw_bytes)
            backend = open_backend(cfg)
            results: dict[str, list[float]] = {}

            def record(name: str, seconds: float) -> None:
                results.setdefault(name, []).append(raw_bytes / seconds / 1e6)

            for r in range(rounds):
                tag = f"r{r}"
                store = KVStore.open(cfg, identity(tag), allocator=NumpyAllocator())
                keys = [hash_block(ROOT_HASH, [r, i]) for i in range(len(blocks))]

                def save_all(store: KVStore = store, keys: list[BlockHash] = keys) -> None:
                    for key, block in zip(keys, blocks, strict=True):
                        store.save(key, ROOT_HASH, block, dtype="bfloat16", shape=block.shape)
                    store.flush()

                record("save.raw_MBps", timed(save_all))
                store.close()
                reader = KVStore.open(cfg, identity(tag), allocator=NumpyAllocator())

                def stage_all(reader: KVStore = reader, keys: list[BlockHash] = keys) -> None:
                    reader.prefetch(keys)
                    assert reader.wait_staged(keys, timeout=120) == len(keys)

                record("stage.raw_MBps", timed(stage_all))
                for key, block in zip(keys, blocks, strict=True):
                    staged = reader.staged(key)
                    assert staged is not None
                    assert staged.tobytes() == block.tobytes()
                reader.close()

                raw_keys = [f"raw/{tag}/{i}" for i in range(len(blocks))]
                record(
                    "save.uncompressed_put_MBps",
                    timed(
                        lambda k=raw_keys: parallel(
                            threads, functools.partial(put_raw, backend, k, blocks), len(blocks)
                        )
                    ),
                )
                record(
                    "stage.uncompressed_get_MBps",
                    timed(
                        lambda k=raw_keys: parallel(
                            threads, functools.partial(get_raw, backend, k), len(blocks)
                        )
                    ),
                )
                seed_keys = [f"seed/{tag}/{i}" for i in range(len(blocks))]
                record(
                    "save.seed_style_MBps", timed(lambda k=seed_keys: seed_save(backend, k, blocks))
                )
                record("stage.seed_style_MBps", timed(lambda k=seed_keys: seed_load(backend, k)))

            best = {name: max(values) for name, values in results.items()}
            for name, value in best.items():
                emit(
                    name,
                    value,
                    "MB/s",
                    rounds=rounds,
                    blocks=len(blocks),
                    block_MB=round(blocks[0].nbytes / 1e6, 3),
                    threads=threads,
                )
            emit(
                "save.ratio_vs_uncompressed_put",
                best["save.raw_MBps"] / best["save.uncompressed_put_MBps"],
                "x",
                target=1.3,
            )
            emit(
                "save.ratio_vs_seed_style",
                best["save.raw_MBps"] / best["save.seed_style_MBps"],
                "x",
                target=4.0,
            )
            emit(
                "stage.ratio_vs_uncompressed_get",
                best["stage.raw_MBps"] / best["stage.uncompressed_get_MBps"],
                "x",
                target=1.0,
            )
            emit(
                "stage.ratio_vs_seed_style",
                best["stage.raw_MBps"] / best["stage.seed_style_MBps"],
                "x",
                target=4.0,
            )
            head_per_block(backend)
            backend.close()
        finally:
            server.stop(grace=2.0)


def put_raw(backend: Backend, keys: list[str], blocks: list[np.ndarray], i: int) -> None:  # type: ignore[type-arg]
    backend.put(keys[i], blocks[i].tobytes())


def get_raw(backend: Backend, keys: list[str], i: int) -> None:
    backend.get(keys[i])


def seed_save(backend: Backend, keys: list[str], blocks: list[np.ndarray]) -> None:  # type: ignore[type-arg]
    import torch

    for key, block in zip(keys, blocks, strict=True):
        buffer = io.BytesIO()
        torch.save(torch.from_numpy(block.view(np.int16)).view(torch.bfloat16), buffer)
        backend.put(key, buffer.getvalue())


def seed_load(backend: Backend, keys: list[str]) -> None:
    import torch

    for key in keys:
        data = backend.get(key)
        assert data is not None
        torch.load(io.BytesIO(data))


def head_per_block(backend: Backend) -> None:
    """1000 blocks (32K tokens / 32 per block): one HEAD each, as peers' lookups do."""
    keys = [f"head/{i:04d}" for i in range(1000)]
    parallel(8, lambda i: backend.put(keys[i], b"x"), len(keys))
    start = time.perf_counter()
    for key in keys:
        backend.head(key)
    elapsed = time.perf_counter() - start
    emit(
        "lookup.head_per_block_ms_32k_tokens",
        elapsed * 1e3,
        "ms",
        blocks=len(keys),
        per_head_ms=round(elapsed * 1e3 / len(keys), 3),
    )


if __name__ == "__main__":
    main()
