"""YAML and command-line values converted to a config field's type (`int`, `float`, `bool`, `Literal`, lists,
mappings, `Optional`), with a `ConfigError` naming the key when a value does not fit.

Used by the config parser for every key, and by `alignkit eval` for its reward keys given on the command line.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import types
import typing
from typing import Any, Literal

import yaml

from ..errors import ConfigError

# `alignkit train --help-keys` folds transformers' own training keys into one group of names and this link (here,
# below the parser and the key table, since both print it).
TRANSFORMERS_TRAINING_GROUP = "training (transformers)"
TRANSFORMERS_TRAINING_DOCS = ("https://huggingface.co/docs/transformers/main_classes/trainer"
                              "#transformers.Seq2SeqTrainingArguments")


def field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved type annotation, for the fields a dataclass takes in `__init__`."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _allowed(tp: Any) -> list[Any]:
    """Flatten Optional/Union annotations into their member types."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        out: list[Any] = []
        for arg in typing.get_args(tp):
            out.extend(_allowed(arg))
        return out
    return [tp]


def convert_value(key: str, value: Any, tp: Any) -> Any:
    """Convert a YAML or command-line value to the field's type `tp`, or raise a ConfigError naming `key`.

    Example: `convert_value("lora_rank", "8", int)` is 8; `convert_value("lora_rank", "x", int)` raises
    `ConfigError("lora_rank='x' is not a valid int (invalid literal for int() with base 10: 'x').")`.
    """
    allowed = _allowed(tp)
    if value is None:
        if type(None) in allowed or Any in allowed:
            return None
        raise ConfigError(f"{key}: null is not allowed; give a value of type {_type_name(tp)}.")
    if isinstance(value, str) and type(None) in allowed:
        # `null`/`~` always mean None; `none` only where a string is not itself a valid value
        # (`report_to: none` is transformers' word for "no integrations", not a missing value).
        if value.lower() in ("null", "~") or (value.lower() == "none" and str not in allowed):
            return None
    last_error = None
    for candidate in allowed:
        if candidate is type(None):
            continue
        try:
            return _convert_one(value, candidate)
        except (TypeError, ValueError) as err:
            last_error = err
    detail = f" ({last_error})" if last_error and str(last_error) else ""
    raise ConfigError(f"{key}={value!r} is not a valid {_type_name(tp)}{detail}.")


def _convert_one(value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value
        raise ValueError(f"choose one of {', '.join(map(str, choices))}")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(value).value if not isinstance(value, tp) else value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "no", "0", "off"):
            return False
        raise ValueError("expected true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError("expected an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            return int(value)
        raise ValueError("expected an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ValueError("expected a number")
        return float(value)
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ValueError("expected a string")
        return str(value)
    if origin in (list, tuple) or tp in (list, tuple):
        if isinstance(value, str):
            items = [v.strip() for v in value.split(",") if v.strip()]
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            raise ValueError("expected a list")
        element = (typing.get_args(tp) or (Any,))[0]
        if typing.get_origin(element) is Literal:  # a list of choices: each item must be one of them
            choices = typing.get_args(element)
            for item in items:
                if item not in choices:
                    raise ValueError(f"{item!r}: choose each of {', '.join(map(str, choices))}")
        return items
    if origin is dict or tp is dict:
        if isinstance(value, dict):
            return value
        if isinstance(value, str):
            parsed = yaml.safe_load(value)
            if isinstance(parsed, dict):
                return parsed
        raise ValueError("expected a mapping")
    return value


def _type_name(tp: Any) -> str:
    names = []
    for t in _allowed(tp):
        if t is type(None):
            continue
        if typing.get_origin(t) is Literal:
            names.append("one of " + ", ".join(map(str, typing.get_args(t))))
        elif typing.get_origin(t) is list and typing.get_origin((typing.get_args(t) or (Any,))[0]) is Literal:
            names.append("a list of them")
        else:
            names.append(getattr(t, "__name__", str(t)))
    return " or ".join(names)


def key_owners(classes: list[tuple[Any, dict[str, Any]]], preferred: Any = None) -> dict[str, Any]:
    """Key -> the class (or the class's name) that receives it.

    Args:
        classes: (class, its field types) pairs: the shared sections first, then each stage's class once.
        preferred: the class of the run's stage. A key may belong to several stages' classes (GRPO and PPO share
            the reward-function keys); it goes to `preferred` when that class has it, else to the first class that
            does (so an error can name a stage it applies to).
    """
    owners: dict[str, Any] = {}
    for cls, types_ in classes:
        if cls == preferred:
            owners.update(dict.fromkeys(types_, cls))
    for cls, types_ in classes:
        for name in types_:
            owners.setdefault(name, cls)
    return owners


# LLaMA-Factory's config keys (its `hparams` model, data and finetuning arguments, read at ff6d4d1) that alignkit has no
# field for. An unknown key among them is named as LLaMA-Factory's instead of matched to the closest alignkit key
# (`use_galore` is not `use_rslora`); those with an alignkit way to the same end say it.
LLAMAFACTORY_KEYS_NOT_HERE = frozenset("""
adapter_folder add_special_tokens add_tokens apollo_layerwise apollo_proj apollo_proj_type apollo_rank apollo_scale
apollo_scale_front apollo_scale_type apollo_target apollo_update_interval asft_alpha audio_sampling_rate badam_mask_mode
badam_mode badam_start_block badam_switch_interval badam_switch_mode badam_update_ratio badam_verbose block_diag_attn
buffer_size compute_accuracy compute_dtype create_new_adapter crop_to_patches data_shared_file_system
device_map disable_shuffling eaft_alpha early_stopping_steps eval_num_beams eval_on_each_dataset export_device
export_dir export_hub_model_id export_legacy_format export_quantization_bit export_quantization_dataset
export_quantization_maxlen export_quantization_nsamples export_size freeze_extra_modules freeze_trainable_modules
galore_layerwise galore_proj_type galore_rank galore_scale galore_target galore_update_interval hf_hub_token
hyper_parallel_args hyper_parallel_cp_size ignore_pad_token_for_loss image_do_pan_and_scan
include_effective_tokens_per_second infer_backend init_special_tokens interleave_probs kt_cpu_activation
kt_expert_checkpoint_path kt_lora_expert_intermediate_size kt_lora_expert_num kt_non_expert_weight_path
kt_use_lora_experts kt_weight_path ld_alpha media_dir megatron_bridge_args mix_strategy mixture_of_depths module_dropout
moe_aux_loss_coef ms_hub_token new_special_tokens_config offload_folder oft_block_size oft_rank oft_target om_hub_token
pref_bco_weight preprocessing_batch_size preserve_thinking print_param_status ref_model ref_model_adapters
ref_model_quantization_bit resize_vocab reward_model_adapters reward_model_quantization_bit sglang_config
sglang_lora_backend sglang_maxlen sglang_mem_fraction sglang_tp_size split_special_tokens swanlab_api_key
swanlab_lark_secret swanlab_lark_webhook_url swanlab_logdir swanlab_mode swanlab_project swanlab_run_name
swanlab_workspace tool_format train_from_scratch upcast_lmhead_output use_adam_mini use_apollo use_asft_loss
use_audio_in_video use_badam use_dft_loss use_eaft_loss use_fast_tokenizer use_galore use_hyper_parallel use_kt
use_kv_cache use_llama_pro use_mca use_megatron_bridge use_muon use_reentrant_gc use_swanlab use_unsloth_gc video_fps
video_max_pixels video_maxlen video_min_pixels vllm_config vllm_enforce_eager vllm_gpu_util vllm_max_lora_rank
vllm_maxlen
""".split())
LLAMAFACTORY_EQUIVALENTS = {
    "disable_shuffling": "train_sampling_strategy: sequential (transformers' key) trains in dataset order; "
                         "grpo, rloo and distill take shuffle_dataset: false",
    "compute_accuracy": "sft's evaluation reports a token accuracy without it",
    "use_reentrant_gc": "gradient_checkpointing_kwargs: {use_reentrant: true} or false (transformers' key)",
    "export_dir": "`alignkit export` merges and exports a trained adapter (docs/commands.md)",
}


# TRL's names for settings the offline stages take under LLaMA-Factory's names (stage -> TRL key -> alignkit's key):
# such a key is answered with the key to use, where it would otherwise be unknown or another stage's (`beta` is
# GRPO's key; TRL's DPOTrainer reads it as DPO's beta).
_TRL_DATA_KEYS = {"max_length": "`cutoff_len` (prompt and reply together)",
                  "dataset_num_proc": "`preprocessing_num_workers`"}
TRL_EQUIVALENTS: dict[str, dict[str, str]] = {
    "sft": {**_TRL_DATA_KEYS,
            "completion_only_loss": "`train_on_prompt`, its opposite (replies alone train by default)"},
    "pt": dict(_TRL_DATA_KEYS),
    "rm": dict(_TRL_DATA_KEYS),
    "dpo": {**_TRL_DATA_KEYS, "beta": "`pref_beta`",
            "loss_type": "`pref_loss` (TRL's loss types under their names, one or a list weighted by `loss_weights`)",
            "label_smoothing": "`dpo_label_smoothing`"},
    "kto": {**_TRL_DATA_KEYS, "beta": "`pref_beta`", "desirable_weight": "`kto_chosen_weight`",
            "undesirable_weight": "`kto_rejected_weight`"},
}


def _unknown_key_hint(key: str, known: list[str]) -> str:
    """What an unknown key's error adds: LLaMA-Factory's key named as such, else the closest known key."""
    if key in LLAMAFACTORY_KEYS_NOT_HERE:
        instead = LLAMAFACTORY_EQUIVALENTS.get(key)
        what = f"; alignkit's way: {instead}" if instead else ", for a feature alignkit does not have"
        return (f" It is LLaMA-Factory's{what}. Remove it (docs/compatibility.md lists the LLaMA-Factory keys "
                "alignkit takes).")
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f" Did you mean `{close[0]}`?" if close else " See `alignkit train --help-keys` for every key."


def assign_keys(merged: dict[str, Any], owners: dict[str, Any], types_of: dict[Any, dict[str, Any]],
                from_command_line: dict[str, str], where: str, stage: str) -> dict[Any, dict[str, Any]]:
    """Each key's value converted to its owner's field type, grouped by owner.

    Args:
        merged: the config's keys, YAML and overrides merged.
        owners: key -> owner (`key_owners`).
        types_of: owner -> {key: field type}.
        from_command_line: key -> the override that set it, to name it in an error.
        where: `" in FILE"` or "".
        stage: the run's stage (its TRL names are answered with alignkit's keys, `TRL_EQUIVALENTS`).

    Raises:
        ConfigError: an unknown key (with the closest known one) or a value that does not fit its field.
    """
    per_class: dict[Any, dict[str, Any]] = {cls: {} for cls in set(owners.values())}
    trl_names = TRL_EQUIVALENTS.get(stage, {})
    for key, value in merged.items():
        if key in trl_names:
            origin = f" on the command line ({from_command_line[key]})" if key in from_command_line else where
            raise ConfigError(f"`{key}`{origin} is TRL's name; stage {stage} takes this setting "
                              f"as {trl_names[key]}. Rename it.")
        if key not in owners:
            hint = _unknown_key_hint(key, list(owners))
            origin = f" on the command line ({from_command_line[key]})" if key in from_command_line else where
            raise ConfigError(f"unknown key `{key}`{origin}.{hint}")
        cls = owners[key]
        if key == "bf16" and isinstance(value, str) and value.strip().lower() == "auto":
            per_class[cls][key] = "auto"  # settled by `parse.settle_auto_bf16` (and, on a CPU, a probe)
            continue
        per_class[cls][key] = convert_value(key, value, types_of[cls][key])
    return per_class


def check_stage_name(stage: str, names: list[str]) -> None:
    """Raise a ConfigError unless `stage` is one of `names` (the registered stages), suggesting the closest one."""
    if stage not in names:
        close = difflib.get_close_matches(stage, names, n=1, cutoff=0.5)
        hint = f" Did you mean `{close[0]}`?" if close else ""
        raise ConfigError(f"stage={stage!r} is not a stage; choose one of {', '.join(names)}.{hint}")


def other_stage_keys_error(keys: list[str], other_stage: str, stage: str, where: str) -> ConfigError:
    """The error for keys of another stage's dataclass (`num_generations` in an sft config), the parse's and the
    early check's alike."""
    verb, pronoun = ("applies", "it") if len(keys) == 1 else ("apply", "them")
    return ConfigError(f"{', '.join(keys)} {verb} to stage {other_stage}, not {stage}{where}; remove {pronoun} (or set "
                       f"stage: {other_stage}).")


def merge_overrides(values: dict[str, Any] | None, overrides: list[str] | None) -> tuple[dict[str, Any], dict[str, str]]:
    """A config mapping with `key=value` overrides applied (overrides win), and key -> the override that set it."""
    merged: dict[str, Any] = dict(values or {})
    from_command_line: dict[str, str] = {}
    for item in overrides or []:
        key, value = parse_override(item)
        merged[key] = value
        from_command_line[key] = item
    return merged, from_command_line


def parse_override(text: str) -> tuple[str, Any]:
    """Split one `key=value` command-line override; the value stays a string unless it is YAML-structured."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value (e.g. learning_rate=1e-4).")
    key, value = text.split("=", 1)
    key = key.strip().lstrip("-").replace("-", "_")
    if not key:
        raise ConfigError(f"override {text!r} has no key before '='.")
    stripped = value.strip()
    if stripped.startswith(("{", "[")):
        try:
            return key, yaml.safe_load(stripped)
        except yaml.YAMLError as err:
            raise ConfigError(f"{key}: cannot parse {value!r}: {err}") from None
    return key, value


__all__ = ["TRANSFORMERS_TRAINING_DOCS", "TRANSFORMERS_TRAINING_GROUP", "assign_keys", "check_stage_name", "convert_value",
           "field_types", "key_owners", "merge_overrides", "other_stage_keys_error", "parse_override"]
