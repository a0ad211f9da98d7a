"""Key inputs through the emulated runtime: LoRA, multimodal items, p-tuning prompt tables.

Each case: instance A serves a prompt with some key input and saves what s3kv may save,
instance B (fresh process state) serves the same tokens with the same or another input.
s3kv must claim only what was computed under the same inputs, and nothing for inputs it
cannot see (a LoRA task id with no configured adapter revision, a prompt table).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _emulator import prompt, tiny_model

from s3kv.connector.shared import process_state
from s3kv.testing.emulator.executor import PyExecutorEmulator
from s3kv.testing.emulator.instance import S3KV_CONNECTOR
from s3kv.testing.emulator.llm_args import KvCacheConfig, TorchLlmArgs
from s3kv.testing.emulator.request import MultimodalInput

TPB = 8
TOKENS = prompt(5 * TPB + 3, seed=91)
IMAGE_A = MultimodalInput(tuple(range(1, 9)), position=TPB + 2, length=TPB)
IMAGE_B = MultimodalInput(tuple(range(11, 19)), position=TPB + 2, length=TPB)


def claimed_by_reader(writer_inputs: dict[str, Any], reader_inputs: dict[str, Any]) -> int:
    """Tokens instance B claims for TOKENS after instance A served them."""
    for inputs in (writer_inputs, reader_inputs):
        args = TorchLlmArgs(
            kv_cache_config=KvCacheConfig(tokens_per_block=TPB, enable_partial_reuse=False),
            kv_connector_config=S3KV_CONNECTOR,
        )
        executor = PyExecutorEmulator(args, tiny_model(TPB), num_blocks=64)
        (result,) = executor.generate([TOKENS], 2, **inputs)
        executor.drain()
        process_state().close_all()
    return result.connector_tokens


FULL = 5 * TPB


@pytest.mark.usefixtures("file_bucket")
def test_plain_requests_hit() -> None:
    assert claimed_by_reader({}, {}) == FULL


@pytest.mark.usefixtures("file_bucket")
def test_lora_without_a_configured_revision_is_neither_saved_nor_claimed() -> None:
    assert claimed_by_reader({"lora_task_id": 3}, {"lora_task_id": 3}) == 0
    assert claimed_by_reader({"lora_task_id": 3}, {}) == 0, "nothing was saved under LoRA"


@pytest.mark.usefixtures("file_bucket")
def test_lora_keys_on_the_configured_adapter_revision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TLLM_S3KV_LORA_REVISIONS", "3=commit:aaaa,4=commit:bbbb")
    assert claimed_by_reader({"lora_task_id": 3}, {"lora_task_id": 3}) == FULL
    assert claimed_by_reader({"lora_task_id": 3}, {"lora_task_id": 4}) == 0, "other adapter"
    assert claimed_by_reader({"lora_task_id": 3}, {}) == 0, "the base model is another key"


@pytest.mark.usefixtures("file_bucket")
def test_a_prompt_table_is_neither_saved_nor_claimed() -> None:
    table = {"prompt_table": torch.zeros(4, 64)}
    assert claimed_by_reader(table, table) == 0
    assert claimed_by_reader(table, {}) == 0, "nothing was saved under a prompt table"


@pytest.mark.usefixtures("file_bucket")
def test_multimodal_items_key_the_blocks_they_overlap() -> None:
    same = claimed_by_reader({"multimodal": [IMAGE_A]}, {"multimodal": [IMAGE_A]})
    assert same == FULL
    # Another image at the same place: only the block before the image is shared.
    assert claimed_by_reader({"multimodal": [IMAGE_A]}, {"multimodal": [IMAGE_B]}) == TPB
