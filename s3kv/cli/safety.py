"""What stands between an operator's typo and a deleted bucket: strict durations, prompts.

* :func:`parse_window` reads ``--older-than``: a unit is required (``7`` is an error that
  suggests ``7d``, never seven seconds) and compound durations (``7d12h``, ``1h30m``) add
  up, as MinIO's ``mc`` reads them. The settings' own parser
  (:func:`s3kv.config.parse_duration`) takes bare seconds, as settings files always have.
* :func:`confirm_deletion` asks before a run that deletes many objects, or a large share of
  a fingerprint's blocks; without a terminal it refuses (``--yes`` skips both).
* :func:`ask` is the prompt: Ctrl-C there exits 130 with one line.
* :func:`denied` tells a refused delete (permission) from a failed one.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Sequence

import typer

from s3kv.cli.context import CommandError
from s3kv.cli.output import Output

__all__ = [
    "ask",
    "confirm_deletion",
    "delete_denied",
    "denied",
    "parse_window",
    "share_reasons",
]

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_NUMBER = r"\d+(?:\.\d+)?"
_PART = re.compile(rf"({_NUMBER})([smhdw])")
_COMPOUND = re.compile(rf"(?:{_NUMBER}[smhdw])+")
_BARE = re.compile(_NUMBER)
_SHOWN = 3  # fingerprints named in a confirmation; the rest are counted
_INTERRUPTED = 130


def parse_window(value: str, *, flag: str) -> float:
    """Seconds of a duration with units: ``90s``, ``30m``, ``12h``, ``7d``, ``2w``, ``7d12h``.

    Raises:
        CommandError: (exit 2, naming ``flag``) a bare number, an unknown or repeated unit,
            or a zero duration.
    """
    text = value.strip()
    if _BARE.fullmatch(text):
        raise CommandError(
            f"{flag}: {value!r} has no unit: write {text}d for {text} days "
            "(units s, m, h, d, w; compound like 7d12h)"
        )
    parts = _PART.findall(text)
    units = [unit for _, unit in parts]
    if not _COMPOUND.fullmatch(text) or len(set(units)) != len(units):
        raise CommandError(
            f"{flag}: expected a duration like 12h, 7d, 7d12h or 1h30m "
            f"(units s, m, h, d, w, each once), got {value!r}"
        )
    seconds = sum(float(number) * _UNITS[unit] for number, unit in parts)
    if seconds <= 0:
        raise CommandError(f"{flag}: must be more than 0 (0 would delete every block)")
    return seconds


def _readline() -> str:
    """One line of stdin ('' at its end); the seam tests replace to press Ctrl-C."""
    return sys.stdin.readline()


def ask(question: str) -> bool:
    """Ask a yes/no question on stderr; anything but ``y``/``yes`` is no.

    Raises:
        CommandError: (exit 130) Ctrl-C at the prompt.
    """
    typer.echo(f"{question} [y/N]: ", err=True, nl=False)
    try:
        answer = _readline()
    except KeyboardInterrupt:
        typer.echo("", err=True)
        raise CommandError("interrupted at the prompt: nothing was deleted", _INTERRUPTED) from None
    return answer.strip().lower() in ("y", "yes")


def share_reasons(counts: Iterable[tuple[str, int, int]], share: float) -> list[str]:
    """Why a run needs confirming for the share it deletes of each fingerprint.

    Args:
        counts: ``(fingerprint, objects to delete, its blocks)`` for each fingerprint.
        share: ``--confirm-share``: confirm above this fraction of a fingerprint's blocks.
    """
    over = [(fp, n, total) for fp, n, total in counts if total and n / total > share]
    if not over:
        return []
    named = ", ".join(f"{n / total:.0%} of {fp} ({n} of {total})" for fp, n, total in over[:_SHOWN])
    more = f" and {len(over) - _SHOWN} more fingerprints" if len(over) > _SHOWN else ""
    return [f"{named}{more}: more than --confirm-share {share:g} of a fingerprint's blocks"]


def confirm_deletion(
    out: Output,
    *,
    command: str,
    what: str,
    reasons: Sequence[str],
    can_prompt: bool,
    yes: bool,
) -> None:
    """Go ahead, ask, or refuse: the confirmation of a run that deletes objects.

    Args:
        out: Where the summary goes (stderr).
        command: The command, for the messages (``prune``).
        what: What it deletes (``delete 4 objects (1.0 KiB)``).
        reasons: Why it needs confirming (empty: it does not).
        can_prompt: Whether someone can answer.
        yes: ``--yes``: go ahead without asking.

    Raises:
        CommandError: (exit 1) no terminal to ask on, or the answer was no; (exit 130)
            Ctrl-C at the prompt.
    """
    if yes or not reasons:
        return
    why = "; ".join(reasons)
    if not can_prompt:
        raise CommandError(
            f"{command} would {what}: {why}; there is no terminal to confirm on: re-run with "
            "--yes (or --dry-run to see the plan)",
            exit_code=1,
        )
    out.err.print(f"{command} will {what}: {why}.", markup=False)
    if not ask("Proceed?"):
        raise CommandError("aborted: nothing was deleted", exit_code=1)


def denied(reason: str) -> bool:
    """Whether a delete failure's reason is a refused permission (no retry will help)."""
    squashed = reason.lower().replace(" ", "")
    return "accessdenied" in squashed or "allaccessdisabled" in squashed


def delete_denied(count: int, *, where: str) -> CommandError:
    """The one line for deletes the bucket refused: a permission, not a transient failure.

    Args:
        count: Objects not deleted.
        where: The keys the permission must cover (``s3://bucket/prefix/*``).
    """
    return CommandError(
        f"permission denied: {count} objects not deleted: these credentials lack the "
        f"s3:DeleteObject action on {where} (the pruner policy in infra/aws grants it)",
        exit_code=1,
    )
