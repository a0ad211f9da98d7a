"""Authenticated blocks: who may write what a reader will load.

Without keys, anyone who can write the bucket can plant a well-formed block under any key
(the checksums in a block are public functions), and an engine would load it. With the
``auth_keys`` setting, every block is sealed with AES-256-GCM under a secret the bucket never
sees, bound to its object key; a block that does not open is a miss and a metric.

    keyring = load_keyring("file:/etc/s3kv/keys")
    sealed = seal(encoded, object_key=key, keyring=keyring)
    encoded = unseal(sealed, object_key=key, keyring=keyring)

The format is in :mod:`s3kv.auth.envelope`, the key list and rotation in
:mod:`s3kv.auth.keyring`, the sources in :mod:`s3kv.auth.sources`.
"""

from s3kv.auth.envelope import MAX_OVERHEAD, is_sealed, seal, sealed_key_id, unseal
from s3kv.auth.keyring import Keyring, new_key_line, parse_keys
from s3kv.auth.sources import load_keyring

__all__ = [
    "MAX_OVERHEAD",
    "Keyring",
    "is_sealed",
    "load_keyring",
    "new_key_line",
    "parse_keys",
    "seal",
    "sealed_key_id",
    "unseal",
]
