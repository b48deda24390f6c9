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


# `--environment-factory`: tests/tool_functions.py's Counter, one for the conversation.
OBSERVATION = " (count from 0; reset got prompt; 2 prompt messages)"  # the system message and the first user message


def test_chat_environment_lives_for_the_conversation(tiny_model_dir, tiny_tokenizer, monkeypatch):
    """Each message is answered by a call to bump(2), then "Done.": the count goes 2, 4 (the same instance, not reset
    at the second message), then 2 again after `clear` (reset at the new conversation's first message)."""
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    seen = []

    def scripted(model, tokenizer, input_ids, attention_mask, *, stop_token_ids, generation_kwargs, **kwargs):
        seen.append(tokenizer.decode(input_ids[0][attention_mask[0].bool()]))
        text = ("<tool_call>\n" + json.dumps({"name": "bump", "arguments": {"by": 2}}) + "\n</tool_call>"
                if len(seen) % 2 else "Done.")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
        return generation_from_token_lists(tokenizer, input_ids.tolist(), [ids], stop_token_ids)

    monkeypatch.setattr(chat_module, "generate", scripted)
    config = parse_config({"model_name_or_path": tiny_model_dir, "max_new_tokens": 64, "template": "chatml"})
    queries = iter(["Count for me.", "Again.", "clear", "Once more.", "exit"])
    stream = io.StringIO()
    assert chat_module.chat(config.model, config.generating, system="You count.", template="chatml", stream=stream,
                            input_fn=lambda _: next(queries), environment_factory=f"{TOOLS}:Counter") is None
    lines = stream.getvalue().splitlines()
    reset = "[reset] " + OBSERVATION.strip()
    assert [line for line in lines if line.startswith(("[", "Assistant: ["))] == [
        reset, "[bump] 2", "[bump] 4", reset, "[bump] 2"]
    assert lines[lines.index(reset) + 1] == 'Assistant: -> bump({"by": 2})'
    assert '"name": "bump"' in seen[0] and "Count for me." + OBSERVATION + "<|im_end|>" in seen[0]
    # The second message's context keeps the first as the model saw it, and has no second observation.
    assert "Count for me." + OBSERVATION in seen[2] and seen[2].count("count from 0") == 1
    assert "Once more." + OBSERVATION in seen[4] and "Count for me." not in seen[4]


def test_chat_environment_is_checked_before_the_model_loads(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(chat_module, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    config = parse_config({"model_name_or_path": tiny_model_dir})
    for spec, message in ((f"{TOOLS}:Nope", "--environment-factory .*has no `Nope`"),
                          (f"{TOOLS}:NoReset", "--environment-factory: .*without a `reset` method")):
        with pytest.raises(ConfigError, match=message):
            chat_module.chat(config.model, config.generating, prompt="hi", template="chatml",
                             environment_factory=spec)


def test_chat_command_passes_the_environment(tiny_model_dir, monkeypatch, capsys):
    from alignkit.cli import main

    monkeypatch.setattr(chat_module, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    assert main(["chat", "--model", tiny_model_dir, "--prompt", "hi", "--environment-factory", f"{TOOLS}:NoReset",
                 "template=chatml"]) == 2
    assert "--environment-factory: " in capsys.readouterr().err
