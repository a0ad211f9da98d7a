"""The model identity of one rank's KV shard, derived from TorchLlmArgs and the KV tensor.

Everything that changes the meaning of a block's bytes goes into
:class:`~s3kv.keys.ModelIdentity`; anything that cannot be determined becomes
:data:`~s3kv.keys.UNKNOWN`, which fails closed (a process-private fingerprint).

The weights revision is the hard part: a model *name* says nothing about which weights are
loaded. In order of preference: the ``model_revision`` setting; a 40-hex commit in
``llm_args.revision``; a Hugging Face cache path (``.../snapshots/<commit>/``); the SHA-256 of
the weight files of a local checkpoint up to :data:`HASH_LIMIT_BYTES`; else unknown.
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path
from typing import Any

from s3kv.config import S3KVConfig
from s3kv.keys import UNKNOWN, ModelIdentity

logger = logging.getLogger(__name__)

#: Local checkpoints up to this size are hashed in full at startup (~1 s per 2 GB).
HASH_LIMIT_BYTES = 8 * 1024**3
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SNAPSHOT = re.compile(r"/snapshots/([0-9a-f]{40})(/|$)")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json")

_KV_DTYPES = {
    "torch.bfloat16": "bfloat16",
    "torch.float16": "float16",
    "torch.float32": "float32",
    "torch.float8_e4m3fn": "fp8_e4m3",
    "torch.float8_e5m2": "fp8_e5m2",
    "torch.int8": "int8",
    "torch.uint8": "uint8",
}


def kv_dtype_name(dtype: Any) -> str | None:
    """s3kv's name for a torch dtype of the KV pool, or ``None`` if unsupported."""
    return _KV_DTYPES.get(str(dtype))


def weights_revision(llm_args: Any, config: S3KVConfig) -> str:
    """An immutable revision of the loaded weights, or :data:`UNKNOWN` (fail closed)."""
    if config.model_revision:
        return config.model_revision
    revision = str(getattr(llm_args, "revision", "") or "")
    if _COMMIT.match(revision):
        return f"commit:{revision}"
    model = str(getattr(llm_args, "model", "") or "")
    snapshot = _SNAPSHOT.search(model)
    if snapshot:
        return f"commit:{snapshot.group(1)}"
    path = Path(model)
    if path.exists():
        digest = _hash_checkpoint(path)
        if digest is not None:
            return digest
    logger.warning(
        "s3kv: cannot determine the weights revision of %r; set TLLM_S3KV_MODEL_REVISION "
        "to share cached blocks between instances",
        model,
    )
    return UNKNOWN


def _hash_checkpoint(path: Path) -> str | None:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    weights = [p for p in files if p.suffix in _WEIGHT_SUFFIXES]
    if not weights or sum(p.stat().st_size for p in weights) > HASH_LIMIT_BYTES:
        return None
    digest = hashlib.sha256()
    for file in weights + [p for p in files if p.name in _CONFIG_FILES]:
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def _quantization(llm_args: Any) -> str:
    from s3kv.connector.envelope import kv_quant_algo

    quant = getattr(llm_args, "quant_config", None)
    algo = getattr(quant, "quant_algo", None) if quant is not None else None
    kv_algo = kv_quant_algo(llm_args)
    if quant is None and kv_algo is None:
        return "none"
    return f"{algo or 'none'}/kv:{kv_algo or 'none'}"


def shard_identity(
    llm_args: Any,
    config: S3KVConfig,
    *,
    kv_shape: tuple[int, ...],
    kv_dtype: Any,
    tp_size: int,
    tp_rank: int,
    revision: str,
    manager: str = "v1",
) -> ModelIdentity:
    """The identity of this rank's shard, from the registered tensor's shape and dtype.

    Args:
        llm_args: TensorRT-LLM's ``TorchLlmArgs`` (or the emulator's).
        config: s3kv settings.
        kv_shape: ``[blocks, layers, kv_factor, block_elems]`` of the registered pool.
        kv_dtype: Its torch dtype.
        tp_size: Tensor-parallel world size.
        tp_rank: This rank.
        revision: From :func:`weights_revision`.
        manager: ``"v1"`` or ``"v2"`` (KVCacheManagerV2 registers through a layout; its page
            bytes are not assumed to match V1's, so the two never share blocks).
    """
    kv_cache = getattr(llm_args, "kv_cache_config", None)
    return ModelIdentity(
        model_id=str(getattr(llm_args, "model", "") or "") or UNKNOWN,
        weights_revision=revision,
        dtype=str(getattr(llm_args, "dtype", "auto") or "auto"),
        kv_dtype=kv_dtype_name(kv_dtype) or UNKNOWN,
        quantization=_quantization(llm_args),
        tokens_per_block=int(getattr(kv_cache, "tokens_per_block", 32) or 32),
        kv_factor=int(kv_shape[2]),
        block_elems=int(kv_shape[3]),
        num_layers=int(kv_shape[1]),
        layout=f"trtllm-{manager}/" + str(getattr(llm_args, "attn_backend", "TRTLLM") or "TRTLLM"),
        tp_size=tp_size,
        tp_rank=tp_rank,
    )


__all__ = [
    "HASH_LIMIT_BYTES",
    "kv_dtype_name",
    "shard_identity",
    "weights_revision",
]
