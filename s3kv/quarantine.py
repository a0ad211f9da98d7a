"""Keys whose objects failed verification, remembered for a while so they are not fetched
again and again.

Without it a corrupt, forged or oversized object under a popular key is fetched on every
request that reaches it (10 lookups, 10 GETs of the same bad bytes). With it the key is a
miss without a request until its entry expires; the next save of the key overwrites the bad
object (a save of a quarantined key is not skipped as "already there"), and ``s3kv verify
--delete-corrupt`` removes it for every instance.

Bounded twice: at most ``capacity`` keys (the oldest entry goes first) and ``ttl`` seconds
per entry, so a hostile writer planting millions of bad objects costs a fixed amount of
memory, and a key healed by another instance is tried again after ``ttl``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Final, Generic, TypeVar

K = TypeVar("K")

#: Default bounds: 64Ki keys (about 8 MB at worst) for 10 minutes.
CAPACITY: Final = 1 << 16
TTL_S: Final = 600.0


class Quarantine(Generic[K]):
    """A bounded set of keys with a time to live; thread-safe."""

    def __init__(
        self,
        capacity: int = CAPACITY,
        ttl: float = TTL_S,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1 or ttl <= 0:
            raise ValueError("capacity must be >= 1 and ttl > 0")
        self.capacity = capacity
        self.ttl = ttl
        self._clock = clock
        self._expiry: OrderedDict[K, float] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, key: K) -> None:
        """Quarantine ``key`` for ``ttl`` seconds from now (again, if it already is)."""
        with self._lock:
            self._expiry.pop(key, None)
            self._expiry[key] = self._clock() + self.ttl
            while len(self._expiry) > self.capacity:
                self._expiry.popitem(last=False)

    def among(self, keys: Iterable[K]) -> set[K]:
        """Those of ``keys`` quarantined now, under one lock (nothing asked when empty)."""
        with self._lock:
            if not self._expiry:
                return set()
            now = self._clock()
            return {key for key in keys if self._expiry.get(key, now) > now}

    def __contains__(self, key: object) -> bool:
        with self._lock:
            expiry = self._expiry.get(key)  # type: ignore[arg-type]
            if expiry is None:
                return False
            if expiry <= self._clock():
                del self._expiry[key]  # type: ignore[arg-type]
                return False
            return True

    def discard(self, key: K) -> None:
        """Release ``key`` (its object was rewritten)."""
        with self._lock:
            self._expiry.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._expiry)


__all__ = ["Quarantine"]
