"""`mask_history` (LLaMA-Factory's key): an SFT conversation is trained on its last reply only, and truncation keeps
turns from the end so that reply is never the one cut."""

from __future__ import annotations

import pytest

from alignkit.config import DataArguments
from alignkit.data.processors import IGNORE_INDEX, encode_supervised
from alignkit.data.template import ChatFormatter
from alignkit.errors import ConfigError

CONVERSATION = {"messages": [{"role": "user", "content": "What is 12 plus 7?"},
                             {"role": "assistant", "content": "12 plus 7 is 19."},
                             {"role": "user", "content": "Name a colour."},
                             {"role": "assistant", "content": "Green."}]}


def _labelled_text(tokenizer, row) -> str:
    return tokenizer.decode([t for t in row["labels"] if t != IGNORE_INDEX])


def test_only_the_last_reply_is_labelled(tiny_tokenizer):
    formatter = ChatFormatter(tiny_tokenizer, "chatml")
    every = encode_supervised(formatter, CONVERSATION, cutoff_len=512)
    last = encode_supervised(formatter, CONVERSATION, cutoff_len=512, mask_history=True)
    assert last["input_ids"] == every["input_ids"]  # the same text; only the labels differ
    assert _labelled_text(tiny_tokenizer, every) == "12 plus 7 is 19.<|im_end|>\nGreen.<|im_end|>\n"
    assert _labelled_text(tiny_tokenizer, last) == "Green.<|im_end|>\n"


def test_truncation_keeps_the_last_turn(tiny_tokenizer):
    formatter = ChatFormatter(tiny_tokenizer, "chatml")
    full = encode_supervised(formatter, CONVERSATION, cutoff_len=512, mask_history=True)
    second_turn = encode_supervised(formatter, {"messages": CONVERSATION["messages"][2:]}, cutoff_len=512)
    budget = len(second_turn["input_ids"])  # room for the last turn only
    assert budget < len(full["input_ids"])
    kept = encode_supervised(formatter, CONVERSATION, cutoff_len=budget, mask_history=True)
    assert kept["input_ids"] == second_turn["input_ids"] and kept["labels"] == second_turn["labels"]
    # Without mask_history the first turn is kept, as before.
    first = encode_supervised(formatter, CONVERSATION, cutoff_len=budget)
    assert _labelled_text(tiny_tokenizer, first).startswith("12 plus 7")


def test_mask_history_with_train_on_prompt_is_refused():
    with pytest.raises(ConfigError, match="mask_history=true .* and train_on_prompt=true"):
        DataArguments(mask_history=True, train_on_prompt=True)
