"""``s3kv pin``/``unpin``/``pins`` through the CLI runner, by key and from prompt text."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_support import Bucket, Clock, assert_one_error_line, invoke, parse_json

from s3kv.keys import chain_hashes
from s3kv.manifest import load_usage
from s3kv.storage import S3Backend

WORDS = "the quick brown fox jumps over a lazy dog and runs away again".split()  # noqa: SIM905


@pytest.fixture
def bucket(moto_backend: S3Backend, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    monkeypatch.setenv("TLLM_S3KV_BLOOM_CAPACITY", "10000")
    b = Bucket(moto_backend, str(moto_backend.client.meta.endpoint_url), moto_backend.bucket)
    b.write_identity()
    return b


def test_pin_unpin_and_list_by_key(bucket: Bucket) -> None:
    chain = bucket.chain(range(12))
    bucket.write_chain(chain, Clock(time.time()))
    leaf = chain[-1].hex()

    pinned = invoke(["pin", leaf, "--json", *bucket.args()])
    assert pinned.exit_code == 0, pinned.output
    assert parse_json(pinned)["fingerprints"][0]["changed"] == 1
    listed = parse_json(invoke(["pins", "--json", *bucket.args()]))["pins"]
    assert [p["key"] for p in listed] == [leaf]
    assert listed[0]["parent"] == chain[-2].hex()

    # Pinning again changes nothing; unpinning removes it.
    again = parse_json(invoke(["pin", leaf, "--json", *bucket.args()]))["fingerprints"][0]
    assert (again["changed"], again["unchanged"]) == (0, 1)
    assert invoke(["unpin", leaf, *bucket.args()]).exit_code == 0
    assert parse_json(invoke(["pins", "--json", *bucket.args()]))["pins"] == []


def test_pin_adopts_unknown_objects_and_refuses_missing_ones(bucket: Bucket) -> None:
    stray = bucket.chain(range(40, 44))[0]
    bucket.put_block(stray)  # exists, but the manifest never heard of it
    doc = parse_json(invoke(["pin", stray.hex(), "--json", *bucket.args()]))
    assert doc["fingerprints"][0]["adopted"] == 1
    row = load_usage(bucket.backend, bucket.prefix, bucket.fingerprint).row(stray)
    assert row is not None
    assert row.pinned

    nowhere = invoke(["pin", "ab" * 16, "--json", *bucket.args()])
    assert nowhere.exit_code == 1
    assert parse_json(nowhere)["fingerprints"][0]["missing"] == 1
    assert_one_error_line(invoke(["pin", "xyz", *bucket.args()]), "KEY", code=2)
    assert_one_error_line(invoke(["pin", *bucket.args()]), "--text", code=2)


def _tokenizer_dir(path: Path) -> Path:
    """A tiny word-level tokenizer saved the way Hugging Face tokenizers are."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(["[UNK]", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]").save_pretrained(path)
    return path


def test_pin_from_prompt_text(bucket: Bucket, tmp_path: Path) -> None:
    tokenizer = _tokenizer_dir(tmp_path / "tok")
    text = " ".join(WORDS)  # 13 tokens: 3 full blocks of 4
    tokens = [WORDS.index(w) + 1 for w in WORDS]
    chain = chain_hashes(tokens, 4)
    bucket.write_chain(chain, Clock(time.time()))
    prompt = tmp_path / "system-prompt.txt"
    prompt.write_text(text)

    result = invoke(["pin", "--text", str(prompt), "--tokenizer", str(tokenizer), "--json",
                     *bucket.args()])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert parse_json(result)["fingerprints"][0]["changed"] == 3
    pins = parse_json(invoke(["pins", "--json", *bucket.args()]))["pins"]
    assert {p["key"] for p in pins} == {k.hex() for k in chain}

    # With another block size the text maps to keys that do not exist: nothing is pinned.
    other = invoke(["unpin", "--text", str(prompt), "--tokenizer", str(tokenizer),
                    "--tokens-per-block", "3", *bucket.args()])  # fmt: skip
    assert other.exit_code == 1


def test_pin_text_without_transformers_says_how_to_install(
    bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if missing
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    result = invoke(["pin", "--text", str(prompt), "--tokenizer", "x", *bucket.args()])
    assert_one_error_line(result, "transformers", "pip install", code=2)


def test_importing_the_cli_loads_neither_torch_nor_transformers() -> None:
    code = (
        "import sys, s3kv.cli, s3kv.cli.app; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)  # fmt: skip
    assert out.stdout.strip() == "[]"
