"""Helpers for the CLI tests: a bucket with realistic blocks and manifest records, the runner.

Blocks are real codec objects (``codec.encode`` under their own key) and the manifest gets
real segments written by :class:`s3kv.manifest.Manifest` with an injected clock, so that
"written 20 days ago" and "hit 5 days from now" need no sleeping.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from typer.testing import CliRunner, Result

from s3kv import codec
from s3kv.cli.app import app
from s3kv.cli.context import Runtime
from s3kv.keys import (
    ROOT_HASH,
    BlockHash,
    ModelIdentity,
    block_object_key,
    chain_hashes,
    identity_object_key,
)
from s3kv.manifest import Manifest
from s3kv.storage import Backend

DAY = 86400.0
#: Credentials of the `read_only_seaweedfs` fixture (tests/conftest.py): an admin and a reader.
ADMIN = ("s3kv-admin", "admin-secret-0123456789")
READ_ONLY = ("s3kv-reader", "reader-secret-0123456789")
PREFIX = "kv"
TOKENS_PER_BLOCK = 4
SHAPE = (2, 2, 4, 8)  # layers, kv, tokens, head_dim: 128 bf16 = 256 bytes, as identity() says


def identity(model_id: str = "test/model") -> ModelIdentity:
    return ModelIdentity(
        model_id=model_id, weights_revision="r1", dtype="bfloat16", kv_dtype="bfloat16",
        quantization="none", tokens_per_block=TOKENS_PER_BLOCK, kv_factor=2, block_elems=32,
        num_layers=2, layout="test",
    )  # fmt: skip


class Clock:
    """A settable clock (epoch seconds)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class Bucket:
    """A test bucket seeded through a backend, and how to point the CLI at it."""

    backend: Backend
    endpoint: str
    bucket: str
    prefix: str = PREFIX
    fingerprint: str = field(default_factory=lambda: identity().fingerprint())

    def args(self) -> list[str]:
        """The connection flags for the CLI."""
        return ["--bucket", self.bucket, "--prefix", self.prefix, "--endpoint-url", self.endpoint]

    def write_identity(self, ident: ModelIdentity | None = None) -> str:
        ident = ident or identity()
        fp = ident.fingerprint()
        payload = json.dumps(ident.as_dict()).encode()
        self.backend.put(identity_object_key(self.prefix, fp), payload)
        return fp

    def object_key(self, key: BlockHash, fingerprint: str | None = None) -> str:
        return block_object_key(self.prefix, fingerprint or self.fingerprint, key)

    def put_block(self, key: BlockHash, *, seed: int = 0, fingerprint: str | None = None) -> int:
        """Write one encoded block; returns its stored size."""
        raw = np.random.default_rng(seed).normal(size=SHAPE).astype(np.float32)
        bf16 = (raw.view(np.uint32) >> 16).astype(np.uint16)
        object_key = self.object_key(key, fingerprint)
        blob = codec.encode(bf16, key=object_key, dtype="bfloat16", shape=SHAPE)
        self.backend.put(object_key, blob)
        return len(blob)

    def chain(self, tokens: Sequence[int]) -> list[BlockHash]:
        return chain_hashes(list(tokens), TOKENS_PER_BLOCK)

    def write_chain(self, keys: Sequence[BlockHash], clock: Clock, *, seed: int = 0) -> None:
        """PUT every block of a chain and record the writes at ``clock.now``."""
        manifest = self.manifest(clock)
        parent = ROOT_HASH
        for i, key in enumerate(keys):
            size = self.put_block(key, seed=seed + i)
            manifest.record_write(key, parent, size)
            parent = key
        assert manifest.flush() == len(keys)

    def record(self, clock: Clock, *, hits: Sequence[BlockHash] = (),
               pins: Sequence[BlockHash] = ()) -> None:  # fmt: skip
        """Record hits and pins at ``clock.now`` (one segment)."""
        manifest = self.manifest(clock)
        if hits:
            manifest.record_hits(list(hits))
        if pins:
            manifest.record_pin(list(pins))
        assert manifest.flush() > 0

    def manifest(self, clock: Clock) -> Manifest:
        return Manifest(self.backend, self.prefix, self.fingerprint, capacity=1000, fpr=0.01,
                        clock=clock)  # fmt: skip

    def block_keys(self) -> set[str]:
        return {info.key for info in self.backend.list(f"{self.prefix}/{self.fingerprint}/blocks/")}


def invoke(args: Sequence[str], *, runtime: Runtime | None = None, input: str | None = None,
           ) -> Result:  # fmt: skip
    """Run the CLI in-process (stdin is not a terminal unless ``runtime`` says so)."""
    return CliRunner().invoke(app, list(args), obj=runtime or Runtime(), input=input)


def parse_json(result: Result) -> dict[str, Any]:
    """The one JSON document a ``--json`` run printed on stdout."""
    document: dict[str, Any] = json.loads(result.stdout)
    return document


def assert_one_error_line(result: Result, *needles: str, code: int | None = None) -> str:
    """The run failed with exactly one ``Error:`` line on stderr and no traceback."""
    assert result.exit_code != 0, result.output
    if code is not None:
        assert result.exit_code == code, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: "), lines[0]
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]
