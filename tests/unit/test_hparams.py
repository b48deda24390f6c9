"""Config parsing: YAML + overrides, type conversion, errors that name the key and the fix."""

import pytest

from alignkit.hparams import ConfigError, load_yaml, parse_config, parse_override, read_config


def test_overrides_win_over_yaml_and_strings_are_converted():
    config = parse_config(
        {"stage": "dpo", "learning_rate": "1e-4", "lora_rank": 16, "dataset": "demo_pref", "do_train": True},
        ["learning_rate=5e-5", "per_device_train_batch_size=4", "bf16=false", "pref_beta=0.2"],
    )
    assert config.finetuning.stage == "dpo"
    assert config.training.learning_rate == pytest.approx(5e-5)
    assert config.training.per_device_train_batch_size == 4
    assert config.training.bf16 is False
    assert config.method.pref_beta == pytest.approx(0.2)
    assert config.finetuning.lora_alpha == 32  # default: 2 * lora_rank


def test_yaml_float_written_without_dot_is_accepted(tmp_path):
    # PyYAML reads `1e-4` as a string; users write it that way all the time.
    path = tmp_path / "c.yaml"
    path.write_text("stage: sft\nlearning_rate: 1e-4\nnum_train_epochs: 2\n")
    config = read_config(path)
    assert config.training.learning_rate == pytest.approx(1e-4)
    assert config.training.num_train_epochs == 2.0
    assert config.source == str(path)


def test_unknown_key_names_the_closest_valid_key():
    with pytest.raises(ConfigError, match="`learnig_rate`.*`learning_rate`"):
        parse_config({}, ["learnig_rate=1e-4"])


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lora_rnak: 8\n")
    with pytest.raises(ConfigError, match=r"lora_rnak.*c\.yaml.*lora_rank"):
        read_config(path)


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("lora_rank=abc", "lora_rank='abc' is not a valid int"),
        ("stage=foo", "stage='foo'.*one of pt, sft, rm, dpo\\."),
        ("do_train=maybe", "do_train='maybe'.*bool"),
        ("pref_loss=kto", "pref_loss"),
        ("noequals", "key=value"),
    ],
)
def test_bad_values_are_errors(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        parse_config({}, [override])


@pytest.mark.parametrize(
    "values, pattern",
    [
        ({"do_train": True}, "needs `dataset`"),
        ({"stage": "dpo", "packing": True}, "packing=true applies to stage sft"),
        ({"stage": "rm", "predict_with_generate": True}, "predict_with_generate applies to stage sft"),
        ({"stage": "sft", "precompute_ref_log_probs": True}, "precompute_ref_log_probs applies to stage dpo"),
        ({"stage": "dpo", "pref_loss": "simpo", "precompute_ref_log_probs": True}, "no reference model"),
        ({"stage": "dpo", "pref_loss": "ipo", "dpo_label_smoothing": 0.1}, "dpo_label_smoothing only applies"),
        ({"val_size": -0.1}, "val_size"),
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"fp16": True, "bf16": True}, "choose one"),
    ],
)
def test_invalid_combinations_say_how_to_fix(values, pattern):
    with pytest.raises(ConfigError, match=pattern):
        parse_config(values)


def test_training_defaults_suit_the_toolkit():
    config = parse_config({})
    assert config.training.logging_steps == 1
    assert config.training.remove_unused_columns is False
    assert config.training.include_num_input_tokens_seen == "non_padding"
    assert config.training.overwrite_output_dir is False
    assert config.model.model_name_or_path is None  # bundled default
    assert config.finetuning.finetuning_type == "lora"


def test_structured_override_and_null():
    key, value = parse_override("lr_scheduler_kwargs={min_lr: 0.0}")
    assert key == "lr_scheduler_kwargs" and value == {"min_lr": 0.0}
    config = parse_config({"max_samples": 10}, ["max_samples=null"])
    assert config.data.max_samples is None


def test_load_yaml_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="bad.yaml.*mapping"):
        load_yaml(bad)


def test_report_to_none_stays_the_string_transformers_expects():
    config = parse_config({"report_to": "none"}, ["report_to=none"])
    assert config.training.report_to == []  # transformers turns the string "none" into no integrations
    config = parse_config({"max_samples": "None"})
    assert config.data.max_samples is None
