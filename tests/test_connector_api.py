"""The connector subclasses TensorRT-LLM's real base classes when ``tensorrt_llm`` imports.

TensorRT-LLM cannot be installed here, so a stand-in ``tensorrt_llm`` package is written to a
temporary directory, at the new location, the old one, or both, and a fresh interpreter
imports ``s3kv.connector.trtllm`` with it on the path.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

NEW = "tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py"
OLD = "tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py"

BASES = textwrap.dedent(
    """
    from abc import ABC, abstractmethod

    class KvCacheConnectorWorker(ABC):
        def __init__(self, llm_args):
            self._llm_args = llm_args
            self._metadata = None
        def bind_connector_meta(self, metadata):
            self._metadata = metadata
        def get_connector_meta(self):
            return self._metadata
        @abstractmethod
        def register_kv_caches(self, kv_cache_tensor): ...

    class KvCacheConnectorScheduler(ABC):
        def __init__(self, llm_args):
            self._llm_args = llm_args
        @abstractmethod
        def build_connector_meta(self, scheduler_output): ...
    """
)

PROBE = textwrap.dedent(
    """
    import importlib, sys
    from s3kv.connector import api, trtllm
    real = importlib.import_module(api.SOURCE)
    assert issubclass(trtllm.S3KVConnectorScheduler, real.KvCacheConnectorScheduler)
    assert issubclass(trtllm.S3KVConnectorWorker, real.KvCacheConnectorWorker)
    print(api.SOURCE)
    """
)


def fake_trtllm(root: Path, *locations: str) -> None:
    for location in locations:
        path = root / location
        for parent in [*reversed(path.relative_to(root).parents)][1:]:
            (root / parent).mkdir(exist_ok=True)
            (root / parent / "__init__.py").touch()
        path.write_text(BASES)


@pytest.mark.parametrize(
    ("locations", "expected"),
    [
        ((NEW,), "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector"),
        ((OLD,), "tensorrt_llm._torch.pyexecutor.kv_cache_connector"),
        ((NEW, OLD), "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector"),
    ],
)
def test_real_base_classes_are_used(
    tmp_path: Path, locations: tuple[str, ...], expected: str
) -> None:
    fake_trtllm(tmp_path, *locations)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin"},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == expected


def test_stand_ins_without_tensorrt_llm() -> None:
    from s3kv.connector import api, trtllm

    if api.HAVE_TRTLLM:  # pragma: no cover - a machine with TensorRT-LLM
        pytest.skip("tensorrt_llm is installed")
    assert api.SOURCE == "s3kv stand-ins"
    assert issubclass(trtllm.S3KVConnectorScheduler, api.KvCacheConnectorScheduler)
    assert issubclass(trtllm.S3KVConnectorWorker, api.KvCacheConnectorWorker)
