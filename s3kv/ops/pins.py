"""Pins: prefixes that prune keeps and warm start stages first.

A pin is a manifest record (kind ``pin``/``unpin``; the latest one of a key wins, see
:mod:`s3kv.manifest.usage`), written here as one new segment per fingerprint, so engines
and ``prune`` see it at their next manifest read and nothing is rewritten in place.

Targets come from key hex (``s3kv pin KEY...``) or from prompt text: the text is tokenized
(transformers, an optional dependency) and :func:`s3kv.keys.chain_hashes` gives the keys of
its full blocks, with ``tokens_per_block`` from the fingerprint's ``identity.json`` unless
given. A pin must name a block that exists: the manifest only keeps usage of live keys, so
a pin on a key never written would be dropped at the next compaction. Keys whose object
exists but that the manifest does not know (a lost segment) are recorded as written first.
Prune keeps the ancestors of pinned blocks too, so pinning a chain's last block keeps the
whole prefix loadable.

Pins live in the manifest that describes the blocks
(:attr:`~s3kv.ops.scope.Fingerprint.manifest_fingerprint`): a TP shard's and its layout's
are the layout's manifest, which engines read. A manifest shared by several fingerprints in
scope is acted on (and listed) once. Under TP a key the manifest does not know is adopted
only if every shard holds its object (one HEAD per shard), with the largest shard's size.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from s3kv.errors import ConfigError, KeyDerivationError
from s3kv.keys import HASH_BYTES, ROOT_HASH, BlockHash, block_object_key, chain_hashes
from s3kv.manifest import (
    KIND_PIN,
    KIND_UNPIN,
    KIND_WRITE,
    RECORD_DTYPE,
    UNKNOWN_PARENT,
    ManifestIO,
    SegmentWriter,
)
from s3kv.ops.scope import Fingerprint, first_per_manifest, load_usage_checked
from s3kv.storage import Backend

__all__ = [
    "PinOutcome",
    "PinReport",
    "PinTarget",
    "PinnedBlock",
    "Tokenizer",
    "keys_from_hex",
    "keys_from_text",
    "list_pins",
    "load_tokenizer",
    "set_pins",
]


@dataclass(frozen=True)
class PinTarget:
    """A block to pin or unpin.

    Attributes:
        key: The block key.
        parent: Its chain parent, when known (from text: the previous block).
    """

    key: BlockHash
    parent: BlockHash | None = None


class Tokenizer(Protocol):
    """What :func:`keys_from_text` needs of a tokenizer (transformers' tokenizers have it)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def keys_from_hex(values: Sequence[str]) -> list[PinTarget]:
    """Targets from 32-hex-digit block keys.

    Raises:
        ConfigError: a value is not 32 hex digits.
    """
    targets = []
    for value in values:
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            raw = b""
        if len(raw) != HASH_BYTES:
            raise ConfigError(f"KEY: {value!r} is not a block key (32 hex digits)")
        targets.append(PinTarget(BlockHash(raw)))
    return targets


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """A transformers tokenizer from a local directory or a Hugging Face model name.

    Raises:
        ConfigError: transformers is not installed, or the tokenizer cannot be loaded; the
            message says what to do.
    """
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ConfigError(
            "--tokenizer: needs the optional dependency transformers: "
            "pip install transformers (or pip install 's3kv-cache[model]')"
        ) from exc
    try:
        tokenizer: Tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"--tokenizer: cannot load {name_or_path!r} ({first}): give a local tokenizer "
            "directory, or a Hugging Face model name with network access or a warm cache"
        ) from exc
    return tokenizer


def keys_from_text(
    text: str,
    tokenizer: Tokenizer,
    tokens_per_block: int,
    *,
    add_special_tokens: bool = True,
) -> list[PinTarget]:
    """Targets for the full blocks of ``text`` as ``tokenizer`` encodes it (a chain).

    Raises:
        ConfigError: the text does not fill one block.
    """
    tokens = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    try:
        keys = chain_hashes(tokens, tokens_per_block)
    except KeyDerivationError as exc:
        raise ConfigError(f"--text: {exc}") from exc
    if not keys:
        raise ConfigError(
            f"--text: {len(tokens)} tokens do not fill one block of {tokens_per_block} tokens"
        )
    parents = [ROOT_HASH, *keys[:-1]]
    return [PinTarget(key, parent) for key, parent in zip(keys, parents, strict=True)]


@dataclass(frozen=True)
class PinOutcome:
    """What :func:`set_pins` did in one manifest.

    Attributes:
        fingerprint: The manifest's fingerprint (a TP layout's, for its shards).
        requested: Targets asked for.
        changed: Pin (or unpin) records written.
        unchanged: Targets already in the requested state.
        adopted: Existing objects the manifest did not know, recorded as written.
        missing: Targets with no object (pin) or not live in the manifest (unpin).
    """

    fingerprint: str
    requested: int
    changed: int
    unchanged: int
    adopted: int
    missing: int


@dataclass(frozen=True)
class PinReport:
    """Outcome of :func:`set_pins` over the scope.

    Attributes:
        pin: ``True`` for pin, ``False`` for unpin.
        outcomes: One per manifest.
    """

    pin: bool
    outcomes: tuple[PinOutcome, ...]

    @property
    def found_any(self) -> bool:
        """Whether any target existed in any fingerprint."""
        return any(o.changed or o.unchanged for o in self.outcomes)


def set_pins(
    backend: Backend,
    scope: Sequence[Fingerprint],
    targets_for: Callable[[Fingerprint], Sequence[PinTarget]],
    *,
    prefix: str,
    pin: bool = True,
    clock: Callable[[], float] = time.time,
) -> PinReport:
    """Pin (or unpin) the targets in the manifest of each fingerprint of ``scope`` (once
    each): one segment per manifest that changes.

    Args:
        backend: The bucket.
        scope: Fingerprints to act in.
        targets_for: The targets of a fingerprint (text keys depend on its block size);
            asked once per manifest, of the first fingerprint in scope that uses it.
        prefix: The configured key prefix.
        pin: Pin, or unpin.
        clock: Epoch seconds for the records.

    Raises:
        CodecError: a manifest snapshot is unreadable (the message says how to rebuild it).
        StorageError: the bucket failed (no segment was written for that fingerprint).
        ConfigError: ``targets_for`` refused a fingerprint (for example no block size).
    """
    outcomes = [
        _set_one(backend, prefix, fp, targets_for(fp), pin, clock)
        for fp in first_per_manifest(scope)
    ]
    return PinReport(pin=pin, outcomes=tuple(outcomes))


def _set_one(
    backend: Backend,
    prefix: str,
    fp: Fingerprint,
    targets: Sequence[PinTarget],
    pin: bool,
    clock: Callable[[], float],
) -> PinOutcome:
    manifest = fp.manifest_fingerprint
    usage = load_usage_checked(backend, prefix, manifest)
    now = clock()
    rows: list[tuple[bytes, bytes, float, int, int, int]] = []
    unchanged = adopted = missing = 0
    for target in dict.fromkeys(targets):  # NOTE: de-duplicated, order kept
        row = usage.row(target.key)
        if row is None and pin:
            size = _stored_size(backend, prefix, fp.manifest_shards, target.key)
            if size is None:
                missing += 1
                continue
            parent = bytes(target.parent) if target.parent is not None else UNKNOWN_PARENT
            rows.append((bytes(target.key), parent, now, size, KIND_WRITE, 1))
            adopted += 1
        elif row is None:
            missing += 1
            continue
        elif row.pinned == pin:
            unchanged += 1
            continue
        rows.append((bytes(target.key), UNKNOWN_PARENT, now, 0, KIND_PIN if pin else KIND_UNPIN, 1))
    if rows:
        _write_segment(backend, prefix, manifest, rows, now)
    changed = sum(1 for r in rows if r[4] != KIND_WRITE)
    return PinOutcome(manifest, len(targets), changed, unchanged, adopted, missing)


def _stored_size(
    backend: Backend, prefix: str, shards: Sequence[str], key: BlockHash
) -> int | None:
    """The largest stored size of ``key``'s objects, if every one of ``shards`` holds one."""
    size = 0
    for shard in shards:
        info = backend.head(block_object_key(prefix, shard, key))
        if info is None:
            return None
        size = max(size, info.size)
    return size


def _write_segment(
    backend: Backend,
    prefix: str,
    fingerprint: str,
    rows: list[tuple[bytes, bytes, float, int, int, int]],
    now: float,
) -> None:
    """PUT one segment holding ``rows``, named for a random writer ``s3kv-cli-<hex>``."""
    io = ManifestIO(backend, prefix, fingerprint)
    writer = SegmentWriter(io, f"s3kv-cli-{secrets.token_hex(4)}", clock=lambda: now)
    writer.write(np.array(rows, dtype=RECORD_DTYPE))


@dataclass(frozen=True)
class PinnedBlock:
    """One pinned block, as the manifest records it.

    Attributes:
        fingerprint: Its manifest's fingerprint (a TP layout's, for its shards).
        model: The ``model_id`` of the fingerprint in scope using that manifest, if known.
        key: Block key, hex.
        parent: Parent key, hex (``None`` if unknown; all zeros for a first block).
        size: Stored bytes.
        hits: Hits recorded.
        last_used: Epoch seconds of its last write or hit.
    """

    fingerprint: str
    model: str | None
    key: str
    parent: str | None
    size: int
    hits: int
    last_used: float


def list_pins(backend: Backend, scope: Sequence[Fingerprint], *, prefix: str) -> list[PinnedBlock]:
    """Every pinned block of ``scope``, by manifest then key (each manifest once).

    Raises:
        CodecError: a manifest snapshot is unreadable.
        StorageError: the bucket failed.
    """
    found: list[PinnedBlock] = []
    for fp in first_per_manifest(scope):
        rows = load_usage_checked(backend, prefix, fp.manifest_fingerprint).rows
        for row in rows[rows["pinned"] != 0]:
            parent = bytes(row["parent"])
            pinned = PinnedBlock(
                fingerprint=fp.manifest_fingerprint,
                model=fp.model,
                key=bytes(row["key"]).hex(),
                parent=None if parent == UNKNOWN_PARENT else parent.hex(),
                size=int(row["size"]),
                hits=int(row["hits"]),
                last_used=float(row["last_used"]),
            )
            found.append(pinned)
    return found
