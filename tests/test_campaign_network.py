"""Campaign (issue 12): a hostile network between s3kv and a real SeaweedFS.

Every fault kind of :mod:`s3kv.testing.faultproxy` is injected on every request type s3kv
makes — block GET and PUT, manifest segment GET and PUT, log entry GET, HEAD — through a
fault-injecting proxy in front of the session's SeaweedFS, against the real store
(``KVStore.open`` on the S3 backend); whole-bucket outages and startup faults also against the
real connector on the emulated TensorRT-LLM runtime. Whatever the network does:

* nothing raises out of the store's or the connector's entry points;
* no wrong bytes are ever staged: every staged block equals the bytes that were saved, every
  object that decodes holds them, and the engine's outputs equal a run without the connector;
* a body corrupted or truncated in transit is a miss (counted), never data;
* outages open the circuit breaker, and once the fault is removed the store recovers: the
  breaker closes, the manifest catches up, blocks stage and saves land again.

Clients behind the proxy use one attempt and a 1 s read timeout (``FAULTED_SETTINGS`` in
conftest), so a delay or a blackhole costs the client's deadline: a second with boto3, a few
with the awscrt transport. The read-only scenarios share one bucket written once
(``written``); those that write get a fresh one (``fault_proxy``). The connector scenarios
build engines and are marked ``slow``.

The matrix: s3kv tells four classes of fault apart — an error status (503, 500), a broken
connection (cut, reset), a timeout (delay, blackhole) and wrong bytes (corrupt, truncate).
Block GET and PUT, the data path, meet every kind; the manifest's requests and HEAD meet
each class at least once (HEAD answers have no body to mangle).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from _emulator import one_torch_thread, prompt, tiny_model
from conftest import BucketProxy, bucket_proxy, s3_config, unique_bucket

from s3kv import codec
from s3kv.config import S3KVConfig
from s3kv.connector.shared import process_state
from s3kv.errors import CodecError
from s3kv.keys import ROOT_HASH, BlockHash, ModelIdentity, block_object_key, chain_hashes
from s3kv.manifest import compact
from s3kv.ops.scope import resolve_scope
from s3kv.ops.verify import verify_objects
from s3kv.staging import NumpyAllocator
from s3kv.storage import Backend, BreakerState, S3Backend, ensure_bucket, make_client
from s3kv.store import KVStore, open_manifest
from s3kv.testing.emulator.executor import PyExecutorEmulator
from s3kv.testing.emulator.instance import S3KV_CONNECTOR
from s3kv.testing.emulator.llm_args import KvCacheConfig, TorchLlmArgs
from s3kv.testing.faultproxy import Fault
from s3kv.testing.local_s3 import LocalS3

pytestmark = pytest.mark.seaweedfs

SHAPE = (2, 2, 4, 1, 8)  # layers, kv, tokens, heads, head_dim: 256-byte blocks
N = 4  # blocks per chain
#: Past every client's deadline behind the proxy: boto3's read timeout, and the stall
#: allowance of the awscrt transport (connect plus read timeout, plus a second per MiB
#: awaited). A delay costs the client's deadline, not this.
DELAY_S = 10.0

#: The fault kinds, by test id. A "503 burst" is every matching request while the rule holds.
KINDS: dict[str, Fault] = {
    "503": Fault.error(503),
    "500": Fault.error(500),
    "delay": Fault.delay(DELAY_S),
    "cut": Fault.cut(),
    "corrupt": Fault.corrupt(),
    "truncate": Fault.truncate(),
    "reset": Fault.reset(),
    "blackhole": Fault.blackhole(),
}
#: Kinds that deliver wrong bytes with a success status; the others fail the request.
MANGLED = frozenset({"corrupt", "truncate"})

#: Path regexes of the request types (with the method, that is what a rule matches).
BLOCKS = r"/blocks/"
SEGMENTS = r"/manifest/segments/"
LOG_ENTRIES = r"/manifest/log/\d+\.json$"

#: Store settings: quick manifest rounds, no compactor of its own, and an open that goes on
#: loading the manifest in the background after half a second (a blackholed manifest GET
#: then holds up no test).
STORE: dict[str, Any] = {
    "io_threads": 4,
    "manifest_refresh_interval": 0.2,
    "manifest_flush_interval": 0.2,
    "manifest_compaction": "off",
    "manifest_open_timeout": 0.5,
    "close_timeout": 5.0,
}
#: Key prefixes of the shared bucket: one chain with segments only (format 1, no log), and
#: the same chain compacted (a log entry and a snapshot, no segments left).
SEGMENTED, LOGGED = "segmented", "logged"


def identity() -> ModelIdentity:
    return ModelIdentity(
        model_id="campaign/model",
        weights_revision="r1",
        dtype="bfloat16",
        kv_dtype="bfloat16",
        quantization="none",
        tokens_per_block=4,
        kv_factor=2,
        block_elems=4 * 1 * 8,
        num_layers=2,
        layout="test",
    )


FP = identity().fingerprint()


@dataclass(frozen=True)
class Chain:
    """Block keys and the bytes saved under them: the truth staged bytes are compared to."""

    keys: list[BlockHash]
    data: list[np.ndarray[Any, np.dtype[np.uint16]]]

    @classmethod
    def make(cls, seed: int) -> Chain:
        rng = np.random.default_rng(seed)
        data = [rng.integers(0, 1 << 16, SHAPE, dtype=np.uint16) for _ in range(N)]
        return cls(chain_hashes(list(range(seed * 100, seed * 100 + N * 4)), 4), data)


TRUTH = Chain.make(1)


# --- fixtures and helpers -------------------------------------------------------------------


@pytest.fixture(scope="module")
def written(seaweedfs: LocalS3) -> Iterator[str]:
    """A bucket holding :data:`TRUTH` under :data:`SEGMENTED` and :data:`LOGGED`; its name."""
    bucket = unique_bucket()
    cfg = s3_config(seaweedfs.endpoint, bucket, conditional_put="on", **STORE)
    client = make_client(cfg, access_key=seaweedfs.access_key, secret_key=seaweedfs.secret_key)
    ensure_bucket(client, bucket)
    backend = S3Backend.from_config(cfg, client=client)
    for prefix in (SEGMENTED, LOGGED):
        with KVStore.open(
            cfg.replace(prefix=prefix), identity(), backend=backend, allocator=NumpyAllocator()
        ) as writer:
            save(writer, TRUTH)
    # NOTE: with no grace the compaction deletes the segments it folded at once.
    compact(backend, LOGGED, FP, fpr=1e-6, grace_s=0)
    assert not list(backend.list(f"{LOGGED}/{FP}/manifest/segments/"))
    try:
        yield bucket
    finally:
        client.delete_bucket(Bucket=bucket)
        backend.close()


@pytest.fixture
def proxy(
    seaweedfs: LocalS3, written: str, aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> Iterator[BucketProxy]:
    """A fault proxy in front of the shared bucket (read-only scenarios)."""
    with bucket_proxy(seaweedfs, written, monkeypatch) as opened:
        yield opened


class Stores:
    """Opens stores; the fixture closes every one of them at teardown."""

    def __init__(self) -> None:
        self.opened: list[KVStore] = []

    def open(self, config: S3KVConfig) -> KVStore:
        store = KVStore.open(config, identity(), allocator=NumpyAllocator())
        self.opened.append(store)
        return store


@pytest.fixture
def stores() -> Iterator[Stores]:
    opened = Stores()
    try:
        yield opened
    finally:
        for store in opened.opened:
            store.close(timeout=5)


def eventually(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Wait (bounded) for ``condition``; the failure names what never happened."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.05)


def save(store: KVStore, chain: Chain) -> bool:
    """Save ``chain`` and wait for the saves (never raises, whatever the network does)."""
    parent = ROOT_HASH
    for key, block in zip(chain.keys, chain.data, strict=True):
        store.save(key, parent, block, dtype="bfloat16", shape=SHAPE)
        parent = key
    assert store.flush(timeout=30), "saves still in flight after 30 s"
    return True


def loaded(store: KVStore) -> None:
    """Wait until the store's manifest, read through the proxy, knows :data:`TRUTH`.

    NOTE: on a loaded machine a request may outlast the one-second read timeout by
    accident; the manifest's refresh timer reads again.
    """
    eventually(lambda: store.healthy and store.count_maybe(TRUTH.keys) == N, "the manifest loads")


def staged_truth(store: KVStore, chain: Chain) -> int:
    """How many of ``chain``'s blocks are staged; fails if any staged bytes are wrong."""
    count = 0
    for i, (key, block) in enumerate(zip(chain.keys, chain.data, strict=True)):
        buffer = store.staged(key)
        if buffer is not None:
            assert buffer.tobytes() == block.tobytes(), f"block {i}: wrong bytes staged"
            count += 1
    return count


def landed(backend: Backend, chain: Chain, prefix: str = "s3kv") -> tuple[int, int]:
    """``(intact, mangled)`` objects of ``chain`` in the bucket, read as a store reads them;
    fails if one decodes to other bytes than were saved."""
    intact = mangled = 0
    for i, (key, block) in enumerate(zip(chain.keys, chain.data, strict=True)):
        object_key = block_object_key(prefix, FP, key)
        blob = backend.get(object_key)
        if blob is None:
            continue
        try:
            raw = codec.decode(blob, key=object_key)
        except CodecError:
            mangled += 1
            continue
        assert bytes(raw) == block.tobytes(), f"block {i}: an object decodes to wrong bytes"
        intact += 1
    return intact, mangled


def stages_all(store: KVStore, chain: Chain) -> bool:
    """One recovery round: ask for health (a half-open breaker probes), prefetch, wait."""
    if not store.healthy:
        return False
    store.prefetch(chain.keys)
    store.wait_staged(chain.keys, timeout=5)
    return staged_truth(store, chain) == N


def recover(store: KVStore, chain: Chain) -> None:
    """The fault is gone: the breaker closes and every block stages, with the right bytes."""
    eventually(lambda: stages_all(store, chain), "the store stages every block again")
    breaker = store.backend.breaker
    assert breaker is not None
    assert breaker.state is BreakerState.CLOSED


def outage_seen(store: KVStore) -> bool:
    breaker = store.backend.breaker
    return breaker is not None and breaker.trips >= 1


def kinds(*names: str) -> list[str]:
    """Fault kinds to parametrize with (all of them by default)."""
    return list(names or KINDS)


# --- blocks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", kinds())
def test_block_get_faults_are_misses_then_recover(
    proxy: BucketProxy, stores: Stores, kind: str
) -> None:
    reader = stores.open(proxy.config(prefix=SEGMENTED, **STORE))
    loaded(reader)

    rule = proxy.add(KINDS[kind], method="GET", path=BLOCKS)
    reader.prefetch(TRUTH.keys)
    reader.wait_staged(TRUTH.keys, timeout=15)
    assert rule.applied >= 1
    assert staged_truth(reader, TRUTH) == 0  # every GET was faulted: nothing staged
    if kind in MANGLED:
        assert reader.metrics.total("corrupt_objects") >= 1  # a counted miss
        assert not outage_seen(reader)  # the object's problem, not the service's
    else:
        assert outage_seen(reader)

    proxy.remove(rule)
    if kind in MANGLED:
        # Nothing changed in the bucket: a fresh instance stages every block.
        recover(stores.open(proxy.config(prefix=SEGMENTED, **STORE)), TRUTH)
    else:
        recover(reader, TRUTH)


@pytest.mark.parametrize("kind", kinds())
def test_block_put_faults_drop_saves_and_land_no_wrong_bytes(
    fault_proxy: BucketProxy, stores: Stores, kind: str
) -> None:
    faulted, later = Chain.make(2), Chain.make(3)
    writer = stores.open(fault_proxy.config(**STORE))

    rule = fault_proxy.add(KINDS[kind], method="PUT", path=BLOCKS)
    save(writer, faulted)
    assert rule.applied >= 1
    if kind not in MANGLED:
        assert writer.metrics.value("save_failed") >= 1
        assert outage_seen(writer)

    fault_proxy.remove(rule)
    # The writer recovers: once the breaker closes, new saves land.
    direct = fault_proxy.backend(direct=True)
    eventually(
        lambda: writer.healthy and save(writer, later) and landed(direct, later) == (N, 0),
        "the writer's breaker closes and new saves land",
    )
    # Of the faulted saves only intact objects landed, or mangled ones a reader rejects.
    _intact, mangled = landed(direct, faulted)
    if kind in MANGLED:  # the server stored the mangled body, or refused it (signed length)
        assert mangled >= 1 or writer.metrics.value("save_failed") >= 1


# --- manifest segments (format 1: no log, every instance reads the segments) ----------------


@pytest.mark.parametrize("kind", kinds("503", "cut", "corrupt", "truncate", "blackhole"))
def test_segment_get_faults_hide_keys_until_the_fault_is_removed(
    proxy: BucketProxy, stores: Stores, kind: str
) -> None:
    """Issue 12 item 3: a segment corrupted or truncated once in transit was lost to the
    instance for its lifetime (it failed here before the fix)."""
    rule = proxy.add(KINDS[kind], method="GET", path=SEGMENTS)
    reader = stores.open(proxy.config(prefix=SEGMENTED, **STORE))  # loads through the fault
    eventually(lambda: rule.applied >= 1, "the manifest reads the segment")
    assert reader.count_maybe(TRUTH.keys) == 0  # the keys are unknown: misses
    reader.prefetch_maybe(TRUTH.keys)
    assert staged_truth(reader, TRUTH) == 0

    proxy.remove(rule)
    # A segment that failed in transit is read again: the keys appear.
    eventually(
        lambda: reader.healthy and reader.count_maybe(TRUTH.keys) == N,
        "a refresh reads the segment again",
    )
    recover(reader, TRUTH)


@pytest.mark.parametrize("kind", kinds("503", "cut", "corrupt", "blackhole"))
def test_segment_put_faults_lose_no_keys_to_an_outage(
    fault_proxy: BucketProxy, stores: Stores, kind: str
) -> None:
    chain = Chain.make(5)
    writer = stores.open(fault_proxy.config(**STORE))

    rule = fault_proxy.add(KINDS[kind], method="PUT", path=SEGMENTS)
    save(writer, chain)  # the blocks land; the manifest's flush meets the fault
    eventually(lambda: rule.applied >= 1, "the manifest flushes a segment")
    if kind not in MANGLED:
        eventually(lambda: writer.stats()["manifest_flush_errors"] >= 1, "a failed flush")

    fault_proxy.remove(rule)
    eventually(
        lambda: (
            writer.healthy and writer.flush() and writer.stats()["manifest_pending_records"] == 0
        ),
        "the writer's breaker closes and its records are flushed",
    )
    direct = fault_proxy.backend(direct=True)
    manifest = open_manifest(direct, fault_proxy.config(direct=True, **STORE), FP)
    try:
        if kind in MANGLED:
            # The mangled segment landed and its records left the queue: other instances
            # skip it (counted) and miss those keys; a miss, never wrong bytes.
            assert manifest.stats()["segments_corrupt"] >= 1
        else:
            # An outage loses no records: they are flushed again once the bucket is back.
            assert manifest.count_leading(chain.keys) == N
    finally:
        manifest.close(flush=False)
    assert landed(direct, chain) == (N, 0)


# --- the manifest log -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", kinds("503", "reset", "corrupt", "truncate", "blackhole"))
def test_log_entry_get_faults_hide_keys_until_the_fault_is_removed(
    proxy: BucketProxy, stores: Stores, kind: str
) -> None:
    rule = proxy.add(KINDS[kind], method="GET", path=LOG_ENTRIES)
    reader = stores.open(proxy.config(prefix=LOGGED, **STORE))
    eventually(lambda: rule.applied >= 1, "the manifest reads the log entry")
    assert reader.count_maybe(TRUTH.keys) == 0
    reader.prefetch_maybe(TRUTH.keys)
    assert staged_truth(reader, TRUTH) == 0

    proxy.remove(rule)
    eventually(
        lambda: reader.healthy and reader.count_maybe(TRUTH.keys) == N,
        "a refresh reads the log entry again",
    )
    recover(reader, TRUTH)


# --- HEAD: the breaker's health probe -------------------------------------------------------


@pytest.mark.parametrize("kind", kinds("503", "cut", "blackhole"))  # HEAD answers have no body
def test_head_faults_keep_the_breaker_open_until_removed(
    proxy: BucketProxy, stores: Stores, kind: str
) -> None:
    # NOTE: no manifest refresh: any request may be the half-open breaker's probe, and only
    # the store's own probe (HEAD bucket) should be.
    reader = stores.open(
        proxy.config(prefix=SEGMENTED, **{**STORE, "manifest_refresh_interval": 0})
    )
    breaker = reader.backend.breaker
    assert breaker is not None

    # Block GETs fail (503) and trip the breaker; its probes (HEAD bucket) meet the fault.
    gets = proxy.add(Fault.error(503), method="GET", path=BLOCKS)
    heads = proxy.add(KINDS[kind], method="HEAD")
    reader.prefetch(TRUTH.keys)
    reader.wait_staged(TRUTH.keys, timeout=15)
    assert outage_seen(reader)
    proxy.remove(gets)
    eventually(lambda: not reader.healthy and heads.applied >= 2, "two probes fail")
    assert breaker.trips >= 2  # each failed probe re-opened the circuit
    assert staged_truth(reader, TRUTH) == 0

    proxy.remove(heads)
    recover(reader, TRUTH)


def test_a_block_corrupted_in_transit_fails_its_checksum(proxy: BucketProxy) -> None:
    backend = proxy.backend()
    with proxy.injected(Fault.corrupt(), method="GET", path=BLOCKS):
        intact, mangled = landed(backend, TRUTH, SEGMENTED)
    assert (intact, mangled) == (0, N)
    assert landed(backend, TRUTH, SEGMENTED) == (N, 0)


# --- ops: verify --delete-corrupt ----------------------------------------------------------


def test_verify_delete_corrupt_keeps_objects_corrupted_only_in_transit(
    fault_proxy: BucketProxy,
) -> None:
    """Issue 12 item 2: ``verify --delete-corrupt`` deleted intact objects whose GET was
    corrupted in transit (it failed here before the fix)."""
    chain = Chain.make(9)
    direct = fault_proxy.backend(direct=True)
    with KVStore.open(
        fault_proxy.config(direct=True, **STORE), identity(), allocator=NumpyAllocator()
    ) as writer:
        save(writer, chain)
    backend = fault_proxy.backend()
    scope = resolve_scope(backend, "s3kv")
    # Two block GETs come back corrupted; the objects in the bucket are intact.
    rule = fault_proxy.add(Fault.corrupt(), method="GET", path=BLOCKS, times=2)
    report = verify_objects(backend, scope, prefix="s3kv", sample=None, delete=True)
    assert rule.applied == 2
    assert landed(direct, chain) == (N, 0), "verify deleted intact objects"
    assert not [finding.key for finding in report.findings if finding.deleted]


# --- the connector on the emulated runtime --------------------------------------------------

TPB = 8
SYSTEMS = [prompt(6 * TPB, seed=s) for s in (61, 71, 81)]  # three system prompts, 6 blocks
ASK = [prompt(9, seed=s) for s in range(62, 67)]


def engine(*, connector: bool) -> PyExecutorEmulator:
    args = TorchLlmArgs(
        kv_cache_config=KvCacheConfig(tokens_per_block=TPB, enable_partial_reuse=False),
        kv_connector_config=S3KV_CONNECTOR if connector else None,
        disable_overlap_scheduler=True,
    )
    return PyExecutorEmulator(args, tiny_model(TPB), num_blocks=96, stall_timeout_s=30)


def serve(executor: PyExecutorEmulator, tokens: list[int]) -> tuple[list[int], int]:
    """Outputs and tokens the connector loaded; raises if anything raised into the engine."""
    (result,) = executor.generate([tokens], 4)
    executor.drain()
    return list(result.output_tokens), result.connector_tokens


@pytest.fixture
def connector_proxy(
    fault_proxy: BucketProxy, monkeypatch: pytest.MonkeyPatch
) -> Iterator[BucketProxy]:
    """The connector's environment pointed at ``fault_proxy``; every store closed after."""
    # NOTE: a patient read timeout: a save lost to a slow moment would change what is
    # claimed; blackholes then cost 3 s.
    env = fault_proxy.env(model_revision="tiny", manifest_flush_interval=0.1, read_timeout=3.0)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        with one_torch_thread():
            yield fault_proxy
    finally:
        process_state().close_all()


def expected_outputs() -> list[list[int]]:
    """What the engine answers without the connector: ``SYSTEMS[i] + ASK[i + 1]``."""
    reference = engine(connector=False)
    return [serve(reference, SYSTEMS[i] + ASK[i + 1])[0] for i in range(3)]


def write_systems() -> None:
    """An instance serves the system prompts (so saves them) and exits."""
    writer = engine(connector=True)
    for system in SYSTEMS:
        serve(writer, system + ASK[0])
    process_state().close_all()


def the_store() -> KVStore:
    (store,) = process_state().stores.values()
    return store


@pytest.mark.slow
@pytest.mark.parametrize("kind", kinds("503", "blackhole"))
def test_connector_serves_through_a_bucket_outage_and_back(
    connector_proxy: BucketProxy, kind: str
) -> None:
    expected = expected_outputs()
    write_systems()
    # A new instance warms from the bucket and hits.
    executor = engine(connector=True)
    assert serve(executor, SYSTEMS[0] + ASK[1]) == (expected[0], len(SYSTEMS[0]))
    store = the_store()
    breaker = store.backend.breaker
    assert breaker is not None
    assert store.flush(timeout=30)

    # Every request fails: saves are dropped, the breaker opens, nothing raises, the staged
    # system prompt is not claimed while the bucket is unhealthy, the answer stays right.
    rule = connector_proxy.add(KINDS[kind])
    serve(executor, prompt(40, seed=99))
    eventually(lambda: breaker.trips >= 1, "the breaker opens")
    assert serve(executor, SYSTEMS[1] + ASK[2]) == (expected[1], 0)
    assert rule.applied >= 1

    # The fault goes: the breaker closes and the connector claims again.
    connector_proxy.remove(rule)
    eventually(lambda: store.healthy, "the breaker closes")
    assert serve(executor, SYSTEMS[2] + ASK[3]) == (expected[2], len(SYSTEMS[2]))


@pytest.mark.slow
def test_connector_reads_corrupted_in_transit_are_misses(connector_proxy: BucketProxy) -> None:
    expected = expected_outputs()
    write_systems()
    # Every block GET is corrupted in transit: warm start and prefetches stage nothing, the
    # connector claims nothing, and the outputs are still right.
    rule = connector_proxy.add(Fault.corrupt(), method="GET", path=BLOCKS)
    executor = engine(connector=True)
    for i in range(3):
        assert serve(executor, SYSTEMS[i] + ASK[i + 1]) == (expected[i], 0)
    store = the_store()
    assert rule.applied >= 1
    assert store.metrics.total("corrupt_objects") >= 1
    breaker = store.backend.breaker
    assert breaker is not None
    assert breaker.trips == 0  # a corrupt object is not an outage


def connector_ready() -> bool:
    """The connector's store is open and healthy, and its warm start is done."""
    opened = list(process_state().stores.values())
    return len(opened) == 1 and opened[0].healthy and opened[0].metrics.value("warm_ready") == 1


@pytest.mark.slow
@pytest.mark.parametrize("kind", kinds("503", "blackhole"))
def test_connector_started_during_an_outage_comes_back(
    connector_proxy: BucketProxy, kind: str
) -> None:
    """Issue 12: a bucket throttled or blackholed at startup turned the connector off for
    the engine's lifetime (it failed here before the fix)."""
    expected = expected_outputs()
    write_systems()
    # The instance starts while every request fails: it serves, claiming nothing ...
    rule = connector_proxy.add(KINDS[kind])
    executor = engine(connector=True)
    assert serve(executor, SYSTEMS[0] + ASK[1]) == (expected[0], 0)
    assert rule.applied >= 1
    # ... and once the bucket answers, its store opens, warms and claims.
    connector_proxy.remove(rule)
    eventually(connector_ready, "the connector's store opens and warms", timeout=15)
    assert serve(executor, SYSTEMS[1] + ASK[2]) == (expected[1], len(SYSTEMS[1]))
    # It saves again.
    store = the_store()
    serve(executor, prompt(40, seed=98))
    assert store.flush(timeout=30)
    assert store.metrics.value("save_completed") >= 1
