"""TensorRT-LLM's ``KvCacheConnectorManager``: connector state, ranks and collectives.

Reproduces ``tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py`` (read at
``035ab91c``; the older ``_torch/pyexecutor/kv_cache_connector.py`` at ``00fdcbff`` has the
same core) for the tensor-parallel path (no attention DP, one layer group, V1 or V2 manager):

* The scheduler exists on rank 0 only; scheduler calls whose result every rank needs run
  there and are broadcast (``_run_on_leader``). By default the result is pickled and
  unpickled, on rank 0 too and with one rank, so unpicklable metadata fails here as it would
  under TP; ``copy_leader_results=False`` hands one rank the object itself, as TensorRT-LLM does
  (``mpi_broadcast`` is ``bcast(...) if global_mpi_size() > 1 else obj``,
  ``tensorrt_llm/_utils.py`` @``ed53795b``), for benchmarks that time the engine's path.
* ``get_num_new_matched_tokens`` (V1) rejects generation-only requests and ``(0, True)``,
  records async loads and the claimed count (subtracted from ``computed_position`` in the
  request's first report, then forgotten). It is ``query_num_new_matched_tokens`` (no side
  effects) followed by ``commit_new_matched_tokens`` (what the runtime honours), which
  ``KVCacheManagerV2`` calls separately because it may honour less than the offer.
* On V2 each report carries ``new_block_ids_by_layer_group`` (see
  ``_ReportedRequest.update_and_build_data``).
* ``get_finished`` passes each id to the worker exactly once, keeps what one rank finished
  until every rank has (allgather + intersection), moves finished loads back to
  ``CONTEXT_INIT`` and returns finished saves for termination.
"""

from __future__ import annotations

import collections
import dataclasses
import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from s3kv.connector.api import (
    KvCacheConnectorScheduler,
    KvCacheConnectorWorker,
    RequestData,
    SchedulerOutput,
)
from s3kv.connector.comm import Collectives, get_collectives
from s3kv.testing.emulator.request import BoundLlmRequest, LlmRequest, LlmRequestState
from s3kv.testing.emulator.scheduler import ScheduledRequests

if TYPE_CHECKING:
    from s3kv.testing.emulator.kv_cache_manager import KVCacheManager

T = TypeVar("T")


@dataclasses.dataclass
class AsyncRequests:
    """Requests with an async save or load, by id."""

    saving: dict[int, Any] = dataclasses.field(default_factory=dict)
    loading: dict[int, Any] = dataclasses.field(default_factory=dict)

    def add_from(self, other: AsyncRequests) -> None:
        """Move every request of ``other`` into this one."""
        self.saving.update(other.saving)
        self.loading.update(other.loading)
        other.saving, other.loading = {}, {}

    def extract_by_id(self, saving_ids: Any, loading_ids: Any) -> AsyncRequests:
        """Remove and return the given ids (a ``KeyError`` for an id not held, as upstream)."""
        out = AsyncRequests()
        for rid in saving_ids:
            out.saving[rid] = self.saving.pop(rid)
        for rid in loading_ids:
            out.loading[rid] = self.loading.pop(rid)
        return out

    @property
    def saving_ids(self) -> set[int]:
        """Ids of async saves."""
        return set(self.saving)

    @property
    def loading_ids(self) -> set[int]:
        """Ids of async loads."""
        return set(self.loading)


class _ReportedRequest:
    """What one request has reported so far (``KvCacheConnectorSchedulerOutputRequest``)."""

    def __init__(self) -> None:
        self.block_ids: list[int] = []
        self.block_ids_by_group: list[list[int]] = []
        self.tokens: list[int] = []

    def update_and_build_data(self, req: LlmRequest, kv: KVCacheManager) -> RequestData:
        """One report (``update_and_build_data`` @ ``035ab91c``).

        V1: ``new_block_ids`` is the delta of ``get_cache_indices``, no per-group ids. V2
        (``KVCacheManagerV2``): the delta of each group of ``get_page_indices_by_layer_group``
        in ``new_block_ids_by_layer_group``, ``new_block_ids`` is group 0's delta when there is
        one group (``[]`` for several); ``block_hashes`` empty and ``priorities`` ``None`` on
        both here (V1 hashes and retention are not emulated).
        """
        from s3kv.testing.emulator.kv_cache_manager_v2 import KVCacheManagerV2

        tokens = req.get_tokens(0)
        by_group: list[list[int]] = []
        if isinstance(kv, KVCacheManagerV2):
            indices_by_group = kv.get_page_indices_by_layer_group(req)
            while len(self.block_ids_by_group) < len(indices_by_group):
                self.block_ids_by_group.append([])
            for seen, indices in zip(self.block_ids_by_group, indices_by_group, strict=False):
                new_ids = indices[len(seen) :]
                seen.extend(new_ids)
                by_group.append(new_ids)
            new_block_ids = list(by_group[0]) if len(by_group) == 1 else []
        else:
            new_block_ids = kv.get_cache_indices(req)[len(self.block_ids) :]
        new_tokens = tokens[len(self.tokens) :]
        self.block_ids.extend(new_block_ids)
        self.tokens.extend(new_tokens)
        if req.state in (
            LlmRequestState.CONTEXT_INIT,
            LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS,
        ):
            computed_position = req.context_current_position
            num_scheduled = min(req.context_remaining_length, req.context_chunk_size)
        else:
            computed_position = len(tokens) - 1
            num_scheduled = 1 + len(req.py_draft_tokens)
        return RequestData(
            request_id=req.request_id,
            new_tokens=new_tokens,
            new_block_ids=new_block_ids,
            computed_position=computed_position,
            num_scheduled_tokens=num_scheduled,
            cache_salt=req.cache_salt,
            new_block_ids_by_layer_group=by_group,
        )


class SchedulerOutputManager:
    """Builds each iteration's ``SchedulerOutput`` (``KvCacheConnectorSchedulerOutputManager``)."""

    def __init__(self) -> None:
        self.requests: collections.defaultdict[int, _ReportedRequest] = collections.defaultdict(
            _ReportedRequest
        )
        self.external_loads: dict[int, int] = {}

    def build_scheduler_output(
        self, batch: ScheduledRequests, new_async: AsyncRequests, kv: KVCacheManager
    ) -> SchedulerOutput:
        """New requests (first report) and cached ones (every later report)."""
        out = SchedulerOutput()
        for req in batch.context_requests:
            if req.request_id in new_async.loading_ids:
                continue
            is_new = req.request_id not in self.requests
            data = self.requests[req.request_id].update_and_build_data(req, kv)
            # NOTE: the connector's tokens are not in the first report's computed_position.
            data.computed_position -= self.external_loads.get(req.request_id, 0)
            (out.new_requests if is_new else out.cached_requests).append(data)
        for req in batch.generation_requests:
            out.cached_requests.append(self.requests[req.request_id].update_and_build_data(req, kv))
        self.external_loads = {}
        return out

    def record_new_matched_tokens(self, request: Any, num_tokens: int) -> None:
        """Remember a claim until the next scheduler output."""
        self.external_loads[request.request_id] = num_tokens

    def reset_request(self, request_id: int) -> None:
        """Forget a request's deltas, so that a replay is reported as new (``035ab91c``)."""
        self.requests.pop(request_id, None)
        self.external_loads.pop(request_id, None)


class KvCacheConnectorManager:
    """Connector state and rank coordination for one rank of the executor."""

    def __init__(
        self,
        worker: KvCacheConnectorWorker,
        scheduler: KvCacheConnectorScheduler | None,
        *,
        collectives: Collectives | None = None,
        stream: Callable[[], Any] = lambda: None,
        copy_leader_results: bool = True,
    ) -> None:
        """Create the manager.

        Args:
            worker: This rank's worker.
            scheduler: The scheduler on rank 0, ``None`` elsewhere.
            collectives: Rank and collectives; default :func:`s3kv.connector.comm.get_collectives`.
            stream: Returns the stream handed to the layer hooks (TensorRT-LLM passes
                ``torch.cuda.current_stream()``; ``None`` on the CPU).
            copy_leader_results: With one rank, still hand over a pickled copy of the leader's
                results (checks that they survive the trip); ``False``: the objects
                themselves, as TensorRT-LLM does.

        Raises:
            AssertionError: A scheduler on a rank other than 0, or none on rank 0.
        """
        self.collectives = collectives if collectives is not None else get_collectives()
        if (scheduler is not None) != (self.collectives.rank == 0):
            raise AssertionError("The scheduler may only exist on rank 0!")
        self.worker = worker
        self.scheduler = scheduler
        self._stream = stream
        self._copy = copy_leader_results or self.collectives.world_size > 1
        self.new_async_requests = AsyncRequests()  # not yet passed to get_finished
        self.pending_async_requests = AsyncRequests()  # passed, not yet returned locally
        self.local_finished_async_requests = AsyncRequests()  # returned here, not everywhere
        self.finished_async_loading_requests: dict[int, Any] = {}
        self._scheduler_output: SchedulerOutput | None = None
        self.scheduler_output_manager = SchedulerOutputManager()
        self.completed_transfers = 0  # saves and loads finished on every rank, so far
        self.handle_metadata_calls = 0

    def _run_on_leader(self, f: Callable[[KvCacheConnectorScheduler], T]) -> T:
        res: Any = None
        if self.scheduler is not None:
            # NOTE: pickled on rank 0 too, and by default with one rank: under TensorRT-LLM
            # the other ranks only ever see an unpickled copy, so the result must survive it.
            res = f(self.scheduler)
            if self._copy:
                res = pickle.loads(pickle.dumps(res))
        result: T = self.collectives.broadcast(res, root=0)
        return result

    # --- allocation (from KVCacheManager.add_sequence / prepare_resources) ---

    def query_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Ask the scheduler how much it can serve past ``num_computed_tokens``; no side effects.

        ``query_num_new_matched_tokens`` @ ``035ab91c``: the leader's answer, broadcast. The
        caller must ask at most once per allocation and then call
        :meth:`commit_new_matched_tokens` with what it honours (V2 allocates per chunk, so it
        may honour less than the offer).

        Raises:
            RuntimeError: The scheduler answered ``(0, True)``.
        """
        num_tokens, load_kv_async = self._run_on_leader(
            lambda s: s.get_num_new_matched_tokens(request, num_computed_tokens)
        )
        if num_tokens == 0 and load_kv_async:
            raise RuntimeError("load_kv_async must be False when num_tokens is 0!")
        return int(num_tokens), bool(load_kv_async)

    def commit_new_matched_tokens(self, request: Any, num_tokens: int, load_kv_async: bool) -> None:
        """Record the honoured count (``commit_new_matched_tokens`` @ ``035ab91c``).

        ``load_kv_async`` parks the request even when ``num_tokens`` is 0 (upstream passes it
        through unmodified); ``num_tokens`` is subtracted from ``computed_position`` in the
        next scheduler output and set as ``request.py_num_connector_matched_tokens``.
        """
        if load_kv_async:
            self.new_async_requests.loading[request.request_id] = request
        self.scheduler_output_manager.record_new_matched_tokens(request, num_tokens)
        request.py_num_connector_matched_tokens = num_tokens

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """V1: query and commit in one step (the C++ manager honours the whole offer).

        Raises:
            RuntimeError: Generation-only request, or the scheduler answered ``(0, True)``.
        """
        if request.is_generation_only_request:
            raise RuntimeError("Connector API is not supported for generation-only requests!")
        num_tokens, load_kv_async = self.query_num_new_matched_tokens(request, num_computed_tokens)
        self.commit_new_matched_tokens(request, num_tokens, load_kv_async)
        return num_tokens

    def reset_request_state(self, request: LlmRequest) -> None:
        """A destroyed allocation: its next report is a new request again (``035ab91c``)."""
        self.scheduler_output_manager.reset_request(request.request_id)

    def should_add_sequence(self, request: LlmRequest) -> bool:
        """False for a request whose blocks were allocated before its async load."""
        return request.request_id not in self.finished_async_loading_requests

    def update_state_after_alloc(self, request: LlmRequest, block_ids: list[int]) -> None:
        """Hand the scheduler the request's blocks (leader only, no collective)."""
        if self.scheduler is not None:
            self.scheduler.update_state_after_alloc(request, block_ids)

    def build_scheduler_output(self, batch: ScheduledRequests, kv: KVCacheManager) -> None:
        """Build this iteration's scheduler output (consumed by :meth:`handle_metadata`)."""
        self._scheduler_output = self.scheduler_output_manager.build_scheduler_output(
            batch, self.new_async_requests, kv
        )

    # --- one batch ---

    def take_scheduled_requests_pending_load(self, batch: ScheduledRequests) -> None:
        """Pull requests with an async load out of the batch and park them."""
        for key in ("context_requests_chunking", "context_requests_last_chunk"):
            kept = []
            for req in getattr(batch, key):
                if req.request_id in self.new_async_requests.loading:
                    req.state = LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS
                    # NOTE: replace the C++ view recorded at the claim by the canonical request.
                    self.new_async_requests.loading[req.request_id] = req
                else:
                    kept.append(req)
            setattr(batch, key, kept)

    def handle_metadata(self) -> None:
        """``build_connector_meta`` on the leader, broadcast, bind on every worker.

        A no-op without a scheduler output since the last call (main's executor calls it
        every iteration, see :mod:`s3kv.testing.emulator.loop`); :attr:`handle_metadata_calls`
        counts every call.
        """
        self.handle_metadata_calls += 1
        if self._scheduler_output is None:
            return
        output = self._scheduler_output
        metadata = self._run_on_leader(lambda s: s.build_connector_meta(output))
        self._scheduler_output = None
        self.worker.bind_connector_meta(metadata)

    def layer_pre_hook(self, layer_idx: int) -> None:
        """Before a decoder layer's work: ``wait_for_layer_load``."""
        self.worker.wait_for_layer_load(layer_idx, self._stream())

    def layer_post_hook(self, layer_idx: int) -> None:
        """After a decoder layer's work: ``save_kv_layer``."""
        self.worker.save_kv_layer(layer_idx, self._stream())

    # --- request end and async completion ---

    def request_finished(self, request: LlmRequest, cache_block_ids: list[int]) -> bool:
        """Tell the scheduler a request finished; ``True`` keeps its blocks for a save."""
        self.finished_async_loading_requests.pop(request.request_id, None)
        saving_async = bool(
            self._run_on_leader(lambda s: s.request_finished(request, cache_block_ids))
        )
        if saving_async:
            self.new_async_requests.saving[request.request_id] = request
            request.state = LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS
        return saving_async

    def get_finished(self) -> list[Any]:
        """Poll the worker; return the requests whose save finished on every rank."""
        started_loading = list(self.new_async_requests.loading_ids)
        finished_gen = list(self.new_async_requests.saving_ids)
        self.pending_async_requests.add_from(self.new_async_requests)
        finished_saving, finished_loading = self.worker.get_finished(finished_gen, started_loading)
        self.local_finished_async_requests.add_from(
            self.pending_async_requests.extract_by_id(finished_saving, finished_loading)
        )
        local = (
            list(self.local_finished_async_requests.saving_ids),
            list(self.local_finished_async_requests.loading_ids),
        )
        everyone = self.collectives.allgather(local)
        saved = set.intersection(*[set(r[0]) for r in everyone])
        loaded = set.intersection(*[set(r[1]) for r in everyone])
        done = self.local_finished_async_requests.extract_by_id(saved, loaded)
        self.completed_transfers += len(done.saving) + len(done.loading)
        for rid, req in done.loading.items():
            req.state = LlmRequestState.CONTEXT_INIT
            self.finished_async_loading_requests[rid] = req
        return list(done.saving.values())

    def has_pending_transfers(self) -> bool:
        """Any async save or load not yet finished on every rank."""
        return any(
            group.saving or group.loading
            for group in (
                self.new_async_requests,
                self.pending_async_requests,
                self.local_finished_async_requests,
            )
        )

    def wait_for_initialization(self) -> None:
        """The scheduler's start-up wait (rank 0 only)."""
        if self.scheduler is not None:
            self.scheduler.wait_for_initialization()

    def check_bookkeeping(self) -> None:
        """Assert the async-transfer bookkeeping is consistent (for fault-injection tests).

        Every async request is in exactly one of new / pending / locally finished, and no id
        is both saving and loading. A worker that returns an id twice or one it was never
        given does not get here: ``get_finished`` raises ``KeyError`` from ``extract_by_id``
        first, as upstream (``AsyncRequests.extract_by_id`` @ ``035ab91c``).

        Raises:
            AssertionError: An id is held twice.
        """
        groups = (
            self.new_async_requests,
            self.pending_async_requests,
            self.local_finished_async_requests,
        )
        for kind in ("saving", "loading"):
            ids = [rid for group in groups for rid in getattr(group, kind)]
            if len(ids) != len(set(ids)):
                raise AssertionError(f"async {kind} ids held twice: {sorted(ids)}")
        saving = {rid for group in groups for rid in group.saving}
        loading = {rid for group in groups for rid in group.loading}
        if saving & loading:
            raise AssertionError(f"ids both saving and loading: {sorted(saving & loading)}")


__all__ = [
    "AsyncRequests",
    "BoundLlmRequest",
    "KvCacheConnectorManager",
    "SchedulerOutputManager",
]
