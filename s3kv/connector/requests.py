"""What the scheduler core sees of a request: a small typed view the adapter builds.

The core (:mod:`s3kv.connector.scheduler`) is engine-neutral: it never reads TensorRT-LLM's
``LlmRequest``. The adapter builds a :class:`RequestView` from the attributes TensorRT-LLM's
binding exposes on the C++ request that ``get_num_new_matched_tokens`` receives
(``GenericLlmRequest`` in ``cpp/tensorrt_llm/nanobind/batch_manager/bindings.cpp``:
``request_id``, ``prompt_len``, ``get_tokens``, ``lora_task_id``, ``cache_salt_id``,
``multimodal_hashes`` / ``_positions`` / ``_lengths``, ``prompt_embedding_table``,
``prompt_vocab_size``). Per-iteration reports need no view: :class:`StepReport` is the shape
of TensorRT-LLM's ``RequestData`` the core reads, matched structurally.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from s3kv.keys import MultimodalItem


@dataclass(frozen=True)
class RequestView:
    """One request as the scheduler core sees it.

    Attributes:
        request_id: The engine's request id.
        prompt: The prompt's token ids.
        key_inputs: Key inputs beyond the tokens (keyword arguments of
            :func:`s3kv.keys.chain_hashes`), or ``None`` when the request has an input s3kv
            cannot see or cannot make global: it is then neither claimed nor saved.
    """

    request_id: int
    prompt: Sequence[int]
    key_inputs: dict[str, Any] | None


class StepReport(Protocol):
    """One scheduled request in an iteration's scheduler output (``RequestData``'s shape)."""

    @property
    def request_id(self) -> int: ...

    @property
    def new_tokens(self) -> Sequence[int]: ...

    @property
    def new_block_ids(self) -> Sequence[int]: ...

    @property
    def computed_position(self) -> int: ...

    @property
    def num_scheduled_tokens(self) -> int: ...


def lora_key(revision: str) -> int:
    """The 64-bit LoRA key input for an adapter revision (stable across instances)."""
    digest = hashlib.sha256(b"s3kv-lora-revision\0" + revision.encode()).digest()
    return int.from_bytes(digest[:8], "little")


def request_view(request: Any, lora_revisions: Mapping[int, str] | None = None) -> RequestView:
    """The view of a TensorRT-LLM request (the C++ binding's attributes only)."""
    prompt_len = int(request.prompt_len)
    tokens = request.get_tokens(0)
    # NOTE: the binding returns a fresh list of ints, which is kept as it is when it holds
    # just the prompt (before the first token, when the engine asks) and sliced (a pointer
    # copy) otherwise. Converting element by element took 10-17 ms at 128K tokens, on the
    # scheduler's path under the block manager's lock; hashing checks the elements anyway.
    if not isinstance(tokens, list):
        tokens = list(tokens)
    prompt = tokens if len(tokens) == prompt_len else tokens[:prompt_len]
    return RequestView(int(request.request_id), prompt, key_inputs(request, lora_revisions))


def key_inputs(
    request: Any, lora_revisions: Mapping[int, str] | None = None
) -> dict[str, Any] | None:
    """Key inputs beyond tokens, from the attributes TensorRT-LLM's binding exposes.

    Returns ``None`` when a key input exists that s3kv cannot see or cannot make global, so
    the request is neither claimed nor saved (two different contents would share a key):

    * a LoRA task id without a configured adapter revision (``lora_revisions``): the id is a
      number each deployment assigns, so it may name another adapter elsewhere;
    * a prompt table (p-tuning): its fake token ids index a per-request embedding table, and
      the per-token extra ids are a constructor argument the binding does not expose;
    * multimodal items without a position or length in the prompt.
    """
    args: dict[str, Any] = {}
    lora = getattr(request, "lora_task_id", None)
    if lora is not None:
        revision = (lora_revisions or {}).get(int(lora))
        if revision is None:
            return None
        args["lora_task_id"] = lora_key(revision)
    if _has_prompt_table(request):
        return None
    salt = getattr(request, "cache_salt_id", None)
    if salt is not None:
        args["cache_salt"] = struct.pack("<Q", int(salt) & (2**64 - 1))
    hashes = getattr(request, "multimodal_hashes", None)
    if hashes:
        positions = list(getattr(request, "multimodal_positions", None) or [])
        lengths = list(getattr(request, "multimodal_lengths", None) or [])
        if len(positions) != len(hashes) or len(lengths) != len(hashes):
            return None
        args["multimodal"] = [
            MultimodalItem(struct.pack(f"<{len(h)}i", *[int(v) for v in h]), int(pos), int(length))
            for h, pos, length in zip(hashes, positions, lengths, strict=True)
        ]
    return args


def honoured_tokens(request: Any) -> int | None:
    """KVCacheManagerV2's honoured count (``py_num_connector_matched_tokens``), if readable.

    ``KvCacheConnectorManager.commit_new_matched_tokens`` sets it to the tokens the runtime
    will consume, before ``update_state_after_alloc`` (``connectors/kv_cache_connector.py``
    @``035ab91c``; the order is pinned by TensorRT-LLM's ``test_kv_connector_v2_prefix.py``,
    stored-file id 57539656528).
    """
    value = getattr(request, "py_num_connector_matched_tokens", None)
    return value if isinstance(value, int) else None


def _has_prompt_table(request: Any) -> bool:
    # NOTE: getattr with a default: a binding without the attribute means "no table".
    for name in ("prompt_embedding_table", "prompt_vocab_size"):
        try:
            value = getattr(request, name, None)
        except Exception:  # a binding that raises on read: assume a table, fail closed
            return True
        if value is not None and not (isinstance(value, int) and value == 0):
            return True
    return False


__all__ = [
    "RequestView",
    "StepReport",
    "honoured_tokens",
    "key_inputs",
    "lora_key",
    "request_view",
]
