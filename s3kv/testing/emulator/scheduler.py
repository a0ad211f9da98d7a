"""Which requests run this iteration: capacity scheduling, then token-budget batching.

TensorRT-LLM schedules in two steps (``tensorrt_llm/_torch/pyexecutor/scheduler.py`` binding
the C++ ``CapacityScheduler`` and ``MicroBatchScheduler``):

1. Capacity, ``GUARANTEED_NO_EVICT``: every request already holding KV keeps running, and
   the blocks it still needs to finish (prompt + ``max_new_tokens``) are reserved. A new
   request is admitted only if its whole need fits in the rest of the free blocks; the first
   one that does not fit stops admission (first come, first served).
2. Micro-batch: at most ``max_batch_size`` requests and ``max_num_tokens`` tokens. A
   generation request costs one token (plus draft tokens); a context request costs its
   chunk. With chunked prefill a chunk is what is left of the budget, rounded down to whole
   blocks unless it finishes the prompt; without it, the whole remaining prompt must fit.

Under the overlap scheduler a request in ``GENERATION_TO_COMPLETE`` (its last token is in
flight) is not scheduled again (``no_schedule_after_state``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from s3kv.testing.emulator.request import LlmRequest, LlmRequestState

if TYPE_CHECKING:
    from s3kv.testing.emulator.kv_cache_manager import KVCacheManager


@dataclasses.dataclass
class ScheduledRequests:
    """One iteration's batch (``ScheduledRequests`` in TensorRT-LLM).

    Context requests are kept in two buckets, as there: those whose chunk ends the prompt
    and those that do not; :attr:`context_requests` is both, in that order.
    """

    context_requests_chunking: list[LlmRequest] = dataclasses.field(default_factory=list)
    context_requests_last_chunk: list[LlmRequest] = dataclasses.field(default_factory=list)
    generation_requests: list[LlmRequest] = dataclasses.field(default_factory=list)

    @property
    def context_requests(self) -> list[LlmRequest]:
        """Every context request of the batch."""
        return self.context_requests_chunking + self.context_requests_last_chunk

    def reset_context_requests(self, requests: Iterable[LlmRequest] | None = None) -> None:
        """Re-bucket context requests (a reuse hit can turn a chunk into the last one)."""
        pool = list(self.context_requests if requests is None else requests)
        self.context_requests_chunking = [r for r in pool if not r.is_last_context_chunk]
        self.context_requests_last_chunk = [r for r in pool if r.is_last_context_chunk]

    @property
    def batch_size(self) -> int:
        """Requests in the batch."""
        return len(self.context_requests) + len(self.generation_requests)

    def all_requests(self) -> list[LlmRequest]:
        """Context requests, then generation requests."""
        return self.context_requests + self.generation_requests


class RequestScheduler:
    """``GUARANTEED_NO_EVICT`` capacity scheduling plus token-budget micro-batching."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_batch_size: int,
        max_num_tokens: int,
        enable_chunked_prefill: bool,
        tokens_per_block: int,
    ) -> None:
        self._kv = kv_cache_manager
        self._max_batch_size = max_batch_size
        self._max_num_tokens = max_num_tokens
        self._chunked = enable_chunked_prefill
        self._tpb = tokens_per_block

    def schedule(self, active: Sequence[LlmRequest]) -> ScheduledRequests:
        """This iteration's batch from the active requests, in arrival order.

        Sets ``context_chunk_size`` on every scheduled context request.
        """
        fitting = self._capacity(active)
        return self._micro_batch(fitting)

    def _capacity(self, active: Sequence[LlmRequest]) -> list[LlmRequest]:
        available = self._kv.get_num_free_blocks()
        for req in active:
            if self._kv.has_sequence(req) and not req.is_finished:
                available -= self._kv.remaining_blocks_to_completion(req)
        fitting: list[LlmRequest] = []
        for req in active:
            if len(fitting) >= self._max_batch_size:
                break
            if req.state == LlmRequestState.GENERATION_IN_PROGRESS:
                fitting.append(req)
            elif req.state == LlmRequestState.CONTEXT_INIT:
                if self._kv.has_sequence(req):
                    fitting.append(req)  # NOTE: in progress (chunked or loaded): reserved above
                    continue
                needed = self._kv.blocks_to_completion(req)
                if needed > available:
                    break  # NOTE: first come, first served: nothing overtakes it
                available -= needed
                fitting.append(req)
        return fitting

    def _micro_batch(self, fitting: Sequence[LlmRequest]) -> ScheduledRequests:
        batch = ScheduledRequests()
        budget = self._max_num_tokens
        for req in fitting:
            if req.state == LlmRequestState.GENERATION_IN_PROGRESS:
                batch.generation_requests.append(req)
                budget -= 1 + len(req.py_draft_tokens)
        contexts: list[LlmRequest] = []
        for req in fitting:
            if req.state != LlmRequestState.CONTEXT_INIT:
                continue
            remaining = req.context_remaining_length
            if remaining <= budget:
                chunk = remaining
            elif self._chunked:
                chunk = budget // self._tpb * self._tpb
            else:
                break
            if chunk <= 0:
                break
            req.context_chunk_size = chunk
            budget -= chunk
            contexts.append(req)
        batch.reset_context_requests(contexts)
        return batch


def blocks_for(num_tokens: int, tokens_per_block: int) -> int:
    """Blocks that hold ``num_tokens`` tokens."""
    return math.ceil(num_tokens / tokens_per_block)


__all__ = ["RequestScheduler", "ScheduledRequests", "blocks_for"]
