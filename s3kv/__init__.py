"""s3kv: persist TensorRT-LLM's KV cache in any S3-compatible bucket.

Importing this package imports neither torch, boto3 nor tensorrt_llm; each is imported only
by the module that needs it, when it is used.
"""

from typing import TYPE_CHECKING

from s3kv.config import S3KVConfig
from s3kv.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    CodecError,
    ConfigError,
    EndpointError,
    KeyDerivationError,
    S3KVError,
    StorageError,
)
from s3kv.keys import (
    ROOT_HASH,
    UNKNOWN,
    BlockHash,
    ModelIdentity,
    MultimodalItem,
    chain_hashes,
    hash_block,
)
from s3kv.storage import Backend, Capabilities, DeleteResult, MemoryBackend, ObjectInfo

__version__ = "0.1.0"

_LAZY = {"KVStore": "s3kv.store", "LookupResult": "s3kv.store", "SaveStatus": "s3kv.store"}


def __getattr__(name: str) -> object:
    # NOTE: the engine pulls in zstandard and the manifest; import it only when used, so
    # `import s3kv` stays cheap for the CLI.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 's3kv' has no attribute {name!r}")


__all__ = [
    "ROOT_HASH",
    "UNKNOWN",
    "AccessDeniedError",
    "Backend",
    "BlockHash",
    "BucketNotFoundError",
    "Capabilities",
    "CodecError",
    "ConfigError",
    "DeleteResult",
    "EndpointError",
    "KVStore",
    "KeyDerivationError",
    "LookupResult",
    "MemoryBackend",
    "ModelIdentity",
    "MultimodalItem",
    "ObjectInfo",
    "S3KVConfig",
    "S3KVError",
    "SaveStatus",
    "StorageError",
    "__version__",
    "chain_hashes",
    "hash_block",
]

if TYPE_CHECKING:
    from s3kv.store import KVStore, LookupResult, SaveStatus
