"""A static, vectorized xor filter over block keys (Graf & Lemire 2019), for snapshots.

A xor filter answers "may this key be in the set?" like a Bloom filter, but is built once
from the whole key set and never changes. In exchange it needs ``1.23 · fp_bits`` bits per
key at false-positive rate ``2**-fp_bits`` (29.5 bits at 24 bits ≈ 6e-8, where a Bloom
filter needs 34), and a lookup reads exactly three table entries.

Hashing: block keys are already uniformly random 128-bit hashes, but the filter must be able
to *change* its hash when peeling fails, so a key's little-endian uint64 halves ``lo, hi``
are mixed with a 64-bit ``seed`` by the murmur3 finalizer ``fmix``::

    a = fmix(lo ^ seed)              # seed-dependent
    h = fmix(hi ^ a)                 # depends on all 128 key bits and the seed
    slot i (i = 0, 1, 2)  = i·L + ((rotl(h, 21·i) mod 2**32) · L >> 32)
    fingerprint           = (a ^ h ^ (h >> 32)) mod 2**fp_bits

The table has three segments of ``L`` slots, ``3·L ≥ floor(1.23·n) + 32``; a key owns one
slot in each segment, and the xor of its three entries is its fingerprint. For random keys
``a`` is independent of ``h``, so a non-member's fingerprint is independent of the three
entries it reads, and it matches them with probability exactly ``2**-fp_bits``.

Construction ("peeling"): a slot touched by exactly one key can be given whatever value makes
that key's xor come out right, after every other slot of that key is final. So repeatedly
remove the keys that own a slot alone, then fill slots in the reverse order of removal. Here
each round removes *all* such keys at once with numpy: per-slot counts and per-slot sums of
key ids (the sum of a slot touched by one key *is* that key's id) are kept with ``ufunc.at``
scatters, and only the slots a round touched can become singletons in the next. If keys
remain that no round can remove (a 2-core: measured ~10% of seeds at 1k–10k keys, none of
48 at 100k and more; or duplicate keys, which are then dropped), the build retries with the
next seed.

Format: a 48-byte header (magic, fp_bits, seed, slots, keys, xxh3_64 of the table), then the
table: ``slots`` little-endian fingerprints of ``fp_bits / 8`` bytes each (24-bit ones as
three bytes, low byte first).

Thread safety: a filter never changes after construction, so lookups need no lock.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt
import xxhash

from s3kv.errors import (
    BadMagicError,
    ChecksumError,
    SizeMismatchError,
    TruncatedError,
    UnsupportedVersionError,
)

__all__ = ["XOR_MAGIC", "XorFilter"]

#: First bytes of a serialized filter; the trailing digit is the format version.
XOR_MAGIC: Final = b"S3KVXOR1"
_MAGIC_STEM: Final = XOR_MAGIC[:-1]
# magic, fp_bits, reserved (0), seed, slots, keys, xxh3_64 of the table bytes
_HEADER: Final = struct.Struct("<8sIIQQQQ")
_FP_BITS: Final = (8, 16, 24, 32)
_KEY_BYTES: Final = 16
#: Key ids and slot numbers are int32 during construction (it halves the build's memory).
_MAX_KEYS: Final = 1 << 30
#: Seeds tried before giving up; one fails with probability ~10% at worst, so all 10 ~1e-10.
_ATTEMPTS: Final = 10
_DEFAULT_SEED: Final = 0x5333_4B56_584F_5231  # b"S3KVXOR1" read big-endian
_SEED_STEP: Final = 0x9E37_79B9_7F4A_7C15  # splitmix64's increment (odd: a full cycle)
#: Keys hashed per batch while building: bounds the hashing temporaries to ~8 MB each.
_BUILD_CHUNK: Final = 1 << 20
#: Keys per vectorized lookup batch: bounds the lookup temporaries to ~130 KB each.
_CHUNK_KEYS: Final = 16384
_MASK32: Final = 0xFFFF_FFFF
_MASK64: Final = 0xFFFF_FFFF_FFFF_FFFF
_FMIX1: Final = 0xFF51_AFD7_ED55_8CCD
_FMIX2: Final = 0xC4CE_B9FE_1A85_EC53

U64Array = npt.NDArray[np.uint64]
IntArray = npt.NDArray[np.intp]
KeyInput = Sequence[bytes] | npt.NDArray[np.void]


def _slots_for(keys: int) -> int:
    """Table slots for ``keys`` distinct keys: ``3·ceil((floor(1.23·keys) + 32) / 3)``.

    An empty set gets an empty table (lookups then answer "absent" without reading it).
    """
    if keys == 0:
        return 0
    return 3 * -(-(keys * 123 // 100 + 32) // 3)


# --- hashing ------------------------------------------------------------------------------


def _fmix(x: U64Array) -> U64Array:
    """murmur3's 64-bit finalizer, in place (uint64 products wrap, as they must)."""
    x ^= x >> np.uint64(33)
    x *= np.uint64(_FMIX1)
    x ^= x >> np.uint64(33)
    x *= np.uint64(_FMIX2)
    x ^= x >> np.uint64(33)
    return x


def _fmix_int(x: int) -> int:
    x ^= x >> 33
    x = x * _FMIX1 & _MASK64
    x ^= x >> 33
    x = x * _FMIX2 & _MASK64
    return x ^ x >> 33


def _mix(lo: U64Array, hi: U64Array, seed: int) -> tuple[U64Array, U64Array]:
    """``(h, f)`` per key: ``h`` picks the slots, ``f``'s low bits are the fingerprint."""
    a = _fmix(lo ^ np.uint64(seed))
    h = _fmix(hi ^ a)
    a ^= h
    a ^= h >> np.uint64(32)
    return h, a


def _slots(h: U64Array, seg: int) -> tuple[IntArray, IntArray, IntArray]:
    """The key's slot in each of the three segments of ``seg`` slots (int64, absolute)."""
    length = np.uint64(seg)
    low = np.uint64(_MASK32)
    s0 = ((h & low) * length >> np.uint64(32)).view(np.int64)
    # NOTE: the reference layout: rotations by 21 and 42 make the high bits that the
    # multiply-shift range reduction actually uses (31..10, 10..0 + 63..53, 53..32) tile h.
    w = (h << np.uint64(21) | h >> np.uint64(43)) & low
    s1 = (w * length >> np.uint64(32)).view(np.int64)
    s1 += seg
    w = (h << np.uint64(42) | h >> np.uint64(22)) & low
    s2 = (w * length >> np.uint64(32)).view(np.int64)
    s2 += 2 * seg
    return s0, s1, s2


def _key_words(keys: KeyInput) -> npt.NDArray[np.uint64]:
    """The keys as an ``(n, 2)`` array of little-endian uint64 halves.

    Raises:
        ValueError: a key is not 16 bytes, or the array is not a 1-D ``V16`` array.
    """
    if isinstance(keys, np.ndarray):
        if keys.ndim != 1 or keys.dtype.kind != "V" or keys.dtype.itemsize != _KEY_BYTES:
            raise ValueError(
                f"keys: expected a 1-D V{_KEY_BYTES} array, got {keys.dtype} "
                f"with shape {keys.shape}"
            )
        flat = np.ascontiguousarray(keys).view(np.uint8)
        return flat.view("<u8").reshape(-1, 2)
    joined = b"".join(keys)
    if len(joined) != _KEY_BYTES * len(keys):
        bad = next(key for key in keys if len(key) != _KEY_BYTES)
        raise ValueError(f"keys: every key must be {_KEY_BYTES} bytes, got {len(bad)}")
    return np.frombuffer(joined, dtype="<u8").reshape(-1, 2)


# --- construction -------------------------------------------------------------------------


def _peel(
    words: npt.NDArray[np.uint64], seed: int, fp_bits: int
) -> tuple[npt.NDArray[np.uint32] | None, IntArray]:
    """Solve the table for ``words`` (distinct or not) under ``seed``.

    Returns:
        ``(table, [])`` with one uint32 fingerprint per slot, or ``(None, stuck)`` with the
        ids of the keys no round could remove when peeling fails.
    """
    n = len(words)
    slots = _slots_for(n)
    seg = slots // 3
    mask = np.uint64((1 << fp_bits) - 1)
    # NOTE: int32 ids and slots: every per-key and per-slot array below is 4 bytes wide
    # except the id sums, which must hold up to count·n.
    where = np.empty((3, n), dtype=np.int32)
    fps = np.empty(n, dtype=np.uint32)
    count = np.zeros(slots, dtype=np.int32)
    id_sum = np.zeros(slots, dtype=np.int64)
    one = np.int32(1)  # NOTE: a Python int here makes ufunc.at take a 20x slower cast loop
    for start in range(0, n, _BUILD_CHUNK):
        end = min(n, start + _BUILD_CHUNK)
        h, f = _mix(words[start:end, 0], words[start:end, 1], seed)
        fps[start:end] = f & mask
        ids = np.arange(start, end, dtype=np.int64)
        for i, slot in enumerate(_slots(h, seg)):
            where[i, start:end] = slot
            np.add.at(count, slot, one)
            np.add.at(id_sum, slot, ids)

    # Peel in rounds. `order` lists the removed keys round by round and `alone` the slot each
    # one owned alone when it was removed; `bounds` delimits the rounds.
    order = np.empty(n, dtype=np.int32)
    alone = np.empty(n, dtype=np.int32)
    owner = np.empty(n, dtype=np.int32)
    bounds = [0]
    candidates: IntArray = np.flatnonzero(count == 1)
    while candidates.size:
        found = id_sum[candidates]  # the one key left in each singleton slot
        # A key can be alone in two or three slots at once: keep one entry per key. Every
        # entry writes its position and exactly one write per key survives, so exactly one
        # entry per key reads its own position back (whichever won is fine).
        position = np.arange(found.size, dtype=np.int32)
        owner[found] = position
        first = owner[found] == position
        keys = found[first]
        done = bounds[-1]
        order[done : done + keys.size] = keys
        alone[done : done + keys.size] = candidates[first]
        bounds.append(done + keys.size)
        touched = []
        for i in range(3):
            slot = where[i].take(keys)
            np.subtract.at(count, slot, one)
            np.subtract.at(id_sum, slot, keys)
            # NOTE: segment i's counts are final for this round here: segments are disjoint.
            touched.append(slot[count.take(slot) == 1])
        # NOTE: a singleton's key was just removed, so it is empty now; the next singletons
        # are among the slots this round decremented (duplicates in the list are harmless).
        candidates = np.concatenate(touched).astype(np.intp)
    if bounds[-1] < n:
        unpeeled = np.ones(n, dtype=np.bool_)
        unpeeled[order[: bounds[-1]]] = False
        return None, np.flatnonzero(unpeeled)
    del count, id_sum, owner

    # Assign in reverse removal order: a key's alone slot is still zero, so writing the xor
    # of its fingerprint and all three of its entries makes the three xor to the fingerprint.
    # NOTE: keys removed in the same round never read each other's alone slot (a slot was a
    # singleton only if no other key still present touched it), so a round is one
    # vectorized step; and keys removed earlier (filled later) never write a slot of a key
    # removed after them, for the same reason.
    table = np.zeros(slots, dtype=np.uint32)
    for lo, hi in zip(reversed(bounds[:-1]), reversed(bounds[1:]), strict=True):
        keys = order[lo:hi]
        value = fps.take(keys)
        for i in range(3):
            value ^= table.take(where[i].take(keys))
        table[alone[lo:hi]] = value
    return table, np.empty(0, dtype=np.intp)


def _duplicates(words: npt.NDArray[np.uint64], stuck: IntArray) -> npt.NDArray[np.bool_] | None:
    """A mask keeping one copy of each key of ``words``, or ``None`` without duplicates.

    Only ``stuck`` (the keys peeling could not remove) are compared: two copies of one key
    share all three slots, so neither can ever be removed and both are always stuck.
    """
    rows = np.ascontiguousarray(words[stuck]).view(f"V{_KEY_BYTES}").ravel()
    _, first = np.unique(rows, return_index=True)
    if first.size == stuck.size:
        return None
    keep = np.ones(len(words), dtype=np.bool_)
    keep[stuck] = False
    keep[stuck[first]] = True
    return keep


class XorFilter:
    """An immutable xor filter of 16-byte keys at false-positive rate ``2**-fp_bits``.

    Memory: ``slots · fp_bits / 8`` bytes of table, ``slots ≈ 1.23 · keys`` — 3.69 bytes per
    key at 24 bits, so **10M keys at ≈6e-8 ≈ 37 MB**. Building ``n`` keys peaks at about
    55 bytes per key beyond the keys themselves (measured, one core: 1M keys 95 MB in
    0.45 s; 8M keys 450 MB in 3.5 s); keys given as ``bytes`` or a non-contiguous array add
    a 16-byte-per-key copy, and duplicates one failed attempt plus a copy. Lookups allocate
    transient arrays of a few hundred KB; ``count_leading`` of 1000 keys against an 8M-key
    filter takes ~0.12 ms.

    Use :meth:`build` to make one and :meth:`from_bytes` to load one.
    """

    __slots__ = ("_bytes_per_fp", "_fp_bits", "_keys", "_seed", "_seg", "_table", "_view")

    def __init__(self, table: npt.NDArray[np.uint8], fp_bits: int, seed: int, keys: int):
        # Private: `table` is the serialized table bytes, already validated.
        self._fp_bits = fp_bits
        self._bytes_per_fp = fp_bits // 8
        self._seed = seed
        self._keys = keys
        self._seg = table.size // self._bytes_per_fp // 3
        self._table = table
        # NOTE: bytes of a memoryview slice convert to an int in ~0.2 µs; reading numpy
        # scalars would make the pure-Python __contains__ several times slower.
        self._view = table.data

    # --- construction ---------------------------------------------------------------------

    @staticmethod
    def fp_bits_for(fpr: float) -> int:
        """The narrowest supported fingerprint (8, 16, 24 or 32 bits) with ``2**-bits <= fpr``.

        ``1e-2 -> 8``, ``1e-4 -> 16``, ``1e-6 -> 24``, ``1e-9 -> 32``.

        Raises:
            ValueError: ``fpr`` not in (0, 1), or below ``2**-32``.
        """
        if not 0.0 < fpr < 1.0:
            raise ValueError(f"fpr: must be between 0 and 1, got {fpr}")
        for bits in _FP_BITS:
            if math.ldexp(1.0, -bits) <= fpr:
                return bits
        raise ValueError(f"fpr: the smallest supported rate is 2**-32, got {fpr}")

    @classmethod
    def build(cls, keys: KeyInput, fp_bits: int, *, seed: int = _DEFAULT_SEED) -> XorFilter:
        """A filter holding ``keys`` (duplicates allowed, ignored), fully vectorized.

        Args:
            keys: 16-byte keys: a sequence of ``bytes`` or a 1-D ``V16`` array (a structured
                field such as ``rows["key"]`` works; it is copied once if not contiguous).
            fp_bits: Fingerprint width, one of 8, 16, 24, 32.
            seed: The first hash seed tried; the same keys and seed give the same bytes.

        Raises:
            ValueError: bad ``fp_bits``, a key that is not 16 bytes, more than 2**30 keys,
                or no seed out of 10 could be peeled (practically impossible).
        """
        if fp_bits not in _FP_BITS:
            raise ValueError(f"fp_bits: must be one of {_FP_BITS}, got {fp_bits}")
        words = _key_words(keys)
        if len(words) > _MAX_KEYS:
            raise ValueError(f"keys: at most {_MAX_KEYS} keys, got {len(words)}")
        seed &= _MASK64
        checked_duplicates = False
        for _ in range(_ATTEMPTS):
            table, stuck = _peel(words, seed, fp_bits)
            # NOTE: duplicates are removed only when peeling fails (they always make it fail):
            # an up-front np.unique over 8M keys costs ~2.5 s and snapshots have none.
            while table is None and not checked_duplicates:
                checked_duplicates = True
                keep = _duplicates(words, stuck)
                if keep is not None:
                    words = words[keep]
                    table, stuck = _peel(words, seed, fp_bits)
            if table is not None:
                return cls(_pack(table, fp_bits), fp_bits, seed, len(words))
            seed = (seed + _SEED_STEP) & _MASK64
        raise ValueError(f"xor filter: no seed out of {_ATTEMPTS} peeled {len(words)} keys")

    # --- properties -----------------------------------------------------------------------

    @property
    def keys(self) -> int:
        """Distinct keys the filter was built from."""
        return self._keys

    @property
    def fp_bits(self) -> int:
        """Fingerprint width in bits; the false-positive rate is ``2**-fp_bits``."""
        return self._fp_bits

    @property
    def seed(self) -> int:
        """The hash seed construction settled on."""
        return self._seed

    @property
    def slots(self) -> int:
        """Table entries (0 for an empty filter)."""
        return 3 * self._seg

    @property
    def nbytes(self) -> int:
        """Bytes held by the fingerprint table."""
        return self._table.size

    def __repr__(self) -> str:
        return f"XorFilter(keys={self._keys}, fp_bits={self._fp_bits}, slots={self.slots})"

    # --- lookup ---------------------------------------------------------------------------

    def _present(self, words: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
        """Membership of each key of an ``(n, 2)`` halves array: three gathers per key."""
        if self._keys == 0:
            return np.zeros(len(words), dtype=np.bool_)
        h, f = _mix(words[:, 0], words[:, 1], self._seed)
        f &= np.uint64((1 << self._fp_bits) - 1)
        for slot in _slots(h, self._seg):
            f ^= self._entries(slot)
        present: npt.NDArray[np.bool_] = f == 0
        return present

    def _entries(self, slot: IntArray) -> U64Array:
        """Table entries at ``slot`` as uint64."""
        width = self._bytes_per_fp
        if width == 3:
            rows = self._table.reshape(-1, 3).take(slot, axis=0).astype(np.uint64)
            out: U64Array = rows[:, 0] | rows[:, 1] << np.uint64(8) | rows[:, 2] << np.uint64(16)
            return out
        typed = self._table.view({1: "<u1", 2: "<u2", 4: "<u4"}[width])
        return typed.take(slot).astype(np.uint64)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` may be in the set (pure Python, ~5 µs).

        Anything that is not a 16-byte ``bytes`` is reported absent.
        """
        if not isinstance(key, bytes) or len(key) != _KEY_BYTES or self._keys == 0:
            return False
        lo = int.from_bytes(key[:8], "little")
        hi = int.from_bytes(key[8:], "little")
        a = _fmix_int(lo ^ self._seed)
        h = _fmix_int(hi ^ a)
        f = (a ^ h ^ h >> 32) & ((1 << self._fp_bits) - 1)
        seg, width, view = self._seg, self._bytes_per_fp, self._view
        for i in range(3):
            w = (h << 21 * i | h >> 64 - 21 * i) & _MASK32
            at = (i * seg + (w * seg >> 32)) * width
            f ^= int.from_bytes(view[at : at + width], "little")
        return f == 0

    def contains_many(self, keys: KeyInput) -> npt.NDArray[np.bool_]:
        """Membership of each key, vectorized; a boolean array of ``len(keys)``.

        Args:
            keys: A sequence of 16-byte ``bytes`` or a 1-D ``V16`` array.

        Raises:
            ValueError: a key is not 16 bytes.
        """
        words = _key_words(keys)
        out = np.empty(len(words), dtype=np.bool_)
        for start in range(0, len(words), _CHUNK_KEYS):
            chunk = words[start : start + _CHUNK_KEYS]
            out[start : start + len(chunk)] = self._present(chunk)
        return out

    def count_leading(self, keys: KeyInput) -> int:
        """Length of the leading run of keys that may be present (0 for an empty list).

        The scheduler's hot path, as :meth:`BloomFilter.count_leading`: batches of keys are
        tested in one pass each and the first miss ends the scan.

        Raises:
            ValueError: a key is not 16 bytes.
        """
        words = _key_words(keys)
        for start in range(0, len(words), _CHUNK_KEYS):
            misses = np.flatnonzero(~self._present(words[start : start + _CHUNK_KEYS]))
            if misses.size:
                return start + int(misses[0])
        return len(words)

    # --- serialization --------------------------------------------------------------------

    @staticmethod
    def serialized_size(keys: int, fp_bits: int) -> int:
        """Length of :meth:`to_bytes` for a filter of ``keys`` keys (a bound for a GET)."""
        return _HEADER.size + _slots_for(keys) * (fp_bits // 8)

    def to_bytes(self) -> bytes:
        """The filter as ``header + table`` (header: magic, fp_bits, seed, slots, keys,
        xxh3_64 of the table)."""
        body = self._table.tobytes()
        header = _HEADER.pack(
            XOR_MAGIC,
            self._fp_bits,
            0,
            self._seed,
            self.slots,
            self._keys,
            xxhash.xxh3_64_intdigest(body),
        )
        return header + body

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> XorFilter:
        """Load and verify a filter written by :meth:`to_bytes`.

        Every header field is checked against the others and the byte length before anything
        is allocated, so a lying header costs nothing; the table is then copied once.

        Raises:
            BadMagicError: not a serialized xor filter.
            UnsupportedVersionError: a filter of another format version.
            TruncatedError: shorter than its header says.
            SizeMismatchError: longer than its header says, or impossible geometry.
            ChecksumError: the table does not match the stored checksum.
        """
        view = memoryview(data).cast("B")
        if len(view) < _HEADER.size:
            if bytes(view[: len(_MAGIC_STEM)]) == _MAGIC_STEM[: len(view)]:
                raise TruncatedError(f"xor filter: {len(view)} bytes is shorter than the header")
            raise BadMagicError("xor filter: not an s3kv xor filter")
        magic, fp_bits, _reserved, seed, slots, keys, checksum = _HEADER.unpack_from(view)
        if magic != XOR_MAGIC:
            if magic[: len(_MAGIC_STEM)] == _MAGIC_STEM:
                raise UnsupportedVersionError(f"xor filter: unsupported format {magic!r}")
            raise BadMagicError("xor filter: not an s3kv xor filter")
        if fp_bits not in _FP_BITS or keys > _MAX_KEYS or slots != _slots_for(keys):
            raise SizeMismatchError(
                f"xor filter: impossible geometry fp_bits={fp_bits} slots={slots} keys={keys}"
            )
        size = slots * (fp_bits // 8)
        body = view[_HEADER.size :]
        if len(body) < size:
            raise TruncatedError(f"xor filter: {len(body)} bytes of table, header says {size}")
        if len(body) > size:
            raise SizeMismatchError(f"xor filter: {len(body)} bytes of table, header says {size}")
        if xxhash.xxh3_64_intdigest(body) != checksum:
            raise ChecksumError("xor filter: table does not match the stored checksum")
        table = np.frombuffer(body, dtype=np.uint8).copy()
        return cls(table, fp_bits, seed, keys)


def _pack(table: npt.NDArray[np.uint32], fp_bits: int) -> npt.NDArray[np.uint8]:
    """The table's serialized bytes: little-endian entries of ``fp_bits / 8`` bytes."""
    wide = table.astype("<u4").view(np.uint8).reshape(-1, 4)
    return np.ascontiguousarray(wide[:, : fp_bits // 8]).ravel()
