"""Run every benchmark and print one JSON object per line (metric, value, unit, ...).

Usage: ``python benchmarks/run.py [--quick]``. Each script runs in its own process so one
benchmark's memory (a 10M-key Bloom filter, a model) never skews another's figures.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = [
    "bench_codec.py",
    "bench_codec_threads.py",
    "bench_store_scaling.py",
    "bench_manifest.py",
    "bench_scheduler.py",
    "bench_hit_path.py",
    "bench_save_path.py",
    "bench_host_contention.py",
    "bench_s3.py",
    "bench_wan.py",  # root only (network namespaces); prints wan.skipped otherwise
    "bench_client_cpu.py",
    "bench_fleet.py",
    "bench_prune.py",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="fewer passes (about 2 minutes on a 2-core machine)"
    )
    args = parser.parse_args()
    failed = 0
    for script in SCRIPTS:
        started = time.monotonic()
        cmd = [sys.executable, str(HERE / script)] + (["--quick"] if args.quick else [])
        result = subprocess.run(cmd, check=False)
        print(
            f"# {script}: exit {result.returncode} in {time.monotonic() - started:.1f} s",
            file=sys.stderr,
        )
        failed += result.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
