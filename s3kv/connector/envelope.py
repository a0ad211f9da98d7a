"""The configuration envelope TensorRT-LLM requires of a KV cache connector.

Outside it the connector is either ignored by TensorRT-LLM without a word (block reuse off)
or rejected at startup (beam search, PP/CP, host cache tier). s3kv checks it up front and
turns itself off with one clear log line instead of silently doing nothing.
"""

from __future__ import annotations

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
    return problems


def envelope_warnings(llm_args: Any) -> list[str]:
    """Settings that work but cost hits."""
    warnings: list[str] = []
    if _get(llm_args, "kv_cache_config.enable_partial_reuse", False):
        warnings.append(
            "kv_cache_config.enable_partial_reuse is True: when the device match ends inside "
            "a block s3kv must claim nothing; enable_partial_reuse=False gives more hits"
        )
    return warnings
