"""Which failed reads to try again, and when: bounded in names and in tries.

A segment or delta that fails verification may be corrupt in the bucket or only garbled
on the way (:class:`~s3kv.manifest.io.Fault`). A reader cannot tell which from one
refresh, so it reads the name again on later refreshes, backing off, until it reads or is
given up. :class:`RetryBook` keeps that schedule, so that no writer, however hostile, can
make a reader hold or reread without bound.
"""

from __future__ import annotations

__all__ = ["RetryBook"]


class RetryBook:
    """Names whose reads failed, to read again on later rounds: bounded in names and tries.

    A name is read again 1, 2, 4, then 8 rounds after its failures and given up at the
    ``attempts``-th; at most ``names`` are held, and a failure beyond that is given up at
    once. A writer that plants any number of unreadable objects therefore costs at most
    ``names`` entries (about 200 bytes each) and ``names`` extra reads in one round, and
    each object at most ``attempts`` failed reads. Not thread-safe (one refresher uses it).

    Args:
        names: Most names held.
        attempts: Failed reads of one name before it is given up.
    """

    def __init__(self, names: int = 256, attempts: int = 5) -> None:
        self.names = names
        self.attempts = attempts
        self._round = 0
        self._held: dict[str, tuple[int, int]] = {}  # name -> (failures, round due)

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, name: object) -> bool:
        return name in self._held

    def held(self) -> list[str]:
        """Every name held, due or not."""
        return list(self._held)

    def next_round(self) -> None:
        """Start a round (each refresh is one)."""
        self._round += 1

    def due(self, name: str) -> bool:
        """Whether to read ``name`` in this round (a name not held always is)."""
        held = self._held.get(name)
        return held is None or held[1] <= self._round

    def failed(self, name: str) -> bool:
        """Count a failed read of ``name``; ``True`` if it will be read again, ``False``
        if it is given up (too many failures, or no room)."""
        failures = self._held.get(name, (0, 0))[0] + 1
        if failures >= self.attempts or (name not in self._held and len(self) >= self.names):
            self._held.pop(name, None)
            return False
        self._held[name] = (failures, self._round + (1 << (failures - 1)))
        return True

    def forget(self, name: str) -> None:
        """Stop tracking ``name`` (read at last, gone, or no longer needed)."""
        self._held.pop(name, None)

    def clear(self) -> None:
        """Forget every name."""
        self._held.clear()
