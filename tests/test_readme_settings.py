"""The README's Configuration table names every setting with its real default.

A default changed in code (``codec_processes`` and ``io_threads`` became ``auto``) must change
the table that operators read; this test is what makes a stale row fail.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from s3kv.config import S3KVConfig, parse_duration, parse_size

README = Path(__file__).resolve().parent.parent / "README.md"
#: What the table writes where a default is empty, unset or computed at startup.
_NO_VALUE = {"—", "empty", "derived", "AWS chain"}


def _rows() -> list[tuple[list[str], list[str]]]:
    """(setting names, default cells) per row of the Configuration table."""
    text = README.read_text()
    start = text.index("| setting | default | meaning |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        name_cell, default_cell = (c.strip() for c in line.strip("|").split("|")[:2])
        names = [n.strip().strip("`") for n in name_cell.split(",")]
        defaults = [d.strip().strip("`") for d in default_cell.split(",")]
        if len(defaults) == 1 and len(names) > 1:
            defaults = defaults * len(names)  # NOTE: one cell for the row ("AWS chain")
        rows.append((names, defaults))
    return rows


def _matches(field: dataclasses.Field[object], cell: str) -> bool:
    default = field.default
    kind = field.metadata.get("kind")
    cell = cell.split(" (", maxsplit=1)[0]  # NOTE: "0 (off)"
    if default in (None, "") or cell in _NO_VALUE:
        return default in (None, "") and cell in _NO_VALUE
    if kind == "size":
        return parse_size(cell) == default
    if kind == "duration":
        return parse_duration(cell) == default
    if isinstance(default, bool):
        return cell == str(default).lower()
    if isinstance(default, int):
        scale = {"K": 1_000, "M": 1_000_000}.get(cell[-1:], 1)
        return int(float(cell.rstrip("KM")) * scale) == default
    if isinstance(default, float):
        return float(cell) == default
    return cell == str(default)


def test_every_setting_has_a_row() -> None:
    listed = {name for names, _ in _rows() for name in names}
    settings = {f.name for f in dataclasses.fields(S3KVConfig)}
    assert sorted(settings - listed) == []
    assert sorted(listed - settings) == []


@pytest.mark.parametrize(("names", "defaults"), _rows(), ids=lambda v: ",".join(v)[:40])
def test_each_row_gives_the_real_default(names: list[str], defaults: list[str]) -> None:
    fields = {f.name: f for f in dataclasses.fields(S3KVConfig)}
    assert len(names) == len(defaults), f"one default per setting in the row {names}"
    for name, cell in zip(names, defaults, strict=True):
        assert _matches(fields[name], cell), (
            f"{name}: README says {cell!r}, the code {fields[name].default!r}"
        )
