"""The bucket goes away while the engine serves, and comes back.

A real SeaweedFS server is stopped under a serving engine (emulated runtime, tiny model, the
s3kv connector) and started again on the same port and data. Nothing may raise into the
engine, every output must equal the no-cache output, the connector must claim nothing while
the circuit breaker is open, and claim again once the bucket is back.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from _emulator import one_torch_thread, prompt, tiny_model

from s3kv.connector.shared import process_state
from s3kv.storage import BreakerState
from s3kv.testing.emulator.executor import PyExecutorEmulator
from s3kv.testing.emulator.instance import S3KV_CONNECTOR
from s3kv.testing.emulator.llm_args import KvCacheConfig, TorchLlmArgs
from s3kv.testing.local_s3 import LocalS3

pytestmark = pytest.mark.seaweedfs

TPB = 8
COOLDOWN_S = 2.0


def engine(connector: bool) -> PyExecutorEmulator:
    args = TorchLlmArgs(
        kv_cache_config=KvCacheConfig(tokens_per_block=TPB, enable_partial_reuse=False),
        kv_connector_config=S3KV_CONNECTOR if connector else None,
        disable_overlap_scheduler=True,
    )
    return PyExecutorEmulator(args, tiny_model(TPB), num_blocks=96)


def serve(executor: PyExecutorEmulator, tokens: list[int]) -> tuple[list[int], int]:
    (result,) = executor.generate([tokens], 4)
    executor.drain()
    return list(result.output_tokens), result.connector_tokens


def test_outage_claims_nothing_then_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = LocalS3.start(tmp_path / "s3", bucket="outage", die_with_parent=True)
    # NOTE: a generous read timeout: a fresh SeaweedFS on a loaded 2-core machine can take
    # seconds to answer its first PUTs; the outage below is refused connections, which the
    # connect timeout bounds.
    for name, value in {
        **server.env(), "TLLM_S3KV_MODEL_REVISION": "tiny", "TLLM_S3KV_MAX_ATTEMPTS": "1",
        "TLLM_S3KV_CONNECT_TIMEOUT": "0.5", "TLLM_S3KV_READ_TIMEOUT": "10",
        "TLLM_S3KV_BREAKER_FAILURES": "2", "TLLM_S3KV_BREAKER_COOLDOWN": str(COOLDOWN_S),
        "TLLM_S3KV_MANIFEST_FLUSH_INTERVAL": "0.1",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    # Three system prompts of 6 full blocks each; a device prefix-cache hit would hide the
    # connector, so each phase below uses a prefix this instance has not computed itself.
    systems = [prompt(48, seed=s) for s in (1, 11, 21)]
    ask = [prompt(9, seed=s) for s in range(2, 7)]
    try:
        with one_torch_thread():
            reference = engine(connector=False)
            expected = [serve(reference, systems[i] + ask[i + 1])[0] for i in range(3)]
            # Instance A saves the three system prompts and exits.
            writer = engine(connector=True)
            for system in systems:
                serve(writer, system + ask[0])
            process_state().close_all()
            # Instance B warms from the bucket and hits.
            executor = engine(connector=True)
            assert serve(executor, systems[0] + ask[1]) == (expected[0], 48)
            (store,) = process_state().stores.values()
            breaker = store.backend.breaker
            assert breaker is not None

            assert store.flush(timeout=30)
            written = store.metrics.value("save_completed")
            server.stop(grace=0.5)  # the bucket goes away
            # Requests fail (saves, manifest flushes); the breaker opens; nothing raises.
            fresh = prompt(40, seed=99)
            serve(executor, fresh)
            # NOTE: the failing saves run on the writer pool: wait for them (bounded).
            deadline = time.monotonic() + 30
            while breaker.trips == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert breaker.trips >= 1
            assert breaker.state is not BreakerState.CLOSED
            assert store.metrics.value("save_completed") == written, "saves lost, not raised"
            # Open: a staged system prompt is NOT claimed; the answer is still right.
            assert serve(executor, systems[1] + ask[2]) == (expected[1], 0)

            # The bucket comes back on the same port with the same data.
            server = LocalS3.start(tmp_path / "s3", port=server.port, bucket="outage",
                                   die_with_parent=True)  # fmt: skip
            time.sleep(COOLDOWN_S)  # NOTE: the breaker's cooldown is wall-clock by design
            # The first request after the cooldown finds the breaker half-open: the store's
            # background HEAD probe or the request's own save is the one probe let through,
            # and its success closes it. NOTE: whichever it is runs on the I/O pool (a save
            # refused because the HEAD probe was first ends at once): wait for it, bounded.
            serve(executor, prompt(40, seed=100))
            assert store.flush(timeout=30)
            deadline = time.monotonic() + 30
            while breaker.state is not BreakerState.CLOSED and time.monotonic() < deadline:
                time.sleep(0.05)
            assert breaker.state is BreakerState.CLOSED
            assert serve(executor, systems[2] + ask[3]) == (expected[2], 48)
    finally:
        process_state().close_all()
        server.stop(grace=0.5)
