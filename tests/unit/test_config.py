"""Config parsing: YAML + overrides, type conversion, errors that name the key and the fix."""

import re

import pytest

from alignkit.config.parse import load_yaml, parse_config, parse_override, read_config
from alignkit.errors import ConfigError


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
    path.write_text("stage: sft\ndataset: demo_sft\nlearning_rate: 1e-4\nnum_train_epochs: 2\n")
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
        ("stage=foo", "stage='foo' is not a stage; choose one of "),
        ("do_train=maybe", "do_train='maybe'.*bool"),
        ("pref_loss=kto", "pref_loss"),
        ("noequals", "key=value"),
        ("use_galore=true", "unknown key `use_galore`.*LLaMA-Factory's, for a feature alignkit does not have"),
        ("disable_shuffling=true", "LLaMA-Factory's; alignkit's way: train_sampling_strategy: sequential"),
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
        ({"stage": "dpo", "neat_packing": True}, "packing=true applies to stage sft"),
        ({"stage": "rm", "predict_with_generate": True}, "predict_with_generate applies to stage sft"),
        ({"stage": "dpo", "train_on_prompt": True}, "train_on_prompt=true chooses .* stage dpo trains on replies only"),
        ({"stage": "grpo", "mask_history": True}, "mask_history=true chooses .* stage grpo trains on replies only"),
        ({"stage": "pt", "train_on_prompt": True}, "stage pt trains on every token of its text"),
        ({"stage": "grpo", "max_new_tokens": 8}, "max_new_tokens=8: stage grpo does not read .*max_completion_length"),
        ({"stage": "online_dpo", "num_beams": 2}, "num_beams=2: stage online_dpo does not read .*always samples"),
        ({"stage": "ppo", "top_p": 0.9}, "top_p=0.9: stage ppo does not read .*temperature 1 without top-k"),
        ({"stage": "dpo", "temperature": 0.7}, "temperature=0.7: stage dpo does not read .*generates nothing"),
        ({"stage": "grpo", "vllm_mode": "server"}, "vllm_mode=server: alignkit runs vLLM inside the training process"),
        ({"stage": "distill", "vllm_mode": "server"}, "vllm_mode=server: alignkit runs vLLM"),
        ({"stage": "sft", "precompute_ref_log_probs": True}, "precompute_ref_log_probs applies to stage dpo"),
        ({"stage": "dpo", "pref_loss": "simpo", "precompute_ref_log_probs": True}, "no reference model"),
        ({"stage": "dpo", "pref_loss": "ipo", "dpo_label_smoothing": 0.1}, "dpo_label_smoothing only applies"),
        ({"stage": "dpo", "pref_loss": "sft", "precompute_ref_log_probs": True}, "no reference model"),
        ({"stage": "dpo", "pref_loss": "sigmoid,sft", "loss_weights": [1.0]},
         r"loss_weights has 1 entries for 2 losses \(pref_loss=sigmoid,sft\)"),
        ({"stage": "dpo", "pref_loss": ["sigmoid", "sigmoid"]}, "names a loss twice"),
        ({"stage": "dpo", "loss_weights": [-1.0]}, "must be finite and >= 0"),
        ({"stage": "dpo", "pref_loss": "exo_pair"}, "exo_pair needs dpo_label_smoothing > 0"),
        ({"stage": "dpo", "pref_loss": "apo_zero", "f_divergence_type": "js_divergence"},
         "f_divergence_type=js_divergence is defined for .* not apo_zero"),
        ({"stage": "dpo", "pref_loss": "discopop", "discopop_tau": 0}, "discopop_tau=0.* must be > 0"),
        ({"stage": "dpo", "label_smoothing_factor": 0.1}, "stage dpo has no such loss.*dpo_label_smoothing"),
        ({"stage": "kto", "label_smoothing_factor": 0.1}, "stage kto has no such loss. Remove it"),
        ({"generation_num_beams": 4}, r"generation_num_beams=4: .*set num_beams \(the same beam width\) instead"),
        ({"generation_max_length": 64}, r"generation_max_length=64: .*set max_new_tokens \(new tokens per prompt"),
        ({"stage": "sft", "label_smoothing_factor": 1.0}, r"label_smoothing_factor=1.0 must be in \[0, 1\)"),
        ({"val_size": -0.1}, "val_size"),
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"fp16": True, "bf16": True}, "choose one"),
    ],
)
def test_invalid_combinations_say_how_to_fix(values, pattern):
    with pytest.raises(ConfigError, match=pattern):
        parse_config(values)


def test_neat_packing_is_llamafactorys_name_for_packing():
    """LLaMA-Factory's `neat_packing: true` (packing without cross-attention) is alignkit's `packing: true`."""
    assert parse_config({"neat_packing": True}).data.packing is True
    assert parse_config({}).data.packing is False


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


# ---------------------------------------------------------------------------------------------- issue 10 item 7-8
@pytest.mark.parametrize("override, key", [
    ("learning_rate=-1", "learning_rate"),
    ("learning_rate=nan", "learning_rate"),
    ("per_device_train_batch_size=0", "per_device_train_batch_size"),
    ("per_device_eval_batch_size=-2", "per_device_eval_batch_size"),
    ("gradient_accumulation_steps=0", "gradient_accumulation_steps"),
    ("max_steps=-5", "max_steps"),
    ("num_train_epochs=0", "num_train_epochs"),
    ("num_train_epochs=-1", "num_train_epochs"),
    ("save_steps=0", "save_steps"),
    ("logging_steps=-1", "logging_steps"),
    ("weight_decay=-0.1", "weight_decay"),
    ("adam_beta1=1", "adam_beta1"),
    ("dataloader_num_workers=-1", "dataloader_num_workers"),
    ("seed=-1", "seed"),
    ("max_samples=0", "max_samples"),
    ("lora_dropout=1", "lora_dropout"),
    ("lora_alpha=0", "lora_alpha"),
    ("pref_beta=0", "pref_beta"),
    ("num_beams=0", "num_beams"),
    ("top_p=0", "top_p"),
])
def test_out_of_range_numbers_are_config_errors_naming_the_key(override, key):
    stage = "dpo" if key.startswith("pref_") else "sft"  # a stage's own keys are checked for that stage
    with pytest.raises(ConfigError, match=rf"^{key}="):
        parse_config({"stage": stage, "dataset": "demo_sft", "do_train": True}, [override])


def test_positive_steps_override_a_zero_epoch_count():
    config = parse_config({"dataset": "demo_sft", "do_train": True}, ["max_steps=3", "num_train_epochs=0"])
    assert config.training.max_steps == 3


def test_fp16_is_refused_on_a_cpu_and_accepted_with_a_gpu(monkeypatch):
    import alignkit.config.parse as parse

    monkeypatch.setattr(parse, "_has_accelerator", lambda: False)
    with pytest.raises(ConfigError, match="fp16=true needs a GPU.*fp32"):
        parse_config({"dataset": "demo_sft", "do_train": True, "fp16": True})
    monkeypatch.setattr(parse, "_has_accelerator", lambda: True)
    with pytest.raises(ConfigError, match="fp16=true needs a GPU"):  # use_cpu forces the CPU on a GPU machine
        parse_config({"dataset": "demo_sft", "do_train": True, "fp16": True, "use_cpu": True})


def test_config_silent_on_do_keys_trains_and_explicit_keys_are_kept(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("stage: sft\ndataset: demo_sft\n")
    assert read_config(path).training.do_train is True
    assert read_config(path, ["do_predict=true"]).training.do_train is False  # an override counts as saying
    path.write_text("stage: sft\ndataset: demo_sft\ndo_eval: true\n")
    config = read_config(path)
    assert (config.training.do_train, config.training.do_eval) == (False, True)


def test_config_switching_every_do_key_off_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("stage: sft\ndataset: demo_sft\ndo_train: false\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: do_train, do_eval and do_predict are all false"):
        read_config(path)


def test_config_file_that_is_not_utf8_names_the_byte(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"stage: sft\ndataset: caf\xe9\n")
    # "stage: sft\n" is 11 bytes and "dataset: caf" 12, so the Latin-1 é is byte 23.
    with pytest.raises(ConfigError, match=r"c\.yaml: byte 23 \(0xe9\) is not UTF-8"):
        read_config(path)


def test_stage_error_and_help_list_exactly_the_registered_stages(monkeypatch):
    """Derived from the registry: a stage registered later appears in both, none that is not registered."""
    from alignkit.config.parse import all_keys
    from alignkit.stages import STAGES, Stage

    with pytest.raises(ConfigError) as err:
        parse_config({}, ["stage=foo"])
    assert err.value.args[0].startswith(f"stage='foo' is not a stage; choose one of {', '.join(STAGES)}.")
    monkeypatch.setitem(STAGES, "newstage", Stage("newstage", "supervised", lambda config, callbacks: None))
    with pytest.raises(ConfigError, match=r"choose one of pt, sft, rm, dpo.*, newstage\."):
        parse_config({}, ["stage=foo"])
    assert all_keys()["finetuning"]["stage"] == f"Training stage, one of {', '.join(STAGES)}."


def test_warmup_ratio_becomes_warmup_steps_said_once(caplog):
    """transformers 5 has no warmup_ratio: a warmup_steps below 1 is the share of the training steps."""
    with caplog.at_level("INFO", logger="alignkit.config.parse"):
        config = parse_config({"warmup_ratio": 0.1})
    assert config.training.warmup_steps == 0.1
    assert config.training.get_warmup_steps(50) == 5  # ceil(50 * 0.1): what the scheduler gets
    said = [r.getMessage() for r in caplog.records if "warmup_ratio" in r.getMessage()]
    assert said == ["warmup_ratio=0.1 is read as warmup_steps=0.1 (transformers 5 takes a warmup_steps below 1 "
                    "as a share of the training steps)."]
    # `warmup_ratio: null` (a template's placeholder) is not a second warm-up key.
    assert parse_config({"warmup_ratio": None, "warmup_steps": 3}).training.warmup_steps == 3


@pytest.mark.parametrize("values, pattern", [
    ({"warmup_ratio": 0.1, "warmup_steps": 0}, "warmup_ratio and warmup_steps are both given; keep one"),
    ({"warmup_ratio": 0.1, "warmup_steps": 10}, "warmup_ratio and warmup_steps are both given; keep one"),
    ({"warmup_ratio": 1.0}, r"warmup_ratio=1.0 must be in \[0, 1\)"),
    ({"warmup_ratio": -0.1}, r"warmup_ratio=-0.1 must be in \[0, 1\)"),
])
def test_warmup_ratio_conflicts_and_range_are_errors(values, pattern):
    with pytest.raises(ConfigError, match=pattern):
        parse_config(values)


def _stub_hardware(monkeypatch, *, accelerator: bool, accelerator_bf16: bool, cpu_bf16: bool) -> None:
    import alignkit.config.parse as parse

    monkeypatch.setattr(parse, "_has_accelerator", lambda: accelerator)
    monkeypatch.setattr(parse, "_accelerator_has_bf16", lambda: accelerator_bf16)
    monkeypatch.setattr(parse, "_cpu_has_bf16", lambda: cpu_bf16)


@pytest.mark.parametrize("hardware, given, expected, warns", [
    # CPU without bf16 hardware: fp32, one warning.
    (dict(accelerator=False, accelerator_bf16=False, cpu_bf16=False), {"bf16": True}, {"bf16": False}, True),
    (dict(accelerator=False, accelerator_bf16=False, cpu_bf16=False), {"bf16": True, "bf16_full_eval": True},
     {"bf16": False, "bf16_full_eval": False}, True),
    # CPU with AVX512-BF16 / AMX: bf16 kept, on the CPU (transformers needs use_cpu for bf16 without a GPU).
    (dict(accelerator=False, accelerator_bf16=False, cpu_bf16=True), {"bf16": True}, {"bf16": True, "use_cpu": True},
     False),
    # A bf16 GPU: as asked.
    (dict(accelerator=True, accelerator_bf16=True, cpu_bf16=False), {"bf16": True}, {"bf16": True}, False),
    # use_cpu on a GPU machine: the CPU decides.
    (dict(accelerator=True, accelerator_bf16=True, cpu_bf16=False), {"bf16": True, "use_cpu": True},
     {"bf16": False, "use_cpu": True}, True),
    # A GPU without bf16: untouched, transformers' own error names the GPU it needs.
    (dict(accelerator=True, accelerator_bf16=False, cpu_bf16=True), {"bf16": True}, {"bf16": True}, False),
    # Nothing asked: nothing changes, nothing said.
    (dict(accelerator=False, accelerator_bf16=False, cpu_bf16=False), {"bf16": False}, {"bf16": False}, False),
])
def test_bf16_is_honoured_where_the_hardware_has_it(monkeypatch, caplog, hardware, given, expected, warns):
    from alignkit.config.parse import choose_precision

    _stub_hardware(monkeypatch, **hardware)
    kwargs = dict(given)
    with caplog.at_level("INFO", logger="alignkit.config.parse"):
        choose_precision(kwargs)
    assert kwargs == expected
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    asked = " and ".join(key for key in ("bf16", "bf16_full_eval") if given.get(key))
    assert warnings == ([f"{asked}=true: this CPU has no bf16 hardware (AVX512-BF16 or AMX) and runs bf16 about 3x "
                         "slower than fp32, so this run trains in fp32. Remove the key to silence this; on a GPU or "
                         "a CPU with bf16 hardware it is used as asked."] if warns else [])


@pytest.mark.parametrize("cpu_bf16", [False, True])
def test_bf16_config_on_a_cpu_parses_either_way(monkeypatch, caplog, cpu_bf16):
    """The whole parse, with the capability check stubbed each way (transformers refuses bf16 on a CPU
    unless use_cpu is set, so both outcomes must get past its check)."""
    _stub_hardware(monkeypatch, accelerator=False, accelerator_bf16=False, cpu_bf16=cpu_bf16)
    with caplog.at_level("WARNING", logger="alignkit.config.parse"):
        training = parse_config({"dataset": "demo_sft", "do_train": True, "bf16": True}).training
    assert (training.bf16, training.use_cpu) == ((True, True) if cpu_bf16 else (False, False))
    assert len([r for r in caplog.records if "bf16" in r.getMessage()]) == (0 if cpu_bf16 else 1)


def test_fp16_stays_refused_on_a_cpu_with_bf16_hardware(monkeypatch):
    _stub_hardware(monkeypatch, accelerator=False, accelerator_bf16=False, cpu_bf16=True)
    with pytest.raises(ConfigError, match="fp16=true needs a GPU.*bf16=true where the CPU has bf16 hardware"):
        parse_config({"dataset": "demo_sft", "do_train": True, "fp16": True})


def test_deepspeed_without_the_package_is_a_config_error_naming_the_extra(monkeypatch, tmp_path):
    """Simulated missing package (as importlib.metadata, which transformers checks, reports it): the error
    comes at parse time, before transformers raises its PackageNotFoundError."""
    import importlib.metadata

    real_version = importlib.metadata.version

    def version(name):
        if name == "deepspeed":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    ds_config = tmp_path / "ds_z3_config.json"
    ds_config.write_text('{"zero_optimization": {"stage": 3}}')
    path = tmp_path / "c.yaml"
    path.write_text(f"stage: sft\ndataset: demo_sft\ndeepspeed: {ds_config}\n")
    with pytest.raises(ConfigError, match=r"deepspeed='.*ds_z3_config.json' needs DeepSpeed, which is not "
                                          r"installed: pip install 'alignkit\[deepspeed\]'.*c\.yaml"):
        read_config(path)


def test_deepspeed_config_file_must_exist(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.19.8")  # DeepSpeed "installed"
    with pytest.raises(ConfigError, match="deepspeed='missing.json': no such file"):
        parse_config({"deepspeed": "missing.json"})


def test_do_eval_false_turns_in_loop_evaluation_off(caplog):
    """transformers turns do_eval back on for any eval_strategy but `no`; an explicit do_eval: false wins."""
    with caplog.at_level("INFO", logger="alignkit.config.parse"):
        config = parse_config({"do_eval": False, "eval_strategy": "steps", "eval_steps": 5})
    assert (config.training.do_eval, config.training.eval_strategy) == (False, "no")
    assert any("do_eval=false: no evaluation during training either" in r.getMessage() for r in caplog.records)
    # Silent on do_eval (LLaMA-Factory's examples): eval_strategy decides, as in transformers.
    config = parse_config({"eval_strategy": "steps", "eval_steps": 5, "val_size": 0.1})
    assert (config.training.do_eval, config.training.eval_strategy) == (True, "steps")


def test_llamafactory_keys_named_as_such_are_not_alignkit_keys():
    """The LLaMA-Factory keys an error names as having no alignkit field have none (a key alignkit gains must leave
    the list), and each alternative an error offers names an alignkit key."""
    from alignkit.config.parse import all_keys
    from alignkit.config.values import LLAMAFACTORY_EQUIVALENTS, LLAMAFACTORY_KEYS_NOT_HERE

    keys = {key for group in all_keys().values() for key in group}
    assert "learning_rate" in keys and "lora_rank" in keys
    assert not LLAMAFACTORY_KEYS_NOT_HERE & keys
    assert set(LLAMAFACTORY_EQUIVALENTS) <= LLAMAFACTORY_KEYS_NOT_HERE
    assert {"train_sampling_strategy", "gradient_checkpointing_kwargs"} <= keys
    assert parse_config({"train_sampling_strategy": "sequential"}).training.train_sampling_strategy == "sequential"


def test_generation_keys_a_stage_reads_or_that_state_its_sampling_pass():
    """GRPO's own `temperature` takes the key; PPO reads `max_new_tokens`; LLaMA-Factory's PPO example's `top_k: 0`
    states PPO's sampling; sft reads every generation key."""
    assert parse_config({"stage": "grpo", "temperature": 0.7, "reward_funcs": "accuracy"}).method.temperature == 0.7
    assert parse_config({"stage": "ppo", "max_new_tokens": 8, "top_k": 0, "do_sample": True}).generating.top_k == 0
    assert parse_config({"stage": "sft", "num_beams": 2, "top_p": 0.5}).generating.num_beams == 2


@pytest.mark.parametrize("stage, key, value, ours", [
    ("dpo", "beta", 0.2, "`pref_beta`"), ("dpo", "loss_type", "sigmoid", "`pref_loss`"),
    ("dpo", "label_smoothing", 0.1, "`dpo_label_smoothing`"), ("kto", "beta", 0.2, "`pref_beta`"),
    ("kto", "desirable_weight", 2.0, "`kto_chosen_weight`"),
    ("kto", "undesirable_weight", 2.0, "`kto_rejected_weight`"),
    ("sft", "max_length", 512, "`cutoff_len`"), ("rm", "dataset_num_proc", 4, "`preprocessing_num_workers`"),
    ("sft", "completion_only_loss", False, "`train_on_prompt`, its opposite"),
])
def test_trl_names_of_the_offline_stages_keys_name_alignkits(stage, key, value, ours, tmp_path):
    """A TRL config's `beta` for dpo was refused as GRPO's key ("set stage: grpo") and its `loss_type` checked
    against KTO's values; each TRL name with an alignkit key for the stage now says which key to use."""
    expected = f"`{key}` is TRL's name; stage {stage} takes this setting as {re.escape(ours)}"
    with pytest.raises(ConfigError, match=expected):
        parse_config({"stage": stage, key: value})
    # The fast path of `alignkit train` (the key table, before torch is imported) answers the same.
    from alignkit.config.keytable import check_config_early, load_key_table

    path = tmp_path / "c.yaml"
    path.write_text(f"stage: {stage}\n")
    with pytest.raises(ConfigError, match=f"`{key}` on the command line .* is TRL's name"):
        check_config_early(str(path), [f"{key}={value}"], load_key_table())


def test_trl_names_a_stage_has_itself_pass():
    grpo = parse_config({"stage": "grpo", "beta": 0.1, "loss_type": "grpo", "reward_funcs": "accuracy"})
    assert grpo.method.beta == 0.1
    assert parse_config({"stage": "kto", "loss_type": "apo_zero_unpaired"}).method.loss_type == "apo_zero_unpaired"


def test_pref_loss_takes_one_loss_or_several():
    """TRL's `loss_type` list (MPO) as a YAML list or comma-separated, each name checked, with `loss_weights`."""
    one = parse_config({"stage": "dpo", "pref_loss": "bco_pair"}).method
    assert (one.pref_loss, one.loss_types, one.needs_reference) == ("bco_pair", ("bco_pair",), True)
    listed = parse_config({"stage": "dpo", "pref_loss": ["sigmoid", "bco_pair", "sft"],
                           "loss_weights": [0.8, 0.2, 1]}).method
    assert listed.loss_types == ("sigmoid", "bco_pair", "sft") and listed.loss_weights == [0.8, 0.2, 1.0]
    assert parse_config({"stage": "dpo"}, ["pref_loss=orpo,sft"]).method.loss_types == ("orpo", "sft")
    assert parse_config({"stage": "dpo", "pref_loss": "orpo,sft"}).method.needs_reference is False
    with pytest.raises(ConfigError, match=r"pref_loss='sigmoid,nope' is not a valid one of sigmoid.* or a list of "
                                          r"them \('nope': choose each of sigmoid"):
        parse_config({"stage": "dpo", "pref_loss": "sigmoid,nope"})
