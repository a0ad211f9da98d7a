"""TensorRT-LLM's ``KvCacheLayout``: what a connector's worker gets under ``KVCacheManagerV2``.

Reproduces ``tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_layout.py`` (NVIDIA/TensorRT-LLM
@ ``ae7a7216``, stored-file id 57717663703): a layout is ``tokens_per_block``, ``dtype`` and
one :class:`KvCacheLayerGroupLayout` per layer group (``layer_ids``, ``window_size``,
``regions``); a :class:`KvCacheRegion` is a byte range repeating once per page slot (``base``,
``size``, ``stride``, ``num_slots``, ``buffers`` in memory order, layer-major, K then V).
:meth:`KvCacheLayout.as_single_pool_tensor` is upstream's: the
``[num_slots, num_layers, kv_factor, block_size]`` view for one group with one region, ``None``
otherwise (several groups, several regions, a page expansion other than 1).

On the CPU there are no device addresses to wrap, so each region also carries the tensor it
describes (``storage``, ``[num_slots, elements]``); ``as_tensor`` views that tensor instead of
``convert_to_torch_tensor(TensorWrapper(base, ...))``. ``base`` is still its ``data_ptr()``.

:func:`register_kv_cache_layout` is the base class default of
``KvCacheConnectorWorker.register_kv_cache_layout`` (``connectors/kv_cache_connector.py`` @
``035ab91c``), applied by the emulator to a worker class that does not define the method (the
s3kv stand-in ABC does not).

For tests: :func:`nvfp4_pool` (a V1 pool tensor shaped like an NVFP4 cache: int8, two FP4
values per byte) and :func:`nvfp4_layout` (that pool plus a separate block-scale region, one
FP8 scale per 16 elements, the V2 ``KEY_BLOCK_SCALE`` / ``VALUE_BLOCK_SCALE`` roles of
``kv_cache_manager_v2.py`` @ ``00043967``), for which ``as_single_pool_tensor()`` is ``None``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

#: Elements per NVFP4 block scale (one FP8 E4M3 scale per 16 FP4 values).
NVFP4_SCALE_BLOCK = 16


@dataclasses.dataclass(frozen=True)
class KvCacheBufferRef:
    """One ``(layer, role)`` buffer of a region, in memory order."""

    layer_id: int
    role: str
    expansion: int = 1


@dataclasses.dataclass(frozen=True, eq=False)
class KvCacheRegion:
    """A byte range that repeats once per page slot: slot ``i`` is at ``base + stride * i``.

    Attributes:
        base: ``storage.data_ptr()``.
        size: Bytes of the region in one slot.
        stride: Bytes between two slots.
        num_slots: Page slots (blocks).
        buffers: The ``(layer, role)`` buffers covered, in memory order.
        storage: The ``[num_slots, size // itemsize]`` tensor the region describes (emulator
            only: stands in for the raw device address).
    """

    base: int
    size: int
    stride: int
    num_slots: int
    buffers: tuple[KvCacheBufferRef, ...]
    storage: torch.Tensor

    def address_of(self, slot_id: int) -> int:
        """Address of this region for ``slot_id``.

        Raises:
            IndexError: ``slot_id`` outside ``[0, num_slots)`` (``BAD_PAGE_INDEX`` included).
        """
        if not 0 <= slot_id < self.num_slots:
            raise IndexError(f"slot_id {slot_id} out of range [0, {self.num_slots})")
        return self.base + self.stride * slot_id

    def as_tensor(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A ``[num_slots, size // itemsize]`` view sharing memory with the cache.

        Raises:
            ValueError: ``size`` or ``stride`` is not a multiple of ``dtype``'s item size.
        """
        itemsize = torch.empty((), dtype=dtype).element_size()
        if self.size % itemsize or self.stride % itemsize:
            raise ValueError(
                f"region size {self.size} and stride {self.stride} must both be "
                f"multiples of {dtype} itemsize {itemsize}"
            )
        return self.storage.view(torch.uint8).view(dtype)

    def slot_tensor(self, slot_id: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """One slot's ``[size // itemsize]`` view; ``IndexError`` for ``-1`` (no page)."""
        self.address_of(slot_id)
        return self.as_tensor(dtype)[slot_id]


@dataclasses.dataclass(frozen=True)
class KvCacheLayerGroupLayout:
    """One layer group: the unit page indices are scoped to."""

    layer_group_id: int
    layer_ids: tuple[int, ...]
    window_size: int | None
    regions: tuple[KvCacheRegion, ...]

    @property
    def bytes_per_page(self) -> int:
        """Bytes this group occupies in one page slot."""
        return sum(region.size for region in self.regions)


@dataclasses.dataclass(frozen=True)
class KvCacheLayout:
    """What a connector is handed in place of a single pool tensor."""

    tokens_per_block: int
    groups: tuple[KvCacheLayerGroupLayout, ...]
    dtype: torch.dtype = torch.uint8

    def group(self, layer_group_id: int) -> KvCacheLayerGroupLayout:
        """The group with this id (``KeyError`` if none)."""
        for group in self.groups:
            if group.layer_group_id == layer_group_id:
                return group
        raise KeyError(f"no layer group {layer_group_id} in layout")

    def group_of_layer(self, layer_id: int) -> KvCacheLayerGroupLayout:
        """The group owning a model layer (``KeyError`` if none)."""
        for group in self.groups:
            if layer_id in group.layer_ids:
                return group
        raise KeyError(f"layer {layer_id} is not covered by this layout")

    def as_single_pool_tensor(self) -> torch.Tensor | None:
        """``[num_slots, num_layers, kv_factor, block_size]`` view, or ``None`` (upstream rules)."""
        if len(self.groups) != 1 or len(self.groups[0].regions) != 1:
            return None
        group = self.groups[0]
        region = group.regions[0]
        num_layers = len(group.layer_ids)
        if not num_layers or len(region.buffers) % num_layers:
            return None
        kv_factor = len(region.buffers) // num_layers
        if any(buffer.expansion != 1 for buffer in region.buffers):
            return None
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        if region.size % (itemsize * len(region.buffers)):
            return None
        block_size = region.size // itemsize // len(region.buffers)
        flat = region.as_tensor(self.dtype)
        return flat.view(region.num_slots, num_layers, kv_factor, block_size)


def _region(tensor: torch.Tensor, roles: tuple[str, ...]) -> KvCacheRegion:
    """A region over a block-major ``[slots, layers, len(roles), elems]`` tensor."""
    if not tensor.is_contiguous():
        raise ValueError("tensor: must be contiguous")
    slots, layers = int(tensor.shape[0]), int(tensor.shape[1])
    itemsize = tensor.element_size()
    return KvCacheRegion(
        base=tensor.data_ptr(),
        size=int(tensor[0].numel()) * itemsize,
        stride=int(tensor.stride(0)) * itemsize,
        num_slots=slots,
        buffers=tuple(KvCacheBufferRef(layer, role) for layer in range(layers) for role in roles),
        storage=tensor.view(slots, -1),
    )


def _roles(kv_factor: int, suffix: str = "") -> tuple[str, ...]:
    return tuple(f"{role}{suffix}" for role in ("key", "value")[:kv_factor])


def layout_of_pool(pool: torch.Tensor, tokens_per_block: int) -> KvCacheLayout:
    """The layout of a single ``[blocks, layers, kv_factor, block_elems]`` pool (one group).

    Full attention (``window_size=None``), layers ``0 .. layers-1``, dtype of the pool.
    """
    if pool.dim() != 4:
        raise ValueError(f"pool: expected 4 dimensions, got shape {tuple(pool.shape)}")
    region = _region(pool, _roles(int(pool.shape[2])))
    group = KvCacheLayerGroupLayout(0, tuple(range(int(pool.shape[1]))), None, (region,))
    return KvCacheLayout(tokens_per_block, (group,), pool.dtype)


def nvfp4_pool(
    num_blocks: int, num_layers: int, block_elems: int, kv_factor: int = 2
) -> torch.Tensor:
    """A zeroed NVFP4-shaped V1 pool: int8, ``block_elems // 2`` bytes per layer and role.

    Raises:
        ValueError: ``block_elems`` is not a multiple of 16 (one scale per 16 values).
    """
    if block_elems % NVFP4_SCALE_BLOCK:
        raise ValueError(f"block_elems: must be a multiple of 16, got {block_elems}")
    return torch.zeros((num_blocks, num_layers, kv_factor, block_elems // 2), dtype=torch.int8)


def nvfp4_layout(
    num_blocks: int,
    num_layers: int,
    block_elems: int,
    tokens_per_block: int,
    kv_factor: int = 2,
) -> KvCacheLayout:
    """An NVFP4-shaped layout: the :func:`nvfp4_pool` region plus a block-scale region.

    The second region (uint8, ``block_elems // 16`` per layer and role) makes
    :meth:`KvCacheLayout.as_single_pool_tensor` return ``None``, as upstream does for block
    scales.
    """
    data = nvfp4_pool(num_blocks, num_layers, block_elems, kv_factor)
    scales = torch.zeros(
        (num_blocks, num_layers, kv_factor, block_elems // NVFP4_SCALE_BLOCK), dtype=torch.uint8
    )
    regions = (_region(data, _roles(kv_factor)), _region(scales, _roles(kv_factor, "_block_scale")))
    group = KvCacheLayerGroupLayout(0, tuple(range(num_layers)), None, regions)
    return KvCacheLayout(tokens_per_block, (group,), torch.int8)


def register_kv_cache_layout(worker: Any, layout: KvCacheLayout) -> None:
    """``worker.register_kv_cache_layout(layout)``, or TensorRT-LLM's base default.

    The default (``KvCacheConnectorWorker.register_kv_cache_layout`` @ ``035ab91c``) hands
    ``layout.as_single_pool_tensor()`` to ``register_kv_caches``.

    Raises:
        NotImplementedError: The worker has no ``register_kv_cache_layout`` and the layout is
            not one pool tensor (upstream's message).
    """
    method = getattr(worker, "register_kv_cache_layout", None)
    if method is not None:
        method(layout)
        return
    tensor = layout.as_single_pool_tensor()
    if tensor is None:
        raise NotImplementedError(
            f"{type(worker).__name__} does not implement register_kv_cache_layout, and this KV "
            f"cache cannot be described as one pool tensor: {len(layout.groups)} layer "
            f"group(s), {sum(len(g.regions) for g in layout.groups)} region(s). Implement "
            "register_kv_cache_layout to address the regions directly."
        )
    worker.register_kv_caches(tensor)


__all__ = [
    "NVFP4_SCALE_BLOCK",
    "KvCacheBufferRef",
    "KvCacheLayerGroupLayout",
    "KvCacheLayout",
    "KvCacheRegion",
    "layout_of_pool",
    "nvfp4_layout",
    "nvfp4_pool",
    "register_kv_cache_layout",
]
