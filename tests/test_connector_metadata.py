"""The metadata's saves as columns (SaveOps): the same blocks as SaveOp items, a small pickle."""

from __future__ import annotations

import array
import pickle

import pytest

from s3kv.connector.metadata import ConnectorMetadata, SaveOp, SaveOps
from s3kv.keys import ROOT_HASH, KeyRun, chain_hashes


def key(i: int) -> bytes:
    return bytes([i]) * 16


def ops(n: int, request_id: int = 1) -> list[SaveOp]:
    return [SaveOp(request_id, 10 + i, key(i + 1), key(i)) for i in range(n)]


def test_columns_are_the_same_blocks_as_their_items() -> None:
    saves = SaveOps.of(ops(4))
    assert list(saves) == ops(4)
    assert saves == tuple(ops(4))
    assert saves[2] == ops(4)[2]
    assert saves[-1] == ops(4)[3]
    assert saves.block_ids == (10, 11, 12, 13)
    assert saves.key(1) == key(2)
    assert saves.parent(1) == key(1)


def test_slices_keep_the_columns_aligned() -> None:
    saves = SaveOps.of(ops(5))
    assert saves[1:3] == SaveOps.of(ops(5)[1:3])
    assert saves[:10] == saves
    assert saves[4:2] == ()
    assert saves[::2] == tuple(ops(5)[::2])
    assert saves[-2:] == tuple(ops(5)[-2:])
    with pytest.raises(IndexError):
        saves[5]


def test_columns_that_disagree_are_refused_with_their_lengths() -> None:
    with pytest.raises(ValueError, match="2 request ids, 1 block ids"):
        SaveOps([1, 1], [3], key(1), key(0))
    with pytest.raises(ValueError, match="15 key bytes"):
        SaveOps([1], [3], key(1)[:15], key(0)[:15])


def test_a_pickled_trip_keeps_every_block_and_is_small() -> None:
    meta = ConnectorMetadata(saves=SaveOps.of(ops(254)))
    wire = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
    again = pickle.loads(wire)
    assert again == meta
    assert hash(again.saves) == hash(meta.saves)
    as_items = pickle.dumps(tuple(ops(254)), protocol=pickle.HIGHEST_PROTOCOL)
    assert len(wire) < len(as_items)


def test_columns_are_immutable_hash_as_their_items_and_index_strictly() -> None:
    saves = SaveOps.of(ops(3))
    assert hash(saves) == hash(tuple(ops(3)))
    assert saves.key(-1) == key(3)
    with pytest.raises(IndexError):
        saves.key(3)
    with pytest.raises(AttributeError, match="immutable"):
        saves.block_ids = (1, 2, 3)  # type: ignore[misc]
    assert ConnectorMetadata().saves == ()
    assert not ConnectorMetadata().saves


def test_runs_travel_unhashed_and_hash_their_keys_on_the_first_read() -> None:
    tpb, tokens = 4, list(range(7, 47))  # 10 blocks
    chain = chain_hashes(tokens, tpb)
    token_bytes = array.array("I", tokens[3 * tpb :]).tobytes()
    saves = SaveOps(
        [1] * 10 + [2],
        [*range(20, 30), 99],
        b"".join(chain[:3]) + key(9),
        ROOT_HASH + chain[0] + chain[1] + key(8),
        [(3, KeyRun(chain[2], token_bytes, tpb))],
    )
    again = pickle.loads(pickle.dumps(saves, protocol=pickle.HIGHEST_PROTOCOL))
    assert again.unhashed == 7  # NOTE: the receiver hashes them, not the sender
    assert [op.key for op in again] == [*chain, key(9)]
    assert [op.parent for op in again] == [ROOT_HASH, *chain[:-1], key(8)]
    assert again.unhashed == 0
    assert saves[0:11] is saves  # NOTE: a whole slice hashes nothing
    assert saves.unhashed == 7
    assert saves[2:4] == SaveOps([1, 1], [22, 23], chain[2] + chain[3], chain[1] + chain[2])
    assert saves.unhashed == 0


def test_runs_that_do_not_fit_the_blocks_are_refused() -> None:
    run = KeyRun(key(1), bytes(4 * 4 * 3), 4)  # 3 blocks
    with pytest.raises(ValueError, match="do not describe the same blocks"):
        SaveOps([1] * 2, [0, 1], b"", b"", [(0, run)])
    with pytest.raises(ValueError, match="does not fit"):  # NOTE: not whole blocks
        SaveOps([1] * 3, [0, 1, 2], b"", b"", [(0, KeyRun(key(1), bytes(4 * 4 * 3 + 4), 4))])
    two = KeyRun(key(1), bytes(4 * 4 * 2), 4)
    with pytest.raises(ValueError, match="reach block 4 of 3"):
        SaveOps([1] * 3, [0, 1, 2], key(1), key(0), [(2, two)])
