"""A codec process: when save outcomes leave for the store; requests and codec work apart."""

from __future__ import annotations

import pickle
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from s3kv import codec
from s3kv.arena import SlabArena
from s3kv.offload import Outcome, Outcomes, child, work
from s3kv.offload.child import _SAVE_COALESCE_S, _Decode, _Put, _Replies, _start, _Steps
from s3kv.offload.jobs import FetchJob, SaveJob
from s3kv.storage.memory import MemoryBackend


class Wire:
    """Stands for the socket: keeps each message sent, with its time."""

    def __init__(self) -> None:
        self.messages: list[tuple[float, Outcomes]] = []
        self.sent = threading.Event()

    def send_bytes(self, data: bytes) -> None:
        self.messages.append((time.monotonic(), pickle.loads(data)))
        self.sent.set()


def sender() -> tuple[Wire, _Replies]:
    """A running sender writing to a :class:`Wire`."""
    wire = Wire()
    replies = _Replies(wire)  # type: ignore[arg-type]
    threading.Thread(target=replies.run, daemon=True).start()
    return wire, replies


def outcome(job_id: int) -> Outcome:
    return Outcome(job_id, True, 0.01, None, True, 100, None)


def test_save_outcomes_leave_together_once_no_job_is_left_not_on_a_short_timer() -> None:
    wire, replies = sender()
    replies.expect(3)
    replies.put(outcome(0), urgent=False)
    replies.put(outcome(1), urgent=False)
    assert not wire.sent.wait(0.05)  # NOTE: a job is left: they wait for it (was: 20 ms)
    last = time.monotonic()
    replies.put(outcome(2), urgent=False)
    assert wire.sent.wait(5)
    [(at, message)] = wire.messages
    assert message.job_id == [0, 1, 2]
    assert at - last < _SAVE_COALESCE_S  # NOTE: at once, not at the timer


def test_save_outcomes_leave_after_the_timer_when_jobs_are_still_running() -> None:
    wire, replies = sender()
    replies.expect(2)
    replies.put(outcome(0), urgent=False)
    assert wire.sent.wait(5 + _SAVE_COALESCE_S)
    [(_, message)] = wire.messages
    assert message.job_id == [0]


def test_a_fetch_outcome_leaves_at_once_whatever_else_is_running() -> None:
    wire, replies = sender()
    replies.expect(5)
    started = time.monotonic()
    replies.put(outcome(7), urgent=True)
    assert wire.sent.wait(5)
    assert wire.messages[0][0] - started < _SAVE_COALESCE_S


# --- requests and codec work on their own threads ---


class Peak:
    """Counts calls running at once; each call waits ``hold`` seconds inside."""

    def __init__(self, hold: float) -> None:
        self.hold = hold
        self.now = 0
        self.most = 0
        self._lock = threading.Lock()

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.now += 1
                self.most = max(self.most, self.now)
            try:
                time.sleep(self.hold)
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.now -= 1

        return counted


class SlowBucket(MemoryBackend):
    """A bucket a round trip away: every GET and PUT waits ``requests.hold`` seconds."""

    def __init__(self, requests: Peak) -> None:
        super().__init__()
        self.get = requests(super().get)  # type: ignore[method-assign]
        self.put = requests(super().put)  # type: ignore[method-assign]


BLOCK_SHAPE = (4, 2, 64, 64)  # NOTE: bf16: 64 KiB a block
BLOCK_NBYTES = 2 * int(np.prod(BLOCK_SHAPE))


def fetch_job(arena: SlabArena, slot: int, key: str) -> FetchJob:
    return FetchJob(key, arena.path, arena.slot_bytes, slot, 2 * BLOCK_NBYTES)


def save_job(arena: SlabArena, slot: int, key: str) -> SaveJob:
    return SaveJob(key, arena.path, arena.slot_bytes, slot, BLOCK_NBYTES, "bfloat16",
                   BLOCK_SHAPE, int(codec.CodecId.PLANES_ZSTD), 1, False)  # fmt: skip


def test_a_process_keeps_8_requests_in_flight_while_it_codes_on_2_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A long link needs many GETs in flight; the engine's host can spare few CPUs for the
    # codec. One kind of thread for both made every GET in flight a possible encode at once.
    requests, codecs = Peak(0.1), Peak(0.005)
    monkeypatch.setattr(work, "decode", codecs(work.decode))
    monkeypatch.setattr(work, "encode", codecs(work.encode))
    bucket = SlowBucket(requests)
    rng = np.random.default_rng(7)
    blocks = [rng.integers(0, 1 << 16, BLOCK_NBYTES // 2, dtype=np.uint16) for _ in range(24)]
    arena = SlabArena.create(BLOCK_NBYTES, 48 * BLOCK_NBYTES)
    try:
        for block in blocks:  # NOTE: the save arena's slots 0-23
            arena.allocate(BLOCK_NBYTES).data[:] = block.view(np.uint8)
        wire, replies = sender()
        steps = _start(replies, bucket, None, threads=8, codec_threads=2)
        replies.expect(24)
        for i in range(24):
            steps.add(i, save_job(arena, i, f"k{i}"))
        wait_for_outcomes(wire, 24)
        saved = requests.most, codecs.most
        requests.most = codecs.most = 0
        replies.expect(24)
        for i in range(24):  # NOTE: decoded into slots 24-47
            steps.add(100 + i, fetch_job(arena, 24 + i, f"k{i}"))
        outcomes = wait_for_outcomes(wire, 48)
        loaded = requests.most, codecs.most
        assert (saved, loaded) == ((8, 2), (8, 2))
        assert all(o.found and o.request_error is None and o.codec_error is None
                   for o in outcomes)  # fmt: skip
        for i, block in enumerate(blocks):
            assert arena.view(24 + i).data.tobytes() == block.tobytes()
    finally:
        arena.close()


def wait_for_outcomes(wire: Wire, count: int) -> list[Outcome]:
    deadline = time.monotonic() + 30
    while True:
        got = [o for _, message in wire.messages for o in message.rows()]
        if len(got) >= count or time.monotonic() > deadline:
            assert len(got) == count
            return got
        time.sleep(0.01)


SAVE = SaveJob("s", "/nowhere", 8, 0, 8, "uint8", (8,), 0, 1, False)
FETCH = FetchJob("f", "/nowhere", 8, 0, 16)
RAW = b"x"


def test_neither_step_runs_ahead_of_the_other_by_more_than_ahead() -> None:
    steps = _Steps(ahead=2)
    for i in range(4):
        steps.add(i, SAVE)
    for i in (10, 11, 12):
        steps.add(i, FETCH)
    assert [steps.next_request().job_id for _ in range(2)] == [10, 11]
    assert [steps.next_codec().job_id for _ in range(2)] == [0, 1]  # NOTE: no decode yet
    taken = queue.SimpleQueue[int]()

    def take(next_step: Callable[[], Any]) -> None:
        taken.put(next_step().job_id)

    threading.Thread(target=take, args=(steps.next_request,), daemon=True).start()
    threading.Thread(target=take, args=(steps.next_codec,), daemon=True).start()
    # Two GETs await their decodes and two encodes their PUTs: nothing more starts.
    with pytest.raises(queue.Empty):
        taken.get(timeout=0.1)
    steps.fetched(_Decode(10, FETCH, work.Fetched(RAW, 0.0)))
    steps.encoded(_Put(0, SAVE, work.Encoded(RAW)))
    # Steps that end a job are never gated: the decode, and the PUT, are taken.
    assert {taken.get(timeout=5), taken.get(timeout=5)} == {10, 0}
    steps.fetch_ended()  # NOTE: fetch 10 ended: GET 12 may start
    steps.save_ended(put=True)  # NOTE: save 0 ended: encode 2 may start
    assert steps.next_request().job_id == 12
    assert steps.next_codec().job_id == 2


def test_fetches_go_first_and_saves_keep_one_put_going_under_a_run_of_loads() -> None:
    # A load may wait on a fetch, nobody on a save; but a run of loads must not stop saves,
    # whose bytes in flight would fill up and drop new ones.
    steps = _Steps(ahead=8)
    steps.add(0, SAVE)
    steps.add(1, SAVE)
    for i in (10, 11, 12, 13):
        steps.add(i, FETCH)
    assert steps.next_codec().job_id == 0
    steps.encoded(_Put(0, SAVE, work.Encoded(RAW)))
    # The GET before the PUT that waited first; then the PUT (none running); then GETs.
    assert [steps.next_request().job_id for _ in range(3)] == [10, 0, 11]
    steps.fetched(_Decode(10, FETCH, work.Fetched(RAW, 0.0)))
    assert steps.next_codec().job_id == 10  # NOTE: the decode before encode 1, queued first
    assert steps.next_codec().job_id == 1
    steps.encoded(_Put(1, SAVE, work.Encoded(RAW)))
    assert steps.next_request().job_id == 12  # NOTE: PUT 0 still runs: the GET first
    steps.save_ended(put=True)
    assert [steps.next_request().job_id for _ in range(2)] == [1, 13]


def test_a_thread_that_meets_a_base_exception_ends_the_process_not_silently_its_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A dead thread would leave its job without an outcome and the store waiting for ever;
    # an exited process has its jobs failed by the store once it is gone.
    exits: queue.SimpleQueue[int] = queue.SimpleQueue()
    monkeypatch.setattr(child.os, "_exit", exits.put)

    class Interrupted(MemoryBackend):
        def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
            raise KeyboardInterrupt

    _, replies = sender()
    steps = _start(replies, Interrupted(), None, threads=1, codec_threads=1)
    replies.expect(1)
    steps.add(0, FETCH)
    assert exits.get(timeout=5) == child._THREAD_DIED
