"""TensorRT-LLM's V1 ``KVCacheManager`` over a fixed pool of blocks.

What it reproduces (``_torch/pyexecutor/resource_manager.py`` ``KVCacheManager`` and the C++
``KVCacheManager`` / ``BlockManager`` in ``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp``):

* ``add_sequence`` allocates the blocks of the **whole prompt** at once. With block reuse it
  first matches the prompt against the reuse tree (``loadOrAllocateBlocks``) over the first
  ``prompt_len - 1`` tokens, so the last prompt token is always computed; then it asks the
  connector manager for more (``getNumNewMatchedTokens(llmRequest, prepopulatedPromptLen)``,
  with the C++ base request) and calls ``set_prepopulated_prompt_len(local + connector)``,
  which raises when that reaches the prompt length. Without block reuse the connector is
  never consulted and nothing is prepopulated, as in C++.
* ``add_token`` adds one decode token and allocates a block when it starts a new one.
* ``store_context_blocks`` (``update_resources``) puts the full prompt blocks into the reuse
  tree; ``free_resources`` stores every block (the last one possibly partial) and releases
  them, last block first, so that leaves are evicted before their parents.
* ``prepare_resources`` is the Python ``KVCacheManager.prepare_resources``: ``add_sequence``
  plus ``update_state_after_alloc(req, all prompt blocks)`` for first chunks not already
  allocated by an async load, ``add_token`` for generation requests, then
  ``build_scheduler_output``.

Blocks are never zeroed: a reused or freshly allocated block holds whatever was written
last, as GPU memory does, so a wrong claim shows up as wrong output.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from s3kv.testing.emulator.blocks import BlockPool, BlockTokens, RootKey
from s3kv.testing.emulator.request import BoundLlmRequest, LlmRequest
from s3kv.testing.emulator.scheduler import ScheduledRequests

if TYPE_CHECKING:
    from s3kv.testing.emulator.connector_manager import KvCacheConnectorManager


@dataclasses.dataclass
class _Sequence:
    block_ids: list[int]
    num_tokens: int  # tokens whose KV the sequence has room for (prompt + decode steps)


@dataclasses.dataclass(frozen=True)
class PrefixStats:
    """What ``add_sequence`` found for one request.

    Attributes:
        reused_tokens: Matched in the local reuse tree.
        connector_tokens: Claimed by the connector on top of that.
    """

    reused_tokens: int
    connector_tokens: int


class KVCacheManager:
    """V1 paged KV cache bookkeeping over ``num_blocks`` blocks of ``pool``."""

    def __init__(
        self,
        *,
        num_blocks: int,
        tokens_per_block: int,
        enable_block_reuse: bool = True,
        enable_partial_reuse: bool = True,
        copy_on_partial_reuse: bool = True,
        pool: Any = None,
        connector_manager: KvCacheConnectorManager | None = None,
        enqueue: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        """Create the manager.

        Args:
            num_blocks: Blocks in the pool.
            tokens_per_block: Tokens per block.
            enable_block_reuse: Local prefix reuse (and the only path to the connector).
            enable_partial_reuse: Reuse partly matching blocks.
            copy_on_partial_reuse: Copy a partly matched block that is in use.
            pool: The ``[blocks, layers, 2, block_elems]`` tensor (needed only for copies);
                :meth:`get_unique_primary_pool` returns it.
            connector_manager: Consulted in :meth:`add_sequence`; ``None`` for no connector.
            enqueue: Queues a block copy on the device (a late device's ``enqueue``), so it
                runs after the queued forward passes that write its source; ``None``: copy
                at once.
        """
        if pool is not None and int(pool.shape[0]) != num_blocks:
            raise ValueError(f"pool: has {pool.shape[0]} blocks, num_blocks is {num_blocks}")
        self.tokens_per_block = tokens_per_block
        self.enable_block_reuse = enable_block_reuse
        self.enable_partial_reuse = enable_partial_reuse
        self.copy_on_partial_reuse = copy_on_partial_reuse
        self.kv_connector_manager = connector_manager
        self._pool = pool
        self._enqueue = enqueue
        self._blocks = BlockPool(num_blocks, self._copy_block)
        self._sequences: dict[int, _Sequence] = {}
        self.prefix_stats: dict[int, PrefixStats] = {}

    # --- the pool ---

    def get_unique_primary_pool(self) -> Any:
        """The tensor the connector's ``register_kv_caches`` receives."""
        return self._pool

    def _copy_block(self, src: int, dst: int) -> None:
        pool = self._pool
        if pool is None:
            return

        def copy() -> None:
            pool[dst].copy_(pool[src])

        if self._enqueue is None:
            copy()
        else:
            self._enqueue(copy)

    def get_num_free_blocks(self) -> int:
        """Blocks not held by any sequence (reusable blocks included)."""
        return self._blocks.num_free

    @property
    def blocks(self) -> BlockPool:
        """The block pool (for tests and diagnostics)."""
        return self._blocks

    # --- sequences ---

    def sequences(self) -> dict[int, list[int]]:
        """Every live sequence's block ids, by request id (identical on every TP rank)."""
        return {rid: list(seq.block_ids) for rid, seq in self._sequences.items()}

    def has_sequence(self, request: LlmRequest) -> bool:
        """Whether ``request`` holds blocks."""
        return request.request_id in self._sequences

    def get_cache_indices(self, request: LlmRequest) -> list[int]:
        """The request's block ids, in order (beam 0).

        Raises:
            IndexError: The request holds no blocks (not added, or already freed).
        """
        seq = self._sequences.get(request.request_id)
        if seq is None:
            raise IndexError(f"request {request.request_id} has no KV cache sequence")
        return list(seq.block_ids)

    def blocks_to_completion(self, request: LlmRequest) -> int:
        """Blocks for prompt + ``max_new_tokens`` (``get_needed_resource_to_completion``)."""
        return math.ceil((request.prompt_len + request.max_new_tokens) / self.tokens_per_block)

    def remaining_blocks_to_completion(self, request: LlmRequest) -> int:
        """Blocks still to be allocated before ``request`` completes."""
        seq = self._sequences.get(request.request_id)
        held = 0 if seq is None else len(seq.block_ids)
        return max(0, self.blocks_to_completion(request) - held)

    def add_sequence(self, request: LlmRequest) -> None:
        """Allocate the prompt's blocks: local reuse, then the connector (see module doc).

        Raises:
            RuntimeError: The connector's claim would leave no prompt token to compute
                (from ``set_prepopulated_prompt_len``), or no free block is left.
        """
        rid = request.request_id
        if rid in self._sequences:
            raise RuntimeError(f"request {rid} already has a KV cache sequence")
        tpb = self.tokens_per_block
        num_blocks = math.ceil(request.prompt_len / tpb)
        seq = _Sequence([], request.prompt_len)
        self._sequences[rid] = seq
        if not self.enable_block_reuse:
            seq.block_ids = [self._blocks.take_free() for _ in range(num_blocks)]
            self.prefix_stats[rid] = PrefixStats(0, 0)
            return
        # NOTE: "Ignore last token because it can't be recovered": match over prompt_len - 1.
        keys = _chop(request.get_tokens(0)[: request.prompt_len - 1], tpb, partial=True)
        matches = self._blocks.match(
            _root(request),
            keys,
            partial_reuse=self.enable_partial_reuse,
            copy_on_partial_reuse=self.copy_on_partial_reuse,
        )
        seq.block_ids = [m.block_id for m in matches]
        local = sum(m.num_tokens for m in matches)
        while len(seq.block_ids) < num_blocks:
            seq.block_ids.append(self._blocks.take_free())
        connector = 0
        if self.kv_connector_manager is not None and not request.is_dummy_request:
            connector = self.kv_connector_manager.get_num_new_matched_tokens(
                BoundLlmRequest(request), local
            )
        self.prefix_stats[rid] = PrefixStats(local, connector)
        request.set_prepopulated_prompt_len(local + connector, tpb)

    def add_token(self, request: LlmRequest) -> None:
        """Room for one more decode token; a new block when it starts one (``addToken``)."""
        seq = self._sequences[request.request_id]
        seq.num_tokens += 1
        if (seq.num_tokens - 1) % self.tokens_per_block == 0:
            seq.block_ids.append(self._blocks.take_free())

    def store_context_blocks(self, request: LlmRequest) -> None:
        """Make the request's computed full prompt blocks reusable (``storeContextBlocks``).

        C++ stores the full blocks of ``tokens[:-1]``; this stores only those whose KV is
        computed (below ``context_current_position``), which is the same set once the context
        phase is over and never exposes an uncomputed block during chunked prefill.
        """
        seq = self._sequences.get(request.request_id)
        if seq is None or not self.enable_block_reuse:
            return
        tokens = request.get_tokens(0)
        usable = min(len(tokens) - 1, request.context_current_position)
        keys = _chop(tokens[:usable], self.tokens_per_block, partial=False)
        self._blocks.store(_root(request), list(zip(keys, seq.block_ids, strict=False)))

    def free_resources(self, request: LlmRequest) -> None:
        """Store the sequence's blocks for reuse and release them (``removeSequence``)."""
        seq = self._sequences.pop(request.request_id, None)
        if seq is None:
            return
        # NOTE: freed before its prefill ended (cancelled, failed, parked in a load): what was
        # computed is already stored (store_context_blocks); the rest holds no valid KV.
        if self.enable_block_reuse and request.context_remaining_length == 0:
            tokens = request.get_tokens(0)
            # NOTE: the last token's KV is never computed, hence len - 1.
            usable = min(len(tokens) - 1, seq.num_tokens)
            keys = _chop(tokens[:usable], self.tokens_per_block, partial=True)
            self._blocks.store(_root(request), list(zip(keys, seq.block_ids, strict=False)))
        for block_id in reversed(seq.block_ids):
            self._blocks.release(block_id)

    # --- the executor's resource-manager calls ---

    def prepare_resources(self, batch: ScheduledRequests) -> None:
        """Allocate for this batch and build the connector's scheduler output."""
        connector = self.kv_connector_manager
        for req in batch.context_requests:
            if not req.is_first_context_chunk:
                continue
            if connector is not None and not connector.should_add_sequence(req):
                continue  # NOTE: allocated before its async load; do not allocate twice
            self.add_sequence(req)
            if connector is not None:
                connector.update_state_after_alloc(req, self.get_cache_indices(req))
        for req in batch.generation_requests:
            self.add_token(req)
            for _ in req.py_draft_tokens:
                self.add_token(req)
        batch.reset_context_requests()
        if connector is not None:
            connector.build_scheduler_output(batch, self)

    def update_resources(self, batch: ScheduledRequests) -> None:
        """After a forward pass: store the context requests' computed prompt blocks."""
        for req in batch.context_requests:
            self.store_context_blocks(req)


def _root(request: LlmRequest) -> RootKey:
    return (request.cache_salt_id, request.lora_task_id)


def _chop(tokens: list[int], tokens_per_block: int, *, partial: bool) -> list[BlockTokens]:
    """Tokens cut into block keys; a trailing partial block only when ``partial``."""
    keys = [
        tuple(tokens[i : i + tokens_per_block]) for i in range(0, len(tokens), tokens_per_block)
    ]
    if keys and not partial and len(keys[-1]) < tokens_per_block:
        keys.pop()
    return keys


__all__ = ["KVCacheManager", "PrefixStats"]
