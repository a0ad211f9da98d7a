"""PagedLlama: the paged forward pass is SmolLM2, and KV from the pool is really used.

The core property for the connector is :func:`test_loaded_prefix_blocks_give_the_cold_output`:
copying the first k blocks from another pool (what a connector load does) and computing only
the rest yields the same tokens as computing everything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from s3kv.testing.emulator.model import ForwardItem, PagedLlama, smollm2_config
from s3kv.testing.emulator.tp import spawn_ranks
from s3kv.testing.smollm2 import PROMPT_TEXT, load_model, load_weights

pytestmark = pytest.mark.model

TPB = 16  # tokens per block
PROMPT_LEN = 100  # 6 full blocks and a partial one
NEW_TOKENS = 20
#: Logit tolerance between fp32 runs whose rows were computed in different shapes (whole vs
#: chunked prefill, loaded prefix, batching, TP): an fp32 last-bit difference that flips the
#: bf16 rounding of one K/V element moves logits by up to ~0.08 here (measured).
BF16_KV_ATOL = 0.15


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    # NOTE: the test machine's 2 cores are shared; OpenMP threads that spin on a barrier
    # while another process holds a core make runs 2-3x slower and erratic. One thread is
    # both faster and steadier here.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hf_model() -> Any:
    return load_model("float32")[0]


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    tokenizer = load_model("float32")[1]
    ids: list[int] = tokenizer(PROMPT_TEXT).input_ids[:PROMPT_LEN]
    return ids


@pytest.fixture(scope="module")
def paged(hf_model: Any) -> PagedLlama:
    return PagedLlama.from_hf(hf_model, tokens_per_block=TPB)


@dataclasses.dataclass(frozen=True)
class Run:
    """A greedy generation: its tokens, the logits each came from, and the pool it left."""

    tokens: list[int]
    logits: list[torch.Tensor]
    pool: torch.Tensor
    block_ids: list[int]


def cold_run(model: PagedLlama, prompt: list[int]) -> Run:
    """The reference: whole prefill then decode, contiguous block ids, a fresh pool."""
    block_ids = list(range(blocks_for(PROMPT_LEN + NEW_TOKENS)))
    pool = model.new_pool(len(block_ids))
    tokens, logits = generate(model, pool, block_ids, prompt)
    return Run(tokens, logits, pool, block_ids)


@pytest.fixture(scope="module")
def cold(paged: PagedLlama, prompt: list[int]) -> Run:
    """The fp32 cold run, shared read-only by the tests that compare against it."""
    return cold_run(paged, prompt)


def generate(
    model: PagedLlama,
    pool: torch.Tensor,
    block_ids: Sequence[int],
    prompt: Sequence[int],
    *,
    start: int = 0,
    chunk: int | None = None,
    new_tokens: int = NEW_TOKENS,
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy generation: prefill [start, len(prompt)) in chunks, then decode one at a time.

    Returns the generated tokens and the logits each was taken from.
    """
    tokens = list(prompt)
    position = start
    while True:  # prefill, possibly chunked
        end = len(tokens) if chunk is None else min(len(tokens), position + chunk)
        logits = model.forward_logits([ForwardItem(tokens, block_ids, position, end)], pool)[0]
        position = end
        if end == len(tokens):
            break
    out: list[torch.Tensor] = []
    while True:
        out.append(logits)
        tokens.append(int(logits.argmax()))
        if len(out) == new_tokens:
            return tokens[len(prompt) :], out
        # Decode step: the newest token's KV is computed, [0, len - 1) comes from the pool.
        step = ForwardItem(tokens, block_ids, len(tokens) - 1, len(tokens))
        logits = model.forward_logits([step], pool)[0]


def blocks_for(tokens: int) -> int:
    return -(-tokens // TPB)


def test_prefill_matches_hf(hf_model: Any, prompt: list[int], paged: PagedLlama) -> None:
    with torch.no_grad():
        reference = hf_model(input_ids=torch.tensor([prompt])).logits[0, -1]
    item = ForwardItem(prompt, list(range(blocks_for(PROMPT_LEN))), 0, PROMPT_LEN)
    # bf16 KV (the default): the same top-1, logits within bf16 rounding of K/V.
    logits = paged.forward_logits([item], paged.new_pool(blocks_for(PROMPT_LEN)))[0]
    assert int(logits.argmax()) == int(reference.argmax())
    assert paged.forward([item], paged.new_pool(blocks_for(PROMPT_LEN))) == [
        int(reference.argmax())
    ]
    torch.testing.assert_close(logits, reference, atol=0.15, rtol=0.0)
    # fp32 KV: nothing is rounded, so this is the same function as HF's up to kernel order.
    exact = PagedLlama.from_hf(hf_model, tokens_per_block=TPB, kv_dtype=torch.float32)
    logits32 = exact.forward_logits([item], exact.new_pool(blocks_for(PROMPT_LEN)))[0]
    torch.testing.assert_close(logits32, reference, atol=2e-4, rtol=0.0)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0},
    ],
    ids=lambda rope: rope["rope_type"],
)
def test_rope_variants_and_biases_match_hf(rope: dict[str, Any]) -> None:
    # A tiny random Llama with every optional bias and a scaled RoPE; fp32 KV so that only
    # kernel order separates the two implementations.
    from transformers import LlamaForCausalLM

    config = smollm2_config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters=rope,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("bias"):  # HF zero-initializes biases; make them matter
                param.normal_(0.0, 0.5)
            elif "q_proj" in name or "k_proj" in name:
                # NOTE: sharpen attention: with init-scale weights it is nearly uniform and
                # positions barely matter, so a wrong RoPE would hide in rounding noise.
                param.mul_(10.0)
    tokens = [int(t) for t in torch.randint(0, 256, (80,))]
    with torch.no_grad():
        reference = hf(input_ids=torch.tensor([tokens])).logits[0, -1]
    model = PagedLlama.from_hf(hf, tokens_per_block=TPB, kv_dtype=torch.float32)
    logits = model.forward_logits([ForwardItem(tokens, range(5), 0, 80)], model.new_pool(5))[0]
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0.0)


def test_sequence_length_dependent_rope_is_refused() -> None:
    config = smollm2_config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )
    with pytest.raises(ValueError, match="rope_type"):
        PagedLlama.random(config, seed=0)


def test_layer_hooks_bracket_each_layers_kv_write(paged: PagedLlama, prompt: list[int]) -> None:
    pool = paged.new_pool(blocks_for(PROMPT_LEN))
    calls: list[tuple[str, int, bool]] = []

    def written(layer: int) -> bool:
        return bool(pool[:, layer].abs().sum() > 0)

    def pre(layer: int) -> None:
        calls.append(("pre", layer, written(layer)))

    def post(layer: int) -> None:
        # save_kv_layer relies on this: layer i's KV is in the pool when post_layer(i) runs,
        # and layer i + 1's is not yet.
        nxt = layer + 1 < paged.geometry.num_layers and written(layer + 1)
        calls.append(("post", layer, written(layer) and not nxt))

    paged.forward(
        [ForwardItem(prompt, list(range(blocks_for(PROMPT_LEN))), 0, PROMPT_LEN)],
        pool,
        pre_layer=pre,
        post_layer=post,
    )
    expected = []
    for layer in range(paged.geometry.num_layers):
        expected += [("pre", layer, False), ("post", layer, True)]
    assert calls == expected


def test_chunked_prefill_generates_the_same_tokens(
    paged: PagedLlama, prompt: list[int], cold: Run
) -> None:
    pool = paged.new_pool(len(cold.block_ids))
    chunked, logits = generate(paged, pool, cold.block_ids, prompt, chunk=32)
    assert chunked == cold.tokens
    for a, b in zip(logits, cold.logits, strict=True):
        torch.testing.assert_close(a, b, atol=BF16_KV_ATOL, rtol=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_loaded_prefix_blocks_give_the_cold_output(
    hf_model: Any, paged: PagedLlama, prompt: list[int], cold: Run, dtype: torch.dtype
) -> None:
    # Cold: everything computed, in pool A.
    if dtype == torch.float64:
        model = PagedLlama.from_hf(hf_model, tokens_per_block=TPB, dtype=dtype)
        cold = cold_run(model, prompt)
    else:
        model = paged
    count = len(cold.block_ids)
    # Warm: pool B, other block ids; the 6 full prompt blocks arrive as whole-block copies
    # (what the connector's load does) and only positions [96, 100) are prefilled.
    loaded = PROMPT_LEN // TPB
    warm_ids = [count + 3 + i for i in range(count)]
    warm_pool = model.new_pool(2 * count + 3)
    # NOTE: the cold pool by now also holds the generated tokens' KV, but only in later
    # blocks; the first `loaded` blocks are prompt-only and final.
    snapshot = cold.pool[cold.block_ids[:loaded]].clone()
    warm_pool[warm_ids[:loaded]] = snapshot
    warm, warm_logits = generate(model, warm_pool, warm_ids, prompt, start=loaded * TPB)
    assert warm == cold.tokens
    if dtype == torch.float64:
        # fp64 rows differ by ~1e-16 only, so every bf16 K/V element rounds the same way:
        # the warm run rebuilt the cold run's pool bit for bit.
        assert torch.equal(warm_pool[warm_ids], cold.pool)
        atol = 1e-9
    else:
        atol = BF16_KV_ATOL
    for a, b in zip(warm_logits, cold.logits, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=0.0)
    # Negative control: the loaded bytes are really read. Zeroing one loaded block's KV
    # changes the next-token logits far beyond rounding.
    warm_pool[warm_ids[:loaded]] = snapshot
    warm_pool[warm_ids[2]] = 0
    item = ForwardItem(prompt, warm_ids, loaded * TPB, PROMPT_LEN)
    broken = model.forward_logits([item], warm_pool)[0]
    assert (broken - cold.logits[0]).abs().max() > 1.0


def test_block_ids_may_be_permuted(paged: PagedLlama, prompt: list[int], cold: Run) -> None:
    scattered = [17, 3, 11, 0, 21, 5, 14, 9][: len(cold.block_ids)]
    pool = paged.new_pool(24)
    tokens, logits = generate(paged, pool, scattered, prompt)
    assert tokens == cold.tokens
    # Same arithmetic, only the storage moved: bit-identical logits and block contents.
    assert all(torch.equal(a, b) for a, b in zip(logits, cold.logits, strict=True))
    assert torch.equal(pool[scattered], cold.pool)
    untouched = sorted(set(range(24)) - set(scattered))
    assert not pool[untouched].any()


def test_batch_items_share_a_prefix_block_and_match_solo_runs(
    paged: PagedLlama, prompt: list[int]
) -> None:
    # Two sequences with the same 32-token prefix share its 2 blocks (prefix reuse).
    pool = paged.new_pool(12)
    prefix_item = ForwardItem(prompt[:32], [0, 1], 0, 32)
    paged.forward([prefix_item], pool)
    seq_a, seq_b = prompt[:60], prompt[:32] + prompt[60:90]
    batch = [ForwardItem(seq_a, [0, 1, 2, 3], 32, 60), ForwardItem(seq_b, [0, 1, 4, 5], 32, 62)]
    together = paged.forward_logits(batch, pool)
    for item, logits in zip(batch, together, strict=True):
        solo = ForwardItem(item.tokens, range(6), 0, item.end)
        alone = paged.forward_logits([solo], paged.new_pool(6))[0]
        assert int(logits.argmax()) == int(alone.argmax())
        torch.testing.assert_close(logits, alone, atol=BF16_KV_ATOL, rtol=0.0)


def test_forward_rejects_what_the_pool_cannot_hold(paged: PagedLlama, prompt: list[int]) -> None:
    pool = paged.new_pool(4)
    with pytest.raises(ValueError, match=r"items\[0\]\.block_ids"):
        paged.forward([ForwardItem(prompt, [0, 1, 2], 0, PROMPT_LEN)], pool)
    with pytest.raises(ValueError, match=r"items\[0\]\.block_ids: ids must be in"):
        paged.forward([ForwardItem(prompt[:20], [0, 4], 0, 20)], pool)
    with pytest.raises(ValueError, match="pool: expected dtype"):
        paged.forward([ForwardItem(prompt[:20], [0, 1], 0, 20)], pool.float())
    with pytest.raises(ValueError, match="start/end"):
        ForwardItem(prompt[:20], [0, 1], 5, 5)


def _tp_generate(
    rank: int, world_size: int, prompt: list[int]
) -> tuple[int, list[int], torch.Tensor]:
    """One TP rank's greedy generation; runs in a spawned process (see spawn_ranks)."""
    model = PagedLlama.from_hf(
        load_weights("float32"), tp_rank=rank, tp_size=world_size, tokens_per_block=TPB
    )
    blocks = list(range(blocks_for(PROMPT_LEN + NEW_TOKENS)))
    tokens, logits = generate(model, model.new_pool(len(blocks)), blocks, prompt)
    return model.geometry.num_kv_heads, tokens, torch.stack(logits)


def test_tp2_generates_the_tp1_tokens(prompt: list[int], cold: Run) -> None:
    ranks = spawn_ranks(_tp_generate, 2, prompt, timeout=120)
    # Rank 0 holds KV heads {0, 1}, rank 1 head {2}; both sample from the all-reduced logits.
    assert [heads for heads, _, _ in ranks] == [2, 1]
    for _, tokens, logits in ranks:
        assert tokens == cold.tokens
        torch.testing.assert_close(logits, torch.stack(cold.logits), atol=BF16_KV_ATOL, rtol=0.0)


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _leaves(getattr(value, f.name), f"{path}.{f.name}")
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}[{i}]")
    else:
        yield path, value


@pytest.mark.parametrize("rank", [0, 1])
def test_weights_read_without_transformers_are_the_hf_models(hf_model: Any, rank: int) -> None:
    # The engine instances (one process each) read the checkpoint directly; every tensor and
    # setting the paged model takes must equal what transformers' model gives it.
    direct = PagedLlama.from_hf(load_weights("float32"), tp_rank=rank, tp_size=2)
    via_hf = PagedLlama.from_hf(hf_model, tp_rank=rank, tp_size=2)
    ours, theirs = dict(_leaves(direct._w)), dict(_leaves(via_hf._w))
    assert ours.keys() == theirs.keys()
    assert len(ours) > 30 * 5
    for path, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(ours[path], value), path
        else:
            assert ours[path] == value, path


def test_random_weights_build_and_run_with_the_smollm2_config() -> None:
    config = smollm2_config()
    model = PagedLlama.random(config, seed=7, tokens_per_block=TPB)
    assert model.geometry.num_layers == 30
    assert model.geometry.num_kv_heads == 3
    assert model.vocab_size == 49152
    item = ForwardItem(list(range(100, 140)), [0, 1, 2], 0, 40)
    first = model.forward_logits([item], model.new_pool(3))[0]
    assert first.shape == (49152,)
    assert torch.isfinite(first).all()
    # Seeded: the same seed builds the same weights, another seed different ones (two
    # layers and a small vocabulary, to stay fast).
    small = smollm2_config(num_hidden_layers=2, vocab_size=1024)
    runs = []
    for seed in (7, 7, 8):
        built = PagedLlama.random(small, seed=seed, tokens_per_block=TPB)
        runs.append(built.forward_logits([item], built.new_pool(3))[0])
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_the_cuda_formulation_computes_the_reference_function() -> None:
    """CUDA's fused path (lower-right causal bias, fused RMS statistics) on the CPU.

    On a half-precision CUDA model the emulator attends through flash attention with a
    lower-right causal bias instead of an explicit mask, and normalises with one fused RMS
    kernel. Forced on a CPU model in float32, that formulation must give the reference's
    logits and pool contents to float32 rounding, for a cold prefill, a chunk after it and a
    decode step (the three shapes of query rows the engine runs).
    """
    small = smollm2_config(num_hidden_layers=2, vocab_size=1024)
    model = PagedLlama.random(small, seed=3, tokens_per_block=TPB)
    tokens = [(7 * i + 3) % 1024 for i in range(3 * TPB + 5)]
    blocks = [4, 1, 6, 2]
    runs = []
    for fused in (False, True):
        object.__setattr__(model, "_flash", fused)  # NOTE: what a bf16 CUDA model sets
        pool = model.new_pool(8)
        steps = [(0, 2 * TPB), (2 * TPB, len(tokens) - 1), (len(tokens) - 1, len(tokens))]
        logits = [
            model.forward_logits([ForwardItem(tokens, blocks, start, end)], pool)[0]
            for start, end in steps
        ]
        runs.append((logits, pool))
    for reference, fused in zip(runs[0][0], runs[1][0], strict=True):
        torch.testing.assert_close(fused, reference, atol=1e-4, rtol=0.0)
    torch.testing.assert_close(runs[1][1].float(), runs[0][1].float(), atol=2e-2, rtol=0.0)
