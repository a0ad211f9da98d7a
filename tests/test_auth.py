"""Authenticated blocks: forging, replay, rotation, key sources, and the store's reaction.

The attacker throughout can write the bucket but does not hold the secret: the checksums in
a block are public functions (``codec.encode`` is all it takes to make a well-formed block),
the seal is not.
"""

from __future__ import annotations

import base64
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from s3kv import codec
from s3kv.auth import (
    Keyring,
    is_sealed,
    load_keyring,
    new_key_line,
    parse_keys,
    seal,
    sealed_key_id,
    unseal,
)
from s3kv.errors import AuthenticationError, CodecError, ConfigError
from s3kv.keys import chain_hashes
from s3kv.pool import IOPool
from s3kv.staging import NumpyAllocator
from s3kv.storage import Backend, MemoryBackend
from s3kv.store import KVStore
from tests.test_store import SHAPE, blocks, config, identity, open_store, save_chain

KEY_A = "s3kv/fp/blocks/aa/aaaa"
KEY_B = "s3kv/fp/blocks/bb/bbbb"


def keyring(*ids: str, accept_unsigned: bool = False) -> Keyring:
    return parse_keys(
        "\n".join(new_key_line(i) for i in ids), source="test", accept_unsigned=accept_unsigned
    )


def encoded(seed: int, key: str) -> bytes:
    data = np.random.default_rng(seed).integers(0, 1 << 16, size=512, dtype=np.uint16)
    return codec.encode(data, key=key, dtype="bfloat16", shape=(512,))


def test_sealed_block_round_trips_and_hides_its_contents() -> None:
    ring = keyring("k1")
    inner = encoded(1, KEY_A)
    sealed = seal(inner, object_key=KEY_A, keyring=ring)
    assert is_sealed(sealed)
    assert sealed_key_id(sealed) == "k1"
    assert inner[64:96] not in sealed  # encrypted at rest
    assert bytes(unseal(sealed, object_key=KEY_A, keyring=ring)) == inner


def test_a_well_formed_unsealed_block_planted_by_the_attacker_is_refused() -> None:
    forged = encoded(2, KEY_A)  # valid header, checksums and key digest: public functions
    with pytest.raises(AuthenticationError) as err:
        unseal(forged, object_key=KEY_A, keyring=keyring("k1"))
    assert err.value.kind == "unsigned"


def test_a_block_sealed_with_the_attackers_own_key_is_refused() -> None:
    attacker = keyring("k1")  # same id, other secret
    sealed = seal(encoded(3, KEY_A), object_key=KEY_A, keyring=attacker)
    with pytest.raises(AuthenticationError) as err:
        unseal(sealed, object_key=KEY_A, keyring=keyring("k1"))
    assert err.value.kind == "forged"


def test_a_valid_block_replayed_under_another_key_is_refused() -> None:
    ring = keyring("k1")
    sealed = seal(encoded(4, KEY_A), object_key=KEY_A, keyring=ring)
    with pytest.raises(AuthenticationError) as err:
        unseal(sealed, object_key=KEY_B, keyring=ring)
    assert err.value.kind == "forged"


@pytest.mark.parametrize("offset", [4, 7, 12, 30, 200, -1])
def test_any_flipped_byte_is_refused(offset: int) -> None:
    ring = keyring("k1")
    sealed = bytearray(seal(encoded(5, KEY_A), object_key=KEY_A, keyring=ring))
    sealed[offset] ^= 0x40
    with pytest.raises(CodecError):  # AuthenticationError, or TruncatedError for the length
        unseal(bytes(sealed), object_key=KEY_A, keyring=ring)


def test_the_key_id_cannot_be_swapped_to_another_trusted_key() -> None:
    ring = parse_keys(f"{new_key_line('k2')}\n{new_key_line('k1')}", source="test")
    sealed = bytearray(seal(encoded(6, KEY_A), object_key=KEY_A, keyring=ring))
    at = sealed.index(b"k2")
    sealed[at : at + 2] = b"k1"
    with pytest.raises(AuthenticationError) as err:
        unseal(bytes(sealed), object_key=KEY_A, keyring=ring)
    assert err.value.kind == "forged"


def test_rotation_new_key_seals_old_key_still_opens_then_is_retired() -> None:
    old_line, new_line = new_key_line("2026-05"), new_key_line("2026-11")
    before = parse_keys(old_line, source="test")
    during = parse_keys(f"{new_line}\n{old_line}", source="test")  # new first: it seals
    after = parse_keys(new_line, source="test")
    old_block = seal(encoded(7, KEY_A), object_key=KEY_A, keyring=before)
    new_block = seal(encoded(8, KEY_B), object_key=KEY_B, keyring=during)
    assert sealed_key_id(new_block) == "2026-11"
    assert bytes(unseal(old_block, object_key=KEY_A, keyring=during)) == encoded(7, KEY_A)
    assert bytes(unseal(new_block, object_key=KEY_B, keyring=after)) == encoded(8, KEY_B)
    with pytest.raises(AuthenticationError) as err:
        unseal(old_block, object_key=KEY_A, keyring=after)
    assert err.value.kind == "unknown_key"


def test_accept_unsigned_reads_plain_blocks_while_migrating() -> None:
    ring = keyring("k1", accept_unsigned=True)
    plain = encoded(9, KEY_A)
    assert bytes(unseal(plain, object_key=KEY_A, keyring=ring)) == plain
    with pytest.raises(AuthenticationError):  # garbage is still not "unsigned"
        unseal(b"junk" * 10, object_key=KEY_A, keyring=ring)


def test_keyring_never_shows_a_secret() -> None:
    line = new_key_line("k1")
    ring = parse_keys(line, source="test")
    secret = line.split()[1]
    assert secret not in repr(ring)
    assert secret not in str(ring)
    assert "k1" in repr(ring)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no keys listed"),
        ("k1", "line 1 is not 'KEY_ID SECRET'"),
        ("k1 00ff", "32 bytes"),
        ("bad/id " + "00" * 32, "key id must be"),
        (f"k1 {'00' * 32}\nk1 {'11' * 32}", "listed twice"),
    ],
)
def test_malformed_key_lists_fail_with_one_line_that_shows_no_secret(
    text: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        parse_keys(text, source="auth_keys (file x)")
    assert "\n" not in str(err.value)
    assert "11" * 32 not in str(err.value)


def test_base64_and_hex_secrets_and_comments() -> None:
    secret = os.urandom(32)
    ring = parse_keys(
        f"# rotated 2026-11\nb64 {base64.b64encode(secret).decode()}  # new\nhex {secret.hex()}\n",
        source="test",
    )
    assert ring.key_ids == ("b64", "hex")
    assert ring.secret("hex") == secret


def test_file_source_refuses_a_file_others_can_read(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(new_key_line("k1") + "\n")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_keyring(f"file:{path}")
    path.chmod(0o600)
    ring = load_keyring(f"file:{path}")
    assert ring is not None
    assert ring.sealing_id == "k1"


def test_env_source_and_setting_errors() -> None:
    lines = f"{new_key_line('a')};{new_key_line('b')}"
    ring = load_keyring("env:TLLM_S3KV_KEYS_SECRET", environ={"TLLM_S3KV_KEYS_SECRET": lines})
    assert ring is not None
    assert ring.key_ids == ("a", "b")
    assert load_keyring("") is None
    with pytest.raises(ConfigError, match="is not set"):
        load_keyring("env:NOPE", environ={})
    with pytest.raises(ConfigError, match="unknown source"):
        load_keyring("vault:x")
    with pytest.raises(ConfigError, match="expected file:PATH"):
        load_keyring("/etc/s3kv/keys")
    with pytest.raises(ConfigError, match="auth_accept_unsigned"):
        load_keyring("", accept_unsigned=True)


def test_kms_source_decrypts_data_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    moto = pytest.importorskip("moto")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    with moto.mock_aws():
        import boto3

        from s3kv.storage import kms_generate

        arn = boto3.client("kms", region_name="us-east-1").create_key()["KeyMetadata"]["Arn"]
        path = tmp_path / "data-keys"
        path.write_text(f"dk1 {kms_generate(arn, region='us-east-1')}\n")
        ring = load_keyring(f"kms:{path}", region="us-east-1")
        assert ring is not None
        assert ring.key_ids == ("dk1",)
        secret = ring.secret("dk1")
        assert secret is not None
        assert len(secret) == 32
        again = load_keyring(f"kms:{path}", region="us-east-1")
        assert again is not None
        assert again.secret("dk1") == secret
        path.write_text("dk1 " + base64.b64encode(b"not a kms blob" * 4).decode() + "\n")
        with pytest.raises(ConfigError, match="KMS did not decrypt data key 1"):
            load_keyring(f"kms:{path}", region="us-east-1")


# --- the store ---------------------------------------------------------------------------


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text(new_key_line("k1") + "\n")
    path.chmod(0o600)
    return path


def test_store_seals_saves_and_loads_them(key_file: Path) -> None:
    backend = MemoryBackend()
    chain = chain_hashes(list(range(16)), 4)
    data = blocks(len(chain))
    save_chain(open_store(backend, auth_keys=f"file:{key_file}"), chain, data)
    stored = backend.get(open_store(backend).object_key(chain[0]))
    assert stored is not None
    assert is_sealed(stored)
    reader = open_store(backend, auth_keys=f"file:{key_file}")
    reader.prefetch(chain)
    assert reader.wait_staged(chain, timeout=10) == len(chain)
    staged = reader.staged(chain[0])
    assert staged is not None
    assert bytes(staged.data) == data[0].tobytes()
    # A reader without the keys cannot read them: misses, never wrong bytes.
    blind = open_store(backend)
    blind.prefetch(chain)
    assert blind.wait_staged(chain, timeout=10) == 0


def forge(backend: Backend, object_key: str, seed: int) -> bytes:
    """Plant a well-formed, unsealed block of other bytes under a victim's key."""
    fake = blocks(1, seed=seed)[0]
    blob = codec.encode(fake, key=object_key, dtype="bfloat16", shape=SHAPE)
    backend.put(object_key, blob)
    return fake.tobytes()


def test_store_with_keys_treats_a_planted_block_as_a_miss_counts_it_and_heals_it(
    key_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = MemoryBackend()
    chain = chain_hashes(list(range(16)), 4)
    data = blocks(len(chain))
    save_chain(open_store(backend, auth_keys=f"file:{key_file}"), chain, data)
    victim = open_store(backend).object_key(chain[1])
    fake = forge(backend, victim, seed=99)
    reader = open_store(backend, auth_keys=f"file:{key_file}")
    with caplog.at_level(logging.DEBUG, logger="s3kv"):
        reader.prefetch(chain)
        reader.wait_staged(chain, timeout=10)
    assert chain[1] not in reader.staging  # the poisoned block is a miss
    assert reader.staging.count_leading(chain) == 1
    assert reader.metrics.value("corrupt_objects", kind="unsigned") == 1
    assert key_file.read_text().split()[1] not in caplog.text
    # Quarantined: asking again does not GET the bad object again.
    gets = backend_gets(reader)
    for _ in range(10):
        reader.prefetch([chain[1]])
        reader.wait_staged([chain[1]], timeout=10)
    assert backend_gets(reader) == gets
    assert reader.metrics.value("prefetch_quarantined") == 10
    # The next save of that key overwrites the planted object (not "already there").
    status = reader.save(chain[1], chain[0], data[1], dtype="bfloat16", shape=SHAPE)
    assert status.name == "QUEUED"
    assert reader.flush(timeout=10)
    assert reader.metrics.value("save_rewrote_quarantined") == 1
    fresh = open_store(backend, auth_keys=f"file:{key_file}")
    fresh.prefetch(chain)
    assert fresh.wait_staged(chain, timeout=10) == len(chain)
    staged = fresh.staged(chain[1])
    assert staged is not None
    assert bytes(staged.data) == data[1].tobytes() != fake


def backend_gets(store: object) -> float:
    metrics = store.metrics  # type: ignore[attr-defined]
    return float(metrics.value("requests", op="get"))


def test_without_keys_a_planted_block_is_loaded_which_is_what_auth_keys_is_for() -> None:
    # The threat, shown: documented in the README's threat model.
    backend = MemoryBackend()
    chain = chain_hashes(list(range(8)), 4)
    save_chain(open_store(backend), chain, blocks(len(chain)))
    fake = forge(backend, open_store(backend).object_key(chain[0]), seed=7)
    reader = open_store(backend)
    reader.prefetch(chain[:1])
    assert reader.wait_staged(chain[:1], timeout=10) == 1
    staged = reader.staged(chain[0])
    assert staged is not None
    assert bytes(staged.data) == fake


# --- the CLI --------------------------------------------------------------------------------


def test_keys_new_prints_a_line_auth_keys_accepts(tmp_path: Path) -> None:
    from cli_support import assert_one_error_line, invoke

    result = invoke(["keys", "new", "2026-11"])
    assert result.exit_code == 0, result.output
    path = tmp_path / "keys"
    path.write_text(result.stdout)
    path.chmod(0o600)
    ring = load_keyring(f"file:{path}")
    assert ring is not None
    assert ring.key_ids == ("2026-11",)
    assert invoke(["keys", "new", "2026-11"]).stdout != result.stdout  # a fresh secret
    assert_one_error_line(invoke(["keys", "new", "bad id"]), "key id", code=2)


def test_verify_delete_corrupt_never_deletes_sealed_blocks_and_removes_planted_ones(
    tmp_path: Path, key_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cli_support import invoke, parse_json

    from s3kv.storage import FileBackend

    root = tmp_path / "bucket"
    root.mkdir()
    backend = FileBackend(root)
    chain = chain_hashes(list(range(16)), 4)
    writer = KVStore.open(
        config(endpoint_url=f"file://{root}", auth_keys=f"file:{key_file}"),
        identity(),
        backend=backend,
        allocator=NumpyAllocator(),
        pool=IOPool(0),
        start_background=False,
    )
    save_chain(writer, chain, blocks(len(chain)))
    writer.close()
    planted = forge(backend, writer.object_key(chain[3]), seed=5)  # type: ignore[arg-type]
    assert planted
    args = ["verify", "--all", "--delete-corrupt", "--yes", "--json"]
    args += ["--endpoint-url", f"file://{root}"]
    # Without the keys: sealed blocks cannot be checked, so nothing sealed is deleted.
    blind = parse_json(invoke(args))
    assert blind["deleted"] == 0
    assert blind["unsupported"] == len(chain) - 1
    # With the keys: the sealed blocks verify, and the planted unsealed one is deleted.
    monkeypatch.setenv("TLLM_S3KV_AUTH_KEYS", f"file:{key_file}")
    result = invoke(args)
    keyed = parse_json(result)
    assert keyed["ok"] == len(chain) - 1, result.output
    assert keyed["deleted"] == 1
    assert backend.get(writer.object_key(chain[3])) is None
    assert backend.get(writer.object_key(chain[0])) is not None
