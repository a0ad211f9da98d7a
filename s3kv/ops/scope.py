"""Which fingerprints and block objects an operator command acts on.

Layout (see :mod:`s3kv.keys`): ``<prefix>/<fingerprint>/blocks/<hh>/<hash>`` for blocks,
``<prefix>/<fingerprint>/manifest/...`` for the manifest and
``<prefix>/<fingerprint>/identity.json`` describing the model. A fingerprint is 32 lowercase
hex digits; anything else directly under the prefix (``.s3kv-probe/``, a user's files) is
not a fingerprint and is never touched.

Scope flags: ``--fingerprint`` names fingerprints exactly; ``--model`` matches the
``model_id`` of each fingerprint's ``identity.json`` (shell-style wildcards allowed). Both
narrow the scope; without either, every fingerprint under the prefix is in scope.

Tensor parallelism: the shards of a TP=N layout keep their blocks under their own *shard*
fingerprints but share one manifest, under the *layout* fingerprint
(:func:`~s3kv.keys.layout_fingerprint`). The layout's directory holds that manifest and an
``identity.json`` naming the shards (``"shard_fingerprints"``, rank order), and no blocks.
:func:`resolve_scope` works out, from the identities it reads anyway, where each
fingerprint's manifest is (:attr:`Fingerprint.manifest_fingerprint`) and which fingerprints
are layouts (:attr:`Fingerprint.shards`). A shard whose layout's ``identity.json`` is missing
(its write is best effort) is matched to its layout by recomputing the layout fingerprint
from the shards' identities, when that directory exists. With TP=1 the layout fingerprint
is the shard's own, and nothing differs.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from s3kv.errors import CodecError, ConfigError, KeyDerivationError, ObjectTooLargeError
from s3kv.keys import (
    BlockHash,
    ModelIdentity,
    block_key_head,
    identity_object_key,
    layout_fingerprint,
    parse_block_object_key,
)
from s3kv.manifest import UsageTable, load_usage
from s3kv.storage import Backend

__all__ = [
    "BlockObject",
    "Fingerprint",
    "blocks_prefix",
    "first_per_manifest",
    "list_blocks",
    "list_fingerprints",
    "load_usage_checked",
    "read_identity",
    "resolve_scope",
]

logger = logging.getLogger(__name__)

_FINGERPRINT_RE = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class Fingerprint:
    """One model fingerprint in the bucket.

    Three kinds (see the module docstring): a *plain* fingerprint (TP=1, or one no layout
    names) holds blocks and its own manifest; a TP *shard* holds blocks whose manifest is its
    layout's; a TP *layout* holds the shared manifest and no blocks.

    Attributes:
        fingerprint: The 32-hex-digit namespace.
        identity: The parsed ``identity.json`` (``None`` if absent or unreadable).
        manifest_fingerprint: Where the manifest describing this fingerprint's blocks lives:
            the layout's fingerprint for a shard, its own otherwise (the default).
        shards: For a layout, its shard fingerprints in rank order; ``()`` otherwise.
        manifest_shards: The fingerprints holding the blocks that manifest describes, in
            rank order: the layout's shards for a layout or a shard; ``(fingerprint,)`` for
            a plain fingerprint (the default).
    """

    fingerprint: str
    identity: Mapping[str, Any] | None = None
    manifest_fingerprint: str = ""
    shards: tuple[str, ...] = ()
    manifest_shards: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.manifest_fingerprint:
            object.__setattr__(self, "manifest_fingerprint", self.fingerprint)
        if not self.manifest_shards:
            own = self.shards or (self.fingerprint,)
            object.__setattr__(self, "manifest_shards", own)

    @property
    def is_layout(self) -> bool:
        """A TP layout: it holds the shared manifest of :attr:`shards`, and no blocks."""
        return bool(self.shards)

    @property
    def is_shard(self) -> bool:
        """A TP shard: its blocks' manifest is its layout's (:attr:`manifest_fingerprint`)."""
        return self.manifest_fingerprint != self.fingerprint

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
    return block_key_head(prefix, fingerprint)


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


#: Longest ``identity.json`` read; s3kv writes a few hundred bytes.
IDENTITY_MAX_BYTES = 1 << 20


def read_identity(backend: Backend, prefix: str, fingerprint: str) -> dict[str, Any] | None:
    """The fingerprint's ``identity.json``, or ``None`` if it is absent or not valid JSON.

    Raises:
        StorageError: the GET failed for a reason other than "not found".
    """
    try:
        data = backend.get(identity_object_key(prefix, fingerprint), max_bytes=IDENTITY_MAX_BYTES)
    except ObjectTooLargeError:
        return None  # NOTE: not an identity s3kv wrote (a few hundred bytes): not read
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
    """The fingerprints a command acts on, with their identities and manifests.

    One listing and one ``identity.json`` GET per fingerprint in scope; when
    ``fingerprints`` narrows the scope to a TP shard (or to an identity that cannot be read),
    the identities of the other fingerprints under the prefix are read too, to find its
    layout (:attr:`Fingerprint.manifest_fingerprint`).

    Args:
        backend: The bucket.
        prefix: The configured key prefix.
        fingerprints: Exact fingerprints (``--fingerprint``); empty for all.
        model: A ``model_id`` or shell pattern (``--model``); ``None`` for any.

    Raises:
        ConfigError: a malformed fingerprint, no fingerprint under ``prefix`` at all, or
            ``--model``/``--fingerprint`` matches nothing (the message lists what exists).
        StorageError: the bucket failed.
    """
    for fp in fingerprints:
        if not _FINGERPRINT_RE.fullmatch(fp):
            raise ConfigError(f"--fingerprint: {fp!r} is not 32 lowercase hex digits")
    present = everything = list_fingerprints(backend, prefix)
    if not everything:
        # NOTE: an error, not an empty success: a nightly job with a wrong prefix or bucket
        # must fail where someone sees it, not prune nothing forever.
        raise ConfigError(
            f"nothing in scope: no s3kv fingerprints under prefix {prefix!r} in "
            f"{backend.description}: check --prefix and --bucket (engines write "
            "<prefix>/<fingerprint>/...)"
        )
    if fingerprints:
        missing = sorted(set(fingerprints) - set(present))
        if missing:
            raise ConfigError(
                f"--fingerprint: no objects under {backend.description} for {missing[0]}; "
                f"present: {', '.join(present) or 'none'}"
            )
        present = [fp for fp in present if fp in set(fingerprints)]
    identities = {fp: read_identity(backend, prefix, fp) for fp in present}
    if fingerprints and any(_maybe_shard(ident) for ident in identities.values()):
        # NOTE: a shard's layout may be outside the scope: only the layout's identity says.
        identities |= {
            fp: read_identity(backend, prefix, fp) for fp in everything if fp not in identities
        }
    found = _with_manifests(present, identities, set(everything))
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


def _maybe_tp(identity: Mapping[str, Any] | None) -> bool:
    """``identity`` is a TP shard's or a layout's, or unknown (it may be either)."""
    if identity is None or "shard_fingerprints" in identity:
        return True
    size = identity.get("tp_size")
    return isinstance(size, int) and not isinstance(size, bool) and size > 1


def _maybe_shard(identity: Mapping[str, Any] | None) -> bool:
    """``identity`` is a TP shard's, or unknown (it may be one)."""
    return _maybe_tp(identity) and "shard_fingerprints" not in (identity or {})


def _declared_shards(fingerprint: str, identity: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The shards a layout's ``identity.json`` names (``()``: not a layout).

    A list naming the fingerprint itself is a TP=1 layout, which is that shard: not a layout.
    """
    named = (identity or {}).get("shard_fingerprints")
    if not isinstance(named, list) or not named:
        return ()
    if not all(isinstance(fp, str) and _FINGERPRINT_RE.fullmatch(fp) for fp in named):
        logger.warning("s3kv: identity.json of %s names malformed shards; ignoring", fingerprint)
        return ()
    return () if fingerprint in named else tuple(named)


def _identity_of(fingerprint: str, data: Mapping[str, Any]) -> ModelIdentity | None:
    """The :class:`~s3kv.keys.ModelIdentity` whose ``identity.json`` is ``data``, if its
    fingerprint is ``fingerprint`` (else ``None``: a newer format, a process-private one)."""
    if "shard_fingerprints" in data:
        return None
    try:
        values = dict(data)
        values["extra"] = tuple(tuple(pair) for pair in values.get("extra") or ())
        identity = ModelIdentity(**values)
    except (TypeError, ValueError, KeyDerivationError):
        return None
    if not identity.is_shareable:
        return None  # NOTE: fingerprint() of such an identity is random: never this one
    return identity if identity.fingerprint() == fingerprint else None


def _derived_layouts(
    identities: Mapping[str, Mapping[str, Any] | None], listed: set[str]
) -> dict[str, tuple[str, ...]]:
    """Layouts recomputed from the shards' identities: ``{layout fp: shards}``.

    Only layouts whose directory exists (it holds their manifest). For a layout whose
    ``identity.json`` is missing, so that its shards are not left without their manifest.
    """
    groups: dict[str, dict[int, tuple[str, ModelIdentity]]] = {}
    for fp, data in identities.items():
        if data is None or not _maybe_tp(data) or "shard_fingerprints" in data:
            continue
        identity = _identity_of(fp, data)
        if identity is None:
            continue
        common = {
            k: v for k, v in identity.as_dict().items() if k not in ("tp_rank", "block_elems")
        }
        ranks = groups.setdefault(json.dumps(common, sort_keys=True), {})
        ranks[identity.tp_rank] = (fp, identity)
    found: dict[str, tuple[str, ...]] = {}
    for ranks in groups.values():
        shards = [ranks[rank] for rank in sorted(ranks)]
        if len(shards) < 2 or len(shards) != shards[0][1].tp_size:
            continue
        try:
            layout = layout_fingerprint([identity for _, identity in shards])
        except KeyDerivationError:
            continue
        if layout in listed:
            found[layout] = tuple(fp for fp, _ in shards)
    return found


def _with_manifests(
    present: Sequence[str],
    identities: Mapping[str, Mapping[str, Any] | None],
    listed: set[str],
) -> list[Fingerprint]:
    """The :class:`Fingerprint` of each of ``present``, with its manifest resolved."""
    layouts = {
        fp: shards for fp, data in identities.items() if (shards := _declared_shards(fp, data))
    }
    if any(_maybe_tp(data) for data in identities.values()):
        described = {shard for shards in layouts.values() for shard in shards}
        for layout, shards in _derived_layouts(identities, listed).items():
            if layout not in layouts and not described & set(shards):
                logger.warning(
                    "s3kv: layout %s has no identity.json; its shards are %s",
                    layout,
                    ", ".join(shards),
                )
                layouts[layout] = shards
    manifest_of: dict[str, str] = {}
    for layout in sorted(layouts):
        for shard in layouts[layout]:
            if manifest_of.setdefault(shard, layout) != layout:
                logger.warning(
                    "s3kv: %s is a shard of layouts %s and %s; using the manifest of %s",
                    shard,
                    manifest_of[shard],
                    layout,
                    manifest_of[shard],
                )
    found = []
    for fp in present:
        if fp in layouts:
            found.append(Fingerprint(fp, identities.get(fp), fp, layouts[fp], layouts[fp]))
        elif (owner := manifest_of.get(fp)) is not None:
            found.append(Fingerprint(fp, identities.get(fp), owner, (), layouts[owner]))
        else:
            found.append(Fingerprint(fp, identities.get(fp)))
    return found


def first_per_manifest(scope: Sequence[Fingerprint]) -> list[Fingerprint]:
    """The first fingerprint of ``scope`` using each manifest, in order (a TP layout's
    shards share one manifest: work on a manifest is done once)."""
    first: dict[str, Fingerprint] = {}
    for fp in scope:
        first.setdefault(fp.manifest_fingerprint, fp)
    return list(first.values())


def load_usage_checked(
    backend: Backend, prefix: str, fingerprint: str, *, then: str = ""
) -> UsageTable:
    """:func:`~s3kv.manifest.load_usage`, with an unreadable snapshot told as one fix.

    Raises:
        CodecError: the snapshot is unreadable; the message names ``s3kv compact --full``
            (followed by ``then``, e.g. ``", then prune"``).
        StorageError: the bucket failed.
    """
    try:
        return load_usage(backend, prefix, fingerprint)
    except CodecError as exc:
        raise CodecError(
            f"the manifest snapshot of {fingerprint} is unreadable ({exc}): rebuild it with "
            f"`s3kv compact --full --fingerprint {fingerprint}`{then}"
        ) from exc
