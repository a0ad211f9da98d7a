"""The bucket at engine startup: bounded, degraded, and back on its own.

Issue 12: with the shipped defaults (read timeout 30 s x 3 attempts) an unreachable bucket
held engine construction for minutes and then turned the connector off for the life of the
engine, so an instance whose bucket hiccuped at startup never saved, even once the bucket was
back. Now startup waits seconds (``startup_timeout``, a short one-attempt check), the
connector starts degraded (claims 0, saves nothing, one line) and opens the store in the
background once the bucket answers; settings that cannot work still turn it off, with one
line naming the setting, and nothing raises out of a constructor.

Faults are real network faults: a socket that accepts and never answers, and the fault proxy
(:mod:`s3kv.testing.faultproxy`) in front of moto answering 503 SlowDown, resetting the
connection or never answering, until the fault is removed.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _emulator import one_torch_thread, prompt
from conftest import unique_bucket
from test_connector_outage import engine, serve
from test_connector_tp_faults import current_rank, register_two_ranks
from test_connector_trtllm import PROMPT, Request, instance, pool

from s3kv.config import S3KVConfig
from s3kv.connector import trtllm
from s3kv.connector.shared import ProcessState, process_state
from s3kv.keys import ROOT_HASH, BlockHash
from s3kv.store import KVStore, SaveStatus
from s3kv.testing.faultproxy import Fault, FaultProxy

#: Generous: measured about 5 s here (the check's read timeout); it was 90 s before.
STARTUP_BOUND_S = 20.0

# ----------------------------------------------------------------------------------------
# Network faults
# ----------------------------------------------------------------------------------------


class Blackhole:
    """A listening socket that never accepts: connections complete (the kernel's backlog)
    and every request waits for an answer that never comes."""

    def __init__(self) -> None:
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen(128)
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"

    def close(self) -> None:
        self._socket.close()


# ----------------------------------------------------------------------------------------
# Fixtures and helpers
# ----------------------------------------------------------------------------------------


@pytest.fixture
def shipped_defaults(aws_env: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The connector's settings as shipped: no TLLM_S3KV_* transport or timeout overrides."""
    import os

    for name in [n for n in os.environ if n.startswith("TLLM_S3KV_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TLLM_S3KV_MODEL_REVISION", "test-rev")
    monkeypatch.setenv("TLLM_S3KV_REGION", "us-east-1")
    monkeypatch.setenv("TLLM_S3KV_STAGING_BYTES", "64MiB")
    yield
    process_state().close_all()


@pytest.fixture
def moto_bucket(moto_server: str, shipped_defaults: None) -> str:
    """A fresh bucket on moto."""
    from s3kv.storage import ensure_bucket, make_client

    bucket = unique_bucket()
    ensure_bucket(make_client(S3KVConfig(endpoint_url=moto_server, region="us-east-1")), bucket)
    return bucket


def use_bucket(monkeypatch: pytest.MonkeyPatch, endpoint: str, bucket: str) -> None:
    monkeypatch.setenv("TLLM_S3KV_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("TLLM_S3KV_BUCKET", bucket)


def only_store() -> KVStore:
    (store,) = process_state().stores.values()
    return store


def startup_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "s3kv.startup" and r.levelno >= logging.WARNING
    ]


# ----------------------------------------------------------------------------------------
# (a) a blackholed endpoint costs seconds, and the connector starts degraded
# ----------------------------------------------------------------------------------------


def test_a_blackholed_endpoint_costs_seconds_and_the_connector_starts_degraded(
    shipped_defaults: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    hole = Blackhole()
    use_bucket(monkeypatch, hole.url, "blackholed")
    caplog.set_level(logging.WARNING)
    try:
        started = time.monotonic()
        scheduler, worker = instance(pool())  # constructors, registration, initialization
        elapsed = time.monotonic() - started
        assert elapsed < STARTUP_BOUND_S, f"engine startup took {elapsed:.1f} s"
        assert scheduler.off_reason == "", "degraded, not off"
        assert scheduler.core is not None
        assert worker.core is not None
        assert not only_store().ready
        assert scheduler.get_num_new_matched_tokens(Request(1, PROMPT), 0) == (0, False)
        (line,) = startup_lines(caplog)  # one line, naming the bucket
        assert "blackholed" in line
        assert hole.url in line
    finally:
        process_state().close_all()
        hole.close()


# ----------------------------------------------------------------------------------------
# (b), (c) a bucket failing at startup: degraded, then it saves, and the next instance claims
# ----------------------------------------------------------------------------------------


FAULTS = {"503": Fault.error(503), "reset": Fault.reset(), "blackhole": Fault.blackhole()}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_bucket_failing_at_startup_starts_degraded_and_comes_back(
    moto_server: str, moto_bucket: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, fault: str,
) -> None:  # fmt: skip
    proxy = FaultProxy(moto_server).start()
    rule = proxy.add(FAULTS[fault])  # every request fails until the rule is removed
    use_bucket(monkeypatch, proxy.endpoint, moto_bucket)
    monkeypatch.setenv("TLLM_S3KV_MANIFEST_FLUSH_INTERVAL", "0.1")
    caplog.set_level(logging.WARNING)
    system, other = prompt(48, seed=31), prompt(48, seed=41)  # 6 full blocks each
    ask = [prompt(9, seed=s) for s in (32, 33)]
    try:
        with one_torch_thread():
            expected = serve(engine(connector=False), other + ask[1])[0]
            # Instance A starts while every request to the bucket fails: degraded, not off.
            started = time.monotonic()
            executor = engine(connector=True)
            assert time.monotonic() - started < STARTUP_BOUND_S
            store = only_store()
            assert not store.ready
            assert rule.applied >= 1
            assert len(startup_lines(caplog)) == 1, "one line for the degraded start"
            # Degraded: it claims nothing and saves nothing (no request reaches the bucket).
            serve(executor, system + ask[0])
            assert store.metrics.value("save_completed") == 0
            # The bucket comes back: the store opens in the background, then A saves.
            proxy.remove(rule)
            assert store.wait_ready(timeout=60), "opened once the bucket answers"
            assert "answers" in startup_lines(caplog)[-1]
            serve(executor, other + ask[0])
            assert store.flush(timeout=30)
            assert store.metrics.value("save_completed") >= 6
            process_state().close_all()  # instance A exits

            # Instance B starts with the bucket healthy, warms from it and claims A's blocks.
            executor = engine(connector=True)
            assert serve(executor, other + ask[1]) == (expected, 48)
    finally:
        process_state().close_all()
        proxy.close()


# ----------------------------------------------------------------------------------------
# Settings and errors that never heal: off, with one line; nothing raises
# ----------------------------------------------------------------------------------------

BAD_SETTINGS: dict[str, tuple[Callable[[pytest.MonkeyPatch, Path], None], str]] = {
    "staging_bytes=inf (env)": (
        lambda mp, _: mp.setenv("TLLM_S3KV_STAGING_BYTES", "inf"),
        "staging_bytes",
    ),
    "prefix = 5 (TOML)": (
        lambda mp, tmp: mp.setenv("TLLM_S3KV_CONFIG", str(_toml(tmp, "prefix = 5\n"))),
        "prefix",
    ),
    "startup_timeout=soon (env)": (
        lambda mp, _: mp.setenv("TLLM_S3KV_STARTUP_TIMEOUT", "soon"),
        "startup_timeout",
    ),
    "no bucket": (lambda mp, _: mp.delenv("TLLM_S3KV_BUCKET"), "TLLM_S3KV_BUCKET"),
}


def _toml(tmp: Path, text: str) -> Path:
    path = tmp / "s3kv.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", sorted(BAD_SETTINGS))
def test_bad_settings_turn_the_connector_off_with_one_line_naming_the_setting(
    moto_server: str, moto_bucket: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, tmp_path: Path, case: str,
) -> None:  # fmt: skip
    use_bucket(monkeypatch, moto_server, moto_bucket)
    apply, setting = BAD_SETTINGS[case]
    apply(monkeypatch, tmp_path)
    caplog.set_level(logging.WARNING)
    scheduler, worker = instance(pool())  # constructors and registration: nothing raises
    assert scheduler.core is None
    assert worker.core is None
    assert scheduler.get_num_new_matched_tokens(Request(1, PROMPT), 0) == (0, False)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, lines
    assert setting in lines[0]


def test_a_missing_bucket_starts_degraded_with_one_error_line_and_comes_back(
    moto_server: str, shipped_defaults: None, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    # NoSuchBucket and AccessDenied need an operator, who may fix them without a restart.
    from s3kv.storage import ensure_bucket, make_client

    bucket = unique_bucket()
    use_bucket(monkeypatch, moto_server, bucket)
    monkeypatch.setattr("s3kv.startup._FIRST_RETRY", 0.05)
    caplog.set_level(logging.WARNING)
    scheduler, _ = instance(pool())
    store = only_store()
    assert scheduler.core is not None
    assert not store.ready
    (line,) = startup_lines(caplog)
    assert bucket in line
    assert "TLLM_S3KV_BUCKET" in line
    assert [r.levelno for r in caplog.records if r.name == "s3kv.startup"] == [logging.ERROR]
    ensure_bucket(make_client(S3KVConfig.load()), bucket)  # the operator creates it
    assert store.wait_ready(timeout=30)
    assert scheduler.core.shards is not None
    assert scheduler.core.shards.healthy


@pytest.mark.parametrize("where", ["scheduler", "worker"])
def test_an_unexpected_failure_in_a_constructor_turns_off_not_raises(
    moto_server: str, moto_bucket: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, where: str,
) -> None:  # fmt: skip
    use_bucket(monkeypatch, moto_server, moto_bucket)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected constructor fault")

    base = trtllm.SchedulerBase if where == "scheduler" else trtllm.WorkerBase
    monkeypatch.setattr(base, "__init__", broken)
    caplog.set_level(logging.ERROR)
    scheduler, worker = instance(pool())  # no exception into the engine
    assert scheduler.core is None
    assert worker.core is None
    assert any("injected constructor fault" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------------------
# Tensor parallelism: a degraded rank does not make the ranks disagree
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("degraded_rank", [0, 1])
def test_a_rank_whose_bucket_fails_at_startup_keeps_every_rank_on(
    moto_server: str, moto_bucket: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, degraded_rank: int,
) -> None:  # fmt: skip
    use_bucket(monkeypatch, moto_server, moto_bucket)
    hole = Blackhole()
    # Rank 0 opens every shard's store (one layout); a rank > 0 its relayed one.
    name = "open_layout" if degraded_rank == 0 else "open_relayed_store"
    real = getattr(ProcessState, name)

    def dead_endpoint(self: ProcessState, config: S3KVConfig, *args: Any) -> Any:
        if current_rank() == degraded_rank:
            config = config.replace(endpoint_url=hole.url, startup_timeout=1.0)
        return real(self, config, *args)

    monkeypatch.setattr(ProcessState, name, dead_endpoint)
    caplog.set_level(logging.WARNING)
    try:
        scheduler, workers = register_two_ranks(monkeypatch)  # no broken barrier
        assert scheduler is not None
        assert scheduler.core is not None
        shards = scheduler.core.shards
        assert shards is not None
        # Every rank has its core: a claim is loaded on every rank, whoever is degraded.
        assert all(w.core is not None for w in workers)
        degraded = workers[degraded_rank].core
        assert degraded is not None
        if degraded_rank == 0:
            # Rank 0 decides claims over its shard stores: none while they are pending.
            assert not shards.healthy
            # One line for the bucket, not one per shard store.
            assert sum("did not answer" in line for line in startup_lines(caplog)) == 1
            assert scheduler.get_num_new_matched_tokens(Request(1, PROMPT), 0) == (0, False)
        else:
            # Rank 0's stores serve claims; rank 1's own store drops its saves meanwhile.
            assert all(store.wait_ready(timeout=30) for store in shards.stores)
            assert shards.healthy
            assert not degraded.store.ready
            key = BlockHash(bytes(32))
            status = degraded.store.save(key, ROOT_HASH, bytes(64), dtype="bfloat16", shape=(32,))
            assert status is SaveStatus.DROPPED
    finally:
        process_state().close_all()
        hole.close()


def test_closing_a_pending_store_stops_its_opening(
    shipped_defaults: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    hole = Blackhole()
    use_bucket(monkeypatch, hole.url, "closed-early")
    monkeypatch.setenv("TLLM_S3KV_STARTUP_TIMEOUT", "0")
    try:
        instance(pool())
        store = only_store()
        assert not store.ready
        assert store.metrics.value("store_pending") == 1  # what an operator's alert reads
        process_state().close_all()
        assert not store.wait_ready(timeout=5), "closed: never ready"
        threads = [t for t in threading.enumerate() if t.name == "s3kv-open" and t.is_alive()]
        deadline = time.monotonic() + 15  # the attempt under way ends at its read timeout
        while threads and time.monotonic() < deadline:
            threads[0].join(0.5)
            threads = [t for t in threads if t.is_alive()]
        assert not threads, "the opener thread ends after close"
    finally:
        hole.close()
