"""The tool-calling rollout's pieces (`alignkit.rl.tools`) against hand-built values: the parser, a call's failures,
the tool turn's tokens, and the multi-turn loop's completion ids and tool mask with a scripted generator (no model)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from alignkit.data.template import ChatFormatter
from alignkit.errors import ConfigError
from alignkit.rl.tools import (ToolCallFormat, ToolLoop, load_environment_factory, load_tools, parse_tool_calls,
                               rollout_tensors, run_tool_call, tool_rollout, tool_suffix_ids, turn_seeds)
from alignkit.rl.rollout import rollout_seed
from tests.tool_functions import add, boom, huge, sleepy

CHATML = ToolCallFormat()


TOOLS = {f.__name__: f for f in (add, boom, sleepy, huge)}


def test_parser_reads_several_calls_and_the_text_before():
    text = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "huge", "arguments": {}}\n</tool_call>')
    parsed = parse_tool_calls(text, CHATML)
    assert parsed.content == "Let me add."
    assert parsed.calls == [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "huge", "arguments": {}}]
    assert parsed.message()["tool_calls"][0] == {"type": "function",
                                                 "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}


def test_parser_reports_bad_calls_and_leaves_a_half_written_block_as_text():
    parsed = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>', CHATML)
    assert len(parsed.calls) == 1 and "not valid JSON" in parsed.calls[0]["error"]
    parsed = parse_tool_calls('<tool_call>\n["add"]\n</tool_call>', CHATML)
    assert "must be a JSON object" in parsed.calls[0]["error"]
    parsed = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": 3}\n</tool_call>', CHATML)
    assert parsed.calls[0]["name"] == "add" and "must be a JSON object" in parsed.calls[0]["error"]
    parsed = parse_tool_calls('answer 3 <tool_call>\n{"name": "add"', CHATML)
    assert parsed.calls == [] and parsed.content == 'answer 3 <tool_call>\n{"name": "add"'


def test_parser_reads_a_cut_off_last_block_whose_json_is_whole_as_trl_does():
    """TRL 1.16 (transformers' `parse_response`) reads `<tool_call>` + a whole JSON object at the end of a turn cut off
    by the length limit as a call (and counts it); a half-written object stays text."""
    parsed = parse_tool_calls('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}', CHATML)
    assert parsed.content == "Let me add." and parsed.calls == [{"name": "add", "arguments": {"a": 1, "b": 2}}]
    closed = '<tool_call>\n{"name": "huge", "arguments": {}}\n</tool_call>\n'
    parsed = parse_tool_calls(closed + '<tool_call>\n{"name": "add", "arguments": {"a": 1}}', CHATML)
    assert parsed.calls == [{"name": "huge", "arguments": {}}, {"name": "add", "arguments": {"a": 1}}]
    parsed = parse_tool_calls(closed + '<tool_call>\n{"name": "add", "argu', CHATML)
    assert parsed.calls == [{"name": "huge", "arguments": {}}] and parsed.content == ""


def test_parser_without_markers_reads_a_bare_json_call():
    llama = ToolCallFormat(open="", close="", arguments_key="parameters")
    parsed = parse_tool_calls('{"name": "add", "parameters": {"a": 1, "b": 2}}', llama)
    assert parsed.calls == [{"name": "add", "arguments": {"a": 1, "b": 2}}]
    assert parse_tool_calls("The answer is 3.", llama).calls == []


def test_call_format_is_read_from_the_template(tiny_tokenizer):
    assert ToolCallFormat.from_formatter(ChatFormatter(tiny_tokenizer, "chatml")) == CHATML


def test_failures_become_messages_never_exceptions():
    ok = run_tool_call({"name": "add", "arguments": {"a": 2, "b": 3}}, TOOLS, timeout=2.0, max_chars=100)
    assert (ok.content, ok.failed) == ("5", False)
    raised = run_tool_call({"name": "boom", "arguments": {"x": 1}}, TOOLS, timeout=2.0, max_chars=100)
    assert (raised.content, raised.failed) == ("{'error': 'kaboom'}", True)  # TRL's str({"error": str(e)})
    unknown = run_tool_call({"name": "nope", "arguments": {}}, TOOLS, timeout=2.0, max_chars=100)
    assert (unknown.content, unknown.failed) == ("{'error': 'Tool nope not found.'}", True)
    wrong_args = run_tool_call({"name": "add", "arguments": {"c": 1}}, TOOLS, timeout=2.0, max_chars=100)
    assert wrong_args.failed and "unexpected keyword argument" in wrong_args.content
    start = time.perf_counter()
    slow = run_tool_call({"name": "sleepy", "arguments": {"seconds": 30}}, TOOLS, timeout=0.2, max_chars=100)
    # back long before the 30 s call could have ended (the bound is about not waiting, not about speed)
    assert time.perf_counter() - start < 15 and slow.failed and "did not return within 0.2 s" in slow.content
    big = run_tool_call({"name": "huge", "arguments": {}}, TOOLS, timeout=5.0, max_chars=50)
    assert not big.failed and big.content.startswith("x" * 50 + "\n[output cut: the tool returned 10000000")
    bad_json = run_tool_call({"error": "the tool call is not valid JSON"}, TOOLS, timeout=1.0, max_chars=100)
    assert bad_json.failed and bad_json.name == "unknown"


def test_tool_suffix_is_the_tool_turn_after_the_end_of_turn_token(tiny_tokenizer):
    formatter = ChatFormatter(tiny_tokenizer, "chatml")
    suffix = tool_suffix_ids(formatter, [{"role": "tool", "name": "add", "content": "5"}],
                             formatter.stop_token_ids())
    assert tiny_tokenizer.decode(suffix) == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
                                             "<|im_start|>assistant\n")


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _call(name, **arguments):
    import json

    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class Script:
    """A stand-in for the policy: row r's turn k is `turns[r][k]` (text, then the end-of-turn token), cut to the
    token budget; records each call."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.calls = tokenizer, turns, []

    def __call__(self, contexts, rows, turn, max_new_tokens):
        self.calls.append((list(rows), turn, max_new_tokens))
        eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        return [(_ids(self.tokenizer, self.turns[r][turn]) + [eos])[:max_new_tokens] for r in rows]


def _rollout(tokenizer, turns, **kwargs):
    formatter = ChatFormatter(tokenizer, "chatml")
    stops = formatter.stop_token_ids()
    prompts = [_ids(tokenizer, f"prompt {r}") for r in range(len(turns))]
    script = Script(tokenizer, turns)
    out = tool_rollout(script, prompts, [TOOLS] * len(turns),
                       decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
                       suffix_ids=lambda messages: tool_suffix_ids(formatter, messages, stops),
                       call_format=CHATML, stop_token_ids=stops,
                       **{"max_completion_length": 2000, "timeout": 1.0, **kwargs})
    return out, script, formatter, prompts


def test_rows_finish_at_different_turns_with_hand_built_ids_and_mask(tiny_tokenizer):
    tok = tiny_tokenizer
    turns = [["The answer is 3."],
             [_call("add", a=1, b=2), "It is 3."],
             [_call("add", a=1, b=2) + "\n" + _call("boom", x=1), _call("nope"), "Done."]]
    out, script, formatter, _ = _rollout(tok, turns)
    # Turn 0 for every row, turn 1 for rows 1 and 2, turn 2 for row 2 only.
    assert [(rows, turn) for rows, turn, _ in script.calls] == [([0, 1, 2], 0), ([1, 2], 1), ([2], 2)]
    eos = [tok.convert_tokens_to_ids("<|im_end|>")]
    stops = formatter.stop_token_ids()

    def suffix(*contents):
        return tool_suffix_ids(formatter, [{"role": "tool", "name": "x", "content": c} for c in contents], stops)

    t1 = _ids(tok, turns[2][0]) + eos
    t2 = _ids(tok, turns[2][1]) + eos
    t3 = _ids(tok, "Done.") + eos
    s1, s2 = suffix("3", "{'error': 'kaboom'}"), suffix("{'error': 'Tool nope not found.'}")
    assert out.completion_ids[0] == _ids(tok, "The answer is 3.") + eos
    assert out.completion_ids[2] == t1 + s1 + t2 + s2 + t3
    assert out.tool_mask[2] == [1] * len(t1) + [0] * len(s1) + [1] * len(t2) + [0] * len(s2) + [1] * len(t3)
    assert out.tool_mask[0] == [1] * len(out.completion_ids[0])
    assert [m["role"] for m in out.messages[2]] == ["assistant", "tool", "tool", "assistant", "tool", "assistant"]
    assert out.messages[2][-1] == {"role": "assistant", "content": "Done."}
    assert (out.calls, out.failures) == (4, 2)
    assert out.calls_per_tool == {"add": 2, "boom": 1, "unknown": 1}
    assert out.failures_per_tool == {"boom": 1, "unknown": 1}
    assert out.turns == [1, 2, 3]
    generation, mask = rollout_tensors(out, [[5], [6], [7]], 0, stops)
    assert generation.completion_mask.sum(1).tolist() == [len(ids) for ids in out.completion_ids]
    assert mask.sum(1).tolist() == [sum(m) for m in out.tool_mask]
    assert not generation.truncated.any()


def test_iteration_cap_and_completion_budget(tiny_tokenizer):
    tok = tiny_tokenizer
    calling = [_call("add", a=1, b=2)] * 4
    out, script, _, _ = _rollout(tok, [calling], max_iterations=2)
    assert out.turns == [3] and out.calls == 2  # the third turn's call is not run: the cap
    # A budget that fits the first turn and its tool turn but not all of the second turn: cut to the budget.
    first, _, formatter, _ = _rollout(tok, [calling], max_iterations=0)
    suffix = tool_suffix_ids(formatter, [{"role": "tool", "name": "add", "content": "3"}], formatter.stop_token_ids())
    budget = len(first.completion_ids[0]) + len(suffix) + 30
    out, script, _, _ = _rollout(tok, [calling], max_completion_length=budget)
    assert len(out.completion_ids[0]) == budget and script.calls[1][2] == 30
    assert out.tool_mask[0] == [1] * len(first.completion_ids[0]) + [0] * len(suffix) + [1] * 30
    assert rollout_tensors(out, [[5]], 0, formatter.stop_token_ids())[0].truncated.tolist() == [True]
    # A tool turn that would pass the budget is dropped: the row ends with its calling turn (the call counted).
    out, _, _, _ = _rollout(tok, [calling], max_completion_length=len(first.completion_ids[0]) + 3)
    assert out.completion_ids[0] == first.completion_ids[0] and out.calls == 1 and out.turns == [1]


def test_turn_seeds_keep_turn_zero_and_differ_per_turn():
    assert turn_seeds(7, 0, [2, 3]) == [rollout_seed(7, 2), rollout_seed(7, 3)]
    assert turn_seeds(7, 2, [3]) == [rollout_seed(rollout_seed(7, 3), 2)]


def test_loading_checks_name_the_key_and_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text("def add(a: int, b: int) -> int:\n    '''Add.\n\n    Args:\n        a: x\n        b: y\n    '''\n"
                    "    return a + b\n\ndef nodoc(a):\n    return a\n\n"
                    "class Env:\n    def reset(self, **kwargs):\n        return None\n"
                    "    def add(self, a: int) -> int:\n        '''Add.\n\n        Args:\n            a: x\n        '''\n"
                    "        return a\n\nclass NoReset:\n    pass\n")
    assert [f.__name__ for f in load_tools([f"{path}:add"])] == ["add"]
    with pytest.raises(ConfigError, match="tools: .*nodoc.*docstring"):
        load_tools([f"{path}:nodoc"])
    with pytest.raises(ConfigError, match="tools .*has no `ad`.*Did you mean `add`"):
        load_tools([f"{path}:ad"])
    with pytest.raises(ConfigError, match="not `path/to/file.py:name`"):
        load_tools(["add"])
    with pytest.raises(ConfigError, match="without a `reset` method"):
        load_environment_factory(f"{path}:NoReset")
    with pytest.raises(ConfigError, match="two tools are named add"):
        load_environment_factory(f"{path}:Env", tools=load_tools([f"{path}:add"]))


def test_environment_reset_extends_the_prompt_and_its_methods_are_tools(tiny_tokenizer):
    class Counter:
        def reset(self, **kwargs):
            self.total = kwargs["start"]
            return f" (start at {self.total})"

        def increment(self, step: int) -> int:
            """Add to the counter.

            Args:
                step: how much.
            """
            self.total += step
            return self.total

    loop = ToolLoop([add], Counter, ChatFormatter(tiny_tokenizer, "chatml"), [2])
    messages, row_tools, environments, prompt_ids = loop.start(
        [[{"role": "user", "content": "count"}]] * 2, [{"start": 1}, {"start": 5}])
    assert [m[-1]["content"] for m in messages] == ["count (start at 1)", "count (start at 5)"]
    assert loop.tool_names == ["add", "increment"] and set(row_tools[1]) == {"add", "increment"}
    assert row_tools[1]["increment"](2) == 7 and environments[0].total == 1  # one instance per row
    assert '"name": "increment"' in tiny_tokenizer.decode(prompt_ids[0])


def test_an_environment_with_get_reward_is_a_reward_source_and_stands_in_for_reward_funcs(tiny_model_dir, tmp_path):
    """TRL 1.16: `get_reward` makes the environment a reward source (named after its class; `get_reward` is not a
    tool) and `reward_funcs` optional; without it `reward_funcs` stays required."""
    from alignkit.config.parse import parse_config
    from alignkit.rl.tools import environment_methods, environment_reward
    from tests.tool_functions import Counter, ScoredCounter

    assert environment_reward(Counter) is None and environment_reward(None) is None
    name, reward = environment_reward(ScoredCounter)
    first, second, other = ScoredCounter(), ScoredCounter(), Counter()
    for env, count in ((first, 2), (second, 5), (other, 1)):
        env.reset(prompt=[])
        env.bump(count)
    assert name == "ScoredCounter" and reward(environments=[first, second, other], prompts=[0, 0, 0]) == [2.0, 5.0,
                                                                                                       None]
    assert [m.__name__ for m in environment_methods(first)] == ["bump"]
    functions = str(Path(__file__).resolve().parents[1] / "tool_functions.py")
    keys = {"stage": "grpo", "model_name_or_path": tiny_model_dir, "dataset": "demo_math", "template": "chatml",
            "output_dir": str(tmp_path / "out"), "num_generations": 2, "per_device_train_batch_size": 2}
    config = parse_config({**keys, "environment_factory": f"{functions}:ScoredCounter"})
    assert config.method.reward_funcs == []
    with pytest.raises(ConfigError, match="needs reward_funcs"):
        parse_config({**keys, "environment_factory": f"{functions}:Counter"})


def test_example_calculator_reads_arithmetic_only():
    """examples/tools/calculator.py: arithmetic from the syntax tree, no `eval`; anything else raises (the model is
    told the error)."""
    from pathlib import Path

    calculate, = load_tools([f"{Path(__file__).resolve().parents[2]}/examples/tools/calculator.py:calculate"])
    assert calculate("12 * (3 + 4)") == "84" and calculate("7 / 2") == "3.5" and calculate("-2 ** 3") == "-8"
    for bad in ("__import__('os').system('ls')", "2 ** 1000", "x + 1"):
        result = run_tool_call({"name": "calculate", "arguments": {"expression": bad}}, {"calculate": calculate},
                               timeout=1.0, max_chars=200)
        assert result.failed and result.content.startswith("{'error': ")
