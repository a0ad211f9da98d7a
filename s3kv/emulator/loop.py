"""One executor iteration, in TensorRT-LLM's order (``PyExecutor._executor_loop[_overlap]``).

Plain loop (``disable_overlap_scheduler=True``), per iteration:

1. schedule; if the batch is not empty: ``prepare_resources`` (allocation,
   ``update_state_after_alloc``, ``build_scheduler_output``), then
   ``_kv_connector_start_batch``: park async loads, ``handle_metadata``, ``start_load_kv``;
2. if the batch is still not empty: forward pass (layer hooks, forward-pass callable),
   ``wait_for_save``, sampling, ``_update_request_states``, ``_update_requests``,
   ``_send_kv_async`` (``request_finished`` for finished requests), responses and
   termination, ``update_resources``;
3. ``get_finished`` (every iteration, even an empty one); finished saves are terminated.

Overlap loop: the same, except that the forward pass of iteration *k* runs before the
results of iteration *k-1* are committed: tokens, ``request_finished``, termination and
``update_resources`` for the previous batch happen after this batch's forward pass. So a
generation step is scheduled before the previous token is known (its report has no new
token), a request whose last token is in flight (``GENERATION_TO_COMPLETE``) is not
scheduled again, and one extra iteration at the end commits the last token (hence one
extra ``get_finished``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from s3kv.emulator.connector_manager import KvCacheConnectorManager
from s3kv.emulator.kv_cache_manager import KVCacheManager
from s3kv.emulator.model import ForwardItem, PagedLlama
from s3kv.emulator.request import LlmRequest, LlmRequestState
from s3kv.emulator.scheduler import RequestScheduler, ScheduledRequests


@dataclasses.dataclass
class Tracked:
    """Executor-side bookkeeping for one request (not visible to the connector)."""

    request: LlmRequest
    submitted: float
    first_token: float | None = None
    finished: float | None = None
    loaded_async: bool = False
    pending_token: int | None = None  # overlap: sampled, not yet committed


@dataclasses.dataclass
class _BatchState:
    batch: ScheduledRequests
    sampled: dict[int, int]


class ExecutorLoop:
    """The per-iteration machinery shared by both loop variants."""

    def __init__(
        self,
        *,
        model: PagedLlama,
        pool: Any,
        kv: KVCacheManager,
        scheduler: RequestScheduler,
        connector: KvCacheConnectorManager | None,
        forward_callable: Callable[[], Any] | None,
        overlap: bool,
        stream: Callable[[], Any],
        clock: Callable[[], float],
    ) -> None:
        self.model = model
        self.pool = pool
        self.kv = kv
        self.scheduler = scheduler
        self.connector = connector
        self.forward_callable = forward_callable
        self.overlap = overlap
        self.stream = stream
        self.clock = clock
        self.active: list[LlmRequest] = []  # arrival order, parked loads included
        self.tracked: dict[int, Tracked] = {}
        self.saving: dict[int, LlmRequest] = {}  # async saves holding their blocks
        self.previous: _BatchState | None = None
        self.iterations = 0
        self.forward_passes = 0

    def step(self) -> bool:
        """Run one iteration; whether anything moved (a forward pass or a commit)."""
        self.iterations += 1
        batch = self.scheduler.schedule(self.active)
        if batch.batch_size > 0:
            self.kv.prepare_resources(batch)
            self._start_batch(batch)
        # NOTE: the batch may have shrunk (async loads parked): checked again, as upstream.
        sampled = self._forward(batch) if batch.batch_size > 0 else None
        moved = sampled is not None
        if self.overlap:
            previous, self.previous = self.previous, None
            if previous is not None:
                self._update_requests(previous)
                self._send_kv_async(previous.batch.all_requests())
                moved = True
            if sampled is not None:
                self._update_request_states(batch)
                self._record_pending(batch, sampled)
                self.previous = _BatchState(batch, sampled)
            if previous is not None:
                self._handle_responses()
                self.kv.update_resources(previous.batch)
        elif sampled is not None:
            self._update_request_states(batch)
            self._update_requests(_BatchState(batch, sampled))
            self._send_kv_async(batch.all_requests())
            self._handle_responses()
            self.kv.update_resources(batch)
        return self._terminate_finished_transfers() or moved

    # --- the steps ---

    def _start_batch(self, batch: ScheduledRequests) -> None:
        """``_kv_connector_start_batch``."""
        if self.connector is None:
            return
        before = {r.request_id for r in batch.context_requests}
        self.connector.take_scheduled_requests_pending_load(batch)
        for rid in before - {r.request_id for r in batch.context_requests}:
            self.tracked[rid].loaded_async = True
        self.connector.handle_metadata()
        self.connector.worker.start_load_kv(self.stream())

    def _forward(self, batch: ScheduledRequests) -> dict[int, int]:
        """``_forward_step``: the model with the layer hooks, the callable, ``wait_for_save``."""
        items = []
        for req in batch.context_requests:
            start = req.context_current_position
            prompt = req.get_tokens(0)[: req.prompt_len]
            items.append(
                ForwardItem(
                    prompt, self.kv.get_cache_indices(req), start, start + req.context_chunk_size
                )
            )
        for req in batch.generation_requests:
            tokens = req.get_tokens(0)
            pending = self.tracked[req.request_id].pending_token
            if pending is not None:
                tokens.append(pending)  # NOTE: overlap: the previous step's token, on device
            items.append(
                ForwardItem(tokens, self.kv.get_cache_indices(req), len(tokens) - 1, len(tokens))
            )
        hooks: dict[str, Any] = {}
        if self.connector is not None:
            hooks = {
                "pre_layer": self.connector.layer_pre_hook,
                "post_layer": self.connector.layer_post_hook,
            }
        next_tokens = self.model.forward(items, self.pool, **hooks)
        if self.forward_callable is not None:
            self.forward_callable()  # NOTE: end of the model engine's forward, same stream
        if self.connector is not None:
            self.connector.worker.wait_for_save(self.stream())
        self.forward_passes += 1
        return {r.request_id: t for r, t in zip(batch.all_requests(), next_tokens, strict=True)}

    def _update_request_states(self, batch: ScheduledRequests) -> None:
        """Advance context cursors; under overlap, mark requests whose last token is in flight."""
        for req in batch.context_requests:
            req.move_to_next_context_chunk()
            if req.context_remaining_length == 0:
                complete = self.overlap and req.will_complete_next_iteration()
                req.state = (
                    LlmRequestState.GENERATION_TO_COMPLETE
                    if complete
                    else LlmRequestState.GENERATION_IN_PROGRESS
                )
        if self.overlap:
            for req in batch.generation_requests:
                if (
                    req.state == LlmRequestState.GENERATION_IN_PROGRESS
                    and req.will_complete_next_iteration()
                ):
                    req.state = LlmRequestState.GENERATION_TO_COMPLETE

    def _update_requests(self, state: _BatchState) -> None:
        """The sampler's ``update_requests``: commit tokens, finish by length."""
        now = self.clock()
        for req in state.batch.all_requests():
            if req.context_remaining_length > 0 or req.request_id not in state.sampled:
                continue  # NOTE: a context chunk that is not the last produces no token
            tracked = self.tracked[req.request_id]
            tracked.pending_token = None
            req.add_new_token(state.sampled[req.request_id])
            req.py_decoding_iter += 1
            if tracked.first_token is None:
                tracked.first_token = now
            if req.max_num_generated_tokens >= req.max_new_tokens:
                req.state = LlmRequestState.GENERATION_COMPLETE

    def _record_pending(self, batch: ScheduledRequests, sampled: dict[int, int]) -> None:
        """Overlap: a sampled token stays on the device until the next iteration commits it."""
        for req in batch.all_requests():
            if req.context_remaining_length == 0:
                self.tracked[req.request_id].pending_token = sampled[req.request_id]

    def _send_kv_async(self, requests: list[LlmRequest]) -> None:
        """``request_finished`` for each finished request; ``True`` keeps its blocks."""
        if self.connector is None:
            return
        for req in requests:
            if req.state != LlmRequestState.GENERATION_COMPLETE:
                continue
            if self.connector.request_finished(req, self.kv.get_cache_indices(req)):
                self.saving[req.request_id] = req

    def _handle_responses(self) -> None:
        """Finished requests leave the active list; those not saving are terminated."""
        now = self.clock()
        keep = []
        for req in self.active:
            if not req.is_finished:
                keep.append(req)
                continue
            self.tracked[req.request_id].finished = now
            if req.request_id not in self.saving:
                self.kv.free_resources(req)
        self.active = keep

    def _terminate_finished_transfers(self) -> bool:
        """``_kv_connector_terminate_requests``: ``get_finished``, then free saved requests."""
        if self.connector is None:
            return False
        before = self.connector.completed_transfers
        for req in self.connector.get_finished():
            self.saving.pop(req.request_id, None)
            self.kv.free_resources(req)
        return self.connector.completed_transfers != before


__all__ = ["ExecutorLoop", "Tracked"]
