"""A folder without a trained score head is refused as a reward model (issue 31 item 7).

Before, a plain causal-LM folder given as a reward model was loaded as `AutoModelForSequenceClassification` with a
randomly initialised `score` head and scored with it: PPO `reward_model=<dir>` (auto and full), GRPO
`reward_funcs=<dir>`, `alignkit score --model <dir>` and `alignkit eval --reward <dir>` all exited 0, the only sign
transformers' load report `score.weight MISSING`. A LoRA rm output whose adapter lost its score head fell back, under
`reward_model_type: auto`, to the same random head. Now each entry point stops with exit status 2, no traceback, and
a message naming the folder and how to train a reward model, before any model loads: `from_pretrained` is replaced
by a function that fails the test if called.
"""

from __future__ import annotations

import json

import pytest

from alignkit.cli import main

pytestmark = pytest.mark.fault

PROMPTS = ["What is 2 + 2?", "Name a colour.", "What is 9 times 3?", "Say hello."]


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading any model's weights fails the test: the reward model must be refused before."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the reward model was refused")

    for auto_class in (transformers.AutoModelForCausalLM, transformers.AutoModelForSequenceClassification):
        monkeypatch.setattr(auto_class, "from_pretrained", refuse)


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": "4"}) + "\n" for p in PROMPTS), encoding="utf-8")
    return path


@pytest.fixture
def headless_adapter(reward_adapter_dir):
    """An rm run's LoRA output whose adapter weights lost the score head (the LoRA matrices are still there)."""
    from safetensors.torch import load_file, save_file

    weights = reward_adapter_dir / "adapter_model.safetensors"
    kept = {k: v for k, v in load_file(weights).items() if ".score." not in k}
    save_file(kept, weights, metadata={"format": "pt"})
    return reward_adapter_dir


def _assert_refused(code: int, err: str, folder) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    assert "alignkit: error: " in err and str(folder) in err
    assert "no trained score head" in err and "stage: rm" in err


STAGE_KEYS = {"ppo": "max_new_tokens: 4\nmini_batch_size: 2\n",
              "grpo": "max_completion_length: 4\nnum_generations: 4\n"}


def _train(tmp_path, tiny_model_dir, prompts_file, stage: str, **keys) -> list[str]:
    config = tmp_path / "run.yaml"
    config.write_text(f"stage: {stage}\nmodel_name_or_path: {tiny_model_dir}\ndataset: {prompts_file}\n"
                      f"output_dir: {tmp_path / 'out'}\nper_device_train_batch_size: 4\nmax_steps: 1\n"
                      f"save_strategy: 'no'\ncutoff_len: 64\nuse_cpu: true\n{STAGE_KEYS[stage]}", encoding="utf-8")
    return ["train", str(config), *[f"{k}={v}" for k, v in keys.items()]]


@pytest.mark.parametrize("reward_model_type", ["auto", "full"])
def test_ppo_reward_model(reward_model_type, tmp_path, tiny_model_dir, prompts_file, capsys, no_model_load):
    argv = _train(tmp_path, tiny_model_dir, prompts_file, "ppo", reward_model=tiny_model_dir,
                  reward_model_type=reward_model_type)
    _assert_refused(main(argv), capsys.readouterr().err, tiny_model_dir)


def test_ppo_reward_adapter_without_its_head(tmp_path, tiny_model_dir, prompts_file, headless_adapter, capsys,
                                             no_model_load):
    """`auto` on a LoRA policy used to fall back from the adapter (no head weights) to a merge with a random head."""
    argv = _train(tmp_path, tiny_model_dir, prompts_file, "ppo", reward_model=headless_adapter)
    _assert_refused(main(argv), capsys.readouterr().err, headless_adapter)


def test_grpo_reward_funcs(tmp_path, tiny_model_dir, prompts_file, capsys, no_model_load):
    argv = _train(tmp_path, tiny_model_dir, prompts_file, "grpo", reward_funcs=f"accuracy,{tiny_model_dir}")
    _assert_refused(main(argv), capsys.readouterr().err, tiny_model_dir)


@pytest.fixture(params=["causal_lm", "headless_adapter"])
def not_a_reward_model(request, tiny_model_dir):
    """A plain causal-LM folder, or an rm run's LoRA output without its head (built before `no_model_load`)."""
    return tiny_model_dir if request.param == "causal_lm" else request.getfixturevalue("headless_adapter")


def test_score_model(not_a_reward_model, tmp_path, capsys, no_model_load):
    model = not_a_reward_model
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "Hi", "response": "Hello"}) + "\n", encoding="utf-8")
    code = main(["score", "--model", str(model), "--input", str(rows), "--output", str(tmp_path / "o.jsonl")])
    _assert_refused(code, capsys.readouterr().err, model)
    assert not (tmp_path / "o.jsonl").exists()


def test_eval_reward(tmp_path, tiny_model_dir, prompts_file, capsys, no_model_load):
    code = main(["eval", "--model", tiny_model_dir, "--dataset", str(prompts_file), "--dataset-dir", str(tmp_path),
                 "--max-new-tokens", "4", "--reward", tiny_model_dir])
    _assert_refused(code, capsys.readouterr().err, tiny_model_dir)
