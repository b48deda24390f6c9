"""Fixtures of the parity tier: injected completions for the online stages, where both trainers get the same fixed
completions instead of sampling (the one thing the two cannot share), looked up by each row's prompt token ids."""

from __future__ import annotations

import pytest

from tests.helpers import Injector


def _chat_prompt_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Each prompt as one user turn, rendered by the tokenizer's chat template with the generation prompt."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True)["input_ids"] for p in prompts]


@pytest.fixture
def chat_prompt_ids():
    """`chat_prompt_ids(tokenizer, prompts)`: each prompt as one user turn, rendered with the generation prompt."""
    return _chat_prompt_ids


@pytest.fixture
def completion_injector():
    """`completion_injector(table)`: an `Injector` (calls counted) answering prompts from `table`."""
    return Injector
