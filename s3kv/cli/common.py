"""The one helper every bucket command uses: shared options in, an open session out.

A command declares only its own options and takes :class:`Common` first::

    @bucket_command()
    def stats(common: Common, sample: SampleOpt = 8) -> None:
        ...  # validate its own flags first: no I/O happens before the session
        with common.session(write=False) as s:
            report = collect_stats(s.backend, s.scope, prefix=s.prefix, clock=s.rt.clock)
        s.out.emit(...)

:func:`bucket_command` appends the shared options (scope, connection, ``--json``) to the
command's signature, so every command's ``--help`` lists them in the same place, and hands
the command their values as one :class:`Common`. :meth:`Common.session` then does what each
command used to repeat: settings (:func:`~s3kv.cli.context.load_config`), the output, the
checked backend (:func:`~s3kv.cli.context.connect`, through
:func:`s3kv.storage.open_backend`) and the scope (:func:`~s3kv.ops.scope.resolve_scope`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec

import typer

from s3kv.cli.context import (
    BucketOpt,
    CaBundleOpt,
    EndpointOpt,
    FingerprintOpt,
    JsonOpt,
    ModelOpt,
    PrefixOpt,
    ProfileOpt,
    RegionOpt,
    Runtime,
    connect,
    load_config,
    runtime,
)
from s3kv.cli.output import Output
from s3kv.config import S3KVConfig
from s3kv.ops.scope import Fingerprint, resolve_scope
from s3kv.storage import Backend

__all__ = ["Common", "Session", "bucket_command"]

_P = ParamSpec("_P")


def _option(name: str, annotation: object, default: object) -> inspect.Parameter:
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
    )


# NOTE: this order is the order of --help (and of the signatures before this module).
_SCOPE_OPTIONS = (_option("model", ModelOpt, None), _option("fingerprint", FingerprintOpt, None))
_CONNECTION_OPTIONS = (
    _option("bucket", BucketOpt, None),
    _option("prefix", PrefixOpt, None),
    _option("endpoint_url", EndpointOpt, None),
    _option("profile", ProfileOpt, None),
    _option("region", RegionOpt, None),
    _option("ca_bundle", CaBundleOpt, None),
    _option("json_out", JsonOpt, False),
)
_CTX = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)


@dataclass(frozen=True)
class Session:
    """What a bucket command works with, open for the ``with`` block of :meth:`Common.session`.

    Attributes:
        rt: The runtime (clock, prompts).
        cfg: The settings.
        out: Where results go (usable after the block too).
        backend: The checked bucket (closed when the block ends).
        scope: The fingerprints in scope (``[]`` for a command without scope options).
    """

    rt: Runtime
    cfg: S3KVConfig
    out: Output
    backend: Backend
    scope: list[Fingerprint]

    @property
    def prefix(self) -> str:
        """The configured key prefix."""
        return self.cfg.key_prefix


@dataclass(frozen=True)
class Common:
    """The shared options of a bucket command, as given, and the runtime.

    Attributes:
        rt: The runtime seam (:class:`~s3kv.cli.context.Runtime`).
        bucket, prefix, endpoint_url, profile, region, ca_bundle: Connection overrides
            (``None``: not given).
        json_out: ``--json``.
        model: ``--model`` (``None`` for any, or a command without scope options).
        fingerprint: ``--fingerprint`` values (``None``: all).
        scoped: Whether the command has the scope options.
    """

    rt: Runtime
    bucket: str | None
    prefix: str | None
    endpoint_url: str | None
    profile: str | None
    json_out: bool
    region: str | None = None
    ca_bundle: str | None = None
    model: str | None = None
    fingerprint: list[str] | None = None
    scoped: bool = True

    def overrides(self) -> dict[str, str | None]:
        """The connection flags as settings overrides (``None``: not given)."""
        return {
            "bucket": self.bucket,
            "prefix": self.prefix,
            "endpoint_url": self.endpoint_url,
            "profile": self.profile,
            "region": self.region,
            "ca_bundle": self.ca_bundle,
        }

    def output(self) -> Output:
        """Where this command's results go."""
        return Output(self.json_out, self.rt)

    @contextlib.contextmanager
    def session(self, *, write: bool) -> Iterator[Session]:
        """Settings, output, the checked bucket and the scope; the bucket closed on exit.

        A read-only command (``write=False``) opens the bucket with ``conditional_put="off"``:
        no conditional-PUT probe, so no scratch PUT and no warning with read-only credentials.

        Args:
            write: The command writes (see :func:`~s3kv.cli.context.connect`).

        Raises:
            ConfigError: a bad setting, ``--model`` or ``--fingerprint``; nothing in scope (no
                fingerprint under the prefix: a wrong ``--prefix`` or ``--bucket``).
            CommandError: no bucket configured.
            StorageError: the bucket is missing, denied or unreachable.
        """
        cfg = load_config(self.rt, **self.overrides())
        out = self.output()
        with connect(self.rt, cfg, write=write) as backend:
            scope: list[Fingerprint] = []
            if self.scoped:
                scope = resolve_scope(
                    backend, cfg.key_prefix, fingerprints=self.fingerprint or (), model=self.model
                )
            yield Session(self.rt, cfg, out, backend, scope)


def bucket_command(
    *, scoped: bool = True
) -> Callable[[Callable[Concatenate[Common, _P], None]], Callable[..., None]]:
    """Give a command the shared options; it receives them as its first argument.

    The command's own parameters keep their place; ``--model``/``--fingerprint`` (with
    ``scoped``), the connection options and ``--json`` follow, as typer reads the
    signature. The returned function is what typer registers.
    """
    shared = (_SCOPE_OPTIONS if scoped else ()) + _CONNECTION_OPTIONS

    def decorate(func: Callable[Concatenate[Common, _P], None]) -> Callable[..., None]:
        own = list(inspect.signature(func, eval_str=True).parameters.values())[1:]
        call: Callable[..., None] = func  # NOTE: typer passes the options by name

        @functools.wraps(func)
        def command(ctx: typer.Context, **kwargs: Any) -> None:
            values = {p.name: kwargs.pop(p.name) for p in shared}
            call(Common(runtime(ctx), scoped=scoped, **values), **kwargs)

        params = [_CTX, *own, *shared]
        # NOTE: typer reads __signature__ (inspect.signature stops at it) and resolved
        # annotations; the wrapped function's string annotations would not resolve here.
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate
