"""``s3kv pin``, ``unpin``, ``pins``: parse, call :mod:`s3kv.ops.pins`, print."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from s3kv.cli.context import (
    BucketOpt,
    CommandError,
    EndpointOpt,
    FingerprintOpt,
    JsonOpt,
    ModelOpt,
    PrefixOpt,
    ProfileOpt,
    Runtime,
    connect,
    load_config,
    runtime,
)
from s3kv.cli.output import Output, iso, table
from s3kv.ops.pins import (
    PinReport,
    PinTarget,
    keys_from_hex,
    keys_from_text,
    list_pins,
    load_tokenizer,
    set_pins,
)
from s3kv.ops.scope import Fingerprint, resolve_scope

__all__ = ["pin", "pins", "unpin"]

_BY_TEXT = "From prompt text (needs transformers)"

KeysArg = Annotated[
    list[str] | None,
    typer.Argument(help="Block keys (32 hex digits each).", show_default=False),
]
TextOpt = Annotated[
    Path | None,
    typer.Option("--text", help="File holding the prompt text ('-' for stdin).",
                 rich_help_panel=_BY_TEXT, allow_dash=True),
]  # fmt: skip
TokenizerOpt = Annotated[
    str | None,
    typer.Option("--tokenizer", help="Tokenizer directory or Hugging Face model name.",
                 rich_help_panel=_BY_TEXT),
]  # fmt: skip
TokensPerBlockOpt = Annotated[
    int | None,
    typer.Option("--tokens-per-block", min=1, rich_help_panel=_BY_TEXT,
                 help="Tokens per block (default: from the fingerprint's identity.json)."),
]  # fmt: skip
SpecialOpt = Annotated[
    bool,
    typer.Option("--special-tokens/--no-special-tokens", rich_help_panel=_BY_TEXT,
                 help="Let the tokenizer add its special tokens (BOS...), as engines do."),
]  # fmt: skip


def pin(
    ctx: typer.Context,
    keys: KeysArg = None,
    text: TextOpt = None,
    tokenizer: TokenizerOpt = None,
    tokens_per_block: TokensPerBlockOpt = None,
    special_tokens: SpecialOpt = True,
    model: ModelOpt = None,
    fingerprint: FingerprintOpt = None,
    bucket: BucketOpt = None,
    prefix: PrefixOpt = None,
    endpoint_url: EndpointOpt = None,
    profile: ProfileOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Pin blocks so prune keeps them (with their prefix) and warm start stages them first.

    Name the blocks by key, or give prompt text and a tokenizer: every full block of the
    text is pinned. Exits 1 if no named block exists in any fingerprint in scope.
    """
    _set(runtime(ctx), True, keys, text, tokenizer, tokens_per_block, special_tokens, model,
         fingerprint, bucket, prefix, endpoint_url, profile, json_out)  # fmt: skip


def unpin(
    ctx: typer.Context,
    keys: KeysArg = None,
    text: TextOpt = None,
    tokenizer: TokenizerOpt = None,
    tokens_per_block: TokensPerBlockOpt = None,
    special_tokens: SpecialOpt = True,
    model: ModelOpt = None,
    fingerprint: FingerprintOpt = None,
    bucket: BucketOpt = None,
    prefix: PrefixOpt = None,
    endpoint_url: EndpointOpt = None,
    profile: ProfileOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Undo pin (by key or by prompt text, as for pin)."""
    _set(runtime(ctx), False, keys, text, tokenizer, tokens_per_block, special_tokens, model,
         fingerprint, bucket, prefix, endpoint_url, profile, json_out)  # fmt: skip


def _set(
    rt: Runtime,
    on: bool,
    keys: list[str] | None,
    text: Path | None,
    tokenizer: str | None,
    tokens_per_block: int | None,
    special_tokens: bool,
    model: str | None,
    fingerprint: list[str] | None,
    bucket: str | None,
    prefix: str | None,
    endpoint_url: str | None,
    profile: str | None,
    json_out: bool,
) -> None:
    targets_for = _targets(keys, text, tokenizer, tokens_per_block, special_tokens)
    cfg = load_config(rt, bucket=bucket, prefix=prefix, endpoint_url=endpoint_url,
                      profile=profile)  # fmt: skip
    out = Output(json_out, rt)
    with connect(rt, cfg, write=True) as backend:
        scope = resolve_scope(backend, cfg.key_prefix, fingerprints=fingerprint or (),
                              model=model)  # fmt: skip
        out.scope(scope, backend.description)
        report = set_pins(backend, scope, targets_for, prefix=cfg.key_prefix, pin=on,
                          clock=rt.clock)  # fmt: skip
    document = {"command": "pin" if on else "unpin", "found_any": report.found_any,
                "fingerprints": [vars(o) for o in report.outcomes]}  # fmt: skip
    out.emit(document, lambda con: _render_set(con, report))
    if not report.found_any:
        out.note("none of the blocks exists in any fingerprint in scope (wrong --model, "
                 "--tokens-per-block or tokenizer?)")  # fmt: skip
        raise typer.Exit(1)


def _targets(
    keys: list[str] | None,
    text: Path | None,
    tokenizer: str | None,
    tokens_per_block: int | None,
    special_tokens: bool,
) -> Callable[[Fingerprint], Sequence[PinTarget]]:
    """``fingerprint -> targets``; validates the flags before any network I/O."""
    if keys and text is not None:
        raise CommandError("give block KEYs or --text FILE, not both")
    if keys:
        fixed = keys_from_hex(keys)
        return lambda fp: fixed
    if text is None:
        raise CommandError("give block KEYs, or --text FILE with --tokenizer NAME_OR_PATH")
    if tokenizer is None:
        raise CommandError("--text needs --tokenizer NAME_OR_PATH")
    prompt = _read_text(text)
    tok = load_tokenizer(tokenizer)

    def from_text(fp: Fingerprint) -> list[PinTarget]:
        size = tokens_per_block or fp.tokens_per_block
        if size is None:
            raise CommandError(f"fingerprint {fp.fingerprint} has no identity.json giving "
                               "tokens_per_block: pass --tokens-per-block")  # fmt: skip
        return keys_from_text(prompt, tok, size, add_special_tokens=special_tokens)

    return from_text


def _read_text(path: Path) -> str:
    if str(path) == "-":
        return typer.get_text_stream("stdin").read()
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CommandError(f"--text: cannot read {path} ({exc})") from exc


def _render_set(con: Console, report: PinReport) -> None:
    verb = "pinned" if report.pin else "unpinned"
    t = table(verb, "fingerprint", "#requested", f"#{verb}", "#already", "#adopted", "#missing")
    for o in report.outcomes:
        t.add_row(o.fingerprint, str(o.requested), str(o.changed), str(o.unchanged),
                  str(o.adopted), str(o.missing))  # fmt: skip
    con.print(t)


def pins(
    ctx: typer.Context,
    model: ModelOpt = None,
    fingerprint: FingerprintOpt = None,
    bucket: BucketOpt = None,
    prefix: PrefixOpt = None,
    endpoint_url: EndpointOpt = None,
    profile: ProfileOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """List pinned blocks."""
    rt = runtime(ctx)
    cfg = load_config(rt, bucket=bucket, prefix=prefix, endpoint_url=endpoint_url,
                      profile=profile)  # fmt: skip
    out = Output(json_out, rt)
    with connect(rt, cfg, write=False) as backend:
        scope = resolve_scope(backend, cfg.key_prefix, fingerprints=fingerprint or (),
                              model=model)  # fmt: skip
        out.scope(scope, backend.description)
        found = list_pins(backend, scope, prefix=cfg.key_prefix)

    def render(con: Console) -> None:
        t = table(f"{len(found)} pinned blocks", "fingerprint", "model", "key", "#bytes",
                  "#hits", "last used (UTC)")  # fmt: skip
        for p in found:
            t.add_row(p.fingerprint, p.model or "?", p.key, str(p.size), str(p.hits),
                      iso(p.last_used))  # fmt: skip
        con.print(t)

    out.emit({"command": "pins", "pins": [vars(p) for p in found]}, render)
