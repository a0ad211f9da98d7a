"""Stub of the optional C kernel built from ``_planes_native.c`` (see ``setup.py``)."""

from typing import Any, Final

MAX_ENTROPY_CHUNK: Final[int]
ZSTD_BLOCK: Final[int]
LITERAL_SLACK: Final[int]
FRAME_BOUND: Final[int]
RAW_FRAME_PREFIX: Final[int]
BLOCK_HEADER: Final[int]

def encode_planes(
    words: Any,
    payload: Any,
    at: int,
    step: int,
    probe: int,
    high: Any,
    low: Any,
    cctx: int,
    compress: int,
    /,
) -> tuple[int, tuple[int, ...]]: ...
