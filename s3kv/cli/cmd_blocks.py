"""``s3kv prune``, ``stats``, ``verify``, ``compact``: parse, call :mod:`s3kv.ops`, print."""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Any

import typer
from rich.console import Console

from s3kv.cli.common import Common, bucket_command
from s3kv.cli.context import CommandError
from s3kv.cli.output import Output, ago, human_bytes, table
from s3kv.config import parse_duration
from s3kv.ops.compaction import compact_scope
from s3kv.ops.prune import PrunePlan, PruneReport, Tally, execute_prune, plan_prune
from s3kv.ops.stats import AGE_BUCKETS, KindStats, PriceTable, StatsReport, collect_stats
from s3kv.ops.verify import VerifyReport, verify_objects
from s3kv.storage import DELETE_BATCH

__all__ = ["compact", "prune", "stats", "verify"]


@bucket_command()
def prune(
    common: Common,
    older_than: Annotated[
        str,
        typer.Option(
            "--older-than",
            help="Delete blocks not used within this window: 90s, 30m, 12h, 7d, 2w.",
            show_default=False,
        ),
    ],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would go.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Skip the confirmation.")] = False,
    confirm_above: Annotated[
        int, typer.Option("--confirm-above", min=0, help="Ask first above this many objects.")
    ] = 1000,
    batch_size: Annotated[
        int,
        typer.Option("--batch-size", min=1, max=DELETE_BATCH, help="Keys per DeleteObjects."),
    ] = DELETE_BATCH,
) -> None:
    """Delete blocks no engine used within a window; pinned prefixes are kept.

    Last use is the later of the manifest's last write/hit and the object's LastModified.
    The manifest snapshot is rewritten afterwards so engines stop advertising deleted keys.
    Safe to re-run: an interrupted prune finishes on the next run.
    """
    rt = common.rt
    window = parse_duration(older_than, name="--older-than")
    if window <= 0:
        raise CommandError("--older-than: must be more than 0 (0 would delete every block)")
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
        _confirm(out, rt.can_prompt(), plan, yes=yes, above=confirm_above)
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
        reason = _unfinished(report)
        raise CommandError(
            f"prune did not finish ({reason}): re-run the same command to complete it", 1
        )


def _unfinished(report: PruneReport) -> str:
    if report.interrupted:
        return f"stopped: {report.interrupted}"
    failed = report.failed.objects
    errors = [o.manifest_error for o in report.outcomes if o.manifest_error]
    return f"{failed} objects not deleted" if failed else f"manifest {errors[0]}"


def _confirm(out: Output, can_prompt: bool, plan: PrunePlan, *, yes: bool, above: int) -> None:
    going = plan.to_delete
    if yes or going.objects <= above:
        return
    what = f"delete {going.objects} objects ({human_bytes(going.bytes)})"
    if not can_prompt:
        raise CommandError(
            f"prune would {what}, more than --confirm-above {above}, and there is no terminal "
            "to confirm on: re-run with --yes (or --dry-run to see the plan)",
            exit_code=1,
        )
    out.err.print(f"prune will {what}; {plan.kept.objects} objects are kept.", markup=False)
    if not typer.confirm("Proceed?", default=False, err=True):
        raise CommandError("aborted: nothing was deleted", exit_code=1)


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
            min=0,
            help="Headers read per fingerprint when its "
            "identity.json does not give the raw block size.",
        ),
    ] = 8,
    prices: Annotated[
        str | None,
        typer.Option(
            "--prices",
            help="Price table (TOML/JSON): storage_per_gib_month, "
            "put_per_1000, get_per_1000, name. Default: AWS S3 Standard us-east-1.",
        ),
    ] = None,
) -> None:
    """Per fingerprint: blocks, compression, age and last-use histograms, hits, pins; every
    object s3kv wrote, by kind (blocks, manifest segments, log, deltas, snapshots,
    identity, other), with bytes and storage cost; and the estimated monthly cost."""
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
        int, typer.Option("--sample", min=1, help="Objects per fingerprint, chosen at random.")
    ] = 100,
    all_: Annotated[bool, typer.Option("--all", help="Verify every object.")] = False,
    seed: Annotated[int | None, typer.Option("--seed", help="Seed of the sample.")] = None,
    delete_corrupt: Annotated[
        bool, typer.Option("--delete-corrupt", help="Delete corrupt and foreign objects.")
    ] = False,
) -> None:
    """Read objects back and verify header and checksum as an engine would.

    Exits 1 if corrupt or foreign objects remain in the bucket.
    """
    with common.session(write=delete_corrupt) as s, s.out.progress() as progress:
        report = verify_objects(
            s.backend,
            s.scope,
            prefix=s.prefix,
            sample=None if all_ else sample,
            seed=seed,
            delete=delete_corrupt,
            fpr=s.cfg.bloom_fpr,
            threads=s.cfg.io_threads,
            clock=common.rt.clock,
            progress=progress,
        )
    document = {
        "command": "verify",
        "listed": report.listed,
        "checked": report.checked,
        "ok": report.ok,
        "gone": report.gone,
        "corrupt": report.count("corrupt"),
        "foreign": report.count("foreign"),
        "unsupported": report.count("unsupported"),
        "remaining": report.remaining,
        "findings": [vars(f) for f in report.findings],
        "delete_failures": [list(f) for f in report.delete_failures],
        "manifest_errors": list(report.manifest_errors),
    }
    s.out.emit(document, lambda con: _render_verify(con, report))
    if report.remaining or report.delete_failures:
        fix = "see --delete-corrupt" if not delete_corrupt else "the deletions failed"
        raise CommandError(f"{report.remaining} corrupt or foreign objects remain ({fix})", 1)


def _render_verify(con: Console, report: VerifyReport) -> None:
    con.print(
        f"checked {report.checked} of {report.listed} objects: {report.ok} ok, "
        f"{report.count('corrupt')} corrupt, {report.count('foreign')} foreign, "
        f"{report.count('unsupported')} of another format version, "
        f"{report.gone} deleted meanwhile"
    )
    if report.findings:
        t = table("findings", "verdict", "kind", "#bytes", "deleted", "key")
        for f in report.findings:
            t.add_row(f.verdict, f.kind, str(f.size), "yes" if f.deleted else "no", f.key)
        con.print(t)
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
