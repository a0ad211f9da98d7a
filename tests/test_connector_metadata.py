"""The metadata's saves as columns (SaveOps): the same blocks as SaveOp items, a small pickle."""

from __future__ import annotations

import pickle

import pytest

from s3kv.connector.metadata import ConnectorMetadata, SaveOp, SaveOps


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
