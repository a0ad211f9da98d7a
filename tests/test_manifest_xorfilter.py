"""The xor filter: no false negatives, FPR near 2**-bits, scalar/vector agreement, format."""

from __future__ import annotations

import os
import struct
import tracemalloc
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
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
from s3kv.manifest import xorfilter
from s3kv.manifest.xorfilter import XOR_MAGIC, XorFilter

key_lists = st.lists(st.binary(min_size=16, max_size=16), min_size=0, max_size=300)
HEADER = struct.Struct("<8sIIQQQQ")


def random_array(n: int, seed: int) -> npt.NDArray[np.void]:
    return np.frombuffer(np.random.default_rng(seed).bytes(16 * n), dtype="V16")


def random_keys(n: int, seed: int) -> list[bytes]:
    data = np.random.default_rng(seed).bytes(16 * n)
    return [data[i : i + 16] for i in range(0, 16 * n, 16)]


@pytest.fixture(scope="module")
def members() -> npt.NDArray[np.void]:
    return random_array(100_000, seed=1)


@pytest.fixture(scope="module")
def strangers() -> npt.NDArray[np.void]:
    # Random keys are members with probability ~1e6 / 2**128: none of them is.
    return random_array(1_000_000, seed=2)


@pytest.mark.parametrize(
    ("fpr", "bits"), [(0.5, 8), (2**-8, 8), (1e-3, 16), (1e-4, 16), (1e-6, 24), (1e-9, 32)]
)
def test_fp_bits_for_picks_the_narrowest_width(fpr: float, bits: int) -> None:
    assert XorFilter.fp_bits_for(fpr) == bits


@pytest.mark.parametrize("fpr", [0.0, 1.0, -0.1, 2**-33])
def test_fp_bits_for_rejects_nonsense(fpr: float) -> None:
    with pytest.raises(ValueError, match="fpr"):
        XorFilter.fp_bits_for(fpr)


@pytest.mark.parametrize("bits", [8, 16, 24, 32])
def test_no_false_negatives(members: npt.NDArray[np.void], bits: int) -> None:
    xor = XorFilter.build(members, bits)
    assert (xor.keys, xor.fp_bits) == (len(members), bits)
    assert xor.contains_many(members).all()
    sample = [bytes(key) for key in members[:2000]]
    assert xor.contains_many(sample).all()
    assert all(key in xor for key in sample)
    assert xor.count_leading(members) == len(members)


def test_table_size_is_1_23_entries_per_key(members: npt.NDArray[np.void]) -> None:
    xor = XorFilter.build(members, 24)
    assert xor.slots == 3 * -(-(len(members) * 123 // 100 + 32) // 3)
    assert xor.nbytes == 3 * xor.slots
    assert xor.nbytes / xor.keys <= 3.7  # the brief's bound is 4 bytes per key


@pytest.mark.parametrize(
    # Expected hits over 1M strangers: 3906 (sd 62), 15.3 (Poisson), 0.06, 0.0002. The bounds
    # are about 6 sd wide; the keys are seeded, so a pass is reproducible.
    ("bits", "low", "high"),
    [(8, 3530, 4290), (16, 2, 42), (24, 0, 3), (32, 0, 1)],
)
def test_measured_fpr_is_near_two_to_the_minus_bits(
    members: npt.NDArray[np.void],
    strangers: npt.NDArray[np.void],
    bits: int,
    low: int,
    high: int,
) -> None:
    xor = XorFilter.build(members, bits)
    hits = int(xor.contains_many(strangers).sum())
    assert low <= hits <= high


@settings(max_examples=40, deadline=None)
@given(present=key_lists, probe=key_lists, bits=st.sampled_from([8, 16, 24, 32]))
def test_scalar_and_vector_paths_agree(present: list[bytes], probe: list[bytes], bits: int) -> None:
    xor = XorFilter.build(present, bits)
    assert all(key in xor for key in present)
    assert xor.count_leading(present) == len(present)
    scalar = [key in xor for key in probe]
    assert xor.contains_many(probe).tolist() == scalar
    expected = scalar.index(False) if False in scalar else len(probe)
    assert xor.count_leading(probe) == expected


def test_scalar_and_vector_paths_agree_on_false_positives() -> None:
    # At 8 bits ~1/256 of strangers pass: the scalar path must report the same ones.
    xor = XorFilter.build(random_array(3000, seed=3), 8)
    probe = random_keys(20_000, seed=4)
    vector = xor.contains_many(probe)
    assert 0 < vector.sum() < 200
    assert [key in xor for key in probe] == vector.tolist()


@pytest.mark.parametrize("bits", [8, 16, 24, 32])
def test_round_trip(bits: int) -> None:
    keys = random_array(5000, seed=5)
    xor = XorFilter.build(keys, bits)
    data = xor.to_bytes()
    assert data.startswith(XOR_MAGIC)
    assert len(data) == HEADER.size + xor.nbytes
    loaded = XorFilter.from_bytes(bytearray(data))
    assert (loaded.keys, loaded.fp_bits, loaded.seed, loaded.slots) == (
        xor.keys,
        xor.fp_bits,
        xor.seed,
        xor.slots,
    )
    assert loaded.contains_many(keys).all()
    assert loaded.to_bytes() == data
    probe = random_array(20_000, seed=6)
    assert (loaded.contains_many(probe) == xor.contains_many(probe)).all()


def test_loaded_filter_does_not_alias_the_input() -> None:
    keys = random_keys(100, seed=7)
    buffer = bytearray(XorFilter.build(keys, 16).to_bytes())
    loaded = XorFilter.from_bytes(memoryview(buffer))
    buffer[HEADER.size :] = bytes(len(buffer) - HEADER.size)
    assert loaded.count_leading(keys) == 100


def test_same_keys_and_seed_give_the_same_bytes() -> None:
    keys = random_keys(2000, seed=8)
    assert XorFilter.build(keys, 24).to_bytes() == XorFilter.build(keys, 24).to_bytes()
    other = XorFilter.build(keys, 24, seed=12345)
    assert other.seed != XorFilter.build(keys, 24).seed
    assert other.count_leading(keys) == 2000


def _with_header(data: bytes, **fields: int) -> bytes:
    names = ("magic", "fp_bits", "reserved", "seed", "slots", "keys", "checksum")
    values = dict(zip(names, HEADER.unpack_from(data), strict=True))
    values.update(fields)
    return HEADER.pack(*values.values()) + data[HEADER.size :]


Mutation = Callable[[bytes], bytes]


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda d: b"NOTAXORF" + d[8:], BadMagicError),
        (lambda d: b"garbage", BadMagicError),
        (lambda d: b"S3KVXOR9" + d[8:], UnsupportedVersionError),
        (lambda d: b"", TruncatedError),
        (lambda d: d[:20], TruncatedError),
        (lambda d: d[:-1], TruncatedError),
        (lambda d: d + b"\x00", SizeMismatchError),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), ChecksumError),
        (lambda d: _with_header(d, checksum=0), ChecksumError),
        (lambda d: _with_header(d, fp_bits=12), SizeMismatchError),
        (lambda d: _with_header(d, fp_bits=8), SizeMismatchError),  # 1/2 the table's size
        (lambda d: _with_header(d, slots=999), SizeMismatchError),
        (lambda d: _with_header(d, keys=400), SizeMismatchError),  # slots disagree
        (lambda d: _with_header(d, keys=2**40, slots=2**40), SizeMismatchError),
    ],
)
def test_corrupt_bytes_raise_codec_errors(mutate: Mutation, error: type[CodecError]) -> None:
    data = XorFilter.build(random_keys(500, seed=9), 16).to_bytes()
    with pytest.raises(error):
        XorFilter.from_bytes(mutate(data))


def test_a_lying_header_allocates_nothing() -> None:
    # The header claims 2**30 keys (a 4 GB table at 32 bits) over a 100-byte body: the
    # length check must come before any allocation sized by the header.
    keys = 1 << 30
    slots = 3 * -(-(keys * 123 // 100 + 32) // 3)
    data = HEADER.pack(XOR_MAGIC, 32, 0, 1, slots, keys, 0) + bytes(100)
    tracemalloc.start()
    try:
        with pytest.raises(TruncatedError, match="header says"):
            XorFilter.from_bytes(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize("keys", [[], np.empty(0, dtype="V16")])
def test_empty_filter_contains_nothing(keys: list[bytes] | npt.NDArray[np.void]) -> None:
    xor = XorFilter.build(keys, 24)
    assert (xor.keys, xor.slots, xor.nbytes) == (0, 0, 0)
    probe = random_keys(1000, seed=10)
    assert not xor.contains_many(probe).any()
    assert not any(key in xor for key in probe)
    assert xor.count_leading(probe) == 0
    assert xor.count_leading([]) == 0
    loaded = XorFilter.from_bytes(xor.to_bytes())
    assert loaded.keys == 0
    assert not loaded.contains_many(probe).any()


def test_duplicates_are_ignored() -> None:
    keys = random_keys(3000, seed=11)
    noisy = keys + keys[:100] + keys[:7] + [keys[5]] * 50
    xor = XorFilter.build(noisy, 16)
    assert xor.keys == 3000
    assert xor.contains_many(noisy).all()
    # Dropping the later copies leaves exactly the distinct keys in order: same filter.
    assert xor.to_bytes() == XorFilter.build(keys, 16).to_bytes()


def test_one_key_many_times() -> None:
    key = os.urandom(16)
    xor = XorFilter.build([key] * 1000, 32)
    assert xor.keys == 1
    assert key in xor


def test_structured_key_field_is_accepted() -> None:
    rows = np.zeros(2000, dtype=[("key", "V16"), ("hits", "<u8")])
    rows["key"] = random_array(2000, seed=12)
    xor = XorFilter.build(rows["key"], 24)
    assert xor.contains_many(rows["key"]).all()
    assert xor.count_leading([bytes(key) for key in rows["key"]]) == 2000


def test_count_leading_semantics() -> None:
    present = random_keys(50, seed=13)
    absent = random_keys(3, seed=14)
    xor = XorFilter.build(present, 32)
    assert xor.count_leading(present) == 50
    assert xor.count_leading(present[:7] + absent + present) == 7
    assert xor.count_leading(absent + present) == 0
    assert xor.count_leading([]) == 0


def test_count_leading_spans_batches() -> None:
    keys = random_keys(40_000, seed=15)
    xor = XorFilter.build(keys, 32)
    absent = random_keys(1, seed=16)
    assert xor.count_leading(keys) == 40_000
    assert xor.count_leading(keys[:20_000] + absent + keys) == 20_000


def test_keys_with_extreme_halves() -> None:
    edge = [b"\x00" * 16, b"\xff" * 16, b"\xff" * 8 + b"\x00" * 8, os.urandom(16)]
    xor = XorFilter.build(edge, 24)
    assert all(key in xor for key in edge)
    assert xor.count_leading(edge) == 4


def test_structured_keys_still_build() -> None:
    # Counters are far from random; the seeded mixing must still spread them.
    keys = [i.to_bytes(16, "little") for i in range(5000)]
    keys += [i.to_bytes(16, "big") for i in range(1, 5000)]
    xor = XorFilter.build(keys, 16)
    assert xor.count_leading(keys) == len(keys)
    strangers = [i.to_bytes(16, "little") for i in range(10_000, 110_000)]
    assert xor.contains_many(strangers).sum() < 30  # 1.5 expected


def test_bad_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        XorFilter.build([b"short"], 16)
    with pytest.raises(ValueError, match="fp_bits"):
        XorFilter.build(random_keys(10, seed=17), 12)
    xor = XorFilter.build(random_keys(10, seed=17), 16)
    with pytest.raises(ValueError, match="V16"):
        xor.contains_many(np.zeros(4, dtype="V8"))
    with pytest.raises(ValueError, match="16 bytes"):
        xor.count_leading([b"x" * 17])
    assert b"short" not in xor
    assert "a string" not in xor


def test_a_failed_peel_retries_with_the_next_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = xorfilter._peel
    seeds: list[int] = []

    def flaky(words: npt.NDArray[np.uint64], seed: int, fp_bits: int) -> object:
        seeds.append(seed)
        if len(seeds) < 3:
            return None, np.empty(0, dtype=np.intp)
        return real(words, seed, fp_bits)

    monkeypatch.setattr(xorfilter, "_peel", flaky)
    keys = random_keys(1000, seed=18)
    xor = XorFilter.build(keys, 16, seed=1)
    assert len(set(seeds)) == 3
    assert xor.seed == seeds[-1] != 1
    assert xor.count_leading(keys) == 1000


def test_gives_up_after_a_few_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(xorfilter, "_peel", lambda *_: (None, np.empty(0, dtype=np.intp)))
    with pytest.raises(ValueError, match="no seed"):
        XorFilter.build(random_keys(10, seed=19), 16)
