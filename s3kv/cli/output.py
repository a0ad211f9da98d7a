"""Printing: rich tables for people, one JSON document for scripts, progress on terminals.

Rules: results go to stdout (tables, or exactly one JSON document with ``--json``);
errors, prompts and progress go to stderr; progress bars appear only when stderr is a
terminal (never in pipes, logs or CI), and never with ``--json``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from s3kv.cli.context import Runtime
from s3kv.ops import ProgressFn, no_progress

__all__ = ["Output", "ago", "error_line", "human_bytes", "json_emitted", "table"]

_PIPE_WIDTH = 200
# NOTE: whether this run printed its JSON document: a failure after it (an unfinished prune)
# must not print a second one (the error document), a failure before it must.
_JSON_EMITTED: ContextVar[bool] = ContextVar("s3kv_json_emitted", default=False)


def json_emitted(reset: bool = False) -> bool:
    """Whether a JSON document went to stdout in this run; ``reset``: start a new run."""
    if reset:
        _JSON_EMITTED.set(False)
    return _JSON_EMITTED.get()


def error_line(message: object) -> str:
    """``Error: <message>`` on one line (whitespace, newlines included, collapsed)."""
    return "Error: " + " ".join(str(message).split())


def human_bytes(n: float | None) -> str:
    """``1.5 GiB`` style; ``-`` for unknown."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def ago(seconds: float) -> str:
    """``3.2d`` style durations."""
    if not math.isfinite(seconds):
        return "never"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def iso(epoch: float) -> str:
    """UTC ISO-8601 of epoch seconds."""
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).isoformat()


def table(title: str, *columns: str) -> Table:
    """A table; columns named ``#...`` are numbers (right-aligned).

    Fingerprints and keys are never truncated: operators copy them into commands.
    """
    result = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for name in columns:
        numeric = name.startswith("#")
        whole = name in ("fingerprint", "key")
        result.add_column(
            name.lstrip("#"),
            justify="right" if numeric else "left",
            no_wrap=whole,
            min_width=32 if whole else None,
        )
    return result


class Output:
    """Where a command's results go.

    Args:
        json_mode: ``--json`` was given.
        rt: The runtime (whether stderr is a terminal).
    """

    def __init__(self, json_mode: bool, rt: Runtime) -> None:
        self.json_mode = json_mode
        self._rt = rt
        # NOTE: consoles are made per command, after CliRunner (or anything) swapped sys.*.
        self.console = Console(highlight=False, soft_wrap=True)
        if not self.console.is_terminal:
            # NOTE: in a pipe rich assumes 80 columns and truncates; a log has no width limit,
            # and fingerprints, keys and settings must come out whole.
            self.console = Console(highlight=False, soft_wrap=True, width=_PIPE_WIDTH)
        self.err = Console(stderr=True, highlight=False, soft_wrap=True)

    def emit(self, document: dict[str, Any], render: Callable[[Console], None]) -> None:
        """Print ``document`` as JSON with ``--json``, else call ``render`` on stdout."""
        if self.json_mode:
            typer.echo(json.dumps(document, indent=2, sort_keys=True, default=_jsonable))
            _JSON_EMITTED.set(True)
        else:
            render(self.console)

    def note(self, message: str) -> None:
        """A line for people on stderr (suppressed with ``--json``)."""
        if not self.json_mode:
            self.err.print(message, markup=False)

    @contextlib.contextmanager
    def progress(self) -> Iterator[ProgressFn]:
        """A :data:`~s3kv.ops.ProgressFn` drawing bars on a terminal; silent otherwise."""
        if self.json_mode or not self._rt.shows_progress():
            yield no_progress
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TaskID,
            TextColumn,
            TimeElapsedColumn,
        )

        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.err,
            transient=True,
        ) as bars:
            tasks: dict[str, TaskID] = {}

            def update(phase: str, done: int, total: int | None) -> None:
                if phase not in tasks:
                    tasks[phase] = bars.add_task(phase, total=total)
                bars.update(tasks[phase], completed=done, total=total)

            yield update


def _jsonable(value: object) -> object:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)
