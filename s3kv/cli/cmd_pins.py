"""``s3kv pin``, ``unpin``, ``pins``: parse, call :mod:`s3kv.ops.pins`, print."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from s3kv.cli.common import Common, bucket_command
from s3kv.cli.context import CommandError
from s3kv.cli.output import iso, table
from s3kv.ops.pins import (
    PinReport,
    PinTarget,
    keys_from_hex,
    keys_from_text,
    list_pins,
    load_tokenizer,
    set_pins,
)
from s3kv.ops.scope import Fingerprint

__all__ = ["pin", "pins", "unpin"]

_BY_TEXT = "From prompt text (needs transformers)"

KeysArg = Annotated[
    list[str] | None,
    typer.Argument(metavar="KEY", help="Block keys (32 hex digits each).", show_default=False),
]
TextOpt = Annotated[
    Path | None,
    typer.Option(
        "--text",
        metavar="FILE",
        help="File holding the prompt text ('-' for stdin).",
        rich_help_panel=_BY_TEXT,
        allow_dash=True,
    ),
]
TokenizerOpt = Annotated[
    str | None,
    typer.Option(
        "--tokenizer",
        metavar="NAME_OR_PATH",
        help="Tokenizer directory or Hugging Face model name.",
        rich_help_panel=_BY_TEXT,
    ),
]
TokensPerBlockOpt = Annotated[
    int | None,
    typer.Option(
        "--tokens-per-block",
        metavar="N",
        min=1,
        rich_help_panel=_BY_TEXT,
        help="Tokens per block (default: from the fingerprint's identity.json).",
    ),
]
SpecialOpt = Annotated[
    bool,
    typer.Option(
        "--special-tokens/--no-special-tokens",
        rich_help_panel=_BY_TEXT,
        help="Let the tokenizer add its special tokens (BOS...), as engines do.",
    ),
]


@bucket_command()
def pin(
    common: Common,
    keys: KeysArg = None,
    text: TextOpt = None,
    tokenizer: TokenizerOpt = None,
    tokens_per_block: TokensPerBlockOpt = None,
    special_tokens: SpecialOpt = True,
) -> None:
    """Pin blocks so prune keeps them (with their prefix) and warm start stages them first.

    Name the blocks by key, or give prompt text and a tokenizer: every full block of the
    text is pinned. Exits 1 if no named block exists in any fingerprint in scope.

    Examples:

    ```
    s3kv pin 0123456789abcdef0123456789abcdef
    s3kv pin --text system-prompt.txt --tokenizer meta-llama/Llama-3.1-8B
    ```
    """
    _set(common, _targets(keys, text, tokenizer, tokens_per_block, special_tokens), on=True)


@bucket_command()
def unpin(
    common: Common,
    keys: KeysArg = None,
    text: TextOpt = None,
    tokenizer: TokenizerOpt = None,
    tokens_per_block: TokensPerBlockOpt = None,
    special_tokens: SpecialOpt = True,
) -> None:
    """Undo pin (by key or by prompt text, as for pin).

    Examples:

    ```
    s3kv unpin 0123456789abcdef0123456789abcdef
    s3kv unpin --text system-prompt.txt --tokenizer meta-llama/Llama-3.1-8B
    ```
    """
    _set(common, _targets(keys, text, tokenizer, tokens_per_block, special_tokens), on=False)


def _set(
    common: Common, targets_for: Callable[[Fingerprint], Sequence[PinTarget]], *, on: bool
) -> None:
    """Pin (``on``) or unpin the targets in scope, print, exit 1 if none exists."""
    with common.session(write=True) as s:
        report = set_pins(
            s.backend, s.scope, targets_for, prefix=s.prefix, pin=on, clock=common.rt.clock
        )
    out = s.out
    document = {
        "command": "pin" if on else "unpin",
        "found_any": report.found_any,
        "fingerprints": [vars(o) for o in report.outcomes],
    }
    out.emit(document, lambda con: _render_set(con, report))
    if not report.found_any:
        out.note(
            "none of the blocks exists in any fingerprint in scope (wrong --model, "
            "--tokens-per-block or tokenizer?)"
        )
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
            raise CommandError(
                f"fingerprint {fp.fingerprint} has no identity.json giving "
                "tokens_per_block: pass --tokens-per-block"
            )
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
        t.add_row(
            o.fingerprint,
            str(o.requested),
            str(o.changed),
            str(o.unchanged),
            str(o.adopted),
            str(o.missing),
        )
    con.print(t)


@bucket_command()
def pins(
    common: Common,
) -> None:
    """List pinned blocks.

    Examples:

    ```
    s3kv pins --model 'meta-llama/*'
    s3kv pins --json
    ```
    """
    with common.session(write=False) as s:
        found = list_pins(s.backend, s.scope, prefix=s.prefix)

    def render(con: Console) -> None:
        t = table(
            f"{len(found)} pinned blocks",
            "fingerprint",
            "model",
            "key",
            "#bytes",
            "#hits",
            "last used (UTC)",
        )
        for p in found:
            t.add_row(
                p.fingerprint, p.model or "?", p.key, str(p.size), str(p.hits), iso(p.last_used)
            )
        con.print(t)

    s.out.emit({"command": "pins", "pins": [vars(p) for p in found]}, render)
