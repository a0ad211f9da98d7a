"""``s3kv.ops.verify.verify_objects`` on an in-memory bucket with planted bad objects."""

from __future__ import annotations

import random

import pytest
from cli_support import PREFIX, Bucket, Clock

from s3kv.auth import Keyring, new_key_line, parse_keys, seal
from s3kv.manifest import load_usage
from s3kv.metrics import Metrics
from s3kv.ops.scope import resolve_scope
from s3kv.ops.verify import delete_findings, verify_objects
from s3kv.storage import Backend, DelegatingBackend, InstrumentedBackend, MemoryBackend

T0 = 1_700_000_000.0


@pytest.fixture
def bucket() -> Bucket:
    b = Bucket(MemoryBackend(), "memory://", "test")
    b.write_identity()
    return b


def _plant(bucket: Bucket) -> dict[str, str]:
    """Four blocks (one corrupted), a block copied under another key, a stray key."""
    chain = bucket.chain(range(16))
    bucket.write_chain(chain, Clock(T0))
    corrupt, copied_from = bucket.object_key(chain[1]), bucket.object_key(chain[2])
    blob = bytearray(bucket.backend.get(corrupt) or b"")
    blob[-1] ^= 0xFF
    bucket.backend.put(corrupt, bytes(blob))
    (other,) = bucket.chain(range(200, 204))
    copy = bucket.object_key(other)
    bucket.backend.put(copy, bucket.backend.get(copied_from) or b"")
    stray = f"{PREFIX}/{bucket.fingerprint}/blocks/zz/stray"
    bucket.backend.put(stray, b"abc")
    return {"corrupt": corrupt, "copy": copy, "stray": stray}


def test_verdicts(bucket: Bucket) -> None:
    planted = _plant(bucket)
    scope = resolve_scope(bucket.backend, PREFIX)
    report = verify_objects(bucket.backend, scope, prefix=PREFIX, sample=None, threads=2)
    assert (report.listed, report.checked, report.ok, report.gone) == (6, 6, 3, 0)
    verdicts = {f.key: (f.verdict, f.kind) for f in report.findings}
    assert verdicts[planted["corrupt"]][0] == "corrupt"
    assert verdicts[planted["copy"]] == ("foreign", "key_mismatch")
    assert verdicts[planted["stray"]] == ("foreign", "not_a_block_key")
    assert report.remaining == 3
    assert all(bucket.backend.head(key) is not None for key in planted.values())


def test_sample_is_seeded(bucket: Bucket) -> None:
    _plant(bucket)
    scope = resolve_scope(bucket.backend, PREFIX)
    first = verify_objects(bucket.backend, scope, prefix=PREFIX, sample=3, seed=7)
    again = verify_objects(bucket.backend, scope, prefix=PREFIX, sample=3, seed=7)
    assert (first.listed, first.checked) == (6, 3)
    assert first == again


def test_delete_removes_bad_objects_and_their_manifest_keys(bucket: Bucket) -> None:
    planted = _plant(bucket)
    scope = resolve_scope(bucket.backend, PREFIX)
    report = verify_objects(
        bucket.backend,
        scope,
        prefix=PREFIX,
        sample=None,
        delete=True,
        fpr=0.01,
        clock=Clock(T0 + 1),
    )
    # The stray key is not an s3kv block key: reported, never deleted (it is not ours).
    assert report.remaining == 1
    assert {f.key for f in report.findings if f.deleted} == {planted["corrupt"], planted["copy"]}
    assert (report.delete_failures, report.manifest_errors) == ((), ())
    assert bucket.backend.head(planted["corrupt"]) is None
    assert bucket.backend.head(planted["copy"]) is None
    assert bucket.backend.head(planted["stray"]) is not None
    corrupt_key = bucket.chain(range(16))[1]
    assert load_usage(bucket.backend, PREFIX, bucket.fingerprint).row(corrupt_key) is None
    clean = verify_objects(bucket.backend, scope, prefix=PREFIX, sample=None)
    assert (clean.checked, clean.ok) == (4, 3)
    assert [f.key for f in clean.findings] == [planted["stray"]]


# --- --delete-corrupt confirms with a second read (issue 12, item 2) ---------------------


class FlakyBlocks(DelegatingBackend):
    """Every second GET of a block object comes back with one bit flipped in its payload,
    at a random place, as corruption on the way does (a bad NIC, proxy or cable)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.gets = 0
        self._rng = random.Random(12)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        data = self.inner.get(key, max_bytes=max_bytes)
        if data is None or "/blocks/" not in key:
            return data
        self.gets += 1
        if self.gets % 2:
            return data
        blob = bytearray(data)
        at = self._rng.randrange(len(blob) // 2, len(blob))  # the payload: a checksum error
        blob[at] ^= 1 << self._rng.randrange(8)
        return bytes(blob)


def _blocks(bucket: Bucket, n: int) -> list[str]:
    """``n`` intact blocks; their object keys in listing order."""
    bucket.write_chain(bucket.chain(range(4 * n)), Clock(T0))
    return sorted(bucket.block_keys())


def test_delete_keeps_intact_objects_whose_get_was_corrupted_on_the_way(bucket: Bucket) -> None:
    keys = _blocks(bucket, 8)
    flaky = FlakyBlocks(bucket.backend)
    scope = resolve_scope(bucket.backend, PREFIX)
    report = verify_objects(
        flaky, scope, prefix=PREFIX, sample=None, delete=True, threads=1, clock=Clock(T0 + 1)
    )
    # Four GETs of eight came back corrupt; read again, each one verified or read other bytes.
    assert [f.verdict for f in report.findings] == ["transient"] * 4
    assert all("kept: read again" in f.detail for f in report.findings)
    assert not any(f.deleted for f in report.findings)
    assert report.remaining == 0
    assert bucket.block_keys() == set(keys)


def test_delete_removes_a_truly_corrupt_object_among_flaky_reads(bucket: Bucket) -> None:
    keys = _blocks(bucket, 9)
    corrupt = keys[2]  # read 3rd (a clean GET), confirmed by the 11th (clean too; see below)
    blob = bytearray(bucket.backend.get(corrupt) or b"")
    blob[-1] ^= 0xFF
    bucket.backend.put(corrupt, bytes(blob))
    flaky = FlakyBlocks(bucket.backend)
    scope = resolve_scope(bucket.backend, PREFIX)
    report = verify_objects(
        flaky, scope, prefix=PREFIX, sample=None, delete=True, threads=1, clock=Clock(T0 + 1)
    )
    # Findings in key order: keys 2, 3 (the corrupt one), 4, 6, 8; their second reads are
    # GETs 10 (flipped), 11 (clean: the same corrupt bytes again), 12, 13 (clean), 14.
    verdicts = {f.key: (f.verdict, f.deleted) for f in report.findings}
    assert verdicts.pop(corrupt) == ("corrupt", True)
    assert set(verdicts.values()) == {("transient", False)}
    assert len(verdicts) == 4
    assert (report.remaining, report.manifest_errors) == (0, ())
    assert bucket.block_keys() == set(keys) - {corrupt}


def test_delete_keeps_an_object_that_changed_between_the_reads(bucket: Bucket) -> None:
    (key,) = _blocks(bucket, 1)
    blob = bytearray(bucket.backend.get(key) or b"")
    blob[-1] ^= 0xFF
    bucket.backend.put(key, bytes(blob))
    scope = resolve_scope(bucket.backend, PREFIX)
    report = verify_objects(bucket.backend, scope, prefix=PREFIX, sample=None)
    assert [f.verdict for f in report.findings] == ["corrupt"]

    class Rewritten(DelegatingBackend):
        def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
            data = self.inner.get(key, max_bytes=max_bytes)
            self.inner.put(key, data or b"")  # a writer PUTs the key again meanwhile
            return data

    done = delete_findings(Rewritten(bucket.backend), report, scope, prefix=PREFIX)
    (finding,) = done.findings
    assert (finding.verdict, finding.deleted) == ("transient", False)
    assert "changed between the reads" in finding.detail
    assert bucket.backend.head(key) is not None


def test_an_object_longer_than_any_block_is_corrupt_and_deleted(bucket: Bucket) -> None:
    (key,) = _blocks(bucket, 1)
    bucket.backend.put(key, b"\0" * 4096)  # junk: a block of this model is 256 raw bytes
    metrics = Metrics()
    counted = InstrumentedBackend(bucket.backend, metrics)
    scope = resolve_scope(bucket.backend, PREFIX)
    report = verify_objects(
        counted, scope, prefix=PREFIX, sample=None, delete=True, clock=Clock(T0 + 1)
    )
    (finding,) = report.findings
    assert (finding.verdict, finding.kind, finding.deleted) == ("corrupt", "too_large", True)
    assert finding.size == 4096
    # Refused from its length, twice: the first read and the one confirming it.
    assert metrics.value("request_errors", op="get", kind="too_large") == 2
    assert bucket.backend.head(key) is None


# --- sealed blocks (auth_keys) -----------------------------------------------------------


def _seal_all(bucket: Bucket, ring: Keyring) -> list[str]:
    keys = _blocks(bucket, 4)
    for key in keys:
        bucket.backend.put(key, seal(bucket.backend.get(key) or b"", object_key=key, keyring=ring))
    return keys


def test_sealed_blocks_are_never_deleted_without_the_keys(bucket: Bucket) -> None:
    keys = _seal_all(bucket, parse_keys(new_key_line("k1"), source="test"))
    scope = resolve_scope(bucket.backend, PREFIX)
    report = verify_objects(bucket.backend, scope, prefix=PREFIX, sample=None, delete=True)
    assert {(f.verdict, f.kind, f.deleted) for f in report.findings} == {
        ("unsupported", "sealed", False)
    }
    assert report.remaining == 0
    assert bucket.block_keys() == set(keys)


def test_with_the_keys_a_flipped_bit_is_transient_and_a_planted_block_deleted(
    bucket: Bucket,
) -> None:
    ring = parse_keys(new_key_line("k1"), source="test")
    keys = _seal_all(bucket, ring)
    scope = resolve_scope(bucket.backend, PREFIX)
    # A bit flipped on the way fails the seal (kind "forged") once; read again, it opens.
    flaky = FlakyBlocks(bucket.backend)
    report = verify_objects(
        flaky, scope, prefix=PREFIX, sample=None, delete=True, keyring=ring, threads=1
    )
    assert [(f.kind, f.verdict, f.deleted) for f in report.findings] == [
        ("forged", "transient", False)
    ] * 2
    # An unsealed block where sealed ones are required (a hostile writer's) is deleted.
    (planted_hash,) = bucket.chain(range(100, 104))
    bucket.put_block(planted_hash)
    planted = bucket.object_key(planted_hash)
    report = verify_objects(
        bucket.backend, scope, prefix=PREFIX, sample=None, delete=True, keyring=ring
    )
    assert report.ok == 4
    assert [(f.key, f.verdict, f.kind, f.deleted) for f in report.findings] == [
        (planted, "foreign", "unsigned", True)
    ]
    assert bucket.block_keys() == set(keys)
