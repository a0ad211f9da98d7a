"""Small tensor helpers of :mod:`s3kv.testing.emulator.model` (one place for the shapes).

* :func:`rotate` — RoPE as HF's ``apply_rotary_pos_emb`` (half-split layout);
* :func:`gather_kv` — a layer's K and V for positions ``[0, end)`` out of the paged pool;
* :func:`fused_bias` — the bias of row-stacked matrices (Q/K/V, gate/up);
* :class:`DeviceTokens` — sampled tokens left in device memory until first read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import torch


class DeviceTokens(Sequence[int]):
    """Greedy tokens left in device memory; the first read waits for the device.

    :meth:`copy_to_host` is the sampler's copy: as TensorRT-LLM's ``TorchSampler.sample_async``
    (``tensorrt_llm/_torch/pyexecutor/sampler.py`` @ 28edbcdb: ``_copy_to_host`` of the new
    tokens, then ``_record_sampler_event``), it queues their copy to pinned host memory and
    an event, which the first read then waits for. The engine calls it after
    ``wait_for_save`` (``_forward_step`` then ``_sample_async``), so device-to-host copies a
    connector queued there run before the tokens' own copy.
    """

    def __init__(self, logits: torch.Tensor) -> None:
        self._device = logits.argmax(-1)  # NOTE: queued, not waited for
        self._host: list[int] | None = None
        self._copy: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None

    @property
    def on_device(self) -> torch.Tensor:
        """The tokens in device memory (a later pass may read them without a host sync)."""
        return self._device

    def copy_to_host(self) -> None:
        """Queue the tokens' copy to pinned host memory (CUDA; a no-op elsewhere or twice)."""
        if self._device.is_cuda and self._copy is None:
            self._copy = torch.empty(self._device.shape, dtype=self._device.dtype, pin_memory=True)
            self._copy.copy_(self._device, non_blocking=True)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()

    def _values(self) -> list[int]:
        if self._host is None:
            if self._copy is not None and self._event is not None:
                self._event.synchronize()
                self._host = [int(t) for t in self._copy.tolist()]
            else:
                self._host = [int(t) for t in self._device.tolist()]
        return self._host

    def __len__(self) -> int:
        return int(self._device.shape[0])

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...

    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        return self._values()[index]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``[T, H, D]`` with ``[T, D]`` tables, as HF's ``apply_rotary_pos_emb``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def gather_kv(layer_kv: torch.Tensor, blocks: torch.Tensor, end: int) -> torch.Tensor:
    """``[blocks, 2, H, tpb, D]`` layer view -> ``[2, H, end, D]`` (K, V) for ``[0, end)``."""
    chunk = layer_kv[blocks]  # [n, 2, H, tpb, D]
    heads, head_dim = chunk.shape[2], chunk.shape[4]
    return chunk.permute(1, 2, 0, 3, 4).reshape(2, heads, -1, head_dim)[:, :, :end]


def fused_bias(parts: list[tuple[torch.Tensor | None, int]]) -> torch.Tensor | None:
    """The biases of row-stacked matrices, zeros for those without one; ``None`` if none has."""
    present = [b for b, _ in parts if b is not None]
    if not present:
        return None
    like = present[0]
    return torch.cat([b if b is not None else like.new_zeros(n) for b, n in parts])


__all__ = ["DeviceTokens", "fused_bias", "gather_kv", "rotate"]
