"""The scheduler half: claims, load/save planning and metadata. Engine-neutral, rank 0 only.

Contracts (DESIGN.md invariants 1-3):

* :meth:`SchedulerCore.get_num_new_matched_tokens` claims only whole blocks staged and
  verified on *every* shard, pins them until the workers have copied them, never claims when
  the device match ends inside a block, and never more than
  ``prompt_len - 1 - num_computed_tokens``. It answers from memory; the Bloom-positive tail
  behind the claim is prefetched in the background for later requests.
* Metadata carries only new work: loads for this iteration's claims and saves for blocks
  that become full in this iteration's forward pass (prompt blocks always, decode blocks if
  ``save_decode_blocks``), skipping blocks the bucket already has.
* While the store is unhealthy (circuit breaker open) it claims nothing and plans no saves.

Pins are released one scheduler step after the load was planned: by then every rank has run
the forward pass that consumed the staged bytes (the executor's ``get_finished`` all-gather
sits between the two steps).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from s3kv.config import S3KVConfig
from s3kv.connector.metadata import EMPTY, ConnectorMetadata, LoadOp, SaveOp
from s3kv.connector.shared import ShardStores
from s3kv.keys import ROOT_HASH, BlockHash, MultimodalItem, chain_hashes

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    """What the scheduler tracks per request."""

    request_id: int
    prompt_len: int
    hash_args: dict[str, Any]
    keys: list[BlockHash]
    tokens: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    claim_start: int = 0  # first claimed block index
    claimed: list[BlockHash] = field(default_factory=list)
    connector_tokens: int = 0
    loads_planned: bool = False
    saved_blocks: int = 0  # blocks [0, saved_blocks) planned or skipped
    saves_planned: int = 0


def hash_args(request: Any) -> dict[str, Any]:
    """Key inputs beyond tokens, read from the attributes TensorRT-LLM's binding exposes."""
    args: dict[str, Any] = {}
    lora = getattr(request, "lora_task_id", None)
    if lora is not None:
        args["lora_task_id"] = int(lora)
    salt = getattr(request, "cache_salt_id", None)
    if salt is not None:
        args["cache_salt"] = struct.pack("<Q", int(salt) & (2**64 - 1))
    hashes = getattr(request, "multimodal_hashes", None)
    if hashes:
        positions = list(getattr(request, "multimodal_positions", None) or [])
        lengths = list(getattr(request, "multimodal_lengths", None) or [])
        args["multimodal"] = [
            MultimodalItem(struct.pack(f"<{len(h)}i", *[int(v) for v in h]), int(pos), int(length))
            for h, pos, length in zip(hashes, positions, lengths, strict=False)
        ]
    return args


class SchedulerCore:
    """Per-request claim and save planning over the shard stores.

    Args:
        config: s3kv settings.
        tokens_per_block: The engine's block size in tokens.

    Attributes (set by the adapter once the workers registered):
        shards: The stores of every TP shard (``None`` until the workers registered; until
            then nothing is claimed or saved).
        arenas: Per rank ``(path, slot_bytes)`` of the staging arenas (tensor parallel), or
            empty.
        slot_of: Maps (rank, key) to the arena slot holding that shard (tensor parallel).
    """

    def __init__(self, config: S3KVConfig, tokens_per_block: int) -> None:
        self.config = config
        self.tokens_per_block = tokens_per_block
        self.shards: ShardStores | None = None
        self.arenas: tuple[tuple[str, int], ...] = ()
        self.slot_of: Any = None
        self._requests: dict[int, _Request] = {}
        self._unpin_next: list[list[BlockHash]] = []

    # --- the claim (memory only) ---

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` that are staged on every shard (pinned)."""
        tpb = self.tokens_per_block
        prompt_len = int(request.prompt_len)
        tokens = list(request.get_tokens(0))[:prompt_len]
        args = hash_args(request)
        keys = chain_hashes(tokens, tpb, **args)
        state = _Request(int(request.request_id), prompt_len, args, keys)
        self._requests[state.request_id] = state
        shards = self.shards
        if shards is None or not shards.healthy:
            return 0
        if num_computed_tokens % tpb:
            return 0  # the device match ends inside a block: whole blocks only
        start = num_computed_tokens // tpb
        max_blocks = max(0, (prompt_len - 1 - num_computed_tokens) // tpb)
        candidates = keys[start : start + max_blocks]
        claimed = shards.pin_leading(candidates)
        tail = candidates[claimed:]
        maybe = shards.maybe(tail) if tail else 0
        if maybe:
            shards.prefetch(tail[:maybe])
        metrics = shards.stores[0].metrics
        metrics.inc("connector_requests")
        metrics.inc("connector_claimed_tokens", claimed * tpb)
        metrics.inc("connector_prompt_tokens", prompt_len)
        if claimed:
            state.claim_start = start
            state.claimed = candidates[:claimed]
            state.connector_tokens = claimed * tpb
            shards.record_hits(state.claimed)
        return state.connector_tokens

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int]) -> None:
        """Remember the blocks the engine allocated (all prompt blocks, V1)."""
        state = self._requests.get(int(request.request_id))
        if state is not None:
            state.block_ids = list(block_ids)

    # --- metadata ---

    def build_connector_meta(self, new_requests: Sequence[Any], cached: Sequence[Any]) -> Any:
        """This iteration's loads and saves; also releases the previous step's load pins."""
        shards = self.shards
        if shards is not None:
            for keys in self._unpin_next:
                shards.unpin(keys)
        self._unpin_next = []
        loads: list[LoadOp] = []
        saves: list[SaveOp] = []
        for data in new_requests:
            state = self._requests.get(int(data.request_id))
            if state is None:
                continue
            state.tokens = list(data.new_tokens)
            if data.new_block_ids:
                state.block_ids = list(data.new_block_ids)
            loads.extend(self._plan_loads(state))
            valid = data.computed_position + state.connector_tokens + data.num_scheduled_tokens
            saves.extend(self._plan_saves(state, valid))
        for data in cached:
            state = self._requests.get(int(data.request_id))
            if state is None:
                continue
            state.tokens.extend(data.new_tokens)
            state.block_ids.extend(data.new_block_ids)
            saves.extend(
                self._plan_saves(state, data.computed_position + data.num_scheduled_tokens)
            )
        if not loads and not saves:
            return EMPTY
        return ConnectorMetadata(tuple(loads), tuple(saves), self.arenas if loads else ())

    def _plan_loads(self, state: _Request) -> list[LoadOp]:
        if state.loads_planned or not state.claimed:
            return []
        state.loads_planned = True
        self._unpin_next.append(state.claimed)
        ops = []
        for i, key in enumerate(state.claimed):
            block_id = state.block_ids[state.claim_start + i]
            slots = tuple(self.slot_of(rank, key) for rank in range(len(self.arenas)))
            ops.append(LoadOp(block_id, bytes(key), slots))
        return ops

    def _plan_saves(self, state: _Request, valid_tokens: int) -> list[SaveOp]:
        shards = self.shards
        if shards is None or not shards.healthy:
            return []
        tpb = self.tokens_per_block
        limit = valid_tokens // tpb
        if not self.config.save_decode_blocks:
            limit = min(limit, state.prompt_len // tpb)
        limit = min(limit, len(state.block_ids), len(state.tokens) // tpb)
        if limit > len(state.keys):
            state.keys = chain_hashes(state.tokens, tpb, **state.hash_args)
        loaded = range(state.claim_start, state.claim_start + len(state.claimed))
        ops = []
        for b in range(state.saved_blocks, limit):
            key = state.keys[b]
            if b in loaded or shards.may_contain(key):
                continue
            parent = state.keys[b - 1] if b else ROOT_HASH
            ops.append(SaveOp(state.request_id, state.block_ids[b], bytes(key), bytes(parent)))
        state.saved_blocks = max(state.saved_blocks, limit)
        state.saves_planned += len(ops)
        return ops

    # --- end of a request ---

    def request_finished(self, request: Any) -> bool:
        """True if the request had saves planned (the workers report when copies are done)."""
        state = self._requests.pop(int(request.request_id), None)
        if state is None:
            return False
        if state.claimed and not state.loads_planned and self.shards is not None:
            self.shards.unpin(state.claimed)  # claimed but never scheduled: release now
        return state.saves_planned > 0

    @property
    def tracked_requests(self) -> int:
        """Requests between their claim and ``request_finished``."""
        return len(self._requests)
