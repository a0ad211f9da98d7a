"""When the worker queues a forward pass's device->host save copies, and what they hold back.

On CUDA the copies are planned in ``wait_for_save`` and queued from the ``get_finished``
after the one that ends their iteration: TensorRT-LLM's sampler queues the new tokens' copy
to the host after ``wait_for_save``, and a copy engine serves copies in order, so the tokens
must not wait behind a prompt's blocks; and under the overlap loop the engine reads the
tokens only in the next iteration, so the host time of queueing them must not come first.
Until queued and completed, the blocks' requests stay "saving" (their blocks stay allocated).
The engine here is a recording fake whose events the test completes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from s3kv.connector import worker as worker_module
from s3kv.connector.completion import CompletionBoard
from s3kv.connector.device import SavePair
from s3kv.connector.metadata import ConnectorMetadata, SaveOp, SaveOps
from s3kv.connector.worker import WorkerCore
from s3kv.metrics import Metrics
from tests.test_connector_layer_load import FakeEvent
from tests.test_store import wait_until

LAYERS, ELEMS = 2, 16


@dataclass
class DeferringEngine:
    """Copies when queued (so the bytes can be checked); its events complete on demand."""

    defers_saves: bool = True
    queues_from_any_thread: bool = False
    queued: list[int] = field(default_factory=list)  # blocks per queued save batch
    events: list[FakeEvent] = field(default_factory=list)
    fail: bool = False

    def mark_forward(self, stream: Any) -> None:
        return None

    def save(self, pairs: list[SavePair], stream: Any) -> FakeEvent:
        if self.fail:
            raise RuntimeError("copy engine broken")
        for target, source in pairs:
            target.copy_(source)
        self.queued.append(len(pairs))
        self.events.append(FakeEvent(f"save{len(self.events)}"))
        return self.events[-1]


@dataclass
class Store:
    """What a worker's saves need from a store."""

    metrics: Metrics = field(default_factory=Metrics)
    saved: dict[bytes, bytes] = field(default_factory=dict)

    def save_arena(self, slot_bytes: int, budget_bytes: int) -> None:
        return None

    def save_many(self, blocks: list[tuple[Any, Any, Any, Callable[[], None]]], **_: Any) -> None:
        for key, _parent, array, consumed in blocks:
            self.saved[bytes(key)] = np.asarray(array).tobytes()
            consumed()


def worker(
    num_blocks: int = 8, idle_save_after: float | None = None
) -> tuple[WorkerCore, DeferringEngine, Store, torch.Tensor]:
    pool = torch.arange(num_blocks * LAYERS * 2 * ELEMS, dtype=torch.float32).to(torch.bfloat16)
    pool = pool.view(num_blocks, LAYERS, 2, ELEMS)
    store = Store()
    core = WorkerCore(
        0, store, pool, 1 << 20, board=CompletionBoard.private(),  # type: ignore[arg-type]
        idle_save_after=idle_save_after,
    )  # fmt: skip
    engine = DeferringEngine()
    core._engine = engine  # NOTE: the recording engine instead of the stream's
    return core, engine, store, pool


def saves(request_id: int, blocks: list[int]) -> ConnectorMetadata:
    return ConnectorMetadata(
        saves=SaveOps.of(
            SaveOp(request_id, b, key=bytes([request_id, b]) * 8, parent=bytes(16)) for b in blocks
        )
    )


def test_copies_are_queued_at_the_next_iterations_get_finished_and_hold_their_request() -> None:
    core, engine, store, pool = worker()
    core.save_after_forward(saves(1, [2, 5]), stream=None)
    assert engine.queued == []  # NOTE: wait_for_save only planned them
    # NOTE: the request finished in this iteration (request_finished said it is saving).
    assert core.finished([1]) == []
    assert engine.queued == []  # NOTE: this iteration's get_finished leaves them
    assert core.finished([]) == []  # NOTE: the next iteration's (an idle one too) queues them
    assert engine.queued == [2]
    assert store.saved == {}
    engine.events[0].done = True
    assert core.finished([]) == [1]
    assert store.saved[bytes([1, 2]) * 8] == pool[2].view(torch.uint8).numpy().tobytes()
    assert store.saved[bytes([1, 5]) * 8] == pool[5].view(torch.uint8).numpy().tobytes()
    assert core.finished([]) == []  # NOTE: returned exactly once


def test_an_engine_that_skips_get_finished_gets_them_queued_at_the_next_wait_for_save() -> None:
    core, engine, _, _ = worker()
    core.save_after_forward(saves(1, [0]), stream=None)
    core.save_after_forward(saves(2, [1, 3]), stream=None)
    assert engine.queued == [1]  # NOTE: the first pass's, in order; the second's still planned
    core.flush()  # NOTE: shutdown queues and waits for everything
    assert engine.queued == [1, 2]
    assert core.finished([1, 2]) == [1, 2]


def test_a_copy_that_cannot_be_queued_loses_its_saves_but_never_its_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    core, engine, store, _ = worker()
    core.save_after_forward(saves(1, [0, 1]), stream=None)
    engine.fail = True
    assert core.finished([1]) == []
    assert core.finished([]) == [1]  # NOTE: nothing raised into get_finished, none held
    assert store.saved == {}
    assert store.metrics.value("connector_save_errors") == 2
    assert store.metrics.value("connector_save_buffers_withheld") == 2  # NOTE: may be written
    assert any("dropping the saves of 2 block(s)" in r.getMessage() for r in caplog.records)


def test_completed_copies_reach_the_store_at_get_finished_not_at_the_next_wait_for_save() -> None:
    """The hand-off to the store costs the engine's thread ~14 us a block (3.5 ms for a
    prompt's 254 on an H200 host); in ``wait_for_save`` it ran before the previous batch's
    token is committed and answered, so it lengthened the first token's latency. At
    ``get_finished``, the iteration's last connector call, the responses are out."""
    core, engine, store, _ = worker()
    core.save_after_forward(saves(1, [0, 1]), stream=None)
    core.finished([])
    core.finished([])
    engine.events[0].done = True
    core.save_after_forward(saves(2, [2]), stream=None)  # NOTE: the next iteration's
    assert store.saved == {}
    assert core.finished([1]) == [1]
    assert sorted(store.saved) == [bytes([1, 0]) * 8, bytes([1, 1]) * 8]


class BrokenEvent(FakeEvent):
    def query(self) -> bool:
        raise RuntimeError("device lost")


def test_copies_whose_events_cannot_be_polled_are_abandoned_never_saved_nor_holding(
    caplog: pytest.LogCaptureFixture,
) -> None:
    core, engine, store, _ = worker()
    core.save_after_forward(saves(1, [0, 1]), stream=None)
    assert core.finished([1]) == []
    assert core.finished([]) == []
    engine.events[0] = BrokenEvent("save0")
    core._pending[0].event = engine.events[0]
    free_before = len(core._buffers._free)
    assert core.finished([]) == [1]  # NOTE: nothing raised, the request no longer held
    assert store.saved == {}
    assert store.metrics.value("connector_save_errors") == 2
    assert len(core._buffers._free) == free_before  # NOTE: a copy may still write them
    assert store.metrics.value("connector_save_buffers_withheld") == 2
    assert any("a save copy's event failed" in r.getMessage() for r in caplog.records)


def test_a_drain_that_keeps_failing_abandons_the_copies_and_returns_the_finished_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    core, engine, store, _ = worker()
    core.save_after_forward(saves(1, [0, 1]), stream=None)
    core.finished([])
    core.save_after_forward(saves(2, [2]), stream=None)
    assert core.finished([1, 2]) == []
    assert engine.queued == [2]  # NOTE: request 1's pass; request 2's waits a call
    assert core.finished([]) == []
    engine.events[0].done = True  # NOTE: request 1's copy ended; request 2's may still run

    def broken(*, block: bool) -> None:
        raise RuntimeError("drain bug")

    monkeypatch.setattr(core, "_drain", broken)
    free_before = len(core._buffers._free)
    assert core.finished([]) == [1, 2]  # NOTE: neither request held for good
    assert store.saved == {}
    assert store.metrics.value("connector_save_errors") == 3
    assert len(core._buffers._free) == free_before + 2  # NOTE: only the ended copy's
    assert store.metrics.value("connector_save_buffers_withheld") == 1


def test_an_engine_that_never_calls_get_finished_gets_completed_copies_saved_at_wait_for_save() -> (
    None
):
    core, engine, store, _ = worker()
    core.save_after_forward(saves(1, [0, 1]), stream=None)
    core.save_after_forward(saves(2, [2]), stream=None)  # NOTE: queues the first pass's copies
    engine.events[0].done = True
    core.save_after_forward(saves(3, [3]), stream=None)
    assert sorted(store.saved) == [bytes([1, 0]) * 8, bytes([1, 1]) * 8]


def test_a_prompts_copies_are_queued_a_share_per_get_finished_and_hold_it_till_the_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """256 planned copies, 64 blocks' worth of bytes per get_finished: a copy engine serves
    device-to-host copies in order, so the next iteration's tokens wait only behind a share.
    The request is reported once its last block's copy is done; every block is saved whole."""
    core, engine, store, pool = worker(num_blocks=300)
    monkeypatch.setattr(worker_module, "SAVE_COPY_BYTES", 64 * core.block_nbytes)
    core.save_after_forward(saves(1, list(range(256))), stream=None)
    reported = []
    for _ in range(6):
        reported.append(core.finished([1] if not reported else []))
        for event in engine.events:
            event.done = True
    assert engine.queued == [64, 64, 64, 64]  # NOTE: 4 calls of 64 copies, from the second
    assert reported == [[], [], [], [], [], [1]]
    core.save_after_forward(ConnectorMetadata(), stream=None)  # NOTE: no copies left to queue
    assert engine.queued == [64, 64, 64, 64]
    assert len(store.saved) == 256
    assert store.saved[bytes([1, 255]) * 8] == pool[255].view(torch.uint8).numpy().tobytes()


def test_what_waits_stays_within_four_iterations_copies_however_long_the_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Guard on the bound: 256 blocks planned every iteration for 30 iterations, 64 blocks'
    worth per call. A quarter of what waits goes when that is more, so the backlog settles
    at a few iterations' copies (this iteration's, which wait a call, included) instead of
    growing without end; flush queues the rest."""
    core, engine, store, _ = worker(num_blocks=300)
    monkeypatch.setattr(worker_module, "SAVE_COPY_BYTES", 64 * core.block_nbytes)
    waiting = []
    for step in range(30):
        ops = SaveOps.of(
            SaveOp(
                step, b, key=bytes([step]) + b.to_bytes(2, "big") * 7 + bytes(1), parent=bytes(16)
            )
            for b in range(256)
        )
        core.save_after_forward(ConnectorMetadata(saves=ops), stream=None)
        core.finished([step])
        for event in engine.events:
            event.done = True
        waiting.append(sum(len(batch.ops) for batch in core._unissued))
    assert max(waiting) <= 4 * 256
    assert waiting[-1] == waiting[-2]  # NOTE: settled
    core.flush()
    assert len(store.saved) == 30 * 256


def test_a_share_whose_copies_cannot_be_planned_loses_its_saves_never_its_request_or_buffers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    core, engine, store, _ = worker(num_blocks=300)
    monkeypatch.setattr(worker_module, "SAVE_COPY_BYTES", 64 * core.block_nbytes)
    free_before = len(core._buffers._free)
    core.save_after_forward(saves(1, list(range(256))), stream=None)
    real = core._copy_pairs
    calls = []

    def broken_once(ops: SaveOps, buffers: list[Any]) -> list[SavePair]:
        calls.append(len(ops))
        if len(calls) == 1:
            raise RuntimeError("cannot plan")
        return real(ops, buffers)

    monkeypatch.setattr(core, "_copy_pairs", broken_once)
    reported = [core.finished([1]), core.finished([])]
    # NOTE: the dropped share's buffers are back at once (nothing was queued into them).
    assert len(core._buffers._free) == free_before + 64
    for _ in range(4):
        reported.append(core.finished([]))
        for event in engine.events:
            event.done = True
    assert calls == [64, 64, 64, 64]
    assert engine.queued == [64, 64, 64]  # NOTE: the first share's 64 saves are dropped
    assert reported == [[], [], [], [], [], [1]]
    assert len(store.saved) == 192
    assert store.metrics.value("connector_save_errors") == 64
    # NOTE: every buffer is back: the dropped share's at once (nothing was queued into it).
    assert len(core._buffers._free) == free_before + 256
    assert "dropping the saves of 64 block(s)" in caplog.text


def _first_share_queued(
    monkeypatch: pytest.MonkeyPatch, blocks: int
) -> tuple[WorkerCore, DeferringEngine, Store]:
    """A pass of ``blocks`` saves of request 1 in shares of 64, its first share queued."""
    core, engine, store, _ = worker(num_blocks=300)
    monkeypatch.setattr(worker_module, "SAVE_COPY_BYTES", 64 * core.block_nbytes)
    core.save_after_forward(saves(1, list(range(blocks))), stream=None)
    core.finished([1])
    core.finished([])
    assert engine.queued == [64]
    return core, engine, store


def test_short_of_buffers_the_waiting_copies_are_queued_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Copies waiting for their share hold their buffers; when a pass finds too few, every
    waiting copy is queued so that its buffers come back as soon as possible."""
    core, engine, _ = _first_share_queued(monkeypatch, 256)
    monkeypatch.setattr(core._buffers, "acquire_many", lambda n: [])
    core.save_after_forward(saves(2, [250, 251]), stream=None)
    assert engine.queued == [64, 192]


def test_a_split_passs_rest_is_queued_first_when_the_engine_then_skips_get_finished(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rest of a pass cut by a share goes back to the head of the queue, ready: an engine
    that then skips get_finished gets it queued at the next wait_for_save, before any later
    pass's copies (oldest first)."""
    core, engine, store = _first_share_queued(monkeypatch, 128)
    core.save_after_forward(saves(2, [200]), stream=None)
    core.save_after_forward(saves(3, [201]), stream=None)  # NOTE: no get_finished between
    assert engine.queued == [64, 64]
    assert [batch.ops.block_ids[0] for batch in core._unissued] == [200, 201]
    for event in engine.events:
        event.done = True
    core.flush()
    assert len(store.saved) == 130


def test_buffers_released_out_of_order_come_back_lowest_slots_first() -> None:
    from s3kv.arena import SlabArena
    from s3kv.connector.worker import SaveBufferPool

    arena = SlabArena.create(64, 64 * 12, tag="order-test")
    try:
        pool = SaveBufferPool(64, 64 * 12, pinned=False, arena=arena)
        taken = pool.acquire_many(10)
        assert [pool.slot(b) for b in taken] == list(range(10))
        for i in (7, 2, 9, 0, 5, 3):  # NOTE: as encoders finish: any order
            pool.release(taken[i])
        again = pool.acquire_many(4)
        assert [pool.slot(b) for b in again] == [0, 2, 3, 5]  # a run's slots, in order
        pool.release(again[1])  # slot 2, below the free ones: no re-sort needed
        assert [pool.slot(b) for b in pool.acquire_many(3)] == [2, 7, 9]
        assert [pool.slot(b) for b in pool.acquire_many(3)] == [10, 11]  # fresh, to the bound
    finally:
        arena.close()


def test_an_idle_engine_still_gets_its_last_copies_saved_and_reported_at_its_next_call() -> None:
    # NOTE: TensorRT-LLM calls get_finished once after a request's last forward pass, then
    # blocks on its request queue: the idle saver must queue and hand over what waits.
    core, engine, store, pool = worker(idle_save_after=0.02)
    engine.queues_from_any_thread = True
    try:
        core.save_after_forward(saves(1, [2, 5]), stream=None)
        assert core.finished([1]) == []  # the one call: its copies wait for the next
        assert wait_until(lambda: engine.queued == [2]), "the idle saver never queued them"
        engine.events[0].done = True
        assert wait_until(lambda: len(store.saved) == 2), "completed copies never reached the store"
        assert store.saved[bytes([1, 5]) * 8] == pool[5].view(torch.uint8).numpy().tobytes()
        assert store.metrics.value("connector_saves_queued_idle") == 2
        assert core.finished([]) == [1]  # reported by the engine's next call, once
        assert core.finished([]) == []
    finally:
        core.close()


def test_no_idle_saver_where_copies_must_be_queued_on_the_engines_thread() -> None:
    core, engine, _, _ = worker(idle_save_after=0.01)  # NOTE: the engine does not allow it
    try:
        core.save_after_forward(saves(1, [2]), stream=None)
        core.finished([1])
        time.sleep(0.2)
        assert engine.queued == []
        assert core._idle_saver is None
    finally:
        core.close()


def test_keys_that_cannot_be_hashed_lose_their_saves_never_the_request_or_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from s3kv.keys import KeyRun

    core, engine, store, _ = worker()
    monkeypatch.setattr(worker_module, "SAVE_COPY_BYTES", 1)  # NOTE: splits hash the keys
    monkeypatch.setattr(KeyRun, "keys", lambda self: 1 / 0)
    tokens = bytes(4 * 4 * 6)  # six blocks of four tokens whose keys travel unhashed
    ops = SaveOps(
        [7] * 8, list(range(8)), bytes(32), bytes(32), [(2, KeyRun(bytes(16), tokens, 4))]
    )
    core.save_after_forward(ConnectorMetadata(saves=ops), stream=None)
    assert core.finished([7]) == []
    assert core.finished([]) == [7]  # NOTE: dropped, counted, reported
    assert engine.queued == []
    assert store.metrics.value("connector_save_errors") == 8
    assert len(core._buffers._free) == 8  # NOTE: every buffer back in the pool


def test_keys_that_cannot_be_hashed_when_buffers_run_short_give_the_buffers_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Short of buffers, wait_for_save takes a part of the saves, which hashes the keys that
    # travelled unhashed; a run whose tokens cannot be read must not keep the buffers taken.
    from s3kv.keys import KeyRun

    core, engine, store, _ = worker()
    core._buffers.capacity = 4  # NOTE: four buffers for eight saves
    monkeypatch.setattr(KeyRun, "keys", lambda self: 1 / 0)
    tokens = bytes(4 * 4 * 6)
    ops = SaveOps(
        [7] * 8, list(range(8)), bytes(32), bytes(32), [(2, KeyRun(bytes(16), tokens, 4))]
    )
    core.save_after_forward(ConnectorMetadata(saves=ops), stream=None)
    assert store.metrics.value("connector_save_errors") == 8
    assert len(core._buffers._free) == 4, "every buffer taken went back"
    assert core.finished([7]) == [7], "nothing of it in flight: reported at once"
    assert engine.queued == []
    core.close()
