"""The config parser: YAML and `key=value` overrides to a checked `Config` (above the stage registry).

`alignkit train CONFIG.yaml key=value ...` merges the YAML mapping with the overrides (overrides win), hands
each key to the dataclass that owns it, converts strings to the field's type (`alignkit.config.values`), and
builds the dataclasses. The shared sections are the schema (`alignkit.config.schema`); each stage's own keys
are a dataclass in its stage module (`alignkit.stages.dpo.DPOArguments`, ...), found through the stage
registry (`alignkit.stages.STAGES`), and arrive as `Config.method`. Anything wrong (an unknown key, a value of
the wrong type, an invalid combination) raises `ConfigError` with a message that names the key and says how
to fix it, before any model is loaded: each dataclass checks its own fields in `__post_init__`, this module
whether `stage` is a stage and the settings that involve several sections (`check_combinations`), and the
stage's `check` what only that stage forbids.

This module imports the stage registry, so nothing the stages import may import it (the import-graph test,
`tests/unit/test_import_graph.py`, holds every module to that).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Optional

from ..env import launched_processes
from ..errors import ConfigError
from ..files import load_yaml
from ..stages import STAGES
from ..trackers import check_report_to
from .schema import (
    ARG_CLASSES,
    STAGE_NAMES,
    TRAINING_DEFAULTS,
    Config,
    DataArguments,
    FinetuningArguments,
    GeneratingArguments,
    ModelArguments,
    TrainingArguments,
)
from .sections import check_generation_keys, check_section_combinations, check_warmup_keys
from .values import (
    TRANSFORMERS_TRAINING_DOCS,
    TRANSFORMERS_TRAINING_GROUP,
    assign_keys,
    check_stage_name,
    field_types,
    key_owners,
    merge_overrides,
    other_stage_keys_error,
    parse_override,
)

logger = logging.getLogger(__name__)


def stage_names() -> str:
    """The registered stages (`alignkit.stages.STAGES`), comma-separated, for messages and help text."""
    return ", ".join(STAGES)


def check_stage(stage: str) -> None:
    """Raise a ConfigError unless `stage` names a registered stage, suggesting the closest one."""
    check_stage_name(stage, list(STAGES))


def _check_deepspeed_processes(training: TrainingArguments, where: str) -> None:
    """Refuse a DeepSpeed run whose processes accelerate did not join into one DeepSpeed world.

    accelerate (1.15) gives DeepSpeed a process-group backend only on GPU-like devices: on a CPU-only machine
    each of N launched processes ends up with a world of 1, and DeepSpeed then fails deep inside its batch-size
    check while the model loads. (The test suite lifts that gate to run DeepSpeed on the CPU with gloo; see
    tests/distributed/cpu_gates.) One process: nothing to check.
    """
    launched = launched_processes()
    if not training.deepspeed or launched == 1 or training.world_size == launched:
        return
    raise ConfigError(f"deepspeed{where}: {launched} processes were launched, but accelerate set DeepSpeed up for "
                      f"{training.world_size}. On a machine without GPUs accelerate (1.15) does not start "
                      "DeepSpeed's process group; run DeepSpeed on GPUs, or remove the `deepspeed` key to train "
                      "data parallel on the CPU (torchrun with the gloo backend).")



def _asks_for_fsdp(train_kwargs: dict[str, Any]) -> bool:
    """Whether the `fsdp` key asks for FSDP (`true`, or transformers' strings such as `full_shard auto_wrap`)."""
    value = train_kwargs.get("fsdp")
    if isinstance(value, str):
        return value.strip().lower() not in ("", "false", "no", "none")
    return bool(value)



def _has_accelerator() -> bool:
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def _env_flag(name: str) -> bool:
    """Whether accelerate's environment variable `name` is set true (`accelerate launch` writes "true")."""
    return os.environ.get(name, "").lower() in ("1", "true")


def _accelerate_runs_fsdp_here() -> bool:
    """Whether accelerate turns an FSDP request into FSDP on this machine.

    accelerate 1.15 does so on GPU-like devices only (`AcceleratorState.__init__`: the multi-process CPU type
    `MULTI_CPU` is not among the types that become `DistributedType.FSDP`), although torch's FSDP2 trains on a
    CPU with gloo. The distributed tests lift that gate in their worker processes
    (`tests/distributed/cpu_gates/sitecustomize.py`) and mark accelerate's `AcceleratorState.fsdp_on_cpu`;
    this reads the mark rather than assuming the device decides, so that those runs are not refused while a
    user's CPU run (which would silently be DDP) still is. Read from the class, not from a state, because
    accelerate's state does not exist yet when the config is parsed.
    """
    if _has_accelerator():
        return True
    from accelerate.state import AcceleratorState

    return getattr(AcceleratorState, "fsdp_on_cpu", False) is True


def _accelerator_has_bf16() -> bool:
    """Whether the accelerator transformers would train on (CUDA, XPU, MPS, ...) computes in bf16."""
    from transformers.utils import is_torch_bf16_gpu_available

    return is_torch_bf16_gpu_available()


def _cpu_has_bf16() -> bool:
    from ..env import cpu_supports_bf16

    return cpu_supports_bf16()


def settle_auto_bf16(train_kwargs: dict[str, Any], engine: bool = False) -> None:
    """Settle `bf16: auto` (the default) where no probe is needed; leave `auto` for the CPU probe otherwise.

    - with `fp16: true`: fp16 as asked;
    - an accelerator: bf16 where it computes in bf16 (as TRL's default `bf16=True` and LLaMA-Factory's examples),
      fp32 elsewhere;
    - the CPU without bf16 hardware: fp32;
    - the CPU under DeepSpeed or FSDP (`engine`): fp32, since the engine reads the precision from its config
      before the model exists;
    - otherwise (a CPU with AVX512-BF16 or AMX): still `auto`; the training run's first trainer probes a step at
      the model's own shapes and keeps fp32 unless bf16 autocast is clearly faster
      (`alignkit.model.precision`).

    Args:
        train_kwargs: the `TrainingArguments` keys of the config; `bf16` is updated in place.
        engine: DeepSpeed or FSDP was asked for.
    """
    if train_kwargs.get("bf16") != "auto":
        return
    on_cpu = bool(train_kwargs.get("use_cpu")) or not _has_accelerator()
    if train_kwargs.get("fp16"):
        train_kwargs["bf16"] = False
    elif not on_cpu:
        train_kwargs["bf16"] = _accelerator_has_bf16()
    elif engine or not _cpu_has_bf16():
        train_kwargs["bf16"] = False


def choose_precision(train_kwargs: dict[str, Any]) -> None:
    """Settle `fp16` / `bf16` for the device the run will use, before transformers checks them.

    Every LLaMA-Factory example says `bf16: true`, meaning "mixed precision where the hardware has it":

    - an accelerator with bf16 (an Ampere or newer GPU, ...): bf16 as asked;
    - the CPU (no accelerator, or `use_cpu: true`) with hardware bf16 (AVX512-BF16 or AMX, see
      `alignkit.env.cpu_supports_bf16`): bf16 autocast on the CPU (`use_cpu` is set, which transformers
      requires for bf16 without a GPU);
    - the CPU without it: fp32, with one warning, because emulated bf16 runs about 3x slower than fp32;
    - a GPU without bf16: left to transformers, whose error says which GPU is needed.

    `fp16: true` on the CPU stays an error: it is never in LLaMA-Factory's examples, so it is a deliberate
    choice, and CPU autocast in float16 has no hardware support (about 3x slower than fp32) and underflows
    gradients that fp32 keeps.

    Args:
        train_kwargs: the `TrainingArguments` keys of the config; `bf16`, `bf16_full_eval` and `use_cpu` are
            updated in place.

    Raises:
        ConfigError: fp16 on the CPU.
    """
    use_cpu = bool(train_kwargs.get("use_cpu"))
    on_cpu = use_cpu or not _has_accelerator()
    if train_kwargs.get("fp16") and on_cpu:
        raise ConfigError("fp16=true needs a GPU: this run is on the CPU, where float16 gives no speed (about 3x "
                          "slower than fp32) and loses precision. Remove fp16 (alignkit trains in fp32 on a CPU, "
                          "or in bf16 with bf16=true where the CPU has bf16 hardware).")
    asked = [key for key in ("bf16", "bf16_full_eval") if train_kwargs.get(key) is True]
    if not asked or (not use_cpu and _accelerator_has_bf16()) or not on_cpu:
        return
    if _cpu_has_bf16():
        train_kwargs["use_cpu"] = True
        logger.info("bf16=true: training on the CPU in bf16 (this CPU has AVX512-BF16 or AMX).")
        return
    for key in asked:
        train_kwargs[key] = False
    logger.warning("%s=true: this CPU has no bf16 hardware (AVX512-BF16 or AMX) and runs bf16 about 3x slower than "
                   "fp32, so this run trains in fp32. Remove the key to silence this; on a GPU or a CPU with bf16 "
                   "hardware it is used as asked.", " and ".join(asked))


def _stage_argument_classes() -> dict[str, type]:
    """Stage name → the dataclass of its own keys, for every registered stage that has some."""
    return {name: stage.arguments for name, stage in STAGES.items() if stage.arguments is not None}


def _owners(stage: Optional[str] = None) -> dict[str, type]:
    """Key -> the dataclass that receives it (`alignkit.config.values.key_owners`, preferring `stage`'s class)."""
    stage_classes = _stage_argument_classes()
    classes = [(cls, field_types(cls)) for cls in (*ARG_CLASSES, *dict.fromkeys(stage_classes.values()))]
    return key_owners(classes, stage_classes.get(stage) if stage is not None else None)


def parse_config(
    values: dict[str, Any] | None = None, overrides: list[str] | None = None, source: str | None = None
) -> Config:
    """Build a `Config` from a mapping (e.g. a loaded YAML) and `key=value` overrides.

    Raises:
        ConfigError: unknown key (with the closest valid one), bad type, or an invalid combination.
    """
    merged, from_command_line = merge_overrides(values, overrides)
    stage = str(merged.get("stage", FinetuningArguments.stage))
    owners = _owners(stage)
    where = f" in {source}" if source else ""
    per_class = assign_keys(merged, owners, {cls: field_types(cls) for cls in set(owners.values())},
                            from_command_line, where, stage)

    for key, value in TRAINING_DEFAULTS.items():
        per_class[TrainingArguments].setdefault(key, value)
    # A tracker that is not installed fails here, not after the model has loaded (`alignkit.trackers`).
    per_class[TrainingArguments]["report_to"] = check_report_to(per_class[TrainingArguments]["report_to"])
    # Pinned memory only helps host-to-GPU copies; on a CPU-only machine torch warns about it each epoch.
    per_class[TrainingArguments].setdefault("dataloader_pin_memory", _has_accelerator())
    fsdp_asked = _asks_for_fsdp(per_class[TrainingArguments]) or _env_flag("ACCELERATE_USE_FSDP")
    if fsdp_asked and not _accelerate_runs_fsdp_here():
        # accelerate (1.15) switches to FSDP only on GPU-like devices; on a CPU the run silently falls back to
        # plain data parallelism with a whole model per process, which is not what was asked for.
        raise ConfigError(f"FSDP (the `fsdp` key or an `accelerate launch` FSDP config){where} needs GPUs: on this "
                          "CPU-only machine accelerate would train plain data parallel (DDP) with the whole model in "
                          "every process. Remove `fsdp`/`fsdp_config` (or launch with torchrun or a non-FSDP "
                          "accelerate config) to train data parallel on the CPU.")
    deepspeed_asked = bool(per_class[TrainingArguments].get("deepspeed"))
    if deepspeed_asked and per_class[TrainingArguments].get("use_cpu"):
        raise ConfigError(f"deepspeed and use_cpu: true{where}: accelerate does not start DeepSpeed with use_cpu "
                          "(the run would crash inside DeepSpeed's set-up). Remove use_cpu, or remove deepspeed to "
                          "train data parallel on the CPU.")
    if launched_processes() > 1 and not _has_accelerator() and not deepspeed_asked:
        # Under torchrun on a CPU-only machine accelerate sets up gloo data parallelism only with `use_cpu`;
        # without it every worker silently trains alone on the whole data set (each one its own "rank 0").
        # (Not under DeepSpeed: with use_cpu accelerate leaves DeepSpeed out; see `_check_deepspeed_processes`.)
        per_class[TrainingArguments].setdefault("use_cpu", True)
    if per_class[DataArguments].get("group_by_length"):
        # LLaMA-Factory's key; transformers 5 names the same sampler `train_sampling_strategy`.
        per_class[TrainingArguments].setdefault("train_sampling_strategy", "group_by_length")

    train_kwargs = per_class[TrainingArguments]
    train_kwargs.setdefault("bf16", TrainingArguments.bf16)
    settle_auto_bf16(train_kwargs, engine=fsdp_asked or deepspeed_asked)
    if train_kwargs.get("fp16") and train_kwargs.get("bf16"):
        raise ConfigError(f"fp16 and bf16 are both true{where}; choose one.")
    choose_precision(train_kwargs)
    check_warmup_keys(train_kwargs, where)
    if train_kwargs.get("do_eval") is False and train_kwargs.get("eval_strategy", "no") != "no":
        # transformers switches do_eval back on for any eval_strategy but `no`, so `do_eval: false` alone would
        # still evaluate every eval_steps.
        logger.info("do_eval=false: no evaluation during training either (eval_strategy=%s set to no).",
                    train_kwargs["eval_strategy"])
        train_kwargs["eval_strategy"] = "no"

    model_kwargs = per_class.get(ModelArguments, {})
    if model_kwargs.get("enable_liger_kernel"):
        train_kwargs.setdefault("use_liger_kernel", True)  # transformers applies Liger's patches (its documented path)
    if model_kwargs.get("disable_gradient_checkpointing"):
        if train_kwargs.get("gradient_checkpointing"):
            raise ConfigError(f"gradient_checkpointing=true and disable_gradient_checkpointing=true{where}; keep one.")
        train_kwargs["gradient_checkpointing"] = False

    def build(cls: type) -> Any:
        try:
            if cls is FinetuningArguments:
                check_stage(str(per_class.get(cls, {}).get("stage", FinetuningArguments.stage)))
            return cls(**per_class.get(cls, {}))
        except ConfigError as err:
            raise ConfigError(f"{err}{' (' + source + ')' if source else ''}") from None
        except (ValueError, TypeError) as err:
            raise ConfigError(f"invalid {cls.__name__} settings{where}: {err}") from None

    built = {cls: build(cls) for cls in ARG_CLASSES}
    _check_deepspeed_processes(built[TrainingArguments], where)
    if built[TrainingArguments].warmup_ratio is not None:
        logger.info("warmup_ratio=%s is read as warmup_steps=%s (transformers 5 takes a warmup_steps below 1 as "
                    "a share of the training steps).", built[TrainingArguments].warmup_ratio,
                    built[TrainingArguments].warmup_steps)
    stage = built[FinetuningArguments].stage
    stage_classes = _stage_argument_classes()
    method_cls = stage_classes.get(stage)
    for other_stage, cls in stage_classes.items():
        if cls is not method_cls and per_class.get(cls):
            raise other_stage_keys_error(sorted(per_class[cls]), other_stage, stage, where)
    config = Config(
        model=built[ModelArguments],
        data=built[DataArguments],
        training=built[TrainingArguments],
        finetuning=built[FinetuningArguments],
        generating=built[GeneratingArguments],
        method=build(method_cls) if method_cls is not None else None,
        source=source,
        values=merged,
    )
    if config.model.rope_scaling and config.model.model_max_length is None:
        config.model.model_max_length = config.data.cutoff_len  # the length training runs at
    check_combinations(config)
    return config


def read_config(path: str | os.PathLike, overrides: list[str] | None = None) -> Config:
    """Parse `alignkit train PATH key=value ...`.

    A config silent on all of `do_train`, `do_eval` and `do_predict` trains: `alignkit train` is the
    command, and LLaMA-Factory configs always say `do_train: true` anyway. Settings that switch all
    three off are refused, since such a run would load nothing and write nothing.
    """
    values = load_yaml(path)
    given = set(values) | {parse_override(item)[0] for item in overrides or []}
    if not given & {"do_train", "do_eval", "do_predict"}:
        values["do_train"] = True
    config = parse_config(values, overrides, source=str(path))
    t = config.training
    if not (t.do_train or t.do_eval or t.do_predict):
        raise ConfigError(f"{path}: do_train, do_eval and do_predict are all false, so there is nothing to do; "
                          "set one of them to true.")
    return config


def _fsdp_activation_checkpointing(t: TrainingArguments) -> bool:
    """Whether FSDP's own activation checkpointing is asked for: `fsdp_config` (transformers has stripped its `fsdp_`
    prefixes by now) or an `accelerate launch` FSDP config (its environment variables)."""
    asked = bool(t.fsdp) and bool((t.fsdp_config or {}).get("activation_checkpointing"))
    return asked or (_env_flag("ACCELERATE_USE_FSDP") and _env_flag("FSDP_ACTIVATION_CHECKPOINTING"))


def _own_keys(arguments: Optional[type]) -> set[str]:
    """The field names of a stage's own keys (none for a stage without a dataclass)."""
    return {f.name for f in dataclasses.fields(arguments)} if arguments is not None else set()


def check_combinations(config: Config) -> None:
    """Reject settings that are valid alone but not together, saying how to fix them.

    Settings of one section are checked by its dataclass; this checks those that span sections, then
    hands the config to the stage's own `check` (what only that stage forbids).
    """
    t, d, f = config.training, config.data, config.finetuning
    stage = STAGES[f.stage]
    if t.do_train and not d.dataset and not d.tokenized_path:
        raise ConfigError("do_train=true needs `dataset` (or a `tokenized_path` saved earlier).")
    if (t.do_eval or t.do_predict) and not (d.eval_dataset or d.val_size or d.dataset or d.tokenized_path):
        raise ConfigError("evaluation needs `eval_dataset` or `val_size` > 0.")
    if config.model.quantization_bit and f.finetuning_type != "lora" and t.do_train:
        raise ConfigError(f"quantization_bit={config.model.quantization_bit} with finetuning_type={f.finetuning_type}: "
                          "a quantized base cannot be trained itself (its weights are frozen integers); use "
                          "finetuning_type=lora (QLoRA), or remove quantization_bit.")
    if t.do_train and f.finetuning_type == "lora" and _fsdp_activation_checkpointing(t):
        raise ConfigError("FSDP's activation checkpointing (fsdp_config activation_checkpointing, or "
                          "fsdp_activation_checkpointing in an accelerate config) with finetuning_type=lora: torch's "
                          "checkpoint wrapper renames every decoder layer, and peft then finds none of the adapter's "
                          "weights when it saves them (the saved adapter would be empty). Use gradient_checkpointing: "
                          "true instead, which checkpoints the same decoder layers.")
    check_section_combinations(config.model, d, f, stage.data_kind)
    if t.predict_with_generate and stage.data_kind not in ("text", "supervised"):
        raise ConfigError(f"predict_with_generate applies to stage sft, not {f.stage}; remove it.")
    for key, ours in (("generation_num_beams", "num_beams (the same beam width)"),
                      ("generation_max_length", "max_new_tokens (new tokens per prompt, not the whole length)")):
        if getattr(t, key) is not None:  # Seq2SeqTrainingArguments' keys, which alignkit's generation never reads
            raise ConfigError(f"{key}={getattr(t, key)}: alignkit's generation (predict_with_generate, eval, chat) "
                              f"takes the generation keys; set {ours} instead.")
    if not t.eval_do_concat_batches:
        raise ConfigError("eval_do_concat_batches=false hands a custom compute_metrics its batches as lists; "
                          "alignkit's metrics and prediction files take them joined. Remove it (batch_eval_metrics: "
                          "true computes the metrics batch by batch, without keeping the predictions).")
    if t.label_smoothing_factor:
        if not 0 <= t.label_smoothing_factor < 1:
            raise ConfigError(f"label_smoothing_factor={t.label_smoothing_factor} must be in [0, 1).")
        if stage.data_kind not in ("text", "supervised"):
            hint = " (DPO's own smoothing of its preference labels is dpo_label_smoothing)" if f.stage == "dpo" else ""
            raise ConfigError(f"label_smoothing_factor smooths the next-token targets of stage sft or pt; stage "
                              f"{f.stage} has no such loss{hint}. Remove it.")
    check_generation_keys(f.stage, stage.data_kind, _own_keys(stage.arguments), config.values, config.generating)
    if stage.check is not None:
        stage.check(config)


# `--help-keys` groups, named as README.md and docs/config.md name them; the stages' groups follow, then the Trainer's.
KEY_GROUPS = ((ModelArguments, "model"), (DataArguments, "data"), (FinetuningArguments, "finetuning"),
              (GeneratingArguments, "generation"), (TrainingArguments, "training"))


def all_keys() -> dict[str, dict[str, str]]:
    """Every accepted key with its help text, grouped (for `alignkit train --help-keys`).

    Returns:
        Group title → {key: help}: `model`, `data`, `finetuning`, `generation`, `training` (the training keys
        alignkit adds), one `stage NAME` group per stage with keys of its own, and last
        `TRANSFORMERS_TRAINING_GROUP`, the 120-odd `Seq2SeqTrainingArguments` keys taken as transformers
        defines them (the CLI folds that group into their names and a link to transformers' docs).
    """
    groups: dict[str, dict[str, str]] = {}
    seen: set[str] = set()
    names = stage_names()
    titles = list(KEY_GROUPS)
    for name, stage in STAGES.items():
        if stage.arguments is not None:
            titles.append((stage.arguments, f"stage {name}"))
    titles.append((TrainingArguments, TRANSFORMERS_TRAINING_GROUP))
    own_training_keys = set(TrainingArguments.__annotations__)  # declared in alignkit's subclass itself
    for cls, title in titles:
        keys = {}
        for f in dataclasses.fields(cls):
            if cls is TrainingArguments and (f.name in own_training_keys) != (title == "training"):
                continue
            if f.init and f.name not in seen:
                seen.add(f.name)
                keys[f.name] = f.metadata.get("help", "").replace(STAGE_NAMES, names)
        if keys:
            groups[title] = keys
    return groups


__all__ = ["KEY_GROUPS", "TRANSFORMERS_TRAINING_DOCS", "TRANSFORMERS_TRAINING_GROUP", "all_keys", "check_combinations", "check_stage", "choose_precision", "settle_auto_bf16", "load_yaml", "parse_config",
           "parse_override", "read_config", "stage_names"]
