"""The classes users name in TensorRT-LLM's ``KvCacheConnectorConfig``.

    KvCacheConnectorConfig(
        connector_module="s3kv.connector.trtllm",
        connector_scheduler_class="S3KVConnectorScheduler",
        connector_worker_class="S3KVConnectorWorker",
    )

They subclass TensorRT-LLM's ``KvCacheConnectorScheduler`` / ``KvCacheConnectorWorker`` when
``tensorrt_llm`` imports (new or old module location) and s3kv's stand-ins otherwise. Settings
come from ``TLLM_S3KV_*`` variables or the TOML file named by ``TLLM_S3KV_CONFIG`` — the only
things that reach TensorRT-LLM's MPI workers.

Nothing here raises into the engine: every entry point is guarded, and a failure turns into
"claim nothing / save nothing" plus one log line. A configuration outside the envelope
TensorRT-LLM requires, or a KV layout s3kv cannot serve, switches the connector off at startup
with one clear message.
"""

from __future__ import annotations

import functools
import logging
import socket
from collections.abc import Callable
from typing import Any, TypeVar

from s3kv.config import S3KVConfig
from s3kv.connector.api import SchedulerBase, SchedulerOutput, WorkerBase
from s3kv.connector.arena import SlabArena
from s3kv.connector.comm import get_collectives
from s3kv.connector.envelope import envelope_problems, envelope_warnings
from s3kv.connector.identity import kv_dtype_name, shard_identity, weights_revision
from s3kv.connector.metadata import EMPTY, ConnectorMetadata
from s3kv.connector.scheduler import SchedulerCore
from s3kv.connector.shared import ShardInfo, ShardStores, process_state
from s3kv.connector.warm import WarmStart
from s3kv.connector.worker import WorkerCore
from s3kv.errors import S3KVError
from s3kv.keys import UNKNOWN, BlockHash

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _guarded(default: Callable[..., Any]) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Never let an exception escape into the engine: log it and return ``default(...)``."""

    def decorate(method: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(method)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> T:
            try:
                return method(self, *args, **kwargs)
            except Exception:
                logger.exception("s3kv: %s failed; continuing without the connector's help",
                                 method.__name__)  # fmt: skip
                return default(*args, **kwargs)  # type: ignore[no-any-return]

        return wrapper

    return decorate


def _tokens_per_block(llm_args: Any) -> int:
    kv_cache = getattr(llm_args, "kv_cache_config", None)
    return int(getattr(kv_cache, "tokens_per_block", 32) or 32)


class S3KVConnectorScheduler(SchedulerBase):  # type: ignore[misc]
    """Rank 0: answers "how many tokens are cached" from memory and plans loads and saves."""

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self.off_reason = ""
        self.core: SchedulerCore | None = None
        self.warm: WarmStart | None = None
        self._arenas: list[SlabArena] = []
        try:
            config = S3KVConfig.load()
            problems = envelope_problems(llm_args)
        except S3KVError as exc:
            self._turn_off(str(exc))
            return
        if problems:
            self._turn_off(problems[0])
            return
        for warning in envelope_warnings(llm_args):
            logger.warning("s3kv: %s", warning)
        self.config = config
        self.core = SchedulerCore(config, _tokens_per_block(llm_args))
        process_state().scheduler = self

    def _turn_off(self, reason: str) -> None:
        self.off_reason = reason
        self.core = None
        logger.error("s3kv: connector disabled: %s", reason)

    def initialize(self, shards: list[ShardInfo]) -> None:
        """Open one store per shard (rank 0's worker calls this after registration)."""
        core = self.core
        if core is None:
            return
        off = [s for s in shards if s.identity is None]
        if off:
            self._turn_off(f"rank {off[0].rank}: {off[0].reason}")
            return
        try:
            self._open_shards(shards)
        except S3KVError as exc:  # missing bucket, denied credentials, no shared memory
            self._turn_off(str(exc))

    def _open_shards(self, shards: list[ShardInfo]) -> None:
        core = self.core
        if core is None:
            return
        state = process_state()
        identities = [s.identity for s in shards if s.identity is not None]
        if len(shards) == 1:
            stores = [state.open_store(self.config, identities[0])]
        else:
            if len({s.host for s in shards}) > 1:
                self._turn_off(
                    "tensor-parallel ranks span several hosts; s3kv stages shards in rank 0's "
                    "host memory, which other hosts cannot map (see the connector README)"
                )
                return
            share = self.config.staging_bytes // len(shards)
            config = self.config.replace(staging_bytes=share)
            self._arenas = [
                SlabArena.create(s.block_nbytes, share, tag=f"r{s.rank}-") for s in shards
            ]
            stores = [
                state.open_store(config, identity, allocator=arena)
                for identity, arena in zip(identities, self._arenas, strict=True)
            ]
            core.arenas = tuple((str(a.path), a.slot_bytes) for a in self._arenas)
            core.slot_of = self._slot_of
        core.shards = ShardStores(stores)
        self.warm = WarmStart(
            core.shards, stores[0], self.config.warm_start_bytes, self.config.warm_start_timeout
        )
        self.warm.start()

    def _slot_of(self, rank: int, key: bytes) -> int:
        shards = self.core.shards if self.core is not None else None
        buffer = shards.stores[rank].staged(BlockHash(key)) if shards is not None else None
        if buffer is None:  # unreachable: claimed blocks are pinned on every shard
            raise RuntimeError(f"claimed block {key.hex()} is not staged on rank {rank}")
        return self._arenas[rank].slot_of(buffer)

    @_guarded(lambda *a, **k: None)
    def wait_for_initialization(self) -> None:
        """Wait (bounded) for warm start to stage the hottest prefixes."""
        if self.warm is not None and not self.warm.wait():
            logger.warning("s3kv: warm start still running after %.0f s; serving anyway",
                           self.warm.timeout)  # fmt: skip

    @_guarded(lambda *a, **k: (0, False))
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens staged and verified on every rank beyond the device match; loads are sync."""
        if self.core is None:
            return 0, False
        return self.core.get_num_new_matched_tokens(request, num_computed_tokens), False

    @_guarded(lambda *a, **k: None)
    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        if self.core is not None:
            self.core.update_state_after_alloc(request, block_ids)

    @_guarded(lambda *a, **k: EMPTY)
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        if self.core is None or scheduler_output is None:
            return EMPTY
        meta: ConnectorMetadata = self.core.build_connector_meta(
            scheduler_output.new_requests, scheduler_output.cached_requests
        )
        return meta

    @_guarded(lambda *a, **k: False)
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        return self.core is not None and self.core.request_finished(request)


class S3KVConnectorWorker(WorkerBase):  # type: ignore[misc]
    """Every rank: copies staged blocks into the pool and full blocks out to the bucket."""

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self.off_reason = ""
        self.core: WorkerCore | None = None
        self._collectives = get_collectives()
        self.rank = self._collectives.rank
        self.tp_size = int(getattr(llm_args, "tensor_parallel_size", 1) or 1)
        try:
            self.config: S3KVConfig | None = S3KVConfig.load()
        except S3KVError as exc:
            self.config = None
            self.off_reason = str(exc)

    def register_forward_pass_callable(self) -> Callable[[], None]:
        return self._forward_done

    def _forward_done(self) -> None:
        try:
            if self.core is not None:
                self.core.forward_done()
        except Exception:  # never into the engine
            logger.exception("s3kv: forward-pass callable failed")

    @_guarded(lambda *a, **k: None)
    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        """Check the pool, agree with every rank, open this rank's store."""
        # NOTE: collectives: every rank registers at the same point of startup. Rank 0 alone
        # derives the weights revision (it may hash the whole checkpoint) and shares it.
        config = self.config
        revision = self._collectives.broadcast(
            weights_revision(self._llm_args, config) if self.rank == 0 and config else UNKNOWN
        )
        info = self._describe(kv_cache_tensor, revision)
        shards = [ShardInfo(**s) for s in self._collectives.allgather(info.__dict__)]
        state = process_state()
        scheduler = getattr(state, "scheduler", None)
        if self.rank == 0 and scheduler is not None:
            scheduler.initialize(shards)
        off = [s for s in shards if s.identity is None]
        if off or self.config is None or info.identity is None:
            reason = off[0].reason if off else self.off_reason
            logger.error("s3kv: connector disabled on rank %d: %s", self.rank, reason)
            return
        try:
            store = state.open_store(self.config, info.identity)
        except S3KVError as exc:
            logger.error("s3kv: connector disabled on rank %d: %s", self.rank, exc)
            return
        self.core = WorkerCore(
            self.rank, store, kv_cache_tensor, self.config.max_inflight_save_bytes
        )

    def _describe(self, kv: Any, revision: str) -> ShardInfo:
        host = socket.gethostname()
        nbytes = int(kv[0].numel() * kv.element_size()) if getattr(kv, "dim", None) else 0
        reason = self.off_reason or self._layout_problem(kv)
        if reason or self.config is None:
            return ShardInfo(self.rank, None, reason or "no configuration", nbytes, host)
        identity = shard_identity(
            self._llm_args, self.config, kv_shape=tuple(kv.shape), kv_dtype=kv.dtype,
            tp_size=self.tp_size, tp_rank=self.rank,
            revision=revision,
        )  # fmt: skip
        return ShardInfo(self.rank, identity, "", nbytes, host)

    def _layout_problem(self, kv: Any) -> str:
        problems = envelope_problems(self._llm_args)
        if problems:
            return problems[0]
        if kv.dim() != 4:
            return (
                f"KV pool has shape {tuple(kv.shape)}; s3kv serves one "
                "[blocks, layers, kv_factor, block_elems] pool"
            )
        if kv_dtype_name(kv.dtype) is None:
            return f"KV cache dtype {kv.dtype} is not supported"
        if not kv.is_contiguous():
            return "KV pool is not contiguous"
        expected = _num_attention_layers(self._llm_args)
        if expected is not None and int(kv.shape[1]) != expected:
            return (
                f"KV pool holds {kv.shape[1]} layers but the model has {expected}: several "
                "pools (layers with different KV head counts) or variable sliding windows"
            )
        windows = getattr(getattr(self._llm_args, "kv_cache_config", None),
                          "max_attention_window", None)  # fmt: skip
        if windows and len(set(windows)) > 1:
            return "variable sliding-window attention (VSWA) is not supported"
        return ""

    @_guarded(lambda *a, **k: None)
    def start_load_kv(self, stream: Any) -> None:
        meta = self.get_connector_meta()
        if self.core is not None and isinstance(meta, ConnectorMetadata):
            self.core.start_load(meta, stream)

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Nothing to wait for: loads were enqueued before the forward pass on its stream."""

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """Nothing per layer: whole blocks are copied after the forward-pass event."""

    @_guarded(lambda *a, **k: None)
    def wait_for_save(self, stream: Any) -> None:
        meta = self.get_connector_meta()
        if self.core is not None and isinstance(meta, ConnectorMetadata):
            self.core.save_after_forward(meta)

    @_guarded(lambda finished, loading: (list(finished), list(loading)))
    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        """Saves whose device→host copies completed; s3kv never loads asynchronously."""
        if self.core is None:
            return list(finished_gen_req_ids), list(started_loading_req_ids)
        return self.core.finished(finished_gen_req_ids), list(started_loading_req_ids)


def _num_attention_layers(llm_args: Any) -> int | None:
    """The model's decoder layer count from its config.json, when readable."""
    import json
    from pathlib import Path

    model = getattr(llm_args, "model", None)
    if not model:
        return None
    config = Path(str(model)) / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    layers = data.get("num_hidden_layers")
    return int(layers) if isinstance(layers, int) else None
