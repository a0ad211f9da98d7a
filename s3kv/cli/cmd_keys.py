"""``s3kv keys new``: make a block key line for ``auth_keys`` (parse, call, print)."""

from __future__ import annotations

from typing import Annotated

import typer

from s3kv.auth import new_key_line
from s3kv.cli.context import CommandError
from s3kv.cli.plain import PlainCommand, PlainGroup
from s3kv.errors import ConfigError

__all__ = ["keys_app"]

keys_app = typer.Typer(name="keys", cls=PlainGroup, rich_markup_mode="markdown")


@keys_app.callback(invoke_without_command=True)
def keys(ctx: typer.Context) -> None:
    """Block keys for the `auth_keys` setting (sealed, authenticated blocks).

    Examples:

    ```
    (umask 077; s3kv keys new 2026-11 > /etc/s3kv/keys)
    s3kv keys new 2026-11 --kms-key arn:aws:kms:us-east-1:111122223333:key/1234 >> data-keys
    ```
    """
    if ctx.invoked_subcommand is None:  # NOTE: help, exit 0 (no "Error:" line)
        typer.echo(ctx.get_help())
        raise typer.Exit(0)


@keys_app.command("new", cls=PlainCommand)
def new(
    key_id: Annotated[
        str,
        typer.Argument(
            metavar="KEY_ID",
            help="Name of the key, written into every block it seals (not secret), e.g. "
            "the month: 2026-11.",
        ),
    ],
    kms_key: Annotated[
        str | None,
        typer.Option(
            "--kms-key",
            metavar="ARN",
            help="Make a data key encrypted under this AWS KMS key and print "
            "'KEY_ID CIPHERTEXT' for an auth_keys = kms:PATH file (needs "
            "kms:GenerateDataKeyWithoutPlaintext; engines need kms:Decrypt).",
        ),
    ] = None,
    region: Annotated[
        str | None, typer.Option("--region", metavar="REGION", help="KMS region.")
    ] = None,
) -> None:
    """Print one key line on stdout: 'KEY_ID SECRET' (or 'KEY_ID CIPHERTEXT' with --kms-key).

    Append it to the key file that auth_keys names (chmod 600). The first line of that file
    seals new blocks; every line opens blocks. To rotate, put the new line first and remove
    the old one once its blocks are rewritten or pruned.

    Examples:

    ```
    (umask 077; s3kv keys new 2026-11 > /etc/s3kv/keys)
    s3kv keys new 2026-11 --kms-key arn:aws:kms:us-east-1:111122223333:key/1234 >> data-keys
    ```
    """
    try:
        line = new_key_line(key_id)
        if kms_key is not None:
            from s3kv.storage import kms_generate

            line = f"{key_id} {kms_generate(kms_key, region=region)}"
    except ConfigError as exc:
        raise CommandError(str(exc)) from None
    typer.echo(line)
