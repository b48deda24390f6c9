"""data/demo_math_eval.json, the held-out split for `alignkit eval` before/after GRPO: no problem of
data/demo_math.json in it, answers right, registered, and reproduced by its script."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

from alignkit.config.parse import parse_config
from alignkit.data.loader import get_dataset

DATA = Path(__file__).resolve().parents[2] / "data"
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_math_eval.py"


def _rows(name):
    return json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))


def _script():
    spec = importlib.util.spec_from_file_location("make_math_eval", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_problem_is_shared_with_the_training_file():
    train, held_out = _rows("demo_math"), _rows("demo_math_eval")
    assert len(held_out) == 100
    train_prompts = {row["prompt"] for row in train}
    assert not train_prompts & {row["prompt"] for row in held_out}  # same text
    problem_key = _script().problem_key
    assert problem_key("Tom has 5 apples and buys 3 more. How many apples does Tom have now?") == \
        problem_key("Anna has 5 apples and buys 3 more. How many apples does Anna have now?")
    held_problems = [problem_key(row["prompt"]) for row in held_out]
    assert len(set(held_problems)) == len(held_problems)  # unique within the split
    assert not {problem_key(p) for p in train_prompts} & set(held_problems)  # same problem, other name


def test_answers_are_the_templates_formulas():
    solve = _script().solve
    for row in _rows("demo_math_eval") + _rows("demo_math"):
        assert solve(row["prompt"]) == int(row["answer"]), row
    assert solve("A bus has 12 passengers. At the next stop 7 people get on and 3 get off. How many passengers "
                 "are on the bus now?") == 16  # 12 + 7 - 3, by hand


def test_registered_as_a_prompt_dataset_with_its_answer_column(tiny_tokenizer):
    config = parse_config({"dataset": "demo_math_eval", "dataset_dir": str(DATA), "stage": "sft", "cutoff_len": 128})
    rows = get_dataset(config, tiny_tokenizer, "prompt")["train_dataset"]
    assert len(rows) == 100 and rows[0]["answer"] == _rows("demo_math_eval")[0]["answer"]


def test_the_script_reproduces_the_file(tmp_path):
    shutil.copy(DATA / "demo_math.json", tmp_path / "demo_math.json")
    (tmp_path / "dataset_info.json").write_text("{}", encoding="utf-8")
    subprocess.run([sys.executable, str(SCRIPT), "--data", str(tmp_path)], check=True, capture_output=True)
    assert (tmp_path / "demo_math_eval.json").read_bytes() == (DATA / "demo_math_eval.json").read_bytes()
    registry = json.loads((tmp_path / "dataset_info.json").read_text(encoding="utf-8"))
    assert registry["demo_math_eval"] == json.loads((DATA / "dataset_info.json").read_text())["demo_math_eval"]
