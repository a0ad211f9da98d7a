"""The quarantine: a bounded set of keys with a time to live."""

from __future__ import annotations

from s3kv.quarantine import Quarantine


def test_among_answers_for_each_key_what_membership_does() -> None:
    now = [100.0]
    quarantine: Quarantine[str] = Quarantine(capacity=8, ttl=10.0, clock=lambda: now[0])
    assert quarantine.among(["a", "b"]) == set()  # NOTE: empty: nothing asked
    quarantine.add("live")
    now[0] = 105.0
    quarantine.add("fresh")
    now[0] = 110.0  # NOTE: "live" expires exactly now, "fresh" in 5 s
    keys = ["live", "fresh", "absent"]
    assert quarantine.among(keys) == {k for k in keys if k in quarantine} == {"fresh"}
    now[0] = 200.0
    assert quarantine.among(keys) == {k for k in keys if k in quarantine} == set()
