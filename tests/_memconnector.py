"""A minimal synchronous in-memory connector that works on both KV cache managers.

It claims whole stored blocks past the device match, learns what the runtime *honoured*
from ``request.py_num_connector_matched_tokens`` in ``update_state_after_alloc`` (V2 may
honour less than the offer; V1 honours all of it), loads exactly those blocks in
``start_load_kv`` and saves newly computed full prompt blocks after the forward pass. Block ids
come from the scheduler outputs (``new_block_ids`` deltas), so V2's per-chunk pages are
followed. Used to prove that every runtime flavour gives the tokens of a run without a
connector.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from s3kv.connector.api import KvCacheConnectorScheduler, KvCacheConnectorWorker, SchedulerOutput
from s3kv.connector.device import DeferredStream

Key = tuple[int, ...]


def on_stream(stream: Any, work: Callable[[], None]) -> None:
    """Run ``work`` in stream order: queued on a late (emulated) device, else now."""
    if isinstance(stream, DeferredStream):
        stream.enqueue(work)
    else:
        work()


class MemScheduler(KvCacheConnectorScheduler):
    """Scheduler side; ``store`` is shared with :class:`MemWorker` (set per test)."""

    store: ClassVar[dict[Key, torch.Tensor]] = {}
    offers: ClassVar[list[tuple[int, int]]] = []  # (offer, honoured) per allocation

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self.tpb = llm_args.kv_cache_config.tokens_per_block
        self.reqs: dict[int, dict[str, Any]] = {}

    def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        usable = request.get_tokens(0)[: request.prompt_len - 1]
        keys = [tuple(usable[: (i + 1) * self.tpb]) for i in range(len(usable) // self.tpb)]
        start = num_computed // self.tpb
        st = {"keys": keys, "start": start, "blocks": [], "load": [], "saved": 0, "matched": 0}
        self.reqs[request.request_id] = st
        if num_computed % self.tpb:
            return 0, False
        n = start
        while n < len(keys) and keys[n] in self.store:
            n += 1
        st["offer"] = (n - start) * self.tpb
        return st["offer"], False

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        st = self.reqs[request.request_id]
        honoured = int(request.py_num_connector_matched_tokens)
        assert honoured % self.tpb == 0
        first = st["start"]
        st["load"] = [
            (block_ids[i], st["keys"][i]) for i in range(first, first + honoured // self.tpb)
        ]
        st["matched"] = honoured
        self.offers.append((st.get("offer", 0), honoured))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> dict[str, Any]:
        loads: list[tuple[int, Key]] = []
        for st in self.reqs.values():
            loads += st["load"]
            st["load"] = []
        saves: list[tuple[int, Key]] = []
        for first, reports in (
            (True, scheduler_output.new_requests),
            (False, scheduler_output.cached_requests),
        ):
            for r in reports:
                st = self.reqs[r.request_id]
                st["blocks"] += r.new_block_ids
                end = r.computed_position + r.num_scheduled_tokens + (st["matched"] if first else 0)
                full = min(end // self.tpb, len(st["keys"]), len(st["blocks"]))
                saves += [(st["blocks"][i], st["keys"][i]) for i in range(st["saved"], full)]
                st["saved"] = max(st["saved"], full)
        return {"loads": loads, "saves": saves}

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        self.reqs.pop(request.request_id, None)
        return False


class MemWorker(KvCacheConnectorWorker):
    """Worker side: copies between the pool and ``store`` on the forward stream."""

    store: ClassVar[dict[Key, torch.Tensor]] = {}

    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        self.pool = kv_cache_tensor

    def start_load_kv(self, stream: Any) -> None:
        meta: dict[str, Any] = self.get_connector_meta()  # type: ignore[assignment]
        for block, key in meta["loads"]:
            on_stream(stream, lambda b=block, k=key: self.pool[b].copy_(self.store[k]))

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        pass

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        pass

    def wait_for_save(self, stream: Any) -> None:
        meta: dict[str, Any] = self.get_connector_meta()  # type: ignore[assignment]
        for block, key in meta["saves"]:
            on_stream(
                stream, lambda b=block, k=key: self.store.__setitem__(k, self.pool[b].clone())
            )

    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        return [], []


def fresh_store() -> dict[Key, torch.Tensor]:
    """A new shared store for both classes (and an empty offer log)."""
    store: dict[Key, torch.Tensor] = {}
    MemScheduler.store = MemWorker.store = store
    MemScheduler.offers = []
    return store
