"""Verify: read block objects back and check them exactly as an engine would.

Each object is fetched and passed to :func:`s3kv.codec.decode` with its own key, which
checks magic, version, header crc, lengths, the key binding and both checksums. Verdicts:

* ``ok`` — decodes to verified bytes.
* ``corrupt`` — truncated, checksum or size mismatch (:class:`~s3kv.errors.ChecksumError`,
  :class:`~s3kv.errors.TruncatedError`, :class:`~s3kv.errors.SizeMismatchError`).
* ``foreign`` — not an s3kv object (bad magic), or an s3kv object written under another key
  (copied or renamed); also objects under ``blocks/`` whose key is not a block key (kind
  ``not_a_block_key``: not fetched; engines never read them, prune and verify never delete
  them).
* ``unsupported`` — another s3kv format version: a newer release may be writing it, so it
  is reported and never deleted.
* ``gone`` — deleted between the listing and the GET (a concurrent prune): not a problem.

With ``delete=True`` (or :func:`delete_findings` after a look at the report) corrupt and
foreign objects whose key is an s3kv block key (:func:`deletable`) are deleted (batched):
never an object of another tool, not even under ``blocks/``. Then the manifest
snapshot describing them is rewritten without their keys, as prune does: a TP shard's is
its layout's (:attr:`~s3kv.ops.scope.Fingerprint.manifest_fingerprint`), compacted once
for all of its shards, and a key deleted from any shard is dropped from it. Engines
already treat such objects as misses, so deleting them only saves the wasted GETs.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from s3kv import codec
from s3kv.errors import (
    AccessDeniedError,
    BadMagicError,
    CodecError,
    KeyMismatchError,
    StorageError,
    UnsupportedVersionError,
)
from s3kv.keys import BlockHash, parse_block_object_key
from s3kv.manifest import compact
from s3kv.ops import ProgressFn, no_progress
from s3kv.ops.scope import BlockObject, Fingerprint, list_blocks
from s3kv.storage import Backend, DeleteResult

__all__ = ["Finding", "VerifyReport", "deletable", "delete_findings", "verify_objects"]

_DELETABLE = frozenset({"corrupt", "foreign"})


@dataclass(frozen=True)
class Finding:
    """One object that failed verification.

    Attributes:
        key: The object key.
        fingerprint: Its fingerprint.
        verdict: ``"corrupt"``, ``"foreign"`` or ``"unsupported"``.
        kind: The codec error's kind (``checksum``, ``bad_magic``...) or ``not_a_block_key``.
        detail: The error message.
        size: Stored bytes.
        deleted: Whether ``delete=True`` removed it.
    """

    key: str
    fingerprint: str
    verdict: str
    kind: str
    detail: str
    size: int
    deleted: bool = False


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify_objects` found and did.

    Attributes:
        listed: Block objects listed in scope.
        checked: Objects fetched and verified (sampled or all).
        ok: Objects that verified.
        gone: Objects deleted between listing and GET.
        findings: Every object that failed, with its verdict.
        delete_failures: ``(key, reason)`` for deletions the server refused.
        manifest_errors: Why a manifest snapshot was not rewritten after deletions.
        blocks_by_fingerprint: Objects listed under block keys, per fingerprint (what the
            share a deletion takes of a fingerprint's blocks is a share of).
    """

    listed: int
    checked: int
    ok: int
    gone: int
    findings: tuple[Finding, ...]
    delete_failures: tuple[tuple[str, str], ...] = ()
    manifest_errors: tuple[str, ...] = ()
    blocks_by_fingerprint: Mapping[str, int] = field(default_factory=dict)

    def count(self, verdict: str) -> int:
        """Findings with ``verdict``."""
        return sum(1 for f in self.findings if f.verdict == verdict)

    @property
    def remaining(self) -> int:
        """Corrupt or foreign objects still in the bucket (what the exit status reports)."""
        return sum(1 for f in self.findings if f.verdict in _DELETABLE and not f.deleted)


def verify_objects(
    backend: Backend,
    scope: Sequence[Fingerprint],
    *,
    prefix: str,
    sample: int | None = 100,
    seed: int | None = None,
    delete: bool = False,
    fpr: float = 1e-6,
    threads: int = 8,
    clock: Callable[[], float] = time.time,
    progress: ProgressFn = no_progress,
) -> VerifyReport:
    """Fetch and verify objects of ``scope``; optionally delete corrupt and foreign ones.

    Args:
        backend: The bucket.
        scope: Fingerprints to verify.
        prefix: The configured key prefix.
        sample: Objects per fingerprint, chosen at random; ``None`` for all.
        seed: Seed of the sample (reproducible runs).
        delete: Delete corrupt and foreign objects, then rewrite the manifest.
        fpr: ``bloom_fpr`` for it.
        threads: Concurrent GETs.
        clock: Epoch seconds (compaction's clock).
        progress: Called with ``("verify", objects checked, objects to check)``.

    Raises:
        StorageError: a listing or GET failed (other than "not found").
    """
    rng = random.Random(seed)
    chosen: list[tuple[str, BlockObject]] = []
    listed = 0
    by_fingerprint: dict[str, int] = {}
    for fp in scope:
        objects = list(list_blocks(backend, prefix, fp.fingerprint))
        listed += len(objects)
        by_fingerprint[fp.fingerprint] = sum(1 for obj in objects if obj.block is not None)
        if sample is not None and sample < len(objects):
            objects = rng.sample(objects, sample)
        chosen.extend((fp.fingerprint, obj) for obj in objects)
    results: list[Finding | str] = []
    check = functools.partial(_check, backend)
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="s3kv-verify") as pool:
        window = 4 * max(1, threads)  # NOTE: bounded submission: never millions of futures
        for start in range(0, len(chosen), window):
            results.extend(pool.map(check, chosen[start : start + window]))
            progress("verify", len(results), len(chosen))
    findings = [r for r in results if isinstance(r, Finding)]
    report = VerifyReport(
        listed=listed,
        checked=len(chosen),
        ok=results.count("ok"),
        gone=results.count("gone"),
        findings=tuple(findings),
        blocks_by_fingerprint=by_fingerprint,
    )
    if delete:
        report = delete_findings(backend, report, scope, prefix=prefix, fpr=fpr, clock=clock)
    return report


def deletable(findings: Iterable[Finding], prefix: str) -> list[Finding]:
    """The findings a deletion removes: corrupt or foreign objects under an s3kv block key
    of their own fingerprint (:func:`~s3kv.keys.parse_block_object_key`); never another
    tool's object, nor one of another format version."""
    found = []
    for f in findings:
        parsed = parse_block_object_key(prefix, f.key)
        if f.verdict in _DELETABLE and parsed is not None and parsed[0] == f.fingerprint:
            found.append(f)
    return found


def delete_findings(
    backend: Backend,
    report: VerifyReport,
    scope: Sequence[Fingerprint],
    *,
    prefix: str,
    fpr: float = 1e-6,
    clock: Callable[[], float] = time.time,
) -> VerifyReport:
    """Delete the :func:`deletable` findings of ``report``, then drop their keys from the
    manifests of ``scope`` (as ``verify_objects(delete=True)`` does).

    A refused deletion (:class:`~s3kv.errors.AccessDeniedError`) is reported in
    :attr:`VerifyReport.delete_failures`, with the reason, for every key.

    Raises:
        StorageError: the deletion failed for another reason than a refused permission.
    """
    if not deletable(report.findings, prefix):
        return report
    manifests = {fp.fingerprint: fp.manifest_fingerprint for fp in scope}
    return _delete(backend, report, prefix, manifests, fpr, clock)


def _check(backend: Backend, item: tuple[str, BlockObject]) -> Finding | str:
    fingerprint, obj = item
    if obj.block is None:
        return Finding(
            obj.key,
            fingerprint,
            "foreign",
            "not_a_block_key",
            "key is not a block key; engines never read it",
            obj.size,
        )
    data = backend.get(obj.key)
    if data is None:
        return "gone"
    try:
        codec.decode(data, key=obj.key)
    except UnsupportedVersionError as exc:
        return Finding(obj.key, fingerprint, "unsupported", exc.kind, str(exc), len(data))
    except (BadMagicError, KeyMismatchError) as exc:
        return Finding(obj.key, fingerprint, "foreign", exc.kind, str(exc), len(data))
    except CodecError as exc:
        return Finding(obj.key, fingerprint, "corrupt", exc.kind, str(exc), len(data))
    return "ok"


def _delete(
    backend: Backend,
    report: VerifyReport,
    prefix: str,
    manifests: Mapping[str, str],
    fpr: float,
    clock: Callable[[], float],
) -> VerifyReport:
    """Delete the corrupt and foreign s3kv objects, then drop their keys from the manifests
    (``manifests``: fingerprint -> its manifest's fingerprint)."""
    doomed = deletable(report.findings, prefix)
    try:
        result = backend.delete_many([f.key for f in doomed])
    except AccessDeniedError as exc:
        result = DeleteResult(failed={f.key: str(exc) for f in doomed})
    gone = {f.key for f in doomed if f.key not in result.failed}
    manifest_errors = []
    by_manifest: dict[str, dict[BlockHash, None]] = {}
    for f in doomed:
        parsed = parse_block_object_key(prefix, f.key)
        if f.key in gone and parsed is not None:
            manifest = manifests.get(f.fingerprint, f.fingerprint)
            by_manifest.setdefault(manifest, {})[parsed[1]] = None
    for fingerprint, keys in by_manifest.items():
        try:
            done = compact(
                backend,
                prefix,
                fingerprint,
                fpr=fpr,
                clock=clock,
                drop_keys=list(keys),
            )
        except (StorageError, CodecError) as exc:
            manifest_errors.append(f"{fingerprint}: manifest not rewritten ({exc})")
            continue
        if done.lost_race:
            manifest_errors.append(f"{fingerprint}: another compaction won; re-run verify")
    findings = tuple(
        Finding(f.key, f.fingerprint, f.verdict, f.kind, f.detail, f.size, f.key in gone)
        for f in report.findings
    )
    return replace(
        report,
        findings=findings,
        delete_failures=tuple(result.failed.items()),
        manifest_errors=tuple(manifest_errors),
    )
