"""``s3kv prune`` through the CLI runner, against moto and a real SeaweedFS server.

Time is injected through ``Runtime(clock=...)``: blocks are "written" 20 days ago by
manifest records with an injected clock, and prune runs "8 days from now", so that object
``LastModified`` (real time) is stale too.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import pytest
from cli_support import DAY, Bucket, Clock, assert_one_error_line, invoke, parse_json

from s3kv.cli.context import Runtime
from s3kv.errors import EndpointError
from s3kv.manifest import load_usage
from s3kv.storage import Backend, DelegatingBackend, DeleteResult, S3Backend


@pytest.fixture(params=["moto", pytest.param("seaweedfs", marks=pytest.mark.seaweedfs)])
def bucket(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    monkeypatch.setenv("TLLM_S3KV_BLOOM_CAPACITY", "10000")  # a 36 KB snapshot, not 36 MB
    fixture = {"moto": "moto_backend", "seaweedfs": "seaweed_backend"}[request.param]
    backend: S3Backend = request.getfixturevalue(fixture)
    if request.param == "seaweedfs":
        server = request.getfixturevalue("seaweedfs")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    return Bucket(backend, str(backend.client.meta.endpoint_url), backend.bucket)


@pytest.fixture
def moto_bucket(moto_backend: S3Backend, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    monkeypatch.setenv("TLLM_S3KV_BLOOM_CAPACITY", "10000")
    return Bucket(moto_backend, str(moto_backend.client.meta.endpoint_url), moto_backend.bucket)


class Scenario:
    """Three chains and a stray block, seeded 20 days before ``t0`` (see each test)."""

    def __init__(self, bucket: Bucket) -> None:
        self.t0 = time.time()
        self.bucket = bucket
        bucket.write_identity()
        self.used = bucket.chain(range(12))  # 3 blocks; the last one hit recently
        self.pinned = bucket.chain(range(100, 108))  # 2 blocks; the last one pinned
        self.stale = bucket.chain(range(200, 212))  # 3 blocks, never used again
        self.stray = bucket.chain(range(300, 304))[0]  # an object the manifest never heard of
        old = Clock(self.t0 - 20 * DAY)
        bucket.write_chain(self.used, old)
        bucket.write_chain(self.pinned, old, seed=10)
        bucket.write_chain(self.stale, old, seed=20)
        bucket.put_block(self.stray, seed=30)
        bucket.record(Clock(self.t0 - 10 * DAY), pins=[self.pinned[-1]])
        bucket.record(Clock(self.t0 + 5 * DAY), hits=[self.used[-1]])
        self.foreign = f"{bucket.prefix}/{bucket.fingerprint}/blocks/zz/not-a-block"
        bucket.backend.put(self.foreign, b"someone else's file")

    @property
    def doomed(self) -> set[str]:
        return {self.bucket.object_key(k) for k in [*self.stale, self.stray]}

    def runtime(self, **kw: object) -> Runtime:
        return Runtime(clock=Clock(self.t0 + 8 * DAY), **kw)  # type: ignore[arg-type]

    def prune(self, *extra: str) -> list[str]:
        return ["prune", "--older-than", "7d", *extra, *self.bucket.args()]


def test_prune_keeps_used_and_pinned_and_removes_stale(bucket: Bucket) -> None:
    s = Scenario(bucket)
    before = bucket.block_keys()

    # A dry run reports the plan and deletes nothing.
    dry = invoke([*s.prune("--dry-run", "--json")], runtime=s.runtime())
    assert dry.exit_code == 0, dry.output
    plan = parse_json(dry)
    assert plan["dry_run"] is True
    assert plan["planned"]["objects"] == 4
    assert bucket.block_keys() == before

    # The real run deletes exactly the stale chain and the stray object.
    run = invoke([*s.prune("--yes", "--json")], runtime=s.runtime())
    assert run.exit_code == 0, run.output
    report = parse_json(run)
    assert report["complete"] is True
    assert report["deleted"]["objects"] == 4
    assert report["deleted"]["bytes"] == plan["planned"]["bytes"]
    kept = report["fingerprints"][0]["kept"]
    assert kept["pinned"]["objects"] == 1  # the pinned block...
    assert kept["recent"]["objects"] == 1  # ...the hit block...
    assert kept["ancestor"]["objects"] == 3  # ...and the prefixes both need
    assert kept["foreign"]["objects"] == 1  # not ours: never deleted
    assert bucket.block_keys() == before - s.doomed

    # The manifest no longer advertises the deleted keys; the kept ones are still there.
    usage = load_usage(bucket.backend, bucket.prefix, bucket.fingerprint)
    assert all(key not in usage for key in s.stale)
    assert all(key in usage for key in [*s.used, *s.pinned])
    assert usage.generation == report["fingerprints"][0]["manifest"]["generation"] == 1

    # Running it again finds nothing to do and changes nothing (idempotent).
    again = invoke([*s.prune("--yes", "--json")], runtime=s.runtime())
    assert parse_json(again)["planned"]["objects"] == 0
    assert load_usage(bucket.backend, bucket.prefix, bucket.fingerprint).generation == 1


def test_human_output_is_a_table(moto_bucket: Bucket) -> None:
    s = Scenario(moto_bucket)
    result = invoke([*s.prune("--dry-run")], runtime=s.runtime())
    assert result.exit_code == 0, result.output
    assert moto_bucket.fingerprint in result.stdout
    assert "would delete 4 objects" in result.stdout
    # At a terminal the same run draws progress on stderr; results stay on stdout.
    at_terminal = invoke([*s.prune("--dry-run")], runtime=s.runtime(interactive=True))
    assert at_terminal.exit_code == 0, at_terminal.output
    assert "would delete 4 objects" in at_terminal.stdout


class FailingDeletes(DelegatingBackend):
    """Delegates to ``inner``; the ``fail_on``-th DeleteObjects call fails as a whole."""

    def __init__(self, inner: Backend, fail_on: int) -> None:
        super().__init__(inner)
        self.fail_on, self.calls = fail_on, 0

    def delete_many(self, keys: Iterable[str]) -> DeleteResult:
        self.calls += 1
        if self.calls == self.fail_on:
            raise EndpointError("cannot reach the endpoint (injected): check the server")
        return self.inner.delete_many(keys)


def test_interrupted_prune_finishes_on_the_next_run(moto_bucket: Bucket) -> None:
    s = Scenario(moto_bucket)

    # Batches of 2 keys; the second DeleteObjects fails: the run stops, says so, exits 1.
    failing = s.runtime(open_backend=lambda cfg: FailingDeletes(S3Backend.from_config(cfg), 2))
    first = invoke([*s.prune("--yes", "--batch-size", "2", "--json")], runtime=failing)
    assert first.exit_code == 1, first.output
    report = parse_json(first)
    assert report["complete"] is False
    assert report["deleted"]["objects"] == 2
    assert report["failed"]["objects"] == 2
    assert "injected" in report["interrupted"]
    assert "re-run" in first.stderr
    left = moto_bucket.block_keys() & s.doomed
    assert len(left) == 2
    # The manifest was not rewritten: it still lists the deleted keys (harmless misses).
    usage = load_usage(moto_bucket.backend, moto_bucket.prefix, moto_bucket.fingerprint)
    assert all(key in usage for key in s.stale)

    # The re-run deletes the rest and drops every stale key from the manifest.
    second = invoke([*s.prune("--yes", "--json")], runtime=s.runtime())
    assert second.exit_code == 0, second.output
    assert parse_json(second)["deleted"]["objects"] == 2
    assert not moto_bucket.block_keys() & s.doomed
    usage = load_usage(moto_bucket.backend, moto_bucket.prefix, moto_bucket.fingerprint)
    assert not any(key in usage for key in s.stale)
    assert all(key in usage for key in [*s.used, *s.pinned])


def test_confirmation_above_the_threshold(moto_bucket: Bucket) -> None:
    s = Scenario(moto_bucket)
    before = moto_bucket.block_keys()

    # No terminal to ask on (CI, cron): refuse with the fix, delete nothing.
    refused = invoke([*s.prune("--confirm-above", "3")], runtime=s.runtime())
    assert_one_error_line(refused, "--yes", "4 objects", code=1)
    assert moto_bucket.block_keys() == before

    # At a terminal, "n" aborts and "y" proceeds.
    no = invoke([*s.prune("--confirm-above", "3")], runtime=s.runtime(interactive=True),
                input="n\n")  # fmt: skip
    assert no.exit_code == 1
    assert no.stderr.strip().endswith("Error: aborted: nothing was deleted")
    assert moto_bucket.block_keys() == before
    yes = invoke([*s.prune("--confirm-above", "3")], runtime=s.runtime(interactive=True),
                 input="y\n")  # fmt: skip
    assert yes.exit_code == 0, yes.output
    assert moto_bucket.block_keys() == before - s.doomed


def test_scope_by_model_and_fingerprint(moto_bucket: Bucket) -> None:
    s = Scenario(moto_bucket)
    other = invoke([*s.prune("--dry-run", "--json", "--model", "other/*")], runtime=s.runtime())
    assert_one_error_line(other, "--model", "test/model", code=2)
    mine = invoke([*s.prune("--dry-run", "--json", "--model", "test/*")], runtime=s.runtime())
    assert parse_json(mine)["planned"]["objects"] == 4
    by_fp = invoke([*s.prune("--dry-run", "--json", "--fingerprint", moto_bucket.fingerprint)],
                   runtime=s.runtime())  # fmt: skip
    assert parse_json(by_fp)["planned"]["objects"] == 4
    bad = invoke([*s.prune("--dry-run", "--fingerprint", "nothex")], runtime=s.runtime())
    assert_one_error_line(bad, "--fingerprint", code=2)


@pytest.mark.parametrize(
    ("args", "needle", "code"),
    [
        (["prune", "--older-than", "7x", "--bucket", "bkt"], "--older-than", 2),
        (["prune", "--older-than", "0s", "--bucket", "bkt"], "--older-than", 2),
        (["prune", "--older-than", "7d", "--bogus"], "--bogus", 2),
        (["prune", "--bucket", "bkt"], "--older-than", 2),
    ],
)
def test_usage_errors_are_one_line(args: list[str], needle: str, code: int) -> None:
    assert_one_error_line(invoke(args), needle, code=code)


def test_missing_bucket_and_wrong_endpoint_are_one_line(
    moto_server: str, aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TLLM_S3KV_BUCKET", raising=False)
    no_bucket = invoke(["prune", "--older-than", "7d", "--endpoint-url", moto_server])
    assert_one_error_line(no_bucket, "no bucket configured", "--bucket", code=2)
    missing = invoke(["prune", "--older-than", "7d", "--yes", "--bucket", "no-such-bucket-x",
                      "--endpoint-url", moto_server])  # fmt: skip
    assert_one_error_line(missing, "no-such-bucket-x", "does not exist", code=1)
    from s3kv.testing.local_s3 import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    wrong = invoke(["stats", "--bucket", "b-x", "--endpoint-url", dead])
    assert_one_error_line(wrong, "cannot reach", dead, code=1)
