"""The Bloom filter: no false negatives, FPR near target, scalar/vector agreement, format."""

from __future__ import annotations

import os
import struct
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s3kv.errors import (
    BadMagicError,
    ChecksumError,
    CodecError,
    SizeMismatchError,
    TruncatedError,
    UnsupportedVersionError,
)
from s3kv.manifest.bloom import BLOOM_MAGIC, BloomFilter

key_lists = st.lists(st.binary(min_size=16, max_size=16), min_size=0, max_size=300)


def random_keys(n: int, seed: int) -> list[bytes]:
    data = np.random.default_rng(seed).bytes(16 * n)
    return [data[i : i + 16] for i in range(0, 16 * n, 16)]


def test_sizing_follows_the_standard_formulas() -> None:
    bloom = BloomFilter.for_capacity(10_000_000, 1e-6)
    assert bloom.m % 64 == 0
    assert bloom.k == 20
    # 28.76 bits per key at 1e-6: ~36 MB for 10M keys (the documented memory cost).
    assert 35.5e6 < bloom.nbytes < 36.5e6
    assert BloomFilter.for_capacity(1, 0.4).m == 64


@pytest.mark.parametrize(("capacity", "fpr"), [(0, 1e-6), (10, 0.0), (10, 0.5)])
def test_sizing_rejects_nonsense(capacity: int, fpr: float) -> None:
    with pytest.raises(ValueError, match=r"capacity|fpr"):
        BloomFilter.for_capacity(capacity, fpr)


@settings(max_examples=60, deadline=None)
@given(keys=key_lists, batched=st.booleans())
def test_no_false_negatives(keys: list[bytes], batched: bool) -> None:
    bloom = BloomFilter.for_capacity(500, 1e-3)
    if batched:
        bloom.add_many(keys)
    else:
        for key in keys:
            bloom.add(key)
    assert all(key in bloom for key in keys)
    assert bloom.contains_many(keys).all()
    assert bloom.count_leading(keys) == len(keys)


@settings(max_examples=30, deadline=None)
@given(present=key_lists, probe=key_lists)
def test_scalar_and_vector_paths_agree(present: list[bytes], probe: list[bytes]) -> None:
    # A tiny, overfull filter so that false positives are common: both paths must agree
    # bit for bit, not merely on the inserted keys.
    bloom = BloomFilter(128, 3)
    bloom.add_many(present)
    scalar = [key in bloom for key in probe]
    assert bloom.contains_many(probe).tolist() == scalar
    expected = scalar.index(False) if False in scalar else len(probe)
    assert bloom.count_leading(probe) == expected


def test_scalar_add_matches_batched_add() -> None:
    keys = random_keys(2000, seed=1)
    one, many = BloomFilter.for_capacity(2000, 1e-4), BloomFilter.for_capacity(2000, 1e-4)
    for key in keys:
        one.add(key)
    many.add_many(keys)
    assert one.to_bytes() == many.to_bytes()


def test_add_many_keeps_bits_that_share_a_byte() -> None:
    # 64 bits and 2000 keys: nearly every probe lands in a byte another probe also sets.
    bloom = BloomFilter(64, 4)
    keys = random_keys(2000, seed=2)
    reference = BloomFilter(64, 4)
    for key in keys:
        reference.add(key)
    bloom.add_many(keys)
    assert bloom.to_bytes() == reference.to_bytes()


def test_measured_fpr_is_near_target() -> None:
    bloom = BloomFilter.for_capacity(100_000, 1e-3)
    bloom.add_many(random_keys(100_000, seed=3))
    absent = random_keys(100_000, seed=4)
    false_positives = int(bloom.contains_many(absent).sum())
    # Expected 100 (Poisson); 3x the target would mean the hashing is broken.
    assert 40 <= false_positives <= 300
    assert 0.45 < bloom.fill_ratio() < 0.55
    assert abs(bloom.approx_count - 100_000) < 2_000


def test_count_leading_semantics() -> None:
    keys = random_keys(5, seed=5)
    bloom = BloomFilter.for_capacity(1000, 1e-9)
    assert bloom.count_leading([]) == 0
    bloom.add_many([keys[0], keys[1], keys[3]])
    assert bloom.count_leading(keys) == 2
    assert bloom.count_leading(keys[2:]) == 0
    assert bloom.count_leading(keys[3:4]) == 1


def test_count_leading_spans_batches() -> None:
    keys = random_keys(40_000, seed=6)
    bloom = BloomFilter.for_capacity(40_000, 1e-9)
    bloom.add_many(keys[:35_000])
    assert bloom.count_leading(keys) == 35_000


def test_wrong_key_length_is_rejected() -> None:
    bloom = BloomFilter.for_capacity(10, 1e-3)
    with pytest.raises(ValueError, match="16 bytes"):
        bloom.add(b"short")
    with pytest.raises(ValueError, match="16 bytes"):
        bloom.count_leading([b"x" * 16, b"short"])
    assert b"short" not in bloom
    assert "not bytes" not in bloom


def test_union_inplace() -> None:
    a_keys, b_keys = random_keys(100, seed=7), random_keys(100, seed=8)
    a, b = BloomFilter.for_capacity(1000, 1e-6), BloomFilter.for_capacity(1000, 1e-6)
    a.add_many(a_keys)
    b.add_many(b_keys)
    a.union_inplace(b)
    assert a.count_leading(a_keys + b_keys) == 200
    assert a.count == 200
    with pytest.raises(ValueError, match="geometry"):
        a.union_inplace(BloomFilter.for_capacity(10, 1e-6))


def test_round_trip() -> None:
    keys = random_keys(1000, seed=9)
    bloom = BloomFilter.for_capacity(1000, 1e-6)
    bloom.add_many(keys)
    data = bloom.to_bytes()
    assert data.startswith(BLOOM_MAGIC)
    loaded = BloomFilter.from_bytes(data)
    assert (loaded.m, loaded.k, loaded.count) == (bloom.m, bloom.k, 1000)
    assert loaded.count_leading(keys) == 1000
    assert loaded.to_bytes() == data
    # The loaded filter is writable (it is not a view of the input bytes).
    loaded.add(random_keys(1, seed=10)[0])


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda d: b"NOTBLOOM" + d[8:], BadMagicError),
        (lambda d: b"S3KVBLM9" + d[8:], UnsupportedVersionError),
        (lambda d: d[:20], TruncatedError),
        (lambda d: d[:-1], TruncatedError),
        (lambda d: d + b"\x00", SizeMismatchError),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), ChecksumError),
        (lambda d: d[:8] + struct.pack("<Q", 100) + d[16:], SizeMismatchError),
        (lambda d: b"", TruncatedError),
        (lambda d: b"garbage", BadMagicError),
    ],
)
def test_corrupt_bytes_raise_codec_errors(mutate: object, error: type[CodecError]) -> None:
    bloom = BloomFilter.for_capacity(100, 1e-3)
    bloom.add_many(random_keys(50, seed=11))
    data = bloom.to_bytes()
    assert callable(mutate)
    with pytest.raises(error):
        BloomFilter.from_bytes(mutate(data))


def test_concurrent_adds_never_hide_completed_keys() -> None:
    # A refresher thread adds batches while lookups run: every key whose add completed
    # before a lookup started must be found by it.
    bloom = BloomFilter.for_capacity(200_000, 1e-6)
    batches = [random_keys(2000, seed=100 + i) for i in range(40)]
    completed = 0
    done = threading.Event()
    failures: list[int] = []

    def writer() -> None:
        nonlocal completed
        for i, batch in enumerate(batches):
            bloom.add_many(batch)
            completed = i + 1
        done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    while not done.is_set():
        finished = completed
        for batch in batches[:finished]:
            if bloom.count_leading(batch) != len(batch) or batch[-1] not in bloom:
                failures.append(finished)
    thread.join()
    assert not failures
    assert all(bloom.count_leading(batch) == len(batch) for batch in batches)


def test_keys_with_extreme_halves() -> None:
    bloom = BloomFilter.for_capacity(100, 1e-6)
    edge = [b"\x00" * 16, b"\xff" * 16, b"\xff" * 8 + b"\x00" * 8, os.urandom(16)]
    bloom.add_many(edge)
    assert all(key in bloom for key in edge)
    assert bloom.count_leading(edge) == 4


def test_a_key_filter_answers_each_key_from_whichever_part_holds_it() -> None:
    from s3kv.manifest.filters import KeyFilter

    growth, local, absent = (
        [os.urandom(16) for _ in range(300)],
        [os.urandom(16) for _ in range(300)],
        [os.urandom(16) for _ in range(300)],
    )
    keys = KeyFilter(1e-6)
    keys.add_many(growth)
    keys.add_local(local)
    mixed = [k for triple in zip(growth, absent, local, strict=True) for k in triple]
    found = keys.contains_many(mixed)
    assert found[0::3].all()
    assert found[2::3].all()
    assert found[1::3].sum() <= 1  # NOTE: false positives at 1e-6: almost surely none
    assert not keys.contains_many(absent[:5]).any()
    with pytest.raises(ValueError, match="16 bytes"):
        keys.contains_many([growth[0], b"short", growth[1] + b"!"])
