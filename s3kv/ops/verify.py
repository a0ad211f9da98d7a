"""Verify: read block objects back and check them exactly as an engine would.

Each object is fetched and passed to :func:`s3kv.codec.decode` with its own key, which
checks magic, version, header crc, lengths, the key binding and both checksums. A sealed
object (``auth_keys``, :mod:`s3kv.auth`) is first opened with the ``keyring``; without one
it cannot be checked (``unsupported``, kind ``sealed``), and never deleted.

Memory is bounded by the fingerprint's geometry (``identity.json``'s raw block size), as an
engine's is: the GET refuses an object longer than a block can encode to
(:func:`~s3kv.codec.max_object_len`; kind ``too_large``, nothing read) and a header
declaring another raw size is a ``size_mismatch`` before anything is allocated. Without an
identity, a header declaring more than :data:`MAX_UNKNOWN_RAW` raw bytes is not decoded
(``unsupported``, kind ``unchecked``): 39 KB of zstd can hold 1 GiB of zeros, and decoding
it would cost 1 GiB.

Verdicts:

* ``ok`` — decodes to verified bytes.
* ``corrupt`` — truncated, checksum or size mismatch (:class:`~s3kv.errors.ChecksumError`,
  :class:`~s3kv.errors.TruncatedError`, :class:`~s3kv.errors.SizeMismatchError`), or longer
  than any block of its fingerprint (``too_large``).
* ``foreign`` — not an s3kv object (bad magic), or an s3kv object written under another key
  (copied or renamed), or (with a keyring) an unsealed one where sealed ones are required
  (kind ``unsigned``); also objects under ``blocks/`` whose key is not a block key (kind
  ``not_a_block_key``: not fetched; engines never read them, prune and verify never delete
  them).
* ``unsupported`` — another s3kv format version: a newer release may be writing it, so it
  is reported and never deleted; also an object too large to decode without its
  fingerprint's geometry (kind ``unchecked``), a sealed one without a keyring (``sealed``)
  or one sealed by a key the keyring lacks (``unknown_key``). A seal that does not verify
  is ``corrupt`` (kind ``forged``).
* ``gone`` — deleted between the listing and the GET (a concurrent prune): not a problem.
* ``transient`` — set by a deletion (below) when a second read did not confirm the first:
  the object is kept.

With ``delete=True`` (or :func:`delete_findings` after a look at the report) corrupt and
foreign objects whose key is an s3kv block key (:func:`deletable`) are deleted (batched):
never an object of another tool, not even under ``blocks/``. A GET corrupted on the way
(a flaky proxy or NIC) must not delete an intact object, so each one is first read again:
HEAD, GET, HEAD. It is deleted only if the second read fails with the same kind on the same
bytes (:attr:`Finding.digest`) and both HEADs show the same version (ETag and size);
otherwise its verdict becomes ``transient`` and it stays. Then the manifest
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
from typing import Final, TypeVar

import xxhash

from s3kv import codec
from s3kv.auth import MAX_OVERHEAD, Keyring, is_sealed, unseal
from s3kv.errors import (
    AccessDeniedError,
    AuthenticationError,
    BadMagicError,
    CodecError,
    KeyMismatchError,
    ObjectTooLargeError,
    StorageError,
    UnsupportedVersionError,
)
from s3kv.keys import BlockHash, parse_block_object_key
from s3kv.manifest import compact
from s3kv.ops import ProgressFn, no_progress
from s3kv.ops.scope import BlockObject, Fingerprint, list_blocks
from s3kv.storage import Backend, DeleteResult

__all__ = [
    "MAX_UNKNOWN_RAW",
    "Finding",
    "VerifyReport",
    "deletable",
    "delete_findings",
    "verify_objects",
]

_DELETABLE = frozenset({"corrupt", "foreign"})
#: Largest raw size decoded for a fingerprint without a known geometry (no identity.json).
#: NOTE: above the largest plausible block (a 405B model, 128 tokens per block: 66 MB).
MAX_UNKNOWN_RAW: Final = 128 * 1024 * 1024

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Finding:
    """One object that failed verification.

    Attributes:
        key: The object key.
        fingerprint: Its fingerprint.
        verdict: ``"corrupt"``, ``"foreign"``, ``"unsupported"``, or ``"transient"`` once
            a deletion's second read did not confirm it.
        kind: The codec error's kind (``checksum``, ``bad_magic``...), ``too_large``,
            ``unchecked`` or ``not_a_block_key``.
        detail: The error message.
        size: Stored bytes.
        deleted: Whether ``delete=True`` removed it.
        digest: xxh3_64 (hex) of the bytes judged; ``""`` when none were read.
    """

    key: str
    fingerprint: str
    verdict: str
    kind: str
    detail: str
    size: int
    deleted: bool = False
    digest: str = ""


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
        """Corrupt or foreign objects still in the bucket (what the exit status reports;
        ``transient`` findings are not: their second read found them intact)."""
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
    keyring: Keyring | None = None,
) -> VerifyReport:
    """Fetch and verify objects of ``scope``; optionally delete corrupt and foreign ones.

    Args:
        backend: The bucket.
        scope: Fingerprints to verify.
        prefix: The configured key prefix.
        sample: Objects per fingerprint, chosen at random; ``None`` for all.
        seed: Seed of the sample (reproducible runs).
        delete: Delete corrupt and foreign objects once a second read confirms them (see
            the module), then rewrite the manifest.
        fpr: ``bloom_fpr`` for it.
        threads: Concurrent GETs.
        clock: Epoch seconds (compaction's clock).
        progress: Called with ``("verify", objects checked, objects to check)``.
        keyring: The ``auth_keys`` to open sealed objects with (``None``: sealed objects
            are reported ``unsupported``, never deleted).

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
    check = functools.partial(_check, _Reader(backend, _raw_sizes(scope), keyring))
    results = _windowed(check, chosen, threads, lambda done: progress("verify", done, len(chosen)))
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
        report = delete_findings(
            backend,
            report,
            scope,
            prefix=prefix,
            fpr=fpr,
            clock=clock,
            threads=threads,
            keyring=keyring,
        )
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
    threads: int = 8,
    keyring: Keyring | None = None,
) -> VerifyReport:
    """Delete the :func:`deletable` findings of ``report`` that a second read confirms,
    then drop their keys from the manifests of ``scope`` (as
    ``verify_objects(delete=True)`` does).

    Each deletable finding is read again first (HEAD, GET, HEAD; see the module); one the
    second read does not confirm is kept, with verdict ``transient``.

    A refused deletion (:class:`~s3kv.errors.AccessDeniedError`) is reported in
    :attr:`VerifyReport.delete_failures`, with the reason, for every key.

    Raises:
        StorageError: a confirming read failed (nothing was deleted), or the deletion
            failed for another reason than a refused permission.
    """
    doomed = deletable(report.findings, prefix)
    if not doomed:
        return report
    confirm = functools.partial(_confirm, _Reader(backend, _raw_sizes(scope), keyring))
    checked = dict(zip(doomed, _windowed(confirm, doomed, threads), strict=True))
    report = replace(report, findings=tuple(checked.get(f, f) for f in report.findings))
    if not deletable(report.findings, prefix):
        return report
    manifests = {fp.fingerprint: fp.manifest_fingerprint for fp in scope}
    return _delete(backend, report, prefix, manifests, fpr, clock)


def _windowed(
    fn: Callable[[T], R],
    items: Sequence[T],
    threads: int,
    done: Callable[[int], None] | None = None,
) -> list[R]:
    """``[fn(item) for item in items]`` on ``threads`` threads, submitted a window at a time
    (NOTE: bounded submission: never millions of futures); ``done(n)`` after each window."""
    results: list[R] = []
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="s3kv-verify") as pool:
        window = 4 * max(1, threads)
        for start in range(0, len(items), window):
            results.extend(pool.map(fn, items[start : start + window]))
            if done is not None:
                done(len(results))
    return results


def _raw_sizes(scope: Sequence[Fingerprint]) -> dict[str, int | None]:
    """Raw bytes of every block, per fingerprint (``None``: no identity, unknown)."""
    return {fp.fingerprint: fp.raw_block_bytes for fp in scope}


@dataclass(frozen=True)
class _Reader:
    """What judging an object needs: the bucket, each fingerprint's raw block size, the keys."""

    backend: Backend
    raw_sizes: Mapping[str, int | None]
    keyring: Keyring | None


def _check(reader: _Reader, item: tuple[str, BlockObject]) -> Finding | str:
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
    return _examine(reader, obj.key, fingerprint, obj.size)


def _examine(reader: _Reader, key: str, fingerprint: str, listed_size: int) -> Finding | str:
    """Read ``key`` once and judge it: ``"ok"``, ``"gone"`` or a :class:`Finding`.

    Nothing is allocated beyond one block's raw bytes (see the module), and for a PLANES_REF
    object the codec's per-thread scratch, about as much again (:func:`~s3kv.codec.decode`).
    """
    raw_len = reader.raw_sizes.get(fingerprint)
    bound = raw_len if raw_len is not None else MAX_UNKNOWN_RAW
    try:
        data = reader.backend.get(key, max_bytes=codec.max_object_len(bound) + MAX_OVERHEAD)
    except ObjectTooLargeError as exc:
        return Finding(key, fingerprint, "corrupt", exc.kind, str(exc), listed_size)
    if data is None:
        return "gone"

    def finding(verdict: str, kind: str, detail: str) -> Finding:
        digest = xxhash.xxh3_64_hexdigest(data)
        return Finding(key, fingerprint, verdict, kind, detail, len(data), digest=digest)

    try:
        blob: bytes | memoryview = data
        if reader.keyring is not None:
            blob = unseal(data, object_key=key, keyring=reader.keyring)
        elif is_sealed(data):
            return finding("unsupported", "sealed", "sealed (auth_keys): give verify the keys")
        if raw_len is None and (declared := codec.read_header(blob).raw_len) > bound:
            detail = (
                f"header declares {declared} raw bytes, more than the {bound} verify decodes "
                "for a fingerprint without identity.json; not decoded"
            )
            return finding("unsupported", "unchecked", detail)
        codec.decode(blob, key=key, expect_raw_len=raw_len)
    except AuthenticationError as exc:
        verdict = {"unknown_key": "unsupported", "unsigned": "foreign"}.get(exc.kind, "corrupt")
        return finding(verdict, exc.kind, str(exc))
    except UnsupportedVersionError as exc:
        return finding("unsupported", exc.kind, str(exc))
    except (BadMagicError, KeyMismatchError) as exc:
        return finding("foreign", exc.kind, str(exc))
    except CodecError as exc:
        return finding("corrupt", exc.kind, str(exc))
    return "ok"


def _confirm(reader: _Reader, f: Finding) -> Finding:
    """``f`` if a second read of the same version fails the same way on the same bytes;
    else ``f`` with verdict ``transient`` and the reason appended to its detail."""
    before = reader.backend.head(f.key)
    second = _examine(reader, f.key, f.fingerprint, f.size)
    after = reader.backend.head(f.key)
    if before is None or after is None or second == "gone":
        why = "it is gone"
    elif (before.etag, before.size) != (after.etag, after.size):
        why = "it changed between the reads"
    elif isinstance(second, str):
        why = "it verified"
    elif (second.verdict, second.kind) != (f.verdict, f.kind):
        why = f"it failed otherwise ({second.kind})"
    elif second.digest != f.digest:
        why = "it returned other bytes (corrupted on the way?)"
    else:
        return f
    return replace(f, verdict="transient", detail=f"{f.detail}; kept: read again, {why}")


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
