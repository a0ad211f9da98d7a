"""spawn_ranks: results in rank order over a real gloo group; failures carry the traceback.

The rank functions live at module level: ``spawn`` pickles them by reference.
"""

from __future__ import annotations

import pytest
import torch
from torch import distributed as dist

from s3kv.testing.emulator.tp import RankError, spawn_ranks


def _sum_ranks(rank: int, world_size: int, offset: int) -> tuple[int, int, float]:
    value = torch.tensor([float(rank + offset)])
    dist.all_reduce(value)  # the default group that spawn_ranks set up
    return rank, dist.get_world_size(), float(value)


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ArithmeticError("rank one is broken")
    # NOTE: rank 0 then blocks in a collective its peer never joins; spawn_ranks must not
    # wait for it once rank 1 has failed.
    dist.barrier()
    return rank


def test_results_come_back_in_rank_order_after_an_all_reduce() -> None:
    results = spawn_ranks(_sum_ranks, 2, 10, timeout=60)
    # all_reduce(SUM) of 10 and 11 on both ranks.
    assert results == [(0, 2, 21.0), (1, 2, 21.0)]


def test_a_failing_rank_raises_with_its_traceback() -> None:
    with pytest.raises(RankError, match=r"rank 1 failed:(.|\n)*ArithmeticError: rank one"):
        spawn_ranks(_fail_on_rank_one, 2, timeout=60)
