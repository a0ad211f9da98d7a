"""``s3kv.testing``: light to import, its submodules loaded on first use."""

from __future__ import annotations

import subprocess
import sys

import pytest

import s3kv.testing


def test_importing_the_harness_imports_nothing_heavy() -> None:
    heavy = (
        "torch",
        "transformers",
        "boto3",
        "botocore",
        "pytest",
        "s3kv.testing.emulator",
        "s3kv.testing.local_s3",
        "s3kv.testing.smollm2",
        "s3kv.testing.storage",
    )
    code = f"import sys, s3kv.testing; print([m for m in {heavy!r} if m in sys.modules])"
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_submodules_load_on_first_use() -> None:
    assert s3kv.testing.storage.BackendTests.__name__ == "BackendTests"
    assert s3kv.testing.local_s3.LocalS3.__name__ == "LocalS3"
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = s3kv.testing.nothing
