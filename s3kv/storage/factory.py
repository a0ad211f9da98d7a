"""The one place settings become a backend: :func:`open_backend` (and :func:`whoami`).

``endpoint_url = "file:///path"`` names a directory (:class:`~s3kv.storage.file.FileBackend`);
anything else is S3. The S3 module, and with it boto3, is imported only here and only when an
S3 backend is asked for, so ``import s3kv.storage`` stays free of boto3; that backend carries
object GET/PUT through awscrt where installed (``s3_client``, :mod:`s3kv.storage.crt`).
"""

from __future__ import annotations

from s3kv.config import S3KVConfig
from s3kv.storage.base import Backend, Credentials
from s3kv.storage.file import FileBackend, is_file_url

__all__ = ["open_backend", "whoami"]


def open_backend(config: S3KVConfig) -> Backend:
    """The backend ``config`` names: a directory for ``file://`` endpoints, else S3.

    The engine (:meth:`s3kv.store.KVStore.open`) and the CLI both open their backend here.
    For S3 with ``conditional_put="auto"`` this does I/O (HeadBucket, then the conditional-PUT
    probe); otherwise it does none and the caller runs :meth:`Backend.check`.

    Raises:
        ConfigError: no bucket configured for S3, or a malformed ``file://`` URL.
        BucketNotFoundError, AccessDeniedError, EndpointError: at open ("auto" probe only).
    """
    if is_file_url(config.endpoint_url):
        return FileBackend.from_url(config.endpoint_url or "")
    from s3kv.storage.s3 import S3Backend

    return S3Backend.from_config(config)


def whoami(config: S3KVConfig) -> Credentials | None:
    """The credentials the backend ``config`` names would use; ``None`` if none are found.

    Raises:
        AccessDeniedError: the configured profile does not exist or is unusable.
        StorageError: another failure of the credential chain.
    """
    if is_file_url(config.endpoint_url):
        return Credentials(
            source=f"none needed for {config.endpoint_url}", access_key_id="", required=False
        )
    from s3kv.storage.s3 import whoami as s3_whoami

    return s3_whoami(config)
