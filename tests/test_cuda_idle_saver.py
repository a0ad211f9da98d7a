"""The worker's idle saver on a real CUDA device: copies queued from its own thread.

TensorRT-LLM calls ``get_finished`` once after a request's last forward pass and then blocks
on its request queue; the idle saver must queue the waiting copies on the device from
another thread and hand their bytes to the store. CUDA only (skipped elsewhere).
"""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch

from s3kv.connector.completion import CompletionBoard
from s3kv.connector.worker import WorkerCore
from tests.test_connector_save_copies import Store, saves

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_idle_saver_copies_the_last_requests_blocks_from_its_own_thread() -> None:
    device = torch.device("cuda", torch.cuda.device_count() - 1)  # NOTE: not only device 0
    pool = torch.randn(8, 2, 2, 4096, device=device).to(torch.bfloat16)
    store = Store()
    core = WorkerCore(
        0, store, pool, 1 << 24, board=CompletionBoard.private(),  # type: ignore[arg-type]
        idle_save_after=0.05,
    )  # fmt: skip
    stream = torch.cuda.current_stream(device)
    try:
        with torch.cuda.device(device):
            core.forward_done()
            core.save_after_forward(saves(1, [2, 5]), stream)
            assert core.finished([1]) == []  # the engine's one call after the last pass
        deadline = time.monotonic() + 20
        while len(store.saved) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.metrics.value("connector_saves_queued_idle") == 2
        for block in (2, 5):
            want = pool[block].view(torch.uint8).cpu().numpy().tobytes()
            assert store.saved[bytes([1, block]) * 8] == want
        assert core.finished([]) == [1]
    finally:
        core.close()


def test_a_closed_core_is_not_kept_alive_by_its_exit_hook() -> None:
    # The idle saver's exit hook (atexit) holds the core and its pool: closing drops it, so
    # a process that makes connectors again and again does not keep every pool alive.
    pool = torch.zeros(4, 2, 2, 1024, device="cuda", dtype=torch.bfloat16)
    core = WorkerCore(
        0, Store(), pool, 1 << 20, board=CompletionBoard.private(),  # type: ignore[arg-type]
        idle_save_after=0.05,
    )  # fmt: skip
    with torch.cuda.device(pool.device):
        core.forward_done()
        core.save_after_forward(saves(1, [2]), torch.cuda.current_stream(pool.device))
    assert core._idle_saver is not None  # NOTE: started by the first deferred save
    alive = weakref.ref(core)
    core.close()
    core.close()  # NOTE: idempotent
    del core
    gc.collect()
    assert alive() is None
