"""End to end: SmolLM2 on the emulated TensorRT-LLM runtime, s3kv on a real S3 server.

Every instance is a new process (a redeploy). Instance A answers a question behind a system
prompt and saves; instance B warms from the bucket and answers a different question behind
the same system prompt. B's greedy output must be token-identical to a run without any cache,
and B must compute only the uncached suffix. Variants: chunked prefill, TP=2, a cache salt
that must not match, a corrupted object, and a hostile writer planting well-formed blocks
(loaded without ``auth_keys``, refused with them).
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from s3kv.testing.emulator.instance import (
    TOKENS_PER_BLOCK,
    InstanceReport,
    InstanceSpec,
    run_instance,
)

if TYPE_CHECKING:
    from s3kv.testing.local_s3 import LocalS3

pytestmark = [pytest.mark.seaweedfs, pytest.mark.model]

SYSTEM_BLOCKS = 8


@pytest.fixture(scope="module")
def prompts() -> dict[str, tuple[int, ...]]:
    from s3kv.testing import smollm2

    _, tokenizer = smollm2.load_model("float32")
    system = tokenizer(smollm2.PROMPT_TEXT).input_ids[: SYSTEM_BLOCKS * TOKENS_PER_BLOCK]
    ask = {
        "a": "\nQuestion: what is the main risk in this report?\nAnswer:",
        "b": "\nQuestion: who owns the follow-up actions?\nAnswer:",
    }
    return {k: tuple(system + tokenizer(v).input_ids) for k, v in ask.items()}


@pytest.fixture
def bucket(seaweedfs: LocalS3, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"e2e-{uuid.uuid4().hex[:12]}"
    seaweedfs.client().create_bucket(Bucket=name)
    for key, value in seaweedfs.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TLLM_S3KV_BUCKET", name)
    monkeypatch.setenv("TLLM_S3KV_MANIFEST_FLUSH_INTERVAL", "0.2")
    return name


def run(prompt: tuple[int, ...], **kwargs: object) -> InstanceReport:
    if kwargs.get("connector") is False:
        return reference_run(prompt, **kwargs)
    return run_instance(InstanceSpec(prompts=(prompt,), **kwargs))  # type: ignore[arg-type]


_REFERENCES: dict[InstanceSpec, InstanceReport] = {}


def reference_run(prompt: tuple[int, ...], **kwargs: object) -> InstanceReport:
    """The plain engine's run (no connector) of ``prompt`` with these settings, once per
    module: it reads no bucket and no ``TLLM_S3KV_*`` setting, so the same arguments give the
    same run. NOTE: each run is a new process (~5 s here); eight tests ask for four runs."""
    spec = InstanceSpec(prompts=(prompt,), **kwargs)  # type: ignore[arg-type]
    if spec not in _REFERENCES:
        _REFERENCES[spec] = run_instance(spec)
    return copy.deepcopy(_REFERENCES[spec])  # NOTE: a test may not change another's


def assert_redeploy_hits(
    prompts: dict[str, tuple[int, ...]], **kwargs: object
) -> tuple[InstanceReport, InstanceReport]:
    a = run(prompts["a"], **kwargs)
    assert a.connector_tokens == [0], "nothing is cached before instance A"
    assert a.metrics["save_completed"] >= SYSTEM_BLOCKS
    b = run(prompts["b"], **kwargs)
    reference = run(prompts["b"], connector=False, **kwargs)
    assert b.outputs == reference.outputs, "loaded KV must give the same greedy tokens"
    cached = SYSTEM_BLOCKS * TOKENS_PER_BLOCK
    assert b.connector_tokens == [cached]
    assert b.computed_tokens == [len(prompts["b"]) - cached], "only the suffix is computed"
    assert reference.computed_tokens == [len(prompts["b"])]
    return a, b


def test_redeploy_warms_and_answers_identically(
    bucket: str, prompts: dict[str, tuple[int, ...]]
) -> None:
    a, b = assert_redeploy_hits(prompts)
    # Warm start staged the system prompt's blocks (and A's question block) before serving.
    assert b.warm_blocks_staged == a.metrics["save_completed"]
    assert b.metrics["prefetch_staged"] >= SYSTEM_BLOCKS
    assert not any(name.startswith("corrupt_objects") for name in b.metrics)


def test_chunked_prefill(bucket: str, prompts: dict[str, tuple[int, ...]]) -> None:
    assert_redeploy_hits(prompts, chunk_tokens=64)


def test_tensor_parallel_two_ranks(bucket: str, prompts: dict[str, tuple[int, ...]]) -> None:
    a, _ = assert_redeploy_hits(prompts, tp_size=2)
    # Each rank wrote its own shard of every block.
    assert a.metrics["save_completed"] % 2 == 0


def test_redeploy_through_codec_processes(
    bucket: str, prompts: dict[str, tuple[int, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Block GET/decode and encode/PUT run in codec processes (shared-memory staging and save
    # buffers): same hits, identical answers. Under TP (rank 0's per-shard arenas):
    # test_redeploy_writes_the_configured_codec[planes-ref-tp2-codec-processes].
    monkeypatch.setenv("TLLM_S3KV_CODEC_PROCESSES", "2")
    a, b = assert_redeploy_hits(prompts)
    for report in (a, b):
        assert report.metrics["codec_processes_alive"] == 2
    assert not any(name.startswith("corrupt_objects") for name in b.metrics)


@pytest.mark.parametrize(
    ("setting", "tp_size", "processes"),
    [(None, 1, 0), ("planes-ref", 1, 0), ("planes-ref", 2, 2)],
    ids=["default", "planes-ref", "planes-ref-tp2-codec-processes"],
)
def test_redeploy_writes_the_configured_codec(
    bucket: str,
    seaweedfs: LocalS3,
    prompts: dict[str, tuple[int, ...]],
    monkeypatch: pytest.MonkeyPatch,
    setting: str | None,
    tp_size: int,
    processes: int,
) -> None:
    # The connector records (layers, 2, heads, tokens_per_block, head_dim) blocks, so
    # planes-ref takes effect end to end (with the pool's 4-D shape it would write
    # PLANES_ZSTD), and the default planes-zstd reads the same 5-D shape. Codec processes
    # encode and decode it too, and each rank's shard has its own heads.
    if setting is not None:
        monkeypatch.setenv("TLLM_S3KV_CODEC", setting)
    monkeypatch.setenv("TLLM_S3KV_CODEC_PROCESSES", str(processes))
    cold, warm = assert_redeploy_hits(prompts, tp_size=tp_size)
    assert not any(name.startswith("corrupt_objects") for name in warm.metrics)
    for report in (cold, warm):  # NOTE: under TP each rank has its own codec processes
        assert report.metrics.get("codec_processes_alive", 0) == processes * tp_size
    from s3kv import codec

    client = seaweedfs.client()
    headers = [
        codec.read_header(client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for obj in page.get("Contents", [])
        if "/blocks/" in obj["Key"]
    ]
    assert len(headers) >= SYSTEM_BLOCKS
    written = codec.CodecId.PLANES_REF if setting else codec.CodecId.PLANES_ZSTD
    assert {h.codec for h in headers} == {written}
    assert {len(h.shape) for h in headers} == {5}


def test_cache_salt_must_not_match(bucket: str, prompts: dict[str, tuple[int, ...]]) -> None:
    run(prompts["a"], cache_salt="tenant-a")
    other = run(prompts["b"], cache_salt="tenant-b")
    assert other.connector_tokens == [0], "another tenant's blocks are never claimed"
    same = run(prompts["b"], cache_salt="tenant-a")
    reference = run(prompts["b"], connector=False, cache_salt="tenant-a")
    assert same.connector_tokens == [SYSTEM_BLOCKS * TOKENS_PER_BLOCK]
    assert same.outputs == reference.outputs == other.outputs


def test_corrupted_object_is_a_miss(
    bucket: str, seaweedfs: LocalS3, prompts: dict[str, tuple[int, ...]]
) -> None:
    run(prompts["a"])
    client = seaweedfs.client()
    keys = sorted(
        obj["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for obj in page.get("Contents", [])
        if "/blocks/" in obj["Key"]
    )
    from s3kv.keys import chain_hashes

    block3 = chain_hashes(prompts["a"], TOKENS_PER_BLOCK)[3].hex()
    (victim,) = [k for k in keys if k.endswith(block3)]
    body = bytearray(client.get_object(Bucket=bucket, Key=victim)["Body"].read())
    body[len(body) // 2] ^= 0x01
    client.put_object(Bucket=bucket, Key=victim, Body=bytes(body))

    b = run(prompts["b"])
    reference = run(prompts["b"], connector=False)
    assert b.outputs == reference.outputs
    assert b.connector_tokens == [3 * TOKENS_PER_BLOCK], "the chain stops at the corrupt block"
    assert b.metrics['corrupt_objects{kind="checksum"}'] >= 1


# --- a hostile writer ------------------------------------------------------------------------


@pytest.fixture
def forge(bucket: str, seaweedfs: LocalS3) -> Callable[[list[str], list[str]], None]:
    """Plant, under each victim key, the KV of another prompt re-encoded as a well-formed,
    unsealed block for that key: what anyone who can write the bucket can do with the public
    codec and no secret."""
    from s3kv import codec

    client = seaweedfs.client()

    def plant(victims: list[str], donors: list[str]) -> None:
        for victim, donor in zip(victims, donors, strict=True):
            blob = client.get_object(Bucket=bucket, Key=donor)["Body"].read()
            header = codec.read_header(blob)
            raw = codec.decode(blob, key=donor)
            forged = codec.encode(raw, key=victim, dtype=header.dtype, shape=header.shape)
            client.put_object(Bucket=bucket, Key=victim, Body=forged)

    return plant


def block_keys(seaweedfs: LocalS3, bucket: str, prompt: tuple[int, ...], n: int) -> list[str]:
    from s3kv.keys import chain_hashes

    client = seaweedfs.client()
    keys = [
        obj["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for obj in page.get("Contents", [])
        if "/blocks/" in obj["Key"]
    ]
    wanted = [h.hex() for h in chain_hashes(prompt, TOKENS_PER_BLOCK)[:n]]
    return [next(k for k in keys if k.endswith(h)) for h in wanted]


def test_planted_blocks_are_loaded_without_auth_keys_and_refused_with_them(
    bucket: str,
    seaweedfs: LocalS3,
    prompts: dict[str, tuple[int, ...]],
    forge: Callable[[list[str], list[str]], None],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from s3kv.auth import new_key_line

    key_file = tmp_path / "keys"
    key_file.write_text(new_key_line("k1") + "\n")
    key_file.chmod(0o600)
    # The attacker's donor KV: another system prompt, written by any instance.
    donor_prompt = (
        tuple(reversed(prompts["a"][: SYSTEM_BLOCKS * TOKENS_PER_BLOCK]))
        + prompts["a"][SYSTEM_BLOCKS * TOKENS_PER_BLOCK :]
    )
    run(donor_prompt)
    donors = block_keys(seaweedfs, bucket, donor_prompt, SYSTEM_BLOCKS)
    # The victim's engines seal their blocks.
    monkeypatch.setenv("TLLM_S3KV_AUTH_KEYS", f"file:{key_file}")
    a = run(prompts["a"])
    assert a.metrics["save_completed"] >= SYSTEM_BLOCKS
    victims = block_keys(seaweedfs, bucket, prompts["a"], SYSTEM_BLOCKS)
    forge(victims, donors)
    reference = run(prompts["b"], connector=False)
    # With auth_keys the planted blocks are misses: nothing claimed, the answer is right.
    sealed = run(prompts["b"])
    assert sealed.connector_tokens == [0]
    assert sealed.outputs == reference.outputs
    assert sealed.metrics['corrupt_objects{kind="unsigned"}'] >= 1
    # Without auth_keys the same planted blocks are claimed and loaded: the threat.
    monkeypatch.delenv("TLLM_S3KV_AUTH_KEYS")
    blind = run(prompts["b"])
    assert blind.connector_tokens == [SYSTEM_BLOCKS * TOKENS_PER_BLOCK]
    assert blind.outputs != reference.outputs, "the donor's KV changed the answer"
