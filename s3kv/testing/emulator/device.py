"""An emulated device that runs late: one in-order work queue, run only when synchronised.

Under TensorRT-LLM's overlap loop (``PyExecutor._executor_loop_overlap`` in
``tensorrt_llm/_torch/pyexecutor/py_executor.py``) the host runs about one iteration ahead
of the GPU: work it enqueues (host→device copies, the forward pass, device→host copies) runs
some time later, in stream order. :class:`LateDevice` takes that to the worst case: queued
work runs *only* when somebody synchronises (:meth:`LateDevice.synchronize` or
:meth:`LateEvent.synchronize`), on the synchronising thread, in enqueue order. So a connector
that recycles a host buffer before the device copy reading it has completed reads recycled
bytes here exactly as it would on a GPU.

All streams of the device are one queue: :meth:`LateDevice.stream` returns the device itself,
which implements :class:`s3kv.connector.device.DeferredStream`.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

Work = Callable[[], None]


class LateEvent:
    """A marker after the work queued before it (a ``torch.cuda.Event`` stand-in)."""

    def __init__(self, device: LateDevice, position: int) -> None:
        self._device = device
        self._position = position

    def query(self) -> bool:
        """Whether all work queued before the marker has run. Never runs work, never blocks."""
        return self._device.executed >= self._position

    def synchronize(self) -> None:
        """Run queued work up to and including the marker, then return.

        Raises:
            Exception: Whatever a work item raised (the item counts as run; later items stay
                queued).
        """
        self._device.run_until(self._position)


class LateDevice:
    """One in-order work queue whose items run only at synchronisation points.

    Thread safety: :meth:`enqueue` and :meth:`record_event` only take a short queue lock, so
    any thread may call them, also from inside running work. Running is serialised by a
    re-entrant lock: one thread runs work at a time, in FIFO order; work may enqueue more
    work or synchronise (re-entrantly) on the same thread.
    """

    def __init__(self) -> None:
        self._queue_lock = threading.Lock()
        self._run_lock = threading.RLock()
        self._queue: collections.deque[Work] = collections.deque()
        self._enqueued = 0
        self._executed = 0

    def stream(self) -> LateDevice:
        """The stream handed to the connector (every stream is this device's one queue)."""
        return self

    @property
    def enqueued(self) -> int:
        """Work items queued so far (run or not)."""
        return self._enqueued

    @property
    def executed(self) -> int:
        """Work items run so far (including one that raised)."""
        return self._executed

    @property
    def pending(self) -> int:
        """Work items queued and not run yet."""
        return self._enqueued - self._executed

    def enqueue(self, work: Work) -> None:
        """Queue ``work``; it runs after everything queued before it, at a sync point."""
        with self._queue_lock:
            self._queue.append(work)
            self._enqueued += 1

    def record_event(self) -> LateEvent:
        """A marker that completes once everything queued so far has run."""
        with self._queue_lock:
            return LateEvent(self, self._enqueued)

    def synchronize(self) -> None:
        """Run everything queued, including work that running work enqueues.

        Raises:
            Exception: Whatever a work item raised (see :meth:`LateEvent.synchronize`).
        """
        self.run_until(None)

    def run_until(self, position: int | None) -> None:
        """Run queued work in order until ``position`` items have run (``None``: all)."""
        with self._run_lock:
            while position is None or self._executed < position:
                with self._queue_lock:
                    if not self._queue:
                        return
                    work = self._queue.popleft()
                try:
                    work()
                finally:
                    self._executed += 1


class DeviceValue(Generic[T]):
    """A value produced by queued work (e.g. sampled tokens in device memory).

    The host may read it only after synchronising past the work that sets it; queued work
    enqueued later may read it freely (FIFO order).
    """

    def __init__(self) -> None:
        self._set = False
        self._value: T | None = None

    @classmethod
    def of(cls, value: T) -> DeviceValue[T]:
        """An already-resolved value (synchronous execution)."""
        resolved: DeviceValue[T] = cls()
        resolved.set(value)
        return resolved

    @property
    def ready(self) -> bool:
        """Whether the producing work has run."""
        return self._set

    def set(self, value: T) -> None:
        """Resolve the value (called by the producing work)."""
        self._value = value
        self._set = True

    def get(self) -> T:
        """The value.

        Raises:
            RuntimeError: The producing work has not run (nobody synchronised past it).
        """
        if not self._set:
            raise RuntimeError("device value read before the device ran the work producing it")
        return self._value  # type: ignore[return-value]


__all__ = ["DeviceValue", "LateDevice", "LateEvent", "Work"]
