"""The manifest log: numbered, immutable entries that say what the manifest is now.

Each entry ``log/<20-digit version>.json`` names the live snapshot (sharded filter and usage
objects), the deltas published since it (at most ``max_deltas``), the compactor holding
the lease, and the segments that this version folded. Entries are created only with a
conditional PUT (If-None-Match: ``*``): exactly one writer can create version ``V + 1``,
which is at once the lease, the fencing token and the publication (the design Delta Lake
uses for its transaction log, with the checkpoint folded into the entry itself). ``LATEST``
is a hint holding the newest version number; it is overwritten after each entry and may
lag, so readers probe forward from it.

A reader's steady-state refresh is one GET of ``log/<V + 1>`` (absent: nothing changed),
whatever the number of writers.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field, replace
from typing import Any, Final

from s3kv.errors import CodecError, StorageError, UnsupportedVersionError
from s3kv.manifest.format import JSON_ERRORS
from s3kv.manifest.io import ManifestIO

__all__ = [
    "LATEST_NAME",
    "LOG_DIR",
    "LOG_FORMAT",
    "MAX_ENTRY_BYTES",
    "MAX_HINT_BYTES",
    "DeltaRef",
    "LogEntry",
    "ManifestLog",
    "SnapshotRef",
    "log_name",
    "log_version",
]

LOG_FORMAT: Final = 2
LOG_DIR: Final = "log/"
LATEST_NAME: Final = "LATEST"
#: Corrupt entries at the tip a reader walks back over before giving up.
_WALK_BACK: Final = 8
#: Forward probes from the hint before a reader lists the log instead.
_PROBES: Final = 3
_LOG_RE: Final = re.compile(r"^(\d{20})\.json$")
_PATH_RE: Final = re.compile(r"^(snapshots|deltas)/[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)?$")
#: Bounds a hostile or corrupt entry cannot pass (versions, leases, shard sizes, widths).
_MAX_VERSION: Final = 10**18
_MAX_LEASE_S: Final = 7 * 86400.0
_MAX_SHARD_KEYS: Final = 1 << 32
_FP_BITS: Final = frozenset({8, 16, 24, 32})
#: An entry is small: a few KB, plus a cycle's folded segment names (at most 20k of at
#: most 90 bytes: 1.8 MB) and its shard key counts (at most 65536: 0.8 MB). Refused before
#: parsing: NOTE: json.loads makes ~10x its input in Python objects, so this bounds a
#: hostile entry's cost to ~200 MB (64 MiB allowed ~1 GB).
MAX_ENTRY_BYTES: Final = 16 * 1024 * 1024
#: ``LATEST`` is ``{"version": N}``; a longer one is not a hint.
MAX_HINT_BYTES: Final = 4096


def log_name(version: int) -> str:
    """``log/<20-digit version>.json`` (relative to the manifest prefix)."""
    return f"{LOG_DIR}{version:020d}.json"


def log_version(name: str) -> int | None:
    """The version of a name under ``log/`` (relative to ``log/``), or ``None``."""
    match = _LOG_RE.fullmatch(name)
    return None if match is None else int(match.group(1))


def _path(value: object, what: str) -> str:
    path = str(value)
    if not _PATH_RE.fullmatch(path) or ".." in path:
        raise CodecError(f"log entry: bad {what} path {path!r}")
    return path


@dataclass(frozen=True)
class SnapshotRef:
    """One snapshot: ``2**shard_bits`` shards, each a filter and a usage object.

    Keys are assigned to shards by their leading ``shard_bits`` bits, so a lookup needs
    one shard and folding, warm-start planning and prune can stream shard by shard.

    Attributes:
        path: Directory of the shard objects (``snapshots/<version>-<token>``).
        generation: Ordinal of this snapshot (1 for the first one ever written).
        shard_bits: log2 of the shard count.
        shard_keys: Live keys per shard.
        fp_bits: Fingerprint bits of the shard filters (false-positive rate ``2**-fp_bits``).
        created_at: Epoch seconds when it was written.
    """

    path: str
    generation: int
    shard_bits: int
    shard_keys: tuple[int, ...]
    fp_bits: int
    created_at: float

    @property
    def keys(self) -> int:
        """Live keys in the snapshot."""
        return sum(self.shard_keys)

    def filter_path(self, shard: int) -> str:
        """Path of shard ``shard``'s filter object."""
        return f"{self.path}/filter-{shard:05d}.bin"

    def usage_path(self, shard: int) -> str:
        """Path of shard ``shard``'s usage object."""
        return f"{self.path}/usage-{shard:05d}.bin"

    def paths(self) -> list[str]:
        """Every object of the snapshot."""
        shards = range(len(self.shard_keys))
        return [p for s in shards for p in (self.filter_path(s), self.usage_path(s))]


@dataclass(frozen=True)
class DeltaRef:
    """One delta: coalesced records folded from segments since the snapshot.

    Attributes:
        path: Object path (``deltas/<version>-<token>.delta``).
        records: Records it holds.
        writes: Write records among them (keys readers add to their filters).
        merged: It merges the deltas before it (a reader that applied them skips it).
    """

    path: str
    records: int
    writes: int
    merged: bool = False


@dataclass(frozen=True)
class LogEntry:
    """One version of the manifest.

    Attributes:
        version: Its number (1 for the first entry).
        holder: Instance id of the compactor holding the lease ("" when released).
        token: Random token of the holder's term (names its objects, so no two terms collide).
        lease_s: Readers may take the lease over when no newer entry appeared for this long.
        snapshot: The live snapshot, or ``None`` before the first one.
        deltas: Deltas since the snapshot, oldest first.
        folded: Segments folded by this version (deleted once it is published).
        created_at: Epoch seconds (writer's clock; informational).
        format: Log format version.
    """

    version: int
    holder: str
    token: str
    lease_s: float
    snapshot: SnapshotRef | None
    deltas: tuple[DeltaRef, ...] = ()
    folded: tuple[str, ...] = field(default=())
    created_at: float = 0.0
    format: int = LOG_FORMAT

    @property
    def delta_records(self) -> int:
        """Records held by the deltas."""
        return sum(delta.records for delta in self.deltas)

    def next(self, **changes: Any) -> LogEntry:
        """The entry ``version + 1`` with ``changes`` applied (``folded`` reset)."""
        return replace(self, **{"version": self.version + 1, "folded": (), **changes})

    def objects(self) -> set[str]:
        """Paths of every snapshot and delta object this entry references."""
        found = {delta.path for delta in self.deltas}
        if self.snapshot is not None:
            found.update(self.snapshot.paths())
        return found

    def to_json(self) -> bytes:
        """Compact JSON, keys sorted."""
        snapshot = None
        if self.snapshot is not None:
            snapshot = {
                "path": self.snapshot.path,
                "generation": self.snapshot.generation,
                "shard_bits": self.snapshot.shard_bits,
                "shard_keys": list(self.snapshot.shard_keys),
                "fp_bits": self.snapshot.fp_bits,
                "created_at": self.snapshot.created_at,
            }
        payload = {
            "format": self.format,
            "version": self.version,
            "holder": self.holder,
            "token": self.token,
            "lease_s": self.lease_s,
            "snapshot": snapshot,
            "deltas": [[d.path, d.records, d.writes, d.merged] for d in self.deltas],
            "folded": list(self.folded),
            "created_at": self.created_at,
        }
        return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes) -> LogEntry:
        """Parse and validate an entry.

        Raises:
            UnsupportedVersionError: an entry of another format.
            CodecError: not a valid entry.
        """
        if len(data) > MAX_ENTRY_BYTES:
            raise CodecError(
                f"log entry: {len(data)} bytes is over the {MAX_ENTRY_BYTES}-byte bound"
            )
        try:
            payload = json.loads(data.decode("utf-8"))
            if not isinstance(payload, dict):
                raise TypeError("not an object")
            version = int(payload.get("format", -1))
            if version != LOG_FORMAT:
                raise UnsupportedVersionError(f"log entry: format {version}, expected 2")
            raw = payload["snapshot"]
            snapshot = None
            if raw is not None:
                shard_bits = int(raw["shard_bits"])
                shard_keys = tuple(int(n) for n in raw["shard_keys"])
                if not 0 <= shard_bits <= 16 or len(shard_keys) != 1 << shard_bits:
                    raise ValueError(f"{len(shard_keys)} shards for shard_bits={shard_bits}")
                if any(n < 0 for n in shard_keys):
                    raise ValueError("negative shard key count")
                snapshot = SnapshotRef(
                    path=_path(raw["path"], "snapshot"),
                    generation=int(raw["generation"]),
                    shard_bits=shard_bits,
                    shard_keys=shard_keys,
                    fp_bits=int(raw["fp_bits"]),
                    created_at=float(raw["created_at"]),
                )
            entry = cls(
                version=int(payload["version"]),
                holder=str(payload["holder"]),
                token=str(payload["token"]),
                lease_s=float(payload["lease_s"]),
                snapshot=snapshot,
                deltas=tuple(
                    DeltaRef(_path(p, "delta"), int(r), int(w), bool(m))
                    for p, r, w, m in payload["deltas"]
                ),
                folded=tuple(str(name) for name in payload["folded"]),
                created_at=float(payload["created_at"]),
                format=version,
            )
        except (UnsupportedVersionError, CodecError):
            raise
        except JSON_ERRORS as exc:
            raise CodecError(f"log entry: not a valid manifest log entry ({exc})") from exc
        if not 1 <= entry.version < _MAX_VERSION or not 0 < entry.lease_s <= _MAX_LEASE_S:
            raise CodecError(f"log entry: bad version {entry.version} or lease {entry.lease_s}")
        snap = entry.snapshot
        if snap is not None and (
            snap.fp_bits not in _FP_BITS
            or not 0 <= snap.generation < _MAX_VERSION
            or any(n > _MAX_SHARD_KEYS for n in snap.shard_keys)
        ):
            raise CodecError(f"log entry: implausible snapshot {snap.path}")
        return entry


class ManifestLog:
    """Reads and appends entries of one fingerprint's manifest log.

    Every method may raise :class:`~s3kv.errors.StorageError`; readers also raise
    :class:`~s3kv.errors.CodecError` for an entry that is not valid.
    """

    def __init__(self, io: ManifestIO) -> None:
        self.io = io

    def read(self, version: int) -> LogEntry | None:
        """Entry ``version``, or ``None`` if it does not exist (yet, or any more).

        Raises:
            CodecError: not a valid entry (one longer than :data:`MAX_ENTRY_BYTES` is
                refused unread).
        """
        data = self.io.get(log_name(version), max_bytes=MAX_ENTRY_BYTES)
        if data is None:
            return None
        entry = LogEntry.from_json(data)
        if entry.version != version:
            raise CodecError(f"log entry: {log_name(version)} says version {entry.version}")
        return entry

    def hint(self) -> int:
        """The version ``LATEST`` names (0 when absent or unreadable)."""
        try:
            data = self.io.get(LATEST_NAME, max_bytes=MAX_HINT_BYTES)
            value = json.loads(data)["version"] if data else 0
            return value if isinstance(value, int) and 0 <= value < _MAX_VERSION else 0
        except (CodecError, *JSON_ERRORS):
            return 0  # NOTE: a hint is only a hint: a bad or oversized one costs a listing

    def latest(self) -> LogEntry | None:
        """The newest entry: the hint, probed forward; a listing when the hint lags far.

        Requests: 2 (hint and its entry) + 1 per newer entry found, at most
        ``3`` probes before one listing page from the hint.
        """
        try:
            version = self.hint()
            entry = self.read(version) if version else None
            if version and entry is None:
                version = 0  # the hint names a deleted entry: list instead
            for _ in range(_PROBES):
                newer = self.read(version + 1)
                if newer is None:
                    return entry if version else self._listed_latest(0)
                entry, version = newer, version + 1
        except CodecError:
            return self._listed_latest(0)  # NOTE: a corrupt entry on the way: walk back
        return self._listed_latest(version) or entry

    def _listed_latest(self, after: int) -> LogEntry | None:
        """The newest *valid* entry after ``after`` (a corrupt tip is skipped, a few deep)."""
        start = f"{after:020d}" if after else None
        found = (log_version(name) for name, _ in self.io.list_dir(LOG_DIR, start))
        versions = sorted((v for v in found if v is not None), reverse=True)
        for version in versions[:_WALK_BACK]:
            try:
                entry = self.read(version)
            except CodecError:
                continue
            if entry is not None:
                return entry
        return None

    def append(self, entry: LogEntry) -> bool:
        """Create ``entry`` if its version is free; ``False`` when another writer has it,
        or when the log had already moved past it.

        A version is also free once swept (entries far behind the newest are deleted): a
        writer paused between choosing ``V`` and creating it would create a stray entry
        behind the log. So one listing after the create checks that nothing newer exists;
        if something does, the entry is a stray (readers following the log never reach it;
        the sweep deletes it) and this returns ``False`` as if ``V`` were taken. Only then
        is the ``LATEST`` hint overwritten (best effort: a lagging hint costs readers a
        probe), so the hint never names a stray.
        """
        if not self.io.put(log_name(entry.version), entry.to_json(), if_absent=True):
            return False
        if self.versions_after(entry.version):
            return False
        payload = json.dumps({"version": entry.version}).encode("utf-8")
        # NOTE: the entry is published; a stale hint only costs readers a probe.
        with contextlib.suppress(StorageError):
            self.io.put(LATEST_NAME, payload)
        return True

    def versions_after(self, version: int) -> list[int]:
        """Versions present after ``version``, ascending (one listing request per 1000)."""
        found = (log_version(n) for n, _ in self.io.list_dir(LOG_DIR, f"{version:020d}.json"))
        return sorted(v for v in found if v is not None and v > version)
