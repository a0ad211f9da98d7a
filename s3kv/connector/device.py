"""How the worker moves bytes between host staging and the KV pool, and knows when it is done.

The one rule this module exists for (DESIGN.md invariant 1): bytes a claimed load reads stay
pinned until the device copy that reads them has *completed*, not merely been enqueued. Under
TensorRT-LLM's overlap loop the host runs one iteration ahead of the device
(``PyExecutor._executor_loop_overlap`` in ``tensorrt_llm/_torch/pyexecutor/py_executor.py``
@``00043967``: iteration N+1 calls ``handle_metadata`` / ``_kv_connector_start_batch`` and
enqueues its forward before ``_update_requests(previous_batch)`` synchronises on N), so a copy
enqueued by ``start_load_kv`` in iteration N may still be queued when iteration N+1 plans its
loads; its source must not be recycled before the copy's event has completed.

A :class:`CopyEngine` enqueues copies on the engine's stream and returns an event that
completes with them. Three engines, chosen from the pool tensor and the stream TensorRT-LLM
passes in:

* :class:`CudaCopyEngine` — a CUDA pool: ``non_blocking`` copies from page-locked host memory
  on the given stream, device→host copies on a side stream that waits for the forward-pass
  event, ``torch.cuda.Event`` completions.
* :class:`DeferredCopyEngine` — any stream that implements :class:`DeferredStream`: work is
  enqueued as closures that run later, in order, as on a device. s3kv's emulated runtime
  supplies one on the CPU (a device that runs late), so the load/recycle race is tested
  without a GPU.
* :class:`SyncCopyEngine` — a CPU pool with no stream: copies happen at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class StreamEvent(Protocol):
    """A completion marker (``torch.cuda.Event`` has this shape)."""

    def query(self) -> bool:
        """Whether all work before the marker has completed (never blocks)."""
        ...

    def synchronize(self) -> None:
        """Block until all work before the marker has completed."""
        ...


@runtime_checkable
class DeferredStream(Protocol):
    """A stream whose work runs later, in enqueue order (an emulated device)."""

    def enqueue(self, work: Callable[[], None]) -> None:
        """Queue ``work``; it runs after everything queued before it."""
        ...

    def record_event(self) -> StreamEvent:
        """A marker that completes once everything queued so far has run."""
        ...


class _Done:
    """An event that has already completed (synchronous copies)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class _Never:
    """An event that never completes: the copies' fate is unknown, keep their sources."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        return None


DONE: StreamEvent = _Done()
NEVER: StreamEvent = _Never()

#: (destination, source) pairs of torch tensors / numpy host arrays.
LoadPair = tuple[Any, np.ndarray]
SavePair = tuple[Any, Any]


class CopyEngine(Protocol):
    """Enqueues the worker's copies; every method returns without waiting for the device."""

    def mark_forward(self, stream: Any) -> None:
        """Record the end of the forward pass (device→host copies wait for it)."""
        ...

    def load(self, pairs: Sequence[LoadPair], stream: Any) -> StreamEvent:
        """Copy host sources into pool blocks on ``stream``; the event completes with them."""
        ...

    def save(self, pairs: Sequence[SavePair], stream: Any) -> StreamEvent:
        """Copy pool blocks into host buffers after the forward pass; event as for loads."""
        ...


def _torch() -> Any:
    import torch

    return torch


def _as_bytes(tensor: Any) -> Any:
    torch = _torch()
    return tensor.view(-1).view(torch.uint8)


class SyncCopyEngine:
    """CPU pool, no stream: the copies are done when the call returns."""

    def mark_forward(self, stream: Any) -> None:
        return None

    def load(self, pairs: Sequence[LoadPair], stream: Any) -> StreamEvent:
        torch = _torch()
        for target, source in pairs:
            _as_bytes(target).copy_(torch.from_numpy(source))
        return DONE

    def save(self, pairs: Sequence[SavePair], stream: Any) -> StreamEvent:
        for buffer, block in pairs:
            buffer.copy_(_as_bytes(block))
        return DONE


class DeferredCopyEngine:
    """Copies as closures on a :class:`DeferredStream`: they read their source when they run.

    One in-order stream serves loads, the forward pass and saves, so saves need no event to
    wait for: they are queued after the forward pass that wrote the blocks.
    """

    def mark_forward(self, stream: Any) -> None:
        return None

    def load(self, pairs: Sequence[LoadPair], stream: Any) -> StreamEvent:
        torch = _torch()
        for target, source in pairs:
            # NOTE: the source is read when the work runs, not now: exactly the hazard of an
            # asynchronous copy from host memory that somebody recycles in between.
            def copy(target: Any = target, source: np.ndarray = source) -> None:
                _as_bytes(target).copy_(torch.from_numpy(source))

            stream.enqueue(copy)
        event: StreamEvent = stream.record_event()
        return event

    def save(self, pairs: Sequence[SavePair], stream: Any) -> StreamEvent:
        for buffer, block in pairs:

            def copy(buffer: Any = buffer, block: Any = block) -> None:
                buffer.copy_(_as_bytes(block))

            stream.enqueue(copy)
        event: StreamEvent = stream.record_event()
        return event


class CudaCopyEngine:
    """A CUDA pool: asynchronous copies and ``torch.cuda.Event`` completions."""

    def __init__(self, device: Any) -> None:
        torch = _torch()
        self._side = torch.cuda.Stream(device=device)
        self._forward: Any = None

    def mark_forward(self, stream: Any) -> None:
        torch = _torch()
        event = torch.cuda.Event()
        event.record(stream) if stream is not None else event.record()
        self._forward = event

    def load(self, pairs: Sequence[LoadPair], stream: Any) -> StreamEvent:
        torch = _torch()
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with context:
            for target, source in pairs:
                _as_bytes(target).copy_(torch.from_numpy(source), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        result: StreamEvent = event
        return result

    def save(self, pairs: Sequence[SavePair], stream: Any) -> StreamEvent:
        torch = _torch()
        with torch.cuda.stream(self._side):
            if self._forward is not None:
                self._side.wait_event(self._forward)
            elif stream is not None:
                self._side.wait_stream(stream)
            for buffer, block in pairs:
                buffer.copy_(_as_bytes(block), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        result: StreamEvent = event
        return result


def copy_engine(kv_cache: Any, stream: Any) -> CopyEngine:
    """The engine for this pool and the stream TensorRT-LLM passes to the worker."""
    if bool(getattr(kv_cache, "is_cuda", False)):
        return CudaCopyEngine(kv_cache.device)
    if isinstance(stream, DeferredStream):
        return DeferredCopyEngine()
    return SyncCopyEngine()


__all__ = [
    "CopyEngine",
    "CudaCopyEngine",
    "DONE",
    "NEVER",
    "DeferredCopyEngine",
    "DeferredStream",
    "LoadPair",
    "SavePair",
    "StreamEvent",
    "SyncCopyEngine",
    "copy_engine",
]
