"""A codec process's sender: when save outcomes leave for the store."""

from __future__ import annotations

import pickle
import threading
import time

from s3kv.offload import Outcome, Outcomes
from s3kv.offload.child import _SAVE_COALESCE_S, _Replies


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
