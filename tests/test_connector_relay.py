"""The write relay: other TP ranks' writes reach rank 0's shared manifest, bounded."""

from __future__ import annotations

import subprocess
import sys
import time

from s3kv.connector.relay import RelayedManifest, RelayPump, WriteRelay
from s3kv.keys import ROOT_HASH, BlockHash, hash_block


def key(i: int) -> BlockHash:
    return hash_block(ROOT_HASH, [i])


def test_reports_arrive_in_order_and_a_full_ring_drops_and_counts() -> None:
    relay = WriteRelay.create(3, capacity=2)
    rank2 = RelayedManifest(2)
    rank2.record_write(key(0), ROOT_HASH, 1)  # before the attach: nowhere to go
    rank2.attach(relay.path)
    for i in range(1, 4):
        rank2.record_write(key(i), ROOT_HASH, 10 + i)
    assert rank2.stats() == {"relay_reports": 2.0, "relay_dropped": 2.0}
    assert relay.dropped() == 1
    assert relay.drain(2) == [(bytes(key(1)), bytes(ROOT_HASH), 11),
                              (bytes(key(2)), bytes(ROOT_HASH), 12)]  # fmt: skip
    assert relay.drain(2) == []
    assert relay.drain(1) == []
    rank2.record_write(key(4), ROOT_HASH, 14)  # room again once drained
    assert [r[0] for r in relay.drain(2)] == [bytes(key(4))]
    rank2.close()
    relay.close()


def test_a_relayed_manifest_answers_nothing_itself() -> None:
    # Rank 0 decides what is saved: a rank > 0 admits every planned save.
    relayed = RelayedManifest(1)
    assert not relayed.may_contain(key(1))
    assert relayed.count_leading([key(1), key(2)]) == 0
    relayed.record_hits([key(1)])
    assert relayed.flush() == 0
    relayed.attach("/nonexistent/relay")  # logged, counted as drops later; never raises
    relayed.record_write(key(1), ROOT_HASH, 1)
    assert relayed.stats()["relay_dropped"] == 1


def test_another_process_reports_through_the_descriptor_path() -> None:
    relay = WriteRelay.create(2)
    code = (
        "from s3kv.connector.relay import RelayedManifest; "
        f"m = RelayedManifest(1); m.attach({relay.path!r}); "
        f"m.record_write({bytes(key(7))!r}, {bytes(key(6))!r}, 77); m.close()"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert relay.unfinished() == [], "the other rank closed: finished"
    assert relay.drain(1) == [(bytes(key(7)), bytes(key(6)), 77)]
    relay.close()


def test_the_pump_waits_for_every_joined_rank_before_closing() -> None:
    relay = WriteRelay.create(3)
    got: list[tuple[int, bytes]] = []
    pump = RelayPump(relay, lambda rank, k, parent, size: got.append((rank, bytes(k))), 0.01)
    pump.start()
    rank1, rank2 = RelayedManifest(1), RelayedManifest(2)
    rank1.attach(relay.path)
    rank2.attach(relay.path)
    rank1.record_write(key(1), ROOT_HASH, 1)
    rank1.close()
    # Rank 2 joined but never finishes: close waits for it, bounded, and says so.
    started = time.monotonic()
    assert not pump.close(timeout=0.2)
    assert 0.2 <= time.monotonic() - started < 5
    assert got == [(1, bytes(key(1)))]
    assert pump.close(timeout=0.2), "idempotent"
    rank2.close()


def test_the_pump_delivers_a_late_report_before_it_closes() -> None:
    relay = WriteRelay.create(2)
    got: list[bytes] = []
    pump = RelayPump(relay, lambda rank, k, parent, size: got.append(bytes(k)), 0.01)
    rank1 = RelayedManifest(1)
    rank1.attach(relay.path)
    rank1.record_write(key(1), ROOT_HASH, 1)
    rank1.close()  # finished before the pump ever ran: close still drains
    assert pump.close(timeout=1.0)
    assert got == [bytes(key(1))]
