"""`alignkit chat --tools`: the chat runs GRPO's tool loop (`rl.tools.ToolLoop`), shown turn by turn. The tiny random
model never writes a call, so the decoder is replaced by a scripted one: a call to `add`, then an answer."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from alignkit import chat as chat_module
from alignkit.config.parse import parse_config
from alignkit.errors import ConfigError
from alignkit.rl.rollout import generation_from_token_lists

TOOLS = str(Path(__file__).resolve().parents[1] / "tool_functions.py")


def test_chat_calls_a_tool_and_answers_with_its_result(tiny_model_dir, tiny_tokenizer, monkeypatch):
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    seen = []

    def scripted(model, tokenizer, input_ids, attention_mask, *, stop_token_ids, generation_kwargs, **kwargs):
        context = tokenizer.decode(input_ids[0][attention_mask[0].bool()])
        seen.append(context)
        text = ("<tool_call>\n" + json.dumps({"name": "add", "arguments": {"a": 2, "b": 3}}) + "\n</tool_call>"
                if "<tool_response>" not in context else "It is 5.")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
        return generation_from_token_lists(tokenizer, input_ids.tolist(), [ids], stop_token_ids)

    monkeypatch.setattr(chat_module, "generate", scripted)
    config = parse_config({"model_name_or_path": tiny_model_dir, "max_new_tokens": 64, "template": "chatml"})
    stream = io.StringIO()
    reply = chat_module.chat(config.model, config.generating, prompt="What is 2 plus 3?", template="chatml",
                             stream=stream, tools=[f"{TOOLS}:add"])
    assert reply == "It is 5."
    assert '"name": "add"' in seen[0] and "<tools>" in seen[0]  # the schema is in the prompt
    assert "<tool_response>\n5\n</tool_response>" in seen[1]
    assert stream.getvalue().splitlines() == ['-> add({"a": 2, "b": 3})', "[add] 5", "It is 5."]


def test_chat_tools_are_checked_before_the_model_loads(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(chat_module, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    config = parse_config({"model_name_or_path": tiny_model_dir})
    with pytest.raises(ConfigError, match="has no `ad`"):
        chat_module.chat(config.model, config.generating, prompt="hi", template="chatml", tools=[f"{TOOLS}:ad"])
