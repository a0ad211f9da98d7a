"""Which fingerprints and block objects an operator command acts on.

Layout (see :mod:`s3kv.keys`): ``<prefix>/<fingerprint>/blocks/<hh>/<hash>`` for blocks,
``<prefix>/<fingerprint>/manifest/...`` for the manifest and
``<prefix>/<fingerprint>/identity.json`` describing the model. A fingerprint is 32 lowercase
hex digits; anything else directly under the prefix (``.s3kv-probe/``, a user's files) is
not a fingerprint and is never touched.

Scope flags: ``--fingerprint`` names fingerprints exactly; ``--model`` matches the
``model_id`` of each fingerprint's ``identity.json`` (shell-style wildcards allowed). Both
narrow the scope; without either, every fingerprint under the prefix is in scope.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from s3kv.errors import ConfigError
from s3kv.keys import (
    BlockHash,
    fingerprint_prefix,
    identity_object_key,
    parse_block_object_key,
)
from s3kv.storage import Backend

__all__ = [
    "BlockObject",
    "Fingerprint",
    "blocks_prefix",
    "list_blocks",
    "list_fingerprints",
    "read_identity",
    "resolve_scope",
]

logger = logging.getLogger(__name__)

_FINGERPRINT_RE = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class Fingerprint:
    """One model fingerprint in the bucket.

    Attributes:
        fingerprint: The 32-hex-digit namespace.
        identity: The parsed ``identity.json`` (``None`` if absent or unreadable).
    """

    fingerprint: str
    identity: Mapping[str, Any] | None = None

    @property
    def model(self) -> str | None:
        """The identity's ``model_id``, if known."""
        value = (self.identity or {}).get("model_id")
        return str(value) if value is not None else None

    @property
    def tokens_per_block(self) -> int | None:
        """The identity's ``tokens_per_block``, if known."""
        value = (self.identity or {}).get("tokens_per_block")
        return int(value) if isinstance(value, int) else None

    @property
    def raw_block_bytes(self) -> int | None:
        """Raw (decoded) bytes of every block, from the identity's geometry; ``None`` if unknown."""
        from s3kv.codec import DType

        ident = self.identity or {}
        dims = [ident.get(name) for name in ("num_layers", "kv_factor", "block_elems")]
        ints = [d for d in dims if isinstance(d, int) and not isinstance(d, bool) and d > 0]
        try:
            itemsize = DType(str(ident.get("kv_dtype"))).itemsize
        except ValueError:
            return None
        return ints[0] * ints[1] * ints[2] * itemsize if len(ints) == 3 else None


@dataclass(frozen=True)
class BlockObject:
    """One object under a fingerprint's ``blocks/`` directory.

    Attributes:
        key: The full object key.
        block: The block hash its key encodes, or ``None`` for a key that is not a block key
            (a foreign object: never deleted by prune, reported by verify).
        size: Stored bytes.
        last_modified: Epoch seconds.
    """

    key: str
    block: BlockHash | None
    size: int
    last_modified: float


def blocks_prefix(prefix: str, fingerprint: str) -> str:
    """The key prefix (ending in ``/``) of one fingerprint's block objects."""
    return fingerprint_prefix(prefix, fingerprint) + "blocks/"


def list_blocks(backend: Backend, prefix: str, fingerprint: str) -> Iterator[BlockObject]:
    """Every object under ``<prefix>/<fingerprint>/blocks/``, in key order.

    Raises:
        StorageError: a listing request failed.
    """
    for info in backend.list(blocks_prefix(prefix, fingerprint)):
        parsed = parse_block_object_key(prefix, info.key)
        block = parsed[1] if parsed is not None and parsed[0] == fingerprint else None
        yield BlockObject(info.key, block, info.size, info.last_modified)


def list_fingerprints(backend: Backend, prefix: str) -> list[str]:
    """The fingerprints that have any object under ``prefix``, sorted.

    One :meth:`~s3kv.storage.Backend.list_dirs` (on S3 a delimiter listing: one request
    per 1000 fingerprints).

    Raises:
        StorageError: a listing request failed.
    """
    base = prefix.strip("/") + "/" if prefix.strip("/") else ""
    return sorted(name for name in backend.list_dirs(base) if _FINGERPRINT_RE.fullmatch(name))


def read_identity(backend: Backend, prefix: str, fingerprint: str) -> dict[str, Any] | None:
    """The fingerprint's ``identity.json``, or ``None`` if it is absent or not valid JSON.

    Raises:
        StorageError: the GET failed for a reason other than "not found".
    """
    data = backend.get(identity_object_key(prefix, fingerprint))
    if data is None:
        return None
    try:
        parsed = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        logger.warning("s3kv: identity.json of %s is not valid JSON; ignoring it", fingerprint)
        return None
    return parsed if isinstance(parsed, dict) else None


def resolve_scope(
    backend: Backend,
    prefix: str,
    *,
    fingerprints: Sequence[str] = (),
    model: str | None = None,
) -> list[Fingerprint]:
    """The fingerprints a command acts on, with their identities.

    Args:
        backend: The bucket.
        prefix: The configured key prefix.
        fingerprints: Exact fingerprints (``--fingerprint``); empty for all.
        model: A ``model_id`` or shell pattern (``--model``); ``None`` for any.

    Raises:
        ConfigError: a malformed fingerprint, or ``--model``/``--fingerprint`` matches nothing
            (the message lists what exists).
        StorageError: the bucket failed.
    """
    for fp in fingerprints:
        if not _FINGERPRINT_RE.fullmatch(fp):
            raise ConfigError(f"--fingerprint: {fp!r} is not 32 lowercase hex digits")
    present = list_fingerprints(backend, prefix)
    if fingerprints:
        missing = sorted(set(fingerprints) - set(present))
        if missing:
            raise ConfigError(
                f"--fingerprint: no objects under {backend.description} for {missing[0]}; "
                f"present: {', '.join(present) or 'none'}"
            )
        present = [fp for fp in present if fp in set(fingerprints)]
    found = [Fingerprint(fp, read_identity(backend, prefix, fp)) for fp in present]
    if model is None:
        return found
    matched = [fp for fp in found if fp.model is not None and fnmatch.fnmatchcase(fp.model, model)]
    if not matched:
        models = sorted({fp.model for fp in found if fp.model is not None})
        raise ConfigError(
            f"--model: no fingerprint under {backend.description} has model {model!r}; "
            f"known models: {', '.join(models) or 'none'}"
        )
    return matched
