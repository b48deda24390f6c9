"""The key table (`alignkit/config/keys.json`) that `alignkit train` checks a config against before torch loads.

The table must say what the dataclasses say (else regenerate it: `python -m alignkit.config.keytable`), and the
early check must never refuse what the full parse accepts: every value the check refuses, the parse refuses with
the same message.
"""

import enum
import json
import shutil
from pathlib import Path
from typing import Any, Literal, Optional, Union

import pytest

from alignkit.config import keytable
from alignkit.config.keytable import build_key_table, check_config_early, load_key_table, type_from_spec, type_spec
from alignkit.config.values import _type_name, convert_value, field_types
from alignkit.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[2]


def test_committed_table_matches_the_dataclasses():
    committed = json.loads(keytable.TABLE_FILE.read_text(encoding="utf-8"))
    live = build_key_table()
    assert keytable.same_keys(committed, live), "keys.json is stale: run `python -m alignkit.config.keytable`"
    assert live["transformers"][0] in committed["transformers"], "run `python -m alignkit.config.keytable`"
    assert load_key_table() == committed  # made with the installed transformers, so it is used


def test_regenerating_adds_the_installed_release_where_the_keys_are_the_same(tmp_path, monkeypatch):
    """transformers 5.24.0 and 5.25.0 gave the same table: one file lists both. A table whose keys differ from the
    live ones is replaced by one naming the installed release alone."""
    live = build_key_table()
    installed = live["transformers"][0]
    table_file = tmp_path / "keys.json"
    monkeypatch.setattr(keytable, "TABLE_FILE", table_file)
    monkeypatch.setattr(keytable, "build_key_table", lambda: json.loads(json.dumps(live)))
    table_file.write_text(json.dumps({**live, "transformers": ["10.0.0", "4.9.1"]}), encoding="utf-8")
    keytable.write_key_table()
    assert json.loads(table_file.read_text())["transformers"] == sorted(
        ["4.9.1", installed, "10.0.0"], key=lambda r: [int(p) for p in r.split(".")])
    assert load_key_table() is not None
    other = dict(live, transformers=["4.9.1"], stages=[*live["stages"], "another"])
    table_file.write_text(json.dumps(other), encoding="utf-8")
    keytable.write_key_table()
    assert json.loads(table_file.read_text()) == live


def test_a_table_of_another_transformers_release_is_not_used(tmp_path, monkeypatch):
    table = json.loads(keytable.TABLE_FILE.read_text(encoding="utf-8"))
    table["transformers"] = ["0.0.1"]
    stale = tmp_path / "keys.json"
    stale.write_text(json.dumps(table), encoding="utf-8")
    monkeypatch.setattr(keytable, "TABLE_FILE", stale)
    assert load_key_table() is None
    monkeypatch.setattr(keytable, "TABLE_FILE", tmp_path / "missing.json")
    assert load_key_table() is None


class Colour(enum.Enum):
    RED = "red"


def test_type_spec_by_hand():
    assert type_spec(int) == "int" and type_spec(Any) == "any"
    assert type_spec(Optional[int]) == {"union": ["int", "none"]}
    assert type_spec(Literal["a", 1, None]) == {"literal": ["a", 1, None]}
    assert type_spec(list[str]) == "list" and type_spec(dict[str, Any]) == "dict"
    assert type_spec(Union[Colour, str]) == {"union": ["any", "str"]}  # an enum: any value here, the parse checks
    assert type_from_spec({"union": ["int", "none"]}) == Optional[int]
    assert type_from_spec({"literal": ["a", "b"]}) == Literal["a", "b"]


SAMPLES = ("abc", "3", "2.5", "true", "none", None, 7, 0.5, True, [1, "x"], {"a": 1}, "sigmoid", "lora", "cosine")


def test_the_early_check_refuses_only_what_the_parse_refuses_with_the_same_message():
    """For every key of every section and stage, and a spread of values: where the table's type refuses a value,
    the field's real type refuses it with the same message; where the table cannot write a type down it accepts."""
    from alignkit.config.parse import _stage_argument_classes
    from alignkit.config.schema import ARG_CLASSES

    checked = 0
    for cls in (*ARG_CLASSES, *_stage_argument_classes().values()):
        for key, tp in field_types(cls).items():
            rebuilt = type_from_spec(type_spec(tp))
            if "any" not in json.dumps(type_spec(tp)):
                assert _type_name(rebuilt) == _type_name(tp), key
            for value in SAMPLES:
                try:
                    convert_value(key, value, rebuilt)
                except ConfigError as early:
                    with pytest.raises(ConfigError) as full:
                        convert_value(key, value, tp)
                    assert str(full.value) == str(early), (key, value)
                    checked += 1
    assert checked > 100


def _config(tmp_path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_early_check_finds_unknown_keys_bad_values_stages_and_datasets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(ROOT / "data", tmp_path / "data")
    table = load_key_table()
    path = _config(tmp_path, "stage: dpo\ndataset: demo_pref\npref_beta: 0.1\n")
    check_config_early(path, [], table)  # a good config passes
    with pytest.raises(ConfigError, match=r"unknown key `learnig_rate` on the command line .*`learning_rate`"):
        check_config_early(path, ["learnig_rate=1e-4"], table)
    with pytest.raises(ConfigError, match=r"lora_rank='x' is not a valid int"):
        check_config_early(path, ["lora_rank=x"], table)
    with pytest.raises(ConfigError, match=r"pref_loss='nope' is not a valid one of sigmoid"):  # a stage's own key
        check_config_early(path, ["pref_loss=nope"], table)
    with pytest.raises(ConfigError, match=r"pref_loss='sigmoid,nope' .*'nope': choose each of sigmoid"):  # a list
        check_config_early(path, ["pref_loss=sigmoid,nope"], table)
    check_config_early(path, ["pref_loss=sigmoid,bco_pair,sft", "loss_weights=0.8,0.2,1"], table)
    with pytest.raises(ConfigError, match=r"stage='dop' is not a stage.*Did you mean `dpo`\? \(.*c.yaml\)"):
        check_config_early(path, ["stage=dop"], table)
    with pytest.raises(DataError, match=r"dataset 'demo_prf' is not a file, not a name in"):
        check_config_early(path, ["dataset=demo_prf"], table)
    with pytest.raises(DataError, match=r"dataset 'missing.jsonl': no such file"):
        check_config_early(path, ["eval_dataset=missing.jsonl"], table)
    (tmp_path / "tokens").mkdir()  # saved tokens: the dataset keys are ignored, as the loader ignores them
    check_config_early(path, ["dataset=demo_prf", "tokenized_path=tokens"], table)


def test_the_full_parse_gives_the_same_messages(tmp_path, monkeypatch):
    from alignkit.config.parse import read_config

    monkeypatch.chdir(tmp_path)
    table = load_key_table()
    (tmp_path / "rows.jsonl").write_text('{"instruction": "hi", "output": "hello"}\n', encoding="utf-8")
    path = _config(tmp_path, "stage: dpo\ndataset: rows.jsonl\n")  # the parse then fails on the key first
    for overrides in (["learnig_rate=1e-4"], ["lora_rank=x"], ["pref_loss=nope"], ["pref_loss=ipo,nope"],
                      ["stage=dop"], ["num_generations=4"], ["num_generations=4", "lora_target=q_proj"],
                      # values the sections refuse (built without torch), and alignkit's checks of training keys
                      ["lora_rank=0"], ["cutoff_len=0"], ["val_size=-1"], ["max_new_tokens=0"], ["top_p=2"],
                      ["quantization_bit=3"], ["finetuning_type=freeze", "freeze_trainable_layers=0"],
                      ["learning_rate=-1"], ["per_device_eval_batch_size=0"], ["eval_strategy=steps", "eval_steps=-1"],
                      ["save_strategy=steps", "save_steps=0"], ["num_train_epochs=0"], ["seed=-1"],
                      ["warmup_ratio=1"], ["warmup_ratio=0.1", "warmup_steps=3"], ["adam_beta2=1"],
                      # the stages' own keys (alignkit.stages.arguments, built without torch)
                      ["pref_beta=0"], ["pref_loss=exo_pair"], ["pref_loss=sigmoid,sft", "loss_weights=1"],
                      ["sync_ref_model=true", "ref_model_mixup_alpha=2"], ["stage=kto", "pref_beta=0"],
                      ["stage=grpo", "num_generations=1"], ["stage=grpo", "reward_funcs=acuracy"],
                      ["stage=rloo", "temperature=0"], ["stage=ppo", "ppo_epochs=0"],
                      ["stage=online_dpo", "beta=0"], ["stage=distill", "reward_funcs=accuracy"],
                      # check_combinations' checks of the sections and the stage (check_section_combinations,
                      # check_generation_keys)
                      ["packing=true"], ["train_on_prompt=true"], ["stage=pt", "mask_history=true"],
                      ["pissa_init=true"], ["stage=sft", "pissa_init=true", "quantization_bit=4"],
                      ["temperature=0.7"], ["stage=grpo", "max_new_tokens=8"], ["stage=ppo", "top_p=0.9"],
                      ["stage=online_dpo", "num_beams=2"],
                      # the part of a stage's check_config its own keys and the run's mode decide (check_run)
                      ["stage=grpo"], ["stage=rloo"], ["stage=ppo"], ["stage=online_dpo"],
                      ["stage=grpo", "reward_funcs=accuracy", "do_eval=true"],
                      ["stage=grpo", "reward_funcs=accuracy", "eval_strategy=steps"],
                      ["stage=ppo", "reward_funcs=accuracy", "do_predict=true"], ["stage=ppo", "do_eval=true"],
                      ["stage=online_dpo", "reward_funcs=accuracy", "do_eval=true"], ["stage=distill", "do_eval=true"],
                      ["stage=grpo", "reward_funcs=accuracy", "per_device_train_batch_size=4"],
                      ["stage=rloo", "reward_funcs=accuracy", "per_device_train_batch_size=3"],
                      ["stage=grpo", "reward_funcs=accuracy", "per_device_train_batch_size=4",
                       "generation_batch_size=10"]):
        with pytest.raises(ConfigError) as early:
            check_config_early(path, overrides, table)
        with pytest.raises(ConfigError) as full:
            read_config(path, overrides)
        assert str(early.value) == str(full.value), overrides


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.yaml")))
def test_every_example_passes_the_early_check(example, monkeypatch):
    monkeypatch.chdir(ROOT)
    check_config_early(f"examples/{example}", [], load_key_table())


def test_values_the_parse_accepts_pass_the_early_check(tmp_path, monkeypatch):
    """The early value checks add no error of their own: settings the full parse takes pass them too (a training
    key's check reads transformers' defaults from the table; do_eval=false turns eval_strategy off first)."""
    from alignkit.config.parse import read_config

    monkeypatch.chdir(tmp_path)
    table = load_key_table()
    (tmp_path / "rows.jsonl").write_text('{"instruction": "hi", "output": "hello"}\n', encoding="utf-8")
    path = _config(tmp_path, "stage: sft\ndataset: rows.jsonl\n")
    for overrides in ([], ["eval_strategy=steps", "eval_steps=-1", "do_eval=false", "do_train=true"], ["eval_strategy=steps", "eval_steps=0"],
                      ["max_steps=5", "num_train_epochs=0"], ["warmup_ratio=0.5"], ["save_strategy=no", "save_steps=0"],
                      ["learning_rate=0"], ["finetuning_type=full"], ["stage=dpo", "pref_beta=0.5"],
                      ["temperature=0.7"], ["packing=true", "mask_history=true"], ["pissa_init=true"],
                      ["stage=grpo", "reward_funcs=accuracy"], ["stage=ppo", "reward_funcs=accuracy"],
                      ["stage=grpo", "reward_funcs=accuracy", "eval_strategy=steps", "do_eval=false", "do_train=true"],
                      ["stage=ppo", "do_train=true", "do_eval=false", "reward_funcs=format"],
                      ["stage=grpo", "reward_funcs=accuracy", "per_device_train_batch_size=4",
                       "gradient_accumulation_steps=2"]):
        read_config(path, overrides)
        check_config_early(path, overrides, table)

