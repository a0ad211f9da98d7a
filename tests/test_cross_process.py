"""One process saves real SmolLM2 KV blocks; a fresh process finds them through the manifest.

This is the redeploy case for the store alone, on a real S3 server (SeaweedFS): instance B
never lists block objects, learns what exists from the manifest, stages every block (GET →
verify → decode) and holds exactly the bytes its own forward pass computes.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from s3kv.testing.local_s3 import LocalS3

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

pytestmark = [pytest.mark.seaweedfs, pytest.mark.model]


def test_fresh_process_finds_and_stages_identical_bytes(seaweedfs: LocalS3) -> None:
    import store_demo  # examples/store_demo.py: the roles of the demo

    bucket = f"xp-{uuid.uuid4().hex[:12]}"
    seaweedfs.client().create_bucket(Bucket=bucket)
    env = {**seaweedfs.env(), "TLLM_S3KV_BUCKET": bucket, "TLLM_S3KV_PREFIX": "xp"}

    saved = store_demo.run_role("save", env)
    assert saved["blocks"] == saved["prompt_tokens"] // store_demo.TOKENS_PER_BLOCK
    assert saved["blocks"] >= 16
    assert saved["compression_ratio"] > 1.3

    loaded = store_demo.run_role("load", env)
    assert loaded["lookup_maybe_blocks"] == saved["blocks"]
    assert loaded["lookup_requests"] == 0, "lookup must not touch the network"
    assert loaded["staged_blocks"] == saved["blocks"]
    assert loaded["identical"] is True
    assert loaded["listed_block_objects"] is False, "B must learn keys from the manifest only"
    assert loaded["open_requests"] <= 8
