"""The store against objects planted in its bucket: oversized junk under a block key is
never read, and a known-bad key is not fetched again and again (issue 12, items 5 and 6).
Forged and replayed blocks are in ``test_auth.py``; decoders' declared sizes in
``test_declared_sizes.py``; the network in ``test_campaign_network.py``."""

from __future__ import annotations

import tracemalloc

from s3kv.keys import chain_hashes
from s3kv.storage import MemoryBackend
from tests.test_store import blocks, open_store, save_chain


def gets(store: object) -> float:
    return float(store.metrics.value("requests", op="get"))  # type: ignore[attr-defined]


def test_oversized_junk_under_a_block_key_is_refused_unread() -> None:
    backend = MemoryBackend()
    chain = chain_hashes(list(range(16)), 4)
    save_chain(open_store(backend), chain, blocks(len(chain)))
    reader = open_store(backend)
    junk = b"\xa5" * (64 << 20)  # 64 MiB under a 512-byte block's key
    backend.put(reader.object_key(chain[2]), junk)
    tracemalloc.start()
    try:
        reader.prefetch(chain)
        reader.wait_staged(chain, timeout=10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reader.staging.count_leading(chain) == 2
    assert reader.metrics.value("corrupt_objects", kind="too_large") == 1
    assert peak < 8 << 20, f"reading the junk allocated {peak} bytes"
    assert reader.metrics.value("bytes_received") < 1 << 20


def test_a_corrupt_object_is_fetched_once_not_per_lookup() -> None:
    backend = MemoryBackend()
    chain = chain_hashes(list(range(16)), 4)
    save_chain(open_store(backend), chain, blocks(len(chain)))
    reader = open_store(backend)
    key = reader.object_key(chain[0])
    body = bytearray(backend.get(key) or b"")
    body[-1] ^= 0xFF
    backend.put(key, bytes(body))
    # The scheduler's path: pin the staged run, prefetch the maybe-tail (the whole chain,
    # since its first block is the corrupt one).
    assert reader.claim(chain) == 0
    reader.wait_staged(chain, timeout=10)
    after_first = gets(reader)
    for _ in range(9):
        assert reader.claim(chain) == 0
        reader.wait_staged(chain, timeout=10)
    assert gets(reader) == after_first, "quarantined: no GET of the corrupt object again"
    assert reader.metrics.value("corrupt_objects", kind="checksum") == 1
    assert reader.metrics.value("prefetch_quarantined") == 9


def test_ops_never_read_an_oversized_identity_or_sample_junk() -> None:
    import tracemalloc

    from s3kv.keys import identity_object_key
    from s3kv.ops.scope import read_identity

    backend = MemoryBackend()
    fp = "0" * 32
    backend.put(identity_object_key("s3kv", fp), b"{" + b" " * (32 << 20) + b"}")
    tracemalloc.start()
    try:
        assert read_identity(backend, "s3kv", fp) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20
