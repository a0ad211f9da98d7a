"""TensorRT-LLM's connector API: the real classes when ``tensorrt_llm`` imports, else stand-ins.

The stand-ins reproduce the public surface of
``tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py`` (and its older location
``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py``): the two ABCs with the same method
names, arguments and return types, and the ``RequestData`` / ``SchedulerOutput`` data classes.
They let the connector be imported, type-checked and driven by s3kv's emulated runtime on
machines without TensorRT-LLM. Both locations are tried, newest first.

Nothing here imports torch at module level. This is s3kv's only module that imports
``tensorrt_llm`` (the architecture test checks it).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_LOCATIONS = (
    "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector",
    "tensorrt_llm._torch.pyexecutor.kv_cache_connector",
)


def _import_trtllm() -> tuple[Any, str] | None:
    for name in _LOCATIONS:
        try:
            return importlib.import_module(name), name
        except ImportError:
            continue
    return None


@dataclass
class RequestData:
    """One scheduled request, as TensorRT-LLM reports it to ``build_connector_meta``.

    Attributes:
        request_id: The request id.
        new_tokens: Tokens of beam 0 added since the last report.
        new_block_ids: Block ids added since the last report.
        computed_position: Tokens whose KV is valid before this iteration's forward pass
            (on a request's first report, connector-loaded tokens are *not* included).
        num_scheduled_tokens: Tokens the upcoming forward pass computes.
        priorities: Retention priority per new block (newer versions; may be ``None``).
        cache_salt: Cache salt string (newer versions; may be ``None``).
        block_hashes: TensorRT-LLM's 64-bit block hash chain (newer versions; unused here).
        new_block_ids_by_layer_group: New page indices per layer group, ``-1`` for a block
            without a page (KVCacheManagerV2, ``035ab91c``; with one group ``new_block_ids``
            equals group 0).
    """

    request_id: int
    new_tokens: list[int]
    new_block_ids: list[int]
    computed_position: int
    num_scheduled_tokens: int
    priorities: list[int] | None = None
    cache_salt: str | None = None
    block_hashes: list[int] = field(default_factory=list)
    new_block_ids_by_layer_group: list[list[int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """Every request scheduled this iteration: first reports and later ones."""

    new_requests: list[RequestData] = field(default_factory=list)
    cached_requests: list[RequestData] = field(default_factory=list)
    attention_dp_rank: int | None = None


class KvCacheConnectorWorker(ABC):
    """Stand-in for TensorRT-LLM's worker ABC (one instance per rank)."""

    supports_attention_dp: bool = False

    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args
        self._metadata: object = None
        super().__init__()

    def bind_connector_meta(self, metadata: object) -> None:
        self._metadata = metadata

    def get_connector_meta(self) -> object:
        return self._metadata

    def _clear_connector_meta(self) -> None:
        self._metadata = None

    def register_forward_pass_callable(self) -> Callable[[], None] | None:
        return None

    @abstractmethod
    def register_kv_caches(self, kv_cache_tensor: Any) -> None: ...

    @abstractmethod
    def start_load_kv(self, stream: Any) -> None: ...

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None: ...

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, stream: Any) -> None: ...

    @abstractmethod
    def wait_for_save(self, stream: Any) -> None: ...

    @abstractmethod
    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]: ...


class KvCacheConnectorScheduler(ABC):
    """Stand-in for TensorRT-LLM's scheduler ABC (rank 0 only)."""

    supports_attention_dp: bool = False

    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args
        super().__init__()

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object: ...

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]: ...

    @abstractmethod
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool: ...

    @abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None: ...

    def wait_for_initialization(self) -> None:
        return None


def trtllm_utils() -> Any | None:
    """TensorRT-LLM's ``tensorrt_llm._utils`` (its MPI helpers), or ``None`` without it.

    NOTE: this module is s3kv's only importer of ``tensorrt_llm``; the collectives in
    :mod:`s3kv.connector.comm` get TensorRT-LLM's MPI helpers through here.
    """
    try:
        return importlib.import_module("tensorrt_llm._utils")
    except ImportError:
        return None


_real = _import_trtllm()
#: Where the base classes came from: a tensorrt_llm module path, or "s3kv stand-ins".
SOURCE: str = _real[1] if _real else "s3kv stand-ins"
HAVE_TRTLLM: bool = _real is not None

if _real is not None:  # pragma: no cover - needs tensorrt_llm
    _module = _real[0]
    WorkerBase: type = _module.KvCacheConnectorWorker
    SchedulerBase: type = _module.KvCacheConnectorScheduler
else:
    WorkerBase = KvCacheConnectorWorker
    SchedulerBase = KvCacheConnectorScheduler

__all__ = [
    "HAVE_TRTLLM",
    "SOURCE",
    "KvCacheConnectorScheduler",
    "KvCacheConnectorWorker",
    "RequestData",
    "SchedulerBase",
    "SchedulerOutput",
    "WorkerBase",
    "trtllm_utils",
]
