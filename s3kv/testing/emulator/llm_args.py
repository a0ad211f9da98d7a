"""A ``TorchLlmArgs``-shaped configuration for the emulated runtime.

TensorRT-LLM constructs both connector classes with its ``TorchLlmArgs``
(``tensorrt_llm/llmapi/llm_args.py``), and a connector reads everything about the engine from
it. These plain dataclasses carry the same attribute paths with TensorRT-LLM's defaults
(``KvCacheConfig.tokens_per_block=32``, ``enable_block_reuse=True``,
``enable_partial_reuse=True``, ``CapacitySchedulerPolicy.GUARANTEED_NO_EVICT``), so code that
reads ``llm_args.kv_cache_config.tokens_per_block`` works unchanged on both.

Only what the emulator or a connector reads is here; TensorRT-LLM's pydantic validation is
not reproduced (the emulator checks what it needs at construction).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


class CapacitySchedulerPolicy(str, enum.Enum):
    """TensorRT-LLM's capacity policies (a ``StrEnum`` there: ``str()`` gives the value)."""

    MAX_UTILIZATION = "MAX_UTILIZATION"
    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    STATIC_BATCH = "STATIC_BATCH"

    def __str__(self) -> str:
        return str(self.value)


@dataclasses.dataclass
class KvCacheConfig:
    """``llm_args.kv_cache_config`` (the fields the emulated managers read).

    Attributes:
        tokens_per_block: Tokens per KV block.
        enable_block_reuse: Local prefix reuse; without it V1 never consults the connector.
        enable_partial_reuse: Reuse a stored block whose tokens only partly match.
        copy_on_partial_reuse: Copy a partly matched block that is shared or has children.
        host_cache_size: Secondary (host) tier bytes; TensorRT-LLM rejects it with a connector.
        dtype: KV cache dtype name ("auto" follows the model).
        max_tokens: KV capacity in tokens (informational here: the emulator takes
            ``num_blocks`` explicitly).
        free_gpu_memory_fraction: Informational.
        use_kv_cache_manager_v2: Opt in to ``KVCacheManagerV2`` (TensorRT-LLM's field name,
            quoted in ``connectors/kv_cache_connector.py`` @ ``035ab91c``); main runtime only.
    """

    tokens_per_block: int = 32
    enable_block_reuse: bool = True
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True
    host_cache_size: int | None = None
    dtype: str = "auto"
    max_tokens: int | None = None
    free_gpu_memory_fraction: float | None = None
    use_kv_cache_manager_v2: bool = False


@dataclasses.dataclass
class SchedulerConfig:
    """``llm_args.scheduler_config``."""

    capacity_scheduler_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    context_chunking_policy: str = "FIRST_COME_FIRST_SERVED"


@dataclasses.dataclass
class KvCacheConnectorConfig:
    """``llm_args.kv_connector_config``: where the executor imports the connector from."""

    connector_module: str
    connector_scheduler_class: str
    connector_worker_class: str


@dataclasses.dataclass
class TorchLlmArgs:
    """The ``TorchLlmArgs`` attributes a connector (or the emulator) reads.

    Attributes:
        model: Model path or name (a connector may fingerprint it).
        revision: Weights revision, if known.
        dtype: Model dtype name.
        tensor_parallel_size: TP ranks; the emulator runs that many processes.
        pipeline_parallel_size: Must be 1 with a connector (rejected at construction).
        context_parallel_size: Must be 1 with a connector (rejected at construction).
        max_beam_width: Must be 1 with a connector (rejected at construction).
        max_batch_size: Requests per iteration; also the first request id (TensorRT-LLM
            reserves the ids below it for dummy requests).
        max_num_tokens: Token budget of one forward pass (the prefill chunk bound).
        max_seq_len: Longest prompt + output; ``None`` means unbounded here.
        enable_attention_dp: Rejected with a connector (attention DP is not emulated).
        enable_chunked_prefill: Split long prompts into ``max_num_tokens`` chunks.
        disable_overlap_scheduler: ``False`` (TensorRT-LLM's default) runs the overlap loop.
        cuda_graph_config: ``None`` (here the default), or any object for CUDA graphs: on
            the main runtime a batch of decode steps, or of final one-token context chunks
            with them, then runs without the layer hooks, as a replayed graph does
            (TensorRT-LLM turns them on by default); refused with a connector on the
            1.2-era runtime.
        kv_cache_config: See :class:`KvCacheConfig`.
        scheduler_config: See :class:`SchedulerConfig`.
        kv_connector_config: Classes to import, or ``None`` for no connector (unless the
            emulator is handed the classes directly).
        backend: Always "pytorch".
        attn_backend: Attention backend name (part of a connector's layout identity).
        quant_config: Quantization description; ``None`` means unquantized.
    """

    model: str = "emulated-llama"
    revision: str | None = None
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    max_beam_width: int = 1
    max_batch_size: int = 8
    max_num_tokens: int = 8192
    max_seq_len: int | None = None
    enable_attention_dp: bool = False
    enable_chunked_prefill: bool = False
    disable_overlap_scheduler: bool = False
    cuda_graph_config: Any = None
    kv_cache_config: KvCacheConfig = dataclasses.field(default_factory=KvCacheConfig)
    scheduler_config: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    kv_connector_config: KvCacheConnectorConfig | None = None
    backend: str = "pytorch"
    attn_backend: str = "TRTLLM"
    quant_config: Any = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "max_batch_size", "max_num_tokens"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        if self.kv_cache_config.tokens_per_block < 1:
            raise ValueError(
                "kv_cache_config.tokens_per_block: must be >= 1, "
                f"got {self.kv_cache_config.tokens_per_block}"
            )


__all__ = [
    "CapacitySchedulerPolicy",
    "KvCacheConfig",
    "KvCacheConnectorConfig",
    "SchedulerConfig",
    "TorchLlmArgs",
]
