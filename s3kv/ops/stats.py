"""Stats: per-fingerprint objects, bytes, compression, usage histograms and a cost estimate.

Where each figure comes from:

* **objects and bytes by kind** — one listing of everything under ``<prefix>/<fp>/``,
  each object counted under one of :data:`KINDS`: ``blocks`` (``blocks/<hh>/<hash>``),
  ``segments`` (``manifest/segments/``), ``log`` (``manifest/log/`` entries and the
  ``LATEST``/format-1 ``CURRENT`` pointers), ``deltas`` (``manifest/deltas/``),
  ``snapshots`` (``manifest/snapshots/``: sharded filter/usage objects, and format 1's
  ``<gen>/bloom.bin``/``usage.bin``), ``identity`` (``identity.json``) and ``other``
  (anything else, e.g. a non-block key under ``blocks/``). Layout:
  ``s3kv/manifest/README.md``.
* **block objects, stored bytes, ages** — the ``blocks`` kind (sizes and ``LastModified``).
* **raw bytes** — every block of a fingerprint has the same raw size, so when its
  ``identity.json`` gives the geometry (``num_layers × kv_factor × block_elems ×
  itemsize(kv_dtype)``) raw bytes are exact (``raw_source="identity"``). Otherwise the
  headers of up to ``sample`` objects are read (``codec.read_header``: one GET each) and
  their raw/stored ratio is applied to the stored bytes (``"sampled N headers"``).
* **age** — now minus the manifest's first write, else ``LastModified``.
* **last use** — the later of the manifest's last write/hit and ``LastModified`` (as prune
  decides), so the histogram shows what ``prune --older-than`` would remove.
* **hits, pins** — the manifest's usage table (snapshot plus newer segments). Usage figures
  (hits, pins, manifest keys, last use, age, unmanifested, requests) come from the manifest
  that describes the fingerprint's blocks: a TP shard's is its layout's
  (:attr:`~s3kv.ops.scope.Fingerprint.manifest_fingerprint`), so each shard of a layout
  shows the layout's hits and pins. A layout's own entry has no blocks: it shows its
  manifest's keys, hits and pins and the objects under it, and no request cost (its shards
  carry it, each for its own objects).
* **monthly cost** — storage: the bytes of *every* kind × the price per GiB-month (per kind
  and in total: manifest snapshots can outweigh the blocks). Requests, over 30
  days: PUTs = blocks first written in the last 30 days; GETs = each block's hits scaled to
  30 days at its average rate since its first write (hits are cumulative per key).
  Defaults are AWS S3 Standard in us-east-1 (:class:`PriceTable`); pass your own table.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from s3kv.errors import CodecError, ConfigError, ObjectTooLargeError
from s3kv.keys import fingerprint_prefix, parse_block_object_key
from s3kv.manifest import USAGE_DTYPE, UsageTable, load_usage
from s3kv.ops import ProgressFn, no_progress
from s3kv.ops.scope import BlockObject, Fingerprint
from s3kv.storage import Backend

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "AGE_BUCKETS",
    "KINDS",
    "FingerprintStats",
    "KindStats",
    "PriceTable",
    "StatsReport",
    "classify",
    "collect_stats",
]

#: Histogram buckets: (label, upper bound in seconds, exclusive).
AGE_BUCKETS: tuple[tuple[str, float], ...] = (
    ("<1h", 3600.0),
    ("<1d", 86400.0),
    ("<7d", 7 * 86400.0),
    ("<30d", 30 * 86400.0),
    (">=30d", math.inf),
)
_MONTH_S = 30 * 86400.0
_GIB = 1024**3

#: The kinds of object s3kv writes under a fingerprint (see the module docstring).
KINDS: tuple[str, ...] = (
    "blocks",
    "segments",
    "log",
    "deltas",
    "snapshots",
    "identity",
    "other",
)
# NOTE: the manifest's directory names (s3kv/manifest/README.md); its front does not export
# them, so they are repeated here.
_MANIFEST_KINDS: tuple[tuple[str, str], ...] = (
    ("segments/", "segments"),
    ("log/", "log"),
    ("deltas/", "deltas"),
    ("snapshots/", "snapshots"),
)
_MANIFEST_POINTERS = frozenset({"LATEST", "CURRENT"})


def classify(relative: str) -> str:
    """The :data:`KINDS` entry of a key relative to ``<prefix>/<fp>/``.

    A key under ``blocks/`` is ``"blocks"`` here whatever its shape; :func:`collect_stats`
    counts those that are not block keys as ``"other"``.
    """
    if relative.startswith("blocks/"):
        return "blocks"
    if relative == "identity.json":
        return "identity"
    if relative.startswith("manifest/"):
        rest = relative[len("manifest/") :]
        if rest in _MANIFEST_POINTERS:
            return "log"
        for directory, kind in _MANIFEST_KINDS:
            if rest.startswith(directory):
                return kind
    return "other"


@dataclass(frozen=True, kw_only=True)
class PriceTable:
    """Prices for the cost estimate, in USD. Defaults: AWS S3 Standard, us-east-1.

    A table file (``--prices FILE``, TOML or JSON) sets any of these fields.

    Attributes:
        name: What the prices are (shown in reports).
        storage_per_gib_month: Storage per GiB-month (AWS bills "GB" = GiB).
        put_per_1000: PUT/COPY/POST/LIST requests, per 1000.
        get_per_1000: GET/HEAD requests, per 1000.
    """

    name: str = "AWS S3 Standard, us-east-1"
    storage_per_gib_month: float = 0.023
    put_per_1000: float = 0.005
    get_per_1000: float = 0.0004

    @classmethod
    def from_file(cls, path: str | Path) -> PriceTable:
        """Read a price table (TOML or JSON; unknown or non-numeric fields are errors).

        Raises:
            ConfigError: unreadable file, bad syntax, unknown field or bad value.
        """
        where = f"--prices {path}"
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read it ({exc.strerror})") from exc
        try:
            data: Any = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
        except (ValueError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{where}: not valid TOML/JSON ({exc})") from exc
        known = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) - known:
            extra = sorted(set(data) - known) if isinstance(data, dict) else ["<not a table>"]
            raise ConfigError(f"{where}: unknown field {extra[0]!r}; known: {sorted(known)}")
        for name, value in data.items():
            ok = isinstance(value, str) if name == "name" else _non_negative(value)
            if not ok:
                raise ConfigError(f"{where}: {name} has a bad value {value!r}")
        return cls(**data)


def _non_negative(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class KindStats:
    """Objects of one kind (:data:`KINDS`) and what storing them costs.

    Attributes:
        objects: Objects listed.
        bytes: Their stored bytes.
        storage_usd_month: Estimated storage cost per month.
    """

    objects: int
    bytes: int
    storage_usd_month: float


def _kind_stats(objects: int, size: int, prices: PriceTable) -> KindStats:
    return KindStats(objects, size, size / _GIB * prices.storage_per_gib_month)


@dataclass(frozen=True)
class FingerprintStats:
    """Stats of one fingerprint (see the module docstring for sources).

    Attributes:
        fingerprint: The fingerprint.
        model: Its ``model_id``, if known.
        objects: Block objects listed (``kinds["blocks"]``).
        stored_bytes: Their stored bytes.
        raw_bytes: Decoded bytes (``None`` if unknown).
        raw_source: ``"identity"``, ``"sampled N headers"`` or ``"unknown"``.
        ratio: raw / stored (``None`` if unknown).
        age: Objects per :data:`AGE_BUCKETS` label, by age.
        last_use: Objects per label, by time since last use.
        hits: Hits recorded in the manifest.
        pins: Pinned blocks.
        manifest_keys: Live keys in the manifest.
        unmanifested: Objects the manifest does not list.
        foreign: Objects under ``blocks/`` that are not block keys.
        manifest_error: Why the manifest could not be read (its figures are then 0).
        manifest_fingerprint: The manifest the usage figures come from (a TP shard's is its
            layout's).
        storage_usd_month: Estimated storage cost per month, every kind.
        requests_usd_month: Estimated request cost per month.
        kinds: Objects, bytes and storage cost per :data:`KINDS` entry (every kind present).
        total_objects: Objects of every kind.
        total_bytes: Bytes of every kind.
        snapshot_generations: Manifest snapshots stored (``snapshots/<name>/`` directories;
            one or two are live, older ones await deletion).
    """

    fingerprint: str
    model: str | None
    objects: int
    stored_bytes: int
    raw_bytes: int | None
    raw_source: str
    ratio: float | None
    age: dict[str, int]
    last_use: dict[str, int]
    hits: int
    pins: int
    manifest_keys: int
    unmanifested: int
    foreign: int
    manifest_error: str | None
    storage_usd_month: float
    requests_usd_month: float
    kinds: dict[str, KindStats]
    total_objects: int
    total_bytes: int
    snapshot_generations: int
    manifest_fingerprint: str = ""

    def __post_init__(self) -> None:
        if not self.manifest_fingerprint:
            object.__setattr__(self, "manifest_fingerprint", self.fingerprint)


@dataclass(frozen=True)
class StatsReport:
    """Stats of every fingerprint in scope, with the prices used.

    Attributes:
        now: Epoch seconds the stats refer to.
        prices: The price table.
        fingerprints: One entry per fingerprint.
    """

    now: float
    prices: PriceTable
    fingerprints: tuple[FingerprintStats, ...]

    @property
    def objects(self) -> int:
        """Block objects, all fingerprints."""
        return sum(fp.objects for fp in self.fingerprints)

    @property
    def stored_bytes(self) -> int:
        """Bytes of block objects, all fingerprints."""
        return sum(fp.stored_bytes for fp in self.fingerprints)

    @property
    def total_objects(self) -> int:
        """Objects of every kind, all fingerprints."""
        return sum(fp.total_objects for fp in self.fingerprints)

    @property
    def total_bytes(self) -> int:
        """Bytes of every kind, all fingerprints."""
        return sum(fp.total_bytes for fp in self.fingerprints)

    @property
    def kinds(self) -> dict[str, KindStats]:
        """Objects, bytes and storage cost per kind, all fingerprints (every kind)."""
        return {
            kind: _kind_stats(
                sum(fp.kinds[kind].objects for fp in self.fingerprints),
                sum(fp.kinds[kind].bytes for fp in self.fingerprints),
                self.prices,
            )
            for kind in KINDS
        }

    @property
    def storage_usd_month(self) -> float:
        """Estimated storage cost per month, every kind, all fingerprints."""
        return sum(fp.storage_usd_month for fp in self.fingerprints)

    @property
    def requests_usd_month(self) -> float:
        """Estimated request cost per month, all fingerprints."""
        return sum(fp.requests_usd_month for fp in self.fingerprints)

    @property
    def usd_month(self) -> float:
        """Estimated storage plus request cost per month, all fingerprints."""
        return self.storage_usd_month + self.requests_usd_month


def collect_stats(
    backend: Backend,
    scope: Sequence[Fingerprint],
    *,
    prefix: str,
    prices: PriceTable | None = None,
    sample: int = 8,
    clock: Callable[[], float] = time.time,
    progress: ProgressFn = no_progress,
) -> StatsReport:
    """Compute :class:`FingerprintStats` for each fingerprint in ``scope``. Reads only.

    Args:
        backend: The bucket.
        scope: The fingerprints (:func:`~s3kv.ops.scope.resolve_scope`).
        prefix: The configured key prefix.
        prices: Price table; default :class:`PriceTable` (AWS S3 Standard).
        sample: Headers to read per fingerprint when its identity does not give raw sizes.
        clock: Epoch seconds.
        progress: Called with ``("stats <fp>", objects listed, None)`` (every kind).

    Raises:
        StorageError: the bucket failed.
    """
    table = prices or PriceTable()
    now = clock()
    usages: dict[str, tuple[UsageTable, str | None]] = {}  # a layout's shards share one
    results = [_one(backend, prefix, fp, table, sample, now, progress, usages) for fp in scope]
    return StatsReport(now=now, prices=table, fingerprints=tuple(results))


def _one(
    backend: Backend,
    prefix: str,
    fp: Fingerprint,
    prices: PriceTable,
    sample: int,
    now: float,
    progress: ProgressFn,
    usages: dict[str, tuple[UsageTable, str | None]],
) -> FingerprintStats:
    if fp.manifest_fingerprint not in usages:
        try:
            usages[fp.manifest_fingerprint] = (
                load_usage(backend, prefix, fp.manifest_fingerprint),
                None,
            )
        except CodecError as exc:
            error = f"{exc} (rebuild with `s3kv compact --full`)"
            usages[fp.manifest_fingerprint] = (UsageTable(np.zeros(0, USAGE_DTYPE)), error)
    usage, manifest_error = usages[fp.manifest_fingerprint]
    rows = usage.rows
    keys: list[bytes] = rows["key"].tolist()
    first = dict(zip(keys, rows["first_written"].tolist(), strict=True))
    used = dict(zip(keys, rows["last_used"].tolist(), strict=True))
    phase = f"stats {fp.fingerprint[:8]}"
    base = fingerprint_prefix(prefix, fp.fingerprint)
    objects: list[BlockObject] = []
    counts = dict.fromkeys(KINDS, 0)
    sizes = dict.fromkeys(KINDS, 0)
    generations: set[str] = set()
    for count, info in enumerate(backend.list(base), start=1):
        relative = info.key[len(base) :]
        kind = classify(relative)
        if kind == "blocks":
            parsed = parse_block_object_key(prefix, info.key)
            block = parsed[1] if parsed is not None and parsed[0] == fp.fingerprint else None
            objects.append(BlockObject(info.key, block, info.size, info.last_modified))
            kind = "blocks" if block is not None else "other"
        elif kind == "snapshots":
            parts = relative.split("/")  # manifest/snapshots/<name>/<object>
            if len(parts) > 3:
                generations.add(parts[2])
        counts[kind] += 1
        sizes[kind] += info.size
        if count % 1000 == 0:
            progress(phase, count, None)
    blocks = [o for o in objects if o.block is not None]
    stored = sum(o.size for o in blocks)
    age = _histogram(now - first.get(o.block, o.last_modified) for o in blocks if o.block)
    last_use = _histogram(
        now - max(o.last_modified, used.get(o.block, 0.0)) for o in blocks if o.block
    )
    kinds = {kind: _kind_stats(counts[kind], sizes[kind], prices) for kind in KINDS}
    raw, source = _raw_bytes(backend, fp, blocks, sample)
    hits = int(rows["hits"].sum())
    puts = gets = 0.0
    if not fp.is_layout:  # NOTE: a layout's blocks are its shards': they count them
        puts = sum(1 for t in rows["first_written"].tolist() if now - t < _MONTH_S)
        gets = sum(
            h * _MONTH_S / max(_MONTH_S, now - t)
            for h, t in zip(rows["hits"].tolist(), rows["first_written"].tolist(), strict=True)
        )
    return FingerprintStats(
        fingerprint=fp.fingerprint,
        model=fp.model,
        objects=len(blocks),
        stored_bytes=stored,
        raw_bytes=raw,
        raw_source=source,
        ratio=None if raw is None or not stored else raw / stored,
        age=age,
        last_use=last_use,
        hits=hits,
        pins=int(rows["pinned"].sum()),
        manifest_keys=len(rows),
        unmanifested=sum(1 for o in blocks if o.block not in first),
        foreign=len(objects) - len(blocks),
        manifest_error=manifest_error,
        storage_usd_month=sum(k.storage_usd_month for k in kinds.values()),
        requests_usd_month=puts / 1000 * prices.put_per_1000 + gets / 1000 * prices.get_per_1000,
        kinds=kinds,
        total_objects=sum(counts.values()),
        total_bytes=sum(sizes.values()),
        snapshot_generations=len(generations),
        manifest_fingerprint=fp.manifest_fingerprint,
    )


def _histogram(ages: Iterable[float]) -> dict[str, int]:
    counts = dict.fromkeys((label for label, _ in AGE_BUCKETS), 0)
    for age in ages:
        for label, bound in AGE_BUCKETS:
            if age < bound:
                counts[label] += 1
                break
    return counts


#: Largest object whose header ``stats`` samples.
SAMPLE_MAX_BYTES = 256 << 20


def _raw_bytes(
    backend: Backend, fp: Fingerprint, blocks: list[BlockObject], sample: int
) -> tuple[int | None, str]:
    per_block = fp.raw_block_bytes
    if per_block is not None:
        return per_block * len(blocks), "identity"
    if not blocks or sample <= 0:
        return None, "unknown"
    from s3kv.codec import read_header

    step = max(1, len(blocks) // sample)
    raw = stored = 0
    read = 0
    for obj in blocks[::step][:sample]:
        if obj.size > SAMPLE_MAX_BYTES:
            continue  # NOTE: no block is this large; junk is not read to learn that
        try:
            data = backend.get(obj.key, max_bytes=max(obj.size, 1))
        except ObjectTooLargeError:
            continue  # rewritten larger since the listing
        if data is None:
            continue  # deleted since the listing
        try:
            header = read_header(data)
        except CodecError:
            continue  # corrupt: `s3kv verify` reports it
        raw, stored, read = raw + header.raw_len, stored + len(data), read + 1
    if not read or not stored:
        return None, "unknown"
    total_stored = sum(o.size for o in blocks)
    return round(total_stored * raw / stored), f"sampled {read} headers"
