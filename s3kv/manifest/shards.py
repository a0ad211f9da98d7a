"""One manifest per tensor-parallel layout: a block is present once every shard is written.

Under TP=N every shard of a block has the same key, so one manifest serves the whole layout
(named by :func:`~s3kv.keys.layout_fingerprint`) instead of one per shard:
one startup, one refresh loop and one Bloom filter instead of N. The block objects stay
under each shard's own fingerprint; only the manifest is shared. :class:`ShardedPresence`
owns that manifest and hands each shard a :class:`ShardView` with the methods a store uses
of a :class:`~s3kv.manifest.Manifest`.

Rules:

* **All shards or nothing.** A write reported by shard *i* sets bit *i* of the key's
  pending mask; once all N bits are set the key goes to the manifest's ``record_write``,
  once, with the largest stored size reported (the shards are about equal; warm start
  budgets per shard). Other instances therefore only see blocks whose every shard exists.
* **A shard knows its own writes.** Shard *i*'s ``may_contain`` / ``count_leading`` answer
  "the manifest says so, or bit *i* is set", so a shard never re-saves what it wrote while
  another shard of the block is still missing. Taken over every shard (as the connector
  does) that is exactly "every shard is written".
* **Usage once.** Hits and pins are recorded through shard 0's view only; the other views
  drop them. A claim touches every shard, and N views would count each hit N times.
* **Bounded.** At most ``max_pending`` keys wait for their other shards (a rank whose save
  failed never reports). Past that the oldest waiting key is forgotten and counted
  (``shard_pending_evicted``): its block is saved again the next time a request carries it.
* **Closed once.** Each view's :meth:`~ShardView.close` releases one reference; the last one
  closes (and flushes) the manifest. A view closed twice releases once.

Thread-safe: one lock guards the pending masks and counters, and the manifest is thread-safe
itself (it never calls back into this module, so holding the lock around it cannot deadlock).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from s3kv.keys import HASH_BYTES, BlockHash
from s3kv.manifest.live import Manifest

__all__ = ["ShardView", "ShardedPresence"]

#: Default bound on keys waiting for their other shards (~250 bytes each: ~16 MB).
DEFAULT_MAX_PENDING: Final = 65_536


@dataclass(slots=True)
class _Pending:
    """A key some shards have reported: which ones, and what they reported."""

    mask: int
    parent: bytes
    size: int


class ShardedPresence:
    """The shared manifest of one TP layout and the all-shards rule over it.

    Build it around the layout's opened manifest (:meth:`Manifest.open` under the layout
    fingerprint), hand each shard's store :meth:`view` ``(i)``, and :meth:`start` the
    manifest's background thread once.

    Args:
        manifest: The layout's manifest; owned from now on (closed by the last view).
        shards: Number of shards (the TP size), >= 1.
        max_pending: Keys that may wait for their other shards, >= 1.

    Raises:
        ValueError: ``shards`` or ``max_pending`` below 1.
    """

    def __init__(
        self, manifest: Manifest, shards: int, *, max_pending: int = DEFAULT_MAX_PENDING
    ) -> None:
        if shards < 1:
            raise ValueError(f"shards: must be >= 1, got {shards}")
        if max_pending < 1:
            raise ValueError(f"max_pending: must be >= 1, got {max_pending}")
        self.shards = shards
        self.max_pending = max_pending
        self._manifest = manifest
        self._full = (1 << shards) - 1
        self._lock = threading.Lock()
        self._pending: OrderedDict[bytes, _Pending] = OrderedDict()  # oldest first
        self._evicted = 0
        self._completed = 0
        self._refs = 0
        self._closed = False

    def start(
        self, refresh_interval: float = 30.0, flush_interval: float = 5.0, flush_keys: int = 4096
    ) -> None:
        """Start the manifest's background thread (:meth:`Manifest.start`); once."""
        self._manifest.start(
            refresh_interval=refresh_interval, flush_interval=flush_interval, flush_keys=flush_keys
        )

    def view(self, shard: int) -> ShardView:
        """A new view for ``shard``'s store; each one holds a reference until closed.

        Raises:
            ValueError: ``shard`` is not in ``0..shards-1``.
            RuntimeError: the manifest was already closed by the last view.
        """
        self._check_shard(shard)
        with self._lock:
            if self._closed:
                raise RuntimeError("ShardedPresence.view: the manifest is closed")
            self._refs += 1
        return ShardView(self, shard)

    # --- lookups: memory only -------------------------------------------------------------

    def may_contain(self, shard: int, key: bytes) -> bool:
        """Whether ``key`` may exist for ``shard``: in the manifest, or written by ``shard``."""
        if self._manifest.may_contain(key):
            return True
        with self._lock:
            entry = self._pending.get(bytes(key))
            return entry is not None and bool(entry.mask >> shard & 1)

    def contains_many(self, shard: int, keys: Sequence[bytes]) -> npt.NDArray[np.bool_]:
        """:meth:`may_contain` for each of ``keys``: one filter pass, one lock."""
        present = self._manifest.contains_many(keys)
        if self._pending and not present.all():
            bit = 1 << shard
            with self._lock:
                for i in np.flatnonzero(~present).tolist():
                    entry = self._pending.get(bytes(keys[i]))
                    present[i] = entry is not None and bool(entry.mask & bit)
        return present

    def count_leading(self, shard: int, keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` that :meth:`may_contain` for ``shard``."""
        if not keys or not self.may_contain(shard, keys[0]):
            return 0  # NOTE: a prompt nobody saved costs one scalar lookup, not a pass
        present = self._manifest.contains_many(keys)
        missing = np.flatnonzero(~present)
        # NOTE: a racy emptiness check is fine: a key added meanwhile is a hint missed once.
        if not len(missing) or not self._pending:
            return int(missing[0]) if len(missing) else len(keys)
        bit = 1 << shard
        # NOTE: one filter pass, then one lock for the walk: linear in the prompt.
        with self._lock:
            for index in missing.tolist():
                entry = self._pending.get(bytes(keys[index]))
                if entry is None or not entry.mask & bit:
                    return int(index)
        return len(keys)

    # --- recording: memory only -----------------------------------------------------------

    def record_write(self, shard: int, key: BlockHash, parent: BlockHash, size: int) -> None:
        """Note that ``shard`` wrote its part of ``key``; the last shard records the key.

        Raises:
            ValueError: ``shard`` out of range, or ``key``/``parent`` not 16 bytes.
        """
        self._check_shard(shard)
        key_bytes, parent_bytes = bytes(key), bytes(parent)
        if len(key_bytes) != HASH_BYTES or len(parent_bytes) != HASH_BYTES:
            raise ValueError(f"key, parent: must be {HASH_BYTES} bytes each")
        with self._lock:
            entry = self._pending.get(key_bytes)
            if entry is None:
                if self._manifest.may_contain(key_bytes):
                    return  # already advertised (another instance, or a re-save): nothing new
                entry = self._pending[key_bytes] = _Pending(0, parent_bytes, 0)
            entry.mask |= 1 << shard
            entry.size = max(entry.size, int(size))
            if entry.mask == self._full:
                del self._pending[key_bytes]
                self._completed += 1
                # NOTE: under the lock, so no lookup sees the key in neither place.
                self._manifest.record_write(key, BlockHash(entry.parent), entry.size)
            elif len(self._pending) > self.max_pending:
                self._pending.popitem(last=False)
                self._evicted += 1

    def record_hits(self, keys: Sequence[BlockHash]) -> None:
        """Note that ``keys`` served a request (once per claim: shard 0's view calls this)."""
        self._manifest.record_hits(keys)

    def record_pin(self, keys: Sequence[BlockHash]) -> None:
        """Pin ``keys`` in the manifest (:meth:`Manifest.record_pin`)."""
        self._manifest.record_pin(keys)

    def record_unpin(self, keys: Sequence[BlockHash]) -> None:
        """Undo :meth:`record_pin`."""
        self._manifest.record_unpin(keys)

    # --- lifecycle ------------------------------------------------------------------------

    def flush(self) -> int:
        """Write one manifest segment now (:meth:`Manifest.flush`); records written."""
        return self._manifest.flush()

    def _release(self, flush: bool, timeout: float | None) -> None:
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
            if last:
                self._closed = True
        if last:
            self._manifest.close(flush=flush, timeout=timeout)

    @property
    def closed(self) -> bool:
        """Whether the last view has closed the manifest."""
        return self._closed

    @property
    def pending(self) -> int:
        """Keys waiting for some of their shards."""
        with self._lock:
            return len(self._pending)

    def stats(self) -> dict[str, float]:
        """The manifest's :meth:`~Manifest.stats` plus the all-shards rule's own.

        Added: ``shard_pending`` (gauge: keys waiting for other shards),
        ``shard_pending_evicted`` (waiting keys forgotten at the bound) and
        ``shard_writes_completed`` (keys recorded once every shard was written).
        """
        values = self._manifest.stats()
        with self._lock:
            values["shard_pending"] = float(len(self._pending))
            values["shard_pending_evicted"] = float(self._evicted)
            values["shard_writes_completed"] = float(self._completed)
        return values

    def _check_shard(self, shard: int) -> None:
        if not 0 <= shard < self.shards:
            raise ValueError(f"shard: must be in 0..{self.shards - 1}, got {shard}")


class ShardView:
    """One shard's face of a :class:`ShardedPresence`: the manifest methods a store uses.

    Made by :meth:`ShardedPresence.view`. Lookups and writes apply the all-shards rule for
    :attr:`shard`; hits and pins are forwarded by shard 0's view only; :meth:`close`
    releases this view's reference (the last one closes the manifest). Thread-safe.
    """

    def __init__(self, presence: ShardedPresence, shard: int) -> None:
        self.presence = presence
        self.shard = shard
        self._closed = False
        self._close_lock = threading.Lock()

    def may_contain(self, key: bytes) -> bool:
        """Whether ``key`` may exist: every shard is written, or this one is. No network."""
        return self.presence.may_contain(self.shard, key)

    def count_leading(self, keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` that :meth:`may_contain`. No network."""
        return self.presence.count_leading(self.shard, keys)

    def contains_many(self, keys: Sequence[bytes]) -> npt.NDArray[np.bool_]:
        """:meth:`may_contain` for each of ``keys`` (one vectorized pass). No network."""
        return self.presence.contains_many(self.shard, keys)

    def record_write(self, key: BlockHash, parent: BlockHash, size: int) -> None:
        """This shard wrote its part of ``key`` (``size`` stored bytes)."""
        self.presence.record_write(self.shard, key, parent, size)

    def record_writes(self, writes: Sequence[tuple[BlockHash, BlockHash, int]]) -> None:
        """:meth:`record_write` of each ``(key, parent, size)``."""
        for key, parent, size in writes:
            self.presence.record_write(self.shard, key, parent, size)

    def record_hits(self, keys: Sequence[BlockHash]) -> None:
        """Hits: forwarded by shard 0's view only (one claim touches every shard)."""
        if self.shard == 0:
            self.presence.record_hits(keys)

    def record_pin(self, keys: Sequence[BlockHash]) -> None:
        """Pins: forwarded by shard 0's view only."""
        if self.shard == 0:
            self.presence.record_pin(keys)

    def record_unpin(self, keys: Sequence[BlockHash]) -> None:
        """Unpins: forwarded by shard 0's view only."""
        if self.shard == 0:
            self.presence.record_unpin(keys)

    def flush(self) -> int:
        """Flush the shared manifest now; records written."""
        return self.presence.flush()

    def close(self, flush: bool = True, timeout: float | None = None) -> None:
        """Release this view (idempotent); the last view closes the shared manifest."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.presence._release(flush, timeout)

    def stats(self) -> dict[str, float]:
        """The shared :meth:`ShardedPresence.stats` (the same for every view)."""
        return self.presence.stats()
