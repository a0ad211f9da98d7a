"""Where a cold prompt's first token waits: the engine thread's first two iterations, timed.

In the overlap loop a cold prompt's prefill is queued in iteration 1 and its first token is
committed in iteration 2, after that iteration's forward pass is queued. This script runs the
same cold prompts through one executor with the connector and one without (the model, pool
size and prompts of ``gpu_ab.py``; the two alternate per trial), times the host calls of those
two iterations (the loop's steps, the model's launch, the connector's entry points, the
worker's hand-off of completed copies to the store, the waits on CUDA events) and the GPU
time at which each iteration's work ended, and prints the median trial's timeline of each.

Rows (JSON lines): ``gpu.timeline.ttft_ms`` per executor (``connector``: bool) with the
trials' values, and ``gpu.timeline.call`` per timed call of the median trial: ``name``,
``start_ms`` (from the request's submission), ``value`` (its milliseconds), ``iteration``.

Usage: ``python benchmarks/gpu_iteration_timeline.py [--shape llama3-8b:8] [--trials 7]``
(needs CUDA; ``--codec-processes`` as in ``gpu_ab.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from gpu_ab import (
    _close_connector,
    _one_rank,
    build_model,
    connector_settings,
    executor_for,
    model_dir,
    parse_shape,
    pool_blocks,
    prompts,
    settle,
    warm_up,
)

from s3kv.connector import trtllm, worker
from s3kv.testing.emulator import kernels, loop, model

PREFIX_TOKENS = 8128
NEW_TOKENS = 8


class Timeline:
    """Host calls timed while :attr:`on`: (name, start from :attr:`origin`, seconds)."""

    CALLS: tuple[tuple[Any, tuple[str, ...]], ...] = (
        (loop.ExecutorLoop, ("step", "_forward", "_update_requests",
                             "_terminate_finished_transfers")),
        (model.PagedLlama, ("launch_forward",)),
        (trtllm.S3KVConnectorScheduler, ("get_num_new_matched_tokens", "build_connector_meta")),
        (trtllm.S3KVConnectorWorker, ("start_load_kv", "wait_for_save", "get_finished")),
        (worker.WorkerCore, ("_issue", "_hand_to_store")),
        (kernels.DeviceTokens, ("copy_to_host",)),
        (torch.cuda.Event, ("synchronize",)),
    )  # fmt: skip

    def __init__(self) -> None:
        self.on = False
        self.origin = 0.0
        self.iteration = 0
        self.calls: list[tuple[str, float, float, int]] = []
        for owner, names in self.CALLS:
            for name in names:
                setattr(owner, name, self._timed(f"{owner.__name__}.{name}", getattr(owner, name)))

    def _timed(self, label: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return real(*args, **kwargs)
            started = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                ended = time.perf_counter()
                self.calls.append(
                    (label, (started - self.origin) * 1e3, (ended - started) * 1e3, self.iteration)
                )

        return timed


def one_request(executor: Any, prompt: list[int], timeline: Timeline) -> dict[str, Any]:
    """A cold prompt alone; its TTFT, its first two iterations' calls and GPU end times."""
    settle(executor)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    timeline.calls = []
    timeline.origin = time.perf_counter()
    timeline.on = True
    rid = executor.submit(prompt, NEW_TOKENS)
    ends = []
    for iteration in (1, 2):
        timeline.iteration = iteration
        executor.step()
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end.record()
        ends.append(((time.perf_counter() - timeline.origin) * 1e3, end))
    timeline.on = False
    executor.run_until_complete([rid])
    result = executor.result(rid)
    torch.cuda.synchronize()
    return {
        "ttft_ms": result.ttft_s * 1e3,
        "calls": timeline.calls,
        "host_end_ms": [round(host, 3) for host, _ in ends],
        "gpu_end_ms": [round(start.elapsed_time(event), 3) for _, event in ends],
    }


def emit(metric: str, value: Any, unit: str, **extra: Any) -> None:
    print(json.dumps({"metric": metric, "value": value, "unit": unit, **extra}))
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="llama3-8b:8")
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--codec-processes", type=int, default=4)
    parser.add_argument("--min-ms", type=float, default=0.05, help="calls shorter are not printed")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_iteration_timeline: needs CUDA", file=sys.stderr)
        return 2
    label, shape = parse_shape(args.shape)
    bucket = tempfile.mkdtemp(prefix="s3kv-timeline-")
    os.environ.update(connector_settings(bucket, "s3kv-timeline", "6GiB", args.codec_processes))
    _one_rank()
    timeline = Timeline()
    llama = build_model(shape, "cuda", torch.bfloat16)
    blocks = pool_blocks({"prefix_tokens": PREFIX_TOKENS})
    path = model_dir(bucket, label, shape)
    executors = {
        flag: executor_for(label, llama, connector=flag, num_blocks=blocks, model_path=path)
        for flag in (True, False)
    }
    drawn = prompts(shape["vocab"], PREFIX_TOKENS, args.trials)
    for executor in executors.values():
        warm_up(executor, *drawn["warmup"]["writer"])
    runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    for k, (prefix, suffix, _, _) in enumerate(drawn["trials"]):
        for connector in (k % 2 == 0, k % 2 != 0):
            runs[connector].append(one_request(executors[connector], prefix + suffix, timeline))
    common = {
        "shape": label,
        "codec_processes": args.codec_processes,
        "device": torch.cuda.get_device_name(0),
        "prompt_tokens": PREFIX_TOKENS + 24,
    }
    for connector, trials in runs.items():
        values = [t["ttft_ms"] for t in trials]
        middle = sorted(trials, key=lambda t: t["ttft_ms"])[len(trials) // 2]
        emit("gpu.timeline.ttft_ms", round(statistics.median(values), 3), "ms",
             connector=connector, per_trial=[round(v, 2) for v in values],
             host_end_ms=middle["host_end_ms"], gpu_end_ms=middle["gpu_end_ms"],
             **common)  # fmt: skip
        for name, start, length, iteration in middle["calls"]:
            if length >= args.min_ms or name.endswith("synchronize"):
                emit("gpu.timeline.call", round(length, 3), "ms", name=name,
                     start_ms=round(start, 3), iteration=iteration, connector=connector,
                     **common)  # fmt: skip
    _close_connector()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
