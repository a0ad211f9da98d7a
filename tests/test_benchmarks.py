"""The benchmarks that drive the connector's internals still run against today's code.

``benchmarks/`` is not imported by the package, so nothing else notices when a change to the
worker or the scheduler breaks one: ``bench_save_path.py`` failed its own assertion for a
while after the save copies began waiting one ``get_finished`` (9188fd1). Each case here is
one small sample of a benchmark's own ``Case``, so it checks the benchmark's protocol, not
its figures (those are measured by ``benchmarks/run.py``, never in tests).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def benchmarks() -> Iterator[None]:
    """``benchmarks/`` on ``sys.path`` (its scripts import each other), for one test."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield
    finally:
        sys.path.remove(str(BENCHMARKS))


def _module(name: str) -> ModuleType:
    pytest.importorskip("torch")
    return __import__(name)


@pytest.mark.usefixtures("benchmarks")
@pytest.mark.parametrize("codec_processes", [0, 1])
def test_the_save_path_benchmark_hands_a_cold_prompt_over(codec_processes: int) -> None:
    bench = _module("bench_save_path")
    case = bench.Case(256, 32, 1_000, codec_processes)
    try:
        for _ in range(2):
            phases, saves, metadata_bytes = case.sample()
            assert saves == 8
            assert metadata_bytes > 0
            assert set(phases) == set(bench.PHASES)
            assert case.hand_off_calls >= 2  # NOTE: copies are queued from the next call on
    finally:
        case.store.close()
        case.folder.cleanup()


@pytest.mark.usefixtures("benchmarks")
def test_the_hit_path_benchmark_loads_a_staged_prompt() -> None:
    bench = _module("bench_hit_path")
    case = bench.Case(256, 32, 2)
    try:
        for _ in range(2):
            assert set(case.sample()) == set(bench.PHASES)
    finally:
        case.store.close()
