"""Prune: delete the blocks no engine used within a window, then rewrite the manifest.

Decision, for each object under a fingerprint's ``blocks/`` (:func:`plan_prune`):

* **last use** is the later of the manifest's last use (the latest write or hit record, as
  :func:`~s3kv.manifest.load_usage` folds them) and the object's ``LastModified``.
  ``LastModified`` covers objects the manifest does not know yet (a segment not flushed,
  or lost) and objects re-written since, so a block written moments ago is never deleted.
* kept if its last use is within the window (``now - older_than`` or later);
* kept if pinned (the latest pin/unpin record wins);
* kept if it is an ancestor — through the manifest's parent links — of a kept block: a
  block is only loadable after its whole prefix, so deleting a parent would orphan a kept
  child;
* an object whose key is not a block key is never deleted (it is not ours).

Keys the manifest lists but whose object is already gone, that would be pruned anyway, are
*forgotten* too: dropped from the snapshot without a delete. That is what makes prune
resumable: a run interrupted after some deletions leaves keys advertised whose objects are
gone (a wasted GET each for engines, never wrong data), and the next run drops them. The
same heals objects removed by the bucket's lifecycle rule.

Execution (:func:`execute_prune`), per fingerprint: DeleteObjects in batches (at most
:data:`~s3kv.storage.DELETE_BATCH` keys each), then one compaction with
``drop_keys = deleted + forgotten`` so engines stop advertising them after their next
manifest refresh. A batch that fails as a whole stops the run (the bucket is unhealthy);
keys the server refuses one by one are counted as failed and stay in the manifest.
Concurrency with engines: a key an engine re-writes between the deletion and the snapshot
is dropped from the manifest too, which costs one re-save later, never wrong data.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from s3kv.errors import CodecError, StorageError
from s3kv.keys import BlockHash
from s3kv.manifest import UNKNOWN_PARENT, UsageTable, compact, load_usage
from s3kv.ops import ProgressFn, no_progress
from s3kv.ops.scope import BlockObject, Fingerprint, list_blocks
from s3kv.storage import DELETE_BATCH, Backend

__all__ = [
    "FingerprintOutcome",
    "FingerprintPlan",
    "PrunePlan",
    "PruneReport",
    "Tally",
    "execute_prune",
    "plan_prune",
]

_MAX_FAILURES_REPORTED = 10


@dataclass(frozen=True)
class Tally:
    """A count of objects and their stored bytes."""

    objects: int = 0
    bytes: int = 0

    def __add__(self, other: Tally) -> Tally:
        return Tally(self.objects + other.objects, self.bytes + other.bytes)

    @classmethod
    def of(cls, objects: Iterable[BlockObject]) -> Tally:
        """The tally of ``objects``."""
        items = list(objects)
        return cls(len(items), sum(o.size for o in items))


@dataclass(frozen=True)
class FingerprintPlan:
    """What prune will do to one fingerprint.

    Attributes:
        fingerprint: The fingerprint.
        model: Its ``model_id``, if known.
        delete: Block objects to delete.
        forget: Manifest keys to drop whose objects are already gone.
        kept_recent: Kept: used within the window.
        kept_pinned: Kept: pinned.
        kept_ancestor: Kept: a prefix of a kept block.
        kept_foreign: Kept: not a block key.
    """

    fingerprint: str
    model: str | None
    delete: tuple[BlockObject, ...]
    forget: tuple[BlockHash, ...]
    kept_recent: Tally
    kept_pinned: Tally
    kept_ancestor: Tally
    kept_foreign: Tally

    @property
    def to_delete(self) -> Tally:
        """Objects and bytes to delete."""
        return Tally.of(self.delete)

    @property
    def kept(self) -> Tally:
        """Objects and bytes kept, for any reason."""
        return self.kept_recent + self.kept_pinned + self.kept_ancestor + self.kept_foreign


@dataclass(frozen=True)
class PrunePlan:
    """The whole plan: computed first so that a dry run and the confirmation show totals.

    Attributes:
        now: Epoch seconds the plan was made at.
        older_than: The window in seconds.
        fingerprints: One plan per fingerprint in scope.
    """

    now: float
    older_than: float
    fingerprints: tuple[FingerprintPlan, ...]

    @property
    def cutoff(self) -> float:
        """Blocks last used before this epoch second are stale."""
        return self.now - self.older_than

    @property
    def to_delete(self) -> Tally:
        """Objects and bytes to delete, over all fingerprints."""
        return sum((fp.to_delete for fp in self.fingerprints), Tally())

    @property
    def kept(self) -> Tally:
        """Objects and bytes kept, over all fingerprints."""
        return sum((fp.kept for fp in self.fingerprints), Tally())


@dataclass(frozen=True)
class FingerprintOutcome:
    """What prune did to one fingerprint.

    Attributes:
        fingerprint: The fingerprint.
        deleted: Objects deleted (absent ones count: S3 deletes are idempotent).
        failed: Objects the server refused to delete, or whose batch failed.
        not_attempted: Objects left because the run stopped first.
        failures: Up to 10 ``(key, reason)`` examples.
        manifest_keys_dropped: Keys the new snapshot no longer lists.
        manifest_generation: The snapshot generation written (``None``: none written).
        manifest_error: Why the snapshot was not rewritten, if it should have been.
    """

    fingerprint: str
    deleted: Tally = Tally()
    failed: Tally = Tally()
    not_attempted: Tally = Tally()
    failures: tuple[tuple[str, str], ...] = ()
    manifest_keys_dropped: int = 0
    manifest_generation: int | None = None
    manifest_error: str | None = None


@dataclass(frozen=True)
class PruneReport:
    """The result of a prune run (or of a dry run: no outcomes).

    Attributes:
        plan: The plan executed.
        dry_run: Nothing was changed.
        outcomes: One per fingerprint, in plan order.
        interrupted: Why the run stopped early (``None`` if it did not).
    """

    plan: PrunePlan
    dry_run: bool
    outcomes: tuple[FingerprintOutcome, ...] = field(default=())
    interrupted: str | None = None

    @property
    def deleted(self) -> Tally:
        return sum((o.deleted for o in self.outcomes), Tally())

    @property
    def failed(self) -> Tally:
        return sum((o.failed + o.not_attempted for o in self.outcomes), Tally())

    @property
    def complete(self) -> bool:
        """Everything planned was done, manifest included (always true for a dry run)."""
        return self.dry_run or (
            self.interrupted is None
            and all(not o.failed.objects and o.manifest_error is None for o in self.outcomes)
        )


def plan_prune(
    backend: Backend,
    prefix: str,
    scope: Sequence[Fingerprint],
    *,
    older_than: float,
    clock: Callable[[], float] = time.time,
    progress: ProgressFn = no_progress,
) -> PrunePlan:
    """Decide what to delete (see the module docstring). Reads only: changes nothing.

    Args:
        backend: The bucket.
        prefix: The configured key prefix.
        scope: The fingerprints to prune (:func:`~s3kv.ops.scope.resolve_scope`).
        older_than: The window in seconds (> 0).
        clock: Epoch seconds.
        progress: Called with ``("list <fp>", objects listed, None)``.

    Raises:
        ValueError: ``older_than`` is not positive.
        CodecError: a fingerprint's manifest snapshot is unreadable; the message says to
            rebuild it with ``s3kv compact --full`` (pruning without it could delete pins).
        StorageError: the bucket failed.
    """
    if older_than <= 0:
        raise ValueError(f"older_than: must be > 0 seconds, got {older_than}")
    now = clock()
    plans = [_plan_fingerprint(backend, prefix, fp, now - older_than, progress) for fp in scope]
    return PrunePlan(now=now, older_than=older_than, fingerprints=tuple(plans))


def _plan_fingerprint(
    backend: Backend, prefix: str, fp: Fingerprint, cutoff: float, progress: ProgressFn
) -> FingerprintPlan:
    usage = _usage(backend, prefix, fp.fingerprint)
    rows = usage.rows
    keys: list[bytes] = rows["key"].tolist()
    parents: list[bytes] = rows["parent"].tolist()
    last_used = dict(zip(keys, rows["last_used"].tolist(), strict=True))
    pinned = {key for key, pin in zip(keys, rows["pinned"].tolist(), strict=True) if pin}
    parent_of = dict(zip(keys, parents, strict=True))

    objects: list[BlockObject] = []
    phase = f"list {fp.fingerprint[:8]}"
    for count, obj in enumerate(list_blocks(backend, prefix, fp.fingerprint), start=1):
        objects.append(obj)
        if count % 1000 == 0:
            progress(phase, count, None)
    progress(phase, len(objects), len(objects))

    recent: set[bytes] = {
        o.block
        for o in objects
        if o.block is not None and max(o.last_modified, last_used.get(o.block, 0.0)) >= cutoff
    }
    recent |= {key for key, used in last_used.items() if used >= cutoff}
    ancestors = _ancestors(recent | pinned, parent_of)

    delete: list[BlockObject] = []
    kept: dict[str, list[BlockObject]] = {"recent": [], "pinned": [], "ancestor": [], "foreign": []}
    for obj in objects:
        if obj.block is None:
            kept["foreign"].append(obj)
        elif obj.block in pinned:
            kept["pinned"].append(obj)
        elif obj.block in recent:
            kept["recent"].append(obj)
        elif obj.block in ancestors:
            kept["ancestor"].append(obj)
        else:
            delete.append(obj)
    present = {o.block for o in objects}
    forget = [
        BlockHash(key)
        for key in keys
        if key not in present and key not in pinned and key not in recent and key not in ancestors
    ]
    return FingerprintPlan(
        fingerprint=fp.fingerprint,
        model=fp.model,
        delete=tuple(delete),
        forget=tuple(forget),
        kept_recent=Tally.of(kept["recent"]),
        kept_pinned=Tally.of(kept["pinned"]),
        kept_ancestor=Tally.of(kept["ancestor"]),
        kept_foreign=Tally.of(kept["foreign"]),
    )


def _usage(backend: Backend, prefix: str, fingerprint: str) -> UsageTable:
    try:
        return load_usage(backend, prefix, fingerprint)
    except CodecError as exc:
        raise CodecError(
            f"the manifest snapshot of {fingerprint} is unreadable ({exc}): rebuild it with "
            f"`s3kv compact --full --fingerprint {fingerprint}`, then prune"
        ) from exc


def _ancestors(seeds: set[bytes], parent_of: dict[bytes, bytes]) -> set[bytes]:
    """Every known strict ancestor of ``seeds`` (walks parent links; stops at unknown ones)."""
    found: set[bytes] = set()
    for seed in seeds:
        parent = parent_of.get(seed)
        while parent is not None and parent != UNKNOWN_PARENT and parent not in found:
            if parent not in parent_of:  # ROOT_HASH, or a parent the manifest does not hold
                break
            found.add(parent)
            parent = parent_of.get(parent)
    return found


def execute_prune(
    backend: Backend,
    plan: PrunePlan,
    *,
    prefix: str,
    fpr: float,
    clock: Callable[[], float] = time.time,
    batch_size: int = DELETE_BATCH,
    progress: ProgressFn = no_progress,
) -> PruneReport:
    """Delete what ``plan`` says, then rewrite each fingerprint's manifest snapshot.

    Idempotent and resumable: re-running after an interruption (a failed batch, Ctrl-C, a
    crash) finishes the job, because a re-plan finds the remaining objects and forgets the
    already-deleted keys (module docstring).

    Args:
        backend: The bucket.
        plan: From :func:`plan_prune`.
        prefix: The configured key prefix.
        fpr: ``bloom_fpr`` for it.
        clock: Epoch seconds (compaction's clock).
        batch_size: Keys per DeleteObjects request (1..1000).
        progress: Called with ``("delete", objects done, objects planned)``.

    Returns:
        The report; :attr:`PruneReport.complete` says whether anything is left to do.
    """
    if not 1 <= batch_size <= DELETE_BATCH:
        raise ValueError(f"batch_size: must be in 1..{DELETE_BATCH}, got {batch_size}")
    total, done = plan.to_delete.objects, [0]

    def advance(n: int) -> None:
        done[0] += n
        progress("delete", done[0], total)

    outcomes: list[FingerprintOutcome] = []
    interrupted: str | None = None
    for fp_plan in plan.fingerprints:
        if interrupted is not None:
            outcomes.append(
                FingerprintOutcome(fp_plan.fingerprint, not_attempted=fp_plan.to_delete)
            )
            continue
        outcome, deleted, interrupted = _delete(backend, fp_plan, batch_size, advance)
        if interrupted is not None:
            outcome = replace(outcome, manifest_error="not rewritten: the run stopped")
        else:
            drop = [o.block for o in deleted if o.block is not None] + list(fp_plan.forget)
            outcome = _rewrite_manifest(backend, prefix, outcome, drop, fpr, clock)
        outcomes.append(outcome)
    return PruneReport(plan=plan, dry_run=False, outcomes=tuple(outcomes), interrupted=interrupted)


def _delete(
    backend: Backend, fp_plan: FingerprintPlan, batch_size: int, advance: Callable[[int], None]
) -> tuple[FingerprintOutcome, list[BlockObject], str | None]:
    """Delete one fingerprint's objects; (outcome, objects deleted, why it stopped early)."""
    deleted: list[BlockObject] = []
    failed: list[BlockObject] = []
    failures: list[tuple[str, str]] = []
    pending = list(fp_plan.delete)
    interrupted = None
    while pending:
        batch, pending = pending[:batch_size], pending[batch_size:]
        try:
            result = backend.delete_many([obj.key for obj in batch])
        except StorageError as exc:
            # NOTE: a whole batch failing means the bucket is unhealthy: stop rather than
            # hammer it; the next run re-plans and finishes.
            interrupted = str(exc)
            failed.extend(batch)
            failures.append((batch[0].key, f"batch of {len(batch)} failed: {exc}"))
            break
        for obj in batch:
            if obj.key in result.failed:
                failed.append(obj)
                failures.append((obj.key, result.failed[obj.key]))
            else:
                deleted.append(obj)
        advance(len(batch))
    outcome = FingerprintOutcome(
        fp_plan.fingerprint,
        deleted=Tally.of(deleted),
        failed=Tally.of(failed),
        not_attempted=Tally.of(pending),
        failures=tuple(failures[:_MAX_FAILURES_REPORTED]),
    )
    return outcome, deleted, interrupted


def _rewrite_manifest(
    backend: Backend,
    prefix: str,
    outcome: FingerprintOutcome,
    drop: list[BlockHash],
    fpr: float,
    clock: Callable[[], float],
) -> FingerprintOutcome:
    if not drop:
        return outcome  # nothing to drop: leave the snapshot alone (a no-op re-run is free)
    try:
        report = compact(
            backend,
            prefix,
            outcome.fingerprint,
            fpr=fpr,
            clock=clock,
            drop_keys=drop,
        )
    except (StorageError, CodecError) as exc:
        return replace(outcome, manifest_error=f"not rewritten ({exc}); re-run prune")
    if report.lost_race:
        return replace(
            outcome,
            manifest_error="another compaction ran at the same time; re-run prune to drop keys",
        )
    return replace(
        outcome, manifest_generation=report.generation, manifest_keys_dropped=report.keys_dropped
    )
