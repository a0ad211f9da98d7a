"""The keys that seal blocks: parsed from text, held in memory, never printed.

A key list is text, one key per line (blank lines and ``#`` comments ignored)::

    2026-11 3f0c...64 hex digits...
    2026-05 q83v...44 base64 characters (32 bytes)...

Each line is ``KEY_ID SECRET``: an id of 1-32 characters from ``[A-Za-z0-9._-]`` (it is
written into every sealed object, so it must never be secret) and a 32-byte secret as 64 hex
digits or base64. The **first** key seals new blocks; every listed key opens blocks. Rotation
is therefore: put the new key first and keep the old one below it until every block sealed
with the old one has been rewritten or pruned, then remove it.
"""

from __future__ import annotations

import base64
import binascii
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from s3kv.errors import ConfigError

#: Bytes of every secret (AES-256).
SECRET_LEN: Final = 32
_KEY_ID_RE: Final = re.compile(r"^[A-Za-z0-9._-]{1,32}$")


@dataclass(frozen=True, repr=False)
class Keyring:
    """Trusted keys by id, the one that seals, and whether unsealed blocks are still read.

    ``repr`` and ``str`` show the ids only, so a keyring in a log line or a traceback's locals
    never shows a secret.
    """

    secrets: Mapping[str, bytes] = field(compare=False)
    sealing_id: str
    accept_unsigned: bool = False

    def __post_init__(self) -> None:
        if self.sealing_id not in self.secrets:
            raise ValueError(f"sealing key {self.sealing_id!r} is not in the keyring")

    @property
    def key_ids(self) -> tuple[str, ...]:
        """Every trusted key id, the sealing one first."""
        return (self.sealing_id, *(k for k in self.secrets if k != self.sealing_id))

    def secret(self, key_id: str) -> bytes | None:
        """The secret of ``key_id``, or None when this keyring does not trust it."""
        return self.secrets.get(key_id)

    def __repr__(self) -> str:
        return f"Keyring(key_ids={self.key_ids!r}, accept_unsigned={self.accept_unsigned})"

    __str__ = __repr__


def parse_keys(text: str, *, source: str, accept_unsigned: bool = False) -> Keyring:
    """Parse a key list (see the module docstring).

    Args:
        text: The key list.
        source: Where it came from, for messages (``auth_keys (file /etc/s3kv/keys)``); the
            messages name lines by number and never quote a secret.
        accept_unsigned: Carried into the keyring.

    Raises:
        ConfigError: An empty list, a malformed line, a repeated id, or a secret that is not
            32 bytes.
    """
    keys: dict[str, bytes] = {}
    for number, text_line in enumerate(text.splitlines(), start=1):
        parts = text_line.split("#", 1)[0].split()
        if not parts:
            continue
        if len(parts) != 2:
            raise ConfigError(
                f"{source}: line {number} is not 'KEY_ID SECRET' (make one with `s3kv keys new`)"
            )
        key_id, encoded = parts
        if not _KEY_ID_RE.match(key_id):
            raise ConfigError(
                f"{source}: line {number}: key id must be 1-32 characters of A-Z a-z 0-9 . _ -"
            )
        if key_id in keys:
            raise ConfigError(f"{source}: line {number}: key id {key_id!r} is listed twice")
        keys[key_id] = _decode_secret(encoded, where=f"{source}: line {number}")
    if not keys:
        raise ConfigError(f"{source}: no keys listed (make one with `s3kv keys new`)")
    return Keyring(keys, next(iter(keys)), accept_unsigned)


def _decode_secret(encoded: str, *, where: str) -> bytes:
    secret: bytes | None = None
    if len(encoded) == 2 * SECRET_LEN:
        try:
            secret = bytes.fromhex(encoded)
        except ValueError:
            secret = None
    if secret is None:
        try:
            secret = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            secret = None
    if secret is None or len(secret) != SECRET_LEN:
        raise ConfigError(
            f"{where}: the secret must be {SECRET_LEN} bytes as 64 hex digits or base64 "
            "(make one with `s3kv keys new`)"
        )
    return secret


def new_key_line(key_id: str) -> str:
    """A fresh key list line ``KEY_ID SECRET`` (a random 32-byte secret in hex).

    Raises:
        ConfigError: ``key_id`` is not a valid id.
    """
    if not _KEY_ID_RE.match(key_id):
        raise ConfigError("key id must be 1-32 characters of A-Z a-z 0-9 . _ -")
    return f"{key_id} {secrets.token_hex(SECRET_LEN)}"


__all__ = ["SECRET_LEN", "Keyring", "new_key_line", "parse_keys"]
