"""The connector's CUDA path on a GPU: cold prefill vs a staged hit, on the emulated runtime.

Runs on the device machine (no network, no model wheel): the SmolLM2 architecture with seeded
random weights on CUDA, the s3kv connector with a ``file://`` bucket (a directory), pinned
host staging, host→GPU loads on the engine's stream, GPU→host saves on a side stream after
the forward-pass event. Three instances, each a new process:

* A (cold, connector on): system prompt + question A; saves the KV blocks.
* B (the redeploy, connector on): warm start stages the system prompt; system prompt +
  question B; TTFT of a staged hit.
* R (reference, no connector): system prompt + question B computed cold; TTFT of a cold
  prefill, and the tokens B must reproduce.

Prints JSON lines and writes them to ``--out``/gpu_e2e.json. Usage::

    PYTHONPATH=. python3 benchmarks/gpu_e2e.py --prompt-tokens 8192 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from s3kv.testing.emulator.instance import TOKENS_PER_BLOCK, InstanceSpec, run_instance


def emit(rows: list[dict[str, Any]], metric: str, value: Any, unit: str, **extra: Any) -> None:
    row = {"metric": metric, "value": value, "unit": unit, **extra}
    rows.append(row)
    print(json.dumps(row), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-tokens", type=int, default=8192 - 64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    system_len = (args.prompt_tokens // TOKENS_PER_BLOCK) * TOKENS_PER_BLOCK
    rng = np.random.default_rng(7)
    system = [int(t) for t in rng.integers(0, 49152, size=system_len)]
    question_a = [int(t) for t in rng.integers(0, 49152, size=40)]
    question_b = [int(t) for t in rng.integers(0, 49152, size=40)]
    blocks = 2 * ((system_len + 40 + args.new_tokens) // TOKENS_PER_BLOCK + 4)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="s3kv-gpu-bucket-") as bucket:
        os.environ.update({
            "TLLM_S3KV_ENDPOINT_URL": f"file://{bucket}", "TLLM_S3KV_BUCKET": "gpu",
            "TLLM_S3KV_MODEL_REVISION": "random-seed-7",
            "TLLM_S3KV_MANIFEST_FLUSH_INTERVAL": "0.2",
            "TLLM_S3KV_STAGING_BYTES": "4GiB", "TLLM_S3KV_WARM_START_BYTES": "4GiB",
        })  # fmt: skip

        def spec(question: list[int], connector: bool) -> InstanceSpec:
            return InstanceSpec(
                prompts=(tuple(system + question),), max_new_tokens=args.new_tokens,
                connector=connector, num_blocks=blocks, device=args.device,
                random_weights_seed=7, warmup_tokens=len(system) + 40,
            )  # fmt: skip

        started = time.perf_counter()
        a = run_instance(spec(question_a, True))
        b = run_instance(spec(question_b, True))
        r = run_instance(spec(question_b, False))
        wall = time.perf_counter() - started
    identical = b.outputs == r.outputs
    common = {"device": r.device, "prompt_tokens": len(system) + 40}
    emit(rows, "gpu.identical", identical, "bool", **common)
    emit(rows, "gpu.cold_ttft_ms", round(r.ttft_ms[0], 2), "ms", **common)
    emit(rows, "gpu.warm_ttft_ms", round(b.ttft_ms[0], 2), "ms",
         connector_tokens=b.connector_tokens[0], computed_tokens=b.computed_tokens[0],
         **common)  # fmt: skip
    emit(rows, "gpu.ttft_speedup", round(r.ttft_ms[0] / b.ttft_ms[0], 2), "x", **common)
    emit(rows, "gpu.cold_ttft_instance_a_ms", round(a.ttft_ms[0], 2), "ms", **common)
    emit(rows, "gpu.pinned_staging", b.pinned_staging, "bool")
    emit(rows, "gpu.saved_blocks", a.metrics.get("save_completed", 0), "blocks",
         raw_MB=round(a.metrics.get("save_raw_bytes", 0) / 1e6, 1),
         stored_MB=round(a.metrics.get("save_stored_bytes", 0) / 1e6, 1))  # fmt: skip
    emit(rows, "gpu.warm_blocks_staged", b.warm_blocks_staged, "blocks",
         startup_s=round(b.startup_s, 2))  # fmt: skip
    emit(rows, "gpu.wall_s", round(wall, 1), "s")
    Path(args.out, "gpu_e2e.json").write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    return 0 if identical and b.connector_tokens[0] == system_len else 1


if __name__ == "__main__":
    sys.exit(main())
