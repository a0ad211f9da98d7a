"""The TensorRT-LLM KV cache connector.

``s3kv.connector.trtllm`` holds the classes users name in ``KvCacheConnectorConfig``.
``s3kv.connector.api`` is the only module that imports ``tensorrt_llm``: it resolves the base
classes and data classes (TensorRT-LLM's when it imports, local stand-ins otherwise) and
TensorRT-LLM's MPI helpers. The scheduler and worker cores are engine-neutral: they see
:class:`~s3kv.connector.requests.RequestView` s the adapter builds, and the store only
through its public API (:class:`~s3kv.connector.shared.ShardStores`).
"""

from typing import TYPE_CHECKING

_LAZY = {"S3KVConnectorScheduler", "S3KVConnectorWorker"}


def __getattr__(name: str) -> object:
    # NOTE: lazily, so importing the package does not open the engine's dependencies.
    if name in _LAZY:
        from s3kv.connector import trtllm

        return getattr(trtllm, name)
    raise AttributeError(f"module 's3kv.connector' has no attribute {name!r}")


__all__ = ["S3KVConnectorScheduler", "S3KVConnectorWorker"]

if TYPE_CHECKING:
    from s3kv.connector.trtllm import S3KVConnectorScheduler, S3KVConnectorWorker
