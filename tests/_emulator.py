"""Helpers for the emulated-runtime tests: a tiny seeded Llama, executors, threaded ranks."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from s3kv.testing.emulator.executor import PyExecutorEmulator
from s3kv.testing.emulator.llm_args import KvCacheConfig, TorchLlmArgs
from s3kv.testing.emulator.model import PagedLlama, smollm2_config
from s3kv.testing.emulator.recording import RecordingConnector

VOCAB = 128


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run torch single-threaded: the tiny model's ops are far faster without thread sync."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_config() -> Any:
    """2 layers, hidden 64, 4 query / 2 KV heads of 16, vocab 128; untied, so outputs vary."""
    return smollm2_config(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )


@functools.lru_cache(maxsize=1)
def tiny_hf() -> Any:
    """The seeded HF ``LlamaForCausalLM`` (shared, read-only)."""
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(tiny_config())
    model.eval()  # type: ignore[no-untyped-call]
    return model


def tiny_model(tokens_per_block: int = 32, tp_rank: int = 0, tp_size: int = 1) -> PagedLlama:
    """This rank's :class:`PagedLlama` shard of :func:`tiny_hf`."""
    return PagedLlama.from_hf(
        tiny_hf(), tokens_per_block=tokens_per_block, tp_rank=tp_rank, tp_size=tp_size
    )


def prompt(n: int, seed: int = 1) -> list[int]:
    """``n`` pseudo-random token ids."""
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, VOCAB, (n,), generator=g)]


def llm_args(**overrides: Any) -> TorchLlmArgs:
    """TorchLlmArgs with ``kv_cache_config`` fields given as ``kvcache_<field>=...``."""
    kv = {k[8:]: overrides.pop(k) for k in list(overrides) if k.startswith("kvcache_")}
    return TorchLlmArgs(kv_cache_config=KvCacheConfig(**kv), **overrides)


def executor(
    rec: RecordingConnector | None = None,
    *,
    overlap: bool = False,
    num_blocks: int = 64,
    model: PagedLlama | None = None,
    stall_timeout_s: float = 60.0,
    late_device: bool | None = None,
    runtime: str = "main",
    **overrides: Any,
) -> PyExecutorEmulator:
    """An executor on the tiny model, with ``rec``'s classes as the connector (if given)."""
    args = llm_args(**overrides)
    classes: dict[str, Any] = {}
    if rec is not None:
        scheduler_cls, worker_cls = rec.classes()
        classes = {"connector_scheduler_cls": scheduler_cls, "connector_worker_cls": worker_cls}
    tpb = args.kv_cache_config.tokens_per_block
    return PyExecutorEmulator(
        args,
        model if model is not None else tiny_model(tpb),
        num_blocks=num_blocks,
        overlap=overlap,
        stall_timeout_s=stall_timeout_s,
        late_device=late_device,
        runtime=runtime,  # type: ignore[arg-type]
        **classes,
    )


class ThreadRanks:
    """In-process ranks for manager-level tests: one thread per rank, barrier collectives."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size, timeout=30)
        self._slots: list[Any] = [None] * world_size

    def collectives(self, rank: int) -> Any:
        """The :class:`s3kv.connector.comm.Collectives` of ``rank``."""
        outer = self

        class _Rank:
            @property
            def rank(self) -> int:
                return rank

            @property
            def world_size(self) -> int:
                return outer.world_size

            def broadcast(self, obj: Any, root: int = 0) -> Any:
                return outer.allgather(rank, obj)[root]

            def allgather(self, obj: Any) -> list[Any]:
                return outer.allgather(rank, obj)

        return _Rank()

    def allgather(self, rank: int, obj: Any) -> list[Any]:
        self._slots[rank] = obj
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()  # NOTE: nobody overwrites a slot before everyone has read it
        return out

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """``fn(rank)`` on every rank concurrently; re-raises the first failure."""
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException] = []

        def main(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as exc:
                errors.append(exc)
                self._barrier.abort()

        threads = [threading.Thread(target=main, args=(r,)) for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results
