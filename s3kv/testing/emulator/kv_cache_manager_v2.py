"""TensorRT-LLM's ``KVCacheManagerV2`` as the connector sees it: per-chunk pages, query/commit.

Modelled on TensorRT-LLM's own unit tests of the connector prefix path,
``tests/unittest/_torch/.../test_kv_connector_v2_prefix.py`` (stored-file id 57539656528,
which drives the real ``KVCacheManagerV2._run_kv_connector_hooks`` and
``_apply_connector_matched_prefix``), and on the connector manager it calls
(``connectors/kv_cache_connector.py`` @ ``035ab91c``). The manager's own source
(``kv_cache/kv_cache_manager_v2.py``, 213 kB @ ``00043967``) was not read line by line.

Per context request, in :meth:`KVCacheManagerV2.prepare_resources` (on the final batch, after
scheduling, as V1):

1. **First chunk** (no pages yet): local prefix match over ``prompt_len - 1`` tokens (V1's
   block pool and radix tree; token-granular with partial reuse), ``L`` tokens;
   ``set_prepopulated_prompt_len(L)`` moves the chunk window; pages are allocated for
   ``[0, context_current_position + context_chunk_size)`` only — **the current chunk**.
2. **Connector, once per allocation** (memo cleared by :meth:`free_resources`, so a destroyed
   allocation asks again), unless the request is a dummy or generation-only, block reuse is
   off, or ``should_add_sequence`` is false (its async load completed: neither asked nor
   reported again): ``query_num_new_matched_tokens(request, L)`` (the Python request, not
   the C++ view), then the offer ``N`` is **honoured** as ``M <= N``:

   * the target ``min(L + N, prompt_len - 1)`` (the last prompt token stays local);
   * target inside the chunk: the chunk's end stays, its start moves to the target;
   * target at or past the chunk's end (chunked prefill only): the window shifts to start
     at the target with the scheduler's chunk size, its end floored to a block boundary
     unless it is the prompt's end, and the pages **grow** to the new end. A grow fails
     when it needs more than ``grow_limit_blocks`` blocks beyond the chunk's pages, or more
     than are free (``OutOfPagesError`` upstream); then only the largest whole block inside
     the existing pages that still leaves a chunk to compute is honoured (nothing if that is
     not past ``L``);

   then ``commit_new_matched_tokens(request, M, load_async)`` (``load_async`` passed through
   even when ``M == 0``) and ``prefix_stats`` records ``(L, M)``.
3. ``update_state_after_alloc(request, pages allocated so far)`` — once per allocation, after
   the serve (so it includes grown pages), also for requests never queried.
4. **Later chunks**: pages grow to the chunk's end when it is scheduled; no connector call —
   the connector sees them as ``RequestData.new_block_ids`` deltas.

Decode (``add_token``), ``store_context_blocks``, ``free_resources`` and the capacity numbers
are V1's. One layer group: :meth:`get_page_indices_by_layer_group` is ``[get_cache_indices]``.

Not modelled: ``resize``/history (sliding windows), ``num_extra_kv_tokens``, SWA scratch
reuse, the V2 scheduler (it coerces the policy to ``MAX_UTILIZATION``; here the
``GUARANTEED_NO_EVICT`` scheduler reserves each request's whole need, so later chunks never
fail to allocate), preemption and replay (``reset_request_state``).
"""

from __future__ import annotations

import math
from typing import Any

from s3kv.testing.emulator.blocks import NoFreeBlocksError
from s3kv.testing.emulator.kv_cache_manager import (
    KVCacheManager,
    PrefixStats,
    _chop,
    _root,
    _Sequence,
)
from s3kv.testing.emulator.layout import KvCacheLayout, layout_of_pool
from s3kv.testing.emulator.request import LlmRequest
from s3kv.testing.emulator.scheduler import ScheduledRequests


class KVCacheManagerV2(KVCacheManager):
    """Per-chunk allocation with the V2 connector handshake (see module doc)."""

    def __init__(self, *, grow_limit_blocks: int | None = None, **kwargs: Any) -> None:
        """Create the manager.

        Args:
            grow_limit_blocks: Most blocks a connector-driven grow may add beyond the current
                chunk's pages (``0``: every such grow fails); ``None``: only free blocks
                limit it. Settable later as an attribute.
            **kwargs: As :class:`~s3kv.testing.emulator.kv_cache_manager.KVCacheManager`.
        """
        super().__init__(**kwargs)
        self.grow_limit_blocks = grow_limit_blocks
        self._reported: set[int] = set()  # py_connector_allocation_reported, by request id

    # --- V2 accessors ---

    def get_page_indices_by_layer_group(self, request: LlmRequest) -> list[list[int]]:
        """Page indices per layer group (one group: the request's pages)."""
        return [self.get_cache_indices(request)]

    def get_kv_cache_layout(self) -> KvCacheLayout:
        """The layout ``register_kv_cache_layout`` receives (one group, one region).

        Raises:
            RuntimeError: The manager was built without a pool.
        """
        pool = self.get_unique_primary_pool()
        if pool is None:
            raise RuntimeError("no pool: KVCacheManagerV2 was built without one")
        return layout_of_pool(pool, self.tokens_per_block)

    # --- allocation ---

    def prepare_resources(self, batch: ScheduledRequests) -> None:
        """Allocate this batch's chunk pages, run the connector handshake, build the output."""
        connector = self.kv_connector_manager
        for req in batch.context_requests:
            if self.has_sequence(req):
                self._grow_to(req, req.context_current_position + req.context_chunk_size)
                continue
            local = self._add_first_chunk(req)
            self.prefix_stats[req.request_id] = PrefixStats(local, 0)
        for req in batch.context_requests:
            self._run_connector_hooks(req)
        for req in batch.generation_requests:
            self.add_token(req)
            for _ in req.py_draft_tokens:
                self.add_token(req)
        batch.reset_context_requests()
        if connector is not None:
            connector.build_scheduler_output(batch, self)

    def add_sequence(self, request: LlmRequest) -> None:
        """V2 has no whole-prompt ``add_sequence``: allocate the first chunk (no connector)."""
        if self.has_sequence(request):
            raise RuntimeError(f"request {request.request_id} already has a KV cache sequence")
        local = self._add_first_chunk(request)
        self.prefix_stats[request.request_id] = PrefixStats(local, 0)

    def free_resources(self, request: LlmRequest) -> None:
        """V1's release; the allocation is gone, so a new one is asked about again."""
        self._reported.discard(request.request_id)
        super().free_resources(request)

    def _add_first_chunk(self, request: LlmRequest) -> int:
        """Local match, then pages for the current chunk; returns the matched tokens."""
        rid = request.request_id
        seq = _Sequence([], request.prompt_len)
        self._sequences[rid] = seq
        local = 0
        if self.enable_block_reuse:
            keys = _chop(
                request.get_tokens(0)[: request.prompt_len - 1], self.tokens_per_block, partial=True
            )
            matches = self._blocks.match(
                _root(request),
                keys,
                partial_reuse=self.enable_partial_reuse,
                copy_on_partial_reuse=self.copy_on_partial_reuse,
            )
            seq.block_ids = [m.block_id for m in matches]
            local = sum(m.num_tokens for m in matches)
        if local > 0:
            request.set_prepopulated_prompt_len(local, self.tokens_per_block)
        self._grow_to(request, request.context_current_position + request.context_chunk_size)
        return local

    def _grow_to(self, request: LlmRequest, num_tokens: int) -> None:
        seq = self._sequences[request.request_id]
        while len(seq.block_ids) * self.tokens_per_block < num_tokens:
            seq.block_ids.append(self._blocks.take_free())

    def _try_grow(self, request: LlmRequest, num_tokens: int) -> bool:
        """A connector-driven grow; ``False`` (nothing allocated) where V2 runs out of pages."""
        held = len(self._sequences[request.request_id].block_ids)
        extra = math.ceil(num_tokens / self.tokens_per_block) - held
        if extra <= 0:
            return True
        limit = self.grow_limit_blocks
        if (limit is not None and extra > limit) or extra > self.get_num_free_blocks():
            return False
        try:
            self._grow_to(request, num_tokens)
        except NoFreeBlocksError:  # pragma: no cover - checked above
            return False
        return True

    # --- the connector (``_run_kv_connector_hooks``) ---

    def _run_connector_hooks(self, request: LlmRequest) -> None:
        connector = self.kv_connector_manager
        rid = request.request_id
        if connector is None or rid in self._reported:
            return
        if not connector.should_add_sequence(request):
            return  # NOTE: its async load completed: same pages, nothing to ask or report
        excluded = request.is_dummy_request or request.is_generation_only_request
        if self.enable_block_reuse and not excluded and request.is_first_context_chunk:
            local = self.prefix_stats[rid].reused_tokens
            offer, load_async = connector.query_num_new_matched_tokens(request, local)
            honoured = self._serve(request, local, offer)
            connector.commit_new_matched_tokens(request, honoured, load_async)
            self.prefix_stats[rid] = PrefixStats(local, honoured)
        self._reported.add(rid)
        connector.update_state_after_alloc(request, self.get_cache_indices(request))

    def _serve(self, request: LlmRequest, local: int, offer: int) -> int:
        """Move the chunk window past what is honoured of ``offer``; returns the count."""
        tpb = self.tokens_per_block
        target = min(local + offer, request.prompt_len - 1)
        start = request.context_current_position
        end = start + request.context_chunk_size
        if target <= start:
            return 0
        if target < end:
            position, new_end = target, end
        else:
            new_end = target + request.context_chunk_size
            if new_end < request.prompt_len:
                new_end = new_end // tpb * tpb
                if new_end <= target:  # NOTE: keep a token to compute: end of target's block
                    new_end = min(request.prompt_len, (target // tpb + 1) * tpb)
            else:
                new_end = request.prompt_len
            if self._try_grow(request, new_end):
                position = target
            else:
                # NOTE: the largest whole block inside the pages that exist that still
                # leaves the forward pass a chunk to compute.
                position, new_end = (end - 1) // tpb * tpb, end
                if position <= start:
                    return 0
        request.prepopulated_prompt_len = position
        request.context_current_position = position
        request.context_chunk_size = new_end - position
        return position - local


__all__ = ["KVCacheManagerV2"]
