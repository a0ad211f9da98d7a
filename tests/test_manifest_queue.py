"""The manifest's record queue: hits coalesce per key and the bound drops hits before writes."""

from __future__ import annotations

from s3kv.manifest.format import KIND_HIT, KIND_WRITE, UNKNOWN_PARENT
from s3kv.manifest.queue import RecordQueue


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def write(i: int) -> tuple[bytes, bytes, float, int, int, int]:
    return (key(i), UNKNOWN_PARENT, 1.0, 10, KIND_WRITE, 1)


def hits_of(queue: RecordQueue) -> dict[bytes, tuple[int, float]]:
    rows = queue.to_array()
    return {
        bytes(r["key"]): (int(r["count"]), float(r["time"])) for r in rows if r["kind"] == KIND_HIT
    }


def test_hits_coalesce_per_key_with_their_latest_time() -> None:
    queue = RecordQueue(bound=10)
    queue.add_hits([key(1), key(2), key(1)], now=5.0)
    queue.add_hits([key(1)], now=7.0)
    assert hits_of(queue) == {key(1): (3, 7.0), key(2): (1, 5.0)}
    assert len(queue) == 2
    assert not queue.due(now=6.0, hit_interval=2.0)  # NOTE: the oldest hit is from t=5
    assert queue.due(now=7.0, hit_interval=2.0)


def test_at_the_bound_the_oldest_hits_go_first_and_writes_stay() -> None:
    queue = RecordQueue(bound=3)
    queue.append(write(9))
    queue.add_hits([key(1)], now=1.0)
    queue.add_hits([key(2), key(3)], now=2.0)
    assert len(queue) == 3
    assert queue.dropped == 1
    assert set(hits_of(queue)) == {key(2), key(3)}
    assert queue.write_keys() == [key(9)]


def test_a_batch_larger_than_the_bound_keeps_its_newest_keys() -> None:
    queue = RecordQueue(bound=2)
    queue.add_hits([key(i) for i in range(6)], now=1.0)
    assert set(hits_of(queue)) == {key(4), key(5)}
    assert queue.dropped == 4
    # Hits already queued are counted again without growing the queue or dropping anything.
    queue.add_hits([key(5), key(4)], now=2.0)
    assert hits_of(queue) == {key(4): (2, 2.0), key(5): (2, 2.0)}
    assert queue.dropped == 4


def test_extending_keeps_what_appending_one_by_one_keeps() -> None:
    for bound in (1, 3, 5, 9):
        one_by_one, at_once = RecordQueue(bound=bound), RecordQueue(bound=bound)
        for queue in (one_by_one, at_once):
            queue.append(write(90))
            queue.add_hits([key(1), key(2)], now=1.0)
        for i in range(6):
            one_by_one.append(write(i))
        at_once.extend(write(i) for i in range(6))
        assert at_once.to_array().tobytes() == one_by_one.to_array().tobytes()
        assert at_once.dropped == one_by_one.dropped
