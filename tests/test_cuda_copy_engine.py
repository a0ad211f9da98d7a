"""CudaCopyEngine's stream ordering, on a recording stand-in for ``torch.cuda``.

No GPU here: the stand-in records, per stream, the work queued on it and the points of other
streams it waits for, which is all the ordering CUDA gives. What the device then does with
that order is measured on an H100 by ``benchmarks/gpu_copy_order.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from s3kv.connector import device
from s3kv.connector.device import CudaCopyEngine


class FakeStream:
    """A stream: the work queued on it, in order, and what it waits for before each item."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.work: list[str] = []
        self.waits: list[tuple[int, FakeStream, int]] = []  # (before item, stream, its count)

    def wait_event(self, event: FakeEvent) -> None:
        assert event.stream is not None, "waiting for an event never recorded"
        self.waits.append((len(self.work), event.stream, event.position))

    def wait_stream(self, other: FakeStream) -> None:
        self.waits.append((len(self.work), other, len(other.work)))

    def waited_for(self, item: str) -> list[str]:
        """Everything queued on other streams that ``item`` of this stream comes after."""
        index = self.work.index(item)
        return [
            done
            for before, other, count in self.waits
            if before <= index
            for done in other.work[:count]
        ]


class FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.stream: FakeStream | None = None
        self.position = 0

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = stream if stream is not None else self.cuda.current
        self.position = len(self.stream.work)


class FakeCuda:
    def __init__(self) -> None:
        self.engine = FakeStream("engine")
        self.current = self.engine
        self.created: list[FakeStream] = []

    def Stream(self, device: Any = None) -> FakeStream:
        stream = FakeStream(f"side-{len(self.created)}")
        self.created.append(stream)
        return stream

    def Event(self) -> FakeEvent:
        return FakeEvent(self)

    def current_stream(self, device: Any = None) -> FakeStream:
        return self.current

    @contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def foreach_copy(
        self, targets: list[str], sources: list[str], non_blocking: bool = False
    ) -> None:
        self.current.work.extend(f"copy {source}" for source in sources)


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    torch = SimpleNamespace(
        cuda=fake, _foreach_copy_=fake.foreach_copy, from_numpy=lambda array: "staged bytes"
    )
    monkeypatch.setattr(device, "_torch", lambda: torch)
    return fake


def test_saves_wait_for_the_token_copy_queued_after_the_forward_pass(cuda: FakeCuda) -> None:
    engine = CudaCopyEngine("cuda:0")
    main = cuda.engine
    main.work.append("forward")
    engine.mark_forward(main)  # the forward-pass callable
    main.work.append("token copy")  # the sampler, after wait_for_save
    engine.save([("host", "block 7")], main)  # get_finished issues the copies
    side = next(s for s in cuda.created if "copy block 7" in s.work)
    assert "token copy" in side.waited_for("copy block 7")


def test_saves_without_a_forward_event_wait_for_the_engine_stream(cuda: FakeCuda) -> None:
    engine = CudaCopyEngine("cuda:0")
    main = cuda.engine
    main.work.append("forward")
    engine.save([("host", "block 3")], main)
    side = next(s for s in cuda.created if "copy block 3" in s.work)
    assert side.waited_for("copy block 3") == ["forward"]


def test_loads_run_after_the_engine_stream_and_the_forward_waits_for_them(
    cuda: FakeCuda,
) -> None:
    engine = CudaCopyEngine("cuda:0")
    main = cuda.engine
    main.work.append("previous user of the block")
    events = engine.load(["block 5"], [np.zeros(4, np.uint8)], [0, 4], main)
    loads = next(s for s in cuda.created if s.work)
    assert loads.waited_for(loads.work[0]) == ["previous user of the block"]
    engine.wait(events[-1], main)
    main.work.append("layer 0")
    assert loads.work[0] in main.waited_for("layer 0")
