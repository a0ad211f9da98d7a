"""``s3kv stats``, ``verify`` and ``compact`` through the CLI runner, against moto."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from cli_support import DAY, Bucket, Clock, assert_one_error_line, identity, invoke, parse_json

from s3kv.cli.context import Runtime
from s3kv.manifest import ManifestIO, ManifestLog, load_usage
from s3kv.storage import S3Backend

RAW_BLOCK = 2 * 2 * 32 * 2  # layers * kv_factor * block_elems * bf16 bytes


@pytest.fixture
def bucket(moto_backend: S3Backend, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    monkeypatch.setenv("TLLM_S3KV_BLOOM_CAPACITY", "10000")  # small snapshots: fast tests
    b = Bucket(moto_backend, str(moto_backend.client.meta.endpoint_url), moto_backend.bucket)
    b.write_identity()
    return b


def test_stats_reports_sizes_histograms_hits_pins_and_cost(bucket: Bucket, tmp_path: Path) -> None:
    t0 = time.time()
    chain = bucket.chain(range(12))
    bucket.write_chain(chain, Clock(t0 - 10 * DAY))
    bucket.record(Clock(t0 - 2 * DAY), hits=chain[:2], pins=[chain[0]])

    result = invoke(["stats", "--json", *bucket.args()], runtime=Runtime(clock=Clock(t0)))
    assert result.exit_code == 0, result.output
    doc = parse_json(result)
    (fp,) = doc["fingerprints"]
    assert fp["fingerprint"] == bucket.fingerprint
    assert fp["model"] == "test/model"
    assert fp["objects"] == 3
    assert fp["raw_bytes"] == 3 * RAW_BLOCK
    assert fp["raw_source"] == "identity"
    assert fp["ratio"] == pytest.approx(3 * RAW_BLOCK / fp["stored_bytes"])
    assert (fp["hits"], fp["pins"]) == (2, 1)
    assert fp["age"]["<30d"] == 3  # first written 10 days ago (the manifest, not LastModified)
    assert fp["last_use"]["<1h"] == 3  # LastModified is now (real time)
    assert fp["storage_usd_month"] > 0
    assert doc["prices"]["name"] == "AWS S3 Standard, us-east-1"

    # A custom price table, and the human table.
    prices = tmp_path / "prices.toml"
    prices.write_text('name = "free"\nstorage_per_gib_month = 0\nput_per_1000 = 0\n'
                      "get_per_1000 = 0\n")  # fmt: skip
    free = parse_json(invoke(["stats", "--json", "--prices", str(prices), *bucket.args()]))
    assert free["usd_month"] == 0
    human = invoke(["stats", *bucket.args()])
    assert bucket.fingerprint in human.stdout
    assert "USD/month" in human.stdout
    prices.write_text("storage_per_gib_month = -1\n")
    assert_one_error_line(invoke(["stats", "--prices", str(prices), *bucket.args()]),
                          "--prices", "storage_per_gib_month", code=2)  # fmt: skip


def test_stats_samples_headers_without_identity(bucket: Bucket) -> None:
    unknown = "0123456789abcdef0123456789abcdef"
    for i, key in enumerate(bucket.chain(range(8))):
        bucket.put_block(key, seed=i, fingerprint=unknown)
    doc = parse_json(invoke(["stats", "--json", "--fingerprint", unknown, *bucket.args()]))
    (fp,) = doc["fingerprints"]
    assert fp["model"] is None
    assert fp["raw_source"] == "sampled 2 headers"
    assert fp["raw_bytes"] == pytest.approx(2 * RAW_BLOCK, rel=0.05)
    assert fp["unmanifested"] == 2


def test_verify_finds_planted_corruption_and_deletes_it(bucket: Bucket) -> None:
    chain = bucket.chain(range(20))  # 5 blocks
    bucket.write_chain(chain, Clock(time.time()))
    good, flipped, foreign, moved, _ = (bucket.object_key(k) for k in chain)
    # Plant: a flipped payload byte, a non-s3kv object, a valid object under another key.
    blob = bytearray(bucket.backend.get(flipped) or b"")
    blob[-5] ^= 0x40
    bucket.backend.put(flipped, bytes(blob))
    bucket.backend.put(foreign, b"<html>not a KV block</html>")
    bucket.backend.put(moved, bucket.backend.get(good) or b"")
    junk = f"{bucket.prefix}/{bucket.fingerprint}/blocks/zz/junk"
    bucket.backend.put(junk, b"a file someone dropped here")

    result = invoke(["verify", "--all", "--json", *bucket.args()])
    assert result.exit_code == 1, result.output  # problems remain in the bucket
    doc = parse_json(result)
    assert (doc["checked"], doc["ok"], doc["corrupt"], doc["foreign"]) == (6, 2, 1, 3)
    kinds = {f["key"]: (f["verdict"], f["kind"]) for f in doc["findings"]}
    assert kinds == {
        flipped: ("corrupt", "checksum"),
        foreign: ("foreign", "bad_magic"),
        moved: ("foreign", "key_mismatch"),
        junk: ("foreign", "not_a_block_key"),
    }

    # A sample of 2 checks 2; deleting removes the bad objects and their manifest keys.
    assert parse_json(invoke(["verify", "--sample", "2", "--json", *bucket.args()]))[
        "checked"] == 2  # fmt: skip
    # The junk key is not an s3kv block key: reported, never deleted (not ours); exit 1 says so.
    cleaned = invoke(["verify", "--all", "--delete-corrupt", "--yes", "--json", *bucket.args()])
    assert cleaned.exit_code == 1, cleaned.output
    assert "not s3kv block keys" in cleaned.stderr
    deleted = {f["key"] for f in parse_json(cleaned)["findings"] if f["deleted"]}
    assert deleted == {flipped, foreign, moved}
    assert bucket.block_keys() == {bucket.object_key(chain[0]), bucket.object_key(chain[4]), junk}
    usage = load_usage(bucket.backend, bucket.prefix, bucket.fingerprint)
    assert chain[1] not in usage
    assert chain[0] in usage
    bucket.backend.delete_many([junk])
    assert invoke(["verify", "--all", *bucket.args()]).exit_code == 0


def test_compact_and_full_compact_from_a_listing(bucket: Bucket) -> None:
    chain = bucket.chain(range(8))
    bucket.write_chain(chain, Clock(time.time()))
    stray = bucket.chain(range(50, 54))[0]
    bucket.put_block(stray)  # an object whose manifest record was lost

    doc = parse_json(invoke(["compact", "--json", *bucket.args()]))
    (fp,) = doc["fingerprints"]
    assert (fp["generation"], fp["keys"], fp["segments_folded"]) == (1, 2, 1)
    assert stray not in load_usage(bucket.backend, bucket.prefix, bucket.fingerprint)

    full = parse_json(invoke(["compact", "--full", "--json", *bucket.args()]))
    assert (full["fingerprints"][0]["generation"], full["fingerprints"][0]["keys"]) == (2, 3)
    assert stray in load_usage(bucket.backend, bucket.prefix, bucket.fingerprint)
    human = invoke(["compact", *bucket.args()])
    assert human.exit_code == 0
    assert bucket.fingerprint in human.stdout


def test_unreadable_snapshot_asks_for_a_full_compaction(bucket: Bucket) -> None:
    bucket.write_chain(bucket.chain(range(4)), Clock(time.time()))
    assert invoke(["compact", *bucket.args()]).exit_code == 0
    io = ManifestIO(bucket.backend, bucket.prefix, bucket.fingerprint)
    snapshot = ManifestLog(io).latest().snapshot  # type: ignore[union-attr]
    assert snapshot is not None
    io.put(snapshot.usage_path(0), b"not a usage table")
    for command in (["compact"], ["prune", "--older-than", "1d", "--dry-run"], ["pins"]):
        assert_one_error_line(invoke([*command, *bucket.args()]), "--full", code=1)
    assert invoke(["compact", "--full", *bucket.args()]).exit_code == 0
    rebuilt = ManifestLog(io).latest().snapshot  # type: ignore[union-attr]
    assert rebuilt is not None
    assert rebuilt.generation > snapshot.generation


def test_model_scope_lists_known_models(bucket: Bucket) -> None:
    other = identity("other/model")
    fp = bucket.write_identity(other)
    bucket.put_block(bucket.chain(range(4))[0], fingerprint=fp)
    bucket.put_block(bucket.chain(range(4))[0])
    doc = parse_json(invoke(["stats", "--json", "--model", "other/*", *bucket.args()]))
    assert [f["fingerprint"] for f in doc["fingerprints"]] == [fp]
    all_fps = parse_json(invoke(["stats", "--json", *bucket.args()]))["fingerprints"]
    assert {f["model"] for f in all_fps} == {"test/model", "other/model"}
