"""The board's chat with tools, without a browser: the run's `tools` (or the ones typed on the page) are loaded as the
run loaded them, the reply runs GRPO's tool loop (`chat.tool_turns`) and each call and result shows as a bubble of its
own, left out of the history sent back to the model. The tiny random model never writes a call, so its decoder is
replaced by a scripted one: a call to `add`, then an answer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from alignkit import chat as chat_module
from alignkit.board.app import Board, build_app, is_tool_bubble, tool_bubbles
from alignkit.errors import ConfigError
from alignkit.rl.rollout import generation_from_token_lists
from alignkit.train import RUN_CONFIG_FILE

TOOLS = Path(__file__).resolve().parents[1] / "tool_functions.py"
CALL = {"name": "add", "arguments": {"a": 2, "b": 3}}
BUBBLES = [{"role": "assistant", "content": '-> add({"a": 2, "b": 3})', "metadata": {"title": "tool call"}},
           {"role": "assistant", "content": "[add] 5", "metadata": {"title": "tool result"}},
           {"role": "assistant", "content": "It is 5."}]


def _run(root: Path, workdir: Path, name: str, model_dir: str, **keys) -> Path:
    """A finished run folder: the model's files and a run_config.yaml started from workdir/examples/run.yaml."""
    run = root / name
    shutil.copytree(model_dir, run)
    body = "".join(f"{key}: {json.dumps(value)}\n" for key, value in
                   {"model_name_or_path": model_dir, "template": "chatml", **keys}.items())
    (run / RUN_CONFIG_FILE).write_text(f"# alignkit train {run / RUN_CONFIG_FILE}\n# cwd: {workdir}\n"
                                       f"# source: examples/run.yaml\n{body}", encoding="utf-8")
    return run


@pytest.fixture
def board(tmp_path, tiny_model_dir):
    workdir = tmp_path / "work"
    (workdir / "examples" / "tools").mkdir(parents=True)
    shutil.copy(TOOLS, workdir / "examples" / "tools" / "functions.py")  # relative to the config file, as GRPO reads it
    root = tmp_path / "saves"
    _run(root, workdir, "with_tools", tiny_model_dir, tools="tools/functions.py:add", max_tool_calling_iterations=2,
         tool_timeout=3)
    _run(root, workdir, "plain", tiny_model_dir)
    _run(root, workdir, "with_env", tiny_model_dir, environment_factory="tools/functions.py:Counter")
    return Board(root, workdir)


@pytest.fixture
def scripted(tiny_tokenizer, monkeypatch):
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    contexts = []

    def generate(model, tokenizer, input_ids, attention_mask, *, stop_token_ids, generation_kwargs, **kwargs):
        context = tokenizer.decode(input_ids[0][attention_mask[0].bool()])
        contexts.append(context)
        text = ("<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>"
                if context.rsplit("<|im_start|>user", 1)[-1].count("<tool_response>") == 0 else "It is 5.")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
        return generation_from_token_lists(tokenizer, input_ids.tolist(), [ids], stop_token_ids)

    monkeypatch.setattr(chat_module, "generate", generate)
    return contexts


def test_the_runs_tools_and_keys_are_loaded_from_its_config_folder(board):
    tools = board.chat_tools("with_tools")
    assert [f.__name__ for f in tools["functions"]] == ["add"]
    assert (tools["max_iterations"], tools["tool_timeout"], tools["max_tool_output_chars"]) == (2, 3.0, 10_000)
    assert board.chat_tools("plain") is None
    typed = board.chat_tools("plain", f"{TOOLS}:boom, {TOOLS}:add")  # typed on the page: used instead
    assert [f.__name__ for f in typed["functions"]] == ["boom", "add"] and typed["max_iterations"] is None
    with pytest.raises(ConfigError, match="has no `ad`"):
        board.chat_tools("plain", f"{TOOLS}:ad")


def test_the_reply_runs_the_tool_loop_and_shows_each_turn(board, tiny_model_dir, scripted):
    bubbles = board.tool_reply((tiny_model_dir, None, "chatml"), [{"role": "user", "content": "What is 2 plus 3?"}],
                               128, board.chat_tools("with_tools"))
    assert bubbles == BUBBLES
    assert '"name": "add"' in scripted[0] and "<tools>" in scripted[0]  # the schema is in the prompt
    assert "<tool_response>\n5\n</tool_response>" in scripted[1]
    assert [is_tool_bubble(b) for b in bubbles] == [True, True, False]
    assert tool_bubbles([]) == [{"role": "assistant", "content": "(no reply yet)"}]


def test_the_page_chat_with_tools_end_to_end(board, scripted):
    """The page's `respond` handler (no browser): both models answer through the loop; the next message's history
    holds the question and the answer, not the tool bubbles."""
    app = build_app(board)
    (respond,) = {f.fn for f in app.fns.values() if getattr(f.fn, "__name__", "") == "respond"}
    *_, (run_history, base_history, box, error, image, _) = respond("with_tools", "What is 2 plus 3?", [], [], 128, "")
    assert (box, error, image) == ("", "", None)
    assert run_history == base_history == [{"role": "user", "content": "What is 2 plus 3?"}] + BUBBLES
    scripted.clear()
    list(respond("with_tools", "And 2 plus 3 again?", run_history, base_history, 128, ""))
    later = scripted[0]
    assert "What is 2 plus 3?" in later and "It is 5." in later and "[add]" not in later and "->" not in later


def test_the_page_chat_with_an_environment_gives_each_conversation_its_own_instance(board, tiny_tokenizer,
                                                                                   monkeypatch):
    """The run's `environment_factory` (TRL's contract, `tests/tool_functions.py:Counter`): each model's conversation
    gets an instance, reset at the first message (its observation appended to that message); its methods are the
    tools; it keeps its state across the conversation's messages and starts over after Clear (an empty state)."""
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    contexts = []

    def generate(model, tokenizer, input_ids, attention_mask, *, stop_token_ids, generation_kwargs, **kwargs):
        context = tokenizer.decode(input_ids[0][attention_mask[0].bool()])
        contexts.append(context)
        last = context.rsplit("<|im_start|>user", 1)[-1]
        text = ("Counted." if "<tool_response>" in last else
                "<tool_call>\n" + json.dumps({"name": "bump", "arguments": {"by": 2}}) + "\n</tool_call>")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
        return generation_from_token_lists(tokenizer, input_ids.tolist(), [ids], stop_token_ids)

    monkeypatch.setattr(chat_module, "generate", generate)
    tools = board.chat_tools("with_env")
    assert tools["functions"] == [] and tools["environment_factory"].__name__ == "Counter"
    app = build_app(board)
    (respond,) = {f.fn for f in app.fns.values() if getattr(f.fn, "__name__", "") == "respond"}
    *_, (run_history, base_history, _, error, _, environments) = respond("with_env", "Count.", [], [], 64, "")
    assert error == "" and set(environments) == {"run", "base"}
    assert environments["run"] is not environments["base"]
    for history in (run_history, base_history):  # one bump of 2 each: two instances, not one shared
        assert history[0]["content"].startswith("Count. (count from 0; reset got prompt; 1 prompt messages)")
        assert [b["content"] for b in history[1:]] == ['-> bump({"by": 2})', "[bump] 2", "Counted."]
    assert '"name": "bump"' in contexts[0] and "(count from 0" in contexts[0]  # schema and observation in the prompt
    *_, (run_history, _, _, _, _, kept) = respond("with_env", "Again.", run_history, base_history, 64, "", None, "",
                                                  environments)
    assert kept["run"] is environments["run"] and run_history[-2]["content"] == "[bump] 4"  # the same instance
    assert run_history[4]["content"] == "Again."  # no reset after the first message
    *_, (run_history, _, _, _, _, fresh) = respond("with_env", "Count.", [], [], 64, "", None, "", {})  # after Clear
    assert fresh["run"] is not environments["run"] and run_history[-2]["content"] == "[bump] 2"
