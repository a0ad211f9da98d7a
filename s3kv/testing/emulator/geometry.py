"""Where a rank's KV lives: the pool geometry and the tensor-parallel head split.

A pool is one tensor ``[num_blocks, num_layers, kv_factor, block_elems]``, TensorRT-LLM's
``get_unique_primary_pool()`` shape: block-major, so ``pool[block_id]`` is one contiguous
chunk holding every layer's K and V for that block. Inside a block, for each layer and for K
then V, the ``block_elems = kv_heads * tokens_per_block * head_dim`` elements are laid out
HND, ``[kv_heads, tokens_per_block, head_dim]``. The connector must treat blocks as opaque
bytes; only the model runner (:mod:`s3kv.testing.emulator.model`) reads the inner layout.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class KvGeometry:
    """Shape of one rank's KV pool.

    Attributes:
        num_layers: Attention layers held by the pool (dimension 1).
        num_kv_heads: KV heads held by *this rank* (after the TP split).
        head_dim: Elements per head.
        tokens_per_block: Tokens per KV block.
        kv_factor: 2 (K and V) for this runner; TensorRT-LLM uses 1 only for K-only (MLA).
        dtype: Element dtype of the pool tensor.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    kv_factor: int = 2
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_block"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"{name}: must be > 0, got {value}")
        if self.kv_factor not in (1, 2):
            raise ValueError(f"kv_factor: must be 1 or 2, got {self.kv_factor}")

    @property
    def block_elems(self) -> int:
        """Elements per layer per K (or V) in one block: TensorRT-LLM's ``block_size``."""
        return self.num_kv_heads * self.tokens_per_block * self.head_dim

    @property
    def block_nbytes(self) -> int:
        """Bytes of one whole block (``pool[block_id]``): every layer's K and V."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.kv_factor * self.block_elems * itemsize

    def pool_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """``(num_blocks, num_layers, kv_factor, block_elems)``, TensorRT-LLM's pool shape."""
        return (num_blocks, self.num_layers, self.kv_factor, self.block_elems)

    def hnd_view(self, pool: torch.Tensor) -> torch.Tensor:
        """View a pool as ``[blocks, layers, kv_factor, kv_heads, tokens_per_block, head_dim]``.

        Raises:
            ValueError: ``pool`` does not have this geometry's shape (for any block count).
        """
        if pool.dim() != 4 or tuple(pool.shape[1:]) != self.pool_shape(0)[1:]:
            raise ValueError(
                f"pool: expected shape [blocks, {self.num_layers}, {self.kv_factor}, "
                f"{self.block_elems}], got {list(pool.shape)}"
            )
        return pool.view(
            pool.shape[0],
            self.num_layers,
            self.kv_factor,
            self.num_kv_heads,
            self.tokens_per_block,
            self.head_dim,
        )


def split_range(total: int, parts: int, index: int) -> range:
    """The ``index``-th of ``parts`` contiguous ranges covering ``range(total)``.

    ``np.array_split`` semantics: the first ``total % parts`` ranges hold one extra item.

    Raises:
        ValueError: ``parts < 1`` or ``index`` outside ``[0, parts)``.
    """
    if parts < 1:
        raise ValueError(f"parts: must be >= 1, got {parts}")
    if not 0 <= index < parts:
        raise ValueError(f"index: must be in [0, {parts}), got {index}")
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


def kv_heads_for_rank(num_kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """KV heads owned by ``tp_rank``; earlier ranks take the extra head.

    SmolLM2 (3 KV heads) at TP=2: rank 0 owns ``range(0, 2)``, rank 1 ``range(2, 3)``.

    Raises:
        ValueError: Bad rank, or more ranks than KV heads (this runner does not replicate
            KV heads across ranks the way TensorRT-LLM does for ``tp_size > num_kv_heads``).
    """
    if tp_size > num_kv_heads:
        raise ValueError(f"tp_size: must be <= num_kv_heads ({num_kv_heads}), got {tp_size}")
    return split_range(num_kv_heads, tp_size, tp_rank)


def query_heads_for_rank(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """Query heads owned by ``tp_rank``: the GQA groups of its KV heads.

    Query head ``h`` attends with KV head ``h // (num_heads // num_kv_heads)``, as in HF's
    ``repeat_kv``; SmolLM2 (9 / 3) at TP=2: rank 0 owns ``range(0, 6)``, rank 1 ``range(6, 9)``.

    Raises:
        ValueError: ``num_heads`` is not a multiple of ``num_kv_heads``, or see
            :func:`kv_heads_for_rank`.
    """
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads: must be a multiple of num_kv_heads ({num_kv_heads}), got {num_heads}"
        )
    group = num_heads // num_kv_heads
    kv = kv_heads_for_rank(num_kv_heads, tp_size, tp_rank)
    return range(kv.start * group, kv.stop * group)


__all__ = ["KvGeometry", "kv_heads_for_rank", "query_heads_for_rank", "split_range"]
