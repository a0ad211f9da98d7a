"""The public surface, pinned (as httpx's ``test_exported_members.py``).

A name added to or removed from a front's ``__all__`` must be a deliberate change here; every
name listed must exist; every product module states its own surface with ``__all__``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

PUBLIC: dict[str, list[str]] = {
    "s3kv": [
        "ROOT_HASH", "UNKNOWN", "AccessDeniedError", "Backend", "BlockHash",
        "BucketNotFoundError", "Capabilities", "CodecError", "ConfigError", "DeleteResult",
        "EndpointError", "KVStore", "KeyDerivationError", "LookupResult", "MemoryBackend",
        "ModelIdentity", "MultimodalItem", "ObjectInfo", "S3KVConfig", "S3KVError",
        "SaveStatus", "StorageError", "__version__", "chain_hashes", "hash_block",
    ],
    "s3kv.connector": ["S3KVConnectorScheduler", "S3KVConnectorWorker"],
    "s3kv.testing": ["emulator", "faultproxy", "local_s3", "smollm2", "storage"],
    "s3kv.testing.faultproxy": ["Fault", "FaultKind", "FaultProxy", "Record", "Rule"],
    "s3kv.testing.storage": ["BackendTests", "Quirk"],
    "s3kv.connector.trtllm": ["S3KVConnectorScheduler", "S3KVConnectorWorker"],
    "s3kv.storage": [
        "DELETE_BATCH", "FOREIGN_ERRORS", "Backend", "BreakerState", "Capabilities",
        "CircuitBreaker", "CircuitOpenError", "Credentials", "DelegatingBackend",
        "DeleteResult", "FileBackend", "InstrumentedBackend", "MemoryBackend", "ObjectInfo",
        "S3Backend", "ensure_bucket", "is_file_url", "kms_decrypt", "kms_generate",
        "Recorded", "make_client", "open_backend", "probe_conditional_put", "translate_error",
        "whoami",
    ],
    "s3kv.manifest": [
        "KIND_HIT", "KIND_PIN", "KIND_UNPIN", "KIND_WRITE", "RECORD_DTYPE", "UNKNOWN_PARENT",
        "USAGE_DTYPE", "BloomFilter", "CompactionPolicy", "CompactionReport", "Compactor",
        "CycleReport", "DeltaRef", "KeyFilter", "LogEntry", "Manifest", "ManifestIO",
        "ManifestLog", "Records", "SegmentWriter", "ShardView", "ShardedPresence",
        "SnapshotRef", "UsageRow", "UsageTable", "XorFilter", "compact", "load_usage",
    ],
    "s3kv.manifest.shards": ["ShardView", "ShardedPresence"],
    "s3kv.auth": [
        "MAX_OVERHEAD", "Keyring", "is_sealed", "load_keyring", "new_key_line", "parse_keys",
        "seal", "sealed_key_id", "unseal",
    ],
}  # fmt: skip

PACKAGE = Path(__file__).resolve().parent.parent / "s3kv"


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_surface_is_pinned(module: str) -> None:
    exported = importlib.import_module(module).__all__
    assert sorted(exported) == sorted(PUBLIC[module])


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_every_exported_name_exists(module: str) -> None:
    mod = importlib.import_module(module)
    missing = [name for name in mod.__all__ if not hasattr(mod, name)]
    assert not missing


def product_modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        name = ".".join(parts)
        private = any(p.startswith("_") and p != "__init__" for p in rel.parts)
        harness = name.startswith("s3kv.testing")
        if not private and not harness:
            names.append(name)
    return names


def test_every_product_module_declares_its_surface() -> None:
    lacking = [m for m in product_modules() if "__all__" not in vars(importlib.import_module(m))]
    assert not lacking, f"modules without __all__: {lacking}"
