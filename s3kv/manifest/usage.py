"""Per-key usage: folding manifest records, loading it, and the queries warm start and ops make.

:func:`fold` is shared by compaction (which persists the result as ``usage.bin``) and by
:func:`load_usage` (which folds the segments newer than the snapshot in memory, for warm
start and ``s3kv stats``/``prune``/``pins``). It is vectorized: every input becomes a row of
one event table, sorted by (key, time), and each column is reduced per key with
``ufunc.reduceat``. Folding the usage of 1M keys takes about a second on one core.

Fold rules, per key:

* live if the snapshot, a write record or the full listing has it (hits and pins alone do
  not make a key live: the manifest never claims an object it has no evidence of);
* ``first_written`` is the earliest, ``last_used`` the latest time seen (writes and hits);
* ``hits`` add up (a hit record carries the number of hits it coalesced);
* ``size`` and ``parent`` come from the latest event that knows them;
* ``pinned`` follows the latest pin or unpin record (by record time), else the snapshot;
* keys in ``drop`` are removed whatever else says (prune passes the keys it deleted).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from s3kv.keys import ROOT_HASH, BlockHash
from s3kv.manifest.format import (
    KIND_HIT,
    KIND_PIN,
    KIND_UNPIN,
    KIND_WRITE,
    UNKNOWN_PARENT,
    USAGE_DTYPE,
    Records,
)

__all__ = ["UsageRow", "UsageTable", "fold", "fold_sorted", "remove_keys"]

_MAX_HITS: Final = 2**32 - 1
_NO_ROW: Final = -1
_ROOT: Final = -1
_MISSING: Final = -2
_ALL_ONES: Final = np.uint64(2**64 - 1)


def _as_keys(keys: Iterable[bytes]) -> npt.NDArray[np.void]:
    return np.array([bytes(key) for key in keys], dtype="V16")


def _halves(keys: npt.NDArray[np.void]) -> tuple[npt.NDArray[np.uint64], ...]:
    """Big-endian uint64 halves: sorting by (hi, lo) is sorting by the key's bytes."""
    pairs = np.ascontiguousarray(keys).view(">u8").reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]


_EVENT_DTYPE: Final = np.dtype(
    [
        ("key", "V16"),
        ("parent", "V16"),
        ("order", "<f8"),  # time order of pin/unpin and size updates; -inf for baselines
        ("t_first", "<f8"),  # candidate first_written (+inf: none)
        ("t_last", "<f8"),  # candidate last_used (-inf: none)
        ("hits", "<i8"),
        ("size", "<u8"),
        ("pin", "i1"),  # -1: says nothing, 0: unpin, 1: pin
        ("live", "?"),  # evidence that the object exists
    ]
)


def _usage_events(usage: Records) -> Records:
    events = np.zeros(len(usage), _EVENT_DTYPE)
    for name in ("key", "parent", "hits", "size"):
        events[name] = usage[name]
    events["order"] = -np.inf
    events["t_first"], events["t_last"] = usage["first_written"], usage["last_used"]
    events["pin"], events["live"] = usage["pinned"], True
    return events


def _record_events(records: Records) -> Records:
    events = np.zeros(len(records), _EVENT_DTYPE)
    kind, rtime = records["kind"], records["time"]
    is_write, is_hit = kind == KIND_WRITE, kind == KIND_HIT
    events["key"], events["order"] = records["key"], rtime
    # NOTE: only a write's parent is authoritative (the hit path does not know it).
    events["parent"] = UNKNOWN_PARENT
    events["parent"][is_write] = records["parent"][is_write]
    events["t_first"] = np.where(is_write, rtime, np.inf)
    events["t_last"] = np.where(is_write | is_hit, rtime, -np.inf)
    events["hits"] = np.where(is_hit, records["count"], 0)
    events["size"] = np.where(is_write, records["size"], 0)
    events["pin"] = np.select([kind == KIND_PIN, kind == KIND_UNPIN], [1, 0], -1)
    events["live"] = is_write
    return events


def _listing_events(listing: list[tuple[bytes, int, float]]) -> Records:
    events = np.zeros(len(listing), _EVENT_DTYPE)
    if listing:
        events["key"] = _as_keys(item[0] for item in listing)
        events["parent"] = UNKNOWN_PARENT
        modified = np.array([float(item[2]) for item in listing])
        events["order"] = -np.inf
        events["t_first"], events["t_last"] = modified, modified
        events["size"] = np.array([int(item[1]) for item in listing], np.uint64)
        events["pin"], events["live"] = -1, True
    return events


def fold(
    usage: Records,
    records: Records,
    *,
    listing: Iterable[tuple[bytes, int, float]] = (),
    drop: Collection[bytes] = (),
) -> Records:
    """Fold segment ``records`` and ``listing`` into ``usage``; a new usage array.

    Args:
        usage: Rows of :data:`USAGE_DTYPE` (the snapshot's table).
        records: Rows of :data:`RECORD_DTYPE`, from any number of segments, any order.
        listing: ``(key, size, last_modified)`` of objects found by a full bucket listing.
        drop: Keys to remove.

    Returns:
        Rows of :data:`USAGE_DTYPE`, one per live key, sorted by key bytes.
    """
    listed = list(listing)
    if not len(records) and not listed:
        table = _sorted_table(usage)
        if table is not None:
            return remove_keys(table, drop)
    return _fold_events(usage, records, listed, drop)


def _sorted_table(usage: Records) -> Records | None:
    """:func:`fold` of a usage table alone, or None where a key repeats: its rows sorted by
    key. Every rule then keeps a row as it is but a ``pinned`` byte over 127, which the event
    table reads as int8 "says nothing" (0). One sort on two columns instead of three, and
    no event table: a 5M-key table (a shard of a migrated format-1 ``usage.bin``) folds in
    5.4-6.6 s instead of 10.8-11.7 s (2-core machine, two rounds)."""
    hi, lo = _halves(usage["key"])
    order = np.lexsort((lo, hi))
    hi, lo = hi[order], lo[order]
    if ((hi[1:] == hi[:-1]) & (lo[1:] == lo[:-1])).any():
        return None
    table: Records = usage[order]
    table["pinned"][table["pinned"] > 127] = 0
    return table


def _fold_events(
    usage: Records, records: Records, listing: list[tuple[bytes, int, float]],
    drop: Collection[bytes],
) -> Records:  # fmt: skip
    """:func:`fold` through the event table (any input)."""
    events = np.concatenate(
        [_usage_events(usage), _record_events(records), _listing_events(listing)]
    )
    if len(events) == 0:
        return np.zeros(0, USAGE_DTYPE)
    hi, lo = _halves(events["key"])
    events = events[np.lexsort((events["order"], lo, hi))]
    hi, lo = _halves(events["key"])
    changed = (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])
    starts = np.flatnonzero(np.concatenate(([True], changed)))
    positions = np.arange(len(events))
    p_hi, p_lo = _halves(events["parent"])
    parent_at = last_where_sorted(~((p_hi == _ALL_ONES) & (p_lo == _ALL_ONES)), starts, positions)
    size_at = last_where_sorted(events["size"] > 0, starts, positions)
    pin_at = last_where_sorted(events["pin"] >= 0, starts, positions)

    out = np.zeros(len(starts), USAGE_DTYPE)
    out["key"] = events["key"][starts]
    out["parent"] = UNKNOWN_PARENT
    has_parent = parent_at >= 0
    out["parent"][has_parent] = events["parent"][parent_at[has_parent]]
    out["first_written"] = np.minimum.reduceat(events["t_first"], starts)
    out["last_used"] = np.maximum.reduceat(events["t_last"], starts)
    out["hits"] = np.minimum(np.add.reduceat(events["hits"], starts), _MAX_HITS)
    out["size"] = np.where(size_at >= 0, events["size"][size_at], 0)
    out["pinned"] = np.where(pin_at >= 0, events["pin"][pin_at], 0)
    out = out[np.maximum.reduceat(events["live"], starts)]
    return remove_keys(out, drop) if drop else out


def fold_sorted(rows: Records, records: Records) -> Records:
    """:func:`fold` for a usage table already sorted by key, touching only changed keys.

    Rows no record names pass through untouched (no copy when nothing changed), so folding a
    snapshot shard costs memory for the keys the records name, not for the whole shard.
    """
    if not len(records):
        return rows
    names = np.unique(records["key"])
    touched = np.zeros(len(rows), np.bool_)
    touched[_matching_slots(rows["key"], names)] = True
    merged = np.concatenate([rows[~touched], fold(rows[touched], records)])
    hi, lo = _halves(merged["key"])
    ordered: Records = merged[np.lexsort((lo, hi))]
    return ordered


def remove_keys(rows: Records, keys: Collection[bytes]) -> Records:
    """``rows`` (sorted by key) without the rows of ``keys``."""
    if not keys or not len(rows):
        return rows
    keep = np.ones(len(rows), np.bool_)
    keep[_matching_slots(rows["key"], _as_keys(keys))] = False
    return rows[keep]


def last_where_sorted(
    mask: npt.NDArray[np.bool_], starts: npt.NDArray[np.intp], positions: npt.NDArray[np.intp]
) -> npt.NDArray[np.intp]:
    """Per group (``starts``), the position of the last element where ``mask``, or -1."""
    picked: npt.NDArray[np.intp] = np.maximum.reduceat(np.where(mask, positions, _NO_ROW), starts)
    return picked


def _matching_slots(
    sorted_keys: npt.NDArray[np.void], wanted: npt.NDArray[np.void]
) -> npt.NDArray[np.intp]:
    """Positions in ``sorted_keys`` of the keys of ``wanted`` that it holds."""
    if not len(sorted_keys) or not len(wanted):
        return np.zeros(0, np.intp)
    slots = np.searchsorted(sorted_keys, wanted)
    inside = slots < len(sorted_keys)
    slots, wanted = slots[inside], wanted[inside]
    found: npt.NDArray[np.intp] = slots[sorted_keys[slots] == wanted]
    return found


@dataclass(frozen=True)
class UsageRow:
    """Usage of one live key.

    Attributes:
        key: The block key.
        parent: Its chain parent (``ROOT_HASH`` for a first block, ``None`` if unknown).
        first_written: Epoch seconds of its first recorded write.
        last_used: Epoch seconds of its latest write or hit.
        hits: Hits recorded.
        size: Stored object bytes (0 if unknown).
        pinned: Whether an operator pinned it.
    """

    key: BlockHash
    parent: BlockHash | None
    first_written: float
    last_used: float
    hits: int
    size: int
    pinned: bool


class UsageTable:
    """Per-key usage of one fingerprint, sorted by key; read-only.

    Args:
        rows: Rows of :data:`USAGE_DTYPE`, sorted by key (as :func:`fold` returns them).
        generation: Snapshot generation the table started from (0: no snapshot).
        segments_read: Segments newer than the snapshot that were folded in.
        segments_corrupt: Segments skipped because they failed verification.
    """

    def __init__(
        self,
        rows: Records,
        *,
        generation: int = 0,
        segments_read: int = 0,
        segments_corrupt: int = 0,
    ) -> None:
        self.rows: Records = rows
        self.generation = generation
        self.segments_read = segments_read
        self.segments_corrupt = segments_corrupt

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self._slot(key) is not None

    @property
    def total_bytes(self) -> int:
        """Stored bytes of every live key (as recorded)."""
        return int(self.rows["size"].sum(dtype=np.uint64))

    def _slot(self, key: bytes) -> int | None:
        found = _matching_slots(self.rows["key"], _as_keys([key]))
        return int(found[0]) if len(found) else None

    def row(self, key: bytes) -> UsageRow | None:
        """The usage of ``key``, or ``None`` if it is not live."""
        slot = self._slot(key)
        if slot is None:
            return None
        row = self.rows[slot]
        parent = bytes(row["parent"])
        return UsageRow(
            key=BlockHash(bytes(row["key"])),
            parent=None if parent == UNKNOWN_PARENT else BlockHash(parent),
            first_written=float(row["first_written"]),
            last_used=float(row["last_used"]),
            hits=int(row["hits"]),
            size=int(row["size"]),
            pinned=bool(row["pinned"]),
        )

    def last_used(self, key: bytes) -> float | None:
        """Epoch seconds of the latest write or hit of ``key``; ``None`` if not live."""
        slot = self._slot(key)
        return None if slot is None else float(self.rows["last_used"][slot])

    def hottest_chains(self, limit_bytes: int) -> list[list[BlockHash]]:
        """The hottest prefix chains whose distinct blocks fit in ``limit_bytes``.

        Blocks are ranked pinned first, then by hits, then by last use. Taking a block takes
        the ancestors it needs (a block is only loadable after its whole prefix), and the
        block is skipped if that does not fit the remaining budget. Blocks whose chain does
        not reach the root through live keys are never taken.

        Returns:
            Root→leaf chains of the selected blocks, hottest first. Chains that share a
            prefix each list it in full; a chain that is a prefix of another is not listed
            on its own. The budget counts each distinct block once.
        """
        n = len(self.rows)
        if n == 0 or limit_bytes <= 0:
            return []
        keys = self.rows["key"]
        parents = self.rows["parent"]
        parent_idx = np.full(n, _MISSING, np.int64)
        parent_idx[parents == np.void(ROOT_HASH)] = _ROOT
        slots = np.searchsorted(keys, parents)
        inside = slots < n
        linked = np.zeros(n, np.bool_)
        linked[inside] = keys[slots[inside]] == parents[inside]
        parent_idx[linked] = slots[linked]
        rank = np.lexsort(
            (
                -self.rows["last_used"],
                -self.rows["hits"].astype(np.int64),
                -self.rows["pinned"].astype(np.int64),
            )
        )
        selected, order = _select(
            rank.tolist(), parent_idx.tolist(), self.rows["size"].tolist(), limit_bytes
        )
        return _chains(selected, order, parent_idx.tolist(), keys)


def _select(
    rank: list[int], parent_idx: list[int], sizes: list[int], budget: int
) -> tuple[list[bool], list[int]]:
    """Greedy, ancestor-closed selection within ``budget``; (selected mask, selection order)."""
    n = len(parent_idx)
    selected = [False] * n
    dead = [False] * n  # chain does not reach the root
    order: list[int] = []
    smallest = min((size for size in sizes if size > 0), default=0)
    for node in rank:
        if selected[node] or dead[node]:
            continue
        path: list[int] = []
        cursor = node
        reachable = True
        while cursor >= 0 and not selected[cursor]:
            if dead[cursor] or len(path) > n:  # len > n: a cycle in corrupt data
                reachable = False
                break
            path.append(cursor)
            cursor = parent_idx[cursor]
        if not reachable or cursor == _MISSING:
            for item in path:
                dead[item] = True
            continue
        cost = sum(sizes[item] for item in path)
        if cost > budget:
            continue
        budget -= cost
        for item in reversed(path):
            selected[item] = True
            order.append(item)
        if budget < smallest:
            break
    return selected, order


def _chains(
    selected: list[bool], order: list[int], parent_idx: list[int], keys: npt.NDArray[np.void]
) -> list[list[BlockHash]]:
    has_child = [False] * len(selected)
    for node in order:
        parent = parent_idx[node]
        if parent >= 0:
            has_child[parent] = True
    leaves = [node for node in order if not has_child[node]]
    chains: list[list[BlockHash]] = []
    for leaf in leaves:
        path = [leaf]
        while parent_idx[path[-1]] >= 0:
            path.append(parent_idx[path[-1]])
        chains.append([BlockHash(bytes(keys[i])) for i in reversed(path)])
    return chains
