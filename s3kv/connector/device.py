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
  on a load stream ordered after the engine's stream, one ``torch.cuda.Event`` per layer group
  that the forward's stream waits on (:meth:`CopyEngine.wait`, device-side); device→host
  copies on a side stream that waits for the forward-pass event. All of a batch's copies are
  issued in one call (``torch._foreach_copy_``), not one Python call per block.
* :class:`DeferredCopyEngine` — any stream that implements :class:`DeferredStream`: work is
  enqueued as closures that run later, in order, as on a device. s3kv's emulated runtime
  supplies one on the CPU (a device that runs late), so the load/recycle race is tested
  without a GPU.
* :class:`SyncCopyEngine` — a CPU pool with no stream: copies happen at once.
"""

from __future__ import annotations

import itertools
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

#: (destination, source) pairs of torch tensors for device→host saves.
SavePair = tuple[Any, Any]


class CopyEngine(Protocol):
    """Enqueues the worker's copies; every method returns without waiting for the device."""

    #: Whether the worker queues a forward pass's save copies at ``get_finished`` rather
    #: than in ``wait_for_save``: on a device whose copy engines the sampler's token copy
    #: shares (CUDA, and the emulator's late device that stands for it), so that copy is
    #: queued first (see ``WorkerCore.save_after_forward``).
    defers_saves: bool
    #: Whether copies may be queued from a thread other than the engine's (the worker's
    #: idle saver): CUDA streams may; the emulator's late device runs its closures on the
    #: engine's thread only.
    queues_from_any_thread: bool

    def mark_forward(self, stream: Any) -> None:
        """Record the end of the forward pass (device→host copies wait for it)."""
        ...

    def load(
        self, targets: Sequence[Any], sources: Sequence[np.ndarray], bounds: Sequence[int],
        stream: Any,
    ) -> list[StreamEvent]:  # fmt: skip
        """Copy each host source into its pool block, chunk by chunk; one event per chunk.

        ``targets`` are uint8 views of the destination blocks and ``sources`` host arrays of
        the same length; ``bounds`` are byte offsets ``0 = b0 < b1 < ... = block bytes``.
        Chunk ``i`` (bytes ``[b_i, b_i+1)`` of every block) is copied after chunk ``i - 1``;
        event ``i`` completes once chunks ``0..i`` of every block are in place. The copies
        run after all work queued on ``stream`` so far, but ``stream`` does not wait for
        them: :meth:`wait` orders later work after an event.
        """
        ...

    def wait(self, event: StreamEvent, stream: Any) -> None:
        """Make work queued on ``stream`` from now on wait for ``event`` (never blocks)."""
        ...

    def save(self, pairs: Sequence[SavePair], stream: Any) -> StreamEvent:
        """Copy pool blocks into host buffers after the forward pass; event as for loads."""
        ...


def _torch() -> Any:
    import torch

    return torch


def _chunks(bounds: Sequence[int]) -> list[tuple[int, int]]:
    return list(itertools.pairwise(bounds))


class SyncCopyEngine:
    """CPU pool, no stream: the copies are done when the call returns."""

    defers_saves = False
    queues_from_any_thread = False

    def mark_forward(self, stream: Any) -> None:
        return None

    def load(
        self, targets: Sequence[Any], sources: Sequence[np.ndarray], bounds: Sequence[int],
        stream: Any,
    ) -> list[StreamEvent]:  # fmt: skip
        torch = _torch()
        for target, source in zip(targets, sources, strict=True):
            target.copy_(torch.from_numpy(source))
        return [DONE for _ in _chunks(bounds)]

    def wait(self, event: StreamEvent, stream: Any) -> None:
        return None

    def save(self, pairs: Sequence[SavePair], stream: Any) -> StreamEvent:
        for buffer, block in pairs:
            buffer.copy_(block)
        return DONE


class DeferredCopyEngine:
    """Copies as closures on a :class:`DeferredStream`: they read their source when they run.

    One in-order stream serves loads, the forward pass and saves, so nothing needs an event
    to wait for: the forward pass is queued after the loads, saves after the forward pass.
    """

    # NOTE: as on CUDA, so the emulated runtimes (whose late device this serves) run the
    # worker's deferred save path through every test of the matrix.
    defers_saves = True
    queues_from_any_thread = False

    def mark_forward(self, stream: Any) -> None:
        return None

    def load(
        self, targets: Sequence[Any], sources: Sequence[np.ndarray], bounds: Sequence[int],
        stream: Any,
    ) -> list[StreamEvent]:  # fmt: skip
        torch = _torch()
        pairs = list(zip(targets, sources, strict=True))
        events: list[StreamEvent] = []
        for lo, hi in _chunks(bounds):
            # NOTE: the source is read when the work runs, not now: exactly the hazard of an
            # asynchronous copy from host memory that somebody recycles in between.
            def copy(lo: int = lo, hi: int = hi) -> None:
                for target, source in pairs:
                    target[lo:hi].copy_(torch.from_numpy(source[lo:hi]))

            stream.enqueue(copy)
            events.append(stream.record_event())
        return events

    def wait(self, event: StreamEvent, stream: Any) -> None:
        return None

    def save(self, pairs: Sequence[SavePair], stream: Any) -> StreamEvent:
        pending = list(pairs)

        def copy() -> None:
            for buffer, block in pending:
                buffer.copy_(block)

        stream.enqueue(copy)
        event: StreamEvent = stream.record_event()
        return event


class CudaCopyEngine:
    """A CUDA pool: asynchronous copies on side streams, ``torch.cuda.Event`` completions.

    Loads run on their own stream, ordered after the work the engine queued before
    ``start_load_kv`` (the blocks' previous users); the forward pass waits for them layer
    group by layer group (:meth:`wait`, from ``wait_for_layer_load``), so the host keeps
    enqueuing the forward while the copy engine moves bytes. Saves run on another stream
    that waits for the forward-pass event.
    """

    defers_saves = True
    queues_from_any_thread = True

    def __init__(self, device: Any) -> None:
        torch = _torch()
        self._device = device
        self._side = torch.cuda.Stream(device=device)
        self._loads = torch.cuda.Stream(device=device)
        self._forward: Any = None
        self._foreach = True

    def _stream(self, stream: Any) -> Any:
        return stream if stream is not None else _torch().cuda.current_stream(self._device)

    def _copy(self, targets: Sequence[Any], sources: Sequence[Any]) -> None:
        """One ``non_blocking`` copy per pair, issued from C++ in one call where possible."""
        torch = _torch()
        if self._foreach:
            try:
                torch._foreach_copy_(list(targets), list(sources), non_blocking=True)
                return
            except (RuntimeError, NotImplementedError, AttributeError):
                # NOTE: an older torch without mixed-device foreach copies: one call per pair
                # from now on (the copies issued before the failure are simply repeated).
                self._foreach = False
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source, non_blocking=True)

    def mark_forward(self, stream: Any) -> None:
        torch = _torch()
        event = torch.cuda.Event()
        event.record(self._stream(stream))
        self._forward = event

    def load(
        self, targets: Sequence[Any], sources: Sequence[np.ndarray], bounds: Sequence[int],
        stream: Any,
    ) -> list[StreamEvent]:  # fmt: skip
        torch = _torch()
        self._loads.wait_stream(self._stream(stream))
        hosts = [torch.from_numpy(source) for source in sources]
        events: list[StreamEvent] = []
        whole = len(bounds) == 2
        with torch.cuda.stream(self._loads):
            for lo, hi in _chunks(bounds):
                if whole:
                    self._copy(targets, hosts)
                else:
                    self._copy([t[lo:hi] for t in targets], [h[lo:hi] for h in hosts])
                event = torch.cuda.Event()
                event.record(self._loads)
                events.append(event)
        return events

    def wait(self, event: StreamEvent, stream: Any) -> None:
        self._stream(stream).wait_event(event)

    def save(self, pairs: Sequence[SavePair], stream: Any) -> StreamEvent:
        torch = _torch()
        with torch.cuda.stream(self._side):
            if self._forward is not None:
                self._side.wait_event(self._forward)
            # NOTE: and after everything queued on the engine's stream until now, not only
            # the forward pass: the worker issues saves at get_finished, after the sampler
            # queued the new tokens' copy to the host on that stream
            # (TorchSampler.sample_async, sampler.py @ 28edbcdb: new_tokens.to("cpu",
            # non_blocking=True) on the current stream, then sampler_event.record()).
            # Ordered after the forward alone, the blocks' copies start as the forward ends
            # and a copy engine serves them before the token copy that becomes ready a
            # little later: the token waited 5.8 ms behind a prompt's 254 blocks on an
            # H200, 0.5 ms ordered after it (benchmarks/gpu_copy_order.py, "blocks_after").
            # A pass's copies are queued one get_finished after its own iteration's, so they
            # also wait for the next forward pass: safe, as a running or saving request's
            # full blocks are never rewritten (GUARANTEED_NO_EVICT, required by envelope.py).
            self._side.wait_stream(self._stream(stream))
            self._copy([buffer for buffer, _ in pairs], [block for _, block in pairs])
            event = torch.cuda.Event()
            event.record(self._side)
        result: StreamEvent = event
        return result


def on_gpu(kv_cache: Any) -> bool:
    """The KV pool tensor is on a GPU (CUDA)."""
    return bool(getattr(kv_cache, "is_cuda", False))


def copy_engine(kv_cache: Any, stream: Any) -> CopyEngine:
    """The engine for this pool and the stream TensorRT-LLM passes to the worker."""
    if on_gpu(kv_cache):
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
    "SavePair",
    "StreamEvent",
    "SyncCopyEngine",
    "copy_engine",
    "on_gpu",
]
