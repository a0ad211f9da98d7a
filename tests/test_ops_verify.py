"""``s3kv.ops.verify.verify_objects`` on an in-memory bucket with planted bad objects."""

from __future__ import annotations

import pytest
from cli_support import PREFIX, Bucket, Clock

from s3kv.manifest import load_usage
from s3kv.ops.scope import resolve_scope
from s3kv.ops.verify import verify_objects
from s3kv.storage import MemoryBackend

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
