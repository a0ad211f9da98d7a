"""The ``s3kv`` command tree and its error policy.

Expected failures — a bad flag or setting, a missing bucket, denied credentials, an
unreachable endpoint, a refused confirmation — print exactly one line ``Error: <what>:
<fix>`` to stderr and exit non-zero without a traceback:

* 2 — usage or configuration error (bad flag, bad duration, no bucket configured,
  nothing in scope);
* 1 — the operation failed or found problems (storage error, verify findings, doctor
  failures, an unfinished prune, a refused permission, a refused confirmation);
* 130 — interrupted (every command is safe to re-run), Ctrl-C at a prompt included.

With ``--json`` a failure also prints ``{"error": ..., "command": ..., "exit_code": ...}``
on stdout, unless the command printed its own document first (an unfinished prune's
report says what is left). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

import typer

from s3kv.cli import cmd_admin, cmd_blocks, cmd_keys, cmd_pins
from s3kv.cli.context import CommandError
from s3kv.cli.output import error_line, json_emitted
from s3kv.cli.plain import PlainCommand, PlainGroup
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


class _Group(PlainGroup):
    """The root group: runs the command tree and applies the error policy (module doc)."""

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        argv = list(args) if args is not None else sys.argv[1:]
        json_emitted(reset=True)
        message: str | None = None
        try:
            code = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
            code = code if isinstance(code, int) else 0
        except (S3KVError, CommandError, typer.TyperException, typer.Abort) as exc:
            code, message = _exit_code(exc)
        if code == _INTERRUPTED and message is None:  # typer turns Ctrl-C into it, silently
            message = (
                "interrupted: every s3kv command is safe to re-run; a prune re-run "
                "finishes what this one started"
            )
        if message is not None:
            typer.echo(error_line(message), err=True)
        if code and "--json" in argv and not json_emitted():
            document = {
                "error": " ".join((message or f"exit status {code}").split()),
                "command": self._command_name(argv),
                "exit_code": code,
            }
            typer.echo(json.dumps(document, indent=2, sort_keys=True))
        if standalone_mode:
            sys.exit(code)
        return code

    def _command_name(self, argv: Sequence[str]) -> str | None:
        """The (sub)command ``argv`` names (``prune``, ``local-s3 start``), if any."""
        names: list[str] = []
        group: Any = self
        for arg in argv:
            if arg.startswith("-"):
                continue
            command = getattr(group, "commands", {}).get(arg)
            if command is None:
                break
            names.append(arg)
            group = command
        return " ".join(names) or None


app = typer.Typer(
    cls=_Group,
    name="s3kv",
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
    """Operate the s3kv KV-cache bucket: prune, stats, verify, compact, pins, doctor.

    Settings come from TLLM_S3KV_* variables, the TOML file named by TLLM_S3KV_CONFIG
    and the AWS credential chain, like the engines'; --bucket/--prefix/--endpoint-url/
    --profile/--region/--ca-bundle override them. Every command takes --json.

    Examples:

    ```
    s3kv doctor --role pruner
    s3kv stats --model 'meta-llama/*'
    s3kv prune --older-than 7d --dry-run
    ```
    """
    if version:
        from s3kv import __version__

        typer.echo(f"s3kv {__version__}")
        raise typer.Exit(0)
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())
        raise typer.Exit(0)


app.command("prune", cls=PlainCommand)(cmd_blocks.prune)
app.command("stats", cls=PlainCommand)(cmd_blocks.stats)
app.command("verify", cls=PlainCommand)(cmd_blocks.verify)
app.command("compact", cls=PlainCommand)(cmd_blocks.compact)
app.command("pin", cls=PlainCommand)(cmd_pins.pin)
app.command("unpin", cls=PlainCommand)(cmd_pins.unpin)
app.command("pins", cls=PlainCommand)(cmd_pins.pins)
app.command("doctor", cls=PlainCommand)(cmd_admin.doctor)
app.add_typer(cmd_admin.local_s3_app, name="local-s3")
app.add_typer(cmd_keys.keys_app, name="keys")


def run(argv: Sequence[str] | None = None) -> None:
    """The console script: configure logging for a terminal, run, exit with the status."""
    # NOTE: the library never configures handlers; the CLI is an application and shows the
    # library's warnings (a corrupt segment skipped...) as plain lines on stderr.
    logging.basicConfig(level=logging.WARNING, format="s3kv: %(levelname)s: %(message)s")
    logging.getLogger("botocore").setLevel(logging.ERROR)
    app(args=list(argv) if argv is not None else None, prog_name="s3kv")
