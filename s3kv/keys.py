"""Block keys: chained prefix hashes, the model fingerprint and the object key layout.

A block's key must identify its KV bytes exactly, across processes, hosts and releases:

* :func:`hash_block` is SHA-256 (truncated to 128 bits) over a length-prefixed encoding of
  the parent block's hash, the block's token ids as fixed-width integers, the per-token
  extra ids, the LoRA task id, the multimodal item hashes with their offsets, and (first
  block only) the cache salt. Chaining through the parent makes block *i*'s key cover the
  whole prefix ``[0, (i + 1) * tokens_per_block)``. Python's ``hash()`` is never used: it is
  randomized per process.
* :class:`ModelIdentity` names everything that changes the meaning of the bytes (model and
  weights revision, dtypes, quantization, block geometry, layout, TP shard, format version).
  Its :meth:`~ModelIdentity.fingerprint` namespaces every object. An input that is unknown
  (``None`` or :data:`UNKNOWN`) fails *closed*: the fingerprint gets a per-process random
  component, so it can never match another instance's objects. Under tensor parallelism
  :func:`layout_fingerprint` (a digest of every shard's fingerprint) names what the shards
  of one layout share: the manifest.
* :func:`block_object_key` maps (prefix, fingerprint, hash) to the object key, with the hash's
  leading hex digits as a directory so that load and listings spread over key prefixes.
"""

from __future__ import annotations

import array
import hashlib
import json
import logging
import os
import struct
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Final, NewType, overload

import numpy as np
import numpy.typing as npt

from s3kv.errors import KeyDerivationError

logger = logging.getLogger(__name__)

#: Version of the object format and key layout; part of every fingerprint.
FORMAT_VERSION: Final = 1

#: A block key: 16 bytes of a chained SHA-256. Distinct from ``bytes`` for the type checker.
BlockHash = NewType("BlockHash", bytes)
HASH_BYTES: Final = 16
#: The parent of the first block of every chain.
ROOT_HASH: Final = BlockHash(bytes(HASH_BYTES))

#: Marks an identity field whose true value is not known; the fingerprint then fails closed.
UNKNOWN: Final = "<unknown>"

_BLOCK_DOMAIN: Final = b"s3kv/block/v1\x00"
_FINGERPRINT_DOMAIN: Final = "s3kv/fingerprint/v1"
_LAYOUT_DOMAIN: Final = "s3kv/layout/v1"
_MAX_TOKEN: Final = 2**32 - 1
_SHARD_HEX_DIGITS: Final = 2
#: Per-process nonce used when an identity input is unknown (fail closed).
_PROCESS_NONCE: Final = os.urandom(16).hex()


@dataclass(frozen=True)
class MultimodalItem:
    """One multimodal input placed in the prompt.

    Attributes:
        content_hash: Digest of the item's content (TensorRT-LLM passes 32 bytes).
        start: Token position of the item's first placeholder token in the prompt.
        length: Number of prompt tokens the item occupies.
    """

    content_hash: bytes
    start: int
    length: int

    def __post_init__(self) -> None:
        if not self.content_hash or len(self.content_hash) > 255:
            raise KeyDerivationError("MultimodalItem.content_hash: must be 1..255 bytes")
        if self.start < 0 or self.length <= 0:
            raise KeyDerivationError(
                f"MultimodalItem: start must be >= 0 and length > 0, got "
                f"start={self.start} length={self.length}"
            )


def _u32(value: int) -> bytes:
    return struct.pack("<I", value)


def _u64(value: int, what: str) -> bytes:
    if not 0 <= value < 2**64:
        raise KeyDerivationError(f"{what}: must be in 0..2**64-1, got {value}")
    return struct.pack("<Q", value)


def tokens_to_array(tokens: Sequence[int] | npt.NDArray[np.integer]) -> npt.NDArray[np.uint32]:
    """Token ids as a little-endian uint32 array, validating the range 0..2**32-1."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise KeyDerivationError(f"tokens: expected a 1-D sequence, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    if not np.issubdtype(arr.dtype, np.integer):
        raise KeyDerivationError(f"tokens: expected integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN:
        raise KeyDerivationError("tokens: every token id must be in 0..2**32-1")
    return arr.astype("<u4", copy=False)


def _block_digest(
    parent: bytes,
    token_bytes: bytes,
    n_tokens: int,
    extra_bytes: bytes | None,
    lora_task_id: int | None,
    mm_parts: Sequence[tuple[bytes, int, int]],
    salt: bytes | None,
) -> BlockHash:
    # NOTE: one sha256() over a joined buffer: the per-call overhead of hashlib dominates
    # at 32 tokens per block (~4x faster than eight update() calls).
    parts = [_BLOCK_DOMAIN, parent, _u32(n_tokens), token_bytes]
    parts.append(b"\x00" if extra_bytes is None else b"\x01" + extra_bytes)
    parts.append(b"\x00" if lora_task_id is None else b"\x01" + _u64(lora_task_id, "lora_task_id"))
    parts.append(_u32(len(mm_parts)))
    for content_hash, item_offset, block_offset in mm_parts:
        parts.append(bytes([len(content_hash)]))
        parts.append(content_hash)
        parts.append(_u64(item_offset, "multimodal item offset"))
        parts.append(_u64(block_offset, "multimodal block offset"))
    parts.append(b"\x00" if salt is None else b"\x01" + _u32(len(salt)) + salt)
    return BlockHash(hashlib.sha256(b"".join(parts)).digest()[:HASH_BYTES])


def hash_block(
    parent: BlockHash,
    tokens: Sequence[int] | npt.NDArray[np.integer],
    *,
    extra_ids: Sequence[int] | None = None,
    lora_task_id: int | None = None,
    multimodal: Sequence[tuple[bytes, int, int]] = (),
    cache_salt: str | bytes | None = None,
) -> BlockHash:
    """Hash one block, chained to ``parent``.

    Args:
        parent: The previous block's hash, or :data:`ROOT_HASH` for the first block.
        tokens: The block's token ids.
        extra_ids: One extra id per token (TensorRT-LLM's per-token extra ids), or ``None``.
        lora_task_id: The LoRA adapter's task id, or ``None`` for the base model.
        multimodal: ``(content_hash, offset_within_item, offset_within_block)`` for each
            multimodal item overlapping the block: where in the item the block's overlap
            starts, and where in the block the item starts (stricter than TensorRT-LLM, which
            keys only the former; placeholder tokens alone cannot tell the two apart).
        cache_salt: Tenant/isolation salt; only allowed on the first block (later blocks
            inherit it through the chain, as in TensorRT-LLM's ``blockKey.cpp``).

    Raises:
        KeyDerivationError: malformed input (wrong lengths, out-of-range ids, salt on a
            non-first block).
    """
    if len(parent) != HASH_BYTES:
        raise KeyDerivationError(f"parent: expected {HASH_BYTES} bytes, got {len(parent)}")
    arr = tokens_to_array(tokens)
    extra_bytes = _extra_bytes(extra_ids, arr.size)
    salt = _salt_bytes(cache_salt)
    if salt is not None and parent != ROOT_HASH:
        raise KeyDerivationError("cache_salt: only the first block (parent=ROOT_HASH) takes it")
    return _block_digest(
        parent, arr.tobytes(), arr.size, extra_bytes, lora_task_id, multimodal, salt
    )


def chain_hashes(
    tokens: Sequence[int] | npt.NDArray[np.integer],
    tokens_per_block: int,
    *,
    extra_ids: Sequence[int] | None = None,
    lora_task_id: int | None = None,
    multimodal: Sequence[MultimodalItem] = (),
    cache_salt: str | bytes | None = None,
    max_blocks: int | None = None,
) -> list[BlockHash]:
    """Chained hashes of the *full* blocks of ``tokens`` (a trailing partial block is skipped).

    Equivalent to calling :func:`hash_block` block by block, but converts the tokens once.
    :class:`KeyChain` gives the same keys hashed on demand.

    Raises:
        KeyDerivationError: as :func:`hash_block`, or ``tokens_per_block < 1``.
    """
    _check_tokens_per_block(tokens_per_block)
    token_bytes = _token_bytes(tokens)
    n_tokens = len(token_bytes) // 4
    n_blocks = n_tokens // tokens_per_block
    if max_blocks is not None:
        n_blocks = min(n_blocks, max_blocks)
    inputs = _Inputs.of(extra_ids, lora_task_id, multimodal, cache_salt, n_tokens)
    return _hash_blocks(token_bytes, tokens_per_block, ROOT_HASH, 0, n_blocks, inputs)


def _check_tokens_per_block(tokens_per_block: int) -> None:
    if tokens_per_block < 1:
        raise KeyDerivationError(f"tokens_per_block: must be >= 1, got {tokens_per_block}")


def _token_bytes(tokens: Sequence[int] | npt.NDArray[np.integer]) -> bytes:
    """``tokens`` as little-endian uint32 bytes, validated as :func:`tokens_to_array` does."""
    if isinstance(tokens, array.array) and tokens.typecode == "I" and tokens.itemsize == 4:
        if sys.byteorder != "little":
            tokens = array.array("I", tokens)
            tokens.byteswap()
        return tokens.tobytes()  # NOTE: a compacted chain's tokens (KeyChain.compact)
    if isinstance(tokens, list | tuple):
        # NOTE: array("I") converts and range-checks a list of ints ~2-3x faster than
        # np.asarray (the scheduler's path at 128K tokens); anything it refuses takes the
        # numpy path, which names the problem.
        try:
            packed = array.array("I", tokens)
        except (OverflowError, TypeError):
            pass
        else:
            if packed.itemsize == 4:
                if sys.byteorder != "little":
                    packed.byteswap()
                return packed.tobytes()
    return tokens_to_array(tokens).tobytes()


@dataclass(frozen=True)
class _Inputs:
    """The key inputs beyond the tokens, validated and encoded once."""

    extra: bytes | None  # 8 bytes per token of the whole sequence
    lora_task_id: int | None
    multimodal: tuple[MultimodalItem, ...]
    salt: bytes | None

    @classmethod
    def of(
        cls,
        extra_ids: Sequence[int] | None,
        lora_task_id: int | None,
        multimodal: Sequence[MultimodalItem],
        cache_salt: str | bytes | None,
        n_tokens: int,
    ) -> _Inputs:
        if lora_task_id is not None:
            _u64(lora_task_id, "lora_task_id")
        return cls(
            _extra_bytes(extra_ids, n_tokens),
            lora_task_id,
            tuple(multimodal),
            _salt_bytes(cache_salt),
        )

    @property
    def plain(self) -> bool:
        return self.extra is None and self.lora_task_id is None and not self.multimodal


def _hash_blocks(
    token_bytes: bytes,
    tokens_per_block: int,
    parent: BlockHash,
    first: int,
    n_blocks: int,
    inputs: _Inputs,
) -> list[BlockHash]:
    """Keys of blocks ``first .. first + n_blocks - 1`` chained from ``parent``.

    ``token_bytes`` holds those blocks' tokens (uint32 LE) from block ``first`` on.
    """
    width = 4 * tokens_per_block
    out: list[BlockHash] = []
    if inputs.plain and n_blocks:
        start = 0
        if first == 0:  # the first block alone may carry the salt
            parent = _block_digest(
                parent, token_bytes[:width], tokens_per_block, None, None, (), inputs.salt
            )
            out.append(parent)
            start = 1
        # NOTE: the common case, inlined: the same bytes as _block_digest, built with one
        # join per block (Python overhead, not SHA-256, dominates at 32 tokens per block;
        # hence no BlockHash() call per key either: NewType's call is a Python function).
        head, tail = _BLOCK_DOMAIN, _u32(tokens_per_block)
        suffix = b"\x00\x00" + _u32(0) + b"\x00"
        sha256, join, append = hashlib.sha256, b"".join, out.append
        digest: bytes = parent
        for lo in range(start * width, n_blocks * width, width):
            tokens = token_bytes[lo : lo + width]
            digest = sha256(join((head, digest, tail, tokens, suffix))).digest()[:HASH_BYTES]
            append(digest)  # type: ignore[arg-type]  # a BlockHash, without the call
        return out
    for i in range(n_blocks):
        block = first + i
        start, end = block * tokens_per_block, (block + 1) * tokens_per_block
        extra = None if inputs.extra is None else inputs.extra[8 * start : 8 * end]
        mm_parts = [
            (item.content_hash, max(0, start - item.start), max(0, item.start - start))
            for item in inputs.multimodal
            if item.start < end and item.start + item.length > start
        ]
        parent = _block_digest(
            parent,
            token_bytes[i * width : (i + 1) * width],
            tokens_per_block,
            extra,
            inputs.lora_task_id,
            mm_parts,
            inputs.salt if block == 0 else None,
        )
        out.append(parent)
    return out


#: Approximate bytes per cached key: a 16-byte ``bytes`` object and its list slot.
KEY_OVERHEAD: Final = 57

_PLAIN: Final = _Inputs(None, None, (), None)


class KeyRun:
    """Consecutive plain blocks whose keys are still to be hashed: what :func:`chain_from`
    needs, so that whoever uses the keys can hash them later, elsewhere.

    The tokens may be given as bytes, or (:meth:`deferred`) as a range of a :class:`KeyChain`'s
    tokens, read and converted the first time the run is read: by whoever hashes the keys or
    pickles the run, not by whoever plans it. Immutable; equal runs compare equal.

    Args:
        parent: The key of the block before the run (never a sequence's first block).
        tokens: The run's tokens, uint32 little-endian, whole blocks.
        tokens_per_block: Tokens per block.
    """

    __slots__ = ("_nbytes", "_source", "_tokens", "blocks", "parent", "tokens_per_block")

    parent: bytes
    tokens_per_block: int
    #: Blocks in the run.
    blocks: int
    _nbytes: int
    _tokens: bytes | None  # None until the deferred source is converted
    _source: tuple[KeyChain, int, int] | None  # (chain, first token, end) still to read

    def __init__(self, parent: bytes, tokens: bytes, tokens_per_block: int) -> None:
        self._init(parent, tokens_per_block, len(tokens), bytes(tokens), None)

    @classmethod
    def deferred(cls, parent: bytes, chain: KeyChain, start: int, stop: int) -> KeyRun:
        """The run of ``chain``'s blocks ``start .. stop - 1`` after the block keyed
        ``parent``, read from the chain when the run is first read."""
        tpb = chain.tokens_per_block
        run = cls.__new__(cls)
        run._init(parent, tpb, 4 * tpb * max(0, stop - start), None, (chain, start, stop))
        return run

    def _init(
        self,
        parent: bytes,
        tokens_per_block: int,
        nbytes: int,
        tokens: bytes | None,
        source: tuple[KeyChain, int, int] | None,
    ) -> None:
        _check_tokens_per_block(tokens_per_block)
        setter = object.__setattr__
        setter(self, "parent", bytes(parent))
        setter(self, "tokens_per_block", tokens_per_block)
        # NOTE: a partial block counts as none; SaveOps refuses runs that are not whole
        setter(self, "blocks", nbytes // 4 // tokens_per_block)
        setter(self, "_nbytes", nbytes)
        setter(self, "_tokens", tokens)
        setter(self, "_source", source)

    @property
    def nbytes(self) -> int:
        """Bytes of :attr:`tokens` (known without converting a deferred source)."""
        return self._nbytes

    @property
    def tokens(self) -> bytes:
        """The run's tokens, uint32 little-endian (a deferred run's read now, once).

        Raises:
            KeyDerivationError: a deferred run's chain holds a token outside 0..2**32-1, or
                let go of the tokens once it hashed their blocks (:meth:`keys` still answers).
        """
        read = self._read()
        if isinstance(read, bytes):
            return read
        raise KeyDerivationError(
            "a run's tokens were released once the chain hashed its blocks: read its keys"
        )

    def keys(self) -> list[BlockHash]:
        """The run's keys (what :class:`KeyChain` gives for the same blocks).

        Raises:
            KeyDerivationError: a deferred run's chain holds a token outside 0..2**32-1.
        """
        read = self._read()
        if isinstance(read, bytes):
            return chain_from(self.parent, read, self.tokens_per_block)
        return read  # NOTE: the chain hashed these blocks and let go of their tokens

    def _read(self) -> bytes | list[BlockHash]:
        """The tokens (converted once), or the keys where the chain let go of the tokens.

        NOTE: threads may race here: each reads the slots once, converts what it read and
        stores the same bytes; the source goes only after the bytes are stored.
        """
        tokens, source = self._tokens, self._source
        if tokens is not None:
            return tokens
        if source is None:  # NOTE: another thread converted it between the two reads
            assert self._tokens is not None
            return self._tokens
        chain, start, stop = source
        held, keys = chain.read_run(start, stop)
        if held is None:
            return keys
        tokens = _token_bytes(held)
        object.__setattr__(self, "_tokens", tokens)
        object.__setattr__(self, "_source", None)
        return tokens

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"KeyRun is immutable: cannot set {name}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KeyRun):
            return NotImplemented
        return (self.parent, self.tokens_per_block, self.tokens) == (
            other.parent,
            other.tokens_per_block,
            other.tokens,
        )

    def __hash__(self) -> int:
        return hash((self.parent, self.tokens_per_block, self.tokens))

    def __reduce__(self) -> tuple[type[KeyRun], tuple[bytes, bytes, int]]:
        # NOTE: travels as bytes: 4 per token, whatever the source was
        return (KeyRun, (self.parent, self.tokens, self.tokens_per_block))

    def __repr__(self) -> str:
        return f"KeyRun({self.blocks} blocks after {self.parent.hex()[:8]})"


def chain_from(parent: bytes, token_bytes: bytes, tokens_per_block: int) -> list[BlockHash]:
    """Keys of plain blocks that follow the block keyed ``parent`` in a sequence.

    Plain: no per-token extra ids, LoRA task or multimodal item (a cache salt only enters a
    sequence's first block, which never follows a parent). ``token_bytes``: the blocks'
    tokens as uint32 little-endian, whole blocks.

    Raises:
        KeyDerivationError: ``parent`` is not a key, or the tokens are not whole blocks.
    """
    _check_tokens_per_block(tokens_per_block)
    width = 4 * tokens_per_block
    if len(parent) != HASH_BYTES or len(token_bytes) % width:
        raise KeyDerivationError(
            f"chain_from: a {HASH_BYTES}-byte parent and whole blocks of {width} token bytes "
            f"are needed, got {len(parent)} and {len(token_bytes)}"
        )
    return _hash_blocks(
        token_bytes, tokens_per_block, BlockHash(parent), 1, len(token_bytes) // width, _PLAIN
    )


class KeyChain(Sequence[BlockHash]):
    """The chained keys of one request's tokens, hashed on demand, each block once.

    ``chain[i]`` is ``chain_hashes(tokens, tokens_per_block, **inputs)[i]``: the same keys,
    but a block is hashed only when some caller first needs it (at least :attr:`STEP`
    blocks at a time), by whichever thread asks, and kept. Slices are lazy views; iterating
    one hashes as it goes, in steps that double up to :attr:`MAX_STEP`, so a caller that
    stops at the first miss pays for one step, not the rest. :meth:`extend` appends tokens
    (decode) and the chain goes on from its last key.

    Thread-safe: hashing happens under a lock held for at most :attr:`MAX_STEP` blocks at a
    time, so a thread that needs a few keys never waits for another hashing a long tail.
    Malformed tokens raise :class:`~s3kv.errors.KeyDerivationError` from whoever first needs
    their block; malformed key inputs raise from the constructor.

    Memory: about :data:`KEY_OVERHEAD` bytes per hashed block, plus a reference to the tokens
    not hashed yet (released once every full block is hashed).

    Args:
        tokens: The token ids (referenced, not copied: do not mutate them).
        tokens_per_block: Tokens per block.
        extra_ids, lora_task_id, multimodal, cache_salt: as :func:`chain_hashes`.
    """

    #: Fewest blocks hashed per step (amortizes a step's fixed cost). NOTE: small, as a cold
    #: prompt's claim asks for one key: blocks it does not hash go to the workers unhashed
    #: (run_of), and every block hashed here is hashed before the forward pass.
    STEP: Final = 8
    #: Most blocks hashed while holding the lock.
    MAX_STEP: Final = 512

    def __init__(
        self,
        tokens: Sequence[int],
        tokens_per_block: int,
        *,
        extra_ids: Sequence[int] | None = None,
        lora_task_id: int | None = None,
        multimodal: Sequence[MultimodalItem] = (),
        cache_salt: str | bytes | None = None,
    ) -> None:
        _check_tokens_per_block(tokens_per_block)
        self._tpb = tokens_per_block
        self._inputs = _Inputs.of(extra_ids, lora_task_id, multimodal, cache_salt, len(tokens))
        self._tokens: Sequence[int] = tokens  # tokens from index self._base on
        self._owned = False  # self._tokens is this chain's own list (extend appends to it)
        self._base = 0
        self._total = len(tokens)
        self._keys: list[BlockHash] = []
        self._lock = threading.Lock()

    @property
    def num_tokens(self) -> int:
        """Tokens given so far (the constructor's and :meth:`extend`'s)."""
        return self._total

    @property
    def tokens_per_block(self) -> int:
        """Tokens per block."""
        return self._tpb

    @property
    def hashed(self) -> int:
        """Blocks hashed so far."""
        return len(self._keys)

    @property
    def nbytes(self) -> int:
        """Approximate memory held: the keys plus references to tokens not hashed yet."""
        per_token = 4 if isinstance(self._tokens, array.array) else 8
        return len(self._keys) * KEY_OVERHEAD + per_token * (self._total - self._base)

    def __len__(self) -> int:
        return self._total // self._tpb

    @overload
    def __getitem__(self, index: int) -> BlockHash: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[BlockHash]: ...

    def __getitem__(self, index: int | slice) -> BlockHash | Sequence[BlockHash]:
        return _view_item(self, 0, len(self), index)

    def __iter__(self) -> Iterator[BlockHash]:
        return _iterate(self, 0, len(self))

    def ensure(self, n_blocks: int) -> None:
        """Hash blocks up to ``n_blocks`` (at most :func:`len`) now."""
        n_blocks = min(n_blocks, len(self))
        while len(self._keys) < n_blocks:
            with self._lock:
                have = len(self._keys)
                if have >= n_blocks:
                    return
                available = self._total // self._tpb
                upto = min(available, max(n_blocks, have + self.STEP), have + self.MAX_STEP)
                self._hash(have, upto)

    def keys(self, start: int, stop: int) -> list[BlockHash]:
        """Keys of blocks ``start .. stop - 1`` (``stop`` at most :func:`len`), hashed now.

        One call for a run of blocks: what a loop of ``chain[i]`` costs per block, once.
        """
        self.ensure(stop)
        return self._keys[start:stop]

    def run_of(self, start: int, stop: int) -> KeyRun | None:
        """Blocks ``start .. stop - 1`` as a :class:`KeyRun` to hash elsewhere, or ``None``
        where they cannot be: the chain's inputs are not plain, ``start`` is 0, block
        ``start - 1`` is not hashed yet, or the blocks are hashed already (their keys are
        free). This chain does not hash them (it would if asked later).
        """
        stop = min(stop, len(self))
        if not (0 < start < stop) or not self._inputs.plain:
            return None
        with self._lock:
            have = len(self._keys)
            tpb, base = self._tpb, self._base
            if have < start or have >= stop or start * tpb < base:  # NOTE: tokens dropped
                return None
            # NOTE: read from the chain when the run is hashed or pickled, not converted
            # here (8K tokens: 30-90 us before the forward pass); through the chain, so that
            # compact() can let go of the list the tokens came in.
            return KeyRun.deferred(self._keys[start - 1], self, start, stop)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` (those after the ones given so far).

        Raises:
            KeyDerivationError: the chain has per-token extra ids (they cannot be extended).
        """
        if not tokens:
            return
        if self._inputs.extra is not None:
            raise KeyDerivationError("extra_ids: a chain with per-token extra ids cannot grow")
        with self._lock:
            held = self._tokens
            if self._owned and isinstance(held, list):
                held.extend(tokens)
            elif self._owned and isinstance(held, array.array):
                packed = _packed(tokens)
                if packed is not None:
                    held.extend(packed)
                else:  # NOTE: a bad token raises where its block is hashed, not here
                    self._tokens = [*held.tolist(), *tokens]
            else:  # NOTE: the caller's sequence is never mutated
                self._tokens, self._owned = [*held, *tokens], True
            self._total += len(tokens)

    def compact(self) -> None:
        """Hold the tokens not hashed yet as packed uint32 (an ``array``) instead of the list
        they came in, which the chain then no longer references.

        NOTE: a prompt's ints in a list cost every garbage collection that finds the list
        young a pass over them: a cold 8K-token prompt's lists added 0.13-0.16 ms to ten
        young collections (``bench_scheduler.py``'s ``scheduler.young_collections_ms``).
        Packing costs 30-90 us, so the scheduler calls this once the forward pass is queued.
        Tokens that cannot be packed (not all in 0..2**32-1) stay as they are: they raise
        where their block is hashed.
        """
        with self._lock:
            if isinstance(self._tokens, array.array) or self._base >= self._total:
                return
            packed = _packed(self._tokens)
            if packed is not None:
                self._tokens, self._owned = packed, True

    def read_run(self, start: int, stop: int) -> tuple[Sequence[int] | None, list[BlockHash]]:
        """Blocks ``start .. stop - 1``: ``(tokens, [])`` where the chain still holds their
        tokens, else ``(None, keys)`` (it let go of them once every full block was hashed);
        in one step under the lock, so that no other thread's hashing comes between."""
        with self._lock:
            tpb, base = self._tpb, self._base
            if start * tpb >= base:
                return self._tokens[start * tpb - base : stop * tpb - base], []
            return None, self._keys[start:stop]

    def _hash(self, have: int, upto: int) -> None:
        """Caller holds the lock."""
        tpb, base = self._tpb, self._base
        chunk = self._tokens[have * tpb - base : upto * tpb - base]
        parent = self._keys[-1] if self._keys else ROOT_HASH
        keys = _hash_blocks(_token_bytes(chunk), tpb, parent, have, upto - have, self._inputs)
        self._keys.extend(keys)
        if upto == self._total // tpb:  # NOTE: every full block hashed: drop the prompt
            rest = self._tokens[upto * tpb - base :]
            self._tokens = rest if isinstance(rest, array.array) else list(rest)
            self._owned, self._base = True, upto * tpb


def _packed(tokens: Sequence[int]) -> array.array[int] | None:
    """``tokens`` as an ``array("I")`` (4-byte items), or ``None`` where they do not fit."""
    if not isinstance(tokens, list | tuple):
        return None
    try:
        packed = array.array("I", tokens)
    except (OverflowError, TypeError):
        return None
    return packed if packed.itemsize == 4 else None


class _View(Sequence[BlockHash]):
    """Blocks ``start .. stop - 1`` of a :class:`KeyChain`, hashed on demand."""

    def __init__(self, chain: KeyChain, start: int, stop: int) -> None:
        self._chain, self._start, self._stop = chain, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    @overload
    def __getitem__(self, index: int) -> BlockHash: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[BlockHash]: ...

    def __getitem__(self, index: int | slice) -> BlockHash | Sequence[BlockHash]:
        return _view_item(self._chain, self._start, self._stop, index)

    def __iter__(self) -> Iterator[BlockHash]:
        return _iterate(self._chain, self._start, self._stop)


def _view_item(
    chain: KeyChain, start: int, stop: int, index: int | slice
) -> BlockHash | Sequence[BlockHash]:
    n = stop - start
    if isinstance(index, slice):
        lo, hi, step = index.indices(n)
        if step != 1:
            return list(_iterate(chain, start, stop))[index]
        return _View(chain, start + lo, start + max(lo, hi))
    i = index + n if index < 0 else index
    if not 0 <= i < n:
        raise IndexError("KeyChain index out of range")
    chain.ensure(start + i + 1)
    return chain._keys[start + i]


def _iterate(chain: KeyChain, start: int, stop: int) -> Iterator[BlockHash]:
    if len(chain._keys) >= stop:  # NOTE: hashed already: a plain list iterator (C speed)
        return iter(chain._keys[start:stop])
    return _iterate_lazily(chain, start, stop)


def _iterate_lazily(chain: KeyChain, start: int, stop: int) -> Iterator[BlockHash]:
    """Hash in growing steps as the caller goes: a caller stopping early paid for one step."""
    i, step = start, KeyChain.STEP
    while i < stop:
        end = min(stop, i + step)
        chain.ensure(end)
        yield from chain._keys[i:end]
        i, step = end, min(2 * step, KeyChain.MAX_STEP)


def _extra_bytes(extra_ids: Sequence[int] | None, n_tokens: int) -> bytes | None:
    if extra_ids is None:
        return None
    extra = np.asarray(extra_ids)
    if extra.shape != (n_tokens,):
        raise KeyDerivationError(
            f"extra_ids: expected one id per token ({n_tokens}), got shape {extra.shape}"
        )
    if extra.size and (int(extra.min()) < 0 or not np.issubdtype(extra.dtype, np.integer)):
        raise KeyDerivationError("extra_ids: every id must be a non-negative integer")
    return extra.astype("<u8", copy=False).tobytes()


def _salt_bytes(cache_salt: str | bytes | None) -> bytes | None:
    if cache_salt is None:
        return None
    if isinstance(cache_salt, str):
        return cache_salt.encode("utf-8")
    return bytes(cache_salt)


@dataclass(frozen=True, kw_only=True)
class ModelIdentity:
    """Everything that determines the meaning of a block's bytes.

    Every field is required. Use :data:`UNKNOWN` (or ``None``) where a value truly cannot be
    determined: the fingerprint then fails closed (never shared with another process).

    Attributes:
        model_id: Model name or path as the operator knows it.
        weights_revision: Immutable revision of the weights (commit, checksum of the files).
        dtype: Activation/compute dtype, e.g. ``"bfloat16"``.
        kv_dtype: KV-cache element dtype, e.g. ``"bfloat16"``, ``"fp8_e4m3"``.
        quantization: Weight/KV quantization scheme, ``"none"`` if unquantized.
        tokens_per_block: Tokens per KV block.
        kv_factor: 2 for K and V, 1 for K-only caches (MLA).
        block_elems: Elements per block per layer per kv-factor slot.
        num_layers: Attention layers held in the pool.
        layout: Attention backend and in-block layout, e.g. ``"trtllm/HND"``.
        tp_size: Tensor-parallel world size.
        tp_rank: This shard's rank.
        format_version: s3kv object/key format version.
        extra: Further identity inputs as sorted ``(name, value)`` pairs.
    """

    model_id: str | None
    weights_revision: str | None
    dtype: str | None
    kv_dtype: str | None
    quantization: str | None
    tokens_per_block: int
    kv_factor: int
    block_elems: int
    num_layers: int
    layout: str | None
    tp_size: int = 1
    tp_rank: int = 0
    format_version: int = FORMAT_VERSION
    extra: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name in ("tokens_per_block", "block_elems", "num_layers", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise KeyDerivationError(f"ModelIdentity.{name}: must be an int >= 1")
        if self.kv_factor not in (1, 2):
            raise KeyDerivationError(
                f"ModelIdentity.kv_factor: must be 1 or 2, not {self.kv_factor}"
            )
        if not 0 <= self.tp_rank < self.tp_size:
            raise KeyDerivationError(
                f"ModelIdentity.tp_rank: must be in 0..tp_size-1, got {self.tp_rank}"
            )
        for name in ("model_id", "weights_revision", "dtype", "kv_dtype", "quantization", "layout"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise KeyDerivationError(
                    f"ModelIdentity.{name}: must be a non-empty string, None or UNKNOWN"
                )
        if any(not isinstance(k, str) or not isinstance(v, str) for k, v in self.extra):
            raise KeyDerivationError("ModelIdentity.extra: must hold (str, str) pairs")

    @property
    def is_shareable(self) -> bool:
        """False when some input is unknown: the fingerprint is then unique to this process."""
        return all(getattr(self, f.name) not in (None, UNKNOWN) for f in fields(self)) and all(
            v != UNKNOWN for _, v in self.extra
        )

    def as_dict(self) -> dict[str, object]:
        """The identity as JSON-ready data (also written next to the objects for operators)."""
        data: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)}
        data["extra"] = [list(pair) for pair in sorted(self.extra)]
        return data

    def fingerprint(self) -> str:
        """A 32-hex-digit namespace for this identity's objects.

        Stable across processes for a shareable identity; if any input is unknown, it mixes
        in a per-process random nonce (fail closed) and logs a warning.
        """
        data = self.as_dict()
        if not self.is_shareable:
            logger.warning(
                "s3kv: model identity has unknown inputs; using a process-private fingerprint "
                "(blocks will not be shared with other instances)"
            )
            data["nonce"] = _PROCESS_NONCE
        payload = json.dumps([_FINGERPRINT_DOMAIN, data], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:32]


def layout_fingerprint(shards: Sequence[ModelIdentity]) -> str:
    """The fingerprint of a tensor-parallel layout: what all of its shards share.

    It names the layout's one manifest (the block keys are the same on every shard), while
    each shard's blocks stay under its own :meth:`~ModelIdentity.fingerprint`. It is a digest
    of the shards' fingerprints in rank order, not of one identity with the rank blanked out:
    shards may differ in more than their rank (KV heads that do not divide evenly give each
    rank its own ``block_elems``), and a manifest may only be shared by engines whose shards
    all live under the same fingerprints. It fails closed with them. With one shard it *is*
    that shard's fingerprint, so single-GPU buckets keep their manifest where it is.

    Args:
        shards: Every shard's identity, in rank order.

    Raises:
        KeyDerivationError: ``shards`` is not one whole layout in rank order.
    """
    if not shards or [s.tp_rank for s in shards] != list(range(len(shards))):
        raise KeyDerivationError("layout_fingerprint: expects every shard, in rank order")
    if any(s.tp_size != len(shards) for s in shards):
        raise KeyDerivationError("layout_fingerprint: tp_size must equal the number of shards")
    if len(shards) == 1:
        return shards[0].fingerprint()
    payload = json.dumps([_LAYOUT_DOMAIN, [s.fingerprint() for s in shards]])
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:32]


def _join(prefix: str, *parts: str) -> str:
    clean = prefix.strip("/")
    return "/".join((clean, *parts)) if clean else "/".join(parts)


def fingerprint_prefix(prefix: str, fingerprint: str) -> str:
    """The key prefix (ending in ``/``) under which one fingerprint's objects live."""
    return _join(prefix, fingerprint) + "/"


def block_key_head(prefix: str, fingerprint: str) -> str:
    """What every block object key of one fingerprint starts with: ``<prefix>/<fingerprint>/
    blocks/`` (ending in ``/``; also the prefix that lists them)."""
    return _join(prefix, fingerprint, "blocks") + "/"


def block_key_under(head: str, block_hash: bytes) -> str:
    """The object key of ``block_hash`` under ``head`` (:func:`block_key_head`): callers that
    compose many keys of one fingerprint join the head once."""
    hex_hash = block_hash.hex()
    return f"{head}{hex_hash[:_SHARD_HEX_DIGITS]}/{hex_hash}"


def block_object_key(prefix: str, fingerprint: str, block_hash: BlockHash) -> str:
    """The object key of a block: ``<prefix>/<fingerprint>/blocks/<hh>/<hash hex>``."""
    return block_key_under(block_key_head(prefix, fingerprint), block_hash)


def block_object_keys(prefix: str, fingerprint: str, hashes: Iterable[bytes]) -> list[str]:
    """:func:`block_object_key` of each of ``hashes``, the common head joined once."""
    head = block_key_head(prefix, fingerprint)
    return [block_key_under(head, block_hash) for block_hash in hashes]


def parse_block_object_key(prefix: str, key: str) -> tuple[str, BlockHash] | None:
    """Inverse of :func:`block_object_key`; ``None`` if ``key`` is not a block key."""
    base = _join(prefix, "")
    if not key.startswith(base):
        return None
    parts = key[len(base) :].split("/")
    if len(parts) != 4 or parts[1] != "blocks":
        return None
    fingerprint, _, shard, hex_hash = parts
    if len(hex_hash) != 2 * HASH_BYTES or not hex_hash.startswith(shard):
        return None
    try:
        return fingerprint, BlockHash(bytes.fromhex(hex_hash))
    except ValueError:
        return None


def manifest_prefix(prefix: str, fingerprint: str) -> str:
    """The key prefix (ending in ``/``) of one fingerprint's manifest objects."""
    return _join(prefix, fingerprint, "manifest") + "/"


def identity_object_key(prefix: str, fingerprint: str) -> str:
    """Key of the JSON description of a fingerprint's :class:`ModelIdentity`."""
    return _join(prefix, fingerprint, "identity.json")


__all__ = [
    "BlockHash",
    "FORMAT_VERSION",
    "HASH_BYTES",
    "KEY_OVERHEAD",
    "KeyChain",
    "KeyRun",
    "ModelIdentity",
    "MultimodalItem",
    "ROOT_HASH",
    "UNKNOWN",
    "block_key_head",
    "block_key_under",
    "block_object_key",
    "block_object_keys",
    "chain_from",
    "chain_hashes",
    "fingerprint_prefix",
    "hash_block",
    "identity_object_key",
    "layout_fingerprint",
    "manifest_prefix",
    "parse_block_object_key",
    "tokens_to_array",
]
