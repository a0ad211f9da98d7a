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
    │   ├── AuthenticationError  not sealed by a trusted key (auth_keys set): forged or unsigned
    │   └── SizeMismatchError    header fields disagree with each other or the caller
    └── StorageError             the object store failed (after retries)
        ├── BucketNotFoundError  the bucket does not exist
        ├── AccessDeniedError    credentials missing, invalid or not allowed
        ├── EndpointError        the endpoint cannot be reached or answers garbage
        ├── ThrottledError       the server asked us to slow down (503 SlowDown, 429)
        ├── ObjectTooLargeError  an object is longer than the reader's bound (not read)
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


class AuthenticationError(CodecError):
    """Not sealed by a trusted key: forged, replayed from another key, unsigned or sealed
    with a key this reader does not hold. ``kind`` says which."""

    kind = "unauthenticated"

    def __init__(self, message: str, kind: str = "unauthenticated") -> None:
        super().__init__(message)
        self.kind = kind


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


class ObjectTooLargeError(StorageError):
    """An object is longer than the ``max_bytes`` its reader allowed; its body was not read.

    The server answered normally: the object, not the service, is at fault (a foreign or
    corrupt object under an s3kv key), so the circuit breaker counts it as an answer.
    """

    kind = "too_large"


__all__ = [
    "AccessDeniedError",
    "AuthenticationError",
    "BadMagicError",
    "BucketNotFoundError",
    "ChecksumError",
    "CodecError",
    "ConfigError",
    "EndpointError",
    "KeyDerivationError",
    "KeyMismatchError",
    "ObjectTooLargeError",
    "PreconditionFailedError",
    "S3KVError",
    "SizeMismatchError",
    "StorageError",
    "ThrottledError",
    "TruncatedError",
    "UnsupportedVersionError",
]
