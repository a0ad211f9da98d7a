"""The scheduler half: claims, load/save planning and metadata. Engine-neutral, rank 0 only.

Contracts (DESIGN.md invariants 1-3):

* :meth:`SchedulerCore.get_num_new_matched_tokens` claims only whole blocks staged and
  verified on *every* shard, pins them until the workers have copied them, never claims when
  the device match ends inside a block, and never more than
  ``prompt_len - 1 - num_computed_tokens``. It answers from memory; the Bloom-positive tail
  behind the claim is prefetched in the background for later requests.
* Its cost does not grow with the prompt beyond the blocks it must hash (the device match and
  the staged run): a request's keys are a :class:`~s3kv.keys.KeyChain` hashed on demand and
  kept until ``request_finished`` (the engine asks again for a request it did not schedule;
  the save path reuses those hashed and sends the rest unhashed, as
  :class:`~s3kv.keys.KeyRun` s the workers hash, reading the tokens through the chain), and
  the tail goes to the I/O side in one step, which hashes and filters it there
  (:meth:`KVStore.prefetch_many <s3kv.store.KVStore.prefetch_many>`).
* It keeps no token list of its own: once the forward pass is queued
  (:meth:`SchedulerCore.after_forward`) each new prompt's tokens are packed into an array the
  garbage collector does not scan, and reports' token lists are never kept.
* Metadata carries only new work: loads for this iteration's claims and saves for blocks
  that become full in this iteration's forward pass (prompt blocks always, decode blocks if
  ``save_decode_blocks``), skipping the leading run of blocks the bucket already has (in a
  span with blocks that have no page, every block it has).
* While the store is unhealthy (circuit breaker open) it claims nothing and plans no saves.

Pins are released only once every rank has reported, on the completion board, that the
device copies reading the staged bytes have *completed* — not at the next scheduler step: under
the overlap loop the host plans step N+1 while step N's copies may still be queued on the
device (:mod:`s3kv.connector.completion`).

Guard fallbacks keep the engine's bookkeeping: loads are planned as soon as the claimed
blocks are known and :meth:`SchedulerCore.take_metadata` can always hand them out, so a failure
in ``build_connector_meta`` never drops a claimed load. Requests whose key inputs s3kv cannot
see (an unmapped LoRA task id, a p-tuning prompt table) are neither claimed nor saved, and
state of requests TensorRT-LLM frees without ``request_finished`` (cancelled or failed) is
forgotten after :attr:`SchedulerCore.STALE_STEPS` steps.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from s3kv.config import S3KVConfig
from s3kv.connector.completion import CompletionBoard
from s3kv.connector.metadata import EMPTY, NO_SAVES, ConnectorMetadata, LoadOp, SaveOps
from s3kv.connector.requests import RequestView, StepReport
from s3kv.connector.shared import ShardStores
from s3kv.errors import KeyDerivationError
from s3kv.keys import ROOT_HASH, BlockHash, KeyChain, KeyRun

logger = logging.getLogger(__name__)

#: One request's planned saves: block ids, their keys and their chain parents (blocks in
#: runs left out), and the runs whose keys the workers hash: (index among the blocks, run).
_PlannedSaves = tuple[list[int], list[bytes], list[bytes], list[tuple[int, KeyRun]]]
#: An iteration's planned saves: request ids, block ids, keys, chain parents and runs.
_SaveLists = tuple[list[int], list[int], list[bytes], list[bytes], list[tuple[int, KeyRun]]]


@dataclass
class _Request:
    """What the scheduler tracks per request."""

    request_id: int
    prompt_len: int
    key_inputs: dict[str, Any] | None  # None: the key inputs are not all visible; no caching
    keys: KeyChain  # the prompt's, then (saves) the request's tokens' keys, hashed on demand
    sample: tuple[int, ...] = ()  # a few prompt tokens: a re-asked request is the same one
    num_tokens: int = 0  # the request's tokens reported so far (not kept: see _grow_chain)
    decode_keys: bool = True  # decode tokens still go to the chain (saves of decode blocks)
    block_ids: list[int] = field(default_factory=list)
    claim_start: int = 0  # first claimed block index
    claimed: list[BlockHash] = field(default_factory=list)
    connector_tokens: int = 0
    loads_planned: bool = False
    saved_blocks: int = 0  # blocks [0, saved_blocks) planned or skipped
    saves_planned: int = 0
    saves_done: bool = False  # no block of it can be saved any more: reports skip planning
    last_seen: int = 0  # the scheduler step that last reported this request


class SchedulerCore:
    """Per-request claim and save planning over the shard stores.

    Engine-neutral: it sees :class:`~s3kv.connector.requests.RequestView` s the adapter
    builds and ``RequestData``-shaped reports, never the engine's request objects. Until
    :meth:`attach` gives it the shard stores (once every worker registered) it claims and
    saves nothing.

    Args:
        config: s3kv settings.
        tokens_per_block: The engine's block size in tokens.
    """

    #: Scheduler steps a request may be missing from the scheduler output before its state
    #: is dropped. Cancelled and errored requests are freed without ``request_finished``:
    #: ``_handle_canceled_requests`` finishes them with ``FinishReason.CANCELLED`` and
    #: ``_handle_errors`` terminates them, both without a connector call
    #: (``tensorrt_llm/_torch/pyexecutor/py_executor.py`` @``00043967``, and the 1.2-era
    #: version alike); a running request is reported every step it is scheduled.
    STALE_STEPS = 64

    def __init__(self, config: S3KVConfig, tokens_per_block: int) -> None:
        self.config = config
        self.tokens_per_block = tokens_per_block
        self.shards: ShardStores | None = None
        self.board: CompletionBoard = CompletionBoard.private()
        self.manager = "v1"  # "v2": KVCacheManagerV2 (honoured counts, per-chunk pages)
        self._requests: dict[int, _Request] = {}
        self._ready_loads: list[LoadOp] = []  # planned, not yet handed to the workers
        self._ready_whole = False  # one of them computes one prompt token: await whole
        self._held: deque[tuple[int, list[BlockHash]]] = deque()  # (load_seq, pinned keys)
        self._load_seq = 0
        self._step = 0
        self._oldest_seen = 0  # no tracked request was last seen before this step
        self._unpacked: dict[int, KeyChain] = {}  # chains asked for since the last forward

    def attach(self, shards: ShardStores, *, board: CompletionBoard, manager: str) -> None:
        """Start claiming and saving over ``shards`` (every worker has registered).

        Args:
            shards: The stores of every TP shard (and their staging arenas under TP).
            board: Where the workers publish completed loads; pins are released from it.
            manager: ``"v1"`` or ``"v2"`` (KVCacheManagerV2: honoured counts, per-chunk pages).
        """
        self.shards = shards
        self.board = board
        self.manager = manager

    # --- the claim (memory only) ---

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` that are staged on every shard (pinned)."""
        tpb = self.tokens_per_block
        prompt_len = len(request.prompt)
        rid = request.request_id
        previous = self._requests.pop(rid, None)
        if previous is not None:  # asked again (V2 re-offers): the old pins go first
            self._release_unplanned(previous)
        args = request.key_inputs
        if args is None:
            empty = KeyChain((), tpb)
            self._requests[rid] = _Request(rid, prompt_len, None, empty, last_seen=self._step)
            self._metric("connector_uncacheable_requests")
            return 0
        sample = _sample(request.prompt)
        if previous is not None and (previous.key_inputs, previous.sample) == (args, sample):
            keys = previous.keys  # NOTE: a request's prompt is fixed: its keys are too
        else:
            keys = KeyChain(request.prompt, tpb, **args)
        state = _Request(rid, prompt_len, args, keys, sample, last_seen=self._step)
        self._requests[rid] = state
        shards = self.shards
        if shards is None:
            return 0
        self._unpacked[rid] = keys  # NOTE: packed once the forward pass is queued
        if not shards.healthy:
            return 0
        if num_computed_tokens % tpb:
            return 0  # the device match ends inside a block: whole blocks only
        start = num_computed_tokens // tpb
        max_blocks = max(0, (prompt_len - 1 - num_computed_tokens) // tpb)
        candidates = keys[start : start + max_blocks]  # lazy: hashed as far as needed
        # NOTE: the tail's prefetch walk is held until this iteration's forward pass is
        # queued (the worker's wait_for_save starts it), so it does not take the GIL from
        # this thread while it plans; tagged with this iteration's step, so that
        # build_connector_meta can start walks an earlier iteration left.
        claimed = shards.claim(candidates, hold_prefetch=self._step + 1)
        shards.metrics.inc("connector_requests")
        shards.metrics.inc("connector_claimed_tokens", claimed * tpb)
        shards.metrics.inc("connector_prompt_tokens", prompt_len)
        if claimed:
            state.claim_start = start
            state.claimed = list(candidates[:claimed])
            state.connector_tokens = claimed * tpb
        return state.connector_tokens

    def update_state_after_alloc(
        self, request_id: int, block_ids: Sequence[int], honoured_tokens: int | None = None
    ) -> None:
        """Remember the allocated blocks and plan the claim's loads right away.

        Under KVCacheManagerV2 the runtime may honour fewer tokens than offered and records
        the honoured count (``honoured_tokens``, from ``py_num_connector_matched_tokens``)
        before this call (``commit_new_matched_tokens`` in ``connectors/kv_cache_connector.py``
        @``035ab91c``): exactly the honoured blocks are loaded, the rest of the claim is
        unpinned. V1 honours the whole claim.
        """
        state = self._requests.get(request_id)
        if state is None:
            return
        if self.manager == "v2":
            self._honour(state, honoured_tokens)
        state.block_ids = list(block_ids)
        self._plan_loads(state)

    def _honour(self, state: _Request, honoured: int | None) -> None:
        if not state.claimed or state.loads_planned or honoured is None:
            return
        tpb = self.tokens_per_block
        honoured = max(0, min(honoured, state.connector_tokens))
        keep = -(-honoured // tpb)  # NOTE: a partly honoured block is loaded whole
        if keep < len(state.claimed) and self.shards is not None:
            self.shards.unpin(state.claimed[keep:])
            self._metric("connector_unhonoured_blocks", len(state.claimed) - keep)
        state.claimed = state.claimed[:keep]
        state.connector_tokens = honoured

    # --- metadata ---

    def build_connector_meta(
        self, new_requests: Sequence[StepReport], cached: Sequence[StepReport]
    ) -> ConnectorMetadata:
        """This iteration's loads and saves; releases pins whose loads completed everywhere.

        Loads come first and cannot be lost: they were planned when the blocks were known
        (:meth:`update_state_after_alloc`, or here from the first report's block ids), and
        a failure while planning one request's saves costs only that request's saves.
        """
        self._step += 1
        self._release_completed()
        for data in new_requests:
            state = self._requests.get(int(data.request_id))
            if state is None:
                continue
            state.last_seen = self._step
            state.num_tokens = len(data.new_tokens)
            if data.new_block_ids:
                state.block_ids = list(data.new_block_ids)
            self._plan_loads(state)
        planned: _SaveLists = ([], [], [], [], [])
        requests, step = self._requests, self._step
        for data in new_requests:
            state = requests.get(int(data.request_id))
            if state is not None:
                state.last_seen = step
                self._collect_saves(state, data, planned, first=True)
        # NOTE: every running request is reported every step: one whose saves are all
        # planned costs a lookup here (a decode batch of 256: 0.50 ms a step before, 27 us
        # after, bench_scheduler.py's decode_step_us on the 2-core machine).
        for data in cached:
            state = requests.get(int(data.request_id))
            if state is not None:
                state.last_seen = step
                if not state.saves_done:
                    self._collect_saves(state, data, planned, first=False)
        self._forget_stale()
        if self.shards is not None:
            # NOTE: walks held in an iteration no forward pass followed (an empty batch);
            # this iteration's own wait for its forward pass.
            self.shards.start_walks(before=self._step)
        request_ids, block_ids, keys, parents, derived = planned
        if not block_ids:
            return self.take_metadata()
        return self.take_metadata(
            SaveOps(request_ids, block_ids, b"".join(keys), b"".join(parents), derived)
        )

    def _collect_saves(
        self, state: _Request, data: StepReport, planned: _SaveLists, *, first: bool
    ) -> None:
        """Append ``state``'s saves for this report to ``planned``; a failure costs only
        this request's saves."""
        try:
            blocks, keys, parents, derived = self._plan_request_saves(state, data, first=first)
            if self.shards is not None and len(self.shards.stores) > 1:
                # NOTE: under TP the broadcast pickles the runs before the pass anyway:
                # converted here, a bad token costs this request's saves, not the broadcast
                for _, run in derived:
                    run.tokens  # noqa: B018
        except Exception:  # NOTE: isolated: only this request's saves are lost
            logger.exception("s3kv: save planning failed for request %d", state.request_id)
            state.key_inputs = None  # stop planning saves for it
            state.saves_done = True
            self._metric("connector_save_planning_errors")
            return
        request_ids, block_ids, all_keys, all_parents, all_derived = planned
        all_derived.extend((len(block_ids) + index, run) for index, run in derived)
        request_ids.extend([state.request_id] * len(blocks))
        block_ids.extend(blocks)
        all_keys.extend(keys)
        all_parents.extend(parents)

    def take_metadata(self, saves: SaveOps = NO_SAVES) -> ConnectorMetadata:
        """The planned loads (and ``saves``) as this iteration's metadata; cannot fail.

        The adapter's guard calls this with no saves when :meth:`build_connector_meta`
        raised, so claimed loads still reach the workers.
        """
        loads, self._ready_loads = tuple(self._ready_loads), []
        whole, self._ready_whole = self._ready_whole, False
        if not loads and not saves:
            return EMPTY
        seq = 0
        if loads:
            self._load_seq += 1
            seq = self._load_seq
            self._held.append((seq, [BlockHash(op.key) for op in loads]))
        arenas = self.shards.arenas if loads and self.shards is not None else ()
        relay = self.shards.relay if saves and self.shards is not None else ""
        board = self.board.path if loads else ""
        return ConnectorMetadata(loads, saves, arenas, seq, board, relay, whole)

    def _plan_request_saves(
        self, state: _Request, data: StepReport, *, first: bool
    ) -> _PlannedSaves:
        # NOTE: the reports' token lists are not kept: a prompt's 8K ints held in a list
        # across the next iterations cost every young garbage collection there a pass over
        # them (bench_scheduler.py's scheduler.young_collections_ms).
        # The keys' chain holds the prompt; decode tokens go to it only if they are saved.
        if first:
            valid = data.computed_position + state.connector_tokens + data.num_scheduled_tokens
            self._grow_chain(state, data.new_tokens)
            return self._plan_saves(state, valid)
        state.num_tokens += len(data.new_tokens)
        self._grow_chain(state, data.new_tokens)
        state.block_ids.extend(data.new_block_ids)
        return self._plan_saves(state, data.computed_position + data.num_scheduled_tokens)

    def _grow_chain(self, state: _Request, tokens: Sequence[int]) -> None:
        """Give the chain the tokens of this report it lacks (``tokens`` end at
        ``state.num_tokens``), where decode blocks are saved: their keys go on from the
        prompt's. Otherwise, or once the chain cannot follow (it cannot grow, or the tokens
        reported do not line up with it), no block past its end is keyed or saved; the
        prompt's blocks still are."""
        count = len(tokens)
        decode = self.config.save_decode_blocks and state.decode_keys
        if not count or not decode or state.key_inputs is None:
            return
        chain = state.keys
        skip = chain.num_tokens - (state.num_tokens - count)  # NOTE: tokens it already has
        if skip < 0:
            state.decode_keys = False  # NOTE: a gap: later keys could not be derived
            return
        if skip < count:
            try:
                chain.extend(tokens[skip:])
            except KeyDerivationError:  # NOTE: per-token extra ids: the chain cannot grow
                state.decode_keys = False

    def _plan_loads(self, state: _Request) -> None:
        if state.loads_planned or not state.claimed:
            return
        needed = state.claim_start + len(state.claimed)
        if len(state.block_ids) < needed:
            return  # blocks not known yet (the first report carries them)
        claimed = state.claimed
        block_ids = state.block_ids[state.claim_start : needed]
        for i, block_id in enumerate(block_ids):
            if block_id < 0:  # BAD_PAGE_INDEX: no page for an honoured block cannot happen
                raise RuntimeError(f"claimed block {i} of request {state.request_id} has no page")
        shards = self.shards
        slots = shards.slots_many(claimed) if shards is not None else [()] * len(claimed)
        self._ready_loads.extend(
            LoadOp(block_id, bytes(key), where)
            for block_id, key, where in zip(block_ids, claimed, slots, strict=True)
        )
        state.loads_planned = True
        # NOTE: a request left with one prompt token to compute may run in a decode CUDA
        # graph (_make_single_token_context_graph_batch, _torch/pyexecutor/engine/runners/
        # decoder/runner.py @ fcc4432b): no layer hook then, so its loads must be awaited
        # before the forward pass.
        if state.prompt_len - needed * self.tokens_per_block <= 1:
            self._ready_whole = True

    def _plan_saves(self, state: _Request, valid_tokens: int) -> _PlannedSaves:
        """This request's blocks to save, full by ``valid_tokens``: their block ids, keys
        and parents."""
        shards = self.shards
        if state.key_inputs is None:
            state.saves_done = True
            return [], [], [], []
        if shards is None or not shards.healthy:
            return [], [], [], []
        tpb = self.tokens_per_block
        limit = valid_tokens // tpb
        decode = self.config.save_decode_blocks
        if not decode:
            limit = min(limit, state.prompt_len // tpb)
        limit = min(limit, len(state.block_ids), state.num_tokens // tpb, len(state.keys))
        # NOTE: once the prompt's last full block is planned nothing is left to save.
        state.saves_done = not decode and limit >= state.prompt_len // tpb
        first = state.saved_blocks
        if limit <= first:
            return [], [], [], []
        # NOTE: keys chain, so a block after one the bucket lacks is saved without asking
        # the filter: it exists only past a hole (a failed save), and writing it again is
        # harmless. A cold prompt then costs one scalar lookup, not a filter pass over every
        # key (0.3-0.6 ms for 8K tokens on the engine's thread, before its forward pass), and
        # its keys are hashed only as far as that lookup needed: the rest travel as runs the
        # workers hash (SaveOps).
        chain = state.keys
        start = first + shards.count_leading(chain[first:limit])
        claim_lo, claim_hi = state.claim_start, state.claim_start + len(state.claimed)
        spans = [(start, limit)]
        if claim_lo < claim_hi:  # NOTE: claimed blocks are loaded, not saved
            spans = [(start, min(limit, claim_lo)), (max(start, claim_hi), limit)]
        planned: _PlannedSaves = ([], [], [], [])
        for lo, hi in spans:
            if lo < hi:
                _plan_span(chain, state.block_ids, lo, hi, planned, shards)
        state.saved_blocks = limit
        state.saves_planned += len(planned[0])
        return planned

    def after_forward(self) -> None:
        """Once an iteration's forward pass is queued (rank 0's ``wait_for_save``): start the
        prefetch walks the claims held, and pack the prompts' token lists
        (:meth:`KeyChain.compact <s3kv.keys.KeyChain.compact>`). Never raises.

        NOTE: both wait for the pass: a walk would take the GIL from the engine's thread
        while it plans, and packing an 8K-token prompt costs 30-90 us; the host then waits
        for the device anyway (``_forward_step``, then ``_sample_async`` and
        ``_update_requests``, ``py_executor.py`` @ 000439672005).
        """
        chains, self._unpacked = self._unpacked, {}
        for chain in chains.values():  # NOTE: first: a walk may hold a chain's lock a while
            try:
                chain.compact()
            except Exception:  # NOTE: unpacked tokens cost collections, never correctness
                logger.exception("s3kv: packing a prompt's tokens failed")
        if self.shards is not None:
            self.shards.start_walks()

    # --- pins ---

    def _release_completed(self) -> None:
        """Unpin load batches whose copies every rank has reported *completed*."""
        if not self._held:
            return  # NOTE: the board's minimum is a numpy call (~20-60 us) every iteration
        done = self.board.completed()
        shards = self.shards
        while self._held and self._held[0][0] <= done:
            _, keys = self._held.popleft()
            if shards is not None:
                shards.unpin(keys)

    @property
    def held_load_batches(self) -> int:
        """Load batches whose staged sources are still pinned (copies not yet complete)."""
        return len(self._held)

    def _release_unplanned(self, state: _Request) -> None:
        """Unpin a claim whose loads were never handed to the workers."""
        if state.claimed and not state.loads_planned and self.shards is not None:
            self.shards.unpin(state.claimed)
            state.claimed = []

    def _forget_stale(self) -> None:
        """Drop requests missing from the scheduler output for :attr:`STALE_STEPS` steps.

        Looks at every request only once the oldest ``last_seen`` of the last look could be
        stale (``last_seen`` only grows, and new requests start at the current step): once
        per ``STALE_STEPS + 1`` steps in a steady batch, not every step.
        """
        horizon = self._step - self.STALE_STEPS
        if horizon <= self._oldest_seen:
            return
        stale = [rid for rid, s in self._requests.items() if s.last_seen < horizon]
        for rid in stale:
            self._release_unplanned(self._requests.pop(rid))
            self._unpacked.pop(rid, None)
        if stale:
            self._metric("connector_forgotten_requests", len(stale))
        self._oldest_seen = min((s.last_seen for s in self._requests.values()), default=self._step)

    def _metric(self, name: str, amount: int = 1) -> None:
        if self.shards is not None:
            self.shards.metrics.inc(name, amount)

    # --- end of a request ---

    def abandon(self, request_id: int) -> None:
        """Forget a request whose claim failed half-way: its pins go, nothing is loaded."""
        state = self._requests.pop(request_id, None)
        self._unpacked.pop(request_id, None)
        if state is not None:
            self._release_unplanned(state)

    def request_finished(self, request_id: int) -> bool:
        """True if the request had saves planned (the workers report when copies are done)."""
        state = self._requests.pop(request_id, None)
        self._unpacked.pop(request_id, None)
        if state is None:
            return False
        self._release_unplanned(state)  # claimed but never scheduled: release now
        return state.saves_planned > 0

    @property
    def tracked_requests(self) -> int:
        """Requests between their claim and ``request_finished`` (or being forgotten)."""
        return len(self._requests)

    @property
    def key_cache_bytes(self) -> int:
        """Approximate memory of the tracked requests' keys (dropped with the requests)."""
        return sum(state.keys.nbytes for state in self._requests.values())


#: Prompt tokens compared (besides the length) to recognise a request asked about again.
_SAMPLE_TOKENS = 64


def _plan_span(
    chain: KeyChain,
    block_ids: Sequence[int],
    lo: int,
    hi: int,
    planned: _PlannedSaves,
    shards: ShardStores,
) -> None:
    """Append the saves of blocks ``lo .. hi - 1`` to ``planned``: keys hashed already go as
    keys, the rest as one run the workers hash.

    Blocks without a page (BAD_PAGE_INDEX: out of a sliding window) are skipped; such a
    span is hashed here and each block is asked of the filter: a window's leading blocks
    are never saved, so the blocks after them must not count as past a hole.
    """
    chosen, keys, parents, derived = planned
    ids = block_ids[lo:hi]
    if min(ids) < 0:
        span = chain.keys(max(0, lo - 1), hi)
        at = 1 if lo else 0  # NOTE: span[b - lo + at] is block b's key
        present = shards.contains_many(span[at:]).tolist()
        for b, block_id in enumerate(ids, lo):
            if block_id >= 0 and not present[b - lo]:
                chosen.append(block_id)
                keys.append(span[b - lo + at])
                parents.append(span[b - lo + at - 1] if b else ROOT_HASH)
        return
    split = max(lo, min(hi, chain.hashed))
    run = chain.run_of(split, hi) if split < hi else None
    known_hi = split if run is not None else hi
    if known_hi > lo:  # NOTE: three slices, no Python loop per block
        span = chain.keys(max(0, lo - 1), known_hi)
        at = 1 if lo else 0
        keys.extend(span[at:])
        parents.extend(span[: len(span) - 1] if lo else [ROOT_HASH, *span[:-1]])
        chosen.extend(ids[: known_hi - lo])
    if run is not None:
        derived.append((len(chosen), run))
        chosen.extend(ids[known_hi - lo :])


def _sample(prompt: Sequence[int]) -> tuple[int, ...]:
    """The prompt's length and a few of its tokens, evenly spaced, first and last included.

    A guard, not the identity: TensorRT-LLM's request ids are unique for the executor's
    life and a request's prompt never changes, so a request asked about again has the same
    prompt. This catches a caller reusing an id for another prompt (one without
    ``request_finished``) at constant cost instead of comparing the whole prompt.
    """
    n = len(prompt)
    if not n:
        return (0,)
    return (n, prompt[-1], *prompt[:: max(1, n // _SAMPLE_TOKENS)])


__all__ = [
    "SchedulerCore",
]
