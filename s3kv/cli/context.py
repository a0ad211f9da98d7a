"""What every command shares: the runtime seam, common options, settings and the bucket.

:class:`Runtime` is the one seam tests use: ``CliRunner().invoke(app, args,
obj=Runtime(clock=...))`` injects the clock, a backend factory (a failing backend, an
in-memory one), the environment and whether a human is at the terminal. Commands read it
with :func:`runtime`; in production it is all defaults. Commands do not call the rest
directly: :mod:`s3kv.cli.common` adds the options to them and opens the session.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from s3kv.config import S3KVConfig
from s3kv.storage import Backend, is_file_url, open_backend

__all__ = [
    "BucketOpt",
    "CaBundleOpt",
    "CommandError",
    "EndpointOpt",
    "FingerprintOpt",
    "JsonOpt",
    "ModelOpt",
    "PrefixOpt",
    "ProfileOpt",
    "RegionOpt",
    "Runtime",
    "connect",
    "load_config",
    "runtime",
]

_CONNECTION = "Connection (default: the TLLM_S3KV_* settings and the AWS chain)"
_SCOPE = "Scope (default: every fingerprint under the prefix)"

BucketOpt = Annotated[
    str | None,
    typer.Option("--bucket", metavar="NAME", help="Bucket name.", rich_help_panel=_CONNECTION),
]
PrefixOpt = Annotated[
    str | None,
    typer.Option("--prefix", metavar="PREFIX", help="Key prefix.", rich_help_panel=_CONNECTION),
]
EndpointOpt = Annotated[
    str | None,
    typer.Option(
        "--endpoint-url", metavar="URL", help="S3 endpoint URL.", rich_help_panel=_CONNECTION
    ),
]
ProfileOpt = Annotated[
    str | None,
    typer.Option(
        "--profile", metavar="NAME", help="AWS shared-config profile.", rich_help_panel=_CONNECTION
    ),
]
RegionOpt = Annotated[
    str | None,
    typer.Option(
        "--region",
        metavar="REGION",
        help="AWS region (default: the profile's or AWS_REGION).",
        rich_help_panel=_CONNECTION,
    ),
]
CaBundleOpt = Annotated[
    str | None,
    typer.Option(
        "--ca-bundle",
        metavar="FILE",
        help="CA bundle (PEM) for an endpoint with a private certificate authority.",
        rich_help_panel=_CONNECTION,
    ),
]
JsonOpt = Annotated[
    bool,
    typer.Option(
        "--json",
        help="Print one JSON document to stdout instead of tables (on failure: "
        '{"error": ..., "command": ...}).',
    ),
]
ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        metavar="PATTERN",
        help="Only fingerprints whose identity.json model_id matches (shell wildcards).",
        rich_help_panel=_SCOPE,
    ),
]
FingerprintOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--fingerprint",
        metavar="FINGERPRINT",
        help="Only this fingerprint (repeatable).",
        rich_help_panel=_SCOPE,
    ),
]


class CommandError(Exception):
    """An expected failure of a command: printed as one ``Error:`` line, no traceback.

    Attributes:
        exit_code: The process exit status (2: usage, 1: operation refused or failed, 130:
            interrupted at a prompt).
    """

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Runtime:
    """Time, environment and I/O seams of the CLI (all defaults in production).

    Attributes:
        clock: Epoch seconds ("now" for prune windows, stats ages, records, compaction).
        open_backend: Builds the backend from settings; default
            :func:`s3kv.storage.open_backend` (a ``file://`` directory or S3).
        environ: Environment the settings are read from; default ``os.environ``.
        interactive: Whether a human can answer a prompt and watch a progress bar;
            default: stdin (prompts) and stderr (progress) are terminals.
    """

    clock: Callable[[], float] = time.time
    open_backend: Callable[[S3KVConfig], Backend] | None = None
    environ: Mapping[str, str] | None = None
    interactive: bool | None = None

    def can_prompt(self) -> bool:
        """Whether a confirmation prompt can be answered."""
        return self.interactive if self.interactive is not None else sys.stdin.isatty()

    def shows_progress(self) -> bool:
        """Whether progress bars go to stderr (a terminal), not a pipe or a log."""
        return self.interactive if self.interactive is not None else sys.stderr.isatty()


def runtime(ctx: typer.Context) -> Runtime:
    """The :class:`Runtime` passed as the context object, or the defaults."""
    found = ctx.find_object(Runtime)
    return found if found is not None else Runtime()


def load_config(
    rt: Runtime,
    *,
    bucket: str | None,
    prefix: str | None,
    endpoint_url: str | None,
    profile: str | None,
    region: str | None = None,
    ca_bundle: str | None = None,
) -> S3KVConfig:
    """Settings: defaults < ``TLLM_S3KV_CONFIG`` file < ``TLLM_S3KV_*`` env < flags.

    Raises:
        ConfigError: a setting is invalid (the message names it).
        CommandError: no bucket is configured (a ``file://`` endpoint needs none), or
            ``--ca-bundle`` names no file.
    """
    if ca_bundle is not None and not Path(ca_bundle).is_file():
        raise CommandError(f"--ca-bundle: no such file: {ca_bundle}")
    cfg = S3KVConfig.load(
        environ=rt.environ,
        bucket=bucket,
        prefix=prefix,
        endpoint_url=endpoint_url,
        profile=profile,
        region=region,
        ca_bundle=ca_bundle,
    )
    if not cfg.bucket and not is_file_url(cfg.endpoint_url):
        raise CommandError("no bucket configured: pass --bucket or set TLLM_S3KV_BUCKET")
    return cfg


@contextlib.contextmanager
def connect(rt: Runtime, cfg: S3KVConfig, *, write: bool) -> Iterator[Backend]:
    """The bucket, checked (HeadBucket); closed on exit.

    Args:
        rt: The runtime (backend factory).
        cfg: Settings.
        write: The command writes the manifest: keep ``conditional_put`` as configured (the
            "auto" probe PUTs a scratch key). Read-only commands turn it off, so that they
            issue no PUT and work with read-only credentials.

    Raises:
        StorageError: missing bucket, denied credentials, unreachable endpoint (one line
            with the remedy).
    """
    if not write:
        cfg = cfg.replace(conditional_put="off")
    backend = (rt.open_backend or open_backend)(cfg)
    try:
        backend.check()
        yield backend
    finally:
        backend.close()
