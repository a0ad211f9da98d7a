"""``s3kv.ops.scope`` on an in-memory bucket: which fingerprints and objects a command sees."""

from __future__ import annotations

import pytest
from cli_support import PREFIX, Bucket, identity

from s3kv.errors import ConfigError
from s3kv.ops.scope import list_blocks, list_fingerprints, read_identity, resolve_scope
from s3kv.storage import MemoryBackend


@pytest.fixture
def bucket() -> Bucket:
    b = Bucket(MemoryBackend(), "memory://", "test")
    b.write_identity()
    return b


def test_only_fingerprint_directories_are_in_scope(bucket: Bucket) -> None:
    bucket.backend.put(f"{PREFIX}/.s3kv-probe/scratch", b"x")
    bucket.backend.put(f"{PREFIX}/notes/readme.txt", b"x")
    bucket.backend.put(f"{PREFIX}/{'AB' * 16}/identity.json", b"{}")  # upper case: not ours
    assert list_fingerprints(bucket.backend, PREFIX) == [bucket.fingerprint]


def test_model_and_fingerprint_narrow_the_scope(bucket: Bucket) -> None:
    other = bucket.write_identity(identity("org/other-model"))
    both = resolve_scope(bucket.backend, PREFIX)
    assert sorted(fp.fingerprint for fp in both) == sorted([bucket.fingerprint, other])

    by_model = resolve_scope(bucket.backend, PREFIX, model="org/*")
    assert [fp.fingerprint for fp in by_model] == [other]
    assert by_model[0].model == "org/other-model"
    by_fp = resolve_scope(bucket.backend, PREFIX, fingerprints=[bucket.fingerprint])
    assert [fp.fingerprint for fp in by_fp] == [bucket.fingerprint]


def test_scope_errors_name_the_flag_and_what_exists(bucket: Bucket) -> None:
    with pytest.raises(ConfigError, match="--fingerprint: 'xyz' is not 32"):
        resolve_scope(bucket.backend, PREFIX, fingerprints=["xyz"])
    with pytest.raises(ConfigError, match=f"present: {bucket.fingerprint}"):
        resolve_scope(bucket.backend, PREFIX, fingerprints=["0" * 32])
    with pytest.raises(ConfigError, match="known models: test/model"):
        resolve_scope(bucket.backend, PREFIX, model="nope")


def test_identity_gives_geometry_and_bad_json_is_ignored(bucket: Bucket) -> None:
    (fp,) = resolve_scope(bucket.backend, PREFIX)
    assert fp.tokens_per_block == 4
    assert fp.raw_block_bytes == 2 * 2 * 32 * 2  # layers x kv x elems x bf16
    bucket.backend.put(f"{PREFIX}/{bucket.fingerprint}/identity.json", b"not json")
    assert read_identity(bucket.backend, PREFIX, bucket.fingerprint) is None


def test_list_blocks_marks_foreign_keys(bucket: Bucket) -> None:
    (key,) = bucket.chain(range(4))
    size = bucket.put_block(key)
    stray = f"{PREFIX}/{bucket.fingerprint}/blocks/zz/not-a-block"
    bucket.backend.put(stray, b"abc")
    found = {o.key: o for o in list_blocks(bucket.backend, PREFIX, bucket.fingerprint)}
    assert found[bucket.object_key(key)].block == key
    assert found[bucket.object_key(key)].size == size
    assert found[stray].block is None
