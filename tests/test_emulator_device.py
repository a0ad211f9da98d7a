"""LateDevice: an in-order queue run only at sync points, and the overlap loop's load race.

Under TensorRT-LLM's overlap loop the host enqueues iteration N+1 (``build_connector_meta``,
``start_load_kv``, the forward pass) before it synchronises on iteration N's tokens, so a
copy ``start_load_kv`` enqueued in iteration N may not have run when iteration N+1's
``build_connector_meta`` plans the next loads. These tests pin that down in the emulator.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _emulator import executor, one_torch_thread, prompt

from s3kv.connector.device import DeferredStream, StreamEvent
from s3kv.testing.emulator.device import DeviceValue, LateDevice
from s3kv.testing.emulator.recording import RecordingConnector


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def test_nothing_runs_until_synchronised() -> None:
    device = LateDevice()
    ran: list[int] = []
    device.enqueue(lambda: ran.append(1))
    device.enqueue(lambda: ran.append(2))
    assert ran == []
    assert (device.enqueued, device.executed, device.pending) == (2, 0, 2)
    device.synchronize()
    assert ran == [1, 2]
    assert (device.enqueued, device.executed, device.pending) == (2, 2, 0)


def test_event_query_never_runs_and_synchronize_stops_at_the_marker() -> None:
    device = LateDevice()
    ran: list[str] = []
    device.enqueue(lambda: ran.append("a"))
    first = device.record_event()
    device.enqueue(lambda: ran.append("b"))
    second = device.record_event()
    assert not first.query()
    assert not second.query()
    assert ran == []  # query() ran nothing
    first.synchronize()
    assert ran == ["a"]
    assert first.query()
    assert not second.query()
    second.synchronize()
    assert ran == ["a", "b"]
    assert second.query()
    assert device.record_event().query()  # nothing queued before it


def test_fifo_order_and_work_that_enqueues_more_work() -> None:
    device = LateDevice()
    ran: list[int] = []

    def spawn() -> None:
        ran.append(1)
        device.enqueue(lambda: ran.append(3))

    device.enqueue(spawn)
    device.enqueue(lambda: ran.append(2))
    device.synchronize()
    assert ran == [1, 2, 3]


def test_a_failing_item_raises_at_the_sync_point_and_later_work_stays_queued() -> None:
    device = LateDevice()
    ran: list[int] = []

    def boom() -> None:
        raise ArithmeticError("device fault")

    device.enqueue(boom)
    device.enqueue(lambda: ran.append(1))
    with pytest.raises(ArithmeticError):
        device.synchronize()
    assert (device.executed, ran) == (1, [])
    device.synchronize()
    assert ran == [1]


def test_implements_the_connector_stream_protocol() -> None:
    device = LateDevice()
    assert isinstance(device.stream(), DeferredStream)
    assert isinstance(device.record_event(), StreamEvent)


def test_device_value_refuses_reads_before_it_is_produced() -> None:
    value: DeviceValue[int] = DeviceValue()
    with pytest.raises(RuntimeError, match="before the device ran"):
        value.get()
    value.set(3)
    assert value.ready
    assert value.get() == 3


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_late_device_gives_the_same_tokens_and_calls(overlap: bool) -> None:
    shared = prompt(70)
    prompts = [shared, [*shared[:50], *prompt(30, seed=5)], prompt(100, seed=2)]
    runs = []
    for late in (False, True):
        rec = RecordingConnector()
        ex = executor(rec, overlap=overlap, late_device=late)
        first = [r.output_tokens for r in ex.generate(prompts[:1], 6)]
        rest = [r.output_tokens for r in ex.generate(prompts[1:], 9)]  # local reuse
        ex.drain()
        assert ex.device is None or ex.device.pending == 0
        stream = rec.worker.start_load_kv.call_args.args[0]
        assert (stream is ex.device) if late else stream is None
        runs.append((first + rest, rec.names()))
    assert runs[0] == runs[1]


def test_chunked_prefill_under_overlap_matches_the_synchronous_run() -> None:
    outputs = []
    for late in (False, True):
        ex = executor(
            overlap=True, late_device=late, enable_chunked_prefill=True, max_num_tokens=64
        )
        outputs.append([r.output_tokens for r in ex.generate([prompt(150), prompt(40, 3)], 5)])
    assert outputs[0] == outputs[1]


def test_the_forward_pass_is_queued_until_the_host_synchronises() -> None:
    ex = executor(overlap=True)
    assert ex.device is not None  # the default on a CPU model
    ex.submit(prompt(40), 4)
    ex.step()  # overlap: the first forward is queued, nothing commits it yet
    assert ex.device.pending > 0
    assert not ex.pool.any()  # the model has not written a byte
    ex.synchronize()
    assert ex.device.pending == 0
    assert ex.pool.any()


def _load_race(overlap: bool) -> list[bool]:
    """For each ``build_connector_meta`` after the first: had the previous load run?"""
    rec = RecordingConnector()
    loads: list[dict[str, bool]] = []
    seen: list[bool] = []

    def start_load_kv(stream: Any) -> None:
        copy = {"ran": False}
        loads.append(copy)
        stream.enqueue(lambda: copy.update(ran=True))  # a host->device copy, run late

    def build_connector_meta(output: Any) -> None:
        if loads:
            seen.append(loads[-1]["ran"])

    rec.worker.start_load_kv.side_effect = start_load_kv
    rec.scheduler.build_connector_meta.side_effect = build_connector_meta
    ex = executor(rec, overlap=overlap)
    ex.generate([prompt(40)], 6)
    assert all(load["ran"] for load in loads)  # complete once generate() returns
    return seen


def test_overlap_loop_plans_the_next_loads_before_the_previous_copy_ran() -> None:
    seen = _load_race(overlap=True)
    assert len(seen) == 5
    # NOTE: the race a connector must survive: recycling the previous load's host buffer
    # in build_connector_meta would feed the still-queued copy recycled bytes.
    assert not any(seen)


def test_plain_loop_has_run_the_previous_copy_before_planning() -> None:
    seen = _load_race(overlap=False)
    assert len(seen) == 5
    assert all(seen)
