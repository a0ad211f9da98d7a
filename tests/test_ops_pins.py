"""``s3kv.ops.pins`` on an in-memory bucket: targets from keys and text, pin, unpin, list."""

from __future__ import annotations

import pytest
from cli_support import PREFIX, Bucket, Clock

from s3kv.errors import ConfigError
from s3kv.keys import ROOT_HASH, chain_hashes
from s3kv.manifest import load_usage
from s3kv.ops.pins import PinTarget, keys_from_hex, keys_from_text, list_pins, set_pins
from s3kv.ops.scope import resolve_scope
from s3kv.storage import MemoryBackend

T0 = 1_700_000_000.0


class WordTokenizer:
    """Token i for the i-th distinct word; a BOS token 0 with special tokens."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        words = text.split()
        ids = [sorted(set(words)).index(w) + 1 for w in words]
        return [0, *ids] if add_special_tokens else ids


@pytest.fixture
def bucket() -> Bucket:
    b = Bucket(MemoryBackend(), "memory://", "test")
    b.write_identity()
    return b


def test_keys_from_hex_validates() -> None:
    key = "ab" * 16
    assert [bytes(t.key).hex() for t in keys_from_hex([key])] == [key]
    with pytest.raises(ConfigError, match="KEY: 'abc'"):
        keys_from_hex(["abc"])


def test_keys_from_text_is_the_chain_of_full_blocks() -> None:
    text = "a b c d e f g h i"  # 9 words, 10 tokens with BOS: two full blocks of 4
    targets = keys_from_text(text, WordTokenizer(), 4)
    chain = chain_hashes(WordTokenizer().encode(text), 4)
    assert [t.key for t in targets] == chain
    assert [t.parent for t in targets] == [ROOT_HASH, chain[0]]
    assert len(keys_from_text(text, WordTokenizer(), 4, add_special_tokens=False)) == 2
    with pytest.raises(ConfigError, match="do not fill one block"):
        keys_from_text("a b", WordTokenizer(), 4)


def test_pin_list_and_unpin(bucket: Bucket) -> None:
    clock = Clock(T0)
    chain = bucket.chain(range(8))
    bucket.write_chain(chain, clock)
    scope = resolve_scope(bucket.backend, PREFIX)
    leaf = [PinTarget(chain[-1])]

    report = set_pins(bucket.backend, scope, lambda fp: leaf, prefix=PREFIX, clock=clock)
    assert report.found_any
    assert report.outcomes[0].changed == 1
    (pinned,) = list_pins(bucket.backend, scope, prefix=PREFIX)
    assert (pinned.key, pinned.parent, pinned.model) == (
        chain[-1].hex(),
        chain[0].hex(),
        "test/model",
    )

    again = set_pins(bucket.backend, scope, lambda fp: leaf, prefix=PREFIX, clock=clock)
    assert (again.outcomes[0].changed, again.outcomes[0].unchanged) == (0, 1)
    clock.now += 1  # NOTE: the latest record wins: the unpin comes after the pin
    set_pins(bucket.backend, scope, lambda fp: leaf, prefix=PREFIX, pin=False, clock=clock)
    assert list_pins(bucket.backend, scope, prefix=PREFIX) == []


def test_pin_adopts_unknown_objects_and_counts_missing_ones(bucket: Bucket) -> None:
    (stray,) = bucket.chain(range(40, 44))
    bucket.put_block(stray)  # exists, but the manifest never heard of it
    absent = keys_from_hex(["cd" * 16])[0]
    scope = resolve_scope(bucket.backend, PREFIX)
    report = set_pins(
        bucket.backend, scope, lambda fp: [PinTarget(stray), absent], prefix=PREFIX, clock=Clock(T0)
    )
    outcome = report.outcomes[0]
    assert (outcome.requested, outcome.changed, outcome.adopted, outcome.missing) == (2, 1, 1, 1)
    row = load_usage(bucket.backend, PREFIX, bucket.fingerprint).row(stray)
    assert row is not None
    assert row.pinned

    nothing = set_pins(bucket.backend, scope, lambda fp: [absent], prefix=PREFIX)
    assert not nothing.found_any
