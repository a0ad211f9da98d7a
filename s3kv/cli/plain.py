"""Help in plain words: flags show no type, values show the metavar the command chose.

Typer labels every parameter with its Python type (``<bool>`` beside ``--yes``,
``<list[str]>`` beside ``--fingerprint``). Options and arguments name their values with
``metavar=`` (``DURATION``, ``N``, ``URL``, ``KEY``...); these classes give on/off flags,
``--help`` included, an empty one, so that a flag shows nothing beside its name, and show an
argument by its metavar alone (typer would add its type beside it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from typer.core import TyperArgument, TyperCommand, TyperGroup

__all__ = ["PlainCommand", "PlainGroup"]


class _PlainArgument(TyperArgument):
    """An argument shown by its metavar, without typer's type label."""

    def display_type_rich(self, ctx: Any) -> str | None:
        return None


def _plain_flags(params: Iterable[Any]) -> None:
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
        elif type(param) is TyperArgument and param.metavar is not None:
            param.__class__ = _PlainArgument


class PlainCommand(TyperCommand):
    """A command whose flags show no type in ``--help``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _plain_flags(self.params)

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        _plain_flags([option] if option is not None else [])
        return option


class PlainGroup(TyperGroup):
    """A group whose flags show no type in ``--help``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _plain_flags(self.params)

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        _plain_flags([option] if option is not None else [])
        return option
