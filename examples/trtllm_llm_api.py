"""s3kv on TensorRT-LLM's LLM API: the redeploy scenario with two engine instances.

Instance A answers a question behind a long system prompt and saves its KV blocks to the
bucket; it is shut down. Instance B — a new ``LLM`` object, as after a redeploy — stages the
system prompt's blocks at startup (warm start) and answers the same prompt: its output is
identical, and its prefill skips the cached blocks.

Runs where TensorRT-LLM (>= 1.2, PyTorch backend) and a GPU exist::

    export TLLM_S3KV_BUCKET=my-kv-bucket            # plus AWS credentials / endpoint
    python examples/trtllm_llm_api.py --model Qwen/Qwen2.5-0.5B-Instruct

On a machine without TensorRT-LLM, ``examples/cpu_demo.py`` runs the same scenario on s3kv's
emulated runtime.
"""

from __future__ import annotations

import argparse
import time

SYSTEM_PROMPT = (
    "You are the on-call assistant of a storage team. The runbook follows.\n"
    + "\n".join(
        f"Step {i}: check the replication lag of shard {i}, then the compaction backlog, "
        f"and page the owner if either exceeds its threshold for five minutes."
        for i in range(1, 120)
    )
)
QUESTION = "\nQuestion: what do I do when shard 42 lags?\nAnswer:"


def build_llm(model: str):  # type: ignore[no-untyped-def]
    from tensorrt_llm import LLM
    from tensorrt_llm.llmapi import KvCacheConfig
    from tensorrt_llm.llmapi.llm_args import KvCacheConnectorConfig

    return LLM(
        model=model,
        backend="pytorch",
        kv_cache_config=KvCacheConfig(
            enable_block_reuse=True, enable_partial_reuse=False, tokens_per_block=32
        ),
        kv_connector_config=KvCacheConnectorConfig(
            connector_module="s3kv.connector.trtllm",
            connector_scheduler_class="S3KVConnectorScheduler",
            connector_worker_class="S3KVConnectorWorker",
        ),
        disable_overlap_scheduler=False,
        cuda_graph_config=None,
    )


def run(model: str) -> int:
    from tensorrt_llm import SamplingParams

    params = SamplingParams(max_tokens=48, temperature=0.0)
    prompt = SYSTEM_PROMPT + QUESTION
    outputs = []
    for name in ("A (cold)", "B (after a redeploy)"):
        llm = build_llm(model)
        started = time.perf_counter()
        result = llm.generate([prompt], params)[0]
        elapsed = time.perf_counter() - started
        text = result.outputs[0].text
        outputs.append(text)
        print(f"instance {name}: {elapsed * 1e3:.0f} ms: {text!r}")
        llm.shutdown()  # s3kv drains its uploads at exit as well
    identical = outputs[0] == outputs[1]
    print(f"identical outputs: {identical}")
    return 0 if identical else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    return run(parser.parse_args().model)


if __name__ == "__main__":
    raise SystemExit(main())
