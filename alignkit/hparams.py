"""Configuration: one dataclass per concern, read from YAML and `key=value`.

`alignkit train CONFIG.yaml key=value ...` merges the YAML mapping with the overrides (overrides win),
hands each key to the dataclass that owns it, converts strings to the field's type, and builds the
dataclasses. The shared sections live here (model, data, finetuning method, generation, training); each
stage's own keys are a dataclass in its stage module (`alignkit.stages.dpo.DPOArguments`, ...), found
through the stage registry (`alignkit.stages.STAGES`), and arrive as `Config.method`. Anything wrong (an
unknown key, a value of the wrong type, an invalid combination) raises `ConfigError` with a message that
names the key and says how to fix it, before any model is loaded: each dataclass checks its own fields in
`__post_init__`, `check_combinations` the settings that involve several sections, and the stage's
`check` what only that stage forbids.

Key names follow LLaMA-Factory where it has the feature and TRL otherwise; every field of
`transformers.Seq2SeqTrainingArguments` is accepted as is.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib.metadata
import logging
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from transformers import Seq2SeqTrainingArguments

BUNDLED_MODEL_NAME = "smollm2-135m-instruct"
# Stands for the registered stage names in help text, filled in from `alignkit.stages.STAGES` when shown, so
# the help lists exactly the stages that exist.
STAGE_NAMES = "<registered stages>"

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A configuration problem the user must fix; the message says which key and how."""


def stage_names() -> str:
    """The registered stages (`alignkit.stages.STAGES`), comma-separated, for messages and help text."""
    from .stages import STAGES

    return ", ".join(STAGES)


@dataclass
class ModelArguments:
    """Which model to load and how."""

    model_name_or_path: Optional[str] = field(
        default=None,
        metadata={
            "help": "Local directory, hub id, or `smollm2-135m-instruct` (the bundled default, also used when "
            "the key is absent)."
        },
    )
    adapter_name_or_path: Optional[str] = field(
        default=None,
        metadata={
            "help": "PEFT adapter(s) to start from, comma-separated. For a new stage they are merged into the "
            "base in memory and a fresh adapter is trained on top, so the reference model includes them. An "
            "adapter trained that way records them (base_adapters.json) and brings them along: give the last one."
        },
    )
    cache_dir: Optional[str] = field(default=None, metadata={"help": "Where hub downloads are cached."})
    model_revision: str = field(default="main", metadata={"help": "Hub revision (branch, tag or commit)."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow model code from the hub to run. Off unless you trust the repo."}
    )
    infer_dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(
        default="auto",
        metadata={"help": "Weights dtype. `auto`: float32 on CPU, bfloat16 on GPUs that support it, else float16."},
    )
    attn_implementation: Optional[str] = field(
        default=None, metadata={"help": "Attention kernel passed to from_pretrained (`sdpa`, `eager`, ...)."}
    )
    low_cpu_mem_usage: bool = field(default=True, metadata={"help": "Load weights lazily to save host memory."})


@dataclass
class DataArguments:
    """Which data to use and how to turn it into tokens."""

    dataset: Optional[str] = field(
        default=None,
        metadata={
            "help": "Training data, comma-separated: names from `dataset_dir/dataset_info.json`, local "
            ".json/.jsonl/.csv/.parquet files, or hub dataset ids."
        },
    )
    eval_dataset: Optional[str] = field(default=None, metadata={"help": "Evaluation data, same forms as `dataset`."})
    dataset_dir: str = field(
        default="data", metadata={"help": "Folder holding `dataset_info.json` and the files it names."}
    )
    template: Optional[str] = field(
        default=None,
        metadata={
            "help": "Chat template: unset uses the tokenizer's own; built-in ones are `chatml`, `qwen`, `qwen3`, "
            "`smollm2`, `llama3`, `default`, `plain` (for base models without a template), and LLaMA-Factory's "
            "`qwen3_nothink` and `smollm` (ChatML). A template whose special tokens the tokenizer lacks is refused."
        },
    )
    cutoff_len: int = field(default=2048, metadata={"help": "Maximum tokens per example after tokenisation."})
    train_on_prompt: bool = field(default=False, metadata={"help": "Also compute the loss on prompt tokens."})
    max_samples: Optional[int] = field(default=None, metadata={"help": "Keep only the first N rows of each dataset."})
    val_size: float = field(
        default=0.0, metadata={"help": "Held-out share (< 1) or count (>= 1) of the training data for evaluation."}
    )
    packing: bool = field(
        default=False, metadata={"help": "SFT: pack several examples per row, attention kept inside each example."}
    )
    group_by_length: bool = field(
        default=False, metadata={"help": "Batch examples of similar length together to reduce padding."}
    )
    overwrite_cache: bool = field(default=False, metadata={"help": "Re-tokenise even if a cached copy exists."})
    tokenized_path: Optional[str] = field(
        default=None,
        metadata={"help": "Save the tokenised dataset here, or load it from here when it already exists."},
    )
    preprocessing_num_workers: Optional[int] = field(
        default=None, metadata={"help": "Processes used for tokenisation."}
    )
    skip_invalid_rows: bool = field(
        default=False, metadata={"help": "Skip malformed rows (and report them) instead of stopping."}
    )
    streaming: bool = field(default=False, metadata={"help": "Not supported yet; kept for LLaMA-Factory configs."})

    def __post_init__(self) -> None:
        if self.val_size < 0:
            raise ConfigError(f"val_size={self.val_size} is negative: give a share in [0, 1) or a row count >= 1.")
        if self.cutoff_len < 2:
            raise ConfigError(f"cutoff_len={self.cutoff_len} leaves no room for a prompt and a response.")
        if self.streaming:
            raise ConfigError("streaming=true is not supported; remove the key (datasets are loaded in full).")
        _check_positive(self, "max_samples", "preprocessing_num_workers")


@dataclass
class FinetuningArguments:
    """Which stage runs and what it trains: the finetuning method (LoRA, full, freeze) and its settings."""

    stage: str = field(
        default="sft",
        metadata={"help": f"Training stage, one of {STAGE_NAMES}."},
    )
    finetuning_type: Literal["lora", "full", "freeze"] = field(
        default="lora", metadata={"help": "LoRA adapter (default), full fine-tuning, or only the last layers."}
    )
    lora_rank: int = field(default=8, metadata={"help": "LoRA rank r."})
    lora_alpha: Optional[int] = field(default=None, metadata={"help": "LoRA scaling alpha (default: 2 * lora_rank)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input."})
    lora_target: str = field(
        default="all",
        metadata={"help": "Modules to adapt, comma-separated, or `all` = every linear layer but the output head."},
    )
    additional_target: Optional[str] = field(
        default=None, metadata={"help": "Modules trained in full beside the adapter, comma-separated."}
    )
    freeze_trainable_layers: int = field(
        default=2, metadata={"help": "finetuning_type=freeze: how many of the last layers are trained."}
    )

    def __post_init__(self) -> None:
        if self.lora_alpha is None:
            self.lora_alpha = 2 * self.lora_rank
        from .stages import STAGES

        if self.stage not in STAGES:
            close = difflib.get_close_matches(self.stage, list(STAGES), n=1, cutoff=0.5)
            hint = f" Did you mean `{close[0]}`?" if close else ""
            raise ConfigError(f"stage={self.stage!r} is not a stage; choose one of {stage_names()}.{hint}")
        if self.lora_rank < 1:
            raise ConfigError(f"lora_rank={self.lora_rank} must be >= 1.")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"lora_dropout={self.lora_dropout} must be in [0, 1).")
        if self.freeze_trainable_layers < 1:
            raise ConfigError(f"freeze_trainable_layers={self.freeze_trainable_layers} must be >= 1.")
        if self.lora_alpha <= 0:
            raise ConfigError(f"lora_alpha={self.lora_alpha} must be > 0 (default: 2 * lora_rank).")


@dataclass
class GeneratingArguments:
    """How text is generated for prediction, evaluation and chat."""

    do_sample: bool = field(default=False, metadata={"help": "Sample instead of greedy/beam decoding."})
    temperature: float = field(default=0.95, metadata={"help": "Sampling temperature."})
    top_p: float = field(default=0.7, metadata={"help": "Nucleus sampling: keep the smallest set with this mass."})
    top_k: int = field(default=50, metadata={"help": "Sample among the k most likely tokens."})
    num_beams: int = field(default=1, metadata={"help": "Beam search width (1 = no beam search)."})
    max_new_tokens: int = field(default=512, metadata={"help": "Most tokens generated per prompt."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "Penalty > 1 discourages repetition."})
    length_penalty: float = field(default=1.0, metadata={"help": "Beam search length penalty."})

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens}: generation needs at least 1 new token.")
        if self.temperature <= 0 and self.do_sample:
            raise ConfigError("temperature must be > 0 when do_sample=true (use do_sample=false for greedy).")
        _check_positive(self, "num_beams")
        check_sampling_knobs(self)

    def to_generation_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `model.generate` (sampling knobs only when sampling)."""
        kwargs: dict[str, Any] = {
            "do_sample": self.do_sample,
            "num_beams": self.num_beams,
            "max_new_tokens": self.max_new_tokens,
            "repetition_penalty": self.repetition_penalty,
        }
        if self.do_sample:
            kwargs.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        if self.num_beams > 1:
            kwargs["length_penalty"] = self.length_penalty
        return kwargs


@dataclass
class TrainingArguments(Seq2SeqTrainingArguments):
    """`transformers.Seq2SeqTrainingArguments`, plus the keys transformers 5 dropped that users still write
    (`overwrite_output_dir`) and how alignkit runs and reports a step (`padding_free`, `plot_loss`)."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start afresh even if output_dir holds checkpoints. Otherwise a run resumes from the last "
            "complete checkpoint there."
        },
    )
    padding_free: bool = field(
        default=True,
        metadata={
            "help": "Train on the real tokens only: run each batch as its sequences laid end to end, position ids "
            "restarting per sequence (no padding computed). Set false for models whose attention ignores "
            "position-id resets."
        },
    )
    plot_loss: bool = field(default=False, metadata={"help": "Write training_<metric>.png for each logged series."})
    warmup_ratio: Optional[float] = field(
        default=None,
        metadata={
            "help": "Warm up over this share of the training steps, in [0, 1) (LLaMA-Factory's and transformers "
            "4's key). transformers 5 folded it into `warmup_steps`, where a value below 1 is a share; it is "
            "copied there, so give one of the two."
        },
    )

    def __post_init__(self) -> None:
        # Checked before transformers' own __post_init__ and long before the model loads: otherwise these
        # values surface as torch tracebacks (`Invalid learning rate`, a DataLoader refusing batch_size=0,
        # a ZeroDivisionError from gradient_accumulation_steps=0) after the weights are in memory.
        _check_positive(self, "per_device_train_batch_size", "per_device_eval_batch_size",
                        "gradient_accumulation_steps")
        if not math.isfinite(self.learning_rate) or self.learning_rate < 0:
            raise ConfigError(f"learning_rate={self.learning_rate} must be a finite number >= 0 (e.g. 2e-4 for "
                              "LoRA, 1e-5 for full fine-tuning).")
        if self.weight_decay < 0 or not math.isfinite(self.weight_decay):
            raise ConfigError(f"weight_decay={self.weight_decay} must be >= 0 (0 turns it off).")
        for key in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)} must be in [0, 1) (defaults: 0.9 and 0.999).")
        if self.adam_epsilon < 0:
            raise ConfigError(f"adam_epsilon={self.adam_epsilon} must be >= 0 (default 1e-8).")
        if self.max_steps < -1:
            raise ConfigError(f"max_steps={self.max_steps}: give a positive number of optimizer steps, or -1 "
                              "(the default) to train for num_train_epochs.")
        if self.max_steps <= 0 and not (self.num_train_epochs > 0 and math.isfinite(self.num_train_epochs)):
            raise ConfigError(f"num_train_epochs={self.num_train_epochs} must be > 0 (or set max_steps to a "
                              "positive number of steps).")
        for key, strategy in (("logging_steps", "logging_strategy"), ("save_steps", "save_strategy"),
                              ("eval_steps", "eval_strategy")):
            value = getattr(self, key)
            if getattr(self, strategy) == "steps" and value is not None and value <= 0 \
                    and not (key == "eval_steps" and value == 0):  # eval_steps 0/None: use logging_steps
                raise ConfigError(f"{key}={value} must be > 0 with {strategy}=steps (a step count, or a "
                                  "share of the run below 1).")
        if self.dataloader_num_workers < 0:
            raise ConfigError(f"dataloader_num_workers={self.dataloader_num_workers} must be >= 0.")
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"seed={self.seed} must be in [0, 2**32) (numpy's range).")
        if self.warmup_ratio is not None:
            # transformers 5 reads warmup_steps >= 1 as a step count, so a ratio of 1 (warm up for the whole
            # run) cannot be carried over: int(1.0) would be one step.
            if not 0 <= self.warmup_ratio < 1:
                raise ConfigError(f"warmup_ratio={self.warmup_ratio} must be in [0, 1); for a warm-up counted in "
                                  "steps give warmup_steps instead.")
            if self.warmup_steps not in (0, self.warmup_ratio):
                raise ConfigError(_BOTH_WARMUP_KEYS)
            self.warmup_steps = self.warmup_ratio
        if self.deepspeed:
            _check_deepspeed(self.deepspeed)
        super().__post_init__()


_BOTH_WARMUP_KEYS = ("warmup_ratio and warmup_steps are both given; keep one (transformers 5 reads warmup_steps "
                     "below 1 as a share of the training steps, so warmup_ratio: 0.1 is warmup_steps: 0.1).")


def _check_deepspeed(deepspeed: Any) -> None:
    """Refuse a `deepspeed` config that cannot run here, before transformers fails on it with a traceback.

    transformers checks the package with `importlib.metadata` (a missing one raises `PackageNotFoundError`
    from deep inside `TrainingArguments`), so the same check is made here first.
    """
    try:
        importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"deepspeed={deepspeed!r} needs DeepSpeed, which is not installed: pip install 'alignkit[deepspeed]' "
            "(DeepSpeed runs on CUDA GPUs; on a CPU remove the `deepspeed` key)."
        ) from None
    if isinstance(deepspeed, str) and not Path(deepspeed).is_file():
        raise ConfigError(f"deepspeed={deepspeed!r}: no such file; give the path of a DeepSpeed JSON config.")


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


def check_sampling_knobs(args: Any) -> None:
    """Raise a ConfigError for a `top_p`, `top_k` or `repetition_penalty` out of range (generation and the
    online stages' sampling keys)."""
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"top_p={args.top_p} must be in (0, 1] (1 turns nucleus sampling off).")
    if args.top_k < 0:
        raise ConfigError(f"top_k={args.top_k} must be >= 0 (0 turns top-k sampling off).")
    if not args.repetition_penalty > 0:
        raise ConfigError(f"repetition_penalty={args.repetition_penalty} must be > 0 (1 means none).")


def _check_positive(args: Any, *keys: str) -> None:
    """Raise a ConfigError naming the first of `keys` whose value is below 1."""
    for key in keys:
        value = getattr(args, key)
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value} must be at least 1.")


ARG_CLASSES = (ModelArguments, DataArguments, TrainingArguments, FinetuningArguments, GeneratingArguments)

# Our defaults where transformers' do not suit this toolkit: logging often enough to see a curve,
# no third-party reporters, and keep our own columns (collators decide what reaches the model).
TRAINING_DEFAULTS: dict[str, Any] = {
    "output_dir": "outputs/run",
    "logging_steps": 1,
    "report_to": "none",
    "remove_unused_columns": False,
    "save_strategy": "steps",
    "save_steps": 500,
    "include_num_input_tokens_seen": "non_padding",  # tokens/s in trainer_log.jsonl counts real tokens
}


@dataclass
class Config:
    """Everything one run needs, as parsed from YAML and overrides."""

    model: ModelArguments
    data: DataArguments
    training: TrainingArguments
    finetuning: FinetuningArguments
    generating: GeneratingArguments
    method: Any = None  # the stage's own arguments (e.g. `DPOArguments`), None for a stage without keys
    source: Optional[str] = None  # the YAML path, for messages
    values: dict[str, Any] = field(default_factory=dict)  # the keys as given (YAML merged with overrides)


def _asks_for_fsdp(train_kwargs: dict[str, Any]) -> bool:
    """Whether the `fsdp` key asks for FSDP (`true`, or transformers' strings such as `full_shard auto_wrap`)."""
    value = train_kwargs.get("fsdp")
    if isinstance(value, str):
        return value.strip().lower() not in ("", "false", "no", "none")
    return bool(value)


def launched_processes() -> int:
    """How many processes the launcher started (torchrun's, accelerate's or DeepSpeed's `WORLD_SIZE`; 1 alone)."""
    try:
        return max(int(os.environ.get("WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1


def _has_accelerator() -> bool:
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


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
    from .env import cpu_supports_bf16

    return cpu_supports_bf16()


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
    asked = [key for key in ("bf16", "bf16_full_eval") if train_kwargs.get(key)]
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


def _field_types(cls: type) -> dict[str, Any]:
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


def _convert(key: str, value: Any, tp: Any) -> Any:
    """Convert a YAML or command-line value to the field's type, or raise ConfigError."""
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
            return [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, (list, tuple)):
            return list(value)
        raise ValueError("expected a list")
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
        else:
            names.append(getattr(t, "__name__", str(t)))
    return " or ".join(names)


def _stage_argument_classes() -> dict[str, type]:
    """Stage name → the dataclass of its own keys, for every registered stage that has some."""
    from .stages import STAGES

    return {name: stage.arguments for name, stage in STAGES.items() if stage.arguments is not None}


def _owners(stage: Optional[str] = None) -> dict[str, type]:
    """Key → the dataclass that receives it.

    A key may belong to several stages' classes (GRPO and PPO share the reward-function keys); it goes to
    the class of `stage` when that class has it, else to the first stage class that does (so the error
    can name a stage it applies to).
    """
    stage_classes = _stage_argument_classes()
    owners: dict[str, type] = {}
    preferred = stage_classes.get(stage) if stage is not None else None
    if preferred is not None:
        for name in _field_types(preferred):
            owners[name] = preferred
    for cls in (*ARG_CLASSES, *dict.fromkeys(stage_classes.values())):
        for name in _field_types(cls):
            owners.setdefault(name, cls)
    return owners


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


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML config into a flat mapping, with errors that name the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist.")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(f"{p}: byte {err.start} (0x{err.object[err.start]:02x}) is not UTF-8; save the file "
                          "as UTF-8.") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{p}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of key: value, got {type(data).__name__}.")
    return data


def parse_config(
    values: dict[str, Any] | None = None, overrides: list[str] | None = None, source: str | None = None
) -> Config:
    """Build a `Config` from a mapping (e.g. a loaded YAML) and `key=value` overrides.

    Raises:
        ConfigError: unknown key (with the closest valid one), bad type, or an invalid combination.
    """
    merged: dict[str, Any] = dict(values or {})
    for item in overrides or []:
        key, value = parse_override(item)
        merged[key] = value

    owners = _owners(str(merged.get("stage", FinetuningArguments.stage)))
    where = f" in {source}" if source else ""
    per_class: dict[type, dict[str, Any]] = {cls: {} for cls in set(owners.values())}
    for key, value in merged.items():
        if key not in owners:
            close = difflib.get_close_matches(key, list(owners), n=1, cutoff=0.6)
            hint = f" Did you mean `{close[0]}`?" if close else " See `alignkit train --help-keys` for every key."
            raise ConfigError(f"unknown key `{key}`{where}.{hint}")
        cls = owners[key]
        per_class[cls][key] = _convert(key, value, _field_types(cls)[key])

    for key, value in TRAINING_DEFAULTS.items():
        per_class[TrainingArguments].setdefault(key, value)
    # Pinned memory only helps host-to-GPU copies; on a CPU-only machine torch warns about it each epoch.
    per_class[TrainingArguments].setdefault("dataloader_pin_memory", _has_accelerator())
    fsdp_asked = _asks_for_fsdp(per_class[TrainingArguments]) or \
        os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")
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
    if train_kwargs.get("fp16") and train_kwargs.get("bf16"):
        raise ConfigError(f"fp16 and bf16 are both true{where}; choose one.")
    choose_precision(train_kwargs)
    if train_kwargs.get("warmup_ratio") is not None and "warmup_steps" in train_kwargs:
        raise ConfigError(f"{_BOTH_WARMUP_KEYS[:-1]}{where}.")
    if train_kwargs.get("do_eval") is False and train_kwargs.get("eval_strategy", "no") != "no":
        # transformers switches do_eval back on for any eval_strategy but `no`, so `do_eval: false` alone would
        # still evaluate every eval_steps.
        logger.info("do_eval=false: no evaluation during training either (eval_strategy=%s set to no).",
                    train_kwargs["eval_strategy"])
        train_kwargs["eval_strategy"] = "no"

    def build(cls: type) -> Any:
        try:
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
            keys = sorted(per_class[cls])
            verb, pronoun = ("applies", "it") if len(keys) == 1 else ("apply", "them")
            raise ConfigError(f"{', '.join(keys)} {verb} to stage {other_stage}, not {stage}{where}; remove "
                              f"{pronoun} (or set stage: {other_stage}).")
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


def check_combinations(config: Config) -> None:
    """Reject settings that are valid alone but not together, saying how to fix them.

    Settings of one section are checked by its dataclass; this checks those that span sections, then
    hands the config to the stage's own `check` (what only that stage forbids).
    """
    from .stages import STAGES

    t, d, f = config.training, config.data, config.finetuning
    stage = STAGES[f.stage]
    if t.do_train and not d.dataset and not d.tokenized_path:
        raise ConfigError("do_train=true needs `dataset` (or a `tokenized_path` saved earlier).")
    if (t.do_eval or t.do_predict) and not (d.eval_dataset or d.val_size or d.dataset or d.tokenized_path):
        raise ConfigError("evaluation needs `eval_dataset` or `val_size` > 0.")
    if d.packing and stage.data_kind not in ("text", "supervised"):
        raise ConfigError(f"packing=true applies to stage sft or pt, not {f.stage}; remove it.")
    if t.predict_with_generate and stage.data_kind not in ("text", "supervised"):
        raise ConfigError(f"predict_with_generate applies to stage sft, not {f.stage}; remove it.")
    if stage.check is not None:
        stage.check(config)


def all_keys() -> dict[str, dict[str, str]]:
    """Every accepted key with its help text, grouped (for `alignkit train --help-keys`).

    Returns:
        Group title → {key: help}. The shared sections first, then one group per stage with keys of its own.
    """
    from .stages import STAGES

    groups: dict[str, dict[str, str]] = {}
    seen: set[str] = set()
    names = stage_names()
    titles = [(cls.__name__, cls) for cls in ARG_CLASSES]
    for name, stage in STAGES.items():
        if stage.arguments is not None:
            titles.append((f"stage {name} ({stage.arguments.__name__})", stage.arguments))
    for title, cls in titles:
        keys = {}
        for f in dataclasses.fields(cls):
            if f.init and f.name not in seen:
                seen.add(f.name)
                keys[f.name] = f.metadata.get("help", "").replace(STAGE_NAMES, names)
        if keys:
            groups[title] = keys
    return groups
