"""Decode passes replayed from captured CUDA graphs compute what the eager pass computes.

The fixed-shape decode step (:meth:`PagedLlama.decode_logits`) is checked on the CPU against
the eager forward pass in float64, where the two formulations agree to rounding. Capture and
replay need CUDA: those tests skip here and run on the device machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from s3kv.testing.emulator.device import DeviceValue
from s3kv.testing.emulator.executor import PyExecutorEmulator
from s3kv.testing.emulator.graphs import BLOCK_BUCKET, DecodeItem, pack_inputs, unpack_inputs
from s3kv.testing.emulator.kernels import DeviceTokens
from s3kv.testing.emulator.llm_args import KvCacheConfig, TorchLlmArgs
from s3kv.testing.emulator.loop import _decode_items
from s3kv.testing.emulator.model import DecodeInputs, ForwardItem, PagedLlama, smollm2_config

pytestmark = pytest.mark.model

TPB = 16
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def small_model(device: str = "cpu", dtype: torch.dtype = torch.float64) -> PagedLlama:
    config = smollm2_config(num_hidden_layers=2, vocab_size=1024)
    return PagedLlama.random(config, seed=5, tokens_per_block=TPB, device=device, dtype=dtype)


def tokens(n: int, salt: int) -> list[int]:
    return [(7 * i + salt) % 1024 for i in range(n)]


def inputs_for(items: list[ForwardItem], width: int, pad: int, device: str = "cpu") -> DecodeInputs:
    """The fixed-shape inputs of decode items, tables padded to ``width`` with ``pad``."""
    table = [list(item.block_ids[: item.end // TPB + 1]) for item in items]
    table = [row + [pad] * (width - len(row)) for row in table]

    def column(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return DecodeInputs(
        tokens=column([item.tokens[item.start] for item in items]),
        positions=column([item.start for item in items]),
        write_blocks=column([item.block_ids[item.start // TPB] for item in items]),
        write_slots=column([item.start % TPB for item in items]),
        block_table=torch.tensor(table, dtype=torch.long, device=device),
        lengths=column([item.end for item in items]),
    )


def test_the_fixed_shape_decode_step_computes_the_eager_pass() -> None:
    """Two sequences of different lengths in one padded batch: each row's logits and the K/V
    written into the pool equal the eager pass's, and padding blocks are never attended.

    The padding repeats a block whose contents differ from anything either sequence reads,
    so attending it would move the logits.
    """
    model = small_model()
    first, second = tokens(2 * TPB + 5, 3), tokens(TPB + 9, 11)
    blocks = {"first": [4, 1, 6], "second": [2, 7]}
    pool = model.new_pool(10)  # the prompts but their last token, then junk in a free block
    model.forward_logits([ForwardItem(first, blocks["first"], 0, len(first) - 1)], pool)
    model.forward_logits([ForwardItem(second, blocks["second"], 0, len(second) - 1)], pool)
    pool[9].normal_()
    pools = [pool, pool.clone()]
    steps = [
        ForwardItem(first, blocks["first"], len(first) - 1, len(first)),
        ForwardItem(second, blocks["second"], len(second) - 1, len(second)),
    ]
    eager = model.forward_logits(steps, pools[0])
    fixed = model.decode_logits(inputs_for(steps, width=5, pad=9), pools[1])
    for row, reference in zip(fixed, eager, strict=True):
        torch.testing.assert_close(row, reference, atol=1e-10, rtol=0.0)
    torch.testing.assert_close(pools[1], pools[0], atol=0.0, rtol=0.0)


def test_decode_step_padding_changes_nothing_when_junk_is_unmasked_it_would() -> None:
    """Guard: the mask is what hides the padding (a table width of the exact length and a
    padded one agree), and the junk block would change the result if it were attended."""
    model = small_model()
    seq = tokens(TPB + 3, 5)
    pool = model.new_pool(6)
    model.forward_logits([ForwardItem(seq, [0, 1], 0, len(seq) - 1)], pool)
    pool[5].normal_()
    step = [ForwardItem(seq, [0, 1], len(seq) - 1, len(seq))]
    exact = model.decode_logits(inputs_for(step, width=2, pad=5), pool.clone())
    padded = model.decode_logits(inputs_for(step, width=4, pad=5), pool.clone())
    torch.testing.assert_close(padded, exact, atol=1e-12, rtol=0.0)
    unmasked = inputs_for(step, width=4, pad=5)
    unmasked = DecodeInputs(**{**unmasked.__dict__, "lengths": torch.tensor([4 * TPB])})
    assert not torch.allclose(model.decode_logits(unmasked, pool.clone()), exact, atol=1e-6)


def test_the_packed_inputs_of_a_replayed_pass_compute_the_eager_pass() -> None:
    """What a replay is fed, built on the CPU: two sequences, one whose token is known on
    the host and one whose token the previous pass left on the device (packed as 0, then
    copied in), tables padded to a 64-block width. Decoded from the packed tensor, the pass
    gives the eager logits."""
    model = small_model()
    first, second = tokens(2 * TPB + 5, 3), tokens(TPB + 9, 11)
    blocks = {"first": [4, 1, 6], "second": [2, 7]}
    pool = model.new_pool(10)
    model.forward_logits([ForwardItem(first, blocks["first"], 0, len(first) - 1)], pool)
    model.forward_logits([ForwardItem(second, blocks["second"], 0, len(second) - 1)], pool)
    pools = [pool, pool.clone()]
    steps = [
        ForwardItem(first, blocks["first"], len(first) - 1, len(first)),
        ForwardItem(second, blocks["second"], len(second) - 1, len(second)),
    ]
    eager = model.forward_logits(steps, pools[0])
    sampled = DeviceTokens(torch.nn.functional.one_hot(torch.tensor([5, second[-1]]), 1024))
    items = [
        DecodeItem(blocks["first"], len(first) - 1, token=first[-1]),
        DecodeItem(blocks["second"], len(second) - 1, pending=(sampled, 1)),
    ]
    width = BLOCK_BUCKET
    packed = torch.tensor(pack_inputs(items, width, TPB), dtype=torch.long)
    inputs = unpack_inputs(packed, len(items), width)
    assert inputs.tokens.tolist() == [first[-1], 0]
    inputs.tokens[1:2].copy_(sampled.on_device[1:2])  # NOTE: what DecodeGraphs._fill does
    assert inputs.block_table[1].tolist() == [2, 7] + [7] * (width - 2)
    fixed = model.decode_logits(inputs, pools[1])
    for row, reference in zip(fixed, eager, strict=True):
        torch.testing.assert_close(row, reference, atol=1e-10, rtol=0.0)
    torch.testing.assert_close(pools[1], pools[0], atol=0.0, rtol=0.0)


def test_a_replayed_pass_reads_each_token_where_it_is() -> None:
    """The loop's items for a replayed pass: a final one-token context reads its prompt's
    last token, a decode step without a token in flight its last token, and one whose token
    is still on the device (overlap) reads it there, at its index in that pass."""
    sampled = DeviceTokens(torch.nn.functional.one_hot(torch.tensor([9, 4]), 16).float())
    previous = SimpleNamespace(tokens=DeviceValue.of(sampled), index={7: 0, 8: 1})
    snapshot: list[Any] = [
        ([1, 2, 3], [0], 2, 3, None),  # one-token context: prompt[2]
        ([5, 6], [1], 1, 2, None),  # decode, nothing in flight: tokens[-1]
        ([7, 8, 9], [2], 3, 4, previous),  # decode, its token on the device
    ]
    items = _decode_items(snapshot, [5, 6, 8])
    assert [(i.position, i.token) for i in items] == [(2, 3), (1, 6), (3, None)]
    assert items[2].pending is not None
    assert items[2].pending[0] is sampled
    assert items[2].pending[1] == 1


@cuda
def test_a_replayed_graph_gives_the_eager_decode_logits_and_pool_writes() -> None:
    from s3kv.testing.emulator.graphs import DecodeGraphs

    model = small_model("cuda", torch.float32)
    seq = tokens(3 * TPB + 4, 9)
    blocks = [3, 0, 5, 1]
    pools = [model.new_pool(8), model.new_pool(8)]
    for pool in pools:
        model.forward_logits([ForwardItem(seq, blocks, 0, len(seq) - 1)], pool)
    graphs = DecodeGraphs(model, pools[1])
    eager_tokens = []
    replayed = []
    for _ in range(6):  # one capture, then replays over growing lengths
        step = ForwardItem(seq + eager_tokens, blocks, len(seq) + len(eager_tokens) - 1,
                           len(seq) + len(eager_tokens))  # fmt: skip
        eager_tokens.append(int(model.forward_logits([step], pools[0])[0].argmax()))
        sampled = graphs.launch([DecodeItem(blocks, step.start, token=step.tokens[step.start])])
        replayed.append(sampled[0])
    assert replayed == eager_tokens
    assert (graphs.captures, graphs.replays) == (1, 6)
    torch.testing.assert_close(pools[1], pools[0], atol=2e-2, rtol=0.0)


@cuda
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_an_executor_with_cuda_graphs_generates_the_eager_tokens(overlap: bool) -> None:
    """Same prompts, an executor with graphs and one without: identical tokens, and the
    graph executor's decode passes were replays (the overlap loop feeds each one the token
    its previous pass left on the device)."""
    model = small_model("cuda", torch.float32)
    prompts = [tokens(3 * TPB + 4, 1), tokens(2 * TPB + 1, 2)]
    outputs = []
    for graphs in (None, object()):
        args = TorchLlmArgs(
            disable_overlap_scheduler=not overlap,
            cuda_graph_config=graphs,
            kv_cache_config=KvCacheConfig(tokens_per_block=TPB),
        )
        executor = PyExecutorEmulator(args, model, num_blocks=32)
        outputs.append([list(r.output_tokens) for r in executor.generate(prompts, 12)])
        if graphs is not None:
            replays = executor._loop.graphs
            assert replays is not None
            assert replays.replays >= 11
    assert outputs[1] == outputs[0]
