"""spawn_ranks: results in rank order over a real gloo group; failures carry the traceback.

The rank functions live at module level: they are pickled by reference. A single rank starts
from a fork server and must still see what its caller set; several ranks are separate
interpreters.
"""

from __future__ import annotations

import os
from pathlib import Path

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


def _what_the_rank_sees(rank: int, world_size: int, marker: str) -> dict[str, object]:
    import atexit
    import sys

    # An exit handler, as the connector's (drain saves, flush the manifest) is registered.
    atexit.register(lambda: Path(marker).write_text(str(os.getpid())))
    return {
        "env": os.environ.get("S3KV_TP_PROBE"),
        "cwd": os.getcwd(),
        "path": sys.path[0],
        "cpus": sorted(os.sched_getaffinity(0)),
        "pid": os.getpid(),
        "hash": hash("s3kv"),
    }


def test_a_single_rank_takes_the_callers_settings_and_runs_its_exit_handlers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One rank starts from a fork server that was started earlier, elsewhere: what the
    # caller set since must still reach it, as it would reach a spawned process.
    spawn_ranks(_what_the_rank_sees, 1, str(tmp_path / "warm-up"), timeout=120)
    before = os.sched_getaffinity(0)
    monkeypatch.setenv("S3KV_TP_PROBE", "set-after-the-server-started")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "on-the-path"))
    cpus = {min(before)}
    os.sched_setaffinity(0, cpus)
    try:
        marker = tmp_path / "exit-handler-ran"
        (seen,) = spawn_ranks(_what_the_rank_sees, 1, str(marker), timeout=120)
    finally:
        os.sched_setaffinity(0, before)
    assert seen["env"] == "set-after-the-server-started"
    assert seen["cwd"] == str(tmp_path)
    assert seen["path"] == str(tmp_path / "on-the-path")
    assert seen["cpus"] == sorted(cpus)
    assert seen["pid"] != os.getpid()
    assert marker.read_text() == str(seen["pid"]), "the rank's exit handlers ran"


@pytest.mark.skipif(bool(os.environ.get("PYTHONHASHSEED")), reason="PYTHONHASHSEED fixes the seed")
def test_several_ranks_are_separate_interpreters_with_their_own_hash_seed(tmp_path: Path) -> None:
    # As MPI ranks: an iteration order over a set of strings may differ between ranks, and a
    # test must be able to see a rank-dependent order.
    seeds = set()
    for attempt in range(3):
        ranks = spawn_ranks(_what_the_rank_sees, 2, str(tmp_path / f"m{attempt}"), timeout=120)
        seeds.update(seen["hash"] for seen in ranks)
    assert len(seeds) > 1
