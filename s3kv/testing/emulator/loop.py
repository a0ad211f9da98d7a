"""One executor iteration, in TensorRT-LLM's order (``PyExecutor._executor_loop[_overlap]``).

Plain loop (``disable_overlap_scheduler=True``), per iteration:

1. schedule; if the batch is not empty: ``prepare_resources`` (allocation,
   ``update_state_after_alloc``, ``build_scheduler_output``); on the main runtime
   ``handle_metadata`` (every iteration, even an empty one; the 1.2-era loop does not);
   then, if the batch is not empty, ``_kv_connector_start_batch``: park async loads,
   ``handle_metadata``, ``start_load_kv``;
2. if the batch is still not empty: forward pass (layer hooks, forward-pass callable),
   ``wait_for_save``, sampling, ``_update_request_states``, ``_update_requests``,
   ``_send_kv_async`` (``request_finished`` for finished requests),
   ``_handle_canceled_requests``, responses and termination, ``update_resources``;
3. ``get_finished`` (every iteration, even an empty one); finished saves are terminated.

With CUDA graphs on (the main runtime only), a batch of decode steps alone, or with final
one-token context chunks only, runs without the layer hooks, as a replayed graph does.

Overlap loop: the same, except that the forward pass of iteration *k* runs before the
results of iteration *k-1* are committed: tokens, ``request_finished``, termination and
``update_resources`` for the previous batch happen after this batch's forward pass. So a
generation step is scheduled before the previous token is known (its report has no new
token), a request whose last token is in flight (``GENERATION_TO_COMPLETE``) is not
scheduled again, and one extra iteration at the end commits the last token (hence one
extra ``get_finished``).

With a :class:`~s3kv.testing.emulator.device.LateDevice` (the default on a CPU model) the forward
step is *queued*, not run: the layer hooks, the forward-pass callable and ``wait_for_save``
are called on the host at enqueue time, in the order above, while the model's arithmetic
runs when the host synchronises. The host synchronises where TensorRT-LLM blocks on the
sampled tokens (``_update_requests``): the plain loop right after this iteration's forward
step; the overlap loop when it commits the *previous* batch, i.e. after this iteration's
``prepare_resources``, ``_kv_connector_start_batch`` and forward step were queued, and only
up to the event recorded after the previous forward step (``wait_for_save``'s work
included). An iteration with nothing to run synchronises fully (a GPU drains its queue
eventually).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

from s3kv.connector.device import DONE, StreamEvent
from s3kv.testing.emulator.connector_manager import KvCacheConnectorManager
from s3kv.testing.emulator.device import DeviceValue, LateDevice
from s3kv.testing.emulator.graphs import DecodeGraphs, DecodeItem
from s3kv.testing.emulator.kernels import DeviceTokens
from s3kv.testing.emulator.kv_cache_manager import KVCacheManager
from s3kv.testing.emulator.model import ForwardItem, PagedLlama
from s3kv.testing.emulator.request import FinishReason, LlmRequest, LlmRequestState
from s3kv.testing.emulator.scheduler import RequestScheduler, ScheduledRequests


@dataclasses.dataclass
class Tracked:
    """Executor-side bookkeeping for one request (not visible to the connector)."""

    request: LlmRequest
    submitted: float
    first_token: float | None = None
    finished: float | None = None
    loaded_async: bool = False
    pending: _BatchState | None = None  # overlap: the batch whose token is not committed


@dataclasses.dataclass
class _BatchState:
    """A queued forward step: its batch, sampled tokens (in batch order) and end event."""

    batch: ScheduledRequests
    tokens: DeviceValue[Sequence[int]]
    event: StreamEvent
    index: dict[int, int] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.index = {r.request_id: n for n, r in enumerate(self.batch.all_requests())}

    def token(self, request_id: int) -> int:
        """The token sampled for ``request_id`` (only once the forward step has run)."""
        return self.tokens.get()[self.index[request_id]]


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
        device: LateDevice | None = None,
        runtime: str = "main",
        graph_decode: bool = False,
    ) -> None:
        self.runtime = runtime  # "main" or "1.2": where handle_metadata is called
        self.graph_decode = graph_decode  # decode(-shaped) batches replay a CUDA graph
        # NOTE: on a CUDA model of one rank the replay is a real captured graph; elsewhere
        # (CPU, TP ranks) the pass runs eagerly, still without the layer hooks.
        self.graphs = (
            DecodeGraphs(model, pool)
            if graph_decode and device is None and DecodeGraphs.supported(model)
            else None
        )
        self.canceled: set[int] = set()  # ids cancelled, not yet handled
        self.errors: dict[int, str] = {}  # request id -> error message (fail_all)
        self.model = model
        self.pool = pool
        self.kv = kv
        self.scheduler = scheduler
        self.connector = connector
        self.forward_callable = forward_callable
        self.overlap = overlap
        self.stream = stream
        self.clock = clock
        self.device = device
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
        if self.connector is not None and self.runtime == "main":
            self.connector.handle_metadata()  # NOTE: main: every iteration, outside can_queue
        if batch.batch_size > 0:
            self._start_batch(batch)
        # NOTE: the batch may have shrunk (async loads parked): checked again, as upstream.
        current = self._forward(batch) if batch.batch_size > 0 else None
        if current is None and self.device is not None:
            self.device.synchronize()  # NOTE: idle: the device drains its queue
        moved = current is not None
        if self.overlap:
            previous, self.previous = self.previous, None
            if previous is not None:
                previous.event.synchronize()  # NOTE: _update_requests(previous_batch)
                self._update_requests(previous)
                self._send_kv_async(previous.batch.all_requests())
                moved = True
            if current is not None:
                self._update_request_states(batch)
                self._record_pending(current)
                self.previous = current
            if previous is not None:
                self._handle_canceled_requests()  # NOTE: _process_previous_batch
                self._handle_responses()
                self.kv.update_resources(previous.batch)
        elif current is not None:
            current.event.synchronize()  # NOTE: sampling waits for the forward step
            self._update_request_states(batch)
            self._update_requests(current)
            self._send_kv_async(batch.all_requests())
            self._handle_canceled_requests()
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

    def _forward(self, batch: ScheduledRequests) -> _BatchState:
        """``_forward_step``: the model with the layer hooks, the callable, ``wait_for_save``.

        Without a device everything runs now. With one, the model's work is queued and the
        host only calls the hooks, the callable and ``wait_for_save``; the items are built
        from a host snapshot taken now, except a generation request's uncommitted token,
        which the queued work reads from the previous pass's result (as the engine reads it
        from device memory).
        """
        snapshot: list[tuple[list[int], list[int], int, int, _BatchState | None]] = []
        for req in batch.context_requests:
            start = req.context_current_position
            prompt = req.get_tokens(0)[: req.prompt_len]
            blocks = self.kv.get_cache_indices(req)
            snapshot.append((prompt, blocks, start, start + req.context_chunk_size, None))
        for req in batch.generation_requests:
            tokens = req.get_tokens(0)
            pending = self.tracked[req.request_id].pending
            end = len(tokens) + (pending is not None)
            snapshot.append((tokens, self.kv.get_cache_indices(req), end - 1, end, pending))
        ids = [r.request_id for r in batch.all_requests()]

        def items() -> list[ForwardItem]:
            out = []
            for (tokens, blocks, start, end, pending), rid in zip(snapshot, ids, strict=True):
                # NOTE: overlap: the previous step's token, still on the device.
                extra = [] if pending is None else [pending.token(rid)]
                out.append(ForwardItem([*tokens, *extra], blocks, start, end))
            return out

        hooks: dict[str, Any] = {}
        # NOTE: a decode-only batch replays a captured CUDA graph when CUDA graphs are on
        # (TorchLlmArgs.cuda_graph_config, on by default: llmapi/llm_args.py @ fcd3f316),
        # and so does one whose contexts are all final one-token chunks (main's
        # _make_single_token_context_graph_batch, _torch/pyexecutor/engine/runners/decoder/
        # runner.py @ fcc4432b): the decoder layers' Python hooks do not run; the
        # forward-pass callable and wait_for_save still do.
        replayed = self.graph_decode and all(
            req.context_chunk_size == 1 and req.context_current_position + 1 == req.prompt_len
            for req in batch.context_requests
        )
        if self.connector is not None and not replayed:
            hooks = {
                "pre_layer": self.connector.layer_pre_hook,
                "post_layer": self.connector.layer_post_hook,
            }
        cuda = self.device is None and self.model.device.type == "cuda"
        sampled: DeviceValue[Sequence[int]]
        if replayed and self.graphs is not None:
            sampled = DeviceValue.of(self.graphs.launch(_decode_items(snapshot, ids)))
        elif cuda:
            # NOTE: kernels queued, not waited for: the host syncs where the engine does.
            sampled = self.model.launch_forward(items(), self.pool, **hooks)
        elif self.device is None:
            now: Sequence[int] = self.model.forward(items(), self.pool, **hooks)
            sampled = DeviceValue.of(now)
        else:
            queued = self.model.enqueue_forward(items, self.pool, self.device.enqueue, **hooks)
            sampled = cast(DeviceValue[Sequence[int]], queued)
        if self.forward_callable is not None:
            self.forward_callable()  # NOTE: end of the model engine's forward, same stream
        if self.connector is not None:
            self.connector.worker.wait_for_save(self.stream())
        if cuda:
            # NOTE: _sample_async, after _forward_step's wait_for_save (py_executor.py @
            # 000439672005; TorchSampler.sample_async in sampler.py @ 28edbcdb queues the
            # new tokens' copy to the host), so it lands behind what the connector queued.
            tokens = sampled.get()
            if isinstance(tokens, DeviceTokens):
                tokens.copy_to_host()
        self.forward_passes += 1
        event: StreamEvent = DONE
        if cuda:
            event = _cuda_event()
        elif self.device is not None:
            event = self.device.record_event()
        return _BatchState(batch, sampled, event)

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
            if req.context_remaining_length > 0:
                continue  # NOTE: a context chunk that is not the last produces no token
            tracked = self.tracked[req.request_id]
            tracked.pending = None
            if req.is_finished:
                continue  # NOTE: overlap: cancelled or failed while its token was in flight
            req.add_new_token(state.token(req.request_id))
            req.py_decoding_iter += 1
            if tracked.first_token is None:
                tracked.first_token = now
            if req.max_num_generated_tokens >= req.max_new_tokens:
                req.state = LlmRequestState.GENERATION_COMPLETE

    def _record_pending(self, state: _BatchState) -> None:
        """Overlap: a sampled token stays on the device until the next iteration commits it."""
        for req in state.batch.all_requests():
            if req.context_remaining_length == 0:
                self.tracked[req.request_id].pending = state

    def _send_kv_async(self, requests: list[LlmRequest]) -> None:
        """``request_finished`` for each finished request; ``True`` keeps its blocks."""
        if self.connector is None:
            return
        for req in requests:
            if req.state != LlmRequestState.GENERATION_COMPLETE:
                continue
            if not self.kv.has_sequence(req):
                continue  # NOTE: overlap: already terminated (cancelled) in the last iteration
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

    # --- cancellation and errors (py_executor.py @ 00043967, trtllm-notes.md section 2) ---

    def _handle_canceled_requests(self) -> None:
        """``_handle_canceled_requests``: cancelled active requests finish as ``CANCELLED``.

        No connector call: ``_handle_responses`` right after terminates them
        (``free_resources``) without ``request_finished`` (``_try_cancel_request`` is ``True``
        without a transceiver, even for a request parked in an async load). A request that
        already finished is left alone (its save, if any, is released by ``get_finished``).
        """
        if not self.canceled:
            return
        for req in self.active:
            if req.request_id in self.canceled and not req.is_finished:
                req.finish_by_reason(FinishReason.CANCELLED)
                self.canceled.discard(req.request_id)

    def fail_all(self, message: str) -> list[int]:
        """``_handle_errors(message, requests=None)``: fail and terminate every active request.

        Each request (async saves in flight included, which upstream keeps in
        ``active_requests``) is marked complete, freed with ``free_resources`` and dropped,
        with no connector call; the in-flight overlap batch is dropped. The connector manager
        keeps its async bookkeeping, so ``get_finished`` must still return those ids once.
        Returns the failed ids.
        """
        now = self.clock()
        failed = [*self.active, *self.saving.values()]
        for req in failed:
            req.finish_by_reason(FinishReason.ERROR)
            self.errors[req.request_id] = message
            tracked = self.tracked[req.request_id]
            tracked.pending = None
            if tracked.finished is None:
                tracked.finished = now
            self.kv.free_resources(req)
        self.active, self.saving, self.previous = [], {}, None
        return [req.request_id for req in failed]


def _cuda_event() -> StreamEvent:
    """An event after everything queued so far on the current CUDA stream."""
    import torch

    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    result: StreamEvent = event
    return result


def _decode_items(
    snapshot: list[tuple[list[int], list[int], int, int, _BatchState | None]], ids: list[int]
) -> list[DecodeItem]:
    """A replayed pass's sequences; a token still on the device is read there, not waited for."""
    items = []
    for (tokens, blocks, start, _end, pending), rid in zip(snapshot, ids, strict=True):
        if pending is None:
            items.append(DecodeItem(blocks, start, token=tokens[start]))
            continue
        sampled = pending.tokens.get()
        if isinstance(sampled, DeviceTokens):
            items.append(DecodeItem(blocks, start, pending=(sampled, pending.index[rid])))
        else:
            items.append(DecodeItem(blocks, start, token=sampled[pending.index[rid]]))
    return items


__all__ = ["ExecutorLoop", "Tracked"]
