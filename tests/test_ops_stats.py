"""``s3kv.ops.stats``: figures of an in-memory bucket at an injected time, and price tables."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_support import DAY, PREFIX, Bucket, Clock

from s3kv.errors import ConfigError
from s3kv.ops.scope import resolve_scope
from s3kv.ops.stats import PriceTable, collect_stats
from s3kv.storage import MemoryBackend

T0 = 1_700_000_000.0


@pytest.fixture
def clock() -> Clock:
    return Clock(T0 - 10 * DAY)


@pytest.fixture
def bucket(clock: Clock) -> Bucket:
    b = Bucket(MemoryBackend(clock=clock), "memory://", "test")
    b.write_identity()
    return b


def test_counts_sizes_usage_and_cost(bucket: Bucket, clock: Clock) -> None:
    chain = bucket.chain(range(12))
    bucket.write_chain(chain, clock)
    clock.now = T0 - 2 * 3600
    bucket.record(clock, hits=[chain[0], chain[0]], pins=[chain[1]])
    clock.now = T0
    bucket.backend.put(f"{PREFIX}/{bucket.fingerprint}/blocks/zz/stray", b"abc")
    stored = sum(
        info.size
        for info in bucket.backend.list(f"{PREFIX}/{bucket.fingerprint}/blocks/")
        if "stray" not in info.key
    )

    scope = resolve_scope(bucket.backend, PREFIX)
    report = collect_stats(bucket.backend, scope, prefix=PREFIX, clock=clock)
    (fp,) = report.fingerprints
    assert (fp.objects, fp.foreign, fp.stored_bytes) == (3, 1, stored)
    assert (fp.raw_bytes, fp.raw_source) == (3 * 256, "identity")
    assert fp.ratio == pytest.approx(3 * 256 / stored)
    assert (fp.hits, fp.pins, fp.manifest_keys, fp.unmanifested) == (2, 1, 3, 0)
    assert fp.age == {"<1h": 0, "<1d": 0, "<7d": 0, "<30d": 3, ">=30d": 0}
    assert fp.last_use == {"<1h": 0, "<1d": 1, "<7d": 0, "<30d": 2, ">=30d": 0}
    assert report.now == T0
    assert report.usd_month == pytest.approx(fp.storage_usd_month + fp.requests_usd_month)
    assert fp.requests_usd_month > 0  # three PUTs within the month


def test_raw_bytes_are_sampled_without_an_identity(bucket: Bucket, clock: Clock) -> None:
    bucket.write_chain(bucket.chain(range(8)), clock)
    bucket.backend.delete_many([f"{PREFIX}/{bucket.fingerprint}/identity.json"])
    scope = resolve_scope(bucket.backend, PREFIX)
    (fp,) = collect_stats(bucket.backend, scope, prefix=PREFIX, clock=clock).fingerprints
    assert (fp.raw_bytes, fp.raw_source) == (2 * 256, "sampled 2 headers")
    (blind,) = collect_stats(
        bucket.backend, scope, prefix=PREFIX, sample=0, clock=clock
    ).fingerprints
    assert (blind.raw_bytes, blind.raw_source) == (None, "unknown")


def test_price_tables_are_read_and_checked(tmp_path: Path) -> None:
    good = tmp_path / "p.toml"
    good.write_text('name = "cheap"\nstorage_per_gib_month = 0.01\n')
    table = PriceTable.from_file(good)
    assert (table.name, table.storage_per_gib_month, table.put_per_1000) == ("cheap", 0.01, 0.005)
    bad = tmp_path / "p.json"
    bad.write_text('{"storage_per_gb": 1}')
    with pytest.raises(ConfigError, match="unknown field 'storage_per_gb'"):
        PriceTable.from_file(bad)
    bad.write_text('{"get_per_1000": -1}')
    with pytest.raises(ConfigError, match="get_per_1000 has a bad value"):
        PriceTable.from_file(bad)
