"""Sealed blocks: an AES-256-GCM envelope around an encoded block, bound to its object key.

The wire format, all integers little-endian::

    offset  size  field
    0       4     magic b"S3KA"
    4       1     u8 envelope version (1)
    5       1     u8 algorithm (1: AES-256-GCM under a per-object key)
    6       1     u8 key id length L (1..32)
    7       L     key id (ASCII): which secret of the keyring sealed it
    7+L     16    salt (random per object)
    23+L    n     the encoded block (an ``S3KV`` object, :mod:`s3kv.codec`), encrypted
    ..      16    GCM tag

The per-object key is HMAC-SHA256(secret, ``b"s3kv/seal/v1" + salt``) and the nonce is zero:
every object has its own key, so there is no nonce budget to run out of however many blocks
a fleet writes (random 96-bit nonces under one key would allow about 2^32). The associated
data is the envelope header (magic through salt) followed by the UTF-8 object key, so:

* a block cannot be forged without the secret (the checksums inside a block are public
  functions; the tag is not);
* a valid block copied to another key does not open there (replay);
* the key id cannot be swapped, since it is authenticated too;
* the block's contents are encrypted at rest.

A reader that holds no key for the id, or finds an unsealed block where it requires sealed
ones, gets :class:`~s3kv.errors.AuthenticationError` with its own ``kind``; callers treat it
as a miss. Transit corruption fails the tag as well (kind ``forged``): only a second read can
tell the two apart, which is what ``s3kv verify`` does before deleting anything.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import threading
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from s3kv.auth.keyring import Keyring
from s3kv.errors import AuthenticationError, TruncatedError

MAGIC: Final = b"S3KA"
#: The magic of an unsealed block (:data:`s3kv.codec.MAGIC`).
PLAIN_MAGIC: Final = b"S3KV"
VERSION: Final = 1
ALG_AES256GCM: Final = 1
SALT_LEN: Final = 16
TAG_LEN: Final = 16
_NONCE: Final = bytes(12)
_LABEL: Final = b"s3kv/seal/v1"
_PREFIX = struct.Struct("<4sBBB")
#: Largest envelope overhead: header with a 32-byte id, plus the tag.
MAX_OVERHEAD: Final = _PREFIX.size + 32 + SALT_LEN + TAG_LEN

Buffer = bytes | bytearray | memoryview
_scratch = threading.local()


def is_sealed(blob: Buffer) -> bool:
    """Whether ``blob`` starts like a sealed block (nothing is verified)."""
    return bytes(memoryview(blob)[: len(MAGIC)]) == MAGIC


def sealed_key_id(blob: Buffer) -> str | None:
    """The key id a sealed block names, or None when ``blob`` is not a sealed block."""
    view = memoryview(blob).cast("B")
    if len(view) < _PREFIX.size or bytes(view[:4]) != MAGIC:
        return None
    _, _, _, id_len = _PREFIX.unpack_from(view)
    if len(view) < _PREFIX.size + id_len:
        return None
    return bytes(view[_PREFIX.size : _PREFIX.size + id_len]).decode("ascii", "replace")


def _object_cipher(secret: bytes, salt: bytes) -> AESGCM:
    return AESGCM(hmac.new(secret, _LABEL + salt, hashlib.sha256).digest())


def seal(inner: Buffer, *, object_key: str, keyring: Keyring) -> bytes:
    """Seal an encoded block for ``object_key`` with the keyring's sealing key.

    Returns:
        The sealed object: ``len(inner)`` + 39 + len(key id) bytes.
    """
    key_id = keyring.sealing_id.encode("ascii")
    salt = secrets.token_bytes(SALT_LEN)
    head = _PREFIX.pack(MAGIC, VERSION, ALG_AES256GCM, len(key_id)) + key_id + salt
    data = memoryview(inner).cast("B")
    out = bytearray(len(head) + len(data) + TAG_LEN)
    out[: len(head)] = head
    cipher = _object_cipher(keyring.secrets[keyring.sealing_id], salt)
    aad = head + object_key.encode("utf-8")
    cipher.encrypt_into(_NONCE, data, aad, memoryview(out)[len(head) :])
    return bytes(out)


def unseal(blob: Buffer, *, object_key: str, keyring: Keyring) -> memoryview:
    """Authenticate and decrypt a sealed block read from ``object_key``.

    Returns:
        The encoded block inside, in a per-thread scratch buffer: valid until this thread's
        next call (decode it before then). An unsealed block is returned as is when the
        keyring accepts unsigned blocks.

    Raises:
        AuthenticationError: kind ``unsigned`` (an unsealed block where sealed ones are
            required), ``unknown_key`` (sealed by a key this keyring does not hold) or
            ``forged`` (the tag does not verify: forged, replayed from another key, or
            corrupted in transit).
        TruncatedError: Shorter than any sealed block.
    """
    view = memoryview(blob).cast("B")
    if bytes(view[: len(MAGIC)]) != MAGIC:
        if keyring.accept_unsigned and bytes(view[: len(PLAIN_MAGIC)]) == PLAIN_MAGIC:
            return view
        raise AuthenticationError(
            f"{object_key}: not sealed, and auth_keys requires sealed blocks "
            "(written without auth_keys, or planted)",
            kind="unsigned",
        )
    if len(view) < _PREFIX.size:
        raise TruncatedError(f"{object_key}: a sealed block of {len(view)} bytes is truncated")
    _, version, algorithm, id_len = _PREFIX.unpack_from(view)
    head_len = _PREFIX.size + id_len + SALT_LEN
    if version != VERSION or algorithm != ALG_AES256GCM:
        raise AuthenticationError(
            f"{object_key}: sealed with envelope version {version}, algorithm {algorithm}; "
            f"this reader knows {VERSION}/{ALG_AES256GCM}",
            kind="unknown_key",
        )
    if len(view) < head_len + TAG_LEN:
        raise TruncatedError(f"{object_key}: a sealed block of {len(view)} bytes is truncated")
    key_id = bytes(view[_PREFIX.size : _PREFIX.size + id_len]).decode("ascii", "replace")
    secret = keyring.secret(key_id)
    if secret is None:
        raise AuthenticationError(
            f"{object_key}: sealed with key id {key_id!r}, which auth_keys does not list",
            kind="unknown_key",
        )
    head = bytes(view[:head_len])
    body = view[head_len:]
    plain = _scratch_view(len(body) - TAG_LEN)
    try:
        _object_cipher(secret, head[-SALT_LEN:]).decrypt_into(
            _NONCE, body, head + object_key.encode("utf-8"), plain
        )
    except InvalidTag:
        raise AuthenticationError(
            f"{object_key}: the seal does not verify (forged, copied from another key, or "
            "corrupted in transit)",
            kind="forged",
        ) from None
    return plain


def _scratch_view(size: int) -> memoryview:
    # NOTE: one growing buffer per I/O thread instead of a fresh one per block: a fresh
    # megabyte buffer costs its page faults on every block.
    buffer: bytearray | None = getattr(_scratch, "buffer", None)
    if buffer is None or len(buffer) < size:
        buffer = bytearray(max(size, 2 * len(buffer) if buffer else size))
        _scratch.buffer = buffer
    return memoryview(buffer)[:size]


__all__ = [
    "MAGIC",
    "MAX_OVERHEAD",
    "is_sealed",
    "seal",
    "sealed_key_id",
    "unseal",
]
