"""``codec_processes = auto``: how many codec processes a GPU rank's store runs."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from s3kv.config import S3KVConfig
from s3kv.errors import ConfigError
from s3kv.offload import affinity, sizing
from s3kv.offload.sizing import (
    CpuBudget,
    auto_here,
    auto_processes,
    cpu_budget,
    local_ranks,
    resolve_codec_processes,
)


@pytest.mark.parametrize(
    ("on_gpu", "stores", "ranks", "cpus", "expected"),
    [
        (False, 1, 1, 128, 0),  # the CPU emulator, tests, tools: the I/O threads
        (True, 1, 1, 16, 4),  # one H200 host's 16 vCPUs, one rank: the measured 4
        (True, 1, 1, 256, 4),  # at most 4 per rank
        (True, 1, 1, 8, 2),
        (True, 1, 1, 4, 1),
        (True, 1, 1, 3, 0),  # under 4 CPUs: nothing to spare
        (True, 1, 8, 64, 2),  # a TP-8 rank > 0 on a 64-CPU host: its share is 8
        (True, 8, 8, 64, 1),  # rank 0 of the same: one per shard store
        (True, 8, 8, 24, 0),  # 3 CPUs a rank
    ],
)
def test_the_rule(on_gpu: bool, stores: int, ranks: int, cpus: int, expected: int) -> None:
    choice = auto_processes(on_gpu=on_gpu, stores=stores, ranks=ranks, cpus=cpus)
    assert choice.processes == expected
    assert choice.reason


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("cpus", [4, 8, 16, 24, 32, 64, 96, 128, 192, 256])
def test_a_host_runs_at_most_half_its_cpus_in_codec_processes(ranks: int, cpus: int) -> None:
    # Rank 0 opens one store per shard under TP; the others open one each.
    rank0 = auto_processes(on_gpu=True, stores=ranks, ranks=ranks, cpus=cpus).processes * ranks
    others = auto_processes(on_gpu=True, stores=1, ranks=ranks, cpus=cpus).processes
    total = rank0 + (ranks - 1) * others if ranks > 1 else others
    assert total <= cpus // 2


def test_the_cpu_budget_is_the_cpuset_bounded_by_the_cgroup_quota(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sizing, "allowed_cpus", lambda: frozenset(range(64)))
    monkeypatch.setattr(sizing, "online_cpus", lambda: frozenset(range(64)))
    monkeypatch.setattr(sizing, "_CGROUP_V1", tmp_path)  # NOTE: no v1 controller here
    files = {"cpu.max": "max 100000\n"}

    def read(name: str) -> str:
        if name not in files:
            raise FileNotFoundError(name)
        return files[name]

    monkeypatch.setattr(sizing, "read_cgroup", read)
    assert cpu_budget() == CpuBudget(64, whole_host=True)  # no quota
    files["cpu.max"] = "600000 100000\n"  # a Kubernetes limit of 6 CPUs
    assert cpu_budget() == CpuBudget(6, whole_host=False)
    files["cpu.max"] = "50000 100000\n"  # half a CPU: still one
    assert cpu_budget() == CpuBudget(1, whole_host=False)
    for junk in ("garbage", "100000 0", "", "-1 100000"):
        files["cpu.max"] = junk
        assert cpu_budget() == CpuBudget(64, whole_host=True), junk
    del files["cpu.max"]  # cgroup v1: the cpu controller's CFS quota
    (tmp_path / "cpu,cpuacct").mkdir()
    (tmp_path / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("400000\n")
    (tmp_path / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_budget() == CpuBudget(4, whole_host=False)
    (tmp_path / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no limit"
    assert cpu_budget() == CpuBudget(64, whole_host=True)
    monkeypatch.setattr(sizing, "allowed_cpus", lambda: frozenset(range(8)))  # a cpuset
    assert cpu_budget() == CpuBudget(8, whole_host=False)


def test_independent_engines_on_one_host_share_its_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    # One server per GPU, no launcher counting them: each sees one rank, so where nothing
    # narrows the host's CPUs, each sizes from its share of them by the host's GPUs.
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                 "SLURM_NTASKS_PER_NODE"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sizing, "host_gpus", lambda: 8)
    monkeypatch.setattr(sizing, "cpu_budget", lambda: CpuBudget(32, whole_host=True))
    assert auto_here(on_gpu=True, stores=1, tp_size=1).processes == 1  # 8 on 32 CPUs
    # A container with its own CPU limit sizes from it, whatever the host's GPUs.
    monkeypatch.setattr(sizing, "cpu_budget", lambda: CpuBudget(16, whole_host=False))
    assert auto_here(on_gpu=True, stores=1, tp_size=1).processes == 4


def test_read_cgroup_names_a_missing_hierarchy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(affinity, "_CGROUP", affinity._CGROUP / "no-such-dir-here")
    with pytest.raises(FileNotFoundError):
        affinity.read_cgroup("cpu.max")


def test_local_ranks_take_the_launchers_count(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                 "SLURM_NTASKS_PER_NODE"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    assert local_ranks(1) == 1
    assert local_ranks(4) == 4
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "8")
    assert local_ranks(2) == 8
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")  # not a plain count: ignored
    assert local_ranks(2) == 8
    monkeypatch.setenv("MPI_LOCALNRANKS", "\u00b2")  # a digit to str.isdigit, not to int()
    assert local_ranks(2) == 8


def test_resolve_makes_auto_a_number_and_leaves_numbers_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sizing, "cpu_budget", lambda: CpuBudget(16, whole_host=True))
    monkeypatch.setattr(sizing, "host_gpus", lambda: 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_SIZE", raising=False)
    monkeypatch.delenv("MPI_LOCALNRANKS", raising=False)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    auto = S3KVConfig()
    assert auto.codec_processes == "auto"  # the default
    with caplog.at_level(logging.INFO, logger="s3kv.offload.sizing"):
        on_gpu = resolve_codec_processes(auto, on_gpu=True, stores=1, tp_size=1)
    assert on_gpu.codec_processes == 4
    assert "codec_processes auto: 4 (4 for its store: 16 CPUs for 1 GPU rank" in caplog.text
    assert resolve_codec_processes(auto, on_gpu=False, stores=1, tp_size=1).codec_processes == 0
    # rank 0 of TP 2: a share of 8 CPUs gives 2 processes, one for each shard's store
    assert resolve_codec_processes(auto, on_gpu=True, stores=2, tp_size=2).codec_processes == 1
    fixed = auto.replace(codec_processes=0)
    assert resolve_codec_processes(fixed, on_gpu=True, stores=1, tp_size=1) is fixed


@pytest.mark.parametrize(
    ("value", "expected"), [("auto", "auto"), (" AUTO ", "auto"), ("3", 3), (0, 0), (64, 64)]
)
def test_the_setting_takes_a_count_or_auto(value: object, expected: object) -> None:
    assert S3KVConfig.load(codec_processes=value).codec_processes == expected


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("many", "codec_processes: expected an integer or auto, got 'many'"),
        (-1, "codec_processes: must be in 0..64 or auto, got -1"),
        (True, "codec_processes: expected an integer or auto, got True"),
        (1.5, "codec_processes: expected an integer or auto, got 1.5"),
    ],
)
def test_a_bad_count_is_one_line_naming_the_setting(value: object, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(").replace(".", r"\.")):
        S3KVConfig.load(codec_processes=value)


def test_a_store_opened_outside_the_connector_runs_no_processes_for_auto() -> None:
    from s3kv.store import _codec_processes

    assert _codec_processes(S3KVConfig()) == 0
    assert _codec_processes(S3KVConfig(codec_processes=3)) == 3


def test_io_threads_auto_is_8_get_puts_at_once_per_worker() -> None:
    # A GET waits a round trip at least: with codec processes auto runs 8 in each (10 Gbit/s,
    # 10 ms: 8 at once staged 610 MB/s, 32 up to 1,460), the engine's own pool 8 without them.
    # The default: a codec process codes on 2 threads however many requests it makes.
    assert S3KVConfig().io_threads == "auto"
    auto = S3KVConfig(io_threads="auto")
    assert auto.io_concurrency() == 8
    assert auto.io_concurrency(4) == 32
    fixed = S3KVConfig(io_threads=5)
    # NOTE: a number is split over the processes, rounded up to a share each: what runs
    assert (fixed.io_concurrency(), fixed.io_concurrency(4)) == (5, 8)
    assert S3KVConfig(io_threads=8).io_concurrency(4) == 8
    assert S3KVConfig.load(io_threads="AUTO").io_threads == "auto"
