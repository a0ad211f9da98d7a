"""TensorRT-LLM's ``LlmRequest`` as the connector sees it.

:class:`LlmRequest` carries what ``cpp/tensorrt_llm/nanobind/batch_manager/bindings.cpp``
binds (trtllm-connector.md §4) with the C++ semantics of ``llmRequest.h``: the context
cursor (``context_current_position``, ``context_chunk_size`` clamped to what remains,
``move_to_next_context_chunk``), ``set_prepopulated_prompt_len`` with its block-boundary chunk
adjustment and its ``prepopulatedPromptLen < promptLen`` check, and the state machine.

``get_num_new_matched_tokens`` is called from C++ with the *base* ``LlmRequest``, so there
only bound attributes are readable (docstring of ``KvCacheConnectorManager`` at
``035ab91c``). :class:`BoundLlmRequest` reproduces that: a view that raises
``AttributeError`` for the Python-only ``py_*`` attributes and ``cache_salt``, so a connector
that reads them in that call fails here as it would fail (or read garbage) under
TensorRT-LLM.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections.abc import Sequence
from typing import Any, Final


class LlmRequestState(enum.IntEnum):
    """Request states by TensorRT-LLM's names (the numeric values are this module's own)."""

    CONTEXT_INIT = 2
    GENERATION_IN_PROGRESS = 4
    GENERATION_TO_COMPLETE = 5
    GENERATION_COMPLETE = 6
    DISAGG_CONTEXT_TRANS_IN_PROGRESS = 8
    DISAGG_GENERATION_TRANS_IN_PROGRESS = 10


class FinishReason(enum.Enum):
    """Why a request finished (``tensorrt_llm.bindings.executor.FinishReason`` names).

    ``ERROR`` is the emulator's own marker for a request failed by ``_handle_errors`` (upstream
    answers those with an error response rather than a finish reason).
    """

    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


def cache_salt_id(salt: str) -> int:
    """The 64-bit id TensorRT-LLM derives from a cache salt string.

    TensorRT-LLM (``get_cache_salt_id`` in ``tensorrt_llm/inputs/utils.py``) takes the first
    8 bytes of BLAKE3 over the UTF-8 salt as a little-endian uint64. BLAKE3 is not in the
    standard library, so this uses SHA-256 the same way: connectors treat the id as opaque,
    and only equality between salts matters.
    """
    digest = hashlib.sha256(salt.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little")


@dataclasses.dataclass(frozen=True)
class MultimodalInput:
    """One multimodal item of a prompt, as the binding reports it.

    Attributes:
        hash: The item's content hash as eight int32 words (``multimodal_hashes``).
        position: Prompt offset of the item's first placeholder token.
        length: Number of placeholder tokens.
    """

    hash: tuple[int, ...]
    position: int
    length: int


class LlmRequest:
    """One request: prompt, generated tokens, context cursor and state (beam width 1).

    Attributes mirror the binding's names: ``request_id`` (also ``py_request_id``),
    ``prompt_len``, ``orig_prompt_len``, ``max_new_tokens``, ``lora_task_id`` (``None``),
    ``cache_salt_id`` (``None`` or an int), ``multimodal_hashes`` / ``_positions`` /
    ``_lengths`` (``None``), ``prepopulated_prompt_len``, ``state``,
    ``kv_cache_retention_config`` (``None``), ``py_num_connector_matched_tokens``.
    """

    def __init__(
        self,
        request_id: int,
        input_tokens: Sequence[int],
        max_new_tokens: int,
        *,
        cache_salt: str | None = None,
        is_generation_only: bool = False,
        lora_task_id: int | None = None,
        multimodal: Sequence[MultimodalInput] = (),
        prompt_table: Any = None,
    ) -> None:
        """Create a request in ``CONTEXT_INIT``.

        ``lora_task_id``, ``multimodal`` and ``prompt_table`` set what the binding exposes
        as ``lora_task_id``, ``multimodal_hashes`` / ``_positions`` / ``_lengths`` and
        ``prompt_embedding_table`` / ``prompt_vocab_size`` (``GenericLlmRequest`` in
        ``cpp/tensorrt_llm/nanobind/batch_manager/bindings.cpp``, stored-file id 385050988).
        The per-token extra ids of a prompt table are a constructor argument there but not a
        bound property, so connectors cannot read them; this request does not carry them.
        The emulated model ignores all three (no adapters, no embeddings): they only change
        what a connector sees.

        Raises:
            ValueError: Empty prompt or ``max_new_tokens < 1``.
        """
        if not input_tokens:
            raise ValueError("input_tokens: must not be empty")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
        self.request_id: Final = int(request_id)
        self.py_request_id: Final = self.request_id
        self._tokens = [int(t) for t in input_tokens]
        self.prompt_len: Final = len(self._tokens)
        self.orig_prompt_len: Final = self.prompt_len
        self.py_orig_prompt_len: Final = self.prompt_len
        self.max_new_tokens: Final = max_new_tokens
        self.py_max_new_tokens: Final = max_new_tokens
        self.lora_task_id: int | None = lora_task_id
        self.cache_salt: str | None = cache_salt
        self.cache_salt_id: int | None = None if cache_salt is None else cache_salt_id(cache_salt)
        items = list(multimodal)
        self.multimodal_hashes: list[list[int]] | None = (
            [list(i.hash) for i in items] if items else None
        )
        self.multimodal_positions: list[int] | None = [i.position for i in items] if items else None
        self.multimodal_lengths: list[int] | None = [i.length for i in items] if items else None
        self.prompt_embedding_table: Any = prompt_table
        self.prompt_vocab_size: int | None = (
            None if prompt_table is None else int(getattr(prompt_table, "shape", (1,))[0])
        )
        self.kv_cache_retention_config: Any = None
        self.is_dummy_request = False
        self.is_context_only_request = False
        self._generation_only = is_generation_only
        self.state = LlmRequestState.CONTEXT_INIT
        self.context_current_position = 0
        self._chunk = 0
        self.prepopulated_prompt_len = 0
        self.py_num_connector_matched_tokens = 0
        self.py_draft_tokens: list[int] = []
        self.py_decoding_iter = 0
        self.finish_reason: FinishReason | None = None

    # --- tokens ---

    def get_tokens(self, beam: int | None = None) -> Any:
        """``get_tokens(beam)``: beam's tokens; ``get_tokens()``: one list per beam."""
        if beam is None:
            return [list(self._tokens)]
        self._check_beam(beam)
        return list(self._tokens)

    def get_num_tokens(self, beam: int = 0) -> int:
        """Prompt plus generated tokens of ``beam``."""
        self._check_beam(beam)
        return len(self._tokens)

    def add_new_token(self, token: int, beam: int = 0) -> None:
        """Append a sampled token (the sampler's ``add_new_token``)."""
        self._check_beam(beam)
        self._tokens.append(int(token))

    @property
    def max_num_generated_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self._tokens) - self.prompt_len

    @staticmethod
    def _check_beam(beam: int) -> None:
        if beam != 0:
            raise IndexError(f"beam: only beam 0 exists (beam width 1), got {beam}")

    # --- context cursor (llmRequest.h) ---

    @property
    def context_remaining_length(self) -> int:
        """Prompt tokens not yet computed."""
        return self.prompt_len - self.context_current_position

    @property
    def context_chunk_size(self) -> int:
        """Tokens the next context pass computes."""
        return self._chunk

    @context_chunk_size.setter
    def context_chunk_size(self, size: int) -> None:
        # NOTE: C++ setContextChunkSize clamps to the remaining length.
        self._chunk = max(0, min(int(size), self.context_remaining_length))

    @property
    def is_first_context_chunk(self) -> bool:
        """The cursor has not moved past what was prepopulated."""
        return self.context_current_position == self.prepopulated_prompt_len

    @property
    def is_last_context_chunk(self) -> bool:
        """This chunk reaches the end of the prompt."""
        return self.context_current_position + self._chunk == self.prompt_len

    def move_to_next_context_chunk(self) -> None:
        """Advance the cursor past the chunk just computed."""
        if self.state != LlmRequestState.CONTEXT_INIT:
            raise RuntimeError("Chunking is only possible during the context phase.")
        self.context_current_position += self._chunk
        self._chunk = 0

    def set_prepopulated_prompt_len(self, prepopulated: int, tokens_per_block: int) -> None:
        """Record reused + connector tokens and move the cursor past them (C++ semantics).

        When the current chunk does not reach the end of the prompt, it is shortened so that
        it ends on a block boundary, as ``LlmRequest::setPrepopulatedPromptLen`` does.

        Raises:
            RuntimeError: ``prepopulated >= prompt_len`` (C++ ``TLLM_CHECK``): at least one
                prompt token must be computed to produce the first output token.
        """
        if prepopulated >= self.prompt_len:
            raise RuntimeError(
                f"Invalid state: prepopulatedPromptLen ({prepopulated}) >= promptLen "
                f"({self.prompt_len}) for request {self.request_id}"
            )
        self.prepopulated_prompt_len = prepopulated
        if prepopulated > 0:
            chunk = self._chunk
            if prepopulated + chunk < self.prompt_len:
                floored_end = (prepopulated + chunk) // tokens_per_block * tokens_per_block
                chunk = floored_end - prepopulated
            self.context_current_position = prepopulated
            self.context_chunk_size = chunk

    # --- state ---

    @property
    def num_connector_matched_tokens(self) -> int:
        """Newer bindings' getter for what the connector claimed."""
        return self.py_num_connector_matched_tokens

    @property
    def is_generation_only_request(self) -> bool:
        """Disaggregated decode request (the connector manager rejects these)."""
        return self._generation_only

    @property
    def is_finished(self) -> bool:
        """Generation is over (possibly still saving)."""
        return self.state in (
            LlmRequestState.GENERATION_COMPLETE,
            LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS,
        )

    def finish_by_reason(self, reason: FinishReason) -> None:
        """``LlmRequest.finish_by_reason``: ``GENERATION_COMPLETE`` with ``reason``."""
        self.state = LlmRequestState.GENERATION_COMPLETE
        self.finish_reason = reason

    def will_complete_next_iteration(self) -> bool:
        """``LlmRequest::willCompleteNextIteration``: the token in flight is the last one."""
        return self.max_num_generated_tokens + 1 >= self.max_new_tokens

    def __repr__(self) -> str:
        return (
            f"LlmRequest(id={self.request_id}, state={self.state.name}, "
            f"tokens={len(self._tokens)}/{self.prompt_len}+{self.max_new_tokens})"
        )


#: What the nanobind binding exposes (trtllm-connector.md §4), readable through the view.
BOUND_ATTRIBUTES: Final = frozenset(
    {
        "request_id",
        "prompt_len",
        "orig_prompt_len",
        "get_tokens",
        "get_num_tokens",
        "max_new_tokens",
        "lora_task_id",
        "cache_salt_id",
        "multimodal_hashes",
        "multimodal_positions",
        "multimodal_lengths",
        "prompt_embedding_table",
        "prompt_vocab_size",
        "context_current_position",
        "context_chunk_size",
        "context_remaining_length",
        "is_first_context_chunk",
        "is_last_context_chunk",
        "prepopulated_prompt_len",
        "state",
        "is_context_only_request",
        "is_generation_only_request",
        "is_dummy_request",
        "num_connector_matched_tokens",
        "kv_cache_retention_config",
    }
)


class BoundLlmRequest:
    """The C++ base ``LlmRequest`` that ``get_num_new_matched_tokens`` receives.

    Reads of bound attributes go to the wrapped request; anything else (``py_request_id``,
    ``cache_salt``, ...) raises ``AttributeError``. The manager may set
    ``py_num_connector_matched_tokens`` on it, which lands on the wrapped request.
    """

    __slots__ = ("_request",)

    def __init__(self, request: LlmRequest) -> None:
        object.__setattr__(self, "_request", request)

    @property
    def canonical(self) -> LlmRequest:
        """The Python request behind this view (for the runtime, not for connectors)."""
        request: LlmRequest = object.__getattribute__(self, "_request")
        return request

    def __getattr__(self, name: str) -> Any:
        if name in BOUND_ATTRIBUTES:
            return getattr(self.canonical, name)
        raise AttributeError(
            f"{name!r} is not bound on the C++ LlmRequest that get_num_new_matched_tokens "
            "receives; read only what nanobind/batch_manager/bindings.cpp binds"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "py_num_connector_matched_tokens":
            raise AttributeError(f"{name!r} cannot be set on the C++ LlmRequest")
        setattr(self.canonical, name, value)

    def __repr__(self) -> str:
        return f"Bound{self.canonical!r}"


__all__ = [
    "BOUND_ATTRIBUTES",
    "BoundLlmRequest",
    "FinishReason",
    "LlmRequest",
    "LlmRequestState",
    "MultimodalInput",
    "cache_salt_id",
]
