"""Prune: delete the blocks no engine used within a window, then rewrite the manifest.

Decision, for each object under a fingerprint's ``blocks/`` (:func:`plan_prune`):

* **last use** is the later of the manifest's last use (the latest write or hit record, as
  :func:`~s3kv.manifest.load_usage` folds them) and the object's ``LastModified``.
  ``LastModified`` covers objects the manifest does not know yet (a segment not flushed,
  or lost) and objects re-written since, so a block written moments ago is never deleted.
* kept if its last use is within the window (``now - older_than`` or later);
* kept if pinned (the latest pin/unpin record wins);
* kept if it is an ancestor — through the manifest's parent links — of a kept block: a
  block is only loadable after its whole prefix, so deleting a parent would orphan a kept
  child;
* an object whose key is not a block key is never deleted (it is not ours).

Tensor parallelism (:mod:`s3kv.ops.scope`): a TP shard's usage is its layout's manifest
(:attr:`~s3kv.ops.scope.Fingerprint.manifest_fingerprint`), where engines record every
hit; the shards of one layout in scope are planned together against it, with one usage
table, so each key gets one verdict on every shard (recent through any shard's
``LastModified``, ancestors of what any shard keeps). A layout fingerprint holds no blocks:
it is never listed nor pruned itself; in scope it stands for its shards.

Keys the manifest lists but whose object is already gone, that would be pruned anyway, are
*forgotten* too: dropped from the snapshot without a delete. That is what makes prune
resumable: a run interrupted after some deletions leaves keys advertised whose objects are
gone (a wasted GET each for engines, never wrong data), and the next run drops them. The
same heals objects removed by the bucket's lifecycle rule. For a layout's manifest a key is
gone unless every shard listed has its object (it may advertise only keys all shards hold);
the layout's own directory, which has no blocks, never decides it.

Memory: planning is vectorized over numpy arrays, never a Python object per key. The usage
rows stay the array :func:`~s3kv.manifest.load_usage` returns (61 bytes a key), with 13
bytes a key of lookup index and flags; the listing is packed 32K objects at a time into
arrays of 16-byte block keys, ``LastModified``, sizes and usage rows (36 bytes an object);
the ancestor walk maps each round's frontier to rows with one ``searchsorted``, so it takes
as many rounds as the longest chain it climbs. The plan holds what it deletes as
:class:`BlockObjects` (32 bytes an object) and what it forgets as :class:`BlockHashes` (16
bytes a key): sequences that build each :class:`~s3kv.ops.scope.BlockObject` or
:data:`~s3kv.keys.BlockHash` on access. ``benchmarks/bench_prune.py`` measures it: 54 to 67
bytes a key beyond the usage rows at 1M keys, where one Python object per key took ~650.
The shards of one layout are listed before any is classified: their packed listings are
held together (36 bytes an object, each shard), against one usage table for all of them.

Execution (:func:`execute_prune`), per manifest: DeleteObjects in batches (at most
:data:`~s3kv.storage.DELETE_BATCH` keys each) for each fingerprint it describes (a layout's
shards, in turn), then one compaction of that manifest with ``drop_keys = deleted +
forgotten`` (a key deleted from any shard is dropped) so engines stop advertising them
after their next manifest refresh. A batch that fails as a whole stops the run (the bucket
is unhealthy); keys the server refuses one by one are counted as failed and stay in the
manifest.
Deletion builds one batch of :class:`~s3kv.ops.scope.BlockObject` at a time, and
``drop_keys`` is a :class:`BlockHashes`. Concurrency with engines: a key an engine
re-writes between the deletion and the snapshot is dropped from the manifest too, which
costs one re-save later, never wrong data.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, overload

import numpy as np
import numpy.typing as npt

from s3kv.errors import AccessDeniedError, CodecError, StorageError
from s3kv.keys import HASH_BYTES, BlockHash, block_key_head, block_key_under
from s3kv.manifest import UNKNOWN_PARENT, Records, compact
from s3kv.ops import ProgressFn, no_progress
from s3kv.ops.scope import (
    BlockObject,
    Fingerprint,
    list_blocks,
    load_usage_checked,
    read_identity,
)
from s3kv.storage import DELETE_BATCH, Backend

__all__ = [
    "BlockHashes",
    "BlockObjects",
    "FingerprintOutcome",
    "FingerprintPlan",
    "PrunePlan",
    "PruneReport",
    "Tally",
    "execute_prune",
    "plan_prune",
]

_MAX_FAILURES_REPORTED = 10
_KEY: Final = np.dtype(f"V{HASH_BYTES}")
_HIGH: Final = np.dtype(">u8")  # the leading 8 bytes of a key, big-endian: sorts as the key
_CHUNK: Final = 1 << 15  # listed objects buffered as Python objects before they are packed
_SLICE: Final = 1 << 18  # rows looked up per vectorized step of the ancestor walk
_BATCH: Final = 1 << 12  # objects or keys built at a time when a sequence is iterated
_NO_KEY: Final = bytes(HASH_BYTES)  # array filler for an object without a 16-byte block key


@dataclass(frozen=True)
class Tally:
    """A count of objects and their stored bytes."""

    objects: int = 0
    bytes: int = 0

    def __add__(self, other: Tally) -> Tally:
        return Tally(self.objects + other.objects, self.bytes + other.bytes)

    @classmethod
    def of(cls, objects: Iterable[BlockObject]) -> Tally:
        """The tally of ``objects``."""
        if isinstance(objects, BlockObjects):
            return objects.tally
        count = total = 0
        for obj in objects:
            count, total = count + 1, total + obj.size
        return cls(count, total)


class _ObjectKeys:
    """The canonical object key of each block of one fingerprint
    (:func:`~s3kv.keys.block_object_key`), its head joined once: it runs once per listed
    object."""

    __slots__ = ("_head",)

    def __init__(self, prefix: str, fingerprint: str) -> None:
        self._head = block_key_head(prefix, fingerprint)

    def key(self, block: bytes) -> str:
        return block_key_under(self._head, block)


def _hashable(obj: BlockObject) -> bool:
    """``obj`` has a block key that fits the arrays (16 bytes)."""
    return obj.block is not None and len(obj.block) == HASH_BYTES


class BlockHashes(Sequence[BlockHash]):
    """Block keys held as one array of 16-byte values (16 bytes a key, not ~60 as ``bytes``).

    A read-only sequence of :data:`~s3kv.keys.BlockHash`, each built on access; equal to any
    sequence of the same keys (``plan.forget == ()``). ``numpy.asarray`` gives the array.

    Args:
        keys: A 1-D array of dtype ``V16``.
    """

    __slots__ = ("_keys",)

    def __init__(self, keys: npt.NDArray[np.void]) -> None:
        if keys.dtype != _KEY or keys.ndim != 1:
            raise ValueError(f"keys: expected a 1-D {_KEY} array, got {keys.dtype} {keys.shape}")
        self._keys = keys

    @classmethod
    def of(cls, keys: Iterable[bytes]) -> BlockHashes:
        """The 16-byte ``keys``, packed."""
        if isinstance(keys, BlockHashes):
            return keys
        return cls(np.frombuffer(b"".join(bytes(k) for k in _check_lengths(keys)), _KEY))

    @property
    def array(self) -> npt.NDArray[np.void]:
        """The keys (read-only view)."""
        view = self._keys.view()
        view.flags.writeable = False
        return view

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> npt.NDArray[Any]:
        return self.array if dtype is None else self._keys.astype(dtype)

    def __len__(self) -> int:
        return len(self._keys)

    @overload
    def __getitem__(self, index: int) -> BlockHash: ...

    @overload
    def __getitem__(self, index: slice) -> BlockHashes: ...

    def __getitem__(self, index: int | slice) -> BlockHash | BlockHashes:
        if isinstance(index, slice):
            return BlockHashes(self._keys[index])
        return BlockHash(bytes(self._keys[_position(index, len(self))]))

    def __iter__(self) -> Iterator[BlockHash]:
        for start in range(0, len(self._keys), _BATCH):
            yield from self._keys[start : start + _BATCH].tolist()

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, bytes) or len(key) != HASH_BYTES:
            return False
        return bool((self._keys == np.void(key)).any())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockHashes):
            return bool(np.array_equal(self._keys, other._keys))
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return _equal_sequences(self, other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"BlockHashes({len(self)} keys)"


class BlockObjects(Sequence[BlockObject]):
    """Block objects of one fingerprint held as arrays (32 bytes an object, not ~300).

    A read-only sequence of :class:`~s3kv.ops.scope.BlockObject`, each built on access: the
    key from the block hash (:func:`~s3kv.keys.block_object_key`), size and
    ``LastModified`` from their arrays. The rare object whose key is not that canonical key
    (upper-case hex, another shard directory) or has no 16-byte block key is held whole.
    Equal to any sequence of the same objects (``plan.delete == ()``). Made by
    :func:`plan_prune`, or from any objects by :meth:`of`.
    """

    __slots__ = ("_blocks", "_keys", "_modified", "_odd", "_sizes", "_tally")

    def __init__(
        self,
        keys: _ObjectKeys,
        blocks: npt.NDArray[np.void],
        sizes: npt.NDArray[np.uint64],
        modified: npt.NDArray[np.float64],
        odd: Mapping[int, BlockObject] | None = None,
    ) -> None:
        if not len(blocks) == len(sizes) == len(modified):
            raise ValueError("blocks, sizes, modified: expected arrays of one length")
        self._keys = keys
        self._blocks, self._sizes, self._modified = blocks, sizes, modified
        self._odd: dict[int, BlockObject] = dict(odd or {})
        self._tally = Tally(len(blocks), int(sizes.sum(dtype=np.uint64)))

    @classmethod
    def of(cls, prefix: str, fingerprint: str, objects: Iterable[BlockObject]) -> BlockObjects:
        """``objects`` (of the fingerprint's ``blocks/``), packed."""
        if isinstance(objects, BlockObjects):
            return objects
        keys = _ObjectKeys(prefix, fingerprint)
        packer = _Packer(keys)
        chunks = [chunk for obj in objects if (chunk := packer.add(obj)) is not None]
        if (last := packer.flush()) is not None:
            chunks.append(last)
        return cls._join(keys, chunks)

    @classmethod
    def _join(cls, keys: _ObjectKeys, chunks: Sequence[_Chunk]) -> BlockObjects:
        odd: dict[int, BlockObject] = {}
        offset = 0
        for chunk in chunks:
            odd.update((offset + pos, obj) for pos, obj in chunk.odd.items())
            offset += len(chunk.blocks)
        if not chunks:
            return cls(keys, np.zeros(0, _KEY), np.zeros(0, np.uint64), np.zeros(0, np.float64))
        return cls(
            keys,
            np.concatenate([c.blocks for c in chunks]),
            np.concatenate([c.sizes for c in chunks]),
            np.concatenate([c.modified for c in chunks]),
            odd,
        )

    @property
    def tally(self) -> Tally:
        """Objects and stored bytes (what :meth:`Tally.of` returns, without building them)."""
        return self._tally

    def __len__(self) -> int:
        return len(self._blocks)

    @overload
    def __getitem__(self, index: int) -> BlockObject: ...

    @overload
    def __getitem__(self, index: slice) -> BlockObjects: ...

    def __getitem__(self, index: int | slice) -> BlockObject | BlockObjects:
        if isinstance(index, slice):
            picked = range(len(self))[index]
            odd = {picked.index(pos): obj for pos, obj in self._odd.items() if pos in picked}
            return BlockObjects(
                self._keys, self._blocks[index], self._sizes[index], self._modified[index], odd
            )
        pos = _position(index, len(self))
        if (obj := self._odd.get(pos)) is not None:
            return obj
        block = bytes(self._blocks[pos])
        key = self._keys.key(block)
        return BlockObject(key, BlockHash(block), int(self._sizes[pos]), float(self._modified[pos]))

    def __iter__(self) -> Iterator[BlockObject]:
        make = self._keys.key
        for start in range(0, len(self), _BATCH):
            stop = start + _BATCH
            rows = zip(
                self._blocks[start:stop].tolist(),
                self._sizes[start:stop].tolist(),
                self._modified[start:stop].tolist(),
                strict=True,
            )
            for pos, (block, size, modified) in enumerate(rows, start=start):
                if self._odd and (obj := self._odd.get(pos)) is not None:
                    yield obj
                else:
                    yield BlockObject(make(block), BlockHash(block), size, modified)

    def tally_where(self, mask: npt.NDArray[np.bool_]) -> Tally:
        """The tally of the objects where ``mask`` (one flag an object)."""
        return _tally(self._sizes, mask)

    def hashes_where(self, mask: npt.NDArray[np.bool_]) -> BlockHashes:
        """The block keys of the objects where ``mask``, in order (none for a foreign one)."""
        if self._odd:
            mask = mask.copy()
            mask[[pos for pos, obj in self._odd.items() if not _hashable(obj)]] = False
        return BlockHashes(self._blocks[mask])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return _equal_sequences(self, other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"BlockObjects({self.tally.objects} objects, {self.tally.bytes} bytes)"


def _position(index: int, length: int) -> int:
    pos = index + length if index < 0 else index
    if not 0 <= pos < length:
        raise IndexError(f"index {index} out of range for {length} items")
    return pos


def _equal_sequences(mine: Sequence[Any], other: Sequence[Any]) -> bool:
    return len(mine) == len(other) and all(bool(a == b) for a, b in zip(mine, other, strict=True))


def _check_lengths(keys: Iterable[bytes]) -> Iterator[bytes]:
    for key in keys:
        if len(key) != HASH_BYTES:
            raise ValueError(f"keys: expected {HASH_BYTES}-byte keys, got {len(key)} bytes")
        yield key


@dataclass
class _Chunk:
    """Up to :data:`_CHUNK` listed objects, packed.

    Attributes:
        blocks: Block keys (:data:`_NO_KEY` for an object without a 16-byte one).
        sizes: Stored bytes.
        modified: ``LastModified``.
        odd: Position -> object, for objects whose key is not the canonical key of their
            block or who have no 16-byte block key.
        rows: Position -> usage row of the block (-1: none), once looked up.
    """

    blocks: npt.NDArray[np.void]
    sizes: npt.NDArray[np.uint64]
    modified: npt.NDArray[np.float64]
    odd: dict[int, BlockObject]
    rows: npt.NDArray[np.signedinteger[Any]] | None = None

    def unhashable(self) -> list[int]:
        """Positions of the objects without a 16-byte block key."""
        return [pos for pos, obj in self.odd.items() if not _hashable(obj)]

    def where(self, mask: npt.NDArray[np.bool_]) -> _Chunk:
        """The objects where ``mask``, in order."""
        picked = np.flatnonzero(mask)
        odd = {int(np.searchsorted(picked, pos)): o for pos, o in self.odd.items() if mask[pos]}
        return _Chunk(self.blocks[picked], self.sizes[picked], self.modified[picked], odd)


class _Packer:
    """Packs listed objects into :class:`_Chunk` s."""

    def __init__(self, keys: _ObjectKeys) -> None:
        self._keys = keys
        self._blocks: list[bytes] = []
        self._sizes: list[int] = []
        self._modified: list[float] = []
        self._odd: dict[int, BlockObject] = {}

    def add(self, obj: BlockObject) -> _Chunk | None:
        """Take ``obj``; a full chunk when one is ready."""
        block = obj.block
        if block is None or len(block) != HASH_BYTES:
            self._odd[len(self._blocks)] = obj
            block = BlockHash(_NO_KEY)
        elif obj.key != self._keys.key(block):
            self._odd[len(self._blocks)] = obj
        self._blocks.append(block)
        self._sizes.append(obj.size)
        self._modified.append(obj.last_modified)
        return self.flush() if len(self._blocks) >= _CHUNK else None

    def flush(self) -> _Chunk | None:
        """The objects taken since the last chunk, packed (``None``: none)."""
        if not self._blocks:
            return None
        chunk = _Chunk(
            np.frombuffer(b"".join(self._blocks), _KEY),
            np.array(self._sizes, np.uint64),
            np.array(self._modified, np.float64),
            self._odd,
        )
        self._blocks, self._sizes, self._modified, self._odd = [], [], [], {}
        return chunk


@dataclass(frozen=True)
class FingerprintPlan:
    """What prune will do to one fingerprint.

    Attributes:
        fingerprint: The fingerprint.
        model: Its ``model_id``, if known.
        delete: Block objects to delete, in listing order (:func:`plan_prune` gives a
            :class:`BlockObjects`: 32 bytes an object).
        forget: Manifest keys to drop whose objects are already gone, in key order
            (:func:`plan_prune` gives a :class:`BlockHashes`: 16 bytes a key).
        kept_recent: Kept: used within the window.
        kept_pinned: Kept: pinned.
        kept_ancestor: Kept: a prefix of a kept block.
        kept_foreign: Kept: not a block key.
        manifest_fingerprint: The manifest describing these blocks (the default: the
            fingerprint's own); a TP shard's is its layout's, which ``forget`` and the
            deletions are dropped from. The shards of one layout hold the same ``forget``:
            it is the manifest's, dropped once.
    """

    fingerprint: str
    model: str | None
    delete: Sequence[BlockObject]
    forget: Sequence[BlockHash]
    kept_recent: Tally
    kept_pinned: Tally
    kept_ancestor: Tally
    kept_foreign: Tally
    manifest_fingerprint: str = ""

    def __post_init__(self) -> None:
        if not self.manifest_fingerprint:
            object.__setattr__(self, "manifest_fingerprint", self.fingerprint)

    @property
    def to_delete(self) -> Tally:
        """Objects and bytes to delete."""
        return Tally.of(self.delete)

    @property
    def kept(self) -> Tally:
        """Objects and bytes kept, for any reason."""
        return self.kept_recent + self.kept_pinned + self.kept_ancestor + self.kept_foreign


@dataclass(frozen=True)
class PrunePlan:
    """The whole plan: computed first so that a dry run and the confirmation show totals.

    Attributes:
        now: Epoch seconds the plan was made at.
        older_than: The window in seconds.
        fingerprints: One plan per fingerprint in scope.
    """

    now: float
    older_than: float
    fingerprints: tuple[FingerprintPlan, ...]

    @property
    def cutoff(self) -> float:
        """Blocks last used before this epoch second are stale."""
        return self.now - self.older_than

    @property
    def to_delete(self) -> Tally:
        """Objects and bytes to delete, over all fingerprints."""
        return sum((fp.to_delete for fp in self.fingerprints), Tally())

    @property
    def kept(self) -> Tally:
        """Objects and bytes kept, over all fingerprints."""
        return sum((fp.kept for fp in self.fingerprints), Tally())


@dataclass(frozen=True)
class FingerprintOutcome:
    """What prune did to one fingerprint.

    Attributes:
        fingerprint: The fingerprint.
        deleted: Objects deleted (absent ones count: S3 deletes are idempotent).
        failed: Objects the server refused to delete, or whose batch failed.
        not_attempted: Objects left because the run stopped first.
        failures: Up to 10 ``(key, reason)`` examples.
        manifest_keys_dropped: Keys the new snapshot no longer lists.
        manifest_generation: The snapshot generation written (``None``: none written).
        manifest_error: Why the snapshot was not rewritten, if it should have been.
        manifest_fingerprint: The manifest rewritten (the default: the fingerprint's own).
            The shards of one TP layout share it: the three ``manifest_*`` figures above
            are then the same on each of them, one rewrite (count them once).
    """

    fingerprint: str
    deleted: Tally = Tally()
    failed: Tally = Tally()
    not_attempted: Tally = Tally()
    failures: tuple[tuple[str, str], ...] = ()
    manifest_keys_dropped: int = 0
    manifest_generation: int | None = None
    manifest_error: str | None = None
    manifest_fingerprint: str = ""

    def __post_init__(self) -> None:
        if not self.manifest_fingerprint:
            object.__setattr__(self, "manifest_fingerprint", self.fingerprint)


@dataclass(frozen=True)
class PruneReport:
    """The result of a prune run (or of a dry run: no outcomes).

    Attributes:
        plan: The plan executed.
        dry_run: Nothing was changed.
        outcomes: One per fingerprint, in plan order.
        interrupted: Why the run stopped early (``None`` if it did not).
    """

    plan: PrunePlan
    dry_run: bool
    outcomes: tuple[FingerprintOutcome, ...] = field(default=())
    interrupted: str | None = None

    @property
    def deleted(self) -> Tally:
        return sum((o.deleted for o in self.outcomes), Tally())

    @property
    def failed(self) -> Tally:
        return sum((o.failed + o.not_attempted for o in self.outcomes), Tally())

    @property
    def complete(self) -> bool:
        """Everything planned was done, manifest included (always true for a dry run)."""
        return self.dry_run or (
            self.interrupted is None
            and all(not o.failed.objects and o.manifest_error is None for o in self.outcomes)
        )


def plan_prune(
    backend: Backend,
    prefix: str,
    scope: Sequence[Fingerprint],
    *,
    older_than: float,
    clock: Callable[[], float] = time.time,
    progress: ProgressFn = no_progress,
) -> PrunePlan:
    """Decide what to delete (see the module docstring). Reads only: changes nothing.

    Args:
        backend: The bucket.
        prefix: The configured key prefix.
        scope: The fingerprints to prune (:func:`~s3kv.ops.scope.resolve_scope`).
        older_than: The window in seconds (> 0).
        clock: Epoch seconds.
        progress: Called with ``("list <fp>", objects listed, None)``.

    Raises:
        ValueError: ``older_than`` is not positive.
        CodecError: a fingerprint's manifest snapshot is unreadable; the message says to
            rebuild it with ``s3kv compact --full`` (pruning without it could delete pins).
        StorageError: the bucket failed.
    """
    if older_than <= 0:
        raise ValueError(f"older_than: must be > 0 seconds, got {older_than}")
    now = clock()
    plans: list[FingerprintPlan] = []
    for manifest, members in _groups(backend, prefix, scope):
        plans += _plan_group(backend, prefix, manifest, members, now - older_than, progress)
    return PrunePlan(now=now, older_than=older_than, fingerprints=tuple(plans))


def _groups(
    backend: Backend, prefix: str, scope: Sequence[Fingerprint]
) -> list[tuple[str, list[Fingerprint]]]:
    """The fingerprints whose blocks to list, by the manifest that describes them.

    A plain fingerprint is a group of its own; the shards of a TP layout share one (their
    layout's manifest), in rank order. A layout in scope stands for its shards (it holds no
    blocks itself); those not in scope are added, with their ``identity.json``.
    """
    groups: dict[str, dict[str, Fingerprint]] = {}
    for fp in scope:
        members = groups.setdefault(fp.manifest_fingerprint, {})
        if not fp.is_layout:
            members[fp.fingerprint] = fp
    for fp in scope:
        members = groups[fp.manifest_fingerprint]
        for shard in fp.shards:  # NOTE: a layout's (no other fingerprint has shards)
            if shard not in members:
                identity = read_identity(backend, prefix, shard)
                members[shard] = Fingerprint(shard, identity, fp.fingerprint, (), fp.shards)
    found = []
    for manifest, members in groups.items():
        if not members:
            continue
        order = next(iter(members.values())).manifest_shards
        ranks = {shard: rank for rank, shard in enumerate(order)}
        found.append(
            (manifest, sorted(members.values(), key=lambda m: ranks.get(m.fingerprint, len(ranks))))
        )
    return found


def _plan_group(
    backend: Backend,
    prefix: str,
    manifest: str,
    members: Sequence[Fingerprint],
    cutoff: float,
    progress: ProgressFn,
) -> list[FingerprintPlan]:
    """Plan the fingerprints whose blocks ``manifest`` describes (the shards of a layout).

    One usage table for all of them, so every shard of a key gets the same verdict when the
    manifest knows it: recent through any shard's ``LastModified`` keeps it on every shard,
    and the ancestors of what any shard keeps are kept everywhere. A manifest key is
    forgotten unless every shard listed has its object (the manifest may only advertise
    keys every shard holds). Keys the manifest does not know are recent on every shard when
    one shard's object of that key is.
    """
    index = _UsageIndex(
        load_usage_checked(backend, prefix, manifest, then=", then prune").rows, cutoff
    )
    listed = [_list(backend, prefix, fp, index, progress) for fp in members]
    ancestor = index.ancestors()
    forget = index.forget(ancestor)
    pinned, recent = index.pinned, index.recent
    del index  # the usage rows: the rest needs only the flags

    across = _recent_across([chunks for _, chunks, _ in listed], cutoff)
    plans = []
    for fp, (keys, chunks, foreign) in zip(members, listed, strict=True):
        shared = _shared_recent(chunks, cutoff)
        shared_keys = _sorted_keys(shared)
        if len(across):
            shared_keys = np.union1d(shared_keys, across)
        kept = {"pinned": Tally(), "recent": Tally(), "ancestor": Tally()}
        doomed: list[_Chunk] = []
        chunks.reverse()
        while chunks:  # NOTE: popped, so that each chunk is freed once classified
            chunk = chunks.pop()
            verdicts = _classify(chunk, pinned, recent, ancestor, cutoff, shared, shared_keys)
            for reason in kept:
                kept[reason] += _tally(chunk.sizes, verdicts[reason])
            doomed.append(chunk.where(verdicts["delete"]))
        plan = FingerprintPlan(
            fingerprint=fp.fingerprint,
            model=fp.model,
            delete=BlockObjects._join(keys, doomed),
            forget=forget,
            kept_recent=kept["recent"],
            kept_pinned=kept["pinned"],
            kept_ancestor=kept["ancestor"],
            kept_foreign=foreign,
            manifest_fingerprint=manifest,
        )
        plans.append(plan)
    return plans


def _list(
    backend: Backend, prefix: str, fp: Fingerprint, index: _UsageIndex, progress: ProgressFn
) -> tuple[_ObjectKeys, list[_Chunk], Tally]:
    """List one fingerprint's blocks into chunks looked up in ``index`` (one shard of it);
    with the tally of its objects that are not block keys."""
    keys = _ObjectKeys(prefix, fp.fingerprint)
    packer = _Packer(keys)
    chunks: list[_Chunk] = []
    foreign = [0, 0]
    count = 0
    phase = f"list {fp.fingerprint[:8]}"
    for count, obj in enumerate(list_blocks(backend, prefix, fp.fingerprint), start=1):
        if obj.block is None:
            foreign[0], foreign[1] = foreign[0] + 1, foreign[1] + obj.size
        elif (chunk := packer.add(obj)) is not None:
            chunks.append(index.see(chunk))
        if count % 1000 == 0:
            progress(phase, count, None)
    if (chunk := packer.flush()) is not None:
        chunks.append(index.see(chunk))
    progress(phase, count, count)
    index.end_shard()
    return keys, chunks, Tally(foreign[0], foreign[1])


def _high(keys: npt.NDArray[np.void]) -> npt.NDArray[np.uint64]:
    """The leading 8 bytes of each key as a native integer (they order as the keys do)."""
    high: npt.NDArray[np.uint64] = keys.getfield(_HIGH, 0).astype(np.uint64)
    return high


class _UsageIndex:
    """The usage rows of one fingerprint, looked up by key, and the per-row decisions.

    Attributes:
        pinned: Per row: pinned.
        recent: Per row: last used within the window, by the manifest or by the
            ``LastModified`` of an object of its key (:meth:`see`).
        present: Per row: an object of its key was listed (:meth:`see`) in every shard
            listed so far (:meth:`end_shard`).
    """

    def __init__(self, rows: Records, cutoff: float) -> None:
        self._rows = rows
        self._keys: npt.NDArray[np.void] = rows["key"]
        self._high = _high(self._keys)
        self._contiguous: npt.NDArray[np.void] | None = None
        self._cutoff = cutoff
        self._row_type = np.int32 if len(rows) < 2**31 else np.int64
        self.pinned: npt.NDArray[np.bool_] = rows["pinned"] != 0
        self.recent: npt.NDArray[np.bool_] = rows["last_used"] >= cutoff
        self.present = np.zeros(len(rows), np.bool_)
        self._shard: npt.NDArray[np.bool_] | None = None  # present in the shard being listed
        # (from the second shard on: the first marks ``present`` directly)
        self._shards = 0

    def find(self, wanted: npt.NDArray[np.void]) -> npt.NDArray[np.intp]:
        """The row of each key of ``wanted`` (-1: none).

        One ``searchsorted`` on the keys' leading 8 bytes as integers (2-4x faster than on
        the 16-byte keys); a key whose leading 8 bytes other keys share goes to :meth:`_exact`.
        """
        found = np.full(len(wanted), -1, np.intp)
        size = len(self._high)
        if not size or not len(wanted):
            return found
        high = _high(wanted)
        slots = np.searchsorted(self._high, high)
        np.minimum(slots, size - 1, out=slots)
        hit = self._keys[slots] == wanted
        found[hit] = slots[hit]
        tied = ~hit & (self._high[slots] == high)
        if tied.any():
            found[tied] = self._exact(wanted[tied])
        return found

    def _exact(self, wanted: npt.NDArray[np.void]) -> npt.NDArray[np.intp]:
        if self._contiguous is None:
            self._contiguous = np.ascontiguousarray(self._keys)
        keys = self._contiguous
        slots = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
        exact: npt.NDArray[np.intp] = np.where(keys[slots] == wanted, slots, -1)
        return exact

    def see(self, chunk: _Chunk) -> _Chunk:
        """Look up the rows of ``chunk``'s objects; mark them present, and recent as said."""
        rows = self.find(chunk.blocks)
        if chunk.odd:
            rows[chunk.unhashable()] = -1
        has = rows >= 0
        if self._shards == 0:  # NOTE: the first shard marks ``present`` itself
            self.present[rows[has]] = True
        else:
            if self._shard is None:
                self._shard = np.zeros(len(self.present), np.bool_)
            self._shard[rows[has]] = True
        self.recent[rows[has & (chunk.modified >= self._cutoff)]] = True
        chunk.rows = rows.astype(self._row_type)
        return chunk

    def end_shard(self) -> None:
        """Every object of one shard (fingerprint) was seen: fold its presence in."""
        if self._shards > 0:
            self.present &= self._shard if self._shard is not None else False
        self._shards, self._shard = self._shards + 1, None

    def ancestors(self) -> npt.NDArray[np.bool_]:
        """Per row: an ancestor of a pinned or recent row, and neither itself.

        A breadth-first walk up the parent links, one vectorized step per round (and per
        :data:`_SLICE` rows of the frontier). Pinned and recent rows are where the walk
        starts, so it does not enter them again: a round's frontier holds only rows new to
        it, and the walk takes as many rounds as the longest chain of such rows.
        """
        protected = self.pinned | self.recent
        ancestor = np.zeros(len(protected), np.bool_)
        parents: npt.NDArray[np.void] = self._rows["parent"]
        unknown = np.void(UNKNOWN_PARENT)
        size = len(protected)
        frontier: Iterable[npt.NDArray[np.intp]] = (
            np.flatnonzero(protected[start : start + _SLICE]) + start
            for start in range(0, size, _SLICE)
        )
        while True:
            found: list[npt.NDArray[np.intp]] = []
            for rows in frontier:
                wanted = parents[rows]
                up = self.find(wanted)
                up = up[(up >= 0) & (wanted != unknown)]
                up = np.unique(up[~protected[up] & ~ancestor[up]])
                ancestor[up] = True
                if len(up):
                    found.append(up)
            if not found:
                return ancestor
            rounds = np.concatenate(found)
            frontier = (rounds[start : start + _SLICE] for start in range(0, len(rounds), _SLICE))

    def forget(self, ancestor: npt.NDArray[np.bool_]) -> BlockHashes:
        """The keys of rows with no object listed that are neither pinned, recent nor kept."""
        gone = ~(self.present | self.pinned | self.recent | ancestor)
        return BlockHashes(self._keys[gone])


def _own_recent(modified: npt.NDArray[np.float64], cutoff: float) -> npt.NDArray[np.bool_]:
    """Recent by ``LastModified`` alone (a key without a usage row counts as last used at 0)."""
    own: npt.NDArray[np.bool_] = np.maximum(modified, 0.0) >= cutoff
    return own


def _sorted_keys(keys: Iterable[bytes]) -> npt.NDArray[np.void]:
    packed = [key for key in keys if len(key) == HASH_BYTES]
    return np.sort(np.array(packed, _KEY)) if packed else np.zeros(0, _KEY)


def _member(keys: npt.NDArray[np.void], sorted_keys: npt.NDArray[np.void]) -> npt.NDArray[np.bool_]:
    """Per key of ``keys``: in ``sorted_keys`` (a small array)."""
    if not len(sorted_keys):
        return np.zeros(len(keys), np.bool_)
    slots = np.minimum(np.searchsorted(sorted_keys, keys), len(sorted_keys) - 1)
    member: npt.NDArray[np.bool_] = sorted_keys[slots] == keys
    return member


def _recent_across(shards: Sequence[Sequence[_Chunk]], cutoff: float) -> npt.NDArray[np.void]:
    """Sorted block keys without a usage row that some shard's object makes recent.

    Only where there are several shards (one's own objects are :func:`_shared_recent`'s).
    """
    if len(shards) < 2:
        return np.zeros(0, _KEY)
    found = []
    for chunks in shards:
        for chunk in chunks:
            assert chunk.rows is not None
            mine = (chunk.rows < 0) & _own_recent(chunk.modified, cutoff)
            mine[chunk.unhashable()] = False
            found.append(chunk.blocks[mine])
    return np.unique(np.concatenate(found)) if found else np.zeros(0, _KEY)


def _shared_recent(chunks: Sequence[_Chunk], cutoff: float) -> set[bytes]:
    """Block keys without a usage row that are recent through some object of that key.

    Objects share a block key only where one of them is odd (its key is not the canonical
    key of its block), so only the keys of odd objects are looked at: in the usual listing
    there are none and this costs nothing. Keys with a usage row are in
    :attr:`_UsageIndex.recent` already.
    """
    odd = {obj.block for chunk in chunks for obj in chunk.odd.values() if obj.block is not None}
    if not odd:
        return set()
    odd_keys = _sorted_keys(odd)
    shared: set[bytes] = set()
    for chunk in chunks:
        assert chunk.rows is not None
        mine = (chunk.rows < 0) & _own_recent(chunk.modified, cutoff)
        unhashable = chunk.unhashable()
        for pos in unhashable:
            block = chunk.odd[pos].block
            if mine[pos] and block is not None:
                shared.add(block)
        mine[unhashable] = False
        shared.update(chunk.blocks[mine & _member(chunk.blocks, odd_keys)].tolist())
    return shared


def _classify(
    chunk: _Chunk,
    pinned: npt.NDArray[np.bool_],
    recent: npt.NDArray[np.bool_],
    ancestor: npt.NDArray[np.bool_],
    cutoff: float,
    shared: set[bytes],
    shared_keys: npt.NDArray[np.void],
) -> dict[str, npt.NDArray[np.bool_]]:
    """Per object of ``chunk``: kept as pinned, recent or ancestor, or to delete."""
    assert chunk.rows is not None
    has = chunk.rows >= 0
    if len(pinned):
        at = np.where(has, chunk.rows, 0)
        by_pin, by_use, by_child = has & pinned[at], has & recent[at], has & ancestor[at]
    else:
        by_pin = by_use = by_child = np.zeros(len(has), np.bool_)
    own = _own_recent(chunk.modified, cutoff)
    if shared or len(shared_keys):
        member = _member(chunk.blocks, shared_keys)
        for pos in chunk.unhashable():
            member[pos] = chunk.odd[pos].block in shared
        own |= member
    is_recent = np.where(has, by_use, own) & ~by_pin
    is_ancestor = by_child & ~by_pin & ~is_recent
    return {
        "pinned": by_pin,
        "recent": is_recent,
        "ancestor": is_ancestor,
        "delete": ~(by_pin | is_recent | is_ancestor),
    }


def _tally(sizes: npt.NDArray[np.uint64], mask: npt.NDArray[np.bool_]) -> Tally:
    return Tally(int(np.count_nonzero(mask)), int(sizes[mask].sum(dtype=np.uint64)))


def execute_prune(
    backend: Backend,
    plan: PrunePlan,
    *,
    prefix: str,
    fpr: float,
    clock: Callable[[], float] = time.time,
    batch_size: int = DELETE_BATCH,
    progress: ProgressFn = no_progress,
) -> PruneReport:
    """Delete what ``plan`` says, then rewrite each fingerprint's manifest snapshot.

    Idempotent and resumable: re-running after an interruption (a failed batch, Ctrl-C, a
    crash) finishes the job, because a re-plan finds the remaining objects and forgets the
    already-deleted keys (module docstring).

    Args:
        backend: The bucket.
        plan: From :func:`plan_prune`.
        prefix: The configured key prefix.
        fpr: ``bloom_fpr`` for it.
        clock: Epoch seconds (compaction's clock).
        batch_size: Keys per DeleteObjects request (1..1000).
        progress: Called with ``("delete", objects done, objects planned)``.

    Returns:
        The report; :attr:`PruneReport.complete` says whether anything is left to do.
    """
    if not 1 <= batch_size <= DELETE_BATCH:
        raise ValueError(f"batch_size: must be in 1..{DELETE_BATCH}, got {batch_size}")
    total, done = plan.to_delete.objects, [0]

    def advance(n: int) -> None:
        done[0] += n
        progress("delete", done[0], total)

    outcomes: dict[int, FingerprintOutcome] = {}
    interrupted: str | None = None
    for manifest, members in _by_manifest(plan.fingerprints):
        attempted: dict[int, FingerprintOutcome] = {}
        drops: list[BlockHashes] = []
        for pos, fp_plan in members:
            if interrupted is not None:
                outcomes[pos] = FingerprintOutcome(
                    fp_plan.fingerprint,
                    not_attempted=fp_plan.to_delete,
                    manifest_fingerprint=manifest,
                )
                continue
            objects = BlockObjects.of(prefix, fp_plan.fingerprint, fp_plan.delete)
            outcome, deleted, interrupted = _delete(
                backend, fp_plan.fingerprint, objects, batch_size, advance
            )
            attempted[pos] = replace(outcome, manifest_fingerprint=manifest)
            drops.append(objects.hashes_where(deleted))
        if not attempted:
            continue
        if interrupted is not None:
            change: dict[str, Any] = {"manifest_error": "not rewritten: the run stopped"}
        else:
            forgets = {id(p.forget): p.forget for _, p in members}  # NOTE: shards share one
            drop = _drop_keys(drops, list(forgets.values()))
            change = _rewrite_manifest(backend, prefix, manifest, drop, fpr, clock)
        outcomes |= {pos: replace(outcome, **change) for pos, outcome in attempted.items()}
    ordered = tuple(outcomes[pos] for pos in sorted(outcomes))
    return PruneReport(plan=plan, dry_run=False, outcomes=ordered, interrupted=interrupted)


def _by_manifest(
    plans: Sequence[FingerprintPlan],
) -> list[tuple[str, list[tuple[int, FingerprintPlan]]]]:
    """``plans`` (with their positions) by manifest, in order of first appearance."""
    groups: dict[str, list[tuple[int, FingerprintPlan]]] = {}
    for pos, fp_plan in enumerate(plans):
        groups.setdefault(fp_plan.manifest_fingerprint, []).append((pos, fp_plan))
    return list(groups.items())


def _delete(
    backend: Backend,
    fingerprint: str,
    objects: BlockObjects,
    batch_size: int,
    advance: Callable[[int], None],
) -> tuple[FingerprintOutcome, npt.NDArray[np.bool_], str | None]:
    """Delete one fingerprint's objects; (outcome, which were deleted, why it stopped early).

    Builds the :class:`~s3kv.ops.scope.BlockObject` of one batch at a time.
    """
    deleted = np.zeros(len(objects), np.bool_)
    failed = Tally()
    failures: list[tuple[str, str]] = []
    interrupted = None
    start = 0
    while start < len(objects):
        first, start = start, min(start + batch_size, len(objects))
        batch = list(objects[first:start])
        try:
            result = backend.delete_many([obj.key for obj in batch])
        except StorageError as exc:
            # NOTE: a whole batch failing means the bucket is unhealthy: stop rather than
            # hammer it; the next run re-plans and finishes.
            interrupted = str(exc)
            failed += Tally.of(batch)
            failures.append((batch[0].key, f"batch of {len(batch)} failed: {exc}"))
            break
        for pos, obj in enumerate(batch, start=first):
            if obj.key in result.failed:
                failed += Tally(1, obj.size)
                failures.append((obj.key, result.failed[obj.key]))
                del failures[_MAX_FAILURES_REPORTED:]
            else:
                deleted[pos] = True
        advance(len(batch))
    outcome = FingerprintOutcome(
        fingerprint,
        deleted=objects.tally_where(deleted),
        failed=failed,
        not_attempted=objects[start:].tally,
        failures=tuple(failures[:_MAX_FAILURES_REPORTED]),
    )
    return outcome, deleted, interrupted


def _drop_keys(
    deleted: Sequence[BlockHashes], forget: Sequence[Sequence[BlockHash]]
) -> BlockHashes:
    """The keys a manifest's snapshot drops: those deleted, then those forgotten.

    A key deleted from any shard of a layout is dropped (the manifest may only list keys
    every shard holds); from several shards, once (sorted, then).
    """
    if len(deleted) == 1 and len(forget) <= 1:
        if not forget or not len(forget[0]):
            return deleted[0]
        return BlockHashes(np.concatenate([deleted[0].array, BlockHashes.of(forget[0]).array]))
    parts = [d.array for d in deleted] + [BlockHashes.of(f).array for f in forget]
    return BlockHashes(np.unique(np.concatenate(parts)) if parts else np.zeros(0, _KEY))


def _rewrite_manifest(
    backend: Backend,
    prefix: str,
    manifest: str,
    drop: BlockHashes,
    fpr: float,
    clock: Callable[[], float],
) -> dict[str, Any]:
    """Compact ``manifest`` without ``drop``; the :class:`FingerprintOutcome` fields to set."""
    if not drop:
        return {}  # nothing to drop: leave the snapshot alone (a no-op re-run is free)
    try:
        report = compact(backend, prefix, manifest, fpr=fpr, clock=clock, drop_keys=drop)
    except (StorageError, CodecError) as exc:
        # NOTE: a refused permission is not fixed by a re-run: do not advise one.
        advice = "" if isinstance(exc, AccessDeniedError) else "; re-run prune"
        return {"manifest_error": f"not rewritten ({exc}){advice}"}
    if report.lost_race:
        return {
            "manifest_error": "another compaction ran at the same time; re-run prune to drop keys"
        }
    return {"manifest_generation": report.generation, "manifest_keys_dropped": report.keys_dropped}
