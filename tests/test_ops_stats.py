"""``s3kv.ops.stats``: figures of an in-memory bucket at an injected time, and price tables."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_support import DAY, PREFIX, Bucket, Clock

from s3kv.errors import ConfigError
from s3kv.ops.scope import resolve_scope
from s3kv.ops.stats import KINDS, PriceTable, classify, collect_stats
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


def test_every_object_under_a_fingerprint_is_counted_by_kind_with_its_cost(
    bucket: Bucket, clock: Clock
) -> None:
    """The issue's bucket: six format-1 ``bloom.bin`` generations dwarf the blocks."""
    chain = bucket.chain(range(12))
    bucket.write_chain(chain, clock)  # 3 blocks and one manifest segment
    fp = bucket.fingerprint
    manifest = f"{PREFIX}/{fp}/manifest/"
    planted = {
        # format 1: CURRENT and six generations of bloom.bin + usage.bin
        f"{manifest}CURRENT": ("log", 100),
        **{f"{manifest}snapshots/{g:010d}/bloom.bin": ("snapshots", 10_000) for g in range(6)},
        **{f"{manifest}snapshots/{g:010d}/usage.bin": ("snapshots", 500) for g in range(6)},
        # format 2: log entries, LATEST, a delta, a sharded snapshot
        f"{manifest}log/{1:020d}.json": ("log", 300),
        f"{manifest}log/{2:020d}.json": ("log", 310),
        f"{manifest}LATEST": ("log", 20),
        f"{manifest}deltas/{2:020d}-abcd.delta": ("deltas", 700),
        f"{manifest}snapshots/{2:020d}-abcd/filter-0000.bin": ("snapshots", 4000),
        f"{manifest}snapshots/{2:020d}-abcd/usage-0000.bin": ("snapshots", 900),
        # not s3kv's: a stray key under blocks/ and an unknown manifest object
        f"{PREFIX}/{fp}/blocks/zz/stray": ("other", 3),
        f"{manifest}notes.txt": ("other", 7),
    }
    for key, (_, size) in planted.items():
        bucket.backend.put(key, b"x" * size)
    listed = list(bucket.backend.list(f"{PREFIX}/{fp}/"))
    expected = dict.fromkeys(KINDS, (0, 0))
    for info in listed:
        rel = info.key[len(f"{PREFIX}/{fp}/") :]
        kind = planted[info.key][0] if info.key in planted else classify(rel)
        objects, size = expected[kind]
        expected[kind] = (objects + 1, size + info.size)
    assert expected["blocks"][0] == 3
    assert expected["segments"][0] == 1
    assert expected["identity"][0] == 1

    per_byte = PriceTable(name="1 USD per byte-month", storage_per_gib_month=float(1024**3))
    report = collect_stats(
        bucket.backend, resolve_scope(bucket.backend, PREFIX), prefix=PREFIX, prices=per_byte,
        clock=clock,
    )  # fmt: skip
    (stats,) = report.fingerprints
    got = {kind: (k.objects, k.bytes) for kind, k in stats.kinds.items()}
    assert got == expected
    assert list(stats.kinds) == list(KINDS)
    assert stats.kinds["snapshots"].bytes == 6 * 10_500 + 4900
    assert stats.kinds["snapshots"].bytes > 10 * stats.stored_bytes  # what the old stats hid
    assert stats.snapshot_generations == 7
    assert (stats.total_objects, stats.total_bytes) == (len(listed), sum(i.size for i in listed))
    for k in stats.kinds.values():
        assert k.storage_usd_month == pytest.approx(k.bytes)  # one USD per byte
    assert stats.storage_usd_month == pytest.approx(stats.total_bytes)
    # The block figures keep their meaning; the stray block-directory key is "other".
    assert (stats.objects, stats.foreign) == (3, 1)
    assert stats.stored_bytes == expected["blocks"][1]
    # Report totals add up over kinds and fingerprints.
    assert report.total_bytes == stats.total_bytes
    assert report.kinds["snapshots"] == stats.kinds["snapshots"]
    assert report.usd_month == pytest.approx(report.storage_usd_month + stats.requests_usd_month)


def test_keys_are_classified_by_the_manifest_layout() -> None:
    cases = {
        "blocks/ab/ab01": "blocks",
        "identity.json": "identity",
        "manifest/segments/1700000000000-a-000001.seg": "segments",
        "manifest/log/00000000000000000007.json": "log",
        "manifest/LATEST": "log",
        "manifest/CURRENT": "log",
        "manifest/deltas/00000000000000000007-ff.delta": "deltas",
        "manifest/snapshots/0000000003/bloom.bin": "snapshots",
        "manifest/snapshots/00000000000000000007-ff/filter-0000.bin": "snapshots",
        "manifest/LATEST.bak": "other",
        "manifest/segmentsX": "other",
        "notes.txt": "other",
    }
    assert {key: classify(key) for key in cases} == cases
