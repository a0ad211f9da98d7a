"""The bounded queue of manifest records waiting for the next segment flush (private).

Writes, pins and unpins are kept in order; hits are coalesced per key (count + latest
time), because a busy server hits the same prefix blocks thousands of times per flush
interval. At the bound the oldest records are dropped — hits first: they only feed usage
statistics, while a dropped write costs other instances a miss on that key.

Not thread-safe: :class:`s3kv.manifest.Manifest` calls it under its own lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np

from s3kv.manifest.format import KIND_HIT, KIND_WRITE, RECORD_DTYPE, UNKNOWN_PARENT, Records

__all__ = ["Record", "RecordQueue"]

#: key, parent, time, size, kind, count (one row of RECORD_DTYPE).
Record = tuple[bytes, bytes, float, int, int, int]


class RecordQueue:
    """Records waiting to be flushed, at most ``bound`` of them (hits count once per key).

    Memory: about 250 bytes per record (Python tuples and 16-byte keys).

    Args:
        bound: Most records held; beyond it the oldest are dropped (hits first).
    """

    def __init__(self, bound: int) -> None:
        self.bound = max(1, bound)
        self.dropped = 0
        self._records: deque[Record] = deque()
        self._hits: dict[bytes, list[float]] = {}  # key -> [count, latest time]
        self._oldest_hit = float("inf")  # when the oldest pending hit was added

    def __len__(self) -> int:
        return len(self._records) + len(self._hits)

    def append(self, record: Record) -> None:
        """Queue a write, pin or unpin record."""
        self._drop_beyond(self.bound - 1)
        self._records.append(record)

    def extend(self, records: Iterable[Record]) -> None:
        """:meth:`append` of each of ``records``, dropping beyond the bound once, after."""
        self._records.extend(records)
        self._drop_beyond(self.bound)

    def add_hits(self, keys: Iterable[bytes], now: float) -> None:
        """Count one hit at ``now`` for each of ``keys``.

        New keys go in at the end; the oldest records beyond the bound (hits first) are
        dropped once, after the batch. NOTE: not before each insertion: a claim records
        hundreds of hits on the engine's thread, and a check per key cost ~2 us each.
        """
        hits = self._hits
        added = False
        for key in keys:
            entry = hits.get(key)
            if entry is None:
                hits[bytes(key)] = [1.0, now]
                added = True
            else:
                entry[0] += 1
                entry[1] = now
        if added:
            self._oldest_hit = min(self._oldest_hit, now)
            self._drop_beyond(self.bound)

    def due(self, now: float, hit_interval: float) -> bool:
        """Whether a flush has something to write now.

        Writes, pins and unpins are always due; hits alone only once the oldest has waited
        ``hit_interval`` seconds, so a busy instance that only serves hits writes one
        segment per ``hit_interval`` instead of one per flush.
        """
        if self._records:
            return True
        return bool(self._hits) and now - self._oldest_hit >= hit_interval

    def write_keys(self) -> list[bytes]:
        """Keys of the queued write records."""
        return [record[0] for record in self._records if record[4] == KIND_WRITE]

    def take(self) -> RecordQueue:
        """Move every record into a new queue (returned) and leave this one empty."""
        taken = RecordQueue(self.bound)
        taken._records, taken._hits = self._records, self._hits
        taken._oldest_hit = self._oldest_hit
        self._records, self._hits = deque(), {}
        self._oldest_hit = float("inf")
        return taken

    def put_back(self, older: RecordQueue) -> None:
        """Return ``older``'s records (a failed flush) ahead of the ones queued since."""
        hits = older._hits
        for key, entry in self._hits.items():
            old = hits.get(key)
            if old is None:
                hits[key] = entry
            else:
                old[0] += entry[0]
                old[1] = max(old[1], entry[1])
        older._records.extend(self._records)
        self._records, self._hits = older._records, hits
        self._oldest_hit = min(self._oldest_hit, older._oldest_hit)
        self._drop_beyond(self.bound)

    def to_array(self) -> Records:
        """All records as :data:`RECORD_DTYPE` rows, hits last (one row per key)."""
        hits: list[Record] = [
            (key, UNKNOWN_PARENT, entry[1], 0, KIND_HIT, int(entry[0]))
            for key, entry in self._hits.items()
        ]
        return np.array([*self._records, *hits], dtype=RECORD_DTYPE)

    def _drop_beyond(self, limit: int) -> None:
        while len(self._records) + len(self._hits) > limit:
            if self._hits:
                del self._hits[next(iter(self._hits))]
            else:
                self._records.popleft()
            self.dropped += 1
