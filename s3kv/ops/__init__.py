"""Operator logic behind the ``s3kv`` CLI: plain functions returning frozen report dataclasses.

Each module is one command family and is usable (and tested) without the CLI:

* :mod:`s3kv.ops.scope` — which fingerprints and block objects a command acts on.
* :mod:`s3kv.ops.prune` — plan and execute deletion of blocks unused within a window.
* :mod:`s3kv.ops.stats` — per-fingerprint sizes, usage histograms and a cost estimate.
* :mod:`s3kv.ops.verify` — read objects back, verify header and checksum, delete bad ones.
* :mod:`s3kv.ops.compaction` — rebuild manifest snapshots (optionally from a listing).
* :mod:`s3kv.ops.pins` — pin/unpin prefixes by key or from prompt text.
* :mod:`s3kv.ops.doctor` — configuration provenance, reachability, permissions, latency.

Every function takes the clock (and anything else time- or environment-dependent) as a
parameter, so tests never sleep. Long loops report progress through an optional
:data:`ProgressFn` callback; the CLI turns it into a progress bar on a terminal.
"""

from __future__ import annotations

from collections.abc import Callable

#: ``progress(phase, done, total)``: ``done`` items of ``phase`` finished out of ``total``
#: (``None`` while unknown). Called from the calling thread only.
ProgressFn = Callable[[str, int, "int | None"], None]


def no_progress(phase: str, done: int, total: int | None) -> None:
    """The default :data:`ProgressFn`: report nothing."""


__all__ = ["ProgressFn", "no_progress"]
