"""Key runs: blocks whose keys are hashed later, elsewhere, from the tokens they carry."""

from __future__ import annotations

import pickle
import sys
from collections.abc import Sequence
from typing import overload

import pytest

from s3kv.connector.metadata import SaveOps
from s3kv.errors import KeyDerivationError
from s3kv.keys import KeyChain, KeyRun, chain_hashes

TPB = 4


class CountingTokens(Sequence[int]):
    """A token list that counts the elements read from it."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.read = 0

    def __len__(self) -> int:
        return len(self.tokens)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        got = self.tokens[index]
        self.read += len(got) if isinstance(got, list) else 1
        return got


PROMPT = list(range(7, 7 + 20 * TPB + 1))  # 20 full blocks and one token


def test_a_chains_run_hashes_to_the_chains_keys() -> None:
    chain = KeyChain(PROMPT, TPB)
    chain.ensure(1)
    assert chain.hashed == KeyChain.STEP
    run = chain.run_of(KeyChain.STEP, 20)
    assert run is not None
    assert run.blocks == 20 - KeyChain.STEP
    assert run.keys() == chain_hashes(PROMPT, TPB)[KeyChain.STEP : 20]
    assert chain.hashed == KeyChain.STEP, "the chain leaves the run's blocks to whoever hashes them"


def test_a_run_reads_its_tokens_only_when_its_keys_are_needed() -> None:
    source = CountingTokens(PROMPT)
    chain = KeyChain(source, TPB)
    chain.ensure(1)
    before, step = source.read, KeyChain.STEP
    run = chain.run_of(step, 20)
    assert run is not None
    assert source.read == before, "planning a run reads none of its tokens"
    assert run.nbytes == 4 * (20 - step) * TPB
    assert run.keys() == chain_hashes(PROMPT, TPB)[step:20]
    assert source.read == before + (20 - step) * TPB
    run.keys()
    assert source.read == before + (20 - step) * TPB, "converted once"


def test_a_deferred_run_travels_as_bytes_and_equals_the_eager_one() -> None:
    keys = chain_hashes(PROMPT, TPB)
    step = KeyChain.STEP
    chain = KeyChain(PROMPT, TPB)
    chain.ensure(1)
    deferred = chain.run_of(step, 20)
    assert deferred is not None
    eager = KeyRun(keys[step - 1], chain_from_tokens(PROMPT[step * TPB : 20 * TPB]), TPB)
    assert deferred == eager
    assert hash(deferred) == hash(eager)
    fresh = chain.run_of(step, 20)
    wire = pickle.loads(pickle.dumps(fresh))
    assert wire == eager
    assert wire.keys() == keys[step:20]


def chain_from_tokens(tokens: list[int]) -> bytes:
    return b"".join(t.to_bytes(4, "little") for t in tokens)


def test_a_bad_token_in_a_deferred_run_raises_where_the_keys_are_read() -> None:
    step = KeyChain.STEP
    chain = KeyChain([*PROMPT[: (step + 1) * TPB], -6, *PROMPT[(step + 1) * TPB + 1 :]], TPB)
    chain.ensure(1)
    run = chain.run_of(step, 20)  # NOTE: planned: nothing read yet
    assert run is not None
    with pytest.raises(KeyDerivationError, match="token"):
        run.keys()


def test_growing_the_chain_leaves_a_planned_run_as_it_was() -> None:
    step = KeyChain.STEP
    chain = KeyChain(list(PROMPT[: (step + 4) * TPB]), TPB)
    chain.ensure(1)
    run = chain.run_of(step, step + 4)
    assert run is not None
    chain.extend(PROMPT[(step + 4) * TPB :])  # decode tokens: the chain's own list grows
    chain.ensure(len(chain))  # every full block hashed: the chain lets go of its tokens
    assert run.keys() == chain_hashes(PROMPT, TPB)[step : step + 4], "read from the chain"
    with pytest.raises(KeyDerivationError, match="released"):
        run.tokens  # noqa: B018
    saves = SaveOps([1] * 4, [0, 1, 2, 3], b"", b"", [(0, run)])
    wire = pickle.loads(pickle.dumps(saves))  # NOTE: travels hashed then
    assert wire.key_list() == chain_hashes(PROMPT, TPB)[step : step + 4]


def test_runs_are_immutable() -> None:
    run = KeyRun(bytes(16), bytes(4 * TPB), TPB)
    with pytest.raises(AttributeError, match="immutable"):
        run.parent = bytes(16)  # type: ignore[misc]


def test_a_compacted_chain_packs_its_tokens_and_lets_go_of_their_list() -> None:
    tokens = list(PROMPT)
    chain = KeyChain(tokens, TPB)
    chain.ensure(1)
    run = chain.run_of(KeyChain.STEP, 20)
    assert run is not None
    held = sys.getrefcount(tokens)
    chain.compact()
    after = sys.getrefcount(tokens)  # NOTE: outside the assert, which holds its operands
    assert after == held - 1, "neither the chain nor its run references the list"
    assert run.keys() == chain_hashes(PROMPT, TPB)[KeyChain.STEP : 20]
    assert list(chain) == chain_hashes(PROMPT, TPB)
    chain.extend([5, 6, 7])  # NOTE: decode tokens go on the packed tokens
    assert list(chain) == chain_hashes([*PROMPT, 5, 6, 7], TPB)


def test_a_compacted_chain_still_takes_tokens_it_cannot_pack_and_raises_where_hashed() -> None:
    step = KeyChain.STEP
    chain = KeyChain(list(PROMPT[: step * TPB]), TPB)
    chain.compact()
    chain.extend([1, 2, -3, 4])  # NOTE: not packable: held as a list, raised when hashed
    assert chain.keys(0, step) == chain_hashes(PROMPT, TPB)[:step]
    with pytest.raises(KeyDerivationError):
        chain.keys(0, step + 1)


def test_tokens_that_cannot_be_packed_stay_as_they_came() -> None:
    step = KeyChain.STEP
    bad = [*PROMPT[: step * TPB], -1, *PROMPT[step * TPB + 1 :]]
    chain = KeyChain(bad, TPB)
    chain.compact()
    assert chain.keys(0, step) == chain_hashes(PROMPT, TPB)[:step]
    with pytest.raises(KeyDerivationError):
        chain.keys(0, step + 1)
