"""A circuit breaker over object-store requests.

While the bucket is unhealthy, every request would wait out its timeouts and retries; the
breaker turns that into an immediate :class:`CircuitOpenError` after ``failures``
consecutive failures, so the connector claims nothing, drops saves and skips prefetches at
zero cost. After ``cooldown`` seconds one probe request is let through (half-open): success
closes the circuit, failure re-opens it for another cooldown.

Only failures that say the *service* is unhealthy count (endpoint, throttling, 5xx, access
denied); "not found" is a normal answer and a corrupt object is the object's problem.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable

from s3kv.errors import StorageError

__all__ = ["NEUTRAL_KINDS", "BreakerState", "CircuitBreaker", "CircuitOpenError"]

logger = logging.getLogger(__name__)


class CircuitOpenError(StorageError):
    """Raised instead of making a request while the breaker is open."""

    kind = "circuit_open"


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Counts consecutive failures; opens, cools down, probes, closes. Thread-safe.

    Args:
        failures: Consecutive failures that open the circuit (>= 1).
        cooldown: Seconds the circuit stays open before one probe is allowed.
        clock: Monotonic seconds (injectable for tests).
    """

    def __init__(
        self, failures: int, cooldown: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.failures = failures
        self.cooldown = cooldown
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self._probing = False
        self.trips = 0

    @property
    def state(self) -> BreakerState:
        """The current state (OPEN turns HALF_OPEN once the cooldown has passed)."""
        with self._lock:
            return self._current()

    @property
    def healthy(self) -> bool:
        """True when requests flow normally (closed)."""
        return self.state is BreakerState.CLOSED

    def before_request(self) -> None:
        """Admit a request or raise :class:`CircuitOpenError` (one probe when half-open)."""
        with self._lock:
            state = self._current()
            if state is BreakerState.CLOSED:
                return
            if state is BreakerState.HALF_OPEN and not self._probing:
                self._probing = True
                return
        raise CircuitOpenError("s3kv: object store marked unhealthy; skipping the request")

    def admit_many(self, count: int) -> int:
        """:meth:`before_request` for ``count`` requests at once: how many may be made.

        All of them while closed, one (the probe) while half-open and none is probing,
        none otherwise. Never raises.
        """
        with self._lock:
            state = self._current()
            if state is BreakerState.CLOSED:
                return count
            if state is BreakerState.HALF_OPEN and not self._probing and count > 0:
                self._probing = True
                return 1
        return 0

    def cancel(self) -> None:
        """An admitted request was not made after all: a half-open probe may be admitted again."""
        with self._lock:
            self._probing = False

    def record_success(self) -> None:
        """A request succeeded: close the circuit."""
        with self._lock:
            if self._state is not BreakerState.CLOSED:
                logger.warning("s3kv: object store healthy again; circuit closed")
            self._state = BreakerState.CLOSED
            self._consecutive = 0
            self._probing = False

    def record_failure(self) -> None:
        """A request failed in a way that says the service is unhealthy."""
        with self._lock:
            self._consecutive += 1
            probing, self._probing = self._probing, False
            if probing or (
                self._state is BreakerState.CLOSED and self._consecutive >= self.failures
            ):
                self._state = BreakerState.OPEN
                self._opened_at = self._clock()
                self.trips += 1
                logger.warning(
                    "s3kv: %d consecutive storage failures; circuit open for %.0f s "
                    "(claiming nothing, dropping saves)",
                    self._consecutive,
                    self.cooldown,
                )

    def _current(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.cooldown:
            self._state = BreakerState.HALF_OPEN
        return self._state


#: Storage error kinds that say nothing about the service's health.
NEUTRAL_KINDS = frozenset({"precondition_failed", "circuit_open"})
