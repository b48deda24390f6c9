"""Helpers shared by test files (imported as `tests.helpers`; fixtures live in the conftest files).

`Injector` hands fixed completions to an online trainer in place of sampling, `inject_completions` puts it where
`OnlineTrainer.sample` samples, and `prompt_dataset` builds the prompt rows such a trainer reads (the parity tier
and the online stage tests that reuse its runs).

`tiny_config` is the one way a test builds a parsed config: the keys a test names, over defaults that change no
number (`use_cpu`, `disable_tqdm`), with the model folder and output folder as plain arguments. A stage's test file
keeps only the keys its runs share (its own small wrapper) and passes them here.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

from alignkit.config import Config
from alignkit.config.parse import parse_config

# Keys every tiny test run may take without changing what it computes.
QUIET_DEFAULTS: dict[str, Any] = {"use_cpu": True, "disable_tqdm": True}


def tiny_config(model_dir: Optional[Any] = None, out: Optional[Any] = None, **keys: Any) -> Config:
    """`parse_config` of `keys` over `QUIET_DEFAULTS`, with `model_name_or_path=model_dir` and `output_dir=out` where
    given (paths as strings)."""
    values: dict[str, Any] = dict(QUIET_DEFAULTS)
    if model_dir is not None:
        values["model_name_or_path"] = str(model_dir)
    if out is not None:
        values["output_dir"] = str(out)
    values.update(keys)
    return parse_config(values)


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


def inject_completions(monkeypatch, tokenizer, injector: Injector, stop_ids: list[int]) -> None:
    """Every `OnlineTrainer.sample` round takes its completions from `injector` instead of sampling the policy."""
    from alignkit.rl.rollout import generation_from_token_lists
    from alignkit.stages import online

    def sample(model, tok, prompt_ids, **kwargs):
        return generation_from_token_lists(tokenizer, prompt_ids, injector(prompt_ids), stop_ids)

    monkeypatch.setattr(online, "sample_completions", sample)  # what `OnlineTrainer.sample` calls


def prompt_dataset(prompts: list[str], prompt_ids: list[list[int]]):
    """The prompt rows an online trainer reads (as the data layer makes them): each prompt as one user turn."""
    from datasets import Dataset

    return Dataset.from_list([
        {"input_ids": ids, "attention_mask": [1] * len(ids), "prompt_messages": [{"role": "user", "content": p}],
         "prompt_conversational": True} for p, ids in zip(prompts, prompt_ids)])


def record_chat_generations(monkeypatch) -> list:
    """Every generation through `alignkit.chat`'s path, recorded as (input_ids, pixel inputs), then run as usual."""
    from alignkit import chat as chat_module

    calls = []
    original = chat_module.generate

    def generate(model, tokenizer, input_ids, attention_mask, **kwargs):
        calls.append((input_ids, kwargs.get("model_inputs") or {}))
        return original(model, tokenizer, input_ids, attention_mask, **kwargs)

    monkeypatch.setattr(chat_module, "generate", generate)
    return calls

