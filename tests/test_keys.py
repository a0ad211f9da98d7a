"""Block hashing, the model fingerprint and the object key layout."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s3kv.errors import KeyDerivationError
from s3kv.keys import (
    HASH_BYTES,
    ROOT_HASH,
    UNKNOWN,
    BlockHash,
    ModelIdentity,
    MultimodalItem,
    block_object_key,
    block_object_keys,
    chain_hashes,
    hash_block,
    layout_fingerprint,
    parse_block_object_key,
)

IDENTITY = ModelIdentity(
    model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    weights_revision="sha256:abc",
    dtype="bfloat16",
    kv_dtype="bfloat16",
    quantization="none",
    tokens_per_block=32,
    kv_factor=2,
    block_elems=3 * 32 * 64,
    num_layers=30,
    layout="trtllm/HND",
    tp_size=1,
    tp_rank=0,
)


def test_golden_hash_is_stable() -> None:
    # Pinned value: changing the hash silently orphans every object in every bucket.
    h = hash_block(ROOT_HASH, list(range(32)))
    assert h.hex() == "546cab2df7841e68dc7369fdcc51aa67"
    assert len(h) == HASH_BYTES


def test_same_hash_in_a_fresh_process() -> None:
    code = "from s3kv.keys import *; print(hash_block(ROOT_HASH, list(range(32))).hex())"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert out == hash_block(ROOT_HASH, list(range(32))).hex()


@settings(max_examples=50, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=200),
    tpb=st.integers(1, 16),
)
def test_chain_matches_block_by_block(tokens: list[int], tpb: int) -> None:
    chain = chain_hashes(tokens, tpb)
    assert len(chain) == len(tokens) // tpb
    parent = ROOT_HASH
    for i, h in enumerate(chain):
        parent = hash_block(parent, tokens[i * tpb : (i + 1) * tpb])
        assert h == parent


def test_chain_covers_whole_prefix() -> None:
    a = chain_hashes([1] * 32 + [2] * 32, 32)
    b = chain_hashes([9] * 32 + [2] * 32, 32)
    assert a[1] != b[1], "same second block behind a different first block must differ"


def test_numpy_and_list_inputs_agree() -> None:
    tokens = list(range(100, 164))
    assert chain_hashes(tokens, 32) == chain_hashes(np.array(tokens, dtype=np.int64), 32)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"extra_ids": [0] * 64},
        {"lora_task_id": 7},
        {"cache_salt": "tenant-a"},
        {"multimodal": [MultimodalItem(b"\x01" * 32, start=4, length=8)]},
    ],
)
def test_every_input_changes_the_key(kwargs: dict[str, object]) -> None:
    tokens = list(range(64))
    assert chain_hashes(tokens, 32, **kwargs) != chain_hashes(tokens, 32)  # type: ignore[arg-type]


def test_salt_differs_per_tenant_and_chains() -> None:
    tokens = list(range(96))
    a = chain_hashes(tokens, 32, cache_salt="a")
    b = chain_hashes(tokens, 32, cache_salt="b")
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_salt_only_on_first_block() -> None:
    first = hash_block(ROOT_HASH, [1, 2])
    with pytest.raises(KeyDerivationError, match="cache_salt"):
        hash_block(first, [3, 4], cache_salt="x")


def test_multimodal_offset_matters() -> None:
    tokens = list(range(64))
    a = chain_hashes(tokens, 32, multimodal=[MultimodalItem(b"\x01" * 32, start=0, length=40)])
    b = chain_hashes(tokens, 32, multimodal=[MultimodalItem(b"\x01" * 32, start=8, length=40)])
    assert a[0] != b[0]
    assert a[1] != b[1]
    # An item that ends before block 1 does not touch block 1's own inputs, but still
    # reaches it through the chain.
    c = chain_hashes(tokens, 32, multimodal=[MultimodalItem(b"\x02" * 32, start=0, length=4)])
    assert c[1] != chain_hashes(tokens, 32)[1]


def test_mm_item_distinct_from_content() -> None:
    tokens = list(range(32))
    a = chain_hashes(tokens, 32, multimodal=[MultimodalItem(b"\x01" * 32, 0, 32)])
    b = chain_hashes(tokens, 32, multimodal=[MultimodalItem(b"\x02" * 32, 0, 32)])
    assert a != b


@pytest.mark.parametrize(
    ("tokens", "kwargs", "match"),
    [
        ([-1], {}, "tokens"),
        ([2**32], {}, "tokens"),
        ([1.5], {}, "tokens"),
        ([1, 2], {"extra_ids": [1]}, "extra_ids"),
        ([1, 2], {"lora_task_id": -1}, "lora_task_id"),
    ],
)
def test_bad_input_is_rejected(tokens: list[object], kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(KeyDerivationError, match=match):
        hash_block(ROOT_HASH, tokens, **kwargs)  # type: ignore[arg-type]


def test_tokens_per_block_must_be_positive() -> None:
    with pytest.raises(KeyDerivationError, match="tokens_per_block"):
        chain_hashes([1, 2, 3], 0)


def test_partial_trailing_block_is_not_hashed() -> None:
    assert len(chain_hashes(list(range(63)), 32)) == 1
    assert chain_hashes(list(range(10)), 32, max_blocks=5) == []
    assert len(chain_hashes(list(range(128)), 32, max_blocks=2)) == 2


# --- fingerprint ---


def test_fingerprint_is_stable_across_processes() -> None:
    code = (
        "import sys; sys.path.insert(0, 'tests'); from test_keys import IDENTITY; "
        "print(IDENTITY.fingerprint())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert out == IDENTITY.fingerprint()
    assert len(out) == 32


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other"},
        {"weights_revision": "sha256:def"},
        {"dtype": "float16"},
        {"kv_dtype": "fp8_e4m3"},
        {"quantization": "fp8"},
        {"tokens_per_block": 64},
        {"kv_factor": 1},
        {"block_elems": 1},
        {"num_layers": 29},
        {"layout": "trtllm/NHD"},
        {"tp_size": 2, "tp_rank": 0},
        {"tp_size": 2, "tp_rank": 1},
        {"format_version": 2},
        {"extra": (("rope_scaling", "yarn"),)},
    ],
)
def test_every_identity_field_changes_the_fingerprint(change: dict[str, object]) -> None:
    assert dataclasses.replace(IDENTITY, **change).fingerprint() != IDENTITY.fingerprint()  # type: ignore[arg-type]


def shards_of(identity: ModelIdentity, tp_size: int) -> list[ModelIdentity]:
    return [dataclasses.replace(identity, tp_size=tp_size, tp_rank=r) for r in range(tp_size)]


def test_golden_fingerprints_are_stable() -> None:
    # Pinned values: a moved shard fingerprint orphans every block object of that model, a
    # moved layout fingerprint every TP manifest.
    assert IDENTITY.fingerprint() == "b8673d32d05107d952eb38e3880f307a"
    shards = shards_of(IDENTITY, 2)
    assert shards[1].fingerprint() == "9aafa70e5eaf81d04bda1b9d59864ee0"
    assert layout_fingerprint(shards) == "5b58472b26341413e114d55551f3e888"


def test_layout_fingerprint_names_one_manifest_per_layout() -> None:
    # TP=1: the layout is the shard, so single-GPU buckets keep their manifest.
    assert layout_fingerprint([IDENTITY]) == IDENTITY.fingerprint()
    shards = shards_of(IDENTITY, 4)
    layout = layout_fingerprint(shards)
    assert layout not in {s.fingerprint() for s in shards}, "blocks stay under each shard"
    # Another TP size, another input, or another per-shard geometry (KV heads that do not
    # divide evenly) is another layout.
    assert layout_fingerprint(shards_of(IDENTITY, 2)) != layout
    other = shards_of(dataclasses.replace(IDENTITY, kv_dtype="fp8_e4m3"), 4)
    assert layout_fingerprint(other) != layout
    uneven = [*shards[:3], dataclasses.replace(shards[3], block_elems=1)]
    assert layout_fingerprint(uneven) != layout


@pytest.mark.parametrize("ranks", [[], [1, 0], [0, 1, 2]])
def test_layout_fingerprint_needs_every_shard_in_rank_order(ranks: list[int]) -> None:
    shards = [dataclasses.replace(IDENTITY, tp_size=2, tp_rank=r % 2) for r in ranks]
    with pytest.raises(KeyDerivationError, match="layout_fingerprint"):
        layout_fingerprint(shards)


def test_layout_fingerprint_fails_closed_too() -> None:
    code = (
        "import sys, dataclasses; sys.path.insert(0, 'tests'); "
        "from test_keys import IDENTITY, shards_of; from s3kv.keys import layout_fingerprint; "
        "print(layout_fingerprint(shards_of(dataclasses.replace(IDENTITY, dtype=None), 2)))"
    )
    other_process = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()
    unknown = shards_of(dataclasses.replace(IDENTITY, dtype=None), 2)
    assert other_process != layout_fingerprint(unknown)


@pytest.mark.parametrize("value", [None, UNKNOWN])
def test_unknown_input_fails_closed(value: str | None) -> None:
    unknown = dataclasses.replace(IDENTITY, weights_revision=value)
    assert not unknown.is_shareable
    assert unknown.fingerprint() != IDENTITY.fingerprint()
    code = (
        "import sys, dataclasses; sys.path.insert(0, 'tests'); from test_keys import IDENTITY; "
        f"print(dataclasses.replace(IDENTITY, weights_revision={value!r}).fingerprint())"
    )
    other_process = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert other_process != unknown.fingerprint(), "unknown inputs must never match elsewhere"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"tokens_per_block": 0}, "tokens_per_block"),
        ({"kv_factor": 3}, "kv_factor"),
        ({"tp_rank": 1}, "tp_rank"),
        ({"model_id": ""}, "model_id"),
    ],
)
def test_bad_identity_is_rejected(change: dict[str, object], match: str) -> None:
    with pytest.raises(KeyDerivationError, match=match):
        dataclasses.replace(IDENTITY, **change)  # type: ignore[arg-type]


# --- object keys ---


def test_object_key_round_trip() -> None:
    h = hash_block(ROOT_HASH, [1, 2, 3])
    key = block_object_key("team/kv", "f" * 32, h)
    assert key == f"team/kv/{'f' * 32}/blocks/{h.hex()[:2]}/{h.hex()}"
    assert parse_block_object_key("team/kv", key) == ("f" * 32, h)
    assert parse_block_object_key("/team/kv/", key) == ("f" * 32, h)
    assert parse_block_object_key("team/kv", "team/kv/x/manifest/CURRENT") is None
    assert block_object_key("", "fp", h).startswith("fp/blocks/")


def test_object_keys_spread_over_prefixes() -> None:
    keys = chain_hashes(list(range(32 * 4096)), 32)
    shards = Counter(block_object_key("p", "fp", k).split("/")[3] for k in keys)
    assert len(shards) == 256
    assert max(shards.values()) < 3 * 4096 / 256


def test_block_hash_is_bytes() -> None:
    h: BlockHash = hash_block(ROOT_HASH, [5])
    assert isinstance(h, bytes)


def test_object_keys_in_bulk_are_the_object_key_of_each_hash() -> None:
    hashes = [BlockHash(bytes([i]) * HASH_BYTES) for i in range(5)]
    for prefix in ("", "/", "kv", "/kv/", "a/b", "a/b/"):
        assert block_object_keys(prefix, "f" * 32, hashes) == [
            block_object_key(prefix, "f" * 32, h) for h in hashes
        ]
    assert block_object_keys("kv", "f" * 32, []) == []
