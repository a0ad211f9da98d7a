"""The CLI on a ``file://`` directory, opened by the engine's factory (``open_backend``).

Until the CLI and the engine shared :func:`s3kv.storage.open_backend`, every command died on
``endpoint_url = file://...`` with a raw ``ValueError: Invalid endpoint`` from botocore.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from cli_support import DAY, Bucket, Clock, invoke, parse_json

from s3kv.cli.context import Runtime
from s3kv.config import S3KVConfig
from s3kv.storage import FileBackend, open_backend


@pytest.fixture
def bucket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    monkeypatch.setenv("TLLM_S3KV_BLOOM_CAPACITY", "10000")  # small snapshots: fast tests
    for name in ("TLLM_S3KV_BUCKET", "AWS_ACCESS_KEY_ID", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)  # a directory needs neither bucket nor keys
    root = tmp_path / "bucket"
    root.mkdir()
    b = Bucket(FileBackend(root), f"file://{root}", bucket="")
    b.write_identity()
    return b


def args(bucket: Bucket) -> list[str]:
    """Connection flags without ``--bucket``: a ``file://`` endpoint needs none."""
    return ["--prefix", bucket.prefix, "--endpoint-url", bucket.endpoint]


def test_engine_and_cli_open_the_same_backend(bucket: Bucket) -> None:
    backend = open_backend(S3KVConfig(endpoint_url=bucket.endpoint))
    assert isinstance(backend, FileBackend)
    assert backend.description == bucket.backend.description


def test_stats_and_prune_on_a_directory(bucket: Bucket) -> None:
    t0 = time.time()
    used, stale = bucket.chain(range(8)), bucket.chain(range(100, 112))
    bucket.write_chain(used, Clock(t0 - 20 * DAY))
    bucket.write_chain(stale, Clock(t0 - 20 * DAY), seed=10)
    bucket.record(Clock(t0 + 5 * DAY), hits=[used[-1]])
    now = Runtime(clock=Clock(t0 + 8 * DAY))  # file mtimes are t0: eight days old by then

    # stats finds the fingerprint (a directory listing) and its five blocks.
    stats = invoke(["stats", "--json", *args(bucket)], runtime=now)
    assert stats.exit_code == 0, stats.output
    (fp,) = parse_json(stats)["fingerprints"]
    assert (fp["fingerprint"], fp["objects"]) == (bucket.fingerprint, 5)

    # prune deletes the stale chain and keeps the one hit three days ago.
    pruned = invoke(["prune", "--older-than", "7d", "--yes", "--json", *args(bucket)], runtime=now)
    assert pruned.exit_code == 0, pruned.output
    assert parse_json(pruned)["deleted"]["objects"] == 3
    assert bucket.block_keys() == {bucket.object_key(k) for k in used}

    # verify reads every remaining block back and finds them intact.
    verified = invoke(["verify", "--all", "--json", *args(bucket)])
    assert verified.exit_code == 0, verified.output


def test_doctor_on_a_directory(bucket: Bucket) -> None:
    result = invoke(["doctor", "--json", *args(bucket)])
    assert result.exit_code == 0, result.output
    checks = {c["name"]: c for c in parse_json(result)["checks"]}
    assert checks["credentials"]["status"] == "skip"  # a directory needs none
    assert [checks[n]["status"] for n in ("bucket", "list", "put", "get", "delete")] == ["ok"] * 5
    assert checks["conditional write"]["status"] == "ok"  # link() is create-if-absent
    assert not list(bucket.backend.list(f"{bucket.prefix}/.s3kv-probe/"))  # scratch removed


def test_a_missing_directory_is_one_error_line(tmp_path: Path) -> None:
    result = invoke(["stats", "--endpoint-url", f"file://{tmp_path}/absent"])
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().startswith("Error: ")
    assert "does not exist" in result.stderr
    assert "Traceback" not in result.output


def test_stats_counts_manifest_snapshots_beside_blocks(bucket: Bucket) -> None:
    """Old ``bloom.bin`` generations are stored bytes too: counted, priced, shown by kind."""
    bucket.write_chain(bucket.chain(range(8)), Clock(time.time()))
    snapshots = f"{bucket.prefix}/{bucket.fingerprint}/manifest/snapshots/"
    for generation in range(6):
        bucket.backend.put(f"{snapshots}{generation:010d}/bloom.bin", bytes(50_000))
    result = invoke(["stats", "--json", *args(bucket)])
    assert result.exit_code == 0, result.output
    doc = parse_json(result)
    (fp,) = doc["fingerprints"]
    assert fp["kinds"]["snapshots"]["objects"] == 6
    assert fp["kinds"]["snapshots"]["bytes"] == 300_000
    assert fp["kinds"]["blocks"]["objects"] == fp["objects"] == 2
    assert fp["kinds"]["segments"]["objects"] == 1
    assert fp["kinds"]["identity"]["objects"] == 1
    assert fp["total_bytes"] == sum(k["bytes"] for k in fp["kinds"].values())
    assert fp["total_bytes"] > 300_000 > fp["stored_bytes"]
    assert fp["snapshot_generations"] == 6
    snapshot_usd = 300_000 / 1024**3 * doc["prices"]["storage_per_gib_month"]
    assert fp["kinds"]["snapshots"]["storage_usd_month"] == pytest.approx(snapshot_usd)
    assert doc["kinds"]["snapshots"]["bytes"] == 300_000  # all fingerprints
    assert doc["total_bytes"] == fp["total_bytes"]
    assert doc["storage_usd_month"] == pytest.approx(fp["storage_usd_month"])
    assert fp["storage_usd_month"] > snapshot_usd  # every kind, not only the blocks

    human = invoke(["stats", *args(bucket)])
    assert human.exit_code == 0, human.output
    assert "stored by kind" in human.stdout
    (row,) = [line for line in human.stdout.splitlines() if " snapshots " in line]
    assert "293.0 KiB" in row  # 300,000 bytes
    assert "6 manifest snapshot generations" in human.stdout
