"""The ``s3kv`` command tree and its error policy.

Expected failures — a bad flag or setting, a missing bucket, denied credentials, an
unreachable endpoint, a refused confirmation — print exactly one line ``Error: <what>:
<fix>`` to stderr and exit non-zero without a traceback:

* 2 — usage or configuration error (bad flag, bad duration, no bucket configured);
* 1 — the operation failed or found problems (storage error, verify findings, doctor
  failures, an unfinished prune);
* 130 — interrupted (every command is safe to re-run).

Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

import typer
from typer.core import TyperGroup

from s3kv.cli import cmd_admin, cmd_blocks, cmd_pins
from s3kv.cli.context import CommandError
from s3kv.cli.output import error_line
from s3kv.errors import ConfigError, S3KVError

__all__ = ["app", "run"]

_INTERRUPTED = 130


def _exit_code(exc: BaseException) -> tuple[int, str]:
    """(exit status, message) for an expected failure."""
    if isinstance(exc, CommandError):
        return exc.exit_code, str(exc)
    if isinstance(exc, ConfigError):
        return 2, str(exc)
    if isinstance(exc, S3KVError):
        return 1, str(exc)
    if isinstance(exc, typer.Abort):
        return 1, "aborted"
    # typer.TyperException: click's usage and parameter errors (typer vendors click).
    message = exc.format_message() if isinstance(exc, typer.TyperException) else str(exc)
    ctx = getattr(exc, "ctx", None)
    if ctx is not None and getattr(exc, "exit_code", 1) == 2:
        message = f"{message} (see `{ctx.command_path} --help`)"
    return int(getattr(exc, "exit_code", 1)), message


class _Group(TyperGroup):
    """The root group: runs the command tree and applies the error policy (module doc)."""

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            code = code if isinstance(code, int) else 0
        except (S3KVError, CommandError, typer.TyperException, typer.Abort) as exc:
            code, message = _exit_code(exc)
            typer.echo(error_line(message), err=True)
        if code == _INTERRUPTED:  # typer turns Ctrl-C into this status, silently
            message = "interrupted: every s3kv command is safe to re-run; a prune re-run "
            typer.echo(error_line(message + "finishes what this one started"), err=True)
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    cls=_Group,
    name="s3kv",
    help="Operate the s3kv KV-cache bucket: prune, stats, verify, compact, pins, doctor.",
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", help="Print the version and exit."),
) -> None:
    """Settings come from TLLM_S3KV_* variables, the TOML file named by TLLM_S3KV_CONFIG
    and the AWS credential chain, like the engines'; --bucket/--prefix/--endpoint-url/
    --profile override them. Every command takes --json."""
    if version:
        from s3kv import __version__

        typer.echo(f"s3kv {__version__}")
        raise typer.Exit(0)
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())
        raise typer.Exit(0)


app.command("prune")(cmd_blocks.prune)
app.command("stats")(cmd_blocks.stats)
app.command("verify")(cmd_blocks.verify)
app.command("compact")(cmd_blocks.compact)
app.command("pin")(cmd_pins.pin)
app.command("unpin")(cmd_pins.unpin)
app.command("pins")(cmd_pins.pins)
app.command("doctor")(cmd_admin.doctor)
app.add_typer(cmd_admin.local_s3_app, name="local-s3")


def run(argv: Sequence[str] | None = None) -> None:
    """The console script: configure logging for a terminal, run, exit with the status."""
    # NOTE: the library never configures handlers; the CLI is an application and shows the
    # library's warnings (a corrupt segment skipped...) as plain lines on stderr.
    logging.basicConfig(level=logging.WARNING, format="s3kv: %(levelname)s: %(message)s")
    logging.getLogger("botocore").setLevel(logging.ERROR)
    app(args=list(argv) if argv is not None else None, prog_name="s3kv")
