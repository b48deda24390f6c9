"""Fixtures of the parity tier: injected completions for the online stages, where both trainers get the same fixed
completions instead of sampling (the one thing the two cannot share), looked up by each row's prompt token ids."""

from __future__ import annotations

from collections import defaultdict

import pytest


def _chat_prompt_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Each prompt as one user turn, rendered by the tokenizer's chat template with the generation prompt."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True)["input_ids"] for p in prompts]


class Injector:
    """Answers the k-th occurrence of a prompt within a call with that prompt's k-th fixed completion.

    Args:
        table: prompt token ids (a tuple) → its completions (token id lists), in the order they are handed out.
    """

    def __init__(self, table: dict[tuple, list[list[int]]]) -> None:
        self.table = table
        self.calls = 0

    def __call__(self, prompt_ids) -> list[list[int]]:
        self.calls += 1
        seen: dict[tuple, int] = defaultdict(int)
        out = []
        for ids in prompt_ids:
            key = tuple(int(i) for i in ids)
            assert key in self.table, "the two trainers tokenised a prompt differently"
            out.append(list(self.table[key][seen[key]]))
            seen[key] += 1
        return out


@pytest.fixture
def chat_prompt_ids():
    """`chat_prompt_ids(tokenizer, prompts)`: each prompt as one user turn, rendered with the generation prompt."""
    return _chat_prompt_ids


@pytest.fixture
def completion_injector():
    """`completion_injector(table)`: an `Injector` (calls counted) answering prompts from `table`."""
    return Injector
