"""KvGeometry and the tensor-parallel head split (no model needed)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from s3kv.testing.emulator.geometry import (
    KvGeometry,
    kv_heads_for_rank,
    query_heads_for_rank,
    split_range,
)


def test_pool_shape_is_trtllm_block_major() -> None:
    geo = KvGeometry(num_layers=30, num_kv_heads=3, head_dim=64, tokens_per_block=16)
    assert geo.block_elems == 3 * 16 * 64
    assert geo.pool_shape(7) == (7, 30, 2, 3 * 16 * 64)
    # One bf16 block holds 16 tokens of 30 * 2 * 3 * 64 * 2 = 23,040 bytes each.
    assert geo.block_nbytes == 16 * 23_040


def test_hnd_view_addresses_head_token_dim_inside_a_block() -> None:
    geo = KvGeometry(num_layers=2, num_kv_heads=3, head_dim=4, tokens_per_block=5)
    pool = torch.arange(3 * 2 * 2 * geo.block_elems, dtype=torch.float32).view(geo.pool_shape(3))
    view = geo.hnd_view(pool)
    # Element (block 1, layer 1, V, head 2, token 3, dim 1) sits at the HND offset.
    flat = pool[1, 1, 1]
    assert view[1, 1, 1, 2, 3, 1] == flat[(2 * 5 + 3) * 4 + 1]
    assert view.data_ptr() == pool.data_ptr()  # a view, not a copy


def test_hnd_view_rejects_a_foreign_pool() -> None:
    geo = KvGeometry(num_layers=2, num_kv_heads=3, head_dim=4, tokens_per_block=5)
    with pytest.raises(ValueError, match="pool: expected shape"):
        geo.hnd_view(torch.zeros(3, 2, 2, geo.block_elems + 1))


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "tokens_per_block"])
def test_geometry_rejects_non_positive_fields(field: str) -> None:
    valid = KvGeometry(num_layers=1, num_kv_heads=1, head_dim=1, tokens_per_block=1)
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(valid, **{field: 0})  # type: ignore[arg-type]


@pytest.mark.parametrize(("total", "parts"), [(3, 2), (1536, 2), (10, 3), (7, 7), (2, 4)])
def test_split_range_has_array_split_semantics(total: int, parts: int) -> None:
    expected = np.array_split(np.arange(total), parts)
    for index in range(parts):
        assert list(split_range(total, parts, index)) == expected[index].tolist()


def test_smollm2_heads_at_tp2() -> None:
    # 3 KV heads over 2 ranks: rank 0 takes the extra head; 3 query heads per KV head.
    assert kv_heads_for_rank(3, 2, 0) == range(0, 2)
    assert kv_heads_for_rank(3, 2, 1) == range(2, 3)
    assert query_heads_for_rank(9, 3, 2, 0) == range(0, 6)
    assert query_heads_for_rank(9, 3, 2, 1) == range(6, 9)


def test_head_split_rejects_more_ranks_than_kv_heads() -> None:
    with pytest.raises(ValueError, match="tp_size"):
        kv_heads_for_rank(3, 4, 0)
    with pytest.raises(ValueError, match="index"):
        kv_heads_for_rank(3, 2, 2)
    with pytest.raises(ValueError, match="num_heads"):
        query_heads_for_rank(10, 3, 1, 0)
