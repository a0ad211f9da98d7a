"""``s3kv prune``, ``stats``, ``verify``, ``compact``: parse, call :mod:`s3kv.ops`, print."""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Any

import typer
from rich.console import Console

from s3kv.auth import load_keyring
from s3kv.cli.common import Common, Session, bucket_command
from s3kv.cli.context import CommandError
from s3kv.cli.output import ago, human_bytes, table
from s3kv.cli.safety import (
    confirm_deletion,
    delete_denied,
    denied,
    parse_window,
    share_reasons,
)
from s3kv.ops.compaction import compact_scope
from s3kv.ops.prune import FingerprintPlan, PruneReport, Tally, execute_prune, plan_prune
from s3kv.ops.stats import AGE_BUCKETS, KindStats, PriceTable, StatsReport, collect_stats
from s3kv.ops.verify import (
    Finding,
    VerifyReport,
    deletable,
    delete_findings,
    verify_objects,
)
from s3kv.storage import DELETE_BATCH

__all__ = ["compact", "prune", "stats", "verify"]

DryRunOpt = Annotated[
    bool, typer.Option("--dry-run", help="Show what would be deleted; delete nothing.")
]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Skip the confirmation.")]
ConfirmAboveOpt = Annotated[
    int,
    typer.Option("--confirm-above", metavar="N", min=0, help="Ask first above this many objects."),
]
ConfirmShareOpt = Annotated[
    float,
    typer.Option(
        "--confirm-share",
        metavar="SHARE",
        min=0.0,
        max=1.0,
        help="Ask first when a run would delete more than this share of a fingerprint's "
        "blocks, whatever their number (1: never for this).",
    ),
]


@bucket_command()
def prune(
    common: Common,
    older_than: Annotated[
        str,
        typer.Option(
            "--older-than",
            metavar="DURATION",
            help="Delete blocks not used within this window, with a unit: 90s, 30m, 12h, "
            "7d, 2w, or compound: 7d12h, 1h30m.",
            show_default=False,
        ),
    ],
    dry_run: DryRunOpt = False,
    yes: YesOpt = False,
    confirm_above: ConfirmAboveOpt = 1000,
    confirm_share: ConfirmShareOpt = 0.5,
    batch_size: Annotated[
        int,
        typer.Option(
            "--batch-size",
            metavar="N",
            min=1,
            max=DELETE_BATCH,
            help="Keys per DeleteObjects.",
        ),
    ] = DELETE_BATCH,
) -> None:
    """Delete blocks no engine used within a window; pinned prefixes are kept.

    Last use is the later of the manifest's last write/hit and the object's LastModified.
    The manifest snapshot is rewritten afterwards so engines stop advertising deleted keys.
    Safe to re-run: an interrupted prune finishes on the next run. Without a terminal to
    confirm on, a run that needs confirming is refused unless --yes is given.

    Examples:

    ```
    s3kv prune --older-than 7d --dry-run
    s3kv prune --older-than 7d12h --model 'meta-llama/*'
    s3kv prune --older-than 30d --yes --json
    ```
    """
    rt = common.rt
    window = parse_window(older_than, flag="--older-than")
    with common.session(write=not dry_run) as s:
        out = s.out
        with out.progress() as progress:
            plan = plan_prune(
                s.backend, s.prefix, s.scope, older_than=window, clock=rt.clock, progress=progress
            )
        if dry_run:
            report = PruneReport(plan=plan, dry_run=True)
            out.emit(_prune_json(report), lambda con: _render_prune(con, report))
            return
        going = plan.to_delete
        reasons = share_reasons(
            ((fp.fingerprint, fp.to_delete.objects, _blocks(fp)) for fp in plan.fingerprints),
            confirm_share,
        )
        if going.objects > confirm_above:
            reasons.insert(0, f"more than --confirm-above {confirm_above} objects")
        confirm_deletion(
            out,
            command="prune",
            what=f"delete {going.objects} objects ({human_bytes(going.bytes)}), keep "
            f"{plan.kept.objects}",
            reasons=reasons if going.objects else [],
            can_prompt=rt.can_prompt(),
            yes=yes,
        )
        with out.progress() as progress:
            report = execute_prune(
                s.backend,
                plan,
                prefix=s.prefix,
                fpr=s.cfg.bloom_fpr,
                clock=rt.clock,
                batch_size=batch_size,
                progress=progress,
            )
    out.emit(_prune_json(report), lambda con: _render_prune(con, report))
    if not report.complete:
        reasons = [report.interrupted or ""] + [r for o in report.outcomes for _, r in o.failures]
        if any(denied(r) for r in reasons):
            raise delete_denied(report.failed.objects, where=_where(s))
        reason = _unfinished(report)
        if denied(reason):
            raise CommandError(
                f"permission denied: {reason}: these credentials lack the s3:PutObject or "
                f"s3:DeleteObject action on {_where(s)} (the pruner policy in infra/aws "
                "grants both)",
                1,
            )
        raise CommandError(
            f"prune did not finish ({reason}): re-run the same command to complete it", 1
        )


def _blocks(fp: FingerprintPlan) -> int:
    """A fingerprint plan's block objects: deleted or kept, the foreign ones aside."""
    return (fp.to_delete + fp.kept_recent + fp.kept_pinned + fp.kept_ancestor).objects


def _where(s: Session) -> str:
    """The keys a permission must cover, for a message."""
    if s.cfg.bucket:
        return f"s3://{s.cfg.bucket}/{s.prefix}/*" if s.prefix else f"s3://{s.cfg.bucket}/*"
    return s.backend.description


def _unfinished(report: PruneReport) -> str:
    if report.interrupted:
        return f"stopped: {report.interrupted}"
    failed = report.failed.objects
    errors = [o.manifest_error for o in report.outcomes if o.manifest_error]
    return f"{failed} objects not deleted" if failed else f"manifest {errors[0]}"


def _tally(t: Tally) -> dict[str, int]:
    return {"objects": t.objects, "bytes": t.bytes}


def _prune_json(report: PruneReport) -> dict[str, Any]:
    plan = report.plan
    outcomes = {o.fingerprint: o for o in report.outcomes}
    fps = []
    for fp in plan.fingerprints:
        entry: dict[str, Any] = {
            "fingerprint": fp.fingerprint,
            "manifest_fingerprint": fp.manifest_fingerprint,
            "model": fp.model,
            "planned": _tally(fp.to_delete),
            "forget_manifest_keys": len(fp.forget),
            "kept": {
                "recent": _tally(fp.kept_recent),
                "pinned": _tally(fp.kept_pinned),
                "ancestor": _tally(fp.kept_ancestor),
                "foreign": _tally(fp.kept_foreign),
            },
        }
        if (o := outcomes.get(fp.fingerprint)) is not None:
            entry.update(
                deleted=_tally(o.deleted),
                failed=_tally(o.failed),
                not_attempted=_tally(o.not_attempted),
                failures=[list(f) for f in o.failures],
                manifest={
                    "fingerprint": o.manifest_fingerprint,
                    "generation": o.manifest_generation,
                    "keys_dropped": o.manifest_keys_dropped,
                    "error": o.manifest_error,
                },
            )
        fps.append(entry)
    return {
        "command": "prune",
        "dry_run": report.dry_run,
        "now": plan.now,
        "older_than_s": plan.older_than,
        "cutoff": plan.cutoff,
        "planned": _tally(plan.to_delete),
        "kept": _tally(plan.kept),
        "deleted": _tally(report.deleted),
        "failed": _tally(report.failed),
        "complete": report.complete,
        "interrupted": report.interrupted,
        "fingerprints": fps,
    }


def _render_prune(con: Console, report: PruneReport) -> None:
    plan = report.plan
    title = "prune (dry run: nothing deleted)" if report.dry_run else "prune"
    cols = ["fingerprint", "model", "#to delete", "#bytes", "#kept", "#pinned", "#bytes kept"]
    t = table(f"{title}: last use older than {ago(plan.older_than)}", *cols)
    for fp in plan.fingerprints:
        t.add_row(
            fp.fingerprint,
            fp.model or "?",
            str(fp.to_delete.objects),
            human_bytes(fp.to_delete.bytes),
            str(fp.kept.objects),
            str(fp.kept_pinned.objects),
            human_bytes(fp.kept.bytes),
        )
    con.print(t)
    if report.dry_run:
        con.print(
            f"would delete {plan.to_delete.objects} objects "
            f"({human_bytes(plan.to_delete.bytes)}), keep {plan.kept.objects}"
        )
        return
    con.print(
        f"deleted {report.deleted.objects} objects ({human_bytes(report.deleted.bytes)}), "
        f"kept {plan.kept.objects} ({human_bytes(plan.kept.bytes)}), "
        f"failed {report.failed.objects} ({human_bytes(report.failed.bytes)})"
    )
    errors: dict[str, str] = {}  # NOTE: the shards of a layout share one manifest
    for o in report.outcomes:
        for key, reason in o.failures:
            con.print(f"  failed: {key}: {reason}", markup=False)
        if o.manifest_error:
            errors.setdefault(o.manifest_fingerprint, o.manifest_error)
    for manifest, error in errors.items():
        con.print(f"  manifest {manifest}: {error}", markup=False)
    if report.interrupted:
        con.print(f"stopped early: {report.interrupted}", markup=False)


@bucket_command()
def stats(
    common: Common,
    sample: Annotated[
        int,
        typer.Option(
            "--sample",
            metavar="N",
            min=0,
            help="Headers read per fingerprint when its "
            "identity.json does not give the raw block size.",
        ),
    ] = 8,
    prices: Annotated[
        str | None,
        typer.Option(
            "--prices",
            metavar="FILE",
            help="Price table (TOML/JSON): storage_per_gib_month, "
            "put_per_1000, get_per_1000, name. Default: AWS S3 Standard us-east-1.",
        ),
    ] = None,
) -> None:
    """Per fingerprint: blocks, compression, age and last-use histograms, hits, pins; every
    object s3kv wrote, by kind (blocks, manifest segments, log, deltas, snapshots,
    identity, other), with bytes and storage cost; and the estimated monthly cost.

    Examples:

    ```
    s3kv stats
    s3kv stats --model 'meta-llama/*' --prices prices.toml --json
    ```
    """
    table_ = PriceTable.from_file(prices) if prices else PriceTable()
    with common.session(write=False) as s, s.out.progress() as progress:
        report = collect_stats(
            s.backend,
            s.scope,
            prefix=s.prefix,
            prices=table_,
            sample=sample,
            clock=common.rt.clock,
            progress=progress,
        )
    document = {
        "command": "stats",
        "now": report.now,
        "prices": vars(report.prices),
        "objects": report.objects,
        "stored_bytes": report.stored_bytes,
        "total_objects": report.total_objects,
        "total_bytes": report.total_bytes,
        "kinds": {kind: dataclasses.asdict(k) for kind, k in report.kinds.items()},
        "storage_usd_month": report.storage_usd_month,
        "requests_usd_month": report.requests_usd_month,
        "usd_month": report.usd_month,
        "fingerprints": [dataclasses.asdict(fp) for fp in report.fingerprints],
    }
    s.out.emit(document, lambda con: _render_stats(con, report))


def _render_stats(con: Console, report: StatsReport) -> None:
    cols = [
        "fingerprint",
        "model",
        "#blocks",
        "#stored",
        "#raw",
        "#ratio",
        "#hits",
        "#pins",
        "#all objects",
        "#all bytes",
        "#USD/month",
    ]
    t = table("stats (blocks; all: every object under the fingerprint)", *cols)
    for fp in report.fingerprints:
        ratio = f"{fp.ratio:.2f}x" if fp.ratio else "-"
        usd = fp.storage_usd_month + fp.requests_usd_month
        t.add_row(
            fp.fingerprint,
            fp.model or "?",
            str(fp.objects),
            human_bytes(fp.stored_bytes),
            human_bytes(fp.raw_bytes),
            ratio,
            str(fp.hits),
            str(fp.pins),
            str(fp.total_objects),
            human_bytes(fp.total_bytes),
            _usd(usd),
        )
    con.print(t)
    _render_kinds(con, report)
    labels = [label for label, _ in AGE_BUCKETS]
    hist = table(
        "blocks by age | by time since last use",
        "fingerprint",
        *(f"#{x}" for x in labels),
        "|",
        *(f"#{x}" for x in labels),
    )
    for fp in report.fingerprints:
        hist.add_row(
            fp.fingerprint,
            *(str(fp.age[x]) for x in labels),
            "|",
            *(str(fp.last_use[x]) for x in labels),
        )
    con.print(hist)
    errors = {fp.manifest_fingerprint: fp.manifest_error for fp in report.fingerprints}
    for manifest, error in errors.items():
        if error:
            con.print(f"manifest {manifest}: {error}", markup=False)
    sources = ", ".join(sorted({fp.raw_source for fp in report.fingerprints})) or "-"
    con.print(
        f"raw bytes: {sources}; prices: {report.prices.name}; "
        f"storage ~{_usd(report.storage_usd_month)} + requests "
        f"~{_usd(report.requests_usd_month)} = total ~{_usd(report.usd_month)} USD/month",
        markup=False,
    )


def _render_kinds(con: Console, report: StatsReport) -> None:
    """Objects, bytes and storage cost by kind: per fingerprint, then the total."""
    t = table("stored by kind", "fingerprint", "kind", "#objects", "#bytes", "#share", "#USD/month")

    def rows(label: str, kinds: dict[str, KindStats], total: int) -> None:
        for kind, k in kinds.items():
            if k.objects:
                share = f"{100 * k.bytes / total:.1f}%" if total else "-"
                t.add_row(
                    label, kind, str(k.objects), human_bytes(k.bytes), share,
                    _usd(k.storage_usd_month),
                )  # fmt: skip
        storage = sum(k.storage_usd_month for k in kinds.values())
        objects = sum(k.objects for k in kinds.values())
        t.add_row(label, "total", str(objects), human_bytes(total), "", _usd(storage))

    for fp in report.fingerprints:
        rows(fp.fingerprint, fp.kinds, fp.total_bytes)
    if len(report.fingerprints) > 1:
        rows("all fingerprints", report.kinds, report.total_bytes)
    con.print(t)
    for fp in report.fingerprints:
        if fp.snapshot_generations > 2:
            con.print(
                f"note: {fp.fingerprint} holds {fp.snapshot_generations} manifest snapshot "
                f"generations ({human_bytes(fp.kinds['snapshots'].bytes)}): one or two are "
                "live, the compactor's hourly sweep deletes the others",
                markup=False,
            )


def _usd(value: float) -> str:
    """Dollars with two decimals; amounts under a cent keep two significant digits."""
    if not 0 < value < 0.01:
        return f"{value:.2f}"
    decimals = min(8, 1 - math.floor(math.log10(value)))
    return f"{value:.{decimals}f}"


@bucket_command()
def verify(
    common: Common,
    sample: Annotated[
        int,
        typer.Option(
            "--sample", metavar="N", min=1, help="Objects per fingerprint, chosen at random."
        ),
    ] = 100,
    all_: Annotated[bool, typer.Option("--all", help="Verify every object.")] = False,
    seed: Annotated[
        int | None, typer.Option("--seed", metavar="N", help="Seed of the sample.")
    ] = None,
    delete_corrupt: Annotated[
        bool,
        typer.Option(
            "--delete-corrupt",
            help="Delete corrupt and foreign objects under s3kv block keys (never other keys).",
        ),
    ] = False,
    dry_run: DryRunOpt = False,
    yes: YesOpt = False,
    confirm_above: ConfirmAboveOpt = 1000,
    confirm_share: ConfirmShareOpt = 0.5,
) -> None:
    """Read objects back and verify header and checksum as an engine would.

    With --delete-corrupt, corrupt and foreign objects under s3kv block keys are deleted
    (objects of other tools never are), after a confirmation as for prune. Exits 1 if
    corrupt or foreign objects remain in the bucket.

    Examples:

    ```
    s3kv verify --sample 20
    s3kv verify --all --delete-corrupt --dry-run
    s3kv verify --all --delete-corrupt --yes --json
    ```
    """
    rt = common.rt
    with common.session(write=delete_corrupt and not dry_run) as s:
        # NOTE: with auth_keys set, sealed blocks are opened and checked; without, they are
        # reported as sealed and never deleted.
        keyring = load_keyring(
            s.cfg.auth_keys, accept_unsigned=s.cfg.auth_accept_unsigned, region=s.cfg.region
        )
        with s.out.progress() as progress:
            report = verify_objects(
                s.backend,
                s.scope,
                prefix=s.prefix,
                sample=None if all_ else sample,
                seed=seed,
                fpr=s.cfg.bloom_fpr,
                threads=s.cfg.io_concurrency(),
                clock=rt.clock,
                progress=progress,
                keyring=keyring,
            )
        doomed = deletable(report.findings, s.prefix)
        if delete_corrupt and doomed and not dry_run:
            _confirm_verify(s, report, doomed, yes=yes, above=confirm_above, share=confirm_share)
            report = delete_findings(
                s.backend,
                report,
                s.scope,
                prefix=s.prefix,
                fpr=s.cfg.bloom_fpr,
                clock=rt.clock,
                threads=s.cfg.io_concurrency(),
                keyring=keyring,
            )
            doomed = deletable(report.findings, s.prefix)  # NOTE: now with .deleted set
    document = {
        "command": "verify",
        "dry_run": dry_run,
        "listed": report.listed,
        "checked": report.checked,
        "ok": report.ok,
        "gone": report.gone,
        "corrupt": report.count("corrupt"),
        "foreign": report.count("foreign"),
        "unsupported": report.count("unsupported"),
        "transient": report.count("transient"),
        "deletable": len(doomed),
        "deleted": sum(1 for f in report.findings if f.deleted),
        "remaining": report.remaining,
        "findings": [vars(f) for f in report.findings],
        "delete_failures": [list(f) for f in report.delete_failures],
        "manifest_errors": list(report.manifest_errors),
    }
    s.out.emit(document, lambda con: _render_verify(con, report, doomed, dry_run))
    failures = [reason for _, reason in report.delete_failures]
    if any(denied(r) for r in failures):
        raise delete_denied(len(failures), where=_where(s))
    if report.remaining:
        raise CommandError(_verify_problem(report, doomed, delete_corrupt, dry_run), 1)
    if report.manifest_errors:
        # NOTE: the objects are gone but the manifest still advertises them: not a success.
        raise CommandError(
            f"{report.manifest_errors[0]}: run `s3kv compact` to drop the deleted keys", 1
        )


def _confirm_verify(
    s: Session, report: VerifyReport, doomed: list[Finding], *, yes: bool, above: int, share: float
) -> None:
    """Ask before ``verify --delete-corrupt`` deletes, as prune does."""
    per_fingerprint: dict[str, int] = {}
    for f in doomed:
        per_fingerprint[f.fingerprint] = per_fingerprint.get(f.fingerprint, 0) + 1
    reasons = share_reasons(
        ((fp, n, report.blocks_by_fingerprint.get(fp, n)) for fp, n in per_fingerprint.items()),
        share,
    )
    if len(doomed) > above:
        reasons.insert(0, f"more than --confirm-above {above} objects")
    size = human_bytes(sum(f.size for f in doomed))
    confirm_deletion(
        s.out,
        command="verify",
        what=f"delete {len(doomed)} corrupt or foreign objects ({size})",
        reasons=reasons,
        can_prompt=s.rt.can_prompt(),
        yes=yes,
    )


def _verify_problem(
    report: VerifyReport, doomed: list[Finding], delete_corrupt: bool, dry_run: bool
) -> str:
    """The one error line of a verify that leaves corrupt or foreign objects."""
    ours = sum(1 for f in doomed if not f.deleted)
    others = report.remaining - ours
    parts = []
    if ours:
        if not delete_corrupt:
            fix = "see --delete-corrupt"
        elif dry_run:
            fix = "dry run: nothing deleted"
        else:
            first = report.delete_failures[0][1] if report.delete_failures else "?"
            fix = f"{len(report.delete_failures)} deletions failed: {first}"
        parts.append(f"{ours} corrupt or foreign objects remain ({fix})")
    if others:
        parts.append(
            f"{others} objects under blocks/ are not s3kv block keys: s3kv never deletes "
            "them; remove them by hand if no other tool owns them"
        )
    return "; ".join(parts)


def _render_verify(
    con: Console, report: VerifyReport, doomed: list[Finding], dry_run: bool
) -> None:
    con.print(
        f"checked {report.checked} of {report.listed} objects: {report.ok} ok, "
        f"{report.count('corrupt')} corrupt, {report.count('foreign')} foreign, "
        f"{report.count('unsupported')} of another format version or sealed, "
        f"{report.count('transient')} failed one read but not the second (kept), "
        f"{report.gone} deleted meanwhile"
    )
    if report.findings:
        t = table("findings", "verdict", "kind", "#bytes", "deleted", "key")
        for f in report.findings:
            t.add_row(f.verdict, f.kind, str(f.size), "yes" if f.deleted else "no", f.key)
        con.print(t)
    if dry_run and doomed:
        size = human_bytes(sum(f.size for f in doomed))
        con.print(f"dry run: --delete-corrupt would delete {len(doomed)} objects ({size})")
    for line in [f"{k}: {r}" for k, r in report.delete_failures] + list(report.manifest_errors):
        con.print(line, markup=False)


@bucket_command()
def compact(
    common: Common,
    full: Annotated[
        bool, typer.Option("--full", help="Also fold in a listing of every block object.")
    ] = False,
) -> None:
    """Rebuild each manifest snapshot from its segments (and a listing with --full).

    A tensor-parallel shard's manifest is its layout's: compacted once, and with --full
    rebuilt from the keys every shard holds.

    Examples:

    ```
    s3kv compact
    s3kv compact --full --fingerprint 0123456789abcdef0123456789abcdef
    ```
    """
    with common.session(write=True) as s, s.out.progress() as progress:
        report = compact_scope(
            s.backend,
            s.scope,
            prefix=s.prefix,
            fpr=s.cfg.bloom_fpr,
            full=full,
            clock=common.rt.clock,
            progress=progress,
        )
    document = {
        "command": "compact",
        "full": report.full,
        "fingerprints": [{"fingerprint": fp, **vars(r)} for fp, r in report.reports],
    }

    def render(con: Console) -> None:
        t = table(
            "compact" + (" --full" if full else ""),
            "fingerprint",
            "#generation",
            "#keys",
            "#segments folded",
            "#shards",
            "#listed",
            "note",
        )
        for fp, r in report.reports:
            note = "another compactor won: re-run" if r.lost_race else ""
            t.add_row(
                fp,
                str(r.generation),
                str(r.keys),
                str(r.segments_folded),
                str(r.shards),
                str(r.listing_keys),
                note,
            )
        con.print(t)

    s.out.emit(document, render)
    if report.lost_races:
        raise typer.Exit(1)
