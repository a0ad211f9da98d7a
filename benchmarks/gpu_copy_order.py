"""Why the worker queues save copies after the sampler's token copy: one copy engine, in order.

A prompt's KV blocks are copied device-to-host (D2H) on a side stream for saving; the engine's
sampler copies the new tokens D2H on its own stream and the host waits for them (the first
token's latency). Copy engines serve D2H copies in the order they were queued, whatever the
stream, so a token copy queued behind the blocks waits for all of them. Rows (JSON lines,
medians of 12 after 3 warm-ups):

* ``gpu.copy_order.bulk_ms`` — ``blocks`` one-MiB copies (one per block, as from scattered
  pool blocks) and the same bytes as one copy (``contiguous``): GPU time.
* ``gpu.copy_order.token_wait_ms`` — host time to read 16 tokens back: alone; queued after
  the blocks (per-block or one copy, a high-priority side stream); after 20 matmuls with
  and without the blocks queued behind the matmuls; and as the worker issues saves, after
  the token copy was queued, with the blocks ordered after the matmuls' event
  (``blocks_after: forward``) or after the token copy as well (``token``).

Usage: ``python benchmarks/gpu_copy_order.py [--blocks 254]`` (needs CUDA).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

MIB = 1 << 20


def emit(metric: str, value: float, unit: str, **extra: Any) -> None:
    print(json.dumps({"metric": metric, "value": round(value, 3), "unit": unit, **extra}))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=254)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_copy_order: skipped, no CUDA device", file=sys.stderr)
        return 0
    n = args.blocks
    pool = torch.empty((n + 8) * MIB, dtype=torch.uint8, device="cuda").view(n + 8, MIB)
    hosts = [torch.empty(MIB, dtype=torch.uint8, pin_memory=True) for _ in range(n)]
    whole = torch.empty(n * MIB, dtype=torch.uint8, pin_memory=True)
    tokens = torch.arange(16, device="cuda")
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    low, high = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-1)

    def queue_blocks(kind: str, side: torch.cuda.Stream, after: torch.cuda.Event) -> None:
        with torch.cuda.stream(side):
            side.wait_event(after)
            if kind == "blocks":
                torch._foreach_copy_(hosts, [pool[i] for i in range(n)], non_blocking=True)
            else:
                whole.copy_(pool[:n].reshape(-1), non_blocking=True)

    def token_wait(kind: str, side: torch.cuda.Stream = low, *, compute: bool = False) -> float:
        waits = []
        for _ in range(15):
            torch.cuda.synchronize()
            if compute:
                for _ in range(20):
                    x @ x
            after = torch.cuda.Event()
            after.record()
            if kind != "none":
                queue_blocks(kind, side, after)
            started = time.perf_counter()
            tokens.tolist()
            waits.append((time.perf_counter() - started) * 1e3)
        torch.cuda.synchronize()
        return statistics.median(waits[3:])

    host_tokens = torch.empty(16, dtype=tokens.dtype, pin_memory=True)

    def token_wait_issued_after(order: str) -> float:
        """The worker's sequence: a forward (20 matmuls), its event, the sampler (an argmax
        and the token copy) queued, then the blocks queued on the side stream, ordered after
        the ``forward`` event only or after the ``token`` copy too; host time until the
        tokens are in."""
        waits = []
        for _ in range(15):
            torch.cuda.synchronize()
            for _ in range(20):
                x @ x
            forward = torch.cuda.Event()
            forward.record()
            picked = torch.argmax(x[:16], dim=1)  # the sampler's kernels, after the forward
            host_tokens.copy_(picked, non_blocking=True)
            sampled = torch.cuda.Event()
            sampled.record()
            main = torch.cuda.current_stream()
            with torch.cuda.stream(low):
                low.wait_event(forward)
                if order == "token":
                    low.wait_stream(main)
                torch._foreach_copy_(hosts, [pool[i] for i in range(n)], non_blocking=True)
            started = time.perf_counter()
            sampled.synchronize()
            waits.append((time.perf_counter() - started) * 1e3)
        torch.cuda.synchronize()
        return statistics.median(waits[3:])

    def bulk(kind: str) -> float:
        times = []
        for _ in range(15):
            torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(low)
            queue_blocks(kind, low, start)
            stop.record(low)
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        return statistics.median(times[3:])

    device = torch.cuda.get_device_name()
    common = {"device": device, "blocks": n, "block_bytes": MIB}
    for kind in ("blocks", "contiguous"):
        emit("gpu.copy_order.bulk_ms", bulk(kind), "ms", copies=kind, **common)
    emit("gpu.copy_order.token_wait_ms", token_wait("none"), "ms", queued="nothing", **common)
    for kind in ("blocks", "contiguous"):
        emit("gpu.copy_order.token_wait_ms", token_wait(kind), "ms", queued=kind, **common)
    emit("gpu.copy_order.token_wait_ms", token_wait("blocks", high), "ms",
         queued="blocks", side_stream="high priority", **common)  # fmt: skip
    emit("gpu.copy_order.token_wait_ms", token_wait("none", compute=True), "ms",
         queued="20 matmuls", **common)  # fmt: skip
    emit("gpu.copy_order.token_wait_ms", token_wait("blocks", compute=True), "ms",
         queued="20 matmuls, then blocks", **common)  # fmt: skip
    for order in ("forward", "token"):
        emit("gpu.copy_order.token_wait_ms", token_wait_issued_after(order), "ms",
             queued="20 matmuls, the token copy, then blocks", blocks_after=order,
             **common)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
