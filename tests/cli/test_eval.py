"""`alignkit eval` on the tiny model: reward means over a prompt file, per-row output, adapters, errors."""

from __future__ import annotations

import json
import textwrap

import pytest

from alignkit.cli import main

ROWS = [
    {"prompt": "What is 2 + 2?", "answer": "4"},
    {"instruction": "Add the numbers.", "input": "7 and 5", "answer": "12"},
    {"prompt": "Name a colour.", "answer": None},
    {"prompt": "How many legs does a spider have?", "answer": "8"},
]
REWARDS = """
    def answer_value(prompts, completions, answer, **kwargs):
        # The row's answer as the reward: a hand-checkable mean (None where the row has none).
        return [float(a) if a is not None else None for a in answer]

    def completion_chars(prompts, completions, **kwargs):
        return [float(len(c[0]["content"])) for c in completions]

    def fails_on_spiders(prompts, completions, **kwargs):
        return [1.0 / ("spider" not in p[-1]["content"]) for p in prompts]
"""


@pytest.fixture
def workspace(tmp_path):
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(
        {"prompt": r.get("prompt") or r["instruction"] + "\n" + r["input"], "answer": r["answer"]}) for r in ROWS),
        encoding="utf-8")
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(REWARDS), encoding="utf-8")
    return tmp_path


def _eval(workspace, tiny_model_dir, *extra, monkeypatch=None):
    args = ["eval", "--model", tiny_model_dir, "--dataset", str(workspace / "prompts.jsonl"),
            "--dataset-dir", str(workspace), "--max-new-tokens", "6", "--batch-size", "3", *extra]
    return main(args)


def test_means_rows_and_columns(workspace, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.chdir(workspace)  # file.py:function relative to the working directory
    out_file = workspace / "rows.jsonl"
    code = _eval(workspace, tiny_model_dir, "--reward", "my_rewards.py:answer_value", "--reward", "accuracy",
                 "--reward", "my_rewards.py:completion_chars", "--reward-weights", "1,1,0", "--output", str(out_file))
    printed = capsys.readouterr().out
    assert code == 0
    # answer_value: answers 4, 12, 8 (one row has none) -> (4 + 12 + 8) / 3 = 8.
    assert "answer_value: 8.0000 (mean over 3 of 4 rows)" in printed
    rows = [json.loads(line) for line in out_file.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 4 and [r["answer"] for r in rows] == [r["answer"] for r in ROWS]
    assert rows[2]["rewards"]["answer_value"] is None and rows[2]["rewards"]["accuracy"] is None
    chars = [r["rewards"]["completion_chars"] for r in rows]
    assert chars == [float(len(r["completion"])) for r in rows]
    assert all(r["completion_tokens"] <= 6 for r in rows)
    accuracy = [r["rewards"]["accuracy"] for r in rows if r["rewards"]["accuracy"] is not None]
    assert f"accuracy: {sum(accuracy) / 3:.4f} (mean over 3 of 4 rows)" in printed
    # Weighted sum with weights 1, 1, 0 over the rows scored by any function (all 4: completion_chars
    # scores every row): the answers plus accuracy, row 2 contributing 0.
    expected = (4 + 12 + 8 + sum(accuracy)) / 4
    assert f"reward (weighted sum): {expected:.4f}" in printed


def test_greedy_is_repeatable_and_the_adapter_is_used(workspace, tiny_model_dir, tmp_path, save_perturbed_adapter,
                                                      capsys):
    adapter = tmp_path / "adapter"
    save_perturbed_adapter(tiny_model_dir, adapter)
    texts = {}
    for name, extra in (("base", []), ("again", []), ("adapter", ["--adapter", str(adapter)])):
        out_file = workspace / f"{name}.jsonl"
        assert _eval(workspace, tiny_model_dir, "--reward", "length", "--output", str(out_file), *extra) == 0
        texts[name] = [json.loads(line)["completion_tokens"] for line in out_file.read_text().splitlines()], \
            [json.loads(line)["completion"] for line in out_file.read_text().splitlines()]
    assert texts["base"] == texts["again"]
    assert texts["adapter"] != texts["base"]
    assert f"+ {adapter}" in capsys.readouterr().out


def test_a_failing_reward_function_is_a_clean_error(workspace, tiny_model_dir, capsys):
    code = _eval(workspace, tiny_model_dir, "--reward", f"{workspace / 'my_rewards.py'}:fails_on_spiders")
    err = capsys.readouterr().err
    assert code == 2
    # Batches of 3: the spider prompt is row 0 of the second call, and the message shows its prompt.
    assert "reward function fails_on_spiders raised ZeroDivisionError" in err
    assert "on row 0 of 1 (prompt [{'role': 'user', 'content': 'How many legs does a spider have?'}]" in err


def test_reward_settings_as_key_value(workspace, tiny_model_dir, capsys):
    # Everything matches `.*`, so format is 1.0 on every row; the length reward takes its window from the key.
    code = _eval(workspace, tiny_model_dir, "--reward", "format", "--reward", "length", "format_reward_pattern=.*",
                 "length_reward_window=2")
    printed = capsys.readouterr().out
    assert code == 0 and "format: 1.0000 (mean over 4 of 4 rows)" in printed
    with pytest.raises(SystemExit):
        main(["eval", "--dataset", "x"])  # --reward is required
    assert _eval(workspace, tiny_model_dir, "--reward", "format", "length_reward_window=0") == 2
    assert "length_reward_window=0 must be >= 1" in capsys.readouterr().err
