"""Decode-shaped passes replayed from captured CUDA graphs, as TensorRT-LLM runs them.

TensorRT-LLM captures its decode step in CUDA graphs by default
(``TorchLlmArgs.cuda_graph_config``, ``default_factory=CudaGraphConfig``,
``tensorrt_llm/llmapi/llm_args.py`` @ fcd3f316) and replays one for every batch of decode
steps alone, and on main also for a batch whose contexts are all final one-token chunks
(``_make_single_token_context_graph_batch``, ``_torch/pyexecutor/engine/runners/decoder/
runner.py`` @ fcc4432b). A replay is one launch: the host's share of a decode step is then
the loop's bookkeeping, not a kernel launch per operation, and the step is as long as the
device takes. The emulator's eager decode step is launch-bound (about 28 launches a layer),
so without graphs any host work beside it (a connector's codec, say) shows in full in the
step time where an engine would hide it behind the device.

:class:`DecodeGraphs` captures :meth:`PagedLlama.decode_logits` once per batch size and
table width (widths rounded up to :data:`BLOCK_BUCKET` blocks) and replays it. Inputs reach
the graph's static tensors in one page-locked host-to-device copy; a token sampled by the
previous pass (overlap loop) is copied device to device, so the host never waits for it.

Capture needs CUDA and one rank: the all-reduces of a TP model go through the caller's
process group (gloo on the CPU), which a graph cannot hold; the loop keeps such models eager.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Final

import torch

from s3kv.testing.emulator.kernels import DeviceTokens
from s3kv.testing.emulator.model import DecodeInputs, PagedLlama

#: Table widths are captured in multiples of this many blocks: a longer sequence replays the
#: next width up, and a step attends over at most this many padded blocks more than it needs.
BLOCK_BUCKET: Final = 64

#: Rows of the packed input tensor before the block table: token, position, write block,
#: write slot, length.
_COLUMNS: Final = 5


@dataclasses.dataclass(frozen=True)
class DecodeItem:
    """One sequence of a decode-shaped pass.

    Attributes:
        block_ids: Its KV block ids in order; must cover ``[0, position]``.
        position: The position computed (its K/V are written, its next token sampled).
        token: The token at ``position``, when the host knows it.
        pending: Otherwise, where the previous pass left it on the device: the sampled tokens
            and this sequence's index among them.
    """

    block_ids: Sequence[int]
    position: int
    token: int | None = None
    pending: tuple[DeviceTokens, int] | None = None

    def __post_init__(self) -> None:
        if (self.token is None) == (self.pending is None):
            raise ValueError("token/pending: give exactly one")


def pack_inputs(items: Sequence[DecodeItem], width: int, tokens_per_block: int) -> list[int]:
    """The values of a captured pass's packed input tensor, in its layout.

    Five rows of ``len(items)`` values (token, position, write block, write slot, length;
    a token still on the device is 0 here and copied in afterwards), then each item's
    block table padded to ``width`` by repeating its last block (the mask hides padding).
    """
    columns: list[list[int]] = [[] for _ in range(_COLUMNS)]
    table: list[int] = []
    for item in items:
        blocks = list(item.block_ids[: item.position // tokens_per_block + 1])
        row = (
            item.token if item.token is not None else 0,
            item.position,
            blocks[-1],
            item.position % tokens_per_block,
            item.position + 1,
        )
        for column, value in zip(columns, row, strict=True):
            column.append(value)
        table += blocks
        table += [blocks[-1]] * (width - len(blocks))
    return [value for column in columns for value in column] + table


def unpack_inputs(packed: torch.Tensor, batch: int, width: int) -> DecodeInputs:
    """Views of a packed input tensor (:func:`pack_inputs`' layout) as a pass's inputs."""
    columns = packed[: batch * _COLUMNS].view(_COLUMNS, batch)
    return DecodeInputs(
        tokens=columns[0],
        positions=columns[1],
        write_blocks=columns[2],
        write_slots=columns[3],
        block_table=packed[batch * _COLUMNS :].view(batch, width),
        lengths=columns[4],
    )


@dataclasses.dataclass(frozen=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    packed: torch.Tensor  # [B * (_COLUMNS + N)] long: every input, one copy in
    inputs: DecodeInputs  # views of `packed`
    logits: torch.Tensor  # [B, vocab], rewritten by every replay


class DecodeGraphs:
    """Captured decode passes of one model over one pool (CUDA, one rank).

    The pool's storage is captured by address: it must stay the tensor given here.
    """

    def __init__(self, model: PagedLlama, pool: torch.Tensor) -> None:
        if not self.supported(model):
            raise ValueError("model: decode graphs need a CUDA model on one rank")
        self._model = model
        self._pool = pool
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._memory = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        self.captures = 0  # graphs captured so far
        self.replays = 0  # passes replayed so far

    @staticmethod
    def supported(model: PagedLlama) -> bool:
        """Whether ``model`` can replay captured decode passes: CUDA, one rank, on the
        current device (the streams and events here are the current device's)."""
        if model.device.type != "cuda" or model.tp_size != 1:
            return False
        return model.device.index in (None, torch.cuda.current_device())

    def launch(self, items: Sequence[DecodeItem]) -> DeviceTokens:
        """Replay the pass for ``items`` on the current stream; the greedy tokens stay queued.

        Captures the graph for this batch size and table width first if none was.

        Raises:
            ValueError: No items, or an item's ``block_ids`` do not cover its position.
        """
        if not items:
            raise ValueError("items: a pass needs at least one sequence")
        tpb = self._model.geometry.tokens_per_block
        needed = [item.position // tpb + 1 for item in items]
        for n, (item, count) in enumerate(zip(items, needed, strict=True)):
            if len(item.block_ids) < count:
                raise ValueError(
                    f"items[{n}].block_ids: {len(item.block_ids)} blocks cannot hold "
                    f"position {item.position} at {tpb} per block"
                )
        width = -(-max(needed) // BLOCK_BUCKET) * BLOCK_BUCKET
        captured = self._graphs.get((len(items), width))
        if captured is None:
            captured = self._capture(len(items), width)
            self._graphs[(len(items), width)] = captured
        self._fill(captured, items, width)
        captured.graph.replay()
        self.replays += 1
        return DeviceTokens(captured.logits)

    def _fill(self, captured: _Captured, items: Sequence[DecodeItem], width: int) -> None:
        host = torch.tensor(
            pack_inputs(items, width, self._model.geometry.tokens_per_block), dtype=torch.long
        )
        # NOTE: page-locked, so the copy is queued like a kernel; the caching host allocator
        # keeps this buffer until the copy has run.
        captured.packed.copy_(host.pin_memory(), non_blocking=True)
        for n, item in enumerate(items):
            if item.pending is not None:
                sampled, index = item.pending
                captured.inputs.tokens[n : n + 1].copy_(sampled.on_device[index : index + 1])

    def _capture(self, batch: int, width: int) -> _Captured:
        device = self._model.device
        packed = torch.zeros(batch * (_COLUMNS + width), dtype=torch.long, device=device)
        inputs = unpack_inputs(packed, batch, width)
        # NOTE: warm-up runs (lazy library state, allocator growth) write K/V at block 0 of
        # a one-block scratch pool, never into the engine's pool; the capture then records
        # the same kernels over the engine's pool without running them.
        scratch = self._model.new_pool(1)
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for _ in range(2):
                self._model.decode_logits(inputs, scratch)
        torch.cuda.current_stream().wait_stream(self._stream)
        graph = torch.cuda.CUDAGraph()
        # NOTE: thread-local: the store's threads may allocate pinned memory or query events
        # while a capture runs (a new batch size mid-serving); in the default global mode
        # that would invalidate the capture.
        with torch.cuda.graph(
            graph, pool=self._memory, stream=self._stream, capture_error_mode="thread_local"
        ):
            logits = self._model.decode_logits(inputs, self._pool)
        self.captures += 1
        return _Captured(graph, packed, inputs, logits)


__all__ = ["BLOCK_BUCKET", "DecodeGraphs", "DecodeItem", "pack_inputs", "unpack_inputs"]
