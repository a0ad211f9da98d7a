"""The metadata the scheduler sends to every worker each iteration (pickled, broadcast).

Small by construction: only this iteration's new work, as tuples of ints and 16-byte keys.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoadOp:
    """Copy a staged block into a device block before the forward pass.

    Attributes:
        block_id: Destination block in the KV pool (the same id on every rank).
        key: The block's hash (used to find the staged bytes in a single-process setup).
        slots: Per rank, the arena slot holding that rank's shard (tensor parallel), or
            empty when the scheduler's process is the only rank.
    """

    block_id: int
    key: bytes
    slots: tuple[int, ...] = ()


@dataclass(frozen=True)
class SaveOp:
    """Copy a full device block to host after the forward pass and save it.

    Attributes:
        request_id: The request the block belongs to (for ``get_finished``).
        block_id: Source block in the KV pool.
        key: The block's hash.
        parent: Its chain parent (for the manifest's usage records).
    """

    request_id: int
    block_id: int
    key: bytes
    parent: bytes


@dataclass(frozen=True)
class ConnectorMetadata:
    """One iteration's work for the workers.

    Attributes:
        loads: Blocks to load in ``start_load_kv``.
        saves: Blocks to copy out and save after the forward pass.
        arenas: Per rank, the shared-memory arena path and slot size for ``LoadOp.slots``
            (empty unless tensor parallel).
        load_seq: Sequence number of this iteration's loads (0 when there are none). Each
            worker publishes it on the completion board once its copies have *completed*;
            the scheduler keeps the staged sources pinned until every rank has.
        board: Path of the shared completion board (tensor parallel), else ''.
        relay: Path of the write relay through which the other ranks report their saves to
            the layout's shared manifest (tensor parallel, with saves), else ''.
    """

    loads: tuple[LoadOp, ...] = ()
    saves: tuple[SaveOp, ...] = ()
    arenas: tuple[tuple[str, int], ...] = ()
    load_seq: int = 0
    board: str = ""
    relay: str = ""


EMPTY = ConnectorMetadata()


__all__ = [
    "ConnectorMetadata",
    "EMPTY",
    "LoadOp",
    "SaveOp",
]
