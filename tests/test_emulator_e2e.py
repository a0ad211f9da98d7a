"""End to end: a minimal in-memory connector on the emulated runtime, and SmolLM2 vs HF.

The connector below does what a real one must (claim whole stored blocks beyond the device
match, load them in ``start_load_kv`` or asynchronously, save newly computed prompt blocks
after the forward pass, keep keys salted), driven only through the connector API. A second
executor instance that loads the first one's blocks must produce the same tokens while
computing only the prompt's tail; a connector that claims without loading must not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch
from _emulator import executor, llm_args, one_torch_thread, prompt, tiny_model

from s3kv.connector.api import (
    KvCacheConnectorScheduler,
    KvCacheConnectorWorker,
    SchedulerOutput,
)
from s3kv.connector.device import DeferredStream
from s3kv.testing.emulator.executor import PyExecutorEmulator
from s3kv.testing.emulator.llm_args import TorchLlmArgs
from s3kv.testing.emulator.model import PagedLlama

Key = tuple[Any, ...]


def _on_stream(stream: Any, work: Callable[[], None]) -> None:
    """Run ``work`` in stream order: queued on a late (emulated) device, else now."""
    if isinstance(stream, DeferredStream):
        stream.enqueue(work)
    else:
        work()


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


class _MemScheduler(KvCacheConnectorScheduler):
    store: ClassVar[dict[Key, torch.Tensor]]
    load_async: ClassVar[bool]

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self.tpb = llm_args.kv_cache_config.tokens_per_block
        self.reqs: dict[int, dict[str, Any]] = {}

    def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        usable = request.get_tokens(0)[: request.prompt_len - 1]  # the last token is computed
        salt = request.cache_salt_id
        keys = [(salt, tuple(usable[: (i + 1) * self.tpb])) for i in range(len(usable) // self.tpb)]
        state: dict[str, Any] = {"keys": keys, "claim": [], "saved": 0, "first": True}
        state["claimed"] = 0
        self.reqs[request.request_id] = state
        if num_computed % self.tpb:
            return 0, False  # the device match ends inside a block: whole blocks only
        start = n = num_computed // self.tpb
        while n < len(keys) and keys[n] in self.store:
            n += 1
        state["claim"], state["claimed"] = list(range(start, n)), (n - start) * self.tpb
        return state["claimed"], self.load_async and n > start

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        self.reqs[request.request_id]["blocks"] = block_ids

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> dict[str, Any]:
        loads = []
        for rid, st in self.reqs.items():  # NOTE: includes requests parked for an async load
            loads += [(rid, st["blocks"][i], st["keys"][i]) for i in st["claim"]]
            st["claim"] = []
        saves = []
        for r in scheduler_output.new_requests + scheduler_output.cached_requests:
            st = self.reqs[r.request_id]
            # The first report's computed_position leaves a sync claim's tokens out (an async
            # load's first report comes after the load and includes them: over-counting
            # here only re-saves blocks that are already stored).
            end = r.computed_position + r.num_scheduled_tokens + st["claimed"] * st["first"]
            st["first"] = False
            full = min(end // self.tpb, len(st["keys"]))
            saves += [(st["blocks"][i], st["keys"][i]) for i in range(st["saved"], full)]
            st["saved"] = max(st["saved"], full)
        return {"loads": loads, "saves": saves}

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        self.reqs.pop(request.request_id, None)
        return False


class _MemWorker(KvCacheConnectorWorker):
    store: ClassVar[dict[Key, torch.Tensor]]
    load_async: ClassVar[bool]
    skip_loads: ClassVar[bool]

    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        self.pool = kv_cache_tensor
        self.parked: dict[int, list[tuple[int, Key]]] = {}

    def start_load_kv(self, stream: Any) -> None:
        meta: dict[str, Any] = self.get_connector_meta()  # type: ignore[assignment]
        for rid, block, key in meta["loads"]:
            if self.load_async:
                self.parked.setdefault(rid, []).append((block, key))
            elif not self.skip_loads:
                _on_stream(stream, lambda b=block, k=key: self.pool[b].copy_(self.store[k]))

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        pass

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        pass

    def wait_for_save(self, stream: Any) -> None:
        meta: dict[str, Any] = self.get_connector_meta()  # type: ignore[assignment]
        for block, key in meta["saves"]:

            def save(block: int = block, key: Key = key) -> None:
                self.store[key] = self.pool[block].clone()

            _on_stream(stream, save)  # NOTE: after the queued forward pass that wrote it

    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        for rid in started_loading_req_ids:
            for block, key in self.parked.pop(rid, []):
                self.pool[block].copy_(self.store[key])
        return [], list(started_loading_req_ids)


def _memory_connector(
    store: dict[Key, torch.Tensor], *, load_async: bool = False, skip_loads: bool = False
) -> dict[str, Any]:
    attrs = {"store": store, "load_async": load_async, "skip_loads": skip_loads}
    return {
        "connector_scheduler_cls": type("MemScheduler", (_MemScheduler,), attrs),
        "connector_worker_cls": type("MemWorker", (_MemWorker,), attrs),
    }


def _instance(store: dict[Key, torch.Tensor], **kwargs: Any) -> PyExecutorEmulator:
    overlap = kwargs.pop("overlap", True)
    return PyExecutorEmulator(
        llm_args(),
        tiny_model(),
        num_blocks=8,
        overlap=overlap,
        **_memory_connector(store, **kwargs),
    )


@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
def test_second_instance_loads_and_matches(load_async: bool) -> None:
    store: dict[Key, torch.Tensor] = {}
    (first,) = _instance(store).generate([prompt(100)], 8)
    assert len(store) == 3  # the full blocks of the first 99 prompt tokens
    (second,) = _instance(store, load_async=load_async, overlap=False).generate([prompt(100)], 8)
    assert (second.reused_tokens, second.connector_tokens, second.computed_tokens) == (0, 96, 4)
    assert second.loaded_async is load_async
    assert second.output_tokens == first.output_tokens


def test_longer_prompt_loads_the_shared_prefix_only() -> None:
    store: dict[Key, torch.Tensor] = {}
    _instance(store).generate([prompt(100)], 2)
    longer = [*prompt(100)[:70], *prompt(60, seed=7)]
    (loaded,) = _instance(store).generate([longer], 8)
    assert loaded.connector_tokens == 64  # two stored blocks cover tokens [0, 64)
    assert loaded.output_tokens == executor().generate([longer], 8)[0].output_tokens


def test_salted_request_does_not_load_unsalted_blocks() -> None:
    store: dict[Key, torch.Tensor] = {}
    _instance(store).generate([prompt(100)], 2)
    (salted,) = _instance(store).generate([prompt(100)], 2, cache_salt="tenant")
    assert salted.connector_tokens == 0


def test_claim_without_load_is_wrong_output() -> None:
    store: dict[Key, torch.Tensor] = {}
    (first,) = _instance(store).generate([prompt(100)], 8)
    liar = _instance(store, skip_loads=True)
    liar.generate([prompt(100, seed=3)], 1)  # stale, unrelated KV left in the blocks
    (wrong,) = liar.generate([prompt(100)], 8)
    assert wrong.connector_tokens == 96
    assert wrong.output_tokens != first.output_tokens


@pytest.mark.model
def test_smollm2_greedy_matches_hf_generate() -> None:
    from s3kv.testing.smollm2 import load_model

    hf, tokenizer = load_model("float32")
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
    ex = PyExecutorEmulator(TorchLlmArgs(), PagedLlama.from_hf(hf), num_blocks=4, overlap=True)
    (result,) = ex.generate([ids[0].tolist()], 8)
    assert list(result.output_tokens) == expected.tolist()
