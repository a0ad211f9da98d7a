"""The configuration envelope TensorRT-LLM requires of a KV cache connector.

Outside it the connector is either ignored by TensorRT-LLM without a word (block reuse off)
or rejected at startup (beam search, PP/CP, host cache tier). s3kv checks it up front and
turns itself off with one clear log line instead of silently doing nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _get(obj: Any, path: str, default: Any = None) -> Any:
    for part in path.split("."):
        if obj is None:
            return default
        obj = getattr(obj, part, None)
    return default if obj is None else obj


def envelope_problems(llm_args: Any) -> list[str]:
    """Everything about ``llm_args`` that stops s3kv from working, each with its fix."""
    problems: list[str] = []
    if not _get(llm_args, "kv_cache_config.enable_block_reuse", True):
        problems.append(
            "kv_cache_config.enable_block_reuse is False: TensorRT-LLM never consults the "
            "connector without block reuse; set enable_block_reuse=True"
        )
    policy = str(
        _get(llm_args, "scheduler_config.capacity_scheduler_policy", "GUARANTEED_NO_EVICT")
    )
    if "GUARANTEED_NO_EVICT" not in policy:
        problems.append(
            f"scheduler_config.capacity_scheduler_policy is {policy}: connectors require "
            "GUARANTEED_NO_EVICT"
        )
    if int(_get(llm_args, "max_beam_width", 1)) > 1:
        problems.append("max_beam_width > 1: connectors support beam width 1 only")
    for name in ("pipeline_parallel_size", "context_parallel_size"):
        if int(_get(llm_args, name, 1)) > 1:
            problems.append(f"{name} > 1: connectors do not support pipeline/context parallel")
    if int(_get(llm_args, "kv_cache_config.host_cache_size", 0) or 0) > 0:
        problems.append(
            "kv_cache_config.host_cache_size > 0: the host cache tier cannot be combined "
            "with a connector; set host_cache_size=0 (s3kv stages in host memory itself)"
        )
    if _get(llm_args, "enable_attention_dp", False):
        problems.append("enable_attention_dp: s3kv does not support attention data parallel yet")
    if str(_get(llm_args, "kv_cache_config.dtype", "auto")).lower() in ("nvfp4", "fp4"):
        problems.append(
            "kv_cache_config.dtype is NVFP4: its block scales live in a separate pool the "
            "connector cannot see"
        )
    algo = kv_quant_algo(llm_args)
    if algo is not None and "FP4" in algo:
        problems.append(
            f"KV cache quantization {algo}: FP4 KV keeps its block scales in a separate pool "
            "the connector cannot see; use FP8 or unquantized KV with s3kv"
        )
    return problems


def kv_quant_algo(llm_args: Any) -> str | None:
    """The KV cache quantization algorithm, upper-case, or ``None`` when there is none.

    From ``llm_args.quant_config.kv_cache_quant_algo`` first, then the checkpoint:
    ModelOpt's ``hf_quant_config.json`` (``quantization.kv_cache_quant_algo``) and
    ``config.json``'s ``quantization_config`` (``kv_cache_quant_algo``). NOTE: these are the
    files ModelOpt checkpoints carry; the TensorRT-LLM code that reads them was not located in
    the source index, so this is s3kv's reading, failing closed (an int8 pool without a
    readable INT8 setting is refused).
    """
    algo = _get(llm_args, "quant_config.kv_cache_quant_algo")
    if algo is not None:
        return _algo_name(algo)
    model = _get(llm_args, "model")
    if not model:
        return None
    root = Path(str(model))
    for name, path in (
        ("hf_quant_config.json", ("quantization",)),
        ("config.json", ("quantization_config",)),
    ):
        try:
            data = json.loads((root / name).read_text())
        except (OSError, ValueError):
            continue
        for part in path:
            data = data.get(part) if isinstance(data, dict) else None
        if isinstance(data, dict) and data.get("kv_cache_quant_algo"):
            return _algo_name(data["kv_cache_quant_algo"])
    return None


def _algo_name(algo: Any) -> str:
    text = str(getattr(algo, "name", None) or getattr(algo, "value", None) or algo)
    return text.rsplit(".", 1)[-1].upper()


def pool_dtype_problem(llm_args: Any, kv_dtype: str | None) -> str:
    """Why a pool of ``kv_dtype`` (s3kv's name) cannot be served, or ''.

    An int8/uint8 pool is INT8 KV only when the quantization config says so; otherwise it is
    FP4 data packed two per byte (NVFP4 pools are allocated as int8 with half the elements),
    whose scales s3kv would not save: restoring such blocks would give wrong outputs.
    """
    if kv_dtype in ("int8", "uint8") and kv_quant_algo(llm_args) != "INT8":
        return (
            f"the KV pool is {kv_dtype} but the quantization config does not say INT8 KV: "
            "most likely NVFP4 packed data, whose block scales live in a separate pool; "
            "s3kv refuses it"
        )
    return ""


def envelope_warnings(llm_args: Any) -> list[str]:
    """Settings that work but cost hits."""
    warnings: list[str] = []
    if _get(llm_args, "kv_cache_config.enable_partial_reuse", False):
        warnings.append(
            "kv_cache_config.enable_partial_reuse is True: when the device match ends inside "
            "a block s3kv must claim nothing; enable_partial_reuse=False gives more hits"
        )
    return warnings


__all__ = [
    "envelope_problems",
    "envelope_warnings",
    "kv_quant_algo",
    "pool_dtype_problem",
]
