"""Reward errors stop GRPO, PPO and `alignkit eval` with exit 2 before the model loads (issue 31, "weak" list).

A bad module, file or function name in `reward_funcs` (or `--reward`), and PPO's missing `reward_model` folder,
used to be found only when the reward functions were built, after the policy had loaded. "Before the model
loads" is checked as in test_input_errors.py: `load_model` is replaced by a function that fails the test if called.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from alignkit.cli import main

REWARDS = """
    def answer_match(prompts, completions, answer, **kwargs):
        return [1.0 for _ in completions]
"""


@pytest.fixture
def no_model_load(monkeypatch):
    import alignkit.model.loader as loader

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the reward error was reported")

    monkeypatch.setattr(loader, "load_model", refuse)


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """Prompts, a reward file, and the config's folder as the working directory (a relative path then names one
    folder twice over: beside the config and in the current directory)."""
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"What is {i} + 2?", "answer": str(i + 2)})
                                                    + "\n" for i in range(4)), encoding="utf-8")
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(REWARDS), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _write_config(workspace, tiny_model_dir, stage) -> None:
    stage_keys = {"grpo": "max_completion_length: 4\nnum_generations: 4\n", "ppo": "max_new_tokens: 4\n"}[stage]
    (workspace / "run.yaml").write_text(
        f"stage: {stage}\nmodel_name_or_path: {tiny_model_dir}\ndataset: prompts.jsonl\noutput_dir: out\n"
        f"per_device_train_batch_size: 4\nmax_steps: 1\nsave_strategy: 'no'\ncutoff_len: 64\n{stage_keys}",
        encoding="utf-8")


def _train(workspace, tiny_model_dir, stage, capsys, **keys) -> tuple[int, str]:
    _write_config(workspace, tiny_model_dir, stage)
    code = main(["train", "run.yaml", *[f"{k}={v}" for k, v in keys.items()]])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize("spec, expected", [
    ("no_such_package.rewards:score", "cannot import module 'no_such_package.rewards'"),
    ("missing.py:answer_match", "file not found (looked at"),
    ("my_rewards.py:answer_mach", "has no `answer_mach`. Did you mean `answer_match`?"),
])
def test_grpo_reward_function_errors(spec, expected, workspace, tiny_model_dir, capsys, no_model_load):
    code, err = _train(workspace, tiny_model_dir, "grpo", capsys, reward_funcs=f"accuracy,{spec}")
    assert code == 2 and f"reward function {spec!r}" in err and expected in err


def test_ppo_reward_function_error(workspace, tiny_model_dir, capsys, no_model_load):
    code, err = _train(workspace, tiny_model_dir, "ppo", capsys, reward_funcs="my_rewards.py:answer_mach")
    assert code == 2 and "has no `answer_mach`" in err


def test_ppo_missing_reward_model_names_its_key_and_the_path_once(workspace, tiny_model_dir, capsys, no_model_load):
    code, err = _train(workspace, tiny_model_dir, "ppo", capsys, reward_model="saves/rm_typo")
    assert code == 2
    assert "alignkit: error: reward_model: no folder 'saves/rm_typo'" in err and "reward_funcs" not in err
    assert err.count(str(workspace / "saves" / "rm_typo")) == 1


def test_eval_reward_errors(workspace, tiny_model_dir, capsys, no_model_load):
    def run(spec):
        code = main(["eval", "--model", tiny_model_dir, "--dataset", "prompts.jsonl", "--dataset-dir", str(workspace),
                     "--max-new-tokens", "4", "--reward", "accuracy", "--reward", spec])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err
        return err

    assert "has no `answer_mach`. Did you mean `answer_match`?" in run("my_rewards.py:answer_mach")
    assert "alignkit: error: --reward: 'rm_typo' is not a built-in" in run("rm_typo")
    assert "cannot import module 'no_such_module'" in run("no_such_module:score")


@pytest.mark.parametrize("online_stage", ["grpo", "rloo"])
def test_an_online_stage_without_reward_funcs_exits_2_before_the_model_loads(workspace, tiny_model_dir, capsys,
                                                                             no_model_load, online_stage):
    """Issue 32: the missing rewards were reported only when they were built, after the policy had loaded. (rloo
    takes GRPO's generation keys, so the GRPO config serves with `stage=rloo` on the command line.)"""
    _write_config(workspace, tiny_model_dir, "grpo")
    code = main(["train", "run.yaml", f"stage={online_stage}"])
    err = capsys.readouterr().err
    assert code == 2 and f"stage {online_stage} needs reward_funcs" in err and "accuracy,format" in err
