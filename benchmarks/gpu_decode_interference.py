"""What slows decode steps while a prompt's saves are encoded: the connector against stand-ins.

After a cold prompt's prefill its blocks are encoded and written by the codec processes while
the engine decodes. Three things could slow those decode steps: the processes' CPU work on
the same host (cores, caches, memory bandwidth), the outcomes they send back, handled on the
engine's interpreter (the GIL), and the connector's own work in each step. This script
separates them with stand-ins on an executor without the connector (the model, pool size and
prompts of ``gpu_ab.py``; a fresh prompt per request; the variants rotate per trial):

* ``none`` — no connector, nothing else running;
* ``encoders`` — no connector; once the prefill's two iterations have run (where the connector
  hands the blocks over), 4 other processes each encode ``--blocks`` 1 MiB bf16 blocks with
  s3kv's codec: the codec processes' CPU work, with nothing coming back;
* ``gil`` — no connector; at that point a thread of this process runs ``--bursts`` bursts of
  ``--burst-ms`` of pure Python, ``--gap-ms`` apart: work on the engine's interpreter alone;
* ``connector`` — the connector, with ``--codec-processes`` codec processes.

Rows (JSON lines): ``gpu.decode_interference_ms`` per variant, the median over trials of the
host time of the decode steps after the first two iterations (``value``), with per step
position the median host ms (``steps_ms``) and the engine thread's CPU ms (``cpu_ms``; where
``steps_ms`` exceeds it, the step waited, e.g. for the GIL), ``over_none`` (value / none's
value) and ``extra_ms`` (value - none's: the decode time the variant cost in all; with
``--new-tokens`` long enough to outlast the saves, it compares settings that spread the same
work over more or fewer steps).

Usage: ``python benchmarks/gpu_decode_interference.py [--shape llama3-8b:8] [--trials 9]
[--codec-processes 4] [--new-tokens 16] [--variants none,connector] [--cuda-graphs on]``
(needs CUDA).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
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

PREFIX_TOKENS = 8128
NEW_TOKENS = 16
ENCODERS = 4
BLOCK_ELEMENTS = 1 << 19  # NOTE: 1 MiB of bf16, the size of one 8-layer Llama-3-8B block
VARIANTS = ("none", "encoders", "gil", "connector")


def encoder(conn: Connection) -> None:
    """A stand-in codec process: encodes the number of blocks it is sent, answers ``done``."""
    from s3kv import codec

    blocks = [
        torch.randn(BLOCK_ELEMENTS, dtype=torch.bfloat16).view(torch.uint8).numpy()
        for _ in range(8)
    ]
    conn.send("ready")
    while (count := conn.recv()) is not None:
        for i in range(count):
            codec.encode(blocks[i % 8], key=f"k{i}", dtype="bfloat16", shape=(BLOCK_ELEMENTS,))
        conn.send("done")


def bursts(count: int, burst_ms: float, gap_ms: float) -> None:
    """``count`` bursts of pure Python (holding the GIL but for its switch interval)."""
    for _ in range(count):
        time.sleep(gap_ms / 1e3)
        end = time.perf_counter() + burst_ms / 1e3
        total = 0
        while time.perf_counter() < end:
            for i in range(200):
                total += i


def one_request(
    executor: Any,
    prompt: list[int],
    variant: str,
    pipes: list[Connection],
    args: argparse.Namespace,
) -> tuple[list[float], list[float]]:
    """A cold prompt alone: host ms and engine-thread CPU ms of each decode step."""
    settle(executor)
    time.sleep(0.05)
    rid = executor.submit(prompt, args.new_tokens)
    executor.step()
    executor.step()
    burster = None
    if variant == "encoders":
        for pipe in pipes:
            pipe.send(args.blocks)
    elif variant == "gil":
        burster = threading.Thread(target=bursts, args=(args.bursts, args.burst_ms, args.gap_ms))
        burster.start()
    wall: list[float] = []
    cpu: list[float] = []
    while not executor.is_finished(rid):
        cpu_start, started = time.thread_time(), time.perf_counter()
        executor.step()
        wall.append((time.perf_counter() - started) * 1e3)
        cpu.append((time.thread_time() - cpu_start) * 1e3)
    executor.run_until_complete([rid])
    if variant == "encoders":
        for pipe in pipes:
            pipe.recv()
    if burster is not None:
        burster.join()
    return wall, cpu


def by_position(runs: list[list[float]]) -> list[float]:
    steps = min(len(run) for run in runs)
    return [round(statistics.median(run[i] for run in runs), 3) for i in range(steps)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="llama3-8b:8")
    parser.add_argument("--trials", type=int, default=9)
    parser.add_argument("--codec-processes", type=int, default=4)
    parser.add_argument(
        "--new-tokens", type=int, default=NEW_TOKENS, help="decode steps per request (+1)"
    )
    parser.add_argument("--blocks", type=int, default=64, help="blocks each encoder encodes")
    parser.add_argument("--bursts", type=int, default=6)
    parser.add_argument("--burst-ms", type=float, default=1.0)
    parser.add_argument("--gap-ms", type=float, default=8.0)
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="some of " + ", ".join(VARIANTS)
    )
    parser.add_argument(
        "--cuda-graphs", choices=("on", "off"), default="on",
        help="replay decode passes from captured CUDA graphs (TensorRT-LLM's default: on)",
    )  # fmt: skip
    args = parser.parse_args()
    variants = tuple(v for v in VARIANTS if v in args.variants.split(","))
    if "none" not in variants:
        raise SystemExit("Error: --variants must include none (the reference)")
    if not torch.cuda.is_available():
        print("gpu_decode_interference: needs CUDA", file=sys.stderr)
        return 2
    label, shape = parse_shape(args.shape)
    bucket = tempfile.mkdtemp(prefix="s3kv-interference-")
    os.environ.update(connector_settings(bucket, "s3kv-interference", "6GiB", args.codec_processes))
    _one_rank()
    context = multiprocessing.get_context("spawn")
    pipes: list[Connection] = []
    for _ in range(ENCODERS):
        ours, theirs = context.Pipe()
        context.Process(target=encoder, args=(theirs,), daemon=True).start()
        pipes.append(ours)
    for pipe in pipes:
        pipe.recv()
    llama = build_model(shape, "cuda", torch.bfloat16)
    blocks = 2 * pool_blocks({"prefix_tokens": PREFIX_TOKENS})
    graphs = args.cuda_graphs == "on"
    path = model_dir(bucket, label, shape)
    with_connector = executor_for(
        label, llama, connector=True, num_blocks=blocks, model_path=path, cuda_graphs=graphs
    )
    without = executor_for(
        label, llama, connector=False, num_blocks=blocks, model_path=path, cuda_graphs=graphs
    )
    drawn = prompts(shape["vocab"], PREFIX_TOKENS, args.trials * len(variants))
    warm_up(with_connector, *drawn["warmup"]["writer"])
    warm_up(without, *drawn["warmup"]["writer"])
    walls: dict[str, list[list[float]]] = {v: [] for v in variants}
    cpus: dict[str, list[list[float]]] = {v: [] for v in variants}
    trial_prompts = iter(drawn["trials"])
    for trial in range(args.trials):
        turn = trial % len(variants)
        for variant in variants[turn:] + variants[:turn]:
            prefix, suffix, _, _ = next(trial_prompts)
            executor = with_connector if variant == "connector" else without
            wall, cpu = one_request(executor, prefix + suffix, variant, pipes, args)
            walls[variant].append(wall)
            cpus[variant].append(cpu)
    totals = {v: statistics.median(sum(run) for run in walls[v]) for v in variants}
    for variant in variants:
        row = {
            "metric": "gpu.decode_interference_ms", "value": round(totals[variant], 2),
            "unit": "ms", "variant": variant,
            "over_none": round(totals[variant] / totals["none"], 3),
            "steps_ms": by_position(walls[variant]), "cpu_ms": by_position(cpus[variant]),
            "extra_ms": round(totals[variant] - totals["none"], 2),
            "shape": label, "trials": args.trials, "new_tokens": args.new_tokens,
            "codec_processes": args.codec_processes, "encoders": ENCODERS,
            "encoded_blocks": ENCODERS * args.blocks, "bursts": args.bursts,
            "burst_ms": args.burst_ms, "cuda_graphs": graphs,
            "device": torch.cuda.get_device_name(0),
        }  # fmt: skip
        print(json.dumps(row), flush=True)
    for pipe in pipes:
        pipe.send(None)
    _close_connector()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
