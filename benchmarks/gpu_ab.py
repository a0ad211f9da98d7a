"""GPU A/B that isolates the connector: a prefix reused from device memory vs loaded by s3kv.

Same engine (the emulated TensorRT-LLM runtime on CUDA), same model, same prompt, two warm
paths for a request ``P + S2`` (prefix ``P`` of ``--prompt-tokens`` whole blocks, a fresh
40-token suffix ``S2``):

* **(a) device reuse** — in the *writer* process, request ``P + S1`` computed ``P`` cold
  (and s3kv saved its blocks); ``P + S2`` then finds ``P`` in the KV pool by block reuse.
* **(b) s3kv** — in a *reader* process started afterwards, the connector's warm start staged
  the saved blocks in pinned host memory; ``P + S2`` claims ``P`` and the worker loads it.

Both compute exactly ``S2`` over the same prefix bytes, so their outputs must be
bit-identical, and what s3kv adds is ``gpu.load_overhead_ms = TTFT(b) - TTFT(a)`` (the
median over trials of the per-prefix difference; each trial is a different prefix, the
reader's pool never held it). Its physical floor is ``gpu.load_bytes`` over the pinned
block-scatter bandwidth measured in the reader (``gpu.pinned_scatter_GBps``: one
``non_blocking`` copy per block from page-locked host memory into the pool at the block
ids the loads used, timed with CUDA events while queued behind a GPU sleep, so it is the
copy engine's rate and not the host's enqueue rate). Target:
``load_overhead_ms <= 1.25 * floor + 2 ms``.

Saving costs are measured in the writer on one model with two executors, one with the
connector and one without, trial by trial: cold TTFT of ``P + S1`` and the decode step time
(``gpu.save_overhead_pct``, target <= 3 %). Each trial runs both executors back to back (in
alternating order), ``--cold-repeats`` cold prompts each, taking turns; the prefill figure is
the median over trials of each trial's ratio of the executors' quickest cold TTFT (the
decode figure: of each trial's decode step times, one cold prompt each). The
device host's load drifts by ±10-40% between trials and bursts within one (the plain
executor's cold TTFT of one run moved between 21.9 and 36.9 ms), which a ratio of the two
medians of single prompts carried whole. That ratio of medians is kept in each row as
``median_ratio_pct``. On the H200 hosts a trial's quickest cold TTFT is either ~22 ms or
28-40 ms for SmolLM2 at 8K, as often without the connector as with it (and with the codec
in threads): ``slow_trials`` counts each side's trials over 1.15x the run's quickest, and
``quiet_pairs_pct`` is the paired median over the ``quiet_pairs`` trials where neither
side was, which a pair split between the two modes (+-50%) does not move.

Everything runs in new processes (spawned, one rank each): the writer, then the reader, per
shape. Weights are seeded random tensors drawn on the device (no checkpoint, no HF init), so
the writer and the reader hold the same model. Shapes (``--shapes``):

* ``smollm2-135m`` — 30 layers, 9 query / 3 KV heads of 64, hidden 576, FFN 1536;
* ``llama3-8b`` — Llama-3-8B's layer geometry (hidden 4096, 32 query / 8 KV heads of 128,
  FFN 14336, vocab 128256); ``llama3-8b:8`` is an 8-layer slice of it.

bf16 weights, activations and KV; 32 tokens per block (TensorRT-LLM's default
``tokens_per_block`` is 32 too); block reuse on, partial reuse off; the overlap loop. Prints
JSON lines, a table last, and writes ``--out``/gpu_ab.json::

    PYTHONPATH=. python3 benchmarks/gpu_ab.py --out $OUT
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from s3kv.testing.emulator.executor import GenerationResult, PyExecutorEmulator
from s3kv.testing.emulator.instance import S3KV_CONNECTOR
from s3kv.testing.emulator.llm_args import KvCacheConfig, TorchLlmArgs
from s3kv.testing.emulator.model import PagedLlama
from s3kv.testing.emulator.parallel import run_tensor_parallel

TPB = 32
SUFFIX = 24  # NOTE: under one block: neither measured request saves a block of its own
SEED = 7

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "layers": 30, "hidden": 576, "heads": 9, "kv_heads": 3, "head_dim": 64,
        "intermediate": 1536, "vocab": 49152, "rope_theta": 1e5, "tied": True,
    },
    "llama3-8b": {
        "layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128,
        "intermediate": 14336, "vocab": 128256, "rope_theta": 5e5, "tied": False,
    },
}  # fmt: skip


def parse_shape(text: str) -> tuple[str, dict[str, Any]]:
    """``name`` or ``name:layers`` (a slice of the first ``layers`` layers)."""
    name, _, layers = text.partition(":")
    if name not in SHAPES:
        raise SystemExit(f"Error: --shapes: unknown shape {name!r}; known: {', '.join(SHAPES)}")
    shape = dict(SHAPES[name])
    label = name
    if layers:
        shape["layers"] = int(layers)
        label = f"{name}/{layers}L-slice"
    return label, shape


# --- the model: seeded random weights drawn on the device ---


def build_model(shape: dict[str, Any], device: str, dtype: torch.dtype) -> PagedLlama:
    """A :class:`PagedLlama` of ``shape`` with weights from a seeded generator on ``device``.

    NOTE: drawn directly on the device (a few ms on a GPU) instead of initialising an HF
    model on the CPU (tens of seconds for the 8B geometry); ``from_hf`` only reads the
    attributes built here, and the same seed gives the same weights in every process.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(SEED)

    def weight(*size: int) -> torch.Tensor:
        out = torch.randn(*size, generator=generator, device=device, dtype=dtype)
        return out.mul_(0.02)

    def linear(rows: int, cols: int) -> SimpleNamespace:
        return SimpleNamespace(weight=weight(rows, cols), bias=None)

    def norm() -> SimpleNamespace:
        return SimpleNamespace(weight=torch.ones(shape["hidden"], device=device, dtype=dtype))

    hidden, head_dim = shape["hidden"], shape["head_dim"]
    q_out, kv_out = shape["heads"] * head_dim, shape["kv_heads"] * head_dim
    layers = [
        SimpleNamespace(
            self_attn=SimpleNamespace(
                q_proj=linear(q_out, hidden), k_proj=linear(kv_out, hidden),
                v_proj=linear(kv_out, hidden), o_proj=linear(hidden, q_out),
            ),
            mlp=SimpleNamespace(
                gate_proj=linear(shape["intermediate"], hidden),
                up_proj=linear(shape["intermediate"], hidden),
                down_proj=linear(hidden, shape["intermediate"]),
            ),
            input_layernorm=norm(), post_attention_layernorm=norm(),
        )
        for _ in range(shape["layers"])
    ]  # fmt: skip
    embed = weight(shape["vocab"], hidden)
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    config = SimpleNamespace(
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        head_dim=head_dim, hidden_size=hidden, intermediate_size=shape["intermediate"],
        hidden_act="silu", rms_norm_eps=1e-5,
    )  # fmt: skip
    hf = SimpleNamespace(
        config=config,
        model=SimpleNamespace(
            layers=layers, embed_tokens=SimpleNamespace(weight=embed), norm=norm(),
            rotary_emb=SimpleNamespace(
                rope_type="default", attention_scaling=1.0,
                original_inv_freq=1.0 / (shape["rope_theta"] ** exponent),
            ),
        ),
        lm_head=SimpleNamespace(weight=embed if shape["tied"] else weight(shape["vocab"], hidden)),
    )  # fmt: skip
    return PagedLlama.from_hf(hf, device=device, dtype=dtype, kv_dtype=dtype, tokens_per_block=TPB)


def prompts(vocab: int, prefix_tokens: int, trials: int, cold_repeats: int = 1) -> dict[str, Any]:
    """Per trial a prefix and two suffixes (and ``cold_repeats - 1`` more cold prompts); a
    unique warm-up prompt per process role."""
    rng = np.random.default_rng(SEED)

    def draw(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, vocab, size=n)]

    return {
        "trials": [
            (draw(prefix_tokens), draw(SUFFIX), draw(SUFFIX), draw(SUFFIX)) for _ in range(trials)
        ],
        "warmup": {role: (draw(prefix_tokens), draw(SUFFIX)) for role in ("writer", "reader")},
        "profile": (draw(prefix_tokens), draw(SUFFIX), draw(SUFFIX)),
        # NOTE: drawn last, so that the prompts above stay those of earlier runs
        "cold_extra": [
            [draw(prefix_tokens + SUFFIX) for _ in range(cold_repeats - 1)] for _ in range(trials)
        ],
    }


# --- one process ---


def model_dir(root: str, label: str, shape: dict[str, Any]) -> str:
    """A folder in ``root`` (the run's own temporary folder) named for the random model, with
    its ``config.json`` as a checkpoint's: the connector reads the head size there to record
    5-D blocks (the PLANES_REF geometry). The writer's and the reader's processes are given
    the same path, so both have the same model id."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", label)
    folder = Path(root) / f"random-{name}-seed{SEED}"
    folder.mkdir(exist_ok=True)
    config = {
        "num_hidden_layers": shape["layers"], "hidden_size": shape["hidden"],
        "num_attention_heads": shape["heads"], "num_key_value_heads": shape["kv_heads"],
        "head_dim": shape["head_dim"],
    }  # fmt: skip
    staged = folder / f"config.json.{os.getpid()}.tmp"
    staged.write_text(json.dumps(config))
    os.replace(staged, folder / "config.json")  # NOTE: never read half-written
    return str(folder)


def executor_for(
    label: str,
    model: PagedLlama,
    *,
    connector: bool,
    num_blocks: int,
    model_path: str,
    cuda_graphs: bool = True,
) -> PyExecutorEmulator:
    """The emulated engine of the model at ``model_path`` (:func:`model_dir`); ``cuda_graphs``
    replays decode passes from captured graphs, as TensorRT-LLM does by default
    (``cuda_graph_config``, on unless set to ``None``)."""
    args = TorchLlmArgs(
        cuda_graph_config=object() if cuda_graphs else None,
        model=model_path,
        dtype="bfloat16",
        max_num_tokens=8192 + 1024,
        disable_overlap_scheduler=False,
        kv_cache_config=KvCacheConfig(
            tokens_per_block=TPB, enable_block_reuse=True, enable_partial_reuse=False
        ),
        kv_connector_config=S3KV_CONNECTOR if connector else None,
    )
    # NOTE: with one rank TensorRT-LLM hands the workers the scheduler's metadata object
    # itself (mpi_broadcast at one rank, tensorrt_llm/_utils.py @ed53795b), not a pickled
    # copy as the emulator's tests do: the copy's cost is not the engine's.
    return PyExecutorEmulator(args, model, num_blocks=num_blocks, copy_leader_results=False)


class ConnectorTimer:
    """Host time spent inside the connector's entry points (wrapped at class level)."""

    METHODS: tuple[tuple[str, str], ...] = (
        ("S3KVConnectorScheduler", "get_num_new_matched_tokens"),
        ("S3KVConnectorScheduler", "update_state_after_alloc"),
        ("S3KVConnectorScheduler", "build_connector_meta"),
        ("S3KVConnectorScheduler", "request_finished"),
        ("S3KVConnectorWorker", "start_load_kv"),
        ("S3KVConnectorWorker", "wait_for_layer_load"),
        ("S3KVConnectorWorker", "save_kv_layer"),
        ("S3KVConnectorWorker", "wait_for_save"),
        ("S3KVConnectorWorker", "get_finished"),
    )

    def __init__(self) -> None:
        from s3kv.connector import trtllm

        self.totals: dict[str, float] = {}
        for cls_name, name in self.METHODS:
            cls = getattr(trtllm, cls_name)
            real = getattr(cls, name)
            setattr(cls, name, self._wrap(name, real))

    def _wrap(self, name: str, real: Any) -> Any:
        totals = self.totals

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - started

        return timed

    def take(self) -> dict[str, float]:
        out = {k: round(v * 1e3, 3) for k, v in self.totals.items()}
        self.totals.clear()
        return out


def serve(executor: PyExecutorEmulator, prompt: list[int], new_tokens: int) -> GenerationResult:
    """One request, alone; its result once generated (saves may still be in flight)."""
    rid = executor.submit(prompt, new_tokens)
    executor.run_until_complete([rid])
    return executor.result(rid)


def measured(
    executor: PyExecutorEmulator, prompt: list[int], new_tokens: int, timer: ConnectorTimer | None
) -> dict[str, Any]:
    """One request, alone, with the host time of its first iteration and its connector time.

    NOTE: a full garbage collection first, so that neither path pays for the other's garbage;
    collections during the request still happen and are timed (``gc_ms``).
    """
    gc.collect()
    GC_TIMES.clear()
    if timer is not None:
        timer.take()
    threads_before = thread_cpu_ms()
    rid = executor.submit(prompt, new_tokens)
    gpu = _GpuSpan()
    started = time.perf_counter()
    executor.step()  # NOTE: allocation, claim, load and the prefill are queued in this one
    iter1 = time.perf_counter() - started
    gpu.end()
    iter1_connector = timer.take() if timer is not None else {}
    gc_iter1 = sum(GC_TIMES)
    started = time.perf_counter()
    executor.step()  # NOTE: overlap: the next step is queued, then the prefill synchronised
    iter2 = time.perf_counter() - started
    gc_iter2 = sum(GC_TIMES) - gc_iter1
    iter2_connector = timer.take() if timer is not None else {}
    blocks = list(executor.kv_cache_manager.sequences().get(rid, []))
    steps: list[list[float]] = []  # NOTE: [host ms, saves still with the codec] per step
    while not executor.is_finished(rid):
        started = time.perf_counter()
        executor.step()
        steps.append([round((time.perf_counter() - started) * 1e3, 3), _saves_outstanding()])
    executor.run_until_complete([rid])
    result = executor.result(rid)
    threads_after = thread_cpu_ms()
    return {
        "thread_cpu_ms": {
            name: round(ms - threads_before.get(name, 0.0), 1)
            for name, ms in threads_after.items()
            if ms - threads_before.get(name, 0.0) > 0
        },
        "ttft_ms": result.ttft_s * 1e3,
        "token_after_iter1_ms": result.ttft_s * 1e3 - iter1 * 1e3,
        "decode_ms": decode_step_ms(result),
        "iter1_ms": iter1 * 1e3,
        "iter2_ms": iter2 * 1e3,
        "iter1_gpu_ms": gpu.elapsed_ms(),
        "iter1_connector_ms": iter1_connector,
        "iter2_connector_ms": iter2_connector,
        "iter1_gc_ms": round(gc_iter1 * 1e3, 3),
        "iter2_gc_ms": round(gc_iter2 * 1e3, 3),
        "reuse_tokens": result.reused_tokens,
        "connector_tokens": result.connector_tokens,
        "output": list(result.output_tokens),
        "blocks": blocks,
        "connector_ms": _summed(
            _summed(iter1_connector, iter2_connector), timer.take() if timer is not None else {}
        ),
        "gc_ms": round(sum(GC_TIMES) * 1e3, 3),
        "steps": steps,
    }


def _saves_outstanding() -> int:
    """Jobs the connector's stores have handed to codec processes and not heard back on."""
    from s3kv.connector.shared import process_state

    total = 0
    for store in list(process_state().stores.values()):
        offload = getattr(store, "_offload", None)
        total += offload.outstanding if offload is not None else 0
    return total


class _GpuSpan:
    """GPU time from now to the end of the work queued on the current stream by :meth:`end`
    (NaN on the CPU): with the host ahead, the device's time for that work."""

    def __init__(self) -> None:
        self._events: list[Any] = []
        if torch.cuda.is_available():
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events.append(start)

    def end(self) -> None:
        if self._events:
            stop = torch.cuda.Event(enable_timing=True)
            stop.record()
            self._events.append(stop)

    def elapsed_ms(self) -> float:
        if len(self._events) < 2:
            return math.nan
        self._events[1].synchronize()
        return float(self._events[0].elapsed_time(self._events[1]))


def thread_cpu_ms() -> dict[str, float]:
    """CPU milliseconds used so far by this process's threads, by name (numbered siblings
    such as ``s3kv-io-3`` summed): who else ran on the engine's process. From
    ``/proc/.../schedstat`` (nanoseconds on a CPU), else ``stat``'s user + system ticks."""
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    used: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as fh:
                ms = int(fh.read().split()[0]) / 1e6
        except (OSError, ValueError, IndexError):
            try:
                with open(f"/proc/self/task/{tid}/stat") as fh:
                    fields = fh.read().rpartition(")")[2].split()
            except OSError:
                continue
            ms = (int(fields[11]) + int(fields[12])) * tick_ms
        name = names.get(int(tid), "native")
        name = "engine" if name == "MainThread" else name.rstrip("0123456789").rstrip("-")
        used[name] = used.get(name, 0.0) + ms
    return used


GC_TIMES: list[float] = []  # seconds of each collection during the measured request
_GC_STARTED: list[float] = []


def _gc_timer(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _GC_STARTED[:] = [time.perf_counter()]
    elif _GC_STARTED:
        GC_TIMES.append(time.perf_counter() - _GC_STARTED[0])


gc.callbacks.append(_gc_timer)


def settle(executor: PyExecutorEmulator) -> None:
    """Let every save finish (device copies, encoding, upload) so the next request runs alone."""
    executor.drain()
    from s3kv.connector.shared import process_state

    for store in list(process_state().stores.values()):
        store.flush(timeout=300)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_step_ms(result: GenerationResult) -> float:
    steps = len(result.output_tokens) - 1
    return (result.latency_s - result.ttft_s) * 1e3 / max(1, steps)


def warm_up(executor: PyExecutorEmulator, prefix: list[int], suffix: list[int]) -> None:
    """First-call costs (kernel choice, allocator growth) out of the measured requests.

    A cold prefill of the full length, then a suffix over it by device reuse: the same
    shapes the measured requests use, on a prefix no measured request shares.
    """
    serve(executor, prefix + suffix[:1], 2)
    serve(executor, prefix + suffix, 2)
    settle(executor)


def pool_blocks(job: dict[str, Any]) -> int:
    """Room for the warm-up prefix, the current trial's prefix and decode, with slack."""
    return 4 * (job["prefix_tokens"] // TPB + 4)


def writer(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """Cold prefills with and without the connector, then (a): the device-reuse hit."""
    _one_rank()
    timer = ConnectorTimer()
    model = build_model(job["shape"], job["device"], torch.bfloat16)
    check = attention_check(job["shape"], job["device"])
    graphs = job["cuda_graphs"]
    blocks, path = pool_blocks(job), job["model_path"]
    conn = executor_for(
        job["label"], model, connector=True, num_blocks=blocks, model_path=path, cuda_graphs=graphs
    )
    ref = executor_for(
        job["label"], model, connector=False, num_blocks=blocks, model_path=path, cuda_graphs=graphs
    )
    warm = job["prompts"]["warmup"]["writer"]
    warm_up(conn, *warm)
    warm_up(ref, *warm)
    rows = []
    for k, (prefix, s1, s2, _) in enumerate(job["prompts"]["trials"]):
        row: dict[str, Any] = {}
        order = [("ref", ref), ("conn", conn)] if k % 2 == 0 else [("conn", conn), ("ref", ref)]
        for name, executor in order:
            cold = measured(executor, prefix + s1, job["new_tokens"], timer)
            settle(executor)
            reuse = measured(executor, prefix + s2, job["new_tokens"], timer)
            settle(executor)
            row[name] = {"cold": cold, "reuse": reuse, "cold_ttft_ms": [cold["ttft_ms"]]}
        # NOTE: more cold prompts, the two executors taking turns: a trial's figure is each
        # executor's quickest, which a burst of load on the shared host cannot inflate.
        for prompt in job["prompts"]["cold_extra"][k]:
            for name, executor in order:
                extra = measured(executor, prompt, job["new_tokens"], timer)
                settle(executor)
                row[name]["cold_ttft_ms"].append(extra["ttft_ms"])
        rows.append(row)
        cold = {name: [round(t, 2) for t in row[name]["cold_ttft_ms"]] for name in row}
        _log(job, f"writer trial {k}: a={row['conn']['reuse']['ttft_ms']:.2f} ms, cold {cold}")
    if job["profile"]:
        prefix, s1, s2 = job["prompts"]["profile"]
        for name, executor in (("cold-ref", ref), ("cold", conn)):
            profiled(
                job, name, lambda e=executor: measured(e, prefix + s1, job["new_tokens"], None)
            )
            settle(executor)
        profiled(job, "a", lambda: measured(conn, prefix + s2, job["new_tokens"], None))
    settle(conn)
    metrics, _ = _connector_metrics()
    _close_connector()
    return {
        "trials": rows, "device": _device_name(job["device"]), "attention_check": check,
        "metrics": metrics,
    }  # fmt: skip


def attention_check(shape: dict[str, Any], device: str) -> dict[str, float]:
    """The fused attention the emulator uses on CUDA against the reference formulation.

    A suffix of 24 queries over 8K keys with the shape's heads: flash attention with a
    lower-right causal bias vs the math kernel with the explicit mask, in bf16; relative
    error of the outputs (bf16 operands: expect about 1e-3 to 1e-2).
    """
    if not device.startswith("cuda"):
        return {}
    from torch.nn.attention.bias import causal_lower_right

    generator = torch.Generator(device=device)
    generator.manual_seed(SEED + 1)
    queries, keys, dim = SUFFIX, 8192, shape["head_dim"]

    def draw(heads: int, rows: int) -> torch.Tensor:
        return torch.randn(1, heads, rows, dim, generator=generator, device=device).bfloat16()

    q, k, v = (
        draw(shape["heads"], queries),
        draw(shape["kv_heads"], keys),
        draw(shape["kv_heads"], keys),
    )
    fast = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(queries, keys), enable_gqa=True
    )
    positions = torch.arange(keys - queries, keys, device=device)
    mask = torch.arange(keys, device=device)[None, :] <= positions[:, None]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        slow = torch.nn.functional.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True
        )
    error = float((fast.double() - slow).norm() / slow.norm())
    return {"relative_error": error}


def reader(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """(b): a new process whose connector warm-started from the bucket loads each prefix."""
    _one_rank()
    timer = ConnectorTimer()
    model = build_model(job["shape"], job["device"], torch.bfloat16)
    started = time.perf_counter()
    conn = executor_for(
        job["label"], model, connector=True, num_blocks=pool_blocks(job),
        model_path=job["model_path"],
        cuda_graphs=job["cuda_graphs"],
    )  # fmt: skip
    startup_s = time.perf_counter() - started
    warm_up(conn, *job["prompts"]["warmup"]["reader"])
    manager = conn.connector_manager
    core = getattr(manager.worker, "core", None) if manager is not None else None
    rows = []
    variants = job["load_groups"]
    for k, (prefix, _, s2, s3) in enumerate(job["prompts"]["trials"]):
        variant = variants[k % len(variants)]
        if variant and hasattr(core, "set_load_groups"):
            core.set_load_groups(int(variant))
        hit = measured(conn, prefix + s2, job["new_tokens"], timer)
        hit["variant"] = variant
        settle(conn)
        # NOTE: (a) again, in this process right after (b): the prefix s3kv just loaded,
        # reused from device memory by another suffix. The pair shares the process's state
        # (heap, threads, codec processes) and the minute, which the writer's (a) does not.
        hit["reuse_after"] = measured(conn, prefix + s3, job["new_tokens"], timer)
        settle(conn)
        rows.append(hit)
        _log(job, f"reader trial {k} ({variant or 'default'}): b={hit['ttft_ms']:.2f} ms")
    if hasattr(core, "set_load_groups"):
        core.set_load_groups(_default_group_bytes())
    if job["profile"]:
        prefix, _, s2 = job["prompts"]["profile"]
        profiled(job, "b", lambda: measured(conn, prefix + s2, job["new_tokens"], None))
        settle(conn)
    metrics, staged = _connector_metrics()
    # NOTE: the last trial that loaded: with more trials than the warm start holds (15 of
    # SmolLM2's with 3 cold repeats against 6 GiB), the last one may have loaded nothing.
    loaded = [r for r in rows if r["connector_tokens"]]
    load_blocks = loaded[-1]["blocks"][: loaded[-1]["connector_tokens"] // TPB] if loaded else []
    scatter = scatter_bandwidth(conn.pool, load_blocks)
    _close_connector()
    return {
        "trials": rows, "scatter": scatter, "startup_s": startup_s, "warm_blocks": staged,
        "metrics": metrics, "block_nbytes": int(conn.pool[0].numel() * conn.pool.element_size()),
    }  # fmt: skip


def codec_processes_arg(text: str) -> int | str:
    """``--codec-processes``: ``auto`` or a count (the setting checks its range)."""
    return "auto" if text.strip().lower() == "auto" else int(text)


def connector_settings(
    bucket: str, name: str, staging: str, codec_processes: int | str
) -> dict[str, str]:
    """The connector's settings (its environment) in the benchmarks: a ``file://`` bucket
    named ``name`` in the folder ``bucket``, ``staging`` bytes, ``codec_processes``."""
    return {
        "TLLM_S3KV_ENDPOINT_URL": f"file://{bucket}", "TLLM_S3KV_BUCKET": name,
        "TLLM_S3KV_MODEL_REVISION": f"random-seed-{SEED}",
        "TLLM_S3KV_MANIFEST_COMPACTION": "off",  # NOTE: a 20 s maintenance cycle, no load
        "TLLM_S3KV_STAGING_BYTES": staging,
        "TLLM_S3KV_CODEC_PROCESSES": str(codec_processes),
    }  # fmt: skip


def _one_rank() -> None:
    """TensorRT-LLM at TP=1: the leader's answers need no collective (no gloo round trips).

    NOTE: ``run_tensor_parallel`` installs gloo collectives even for one rank; each
    ``handle_metadata`` / ``get_finished`` would then pay a gloo broadcast or all-gather
    that an engine with one rank does not.
    """
    from s3kv.connector.comm import SingleProcess, install_collectives

    install_collectives(SingleProcess())
    cpus = os.environ.get("S3KV_AB_ENGINE_CPUS", "")
    if cpus:
        # NOTE: as a launcher pins a rank (taskset, numactl): the codec processes this
        # process starts later see the mask (codec_cpus=auto moves them off it).
        from s3kv.config import parse_cpu_list

        os.sched_setaffinity(0, parse_cpu_list(cpus))


def _default_group_bytes() -> int:
    from s3kv.connector import worker

    return int(getattr(worker, "LOAD_GROUP_MIN_BYTES", 1 << 20))


def profiled(job: dict[str, Any], name: str, run: Any) -> None:
    """Run ``run`` under cProfile and the torch profiler; tables to stdout, traces to a file."""
    import cProfile
    import gzip
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    python = cProfile.Profile()
    with profile(activities=activities) as trace:
        python.enable()
        result = run()
        python.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    tag = f"{job['label'].replace('/', '_')}-{name}"
    text = io.StringIO()
    pstats.Stats(python, stream=text).sort_stats("cumulative").print_stats(35)
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(f"=== profile {tag}: ttft {result['ttft_ms']:.2f} ms, iter1 {result['iter1_ms']:.2f} ms")
    print(trace.key_averages().table(sort_by=sort, row_limit=18, max_name_column_width=48))
    print(trace.key_averages().table(sort_by="self_cpu_time_total", row_limit=14,
                                     max_name_column_width=48))  # fmt: skip
    print(text.getvalue()[:6000])
    folder = Path(job["profile"])
    folder.mkdir(parents=True, exist_ok=True)
    python.dump_stats(str(folder / f"python-{tag}.pstats"))
    raw = folder / f"trace-{tag}.json"
    trace.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(folder / f"trace-{tag}.json.gz", "wb") as dst:
        dst.write(src.read())
    raw.unlink()


def _log(job: dict[str, Any], message: str) -> None:
    now = time.time()
    stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
    print(f"[{stamp}] {job['label']}: {message}", flush=True)


def scatter_bandwidth(pool: torch.Tensor, block_ids: list[int], reps: int = 7) -> dict[str, float]:
    """Pinned host → pool copies, one per block at ``block_ids``: the copy engine's rate.

    NOTE: the copies are queued behind a GPU sleep and timed between events recorded after
    it, so the host's enqueue rate stays out of the figure; what is left is what the copy
    engine does with block-sized transfers into scattered blocks. ``chunked_GBps`` repeats
    it with each block cut in 2, 4, 8 chunks (copied chunk-major, as layer groups are).
    """
    if not block_ids:
        return {}
    flat = pool.view(pool.shape[0], -1).view(torch.uint8)
    nbytes = int(flat.shape[1])
    hosts = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pool.is_cuda) for _ in block_ids]
    for n, host in enumerate(hosts):
        host.fill_(n % 251)
    total = nbytes * len(block_ids)
    if not pool.is_cuda:
        started = time.perf_counter()
        for b, host in zip(block_ids, hosts, strict=True):
            flat[b].copy_(host)
        return {"GBps": total / (time.perf_counter() - started) / 1e9, "bytes": total}

    def timed(parts: int) -> tuple[float, float]:
        times, enqueue = [], []
        step = nbytes // parts
        for _ in range(reps + 1):
            torch.cuda.synchronize()
            torch.cuda._sleep(50_000_000)  # ~25 ms: every copy is queued before the first runs
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            began = time.perf_counter()
            for part in range(parts):
                lo, hi = part * step, nbytes if part == parts - 1 else (part + 1) * step
                for b, host in zip(block_ids, hosts, strict=True):
                    flat[b, lo:hi].copy_(host[lo:hi], non_blocking=True)
            enqueue.append((time.perf_counter() - began) * 1e3)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times[1:]), statistics.median(enqueue[1:])

    ms, enqueue_ms = timed(1)
    chunked = {str(parts): round(total / timed(parts)[0] / 1e6, 2) for parts in (2, 4, 8)}
    contiguous = torch.empty(total, dtype=torch.uint8).pin_memory()
    target = torch.empty(total, dtype=torch.uint8, device=pool.device)
    one = []
    for _ in range(4):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(contiguous, non_blocking=True)
        end.record()
        end.synchronize()
        one.append(start.elapsed_time(end))
    return {
        "GBps": total / ms / 1e6, "ms": ms, "bytes": total, "enqueue_ms": enqueue_ms,
        "contiguous_GBps": total / statistics.median(one[1:]) / 1e6, "chunked_GBps": chunked,
    }  # fmt: skip


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"


def _connector_metrics() -> tuple[dict[str, float], int]:
    from s3kv.connector.shared import process_state

    state = process_state()
    merged: dict[str, float] = {}
    for store in state.stores.values():
        for name, value in store.stats().items():
            merged[name] = merged.get(name, 0) + value
    warm = getattr(state.scheduler, "warm", None)
    return merged, int(getattr(warm, "staged", 0))


def _close_connector() -> None:
    from s3kv.connector.shared import process_state

    process_state().close_all()


# --- the parent: runs the processes, derives the metrics ---


def emit(rows: list[dict[str, Any]], metric: str, value: Any, unit: str, **extra: Any) -> None:
    row = {"metric": metric, "value": value, "unit": unit, **extra}
    rows.append(row)
    print(json.dumps(row), flush=True)


def run_shape(label: str, shape: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    prefix_tokens = (args.prompt_tokens - SUFFIX) // TPB * TPB
    job = {
        "label": label, "shape": shape, "device": args.device, "new_tokens": args.new_tokens,
        "prefix_tokens": prefix_tokens, "profile": args.profile,
        "load_groups": [0 if v == "default" else _size(v) for v in args.load_groups.split(",")],
        "prompts": prompts(shape["vocab"], prefix_tokens, args.trials, args.cold_repeats),
        "codec_processes": args.codec_processes, "engine_cpus": args.engine_cpus,
        "codec_cpus": args.codec_cpus, "bucket_dir": args.bucket_dir or tempfile.gettempdir(),
        "cuda_graphs": args.cuda_graphs == "on", "io_threads": args.io_threads,
    }  # fmt: skip
    # NOTE: the bucket stands for a remote one, whose writes cost this host no disk I/O; in
    # memory (tmpfs) neither do these. Two runs of each on an H100 host did not tell the two
    # apart: the spread between trials is larger (benchmarks/results/gpu_2026-11-27*).
    with tempfile.TemporaryDirectory(prefix="s3kv-ab-bucket-", dir=args.bucket_dir) as bucket:
        os.environ.update(
            connector_settings(bucket, "s3kv-ab", args.staging, args.codec_processes),
            TLLM_S3KV_WARM_START_BYTES=args.staging, TLLM_S3KV_CODEC_CPUS=args.codec_cpus,
            TLLM_S3KV_IO_THREADS=args.io_threads, S3KV_AB_ENGINE_CPUS=args.engine_cpus,
        )  # fmt: skip
        job["model_path"] = model_dir(bucket, label, shape)
        started = time.perf_counter()
        written = run_tensor_parallel(1, writer, job, timeout=1800.0)[0]
        read = run_tensor_parallel(1, reader, job, timeout=1800.0)[0]
        wall = time.perf_counter() - started
    return {"job": job, "writer": written, "reader": read, "wall_s": wall}


def _memory_dir() -> str | None:
    """``/dev/shm`` when it can hold a run's bucket (a container's may be 64 MB), else None."""
    try:
        return "/dev/shm" if shutil.disk_usage("/dev/shm").free >= 16 << 30 else None
    except OSError:
        return None


def _size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def median(values: list[float]) -> float:
    return round(statistics.median(values), 2) if values else math.nan


def pct(new: list[float], old: list[float]) -> float:
    """The ratio of the medians, as a percentage change."""
    return round((statistics.median(new) / statistics.median(old) - 1) * 100, 2)


def paired_pct(new: list[float], old: list[float]) -> float:
    """The median over trials of each trial's ratio (both measured back to back), as a
    percentage change."""
    return round(statistics.median(x / y - 1 for x, y in zip(new, old, strict=True)) * 100, 2)


#: A cold TTFT more than this over the run's quickest is a trial in the host's slow mode.
#: NOTE: on the H200 hosts the quickest of a trial's cold prompts is either ~22 ms or 28-40
#: ms for SmolLM2 at 8K, with the connector and without it alike (and with the codec in
#: threads), often for several trials in a row: a state of the shared host, not of s3kv.
QUIET = 1.15


def quiet_pairs(new: list[float], old: list[float]) -> list[tuple[float, float]]:
    """The trials whose two sides both ran within :data:`QUIET` of the run's quickest: a
    pair with one side in the slow mode gives a ratio of +-50% that says nothing of s3kv."""
    quick = min(new + old)
    return [(x, y) for x, y in zip(new, old, strict=True) if max(x, y) <= QUIET * quick]


def _summed(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: round(a.get(k, 0.0) + b.get(k, 0.0), 3) for k in {*a, *b}}


def _by_position(runs: list[list[list[float]]], field: int) -> list[float]:
    """Median over runs of ``field`` at each position (as long as the shortest run)."""
    length = min((len(r) for r in runs), default=0)
    return [round(statistics.median(r[i][field] for r in runs), 2) for i in range(length)]


def _medians(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for d in dicts for k in d})
    return {k: round(statistics.median([d.get(k, 0.0) for d in dicts]), 3) for k in keys}


def report(
    label: str, shape: dict[str, Any], run: dict[str, Any], out: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The metrics of one shape (per load-group variant); table rows."""
    written, read, job = run["writer"], run["reader"], run["job"]
    pairs = list(zip(written["trials"], read["trials"], strict=True))
    block_nbytes = read["block_nbytes"]
    scatter = read["scatter"]
    ran = [int(side["metrics"].get("codec_processes_alive", 0)) for side in (written, read)]
    common = {
        "shape": label, "device": written["device"], "layers": shape["layers"],
        "dtype": "bfloat16", "tokens_per_block": TPB,
        "prompt_tokens": job["prefix_tokens"] + SUFFIX, "prefix_tokens": job["prefix_tokens"],
        "codec_processes": job.get("codec_processes", 0),
        "codec_processes_run": ran,
        "engine_cpus": job.get("engine_cpus", ""), "codec_cpus": job.get("codec_cpus", "auto"),
        "io_threads": job.get("io_threads", "auto"), "bucket_dir": job.get("bucket_dir", ""),
        "cuda_graphs": job.get("cuda_graphs", False),
    }  # fmt: skip
    # NOTE: the floor is for a load: trials that loaded nothing (see below) are left out.
    loaded = [r["connector_tokens"] // TPB for r in read["trials"] if r["connector_tokens"]]
    loaded = loaded or [0]
    load_bytes = statistics.median(loaded) * block_nbytes
    floor = load_bytes / (scatter["GBps"] * 1e6) if scatter else math.nan
    emit(out, "gpu.load_bytes", int(load_bytes), "bytes", blocks=statistics.median(loaded),
         block_nbytes=block_nbytes, **common)  # fmt: skip
    emit(out, "gpu.pinned_scatter_GBps", round(scatter.get("GBps", math.nan), 2), "GB/s",
         floor_ms=round(floor, 2), enqueue_ms=round(scatter.get("enqueue_ms", math.nan), 2),
         contiguous_GBps=round(scatter.get("contiguous_GBps", math.nan), 2),
         chunked_GBps=scatter.get("chunked_GBps", {}), **common)  # fmt: skip
    table = []
    for variant in job["load_groups"]:
        # NOTE: only trials whose prefix the reader loaded measure a load: a trial it did not
        # (not in its warm start) computed the whole prompt, a cold TTFT (counted in the row).
        ran = [(w, r) for w, r in pairs if r.get("variant", 0) == variant]
        chosen = [(w, r) for w, r in ran if r["connector_tokens"] == job["prefix_tokens"]]
        a = [w["conn"]["reuse"]["ttft_ms"] for w, _ in chosen]
        b = [r["ttft_ms"] for _, r in chosen]
        diffs = [y - x for x, y in zip(a, b, strict=True)]
        plain = [w["ref"]["reuse"]["ttft_ms"] for w, _ in chosen]
        tag = {"load_group_bytes": variant or "default", "trials": len(chosen),
               "trials_not_loaded": len(ran) - len(chosen), **common}  # fmt: skip
        overhead = median(diffs)
        emit(out, "gpu.load_overhead_ms", overhead, "ms", target_ms=round(1.25 * floor + 2, 2),
             floor_ms=round(floor, 2), per_trial=[round(d, 2) for d in diffs],
             vs_device_reuse_without_connector_ms=median(
                 [y - x for x, y in zip(plain, b, strict=True)]),
             gc_ms_s3kv=median([r["gc_ms"] for _, r in chosen]),
             gc_ms_device_reuse=median([w["conn"]["reuse"]["gc_ms"] for w, _ in chosen]),
             **tag)  # fmt: skip
        same = [r["reuse_after"] for _, r in chosen if "reuse_after" in r]
        if same:
            paired = [r["ttft_ms"] - r["reuse_after"]["ttft_ms"] for _, r in chosen
                      if "reuse_after" in r]  # fmt: skip
            emit(out, "gpu.load_overhead_paired_ms", median(paired), "ms",
                 target_ms=round(1.25 * floor + 2, 2), floor_ms=round(floor, 2),
                 per_trial=[round(d, 2) for d in paired],
                 device_reuse_ttft_ms=median([x["ttft_ms"] for x in same]),
                 device_reuse_reused_tokens=[x["reuse_tokens"] for x in same],
                 note="TTFT of the s3kv hit minus that of the device-reuse hit of the same "
                 "prefix served next in the same (reader) process", **tag)  # fmt: skip
        emit(out, "gpu.ttft_device_reuse_ms", median(a), "ms", per_trial=[round(x, 2) for x in a],
             without_connector_ms=median([w["ref"]["reuse"]["ttft_ms"] for w, _ in chosen]),
             **tag)  # fmt: skip
        emit(out, "gpu.ttft_s3kv_ms", median(b), "ms", per_trial=[round(x, 2) for x in b],
             connector_tokens=[r["connector_tokens"] for _, r in chosen], **tag)  # fmt: skip
        ratio = round(statistics.median(b) / statistics.median(a), 3) if a else math.nan
        emit(out, "gpu.ttft_s3kv_over_device_reuse", ratio, "x", **tag)
        emit(out, "gpu.host_first_iteration_ms", median([r["iter1_ms"] for _, r in chosen]), "ms",
             device_reuse_ms=median([w["conn"]["reuse"]["iter1_ms"] for w, _ in chosen]),
             connector_ms_s3kv=_medians([r["connector_ms"] for _, r in chosen]),
             connector_ms_device_reuse=_medians([w["conn"]["reuse"]["connector_ms"]
                                                 for w, _ in chosen]),
             **tag)  # fmt: skip
        table.append({"shape": label, "variant": variant or "default", "a": median(a),
                      "b": median(b), "overhead": overhead, "floor": round(floor, 2),
                      "GBps": round(scatter.get("GBps", math.nan), 1)})  # fmt: skip
    same = [w["conn"]["reuse"]["output"] == r["output"] for w, r in pairs]
    identical = all(same)
    # NOTE: a trial whose prefix the reader did not load (connector_tokens 0: not in its
    # warm start, e.g. crowded out by --cold-repeats on large blocks) computed the whole
    # prompt, whose bf16 rounding differs from a reused prefix's: per-trial figures say so.
    tokens = [r["connector_tokens"] for _, r in pairs]
    emit(out, "gpu.identical_s3kv_vs_device_reuse", identical, "bool", trials=len(pairs),
         also_without_connector=all(w["ref"]["reuse"]["output"] == r["output"] for w, r in pairs),
         per_trial=same, s3kv_tokens=tokens,
         identical_where_loaded=all(ok for ok, n in zip(same, tokens, strict=True) if n),
         **common)  # fmt: skip
    cold_conn = [min(w["conn"]["cold_ttft_ms"]) for w, _ in pairs]
    cold_ref = [min(w["ref"]["cold_ttft_ms"]) for w, _ in pairs]
    dec_conn = [w["conn"]["cold"]["decode_ms"] for w, _ in pairs]
    dec_ref = [w["ref"]["cold"]["decode_ms"] for w, _ in pairs]
    quiet = quiet_pairs(cold_conn, cold_ref)
    quiet_pct = paired_pct([x for x, _ in quiet], [y for _, y in quiet]) if quiet else None
    emit(out, "gpu.save_overhead_pct", paired_pct(cold_conn, cold_ref), "%", step="prefill",
         median_ratio_pct=pct(cold_conn, cold_ref),
         quiet_pairs=len(quiet), quiet_pairs_pct=quiet_pct,
         slow_trials=[sum(x > QUIET * min(cold_conn + cold_ref) for x in side)
                      for side in (cold_conn, cold_ref)],
         cold_ttft_ms=median(cold_conn), cold_ttft_without_connector_ms=median(cold_ref),
         per_trial_ms=[[round(x, 2), round(y, 2)] for x, y in zip(cold_conn, cold_ref,
                                                               strict=True)],
         trials=len(pairs), **common)  # fmt: skip

    def cold(name: str, field: str) -> float:
        return median([w[name]["cold"][field] for w, _ in pairs])

    # NOTE: each as "<row>_ms" with the connector and "<row>_without_connector_ms" without
    fields = {"iter1_host": "iter1_ms", "iter2_host": "iter2_ms", "iter1_gpu": "iter1_gpu_ms",
              "iter1_gc": "iter1_gc_ms", "iter2_gc": "iter2_gc_ms",
              "token_after_iter1": "token_after_iter1_ms"}  # fmt: skip
    both_ways = {}
    for row, field in fields.items():
        both_ways[f"{row}_ms"] = cold("conn", field)
        both_ways[f"{row}_without_connector_ms"] = cold("ref", field)
    emit(out, "gpu.cold_first_iterations_ms", cold("conn", "ttft_ms"), "ms",
         note="cold prefill with the connector: host time of iterations 1 and 2, the GPU "
              "time of iteration 1's work, the connector's host time and the garbage "
              "collections in iterations 1 and 2, and when the first token came after "
              "iteration 1 (overlap: iteration 2 commits it)",
         **both_ways,
         iter1_connector_ms=_medians([w["conn"]["cold"]["iter1_connector_ms"] for w, _ in pairs]),
         iter2_connector_ms=_medians([w["conn"]["cold"]["iter2_connector_ms"] for w, _ in pairs]),
         ttft_without_connector_ms=cold("ref", "ttft_ms"), **common)  # fmt: skip
    emit(out, "gpu.save_overhead_pct", paired_pct(dec_conn, dec_ref), "%", step="decode",
         median_ratio_pct=pct(dec_conn, dec_ref),
         decode_step_ms=median(dec_conn), decode_step_without_connector_ms=median(dec_ref),
         trials=len(pairs),
         connector_ms_cold=_medians([w["conn"]["cold"]["connector_ms"] for w, _ in pairs]),
         gc_ms_cold=median([w["conn"]["cold"]["gc_ms"] for w, _ in pairs]),
         gc_ms_cold_without_connector=median([w["ref"]["cold"]["gc_ms"] for w, _ in pairs]),
         thread_cpu_ms_cold=_medians([w["conn"]["cold"].get("thread_cpu_ms", {})
                                      for w, _ in pairs]),
         thread_cpu_ms_cold_without_connector=_medians([w["ref"]["cold"].get("thread_cpu_ms", {})
                                                        for w, _ in pairs]),
         **common)  # fmt: skip
    emit(out, "gpu.cold_decode_steps_ms", median(dec_conn), "ms",
         note="host time of each step after the first two of the cold request, median over "
              "trials by position; outstanding: saves still with the codec processes then",
         with_connector=_by_position([w["conn"]["cold"]["steps"] for w, _ in pairs], 0),
         without_connector=_by_position([w["ref"]["cold"]["steps"] for w, _ in pairs], 0),
         outstanding=_by_position([w["conn"]["cold"]["steps"] for w, _ in pairs], 1),
         paired_pct=[round(pct([x], [y]), 1) for x, y in zip(dec_conn, dec_ref, strict=True)],
         **common)  # fmt: skip
    emit(out, "gpu.decode_step_ms", median([w["conn"]["reuse"]["decode_ms"] for w, _ in pairs]),
         "ms", saving=False, note="device-reuse requests, nothing to save",
         without_connector_ms=median([w["ref"]["reuse"]["decode_ms"] for w, _ in pairs]),
         s3kv_hit_ms=median([r["decode_ms"] for _, r in pairs]),
         steps_ms=_by_position([w["conn"]["reuse"]["steps"] for w, _ in pairs], 0),
         steps_without_connector_ms=_by_position([w["ref"]["reuse"]["steps"] for w, _ in pairs],
                                                 0),
         thread_cpu_ms=_medians([w["conn"]["reuse"].get("thread_cpu_ms", {}) for w, _ in pairs]),
         thread_cpu_ms_without_connector=_medians([w["ref"]["reuse"].get("thread_cpu_ms", {})
                                                   for w, _ in pairs]),
         connector_ms=_medians([w["conn"]["reuse"]["connector_ms"] for w, _ in pairs]),
         **common)  # fmt: skip
    emit(out, "gpu.attention_check", written.get("attention_check", {}).get("relative_error"),
         "relative_error", note="flash, lower-right causal bias vs math with the mask, bf16",
         **common)  # fmt: skip
    emit(out, "gpu.warm_start", read["warm_blocks"], "blocks",
         startup_s=round(read["startup_s"], 2), wall_s=round(run["wall_s"], 1),
         **common)  # fmt: skip
    for row in table:
        row.update(identical=identical, save_prefill=paired_pct(cold_conn, cold_ref),
                   save_decode=paired_pct(dec_conn, dec_ref))  # fmt: skip
    return table


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="smollm2-135m,llama3-8b:8")
    parser.add_argument("--prompt-tokens", type=int, default=8192 - 24)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument(
        "--cold-repeats", type=int, default=1,
        help="cold prompts per executor per trial for the prefill save overhead (the quickest "
        "counts); the extra ones are saved too, and with large blocks (8B shapes) they crowd "
        "the trials' prefixes out of the reader's warm start: 3 for SmolLM2",
    )  # fmt: skip
    parser.add_argument(
        "--codec-processes", type=codec_processes_arg, default="auto",
        help="the codec_processes setting of both the writer and the reader: a count or auto "
        "(the default; the rows' codec_processes_run says what it ran)",
    )  # fmt: skip
    parser.add_argument(
        "--engine-cpus",
        default="",
        help="pin the writer and reader to these CPUs, as a launcher would "
        "(e.g. 0-1); the codec processes then follow codec_cpus",
    )
    parser.add_argument("--codec-cpus", default="auto", help="the codec_cpus setting")
    parser.add_argument(
        "--io-threads", default="auto", help="the io_threads setting of the writer and reader"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--bucket-dir",
        default=_memory_dir(),
        help="folder for the file:// bucket (default /dev/shm when it has 16 GiB free: in "
        "memory, as a remote bucket costs this host no disk writes; else the temp folder)",
    )
    parser.add_argument("--staging", default="6GiB")
    parser.add_argument(
        "--cuda-graphs", choices=("on", "off"), default="on",
        help="replay decode passes from captured CUDA graphs (TensorRT-LLM's default: on)",
    )  # fmt: skip
    parser.add_argument("--load-groups", default="default",
                        help="comma-separated per-block layer-group sizes, reader trials "
                             "take them in turn ('default': the connector's)")  # fmt: skip
    parser.add_argument("--profile", default="", help="folder for profiles of one more trial")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    table = []
    for text in args.shapes.split(","):
        label, shape = parse_shape(text)
        table.extend(report(label, shape, run_shape(label, shape, args), rows))
    Path(args.out, "gpu_ab.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"\n{'shape':22} {'groups':>8} {'a ms':>8} {'b ms':>8} {'b-a':>8} {'floor':>7} "
          f"{'GB/s':>6} {'ident':>6} {'save%pf':>8} {'save%dec':>8}")  # fmt: skip
    for t in table:
        print(f"{t['shape']:22} {t['variant']!s:>8} {t['a']:8.2f} {t['b']:8.2f} "
              f"{t['overhead']:8.2f} {t['floor']:7.2f} {t['GBps']:6.1f} {t['identical']!s:>6} "
              f"{t['save_prefill']:8.2f} {t['save_decode']:8.2f}")  # fmt: skip
    return 0 if all(t["identical"] for t in table) else 1


if __name__ == "__main__":
    sys.exit(main())
