"""The metadata the scheduler sends to every worker each iteration (broadcast: pickled under
tensor parallelism; with one rank TensorRT-LLM hands over the object itself).

Small by construction: only this iteration's new work, as tuples of ints and 16-byte keys.
Saves travel column by column (:class:`SaveOps`): an 8K-token prompt's 254 saves as
per-block objects cost the engine's thread 0.3 ms to build and 0.8 ms to pickle and unpickle
before its forward pass (TensorRT-LLM pickles the metadata under TP, and the emulator's tests
do with one rank too); as columns, tens of microseconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

from s3kv.errors import KeyDerivationError
from s3kv.keys import HASH_BYTES, KeyRun


@dataclass(frozen=True)
class LoadOp:
    """Copy a staged block into a device block before the forward pass.

    Attributes:
        block_id: Destination block in the KV pool (the same id on every rank).
        key: The block's hash (used to find the staged bytes in a single-process setup).
        slots: Per rank, the arena slot holding that rank's shard (tensor parallel), or
            empty when the scheduler's process is the only rank.
    """

    block_id: int
    key: bytes
    slots: tuple[int, ...] = ()


@dataclass(frozen=True)
class SaveOp:
    """Copy a full device block to host after the forward pass and save it.

    Attributes:
        request_id: The request the block belongs to (for ``get_finished``).
        block_id: Source block in the KV pool.
        key: The block's hash.
        parent: Its chain parent (for the manifest's usage records).
    """

    request_id: int
    block_id: int
    key: bytes
    parent: bytes


class SaveOps(Sequence[SaveOp]):
    """The saves of one iteration, column by column; a sequence of :class:`SaveOp`.

    Pickles as two tuples of ints and two byte strings (and the runs below). The worker
    reads the columns; an item or an iteration builds :class:`SaveOp` views (for tests and
    diagnostics).

    Keys may travel unhashed: ``derived`` places :class:`~s3kv.keys.KeyRun` s (a parent key
    and the tokens of consecutive blocks, or where to read them in the request's key chain)
    among the blocks, and their keys are hashed on the
    first read of :attr:`keys` or :attr:`parents` (or a slice), by whoever reads them: the
    workers, when they hand the copies to the store, after the engine has read the pass's
    tokens. Hashing an 8K-token prompt's 254 keys cost the scheduler 0.35-0.5 ms before the
    forward pass.

    Args:
        request_ids: Per block, its request.
        block_ids: Per block, its source block in the KV pool.
        keys: The blocks' hashes, concatenated (``HASH_BYTES`` each), runs' blocks left out.
        parents: Their chain parents, concatenated likewise.
        derived: ``(index, run)`` pairs, ascending: the run's blocks are blocks ``index ..
            index + run.blocks - 1``.

    Raises:
        ValueError: The columns disagree in length, or a run does not fit among the blocks.
    """

    __slots__ = ("_columns", "block_ids", "request_ids")

    def __init__(
        self,
        request_ids: Sequence[int] = (),
        block_ids: Sequence[int] = (),
        keys: bytes = b"",
        parents: bytes = b"",
        derived: Sequence[tuple[int, KeyRun]] = (),
    ) -> None:
        n = len(block_ids)
        hashed = n - sum(run.blocks for _, run in derived)
        if len(request_ids) != n or len(keys) != hashed * HASH_BYTES or len(parents) != len(keys):
            raise ValueError(
                f"saves: {len(request_ids)} request ids, {n} block ids, {len(keys)} key bytes "
                f"and {len(parents)} parent bytes do not describe the same blocks"
            )
        at = 0
        for index, run in derived:
            whole = run.blocks * 4 * run.tokens_per_block == run.nbytes
            if index < at or not whole or not run.blocks or len(run.parent) != HASH_BYTES:
                raise ValueError(f"saves: a run of keys at block {index} does not fit")
            at = index + run.blocks
        if at > n:
            raise ValueError(f"saves: runs of keys reach block {at} of {n}")
        object.__setattr__(self, "request_ids", tuple(request_ids))
        object.__setattr__(self, "block_ids", tuple(block_ids))
        object.__setattr__(self, "_columns", (bytes(keys), bytes(parents), tuple(derived)))

    request_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    # NOTE: (keys, parents, runs) in one slot, replaced whole once the runs are hashed: a
    # reader on another thread sees the columns before or after, never half of each.
    _columns: tuple[bytes, bytes, tuple[tuple[int, KeyRun], ...]]

    @property
    def keys(self) -> bytes:
        """The blocks' hashes, concatenated (runs hashed now, once)."""
        return self._hashed()[0]

    @property
    def parents(self) -> bytes:
        """Their chain parents, concatenated likewise."""
        return self._hashed()[1]

    @property
    def unhashed(self) -> int:
        """Blocks whose keys are still to be hashed (runs not read yet)."""
        return sum(run.blocks for _, run in self._columns[2])

    def _hashed(self) -> tuple[bytes, bytes, tuple[tuple[int, KeyRun], ...]]:
        """The columns with every run hashed into them (the object is immutable from
        outside; hashing only fills in what it already describes)."""
        columns = self._columns
        if columns[2]:
            columns = _hash_runs(*columns)
            object.__setattr__(self, "_columns", columns)
        return columns

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"SaveOps is immutable: cannot set {name}")

    @classmethod
    def of(cls, ops: Iterable[SaveOp]) -> SaveOps:
        """The columns of ``ops`` (keys and parents of ``HASH_BYTES`` each)."""
        if isinstance(ops, SaveOps):
            return ops
        listed = list(ops)
        return cls(
            [op.request_id for op in listed],
            [op.block_id for op in listed],
            b"".join(op.key for op in listed),
            b"".join(op.parent for op in listed),
        )

    def key(self, index: int) -> bytes:
        """Block ``index``'s hash (``IndexError`` out of range, negative counts from the end)."""
        i = range(len(self))[index]
        return self.keys[i * HASH_BYTES : (i + 1) * HASH_BYTES]

    def parent(self, index: int) -> bytes:
        """Block ``index``'s chain parent (indexed as :meth:`key`)."""
        i = range(len(self))[index]
        return self.parents[i * HASH_BYTES : (i + 1) * HASH_BYTES]

    def key_list(self) -> list[bytes]:
        """Every block's hash, in order (what :meth:`key` gives, in one pass)."""
        return _split(self.keys)

    def parent_list(self) -> list[bytes]:
        """Every block's chain parent, in order (what :meth:`parent` gives, in one pass)."""
        return _split(self.parents)

    def __len__(self) -> int:
        return len(self.block_ids)

    @overload
    def __getitem__(self, index: int) -> SaveOp: ...

    @overload
    def __getitem__(self, index: slice) -> SaveOps: ...

    def __getitem__(self, index: int | slice) -> SaveOp | SaveOps:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if (start, step) == (0, 1) and stop >= len(self):
                return self  # NOTE: immutable: the whole is itself (its runs unhashed)
            if step != 1:
                return SaveOps.of(self[i] for i in range(start, stop, step))
            lo, hi = start * HASH_BYTES, max(start, stop) * HASH_BYTES
            return SaveOps(
                self.request_ids[start:stop],
                self.block_ids[start:stop],
                self.keys[lo:hi],
                self.parents[lo:hi],
            )
        i = range(len(self))[index]
        return SaveOp(self.request_ids[i], self.block_ids[i], self.key(i), self.parent(i))

    def __iter__(self) -> Iterator[SaveOp]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SaveOps):
            return (self.request_ids, self.block_ids, self.keys, self.parents) == (
                other.request_ids,
                other.block_ids,
                other.keys,
                other.parents,
            )
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        # NOTE: as the tuple of its items, which it equals (equal objects hash equal).
        return hash(tuple(self))

    def __reduce__(self) -> tuple[type[SaveOps], tuple[object, ...]]:
        # NOTE: runs travel unhashed, as bytes: the receiver hashes them when it reads the
        # keys. This runs inside TensorRT-LLM's broadcast, where nothing may raise: runs whose
        # chain let go of their tokens send the keys instead, and saves whose keys cannot be
        # derived at all (a token out of range) are not sent (their requests' workers then
        # report them done at once).
        columns = self._columns
        try:
            for _, run in columns[2]:
                run.tokens  # noqa: B018  # NOTE: converts now (or raises): see above
        except KeyDerivationError:
            try:
                columns = self._hashed()
            except KeyDerivationError:
                return (SaveOps, ())
        return (SaveOps, (self.request_ids, self.block_ids, *columns))

    def __repr__(self) -> str:
        return f"SaveOps({len(self)} blocks of requests {sorted(set(self.request_ids))})"


NO_SAVES = SaveOps()


def _hash_runs(
    keys: bytes, parents: bytes, derived: tuple[tuple[int, KeyRun], ...]
) -> tuple[bytes, bytes, tuple[tuple[int, KeyRun], ...]]:
    """The columns with the runs' keys hashed in, in block order."""
    out_keys: list[bytes] = []
    out_parents: list[bytes] = []
    at = taken = 0  # NOTE: the next block, and the bytes of the given columns used
    for index, run in derived:
        given = (index - at) * HASH_BYTES
        out_keys.append(keys[taken : taken + given])
        out_parents.append(parents[taken : taken + given])
        taken += given
        hashed = run.keys()
        out_keys.extend(hashed)
        out_parents.append(run.parent)
        out_parents.extend(hashed[:-1])
        at = index + len(hashed)
    out_keys.append(keys[taken:])
    out_parents.append(parents[taken:])
    return b"".join(out_keys), b"".join(out_parents), ()


def _split(column: bytes) -> list[bytes]:
    """A column of concatenated hashes as one ``bytes`` per hash."""
    return [column[i : i + HASH_BYTES] for i in range(0, len(column), HASH_BYTES)]


@dataclass(frozen=True)
class ConnectorMetadata:
    """One iteration's work for the workers.

    Attributes:
        loads: Blocks to load in ``start_load_kv``.
        saves: Blocks to copy out and save after the forward pass, as columns
            (:meth:`SaveOps.of` builds them from :class:`SaveOp` items).
        arenas: Per rank, the shared-memory arena path and slot size for ``LoadOp.slots``
            (empty unless tensor parallel).
        load_seq: Sequence number of this iteration's loads (0 when there are none). Each
            worker publishes it on the completion board once its copies have *completed*;
            the scheduler keeps the staged sources pinned until every rank has.
        board: Path of the shared completion board (tensor parallel), else ''.
        relay: Path of the write relay through which the other ranks report their saves to
            the layout's shared manifest (tensor parallel, with saves), else ''.
        whole_loads: Await the loads whole before the forward pass, never layer by layer:
            a request among them computes one prompt token, and TensorRT-LLM may run such a
            final one-token context in a decode CUDA graph, which calls no layer hook
            (``_make_single_token_context_graph_batch``,
            ``_torch/pyexecutor/engine/runners/decoder/runner.py`` @``fcc4432b``).
    """

    loads: tuple[LoadOp, ...] = ()
    saves: SaveOps = NO_SAVES
    arenas: tuple[tuple[str, int], ...] = ()
    load_seq: int = 0
    board: str = ""
    relay: str = ""
    whole_loads: bool = False


EMPTY = ConnectorMetadata()


__all__ = [
    "ConnectorMetadata",
    "EMPTY",
    "LoadOp",
    "NO_SAVES",
    "SaveOp",
    "SaveOps",
]
