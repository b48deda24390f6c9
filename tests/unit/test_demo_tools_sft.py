"""data/demo_tools_sft.json, the tool-use SFT set of the calculator demo (examples/sft_tools_lora.yaml): the calls
are right and trained, the tool results are not, the prompt is the one GRPO with tools shows, no problem is shared
with demo_math or demo_math_eval, and scripts/make_demo_data.py reproduces the file."""

from __future__ import annotations

import copy

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from alignkit.config.parse import parse_config
from alignkit.constants import IGNORE_INDEX
from alignkit.data import ChatFormatter, get_dataset
from alignkit.rl.tools import ToolLoop, load_tools, tool_schema

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"
CALCULATOR = f"{ROOT / 'examples' / 'tools' / 'calculator.py'}:calculate"


def _rows(name):
    return json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))


def _math_eval_script():
    spec = importlib.util.spec_from_file_location("make_math_eval", ROOT / "scripts" / "make_math_eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_call_gives_the_answer_and_the_schema_is_the_calculators():
    (calculate,) = load_tools([CALCULATOR])
    rows = _rows("demo_tools_sft")
    assert len(rows) == 200
    solve = _math_eval_script().solve
    for row in rows:
        assert json.loads(row["tools"]) == [tool_schema(calculate)]  # what the GRPO prompt shows
        human, call, observation, answer = row["conversations"]
        assert [t["from"] for t in row["conversations"]] == ["human", "function_call", "observation", "gpt"]
        call = json.loads(call["value"])
        assert call["name"] == "calculate" and list(call["arguments"]) == ["expression"]
        expected = str(solve(human["value"]))  # the template's formula on the prompt's numbers
        assert calculate(**call["arguments"]) == observation["value"] == expected, row
        assert answer["value"] in (f"The answer is {expected}.", f"答案是{expected}。")
    # By hand: the first row's problem and call.
    assert rows[0]["conversations"][0]["value"].startswith("A shelf holds 29 books.")
    assert json.loads(rows[0]["conversations"][1]["value"])["arguments"] == {"expression": "29 - 12"}
    assert rows[0]["conversations"][2]["value"] == "17"


def test_no_problem_of_grpo_or_of_the_held_out_set():
    problem_key = _math_eval_script().problem_key
    tools = [problem_key(row["conversations"][0]["value"]) for row in _rows("demo_tools_sft")]
    assert len(set(tools)) == len(tools)
    assert not set(tools) & {problem_key(row["prompt"]) for row in _rows("demo_math_eval")}
    assert not set(tools) & {problem_key(row["prompt"]) for row in _rows("demo_math")}


def test_calls_and_answers_are_trained_tool_results_are_not(tiny_tokenizer):
    # A copy: the smollm2 template is installed into the tokenizer it formats with, and the fixture is shared.
    tiny_tokenizer = copy.deepcopy(tiny_tokenizer)
    config = parse_config({"dataset": "demo_tools_sft", "dataset_dir": str(DATA), "stage": "sft", "cutoff_len": 1024,
                           "template": "smollm2", "max_samples": 4})
    rows = get_dataset(config, tiny_tokenizer, "supervised")["train_dataset"]
    source = _rows("demo_tools_sft")
    for row, written in zip(rows, source):
        ids, labels = row["input_ids"], row["labels"]
        trained = [t for t, label in zip(ids, labels) if label != IGNORE_INDEX]
        context = [t for t, label in zip(ids, labels) if label == IGNORE_INDEX]
        assert all(label in (IGNORE_INDEX, t) for t, label in zip(ids, labels))
        call = json.loads(written["conversations"][1]["value"])
        answer = written["conversations"][3]["value"]
        assert tiny_tokenizer.decode(trained) == (
            "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call><|im_end|>\n"
            + answer + "<|im_end|>\n")
        shown = tiny_tokenizer.decode(context)
        assert "<tool_response>\n" + written["conversations"][2]["value"] + "\n</tool_response>" in shown
        assert "<tools>" in shown and '"name": "calculate"' in shown


def test_the_sft_prompt_is_the_grpo_tool_prompt(tiny_tokenizer):
    # A copy: the smollm2 template is installed into the tokenizer it formats with, and the fixture is shared.
    tiny_tokenizer = copy.deepcopy(tiny_tokenizer)
    """The prompt part of a training row (up to the call) is token for token what GRPO's tool loop generates from."""
    config = parse_config({"dataset": "demo_tools_sft", "dataset_dir": str(DATA), "stage": "sft", "cutoff_len": 1024,
                           "template": "smollm2", "max_samples": 2})
    rows = get_dataset(config, tiny_tokenizer, "supervised")["train_dataset"]
    formatter = ChatFormatter(tiny_tokenizer, "smollm2")
    loop = ToolLoop(load_tools([CALCULATOR]), None, formatter, formatter.stop_token_ids())
    for row, written in zip(rows, _rows("demo_tools_sft")):
        question = [{"role": "user", "content": written["conversations"][0]["value"]}]
        (prompt_ids,) = loop.start([question], [{}])[3]
        first_trained = next(i for i, label in enumerate(row["labels"]) if label != IGNORE_INDEX)
        assert row["input_ids"][:first_trained] == prompt_ids


def test_the_script_reproduces_the_file(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_demo_data.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    assert (tmp_path / "demo_tools_sft.json").read_bytes() == (DATA / "demo_tools_sft.json").read_bytes()
    registry = json.loads((tmp_path / "dataset_info.json").read_text(encoding="utf-8"))
    assert registry["demo_tools_sft"] == json.loads((DATA / "dataset_info.json").read_text())["demo_tools_sft"]
