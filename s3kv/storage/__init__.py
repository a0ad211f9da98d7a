"""Storage: where s3kv's objects live, behind one narrow interface. Import from here.

Parts (users import this front, never the parts):

* ``base`` — :class:`Backend`, the interface (after zarr's ``Store``: a miss is ``None``, only
  "not found" becomes ``None``, capabilities declared), its value types and
  :class:`DelegatingBackend`.
* ``memory`` — :class:`MemoryBackend`, in-process, for tests and demos.
* ``file`` — :class:`FileBackend`, a directory as the bucket (``endpoint_url = file:///path``).
* ``s3`` — :class:`S3Backend` over boto3, and :func:`translate_error`, the one place foreign
  errors become the :class:`~s3kv.errors.StorageError` tree. The only boto3 importer in s3kv.
* ``crt`` — object GET/PUT through awscrt for :class:`S3Backend` (``s3_client``; the ``crt``
  extra); the only awscrt importer, loaded by ``s3`` when used.
* ``instrumented`` — :class:`InstrumentedBackend`: request metrics and the circuit breaker.
* ``breaker`` — :class:`CircuitBreaker`, which turns an outage into immediate refusals.
* ``kms`` — :func:`kms_decrypt` and :func:`kms_generate`, AWS KMS for block keys
  (``auth_keys = kms:PATH``); the other boto3 importer, loaded only when used.
* ``factory`` — :func:`open_backend`, the one factory (engine and CLI alike), and
  :func:`whoami`.

Importing this package does not import boto3: the S3 names below are loaded on first use.
"""

from typing import TYPE_CHECKING

from s3kv.storage.base import (
    DELETE_BATCH,
    Backend,
    Capabilities,
    Credentials,
    DelegatingBackend,
    DeleteResult,
    ObjectInfo,
)
from s3kv.storage.breaker import BreakerState, CircuitBreaker, CircuitOpenError
from s3kv.storage.factory import open_backend, whoami
from s3kv.storage.file import FileBackend, is_file_url
from s3kv.storage.instrumented import InstrumentedBackend, Recorded
from s3kv.storage.memory import MemoryBackend

if TYPE_CHECKING:
    from s3kv.storage.kms import kms_decrypt, kms_generate
    from s3kv.storage.s3 import (
        FOREIGN_ERRORS,
        S3Backend,
        ensure_bucket,
        make_client,
        probe_conditional_put,
        translate_error,
    )

#: Names served from ``s3kv.storage.s3`` on first use (importing boto3 then).
_S3_NAMES = frozenset(
    {
        "FOREIGN_ERRORS",
        "S3Backend",
        "ensure_bucket",
        "kms_decrypt",
        "kms_generate",
        "make_client",
        "probe_conditional_put",
        "translate_error",
    }
)


#: Names served from ``s3kv.storage.kms`` on first use.
_KMS_NAMES = frozenset({"kms_decrypt", "kms_generate"})


def __getattr__(name: str) -> object:
    # NOTE: boto3 is slow to import; the CLI's file:// path and the memory backend
    # never need it, so the S3 module is imported on first use of one of its names.
    if name in _KMS_NAMES:
        from s3kv.storage import kms

        return getattr(kms, name)
    if name in _S3_NAMES:
        from s3kv.storage import s3

        return getattr(s3, name)
    raise AttributeError(f"module 's3kv.storage' has no attribute {name!r}")


__all__ = [
    "DELETE_BATCH",
    "FOREIGN_ERRORS",
    "Backend",
    "BreakerState",
    "Capabilities",
    "CircuitBreaker",
    "CircuitOpenError",
    "Credentials",
    "DelegatingBackend",
    "DeleteResult",
    "FileBackend",
    "InstrumentedBackend",
    "MemoryBackend",
    "ObjectInfo",
    "Recorded",
    "S3Backend",
    "ensure_bucket",
    "is_file_url",
    "kms_decrypt",
    "kms_generate",
    "make_client",
    "open_backend",
    "probe_conditional_put",
    "translate_error",
    "whoami",
]
