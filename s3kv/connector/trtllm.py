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
TensorRT-LLM requires, a bad setting, or a KV layout s3kv cannot serve, switches the connector
off at startup with one clear message; constructors never raise. A bucket that does not answer
at startup does not switch it off: startup waits at most ``startup_timeout``, the connector
starts degraded (claims nothing, saves nothing) and its stores open in the background once the
bucket answers (:mod:`s3kv.startup`).
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from s3kv.arena import SlabArena
from s3kv.config import S3KVConfig
from s3kv.connector.api import SchedulerBase, SchedulerOutput, WorkerBase
from s3kv.connector.comm import Collectives, get_collectives
from s3kv.connector.completion import CompletionBoard
from s3kv.connector.device import on_gpu
from s3kv.connector.envelope import envelope_problems, envelope_warnings, pool_dtype_problem
from s3kv.connector.identity import kv_dtype_name, shard_identity, weights_revision
from s3kv.connector.metadata import EMPTY, ConnectorMetadata
from s3kv.connector.requests import honoured_tokens, request_view
from s3kv.connector.scheduler import SchedulerCore
from s3kv.connector.shared import ShardInfo, ShardStores, process_state
from s3kv.connector.warm import WarmStart
from s3kv.connector.worker import WorkerCore, block_geometry
from s3kv.errors import S3KVError
from s3kv.keys import UNKNOWN
from s3kv.offload import resolve_codec_processes

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
                logger.exception(
                    "s3kv: %s failed; continuing without the connector's help", method.__name__
                )
                return default(*args, **kwargs)  # type: ignore[no-any-return]

        return wrapper

    return decorate


def _tokens_per_block(llm_args: Any) -> int:
    kv_cache = getattr(llm_args, "kv_cache_config", None)
    return int(getattr(kv_cache, "tokens_per_block", 32) or 32)


class S3KVConnectorScheduler(SchedulerBase):  # type: ignore[misc]
    """Rank 0: answers "how many tokens are cached" from memory and plans loads and saves."""

    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args
        self.off_reason = ""
        self.core: SchedulerCore | None = None
        self.warm: WarmStart | None = None
        self._warm_awaited = False
        try:
            super().__init__(llm_args)
            config = S3KVConfig.load()
            problems = envelope_problems(llm_args)
            if problems:
                self.turn_off(problems[0])
            else:
                for warning in envelope_warnings(llm_args):
                    logger.warning("s3kv: %s", warning)
                self.config = config
                self._lora_revisions = config.lora_revision_map()
                self.core = SchedulerCore(config, _tokens_per_block(llm_args))
        except S3KVError as exc:  # a bad setting: one line naming it
            self.turn_off(str(exc))
        except Exception as exc:  # NOTE: nothing raises into the engine, constructors included
            self.turn_off(f"cannot start ({type(exc).__name__}: {exc})")
        # NOTE: also when off: rank 0's worker then knows the reason was told (one line).
        process_state().scheduler = self

    def turn_off(self, reason: str) -> None:
        """Claim and save nothing from now on; log ``reason`` once."""
        self.off_reason = reason
        self.core = None
        logger.error("s3kv: connector disabled: %s", reason)

    def initialize(self, shards: list[ShardInfo], *, on_gpu: bool = False) -> None:
        """Open one store per shard (rank 0's worker calls this after registration;
        ``on_gpu``: the KV cache is on a GPU, which ``codec_processes = auto`` asks)."""
        core = self.core
        if core is None:
            return
        off = [s for s in shards if s.identity is None]
        if off:
            self.turn_off(f"rank {off[0].rank}: {off[0].reason}")
            return
        try:
            self._open_shards(shards, on_gpu)
        except S3KVError as exc:  # no bucket configured, no shared memory
            self.turn_off(str(exc))

    def _open_shards(self, shards: list[ShardInfo], on_gpu: bool) -> None:
        core = self.core
        if core is None:
            return
        state = process_state()
        identities = [s.identity for s in shards if s.identity is not None]
        board = CompletionBoard.private()
        sized = resolve_codec_processes(
            self.config, on_gpu=on_gpu, stores=len(shards), tp_size=len(shards)
        )
        if len(shards) == 1:
            stores = ShardStores([state.open_store(sized, identities[0])])
        else:
            if len({s.host for s in shards}) > 1:
                self.turn_off(
                    "tensor-parallel ranks span several hosts; s3kv stages shards in rank 0's "
                    "host memory, which other hosts cannot map (see the connector README)"
                )
                return
            share = sized.staging_bytes // len(shards)
            config = sized.replace(staging_bytes=share)
            arenas = [SlabArena.create(s.block_nbytes, share, tag=f"r{s.rank}-") for s in shards]
            # NOTE: one manifest for the layout, not one per shard (s3kv.manifest.shards).
            layout = state.open_layout(config, identities, arenas)
            stores = ShardStores(layout.stores, arenas, relay=layout.relay)
            board = CompletionBoard.shared(len(shards))
        manager = "v2" if (identities[0].layout or "").startswith("trtllm-v2/") else "v1"
        core.attach(stores, board=board, manager=manager)
        warm = WarmStart(
            stores, stores.stores[0], self.config.warm_start_bytes, self.config.warm_start_timeout
        )
        if stores.ready:
            self.warm = warm
            warm.start()
            return
        # NOTE: the bucket has not answered (s3kv.startup): the stores claim and save nothing
        # until it does, startup does not wait for it, and warm start runs once it answers.
        threading.Thread(
            target=self._warm_once_ready, args=(stores, warm), name="s3kv-warm-wait", daemon=True
        ).start()

    def _warm_once_ready(self, stores: ShardStores, warm: WarmStart) -> None:
        try:
            if stores.wait_ready():
                self.warm = warm
                warm.start()
        except Exception:  # NOTE: a thread of our own: log, never raise
            logger.exception("s3kv: warm start after a late bucket failed")

    def await_warm_start(self) -> None:
        """Wait (bounded by ``warm_start_timeout``) for warm staging; once per process.

        NOTE: rank 0's worker calls this at the end of ``register_kv_caches``, because the
        1.2-era executor never calls ``wait_for_initialization``: its
        ``PyExecutor._maybe_init_kv_connector_manager`` (``py_executor.py``, the 155 kB stored
        version with the old ``_torch/pyexecutor/kv_cache_connector.py`` import; the index
        gives no commit) ends after the layer hooks, while main (@``00043967``) calls it last,
        after ``register_kv_caches``. The
        other ranks wait meanwhile in their next collective, as they would behind
        ``wait_for_initialization``.
        """
        warm, self._warm_awaited = self.warm, True
        if warm is not None and not warm.wait():
            logger.warning(
                "s3kv: warm start still running after %.0f s; serving anyway", warm.timeout
            )

    @_guarded(lambda *a, **k: None)
    def wait_for_initialization(self) -> None:
        """Wait (bounded) for warm start, unless registration already did."""
        if not self._warm_awaited:
            self.await_warm_start()

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens staged and verified on every rank beyond the device match; loads are sync."""
        core = self.core
        if core is None:
            return 0, False
        try:
            view = request_view(request, self._lora_revisions)
            return core.get_num_new_matched_tokens(view, num_computed_tokens), False
        except Exception:
            logger.exception("s3kv: get_num_new_matched_tokens failed; claiming nothing")
        try:  # NOTE: the engine hears 0, so no claim state (pins, loads) may survive
            core.abandon(int(request.request_id))
        except Exception:
            logger.exception("s3kv: cannot abandon the failed claim")
        return 0, False

    @_guarded(lambda *a, **k: None)
    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        if self.core is not None:
            self.core.update_state_after_alloc(
                int(request.request_id), block_ids, honoured_tokens(request)
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        """This iteration's loads and saves; on any failure still the claimed loads."""
        core = self.core
        if core is None or scheduler_output is None:
            return EMPTY
        try:
            meta: ConnectorMetadata = core.build_connector_meta(
                scheduler_output.new_requests, scheduler_output.cached_requests
            )
            return meta
        except Exception:
            logger.exception("s3kv: build_connector_meta failed; sending the claimed loads only")
        try:
            # NOTE: a claim is a promise: the engine already counts those tokens as computed.
            return core.take_metadata()
        except Exception:
            logger.exception("s3kv: cannot send claimed loads; outputs may be wrong")
            return EMPTY

    # NOTE: on failure keep the blocks: device→host copies of this request may be pending,
    # and every worker reports the id once its own copies are done (at once if none).
    @_guarded(lambda *a, **k: True)
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        return self.core is not None and self.core.request_finished(int(request.request_id))


class S3KVConnectorWorker(WorkerBase):  # type: ignore[misc]
    """Every rank: copies staged blocks into the pool and full blocks out to the bucket."""

    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args
        self._model_json: dict[str, Any] | None = None  # NOTE: read once, when first needed
        self.off_reason = ""
        self.core: WorkerCore | None = None
        self._collectives: Collectives | None = None
        self.rank = 0
        self.manager = "v1"  # "v2" once registered through register_kv_cache_layout
        self._pending_core: WorkerCore | None = None
        #: Rank 0: the scheduler's work after each forward pass (SchedulerCore.after_forward).
        self._after_forward: Callable[[], None] | None = None
        self._kv: Any = None
        self.config: S3KVConfig | None = None
        self.tp_size = 1
        # NOTE: nothing raises into the engine, constructors included. A bad setting is told
        # at registration, once the ranks have agreed (one line per process).
        try:
            super().__init__(llm_args)
            collectives = get_collectives()
            self.rank = collectives.rank
            self._collectives = collectives
            self.tp_size = int(getattr(llm_args, "tensor_parallel_size", 1) or 1)
            self.config = S3KVConfig.load()
        except S3KVError as exc:  # a bad setting: one line naming it (logged at registration)
            self.off_reason = str(exc)
        except Exception as exc:
            self.off_reason = f"cannot start ({type(exc).__name__}: {exc})"

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
        """Check the pool, agree with every rank, open this rank's store.

        Collectives: one broadcast and one all-gather, reached by every rank whatever failed
        locally. Everything fallible runs under a guard *before* each collective and its
        outcome travels through it, so a fault on one rank turns the connector off on all
        ranks instead of leaving the others waiting in a collective it skipped. A collective
        that itself fails (the MPI layer) is caught by the outer guard: the connector stays off.
        """
        collectives = self._collectives
        if collectives is None:  # NOTE: no rank, no collectives: the runtime itself failed
            self._start([ShardInfo(self.rank, None, self.off_reason, 0, "")])
            return
        # NOTE: rank 0 alone derives the weights revision (it may hash the checkpoint).
        local = self._attempt("weights revision", self._revision) if self.rank == 0 else None
        revision, problem = collectives.broadcast(local or (UNKNOWN, ""))
        info = self._attempt(
            "registration", lambda: self._register_local(kv_cache_tensor, revision, problem)
        )
        if info is None:  # the guard logged it; the other ranks still need this rank's word
            info = ShardInfo(self.rank, None, "registration failed on this rank", 0, "")
        shards = [ShardInfo(**s) for s in collectives.allgather(info.__dict__)]
        self._attempt("start", lambda: self._start(shards))

    def _attempt(self, what: str, step: Callable[[], T]) -> T | None:
        try:
            return step()
        except Exception:
            logger.exception("s3kv: %s failed on rank %d; the connector turns off", what, self.rank)
            return None

    def _revision(self) -> tuple[str, str]:
        if self.config is None:
            return UNKNOWN, ""
        try:
            return weights_revision(self._llm_args, self.config), ""
        except Exception as exc:  # an unreadable checkpoint: off everywhere, with the reason
            return UNKNOWN, f"cannot derive the weights revision: {exc}"

    def _register_local(self, kv: Any, revision: str, problem: str) -> ShardInfo:
        """This rank's shard identity, store and core (no collectives).

        Rank 0 opens nothing here: its scheduler opens every shard's store after the
        all-gather (under tensor parallelism backed by the shared staging arenas and one
        manifest for the layout), and rank 0's worker then uses shard 0's store from there.
        The other ranks' stores open no manifest: their writes are relayed to rank 0's.
        """
        if problem:
            self.off_reason = problem
        info = self._describe(kv, revision)
        self._kv = kv
        if info.identity is None or self.config is None or self.rank == 0:
            return info
        relayed = None
        sized = resolve_codec_processes(
            self.config, on_gpu=on_gpu(kv), stores=1, tp_size=info.identity.tp_size
        )
        try:
            if info.identity.tp_size > 1:
                store, relayed = process_state().open_relayed_store(sized, info.identity)
            else:
                store = process_state().open_store(sized, info.identity)
        except S3KVError as exc:  # missing bucket, denied credentials: one line, named
            return ShardInfo(self.rank, None, str(exc), info.block_nbytes, info.host)
        self._pending_core = WorkerCore(
            self.rank,
            store,
            kv,
            self.config.max_inflight_save_bytes,
            relay=relayed,
            block_shape=self._block_shape(kv, self.config.codec),
        )
        return info

    def _start(self, shards: list[ShardInfo]) -> None:
        """After the all-gather: every rank on, or every rank off."""
        core, self._pending_core = self._pending_core, None
        scheduler = process_state().scheduler if self.rank == 0 else None
        off = [s for s in shards if s.identity is None]
        if off and scheduler is None:  # NOTE: on rank 0 the scheduler tells it (one line)
            logger.error(
                "s3kv: connector disabled on rank %d: rank %d: %s",
                self.rank,
                off[0].rank,
                off[0].reason,
            )
        if scheduler is not None:
            try:
                # NOTE: with a rank off, it turns itself off naming it
                scheduler.initialize(shards, on_gpu=on_gpu(self._kv))
            except Exception as exc:
                scheduler.turn_off(f"starting the scheduler failed: {exc}")
                raise
        if off:
            return
        if self.rank == 0:
            shards_on = scheduler.core.shards if scheduler and scheduler.core else None
            if scheduler is None or scheduler.core is None or shards_on is None:
                return  # rank 0's scheduler is off: nothing will be planned for any rank
            assert self.config is not None  # an identity implies a configuration
            try:
                core = WorkerCore(
                    0,
                    shards_on.stores[0],
                    self._kv,
                    self.config.max_inflight_save_bytes,
                    block_shape=self._block_shape(self._kv, self.config.codec),
                )
                core.board = scheduler.core.board
                self._after_forward = scheduler.core.after_forward
                scheduler.await_warm_start()
            except Exception as exc:
                # NOTE: a scheduler that claims with no worker on rank 0 to load the claims
                # would have the engine skip computing tokens nobody loads: it turns off
                scheduler.turn_off(f"starting rank 0's worker failed: {exc}")
                raise
        self.core = core

    @_guarded(lambda *a, **k: None)
    def register_kv_cache_layout(self, layout: Any) -> None:
        """KVCacheManagerV2's registration: one pool is served, anything else turns off.

        TensorRT-LLM's default (``connectors/kv_cache_connector.py`` @``035ab91c``) raises
        ``NotImplementedError`` out of executor construction for several groups or regions;
        s3kv still runs the registration collectives (with the reason) and switches off.
        """
        self.manager = "v2"
        tensor = None
        try:
            tensor = layout.as_single_pool_tensor()
        except Exception:
            logger.exception("s3kv: reading the KV cache layout failed")
        if tensor is None and not self.off_reason:
            groups = len(getattr(layout, "groups", ()) or ())
            self.off_reason = (
                f"the KV cache layout has {groups} layer group(s) or several memory regions "
                "(variable sliding windows, or NVFP4 block scales beside the pool); s3kv "
                "serves one contiguous pool"
            )
        self.register_kv_caches(tensor)

    def _describe(self, kv: Any, revision: str) -> ShardInfo:
        host = socket.gethostname()
        nbytes = int(kv[0].numel() * kv.element_size()) if getattr(kv, "dim", None) else 0
        reason = self.off_reason or (self._layout_problem(kv) if kv is not None else "no pool")
        if reason or self.config is None:
            return ShardInfo(self.rank, None, reason or "no configuration", nbytes, host)
        identity = shard_identity(
            self._llm_args,
            self.config,
            kv_shape=tuple(kv.shape),
            kv_dtype=kv.dtype,
            tp_size=self.tp_size,
            tp_rank=self.rank,
            revision=revision,
            manager=self.manager,
        )
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
        dtype_problem = pool_dtype_problem(self._llm_args, kv_dtype_name(kv.dtype))
        if dtype_problem:
            return dtype_problem
        if not kv.is_contiguous():
            return "KV pool is not contiguous"
        expected = _num_attention_layers(self._model_config())
        if expected is not None and int(kv.shape[1]) != expected:
            return (
                f"KV pool holds {kv.shape[1]} layers but the model has {expected}: several "
                "pools (layers with different KV head counts) or variable sliding windows"
            )
        windows = getattr(
            getattr(self._llm_args, "kv_cache_config", None), "max_attention_window", None
        )
        if windows and len(set(windows)) > 1:
            return "variable sliding-window attention (VSWA) is not supported"
        return ""

    def _model_config(self) -> dict[str, Any]:
        """The model folder's config.json (:func:`_read_model_config`), read once."""
        if self._model_json is None:
            self._model_json = _read_model_config(self._llm_args)
        return self._model_json

    def _block_shape(self, kv: Any, codec: str) -> tuple[int, ...] | None:
        return _block_shape(self._llm_args, self._model_config(), kv, codec)

    @_guarded(lambda *a, **k: None)
    def start_load_kv(self, stream: Any) -> None:
        meta = self.get_connector_meta()
        if self.core is not None and isinstance(meta, ConnectorMetadata):
            self.core.start_load(meta, stream)

    @_guarded(lambda *a, **k: None)
    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Order this layer's work after the copies of its layer group (a device-side wait)."""
        if self.core is not None:
            self.core.wait_for_layer(layer_idx, stream)

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """Nothing per layer: whole blocks are copied after the forward-pass event."""

    @_guarded(lambda *a, **k: None)
    def wait_for_save(self, stream: Any) -> None:
        try:
            meta = self.get_connector_meta()
            if self.core is not None and isinstance(meta, ConnectorMetadata):
                self.core.save_after_forward(meta, stream)
        finally:
            # NOTE: the forward pass is queued: the scheduler's prefetch walks may now take
            # the GIL, and its prompts' tokens be packed (the engine's thread soon waits for
            # the device: _forward_step, then _sample_async and _update_requests' wait on the
            # previous batch, py_executor.py @ 000439672005).
            if self._after_forward is not None:
                self._after_forward()

    # NOTE: on failure nothing is returned: an id returned twice makes TensorRT-LLM's
    # extract_by_id raise KeyError out of the executor loop; ids not returned now are
    # still awaited by the core and come back in a later call.
    @_guarded(lambda *a, **k: ([], []))
    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        """Saves whose device→host copies completed; s3kv never loads asynchronously."""
        if self.core is None:
            return list(finished_gen_req_ids), list(started_loading_req_ids)
        return self.core.finished(finished_gen_req_ids), list(started_loading_req_ids)


def _read_model_config(llm_args: Any) -> dict[str, Any]:
    """The model's config.json, or {} where it is not readable."""
    import json
    from pathlib import Path

    model = getattr(llm_args, "model", None)
    if not model:
        return {}
    config = Path(str(model)) / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _num_attention_layers(model_config: dict[str, Any]) -> int | None:
    """The model's decoder layer count from its config.json, when it gives one."""
    layers = model_config.get("num_hidden_layers")
    return int(layers) if isinstance(layers, int) else None


def _block_shape(
    llm_args: Any, model_config: dict[str, Any], kv: Any, codec: str
) -> tuple[int, ...] | None:
    """The 5-D block shape the codec's PLANES_REF needs (see :func:`block_geometry`), from
    the model's head_dim (or hidden_size / num_attention_heads) and tokens_per_block.

    Only for the TRTLLM attention backend (TensorRT-LLM's default): its kernels lay each
    block's K and V out ``[numHeads, tokensPerBlock, hiddenSizePerHead]``
    (``KVBlockArray::getKVLocalIdx``, ``cpp/tensorrt_llm/kernels/kvCacheUtils.h``
    @``deaae40b``), while other backends may not (``KVCacheManager.get_buffers`` offers NHD
    and HND views because "different attention backend/implementation can have different KV
    layouts", ``tensorrt_llm/_torch/pyexecutor/resource_manager.py`` in later versions than
    @``d2a5560a``, whose view is NHD). Where there is no shape and ``codec`` is planes-ref,
    one warning says so: the blocks are then written as PLANES_ZSTD (the same bytes back, a
    smaller ratio).
    """
    backend = str(getattr(llm_args, "attn_backend", "TRTLLM") or "TRTLLM")
    head_dim = model_config.get("head_dim")
    hidden, heads = model_config.get("hidden_size"), model_config.get("num_attention_heads")
    if not isinstance(head_dim, int) and isinstance(hidden, int) and isinstance(heads, int):
        head_dim = hidden // heads if heads > 0 else None
    shape = None
    if backend.upper() == "TRTLLM" and isinstance(head_dim, int):
        shape = block_geometry(tuple(kv.shape), _tokens_per_block(llm_args), head_dim)
    if shape is None and codec == "planes-ref":
        logger.warning(
            "s3kv: codec planes-ref needs the TRTLLM attention backend's block layout and "
            "the head size from the model folder's config.json (head_dim, or hidden_size "
            "and num_attention_heads) to divide the KV pool's blocks %s; backend %s, model "
            "%r gives %s, so blocks are written as planes-zstd",
            tuple(kv.shape[1:]),
            backend,
            getattr(llm_args, "model", None),
            f"head_dim {head_dim}" if isinstance(head_dim, int) else "none",
        )
    return shape


__all__ = [
    "S3KVConnectorScheduler",
    "S3KVConnectorWorker",
]
