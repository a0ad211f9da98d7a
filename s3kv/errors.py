"""The s3kv exception tree.

Every error s3kv raises on purpose is an :class:`S3KVError`::

    S3KVError
    ├── ConfigError              a setting is missing or invalid (names the setting)
    ├── KeyDerivationError       bad input to block hashing or the model fingerprint
    ├── CodecError               an object failed verification on decode
    │   ├── BadMagicError        not an s3kv object at all
    │   ├── UnsupportedVersionError  written by a newer/older incompatible format
    │   ├── TruncatedError       shorter than its header says
    │   ├── ChecksumError        raw bytes do not match the stored checksum
    │   ├── KeyMismatchError     written under a different object key
    │   └── SizeMismatchError    header fields disagree with each other or the caller
    └── StorageError             the object store failed (after retries)
        ├── BucketNotFoundError  the bucket does not exist
        ├── AccessDeniedError    credentials missing, invalid or not allowed
        ├── EndpointError        the endpoint cannot be reached or answers garbage
        ├── ThrottledError       the server asked us to slow down (503 SlowDown, 429)
        └── PreconditionFailedError  a conditional write found the key already present

Foreign exceptions (botocore, urllib3, OS errors) are translated into this tree in exactly
one place, :func:`s3kv.storage.translate_error`; nothing else catches them.
"""

from __future__ import annotations


class S3KVError(Exception):
    """Base class of every error s3kv raises on purpose."""


class ConfigError(S3KVError, ValueError):
    """A setting is missing or invalid; the message names the setting and the fix."""


class KeyDerivationError(S3KVError, ValueError):
    """Bad input to block hashing or to the model fingerprint."""


class CodecError(S3KVError):
    """An encoded object failed verification; it must be treated as a miss."""

    #: Short machine-readable reason, used as a metric label.
    kind = "corrupt"


class BadMagicError(CodecError):
    kind = "bad_magic"


class UnsupportedVersionError(CodecError):
    kind = "unsupported_version"


class TruncatedError(CodecError):
    kind = "truncated"


class ChecksumError(CodecError):
    kind = "checksum"


class KeyMismatchError(CodecError):
    kind = "key_mismatch"


class SizeMismatchError(CodecError):
    kind = "size_mismatch"


class StorageError(S3KVError):
    """The object store failed after bounded retries."""

    #: Short machine-readable reason, used as a metric label.
    kind = "storage"


class BucketNotFoundError(StorageError):
    kind = "no_bucket"


class AccessDeniedError(StorageError):
    kind = "access_denied"


class EndpointError(StorageError):
    kind = "endpoint"


class ThrottledError(StorageError):
    kind = "throttled"


class PreconditionFailedError(StorageError):
    kind = "precondition_failed"


__all__ = [
    "AccessDeniedError",
    "BadMagicError",
    "BucketNotFoundError",
    "ChecksumError",
    "CodecError",
    "ConfigError",
    "EndpointError",
    "KeyDerivationError",
    "KeyMismatchError",
    "PreconditionFailedError",
    "S3KVError",
    "SizeMismatchError",
    "StorageError",
    "ThrottledError",
    "TruncatedError",
    "UnsupportedVersionError",
]
