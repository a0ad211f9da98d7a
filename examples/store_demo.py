"""The s3kv store on its own: one process saves real KV, a fresh process finds and stages it.

Run ``make demo`` (or ``python examples/store_demo.py``): it starts a local SeaweedFS S3
server, runs the two roles below as separate processes, prints what each did, and stops the
server by its pid.

* ``--role save`` (instance A): runs SmolLM2-135M over a system prompt, saves the prompt's KV
  blocks (bf16, 32 tokens per block) through ``KVStore.save`` and exits.
* ``--role load`` (instance B, the redeploy): opens the bucket, asks the manifest how many
  blocks of the same prompt exist (zero network calls), stages them (GET → verify → decode),
  computes the KV itself and checks the staged bytes are identical. It never lists the block
  objects: everything it knows comes from the manifest.

The orchestrator ends with one JSON line summarising both roles.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from s3kv import KVStore, ModelIdentity, S3KVConfig, chain_hashes
from s3kv.keys import ROOT_HASH
from s3kv.staging import NumpyAllocator
from s3kv.storage import Backend, DelegatingBackend, ObjectInfo
from s3kv.testing import smollm2

TOKENS_PER_BLOCK = 32
MAX_PROMPT_TOKENS = 1024


def identity() -> ModelIdentity:
    """SmolLM2's identity: the weights revision is the GGUF file's SHA-256."""
    digest = hashlib.sha256()
    with open(smollm2.gguf_path(), "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    return ModelIdentity(
        model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        weights_revision="sha256:" + digest.hexdigest(),
        dtype="bfloat16",
        kv_dtype="bfloat16",
        quantization="gguf-q4_1-dequantized",
        tokens_per_block=TOKENS_PER_BLOCK,
        kv_factor=2,
        block_elems=TOKENS_PER_BLOCK * smollm2.NUM_KV_HEADS * smollm2.HEAD_DIM,
        num_layers=smollm2.NUM_LAYERS,
        layout="demo/[layers,kv,tokens,heads,head_dim]",
    )


def prompt_blocks() -> tuple[list[int], list[np.ndarray]]:  # type: ignore[type-arg]
    """Token ids of the system prompt and its KV per full block, computed by the model."""
    import torch

    # NOTE: the float32 forward pass is ~3x faster on CPU than bfloat16; the KV cache is then
    # stored as bfloat16, as a bf16 engine's paged cache would hold it.
    model, tokenizer = smollm2.load_model("float32")
    ids = tokenizer(smollm2.PROMPT_TEXT).input_ids[:MAX_PROMPT_TOKENS]
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
    layers = [torch.stack([layer.keys[0], layer.values[0]]) for layer in out.past_key_values.layers]
    # [layers, kv, heads, tokens, dim] -> [layers, kv, tokens, heads, dim], raw bf16 bits
    kv = torch.stack(layers).permute(0, 1, 3, 2, 4).to(torch.bfloat16).contiguous()
    kv = kv.view(torch.int16).numpy()
    kv = kv.view(np.uint16)
    n_blocks = len(ids) // TOKENS_PER_BLOCK
    blocks = [
        np.ascontiguousarray(kv[:, :, i * TOKENS_PER_BLOCK : (i + 1) * TOKENS_PER_BLOCK])
        for i in range(n_blocks)
    ]
    return ids, blocks


class ListRecorder(DelegatingBackend):
    """Passes through, remembering every prefix listed (to prove no block listing)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.listed: list[str] = []

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        self.listed.append(prefix)
        return self.inner.list(prefix, start_after=start_after)


def role_save() -> dict[str, Any]:
    started = time.perf_counter()
    ids, blocks = prompt_blocks()
    compute_s = time.perf_counter() - started
    config = S3KVConfig.load()
    keys = chain_hashes(ids, TOKENS_PER_BLOCK)
    with KVStore.open(config, identity(), allocator=NumpyAllocator()) as store:
        started = time.perf_counter()
        parent = ROOT_HASH
        for key, block in zip(keys, blocks, strict=True):
            store.save(key, parent, block, dtype="bfloat16", shape=block.shape)
            parent = key
        store.flush(timeout=120)
        save_s = time.perf_counter() - started
        raw = store.metrics.value("save_raw_bytes")
        stored = store.metrics.value("save_stored_bytes")
        saved = int(store.metrics.value("save_completed"))
    return {
        "role": "save", "prompt_tokens": len(ids), "blocks": saved,
        "raw_MB": round(raw / 1e6, 2), "stored_MB": round(stored / 1e6, 2),
        "compression_ratio": round(raw / stored, 3) if stored else None,
        "model_forward_s": round(compute_s, 2), "save_s": round(save_s, 3),
    }  # fmt: skip


def role_load() -> dict[str, Any]:
    from s3kv.storage import open_backend

    config = S3KVConfig.load()
    recorder = ListRecorder(open_backend(config))
    started = time.perf_counter()
    store = KVStore.open(config, identity(), backend=recorder, allocator=NumpyAllocator())
    open_ms = (time.perf_counter() - started) * 1e3
    open_requests = store.backend.requests()
    ids, blocks = prompt_blocks()  # our own KV, to check the staged bytes against
    keys = chain_hashes(ids, TOKENS_PER_BLOCK)
    before = store.backend.requests()
    started = time.perf_counter()
    found = store.lookup(keys)
    lookup_us = (time.perf_counter() - started) * 1e6
    lookup_requests = store.backend.requests() - before
    started = time.perf_counter()
    store.prefetch(keys[found.staged : found.staged + found.maybe])
    staged = store.wait_staged(keys, timeout=120)
    stage_s = time.perf_counter() - started
    identical = staged == len(blocks) and all(
        (buf := store.staged(k)) is not None and buf.tobytes() == b.tobytes()
        for k, b in zip(keys, blocks, strict=True)
    )
    block_prefix = f"{config.key_prefix}/{store.fingerprint}/blocks"
    listed_blocks = any(p.startswith(block_prefix) for p in recorder.listed)
    store.close()
    return {
        "role": "load", "manifest_open_ms": round(open_ms, 1), "open_requests": open_requests,
        "lookup_maybe_blocks": found.maybe, "lookup_us": round(lookup_us, 1),
        "lookup_requests": lookup_requests, "staged_blocks": staged,
        "stage_s": round(stage_s, 3),
        "stage_MBps": round(staged * blocks[0].nbytes / stage_s / 1e6, 1) if staged else 0,
        "identical": identical, "listed_block_objects": listed_blocks,
    }  # fmt: skip


def run_role(role: str, env: dict[str, str]) -> dict[str, Any]:
    """Run one role in a fresh interpreter and return its JSON result."""
    out = subprocess.run(
        [sys.executable, __file__, "--role", role],
        env={**os.environ, **env}, check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def orchestrate() -> int:
    from s3kv.testing.local_s3 import LocalS3

    with tempfile.TemporaryDirectory(prefix="s3kv-demo-") as tmp:
        print("starting a local S3 server (SeaweedFS) ...", flush=True)
        server = LocalS3.start(Path(tmp), bucket="s3kv-demo")
        try:
            env = server.env()
            print(f"  endpoint {env['AWS_ENDPOINT_URL_S3']}, bucket {env['TLLM_S3KV_BUCKET']}")
            print("instance A: compute the system prompt's KV with SmolLM2 and save it ...")
            saved = run_role("save", env)
            print(f"  {json.dumps(saved)}")
            print("instance B (a new process): find through the manifest, stage, verify ...")
            loaded = run_role("load", env)
            print(f"  {json.dumps(loaded)}")
        finally:
            server.stop(grace=2.0)
    summary = {
        "identical": loaded["identical"],
        "prompt_tokens": saved["prompt_tokens"],
        "blocks": saved["blocks"],
        "compression_ratio": saved["compression_ratio"],
        "save_s": saved["save_s"],
        "lookup_us": loaded["lookup_us"],
        "lookup_requests": loaded["lookup_requests"],
        "stage_s": loaded["stage_s"],
        "listed_block_objects": loaded["listed_block_objects"],
    }
    print(json.dumps(summary))
    ok = summary["identical"] and not summary["listed_block_objects"]
    return 0 if ok and loaded["staged_blocks"] == saved["blocks"] else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["save", "load"], help="run one instance only")
    args = parser.parse_args()
    if args.role is None:
        return orchestrate()
    result = role_save() if args.role == "save" else role_load()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
