"""Loads in layer groups, awaited layer by layer on the device (``wait_for_layer_load``).

The worker copies each claimed block in *layer groups* (one copy per block and group, the
first layers first) on its own stream and records one event per group; the forward pass
waits on the device, before each decoder layer's work, for the group holding that layer.
The host never waits for the copies. Until the layer hooks have been seen for every layer of
a whole forward pass (an engine whose hooks do not fire), a load is awaited whole, at once.

The engine here is a recording fake (the device is not what is tested): it records every
device-side wait the worker places and hands out events whose completion the test controls.
The copy engines' chunked copies are tested for the bytes they produce.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from s3kv.connector.completion import CompletionBoard
from s3kv.connector.device import DeferredCopyEngine, SyncCopyEngine
from s3kv.connector.metadata import ConnectorMetadata, LoadOp
from s3kv.connector.worker import WorkerCore, layer_groups
from s3kv.metrics import Metrics
from s3kv.testing.emulator.device import LateDevice

LAYERS = 6
BLOCK_ELEMS = 16  # bf16: 32 bytes per (layer, K or V), 64 bytes per layer, 384 per block


@dataclass
class FakeEvent:
    name: str
    done: bool = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


@dataclass
class FakeEngine:
    """Copies at once (so the bytes can be checked) and records the device-side waits."""

    waits: list[str] = field(default_factory=list)
    events: list[FakeEvent] = field(default_factory=list)
    loads: int = 0
    defers_saves: bool = False

    def mark_forward(self, stream: Any) -> None:
        return None

    def load(self, targets: Any, sources: Any, bounds: Any, stream: Any) -> list[FakeEvent]:
        SyncCopyEngine().load(targets, sources, bounds, stream)
        batch = [FakeEvent(f"load{self.loads}/group{g}") for g in range(len(bounds) - 1)]
        self.loads += 1
        self.events.extend(batch)
        return batch

    def wait(self, event: FakeEvent, stream: Any) -> None:
        self.waits.append(event.name)

    def save(self, pairs: Any, stream: Any) -> Any:
        raise AssertionError("no saves here")


class FakeStore:
    """The two things a worker's loads need from a store: staged bytes and metrics."""

    def __init__(self, block_nbytes: int) -> None:
        self.metrics = Metrics()
        self.blocks: dict[bytes, np.ndarray] = {}
        self.block_nbytes = block_nbytes

    def stage(self, key: bytes, fill: int) -> None:
        self.blocks[key] = np.full(self.block_nbytes, fill, dtype=np.uint8)

    def staged_many(self, keys: list[bytes]) -> list[np.ndarray | None]:
        return [self.blocks.get(key) for key in keys]

    def save_arena(self, slot_bytes: int, budget_bytes: int) -> None:
        return None  # NOTE: no codec processes: plain save buffers


def worker(min_group_bytes: int) -> tuple[WorkerCore, FakeEngine, FakeStore, torch.Tensor]:
    pool = torch.zeros((8, LAYERS, 2, BLOCK_ELEMS), dtype=torch.bfloat16)
    store = FakeStore(pool[0].numel() * pool.element_size())
    core = WorkerCore(0, store, pool, 1 << 20, board=CompletionBoard.private())  # type: ignore[arg-type]
    core.set_load_groups(min_group_bytes)
    engine = FakeEngine()
    core._engine = engine  # NOTE: the recording engine instead of the stream's
    return core, engine, store, pool


def load(
    core: WorkerCore, store: FakeStore, seq: int, blocks: dict[int, int], *, whole: bool = False
) -> None:
    """Claimed blocks ``{block_id: fill byte}`` as one load batch."""
    ops = []
    for block_id, fill in blocks.items():
        key = bytes([seq, block_id]) * 8
        store.stage(key, fill)
        ops.append(LoadOp(block_id, key))
    meta = ConnectorMetadata(loads=tuple(ops), load_seq=seq, whole_loads=whole)
    core.start_load(meta, stream=None)


def forward(core: WorkerCore, layers: range = range(LAYERS)) -> None:
    """The hooks of one forward pass, then the forward-pass callable."""
    for layer in layers:
        core.wait_for_layer(layer, stream=None)
    core.forward_done()


@pytest.mark.parametrize(
    ("layers", "layer_nbytes", "min_bytes", "bounds"),
    [
        (30, 24 * 1024, 1 << 20, [0, 30]),  # SmolLM2: a whole block is one group
        (32, 128 * 1024, 1 << 20, [0, 8, 16, 24, 32]),  # Llama-3-8B: 4 groups of 1 MiB
        (8, 128 * 1024, 1 << 20, [0, 8]),  # an 8-layer slice: one group
        (5, 1 << 20, 1 << 20, [0, 1, 2, 3, 4, 5]),  # one layer is enough
        (7, 100, 300, [0, 3, 6, 7]),  # the last group may be smaller
    ],
)
def test_layer_groups(layers: int, layer_nbytes: int, min_bytes: int, bounds: list[int]) -> None:
    assert layer_groups(layers, layer_nbytes, min_bytes) == bounds


def test_until_the_hooks_are_seen_a_load_is_awaited_whole_at_once() -> None:
    core, engine, store, pool = worker(min_group_bytes=128)  # 2 layers a group: 3 groups
    load(core, store, 1, {2: 7, 5: 9})
    assert engine.waits == ["load0/group2"], "the last group's event, before the forward"
    assert torch.equal(pool[2].view(-1).view(torch.uint8), torch.full((384,), 7, dtype=torch.uint8))
    assert torch.equal(pool[5].view(-1).view(torch.uint8), torch.full((384,), 9, dtype=torch.uint8))


def test_once_every_layer_was_hooked_each_group_is_awaited_before_its_first_layer() -> None:
    core, engine, store, _ = worker(min_group_bytes=128)
    forward(core)  # a pass without loads: the hooks ran for every layer
    assert core.layer_waits
    load(core, store, 1, {3: 1})
    assert engine.waits == [], "nothing awaited before the forward pass"
    for layer, expected in [
        (0, ["load0/group0"]),
        (1, ["load0/group0"]),  # same group: no second wait
        (2, ["load0/group0", "load0/group1"]),
        (3, ["load0/group0", "load0/group1"]),
        (4, ["load0/group0", "load0/group1", "load0/group2"]),
        (5, ["load0/group0", "load0/group1", "load0/group2"]),
    ]:
        core.wait_for_layer(layer, stream=None)
        assert engine.waits == expected, f"after layer {layer}'s hook"
    core.forward_done()
    assert core.layer_waits


def test_two_loads_before_one_forward_pass_are_both_awaited_per_group() -> None:
    core, engine, store, _ = worker(min_group_bytes=3 * 64)  # 3 layers a group: 2 groups
    forward(core)
    load(core, store, 1, {1: 1})
    load(core, store, 2, {2: 2})
    forward(core)
    assert engine.waits == ["load0/group0", "load1/group0", "load0/group1", "load1/group1"]


def test_a_forward_pass_that_skips_a_hook_awaits_the_rest_and_stops_deferring() -> None:
    core, engine, store, _ = worker(min_group_bytes=128)
    forward(core)
    load(core, store, 1, {1: 1})
    forward(core, layers=range(2))  # the hooks of layers 2..5 never ran
    assert engine.waits == ["load0/group0", "load0/group2"], "the rest at the pass's end"
    assert not core.layer_waits
    load(core, store, 2, {2: 2})
    assert engine.waits[-1] == "load1/group2", "awaited whole again, before the forward"


def test_a_pass_replayed_without_hooks_keeps_the_per_layer_waits() -> None:
    # TensorRT-LLM replays decode-only batches from CUDA graphs (the default), which run no
    # Python hook: before, one such pass turned the per-layer waits off for the next load.
    core, engine, store, _ = worker(min_group_bytes=128)
    forward(core)  # an eager pass: every hook ran
    forward(core, layers=range(0))  # a replayed decode step: no hook, no load
    assert core.layer_waits
    load(core, store, 1, {3: 1})
    assert engine.waits == [], "still awaited group by group, in the hooks"
    forward(core)
    assert engine.waits == ["load0/group0", "load0/group1", "load0/group2"]


def test_loads_marked_whole_are_awaited_before_the_forward_pass_even_with_layer_waits() -> None:
    # A request left one token may run in a decode CUDA graph, where no hook would await them.
    core, engine, store, _ = worker(min_group_bytes=128)
    forward(core)
    assert core.layer_waits
    load(core, store, 1, {3: 1}, whole=True)
    assert engine.waits == ["load0/group2"], "whole, before the forward pass"
    forward(core, layers=range(0))  # replayed: no hook
    assert engine.waits == ["load0/group2"], "nothing left to await at the pass's end"
    assert core.layer_waits


def test_a_pass_without_hooks_before_any_hook_ran_keeps_loads_awaited_whole() -> None:
    core, engine, store, _ = worker(min_group_bytes=128)
    forward(core, layers=range(0))
    assert not core.layer_waits
    load(core, store, 1, {3: 1})
    assert engine.waits == ["load0/group2"], "whole, before the forward pass"


def test_a_save_without_the_forward_pass_callable_never_leaves_a_load_unawaited() -> None:
    core, engine, store, _ = worker(min_group_bytes=128)
    forward(core)
    load(core, store, 1, {1: 1})
    core.save_after_forward(ConnectorMetadata(), stream=None)  # wait_for_save, no callable
    assert engine.waits == ["load0/group2"]


def test_the_board_hears_of_a_load_only_once_its_last_group_completed() -> None:
    core, engine, store, _ = worker(min_group_bytes=128)
    board = core.board
    assert board is not None
    load(core, store, 1, {1: 1})
    engine.events[0].done = engine.events[1].done = True
    core.poll_loads()
    assert board.published(0) == 0, "two of three groups copied: the sources stay pinned"
    engine.events[2].done = True
    core.poll_loads()
    assert board.published(0) == 1


@pytest.mark.parametrize("bounds", [[0, 384], [0, 64, 192, 384], [0, 128, 256, 384]])
def test_chunked_copies_write_every_byte_of_every_block(bounds: list[int]) -> None:
    rng = np.random.default_rng(3)
    sources = [rng.integers(0, 256, 384, dtype=np.uint8) for _ in range(3)]
    for engine in ("sync", "deferred"):
        targets = [torch.zeros(384, dtype=torch.uint8) for _ in sources]
        if engine == "sync":
            SyncCopyEngine().load(targets, sources, bounds, None)
        else:
            device = LateDevice()
            events = DeferredCopyEngine().load(targets, sources, bounds, device)
            assert len(events) == len(bounds) - 1
            assert not any(e.query() for e in events), "queued, not run"
            events[-1].synchronize()
        for target, source in zip(targets, sources, strict=True):
            assert np.array_equal(target.numpy(), source), engine


def test_deferred_chunks_read_their_source_when_they_run() -> None:
    source = np.full(384, 5, dtype=np.uint8)
    target = torch.zeros(384, dtype=torch.uint8)
    device = LateDevice()
    events = DeferredCopyEngine().load([target], [source], [0, 128, 384], device)
    events[0].synchronize()  # the first chunk ran with the original bytes
    source[:] = 9  # recycled before the second chunk ran: the hazard the board prevents
    events[1].synchronize()
    assert set(target[:128].tolist()) == {5}
    assert set(target[128:].tolist()) == {9}
