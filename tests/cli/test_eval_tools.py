"""`alignkit eval --tools`: the held-out evaluation answers through GRPO's tool loop (`rl.tools.ToolLoop`), batched and
greedy, and reports accuracy on the final answer beside the tool use. The tiny random model never writes a call, so its
decoder is replaced by a scripted one that answers from the context alone (what a greedy model does):

- "2 plus 3": calls add(2, 3), then answers "It is 5."        (1 call, ran)           accuracy 1
- "4 plus 4": answers "8" at once                              (no call)               accuracy 1
- "6 plus 1": calls `sub`, which is no tool, then "It is 6."   (1 call, failed)        accuracy 0 (answer 7)
- "9 plus 9": a call that is not JSON, then two calls in one turn, add(9, 9) and add(1, 1), then "18"
                                                               (3 calls, 1 failed)     accuracy 1

By hand: 5 calls over 4 prompts (1.25 per prompt), 2 failed, success rate 3 / 5 = 0.6; add 3 calls 0 failed, unknown
(the name `sub` and the unreadable call) 2 calls 2 failed; accuracy 3 / 4 = 0.75. With --batch-size 2 the rows run in
two batches of 2; in the first the rows finish after 1 and 0 tool turns, in the second after 1 and 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignkit.cli import main
from alignkit.model import generation
from alignkit.rl.rollout import generation_from_token_lists

TOOLS = str(Path(__file__).resolve().parents[1] / "tool_functions.py")
ROWS = [{"prompt": "What is 2 plus 3?", "answer": "5"}, {"prompt": "What is 4 plus 4?", "answer": "8"},
        {"prompt": "What is 6 plus 1?", "answer": "7"}, {"prompt": "What is 9 plus 9?", "answer": "18"}]


def _call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


SCRIPT = {  # question -> the turn written after 0, 1, 2 tool turns
    "2 plus 3": [_call("add", a=2, b=3), "It is 5."],
    "4 plus 4": ["8"],
    "6 plus 1": [_call("sub", a=6, b=1), "It is 6."],
    "9 plus 9": ["<tool_call>\n{not json}\n</tool_call>", _call("add", a=9, b=9) + "\n" + _call("add", a=1, b=1),
                 "18"],
}


def _script_decoder(tiny_tokenizer, monkeypatch, script):
    """The decode loop replaced by `script`; records every batch's contexts and its `max_new_tokens`."""
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    batches = []

    def decode(model, tokenizer, input_ids, attention_mask, *, stop_token_ids, generation_kwargs, **kwargs):
        contexts = [tokenizer.decode(ids[mask.bool()]) for ids, mask in zip(input_ids, attention_mask)]
        batches.append((contexts, generation_kwargs["max_new_tokens"]))
        completions = []
        for context in contexts:
            question = next(q for q in script if f"What is {q}?" in context)
            turns_written = context.count("<|im_start|>assistant") - 1  # the last is the generation prompt
            text = script[question][turns_written]
            completions.append(tokenizer(text, add_special_tokens=False)["input_ids"] + [eos])
        return generation_from_token_lists(tokenizer, input_ids.tolist(), completions, stop_token_ids)

    monkeypatch.setattr(generation, "generate_with_decode", decode)
    return batches


@pytest.fixture
def scripted(tiny_tokenizer, monkeypatch):
    return _script_decoder(tiny_tokenizer, monkeypatch, SCRIPT)


def _eval(tmp_path, tiny_model_dir, *extra):
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS), encoding="utf-8")
    return main(["eval", "--model", tiny_model_dir, "--dataset", str(tmp_path / "prompts.jsonl"), "--dataset-dir",
                 str(tmp_path), "--template", "chatml", "--max-new-tokens", "400", "--batch-size", "2",
                 "--reward", "accuracy", *extra])


def test_eval_with_tools_counts_calls_and_scores_the_final_answer(tmp_path, tiny_model_dir, scripted, capsys):
    out_file = tmp_path / "rows.jsonl"
    assert _eval(tmp_path, tiny_model_dir, "--tools", f"{TOOLS}:add", "--output", str(out_file)) == 0
    printed = capsys.readouterr().out
    assert "accuracy: 0.7500 (mean over 4 of 4 rows)" in printed
    assert "tool calls: 5 over 4 prompts (1.2500 per prompt), 3 ran without error (success rate 0.6000)" in printed
    assert "  add: 3 calls, 0 failed" in printed and "  unknown: 2 calls, 2 failed" in printed
    assert "tools " in printed and "(no cap on tool turns, tool_timeout 5 s)" in printed
    rows = [json.loads(line) for line in out_file.read_text(encoding="utf-8").splitlines()]
    assert [r["completion"] for r in rows] == ["It is 5.", "8", "It is 6.", "18"]
    assert [r["rewards"]["accuracy"] for r in rows] == [1.0, 1.0, 0.0, 1.0]
    first = rows[0]["messages"]
    assert [m["role"] for m in first] == ["assistant", "tool", "assistant"]
    assert first[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert first[1] == {"role": "tool", "name": "add", "content": "5"}
    assert "not found" in rows[2]["messages"][1]["content"]  # the unknown tool's error went back to the model
    assert [m["content"] for m in rows[3]["messages"] if m["role"] == "tool"][1:] == ["18", "2"]
    # The prompt shows the schema; two batches of 2; a later turn generates only for the rows still calling, with
    # the budget left (max_new_tokens counts the whole conversation).
    contexts, budget = scripted[0]
    assert len(contexts) == 2 and budget == 400 and all('"name": "add"' in c and "<tools>" in c for c in contexts)
    second_turn, budget = scripted[1]
    assert len(second_turn) == 1 and "2 plus 3" in second_turn[0] and second_turn[0].count("<tool_response>") == 1
    assert budget < 400
    assert [len(contexts) for contexts, _ in scripted[2:]] == [2, 2, 1]
    assert [c.count("<tool_response>") for c in scripted[3][0]] == [1, 1] and "9 plus 9" in scripted[4][0][0]


def test_the_iteration_cap_reaches_the_loop(tmp_path, tiny_model_dir, scripted, capsys):
    """With max_tool_calling_iterations=1 the 9 + 9 row stops after its first tool turn: its two later calls are not
    run, so 3 calls, 2 failed."""
    assert _eval(tmp_path, tiny_model_dir, "--tools", f"{TOOLS}:add", "max_tool_calling_iterations=1",
                 "tool_timeout=2") == 0
    printed = capsys.readouterr().out
    assert "tool calls: 3 over 4 prompts (0.7500 per prompt), 1 ran without error (success rate 0.3333)" in printed
    assert "at most 1 tool turns, tool_timeout 2 s" in printed


def test_tool_metrics_by_hand():
    from alignkit.evaluate import ToolUse

    use = ToolUse(calls=3, failures=2)
    use.calls_per_tool.update({"add": 1, "unknown": 2})
    use.failures_per_tool.update({"unknown": 2})
    assert ToolUse().summary(4) == ["tool calls: 0 over 4 prompts (0.0000 per prompt), so no success rate"]
    assert use.metrics(4) == {"tools/call_frequency": 0.75, "tools/success_rate": pytest.approx(1 / 3),
                              "tools/add/calls": 1.0, "tools/add/failures": 0.0, "tools/unknown/calls": 2.0,
                              "tools/unknown/failures": 2.0}


def test_tool_errors_come_before_the_model_loads(tmp_path, tiny_model_dir, monkeypatch, capsys):
    from alignkit.model import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    for extra, message in (
            (["--tools", f"{TOOLS}:ad"], "has no `ad`"),
            (["max_tool_calling_iterations=2"], "add --tools"),
            (["--tools", f"{TOOLS}:add", "max_tool_calling_iterations=-1"], "max_tool_calling_iterations=-1 must be >= 0"),
            (["--tools", f"{TOOLS}:add", "--kl-reference", "base"], "--kl-reference with --tools")):
        assert _eval(tmp_path, tiny_model_dir, *extra) != 0
        assert message in capsys.readouterr().err, extra


# `--environment-factory`: tests/tool_functions.py's Counter, one per prompt, whose `bump` is a tool; its reset() says
# what it got (OBSERVATION: the row's column `answer` and `prompt`, one message), and the reward `counted` reads each
# row's instance from `environments` (NaN where the instance was not reset for the row's answer).
# Per row, with --tools add: bump(2), bump(3) -> 5 | no call -> 0 | bump(7) -> 7 | add(9, 9) and bump(1) in one turn
# -> 1. So 5 calls over 4 prompts, none failed: bump 4, add 1; `counted` 5, 0, 7, 1 (mean 3.25); accuracy 4 / 4.
ENVIRONMENT_SCRIPT = {
    "2 plus 3": [_call("bump", by=2), _call("bump", by=3), "It is 5."],
    "4 plus 4": ["8"],
    "6 plus 1": [_call("bump", by=7), "7"],
    "9 plus 9": [_call("add", a=9, b=9) + "\n" + _call("bump", by=1), "18"],
}
OBSERVATION = " (count from 0; reset got answer, prompt; 1 prompt messages)"


def test_eval_with_an_environment_per_row(tmp_path, tiny_model_dir, tiny_tokenizer, monkeypatch, capsys):
    batches = _script_decoder(tiny_tokenizer, monkeypatch, ENVIRONMENT_SCRIPT)
    out_file = tmp_path / "rows.jsonl"
    assert _eval(tmp_path, tiny_model_dir, "--tools", f"{TOOLS}:add", "--environment-factory", f"{TOOLS}:Counter",
                 "--reward", f"{TOOLS}:counted", "--output", str(out_file)) == 0
    printed = capsys.readouterr().out
    assert "tool calls: 5 over 4 prompts (1.2500 per prompt), 5 ran without error (success rate 1.0000)" in printed
    assert "  bump: 4 calls, 0 failed" in printed and "  add: 1 calls, 0 failed" in printed
    assert "counted: 3.2500 (mean over 4 of 4 rows)" in printed and "accuracy: 1.0000" in printed
    assert f"tools {TOOLS}:add, environment {TOOLS}:Counter (" in printed
    rows = [json.loads(line) for line in out_file.read_text(encoding="utf-8").splitlines()]
    assert [r["rewards"]["counted"] for r in rows] == [5.0, 0.0, 7.0, 1.0]
    # reset got the row's columns and `prompt` (TRL's contract); its observation ends the prompt the model saw (with
    # both tools' schemas) and the one the rewards got.
    assert [r["prompt"][-1]["content"] for r in rows] == [q["prompt"] + OBSERVATION for q in ROWS]
    assert "environments" not in rows[0]
    first_turn, _ = batches[0]
    assert all('"name": "bump"' in c and '"name": "add"' in c for c in first_turn)
    assert "What is 2 plus 3?" + OBSERVATION in first_turn[0] and "What is 4 plus 4?" + OBSERVATION in first_turn[1]


def test_eval_with_an_environment_alone_takes_the_loop_keys(tmp_path, tiny_model_dir, tiny_tokenizer, monkeypatch,
                                                            capsys):
    """max_tool_calling_iterations=1 without --tools: the 2 + 3 row stops after bump(2), so it counts 2; 3 calls."""
    _script_decoder(tiny_tokenizer, monkeypatch, {**ENVIRONMENT_SCRIPT, "9 plus 9": [_call("bump", by=1), "18"]})
    assert _eval(tmp_path, tiny_model_dir, "--environment-factory", f"{TOOLS}:Counter", "--reward", f"{TOOLS}:counted",
                 "max_tool_calling_iterations=1", "--output", str(tmp_path / "rows.jsonl")) == 0
    printed = capsys.readouterr().out
    assert "tool calls: 3 over 4 prompts (0.7500 per prompt), 3 ran without error" in printed
    assert "  bump: 3 calls, 0 failed" in printed and "add:" not in printed
    assert f"tools environment {TOOLS}:Counter (at most 1 tool turns" in printed
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["rewards"]["counted"] for r in rows] == [2.0, 0.0, 7.0, 1.0]


def test_environment_errors_come_before_the_model_loads(tmp_path, tiny_model_dir, monkeypatch, capsys):
    from alignkit.model import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    for extra, message in (
            (["--environment-factory", f"{TOOLS}:Nope"], f"--environment-factory '{TOOLS}:Nope': "),
            (["--environment-factory", f"{TOOLS}:Nope"], "has no `Nope`"),
            (["--environment-factory", f"{TOOLS}:NoReset"], "--environment-factory: "),
            (["--environment-factory", f"{TOOLS}:NoReset"], "without a `reset` method"),
            (["--environment-factory", f"{TOOLS}:Counter", "--kl-reference", "base"],
             "--kl-reference with --tools or --environment-factory")):
        assert _eval(tmp_path, tiny_model_dir, *extra) != 0
        assert message in capsys.readouterr().err, extra
