"""The config's sections that need neither torch nor transformers: model, data, fine-tuning and generation keys, and
alignkit's checks of the training keys (`check_training_values`).

They live apart from `alignkit.config.schema` (which adds `TrainingArguments`, a subclass of transformers'
`Seq2SeqTrainingArguments`, and `Config`) so that `alignkit train` can build them, and so raise a bad value's
`ConfigError`, before it imports torch (`alignkit.config.keytable.check_config_early`): the same classes, the same
messages, in a fraction of a second. Each dataclass checks its own fields in `__post_init__`; checks that span
sections, or need the stage registry, are the parser's.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Literal, Optional

from ..errors import ConfigError

BUNDLED_MODEL_NAME = "smollm2-135m-instruct"
# Stands for the registered stage names in help text, filled in from `alignkit.stages.STAGES` when shown
# (`alignkit.config.parse.all_keys`), so the help lists exactly the stages that exist.
STAGE_NAMES = "<registered stages>"

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
    # Quantized bases (QLoRA), LLaMA-Factory's keys: the base is quantized as it loads; only LoRA trains on it.
    quantization_bit: Optional[int] = field(
        default=None,
        metadata={"help": "Quantize the base as it loads: 4 or 8 bits (bitsandbytes; `pip install "
                  "'alignkit[qlora]'`). Only finetuning_type=lora trains on a quantized base."},
    )
    quantization_method: str = field(
        default="bnb", metadata={"help": "On-the-fly quantization library: `bnb` (bitsandbytes), the only one here."}
    )
    quantization_type: Literal["nf4", "fp4"] = field(
        default="nf4", metadata={"help": "4-bit data type of bitsandbytes: `nf4` (NormalFloat) or `fp4`."}
    )
    double_quantization: bool = field(
        default=True, metadata={"help": "4-bit: quantize the quantization constants too (about 0.4 bit a weight less)."}
    )
    quantization_device_map: Optional[Literal["auto"]] = field(
        default=None,
        metadata={"help": "`auto`: spread a 4-bit base over the visible devices (accelerate's device_map=auto); "
                  "unset: the whole model on this process's device."},
    )

    # LLaMA-Factory's kernel and speed keys.
    flash_attn: Literal["auto", "disabled", "sdpa", "fa2"] = field(
        default="auto",
        metadata={"help": "Attention kernel, LLaMA-Factory's name for attn_implementation: `auto` (transformers' "
                  "choice), `disabled` (eager), `sdpa`, `fa2` (flash_attention_2: a CUDA GPU and flash-attn)."},
    )
    shift_attn: bool = field(
        default=False, metadata={"help": "LongLoRA's shifted sparse attention: not supported here (refused)."}
    )
    enable_liger_kernel: bool = field(
        default=False,
        metadata={"help": "Liger's Triton kernels (CUDA GPUs, `pip install liger-kernel`), applied by transformers' "
                  "`use_liger_kernel`."},
    )
    use_unsloth: bool = field(default=False, metadata={"help": "Unsloth's patched models: not supported here (refused)."})
    upcast_layernorm: bool = field(
        default=False, metadata={"help": "Train with the norm layers' weights in float32 (a bf16/fp16 model)."}
    )
    rope_scaling: Optional[Literal["linear", "dynamic", "yarn", "llama3"]] = field(
        default=None,
        metadata={"help": "RoPE scaling to train beyond the model's context: the factor is ceil(model_max_length / "
                  "max_position_embeddings), written into the model config's rope_parameters (LLaMA-Factory's rule)."},
    )
    model_max_length: Optional[int] = field(
        default=None,
        metadata={"help": "The length rope_scaling scales the context to; cutoff_len when unset (LLaMA-Factory "
                  "derives it the same way)."},
    )
    image_max_pixels: int = field(
        default=768 * 768,
        metadata={"help": "Vision-language models: an image with more pixels is scaled down to this many before the "
                  "model's image processor sees it (LLaMA-Factory's key and default)."},
    )
    image_min_pixels: int = field(
        default=32 * 32,
        metadata={"help": "Vision-language models: an image with fewer pixels is scaled up to this many "
                  "(LLaMA-Factory's key and default)."},
    )
    disable_gradient_checkpointing: bool = field(
        default=False,
        metadata={"help": "Keep gradient checkpointing off. alignkit, unlike LLaMA-Factory, only checkpoints when "
                  "`gradient_checkpointing: true`; giving both is an error."},
    )

    def __post_init__(self) -> None:
        self._check_kernel_keys()
        if not 0 < self.image_min_pixels <= self.image_max_pixels:
            raise ConfigError(f"image_min_pixels={self.image_min_pixels} and image_max_pixels={self.image_max_pixels}: "
                              "need 0 < image_min_pixels <= image_max_pixels.")
        if self.quantization_bit is None:
            return
        if self.quantization_method != "bnb":
            raise ConfigError(f"quantization_method={self.quantization_method!r} is not supported here; use bnb "
                              "(bitsandbytes), or quantize the model beforehand and give its folder.")
        if self.quantization_bit not in (4, 8):
            raise ConfigError(f"quantization_bit={self.quantization_bit}: bitsandbytes quantizes to 4 or 8 bits.")
        if self.quantization_device_map == "auto" and self.quantization_bit != 4:
            raise ConfigError("quantization_device_map=auto applies to quantization_bit=4 only; remove it for 8 bits.")
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(f"quantization_bit={self.quantization_bit} needs bitsandbytes, which is not installed: "
                              "pip install 'alignkit[qlora]' (or remove quantization_bit to train on the full-precision "
                              "base).")


    def _check_kernel_keys(self) -> None:
        """LLaMA-Factory's kernel keys: refused with the reason where they cannot run here."""
        on_gpu = _cuda_available() if self.use_unsloth or self.enable_liger_kernel or self.flash_attn == "fa2" else False
        if self.shift_attn:
            raise ConfigError("shift_attn=true (LongLoRA's shifted sparse attention) is not supported: it patches one "
                              "model family's eager attention for training only, and breaks padding-free batches and "
                              "the other attention kernels. Remove it (for long contexts, train a model made for that "
                              "length).")
        if self.use_unsloth:
            raise ConfigError("use_unsloth=true is not supported: Unsloth replaces the model's code and parts of the "
                              "training loop" + ("" if on_gpu else ", and needs a CUDA GPU, which this machine lacks")
                              + ". Remove it.")
        if self.enable_liger_kernel:
            if not on_gpu:
                raise ConfigError("enable_liger_kernel=true needs a CUDA GPU: Liger's kernels are Triton GPU kernels, "
                                  "and this machine has none. Remove it on a CPU.")
            if importlib.util.find_spec("liger_kernel") is None:
                raise ConfigError("enable_liger_kernel=true needs liger-kernel: pip install liger-kernel.")
        if self.flash_attn == "fa2":
            if not on_gpu:
                raise ConfigError("flash_attn=fa2 (FlashAttention 2) needs a CUDA GPU, which this machine lacks; use "
                                  "flash_attn=sdpa (or auto).")
            if importlib.util.find_spec("flash_attn") is None:
                raise ConfigError("flash_attn=fa2 needs the flash-attn package: pip install flash-attn "
                                  "--no-build-isolation (or use flash_attn=sdpa).")
        mapped = attention_from_flash_attn(self.flash_attn)
        if mapped and self.attn_implementation and self.attn_implementation != mapped:
            raise ConfigError(f"flash_attn={self.flash_attn} (attn_implementation={mapped}) and attn_implementation="
                              f"{self.attn_implementation} disagree; give one of them.")


def attention_from_flash_attn(flash_attn: str) -> Optional[str]:
    """transformers' `attn_implementation` for LLaMA-Factory's `flash_attn` (None for `auto`: transformers chooses)."""
    return {"disabled": "eager", "sdpa": "sdpa", "fa2": "flash_attention_2"}.get(flash_attn)


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
            "`qwen3_no_thinking`, `smollm2`, `llama3`, `default`, `plain` (for base models without a template), and LLaMA-Factory's "
            "`qwen3_nothink` and `smollm` (ChatML). A template whose special tokens the tokenizer lacks is refused."
        },
    )
    default_system: Optional[str] = field(
        default=None,
        metadata={"help": "System prompt of conversations without one, in place of the built-in `template`'s own "
                  "(also in the chat template saved with the model); needs `template`."},
    )
    cutoff_len: int = field(default=2048, metadata={"help": "Maximum tokens per example after tokenisation."})
    train_on_prompt: bool = field(default=False, metadata={"help": "Also compute the loss on prompt tokens."})
    enable_thinking: bool = field(
        default=True,
        metadata={"help": "Reasoning templates (`qwen3`): true trains replies' thoughts (an empty one where a reply "
                  "has none); false drops thoughts and puts the empty one in the prompt, untrained, in training "
                  "and in the saved chat template (template qwen3 becomes qwen3_no_thinking)."},
    )
    mask_history: bool = field(
        default=False,
        metadata={"help": "SFT: train on the last assistant reply only; earlier turns are context (truncation "
                  "keeps the last turn first)."},
    )
    max_samples: Optional[int] = field(default=None, metadata={"help": "Keep only the first N rows of each dataset."})
    val_size: float = field(
        default=0.0, metadata={"help": "Held-out share (< 1) or count (>= 1) of the training data for evaluation."}
    )
    packing: bool = field(
        default=False, metadata={"help": "SFT: pack several examples per row, attention kept inside each example."}
    )
    neat_packing: bool = field(
        default=False,
        metadata={"help": "LLaMA-Factory's packing without cross-attention: sets packing: true, which here never "
                          "attends across examples."},
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
        default=None, metadata={"help": "Tokenise in this many forked processes (the same rows as one; a first "
                                          "run's cost, the cache serves later runs)."}
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
        if self.default_system is not None and self.template is None:
            from ..data.template import DEFAULT_SYSTEM_NEEDS_A_TEMPLATE

            raise ConfigError(DEFAULT_SYSTEM_NEEDS_A_TEMPLATE)
        if self.neat_packing:
            self.packing = True  # LLaMA-Factory's meaning; alignkit's packing is always without cross-attention
        if not self.enable_thinking:
            if self.template is None:
                raise ConfigError("enable_thinking=false needs a built-in reasoning template: set template: qwen3 "
                                  "(the tokenizer's own template is used as it is).")
            if self.template == "qwen3":
                self.template = "qwen3_no_thinking"  # the one description every formatter and the saved template use
        if self.mask_history and self.train_on_prompt:
            raise ConfigError("mask_history=true (train on the last reply only) and train_on_prompt=true (train on "
                              "every token) contradict each other; keep one.")
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
    # LoRA variants (peft's), LLaMA-Factory's keys.
    use_dora: bool = field(
        default=False, metadata={"help": "DoRA: train a per-output magnitude beside the LoRA direction (peft's use_dora)."}
    )
    use_rslora: bool = field(
        default=False, metadata={"help": "rsLoRA: scale the update by lora_alpha / sqrt(lora_rank) instead of / lora_rank."}
    )
    pissa_init: bool = field(
        default=False,
        metadata={"help": "PiSSA: start the adapter from the base weights' principal singular vectors (their residual "
                  "stays in the base). Stages without a reference model only (pt, sft, rm)."},
    )
    pissa_iter: int = field(
        default=16, metadata={"help": "PiSSA: fast-SVD iterations; -1 computes the full SVD."}
    )
    pissa_convert: bool = field(
        default=False,
        metadata={"help": "PiSSA: also save the adapter converted to plain LoRA on the original base, in "
                  "output_dir/pissa_converted (the initial one in output_dir/pissa_init), as LLaMA-Factory does. "
                  "That folder is the one to merge with `alignkit export`."},
    )
    freeze_vision_tower: bool = field(
        default=True,
        metadata={"help": "Vision-language models: keep the vision encoder's weights frozen (no LoRA on it either)."},
    )
    freeze_multi_modal_projector: bool = field(
        default=True,
        metadata={"help": "Vision-language models: keep the projector from vision features to the language model "
                  "frozen (no LoRA on it either)."},
    )
    freeze_language_model: bool = field(
        default=False,
        metadata={"help": "Vision-language models: keep the language model frozen (train only the parts not frozen "
                  "by the two keys above)."},
    )
    loraplus_lr_ratio: Optional[float] = field(
        default=None, metadata={"help": "LoRA+: lora_B learns at learning_rate times this ratio (peft's LoRA+ optimizer)."}
    )
    loraplus_lr_embedding: float = field(
        default=1e-6, metadata={"help": "LoRA+: the learning rate of LoRA on embedding layers."}
    )

    def __post_init__(self) -> None:
        if self.lora_alpha is None:
            self.lora_alpha = 2 * self.lora_rank
        variants = [k for k in ("use_dora", "use_rslora", "pissa_init", "pissa_convert") if getattr(self, k)]
        if self.loraplus_lr_ratio is not None:
            variants.append("loraplus_lr_ratio")
        if variants and self.finetuning_type != "lora":
            raise ConfigError(f"{', '.join(variants)} apply to finetuning_type=lora, not {self.finetuning_type}; "
                              "remove them or set finetuning_type=lora.")
        if self.loraplus_lr_ratio is not None and not self.loraplus_lr_ratio > 0:
            raise ConfigError(f"loraplus_lr_ratio={self.loraplus_lr_ratio} must be > 0 (LoRA+ papers use 16).")
        if self.pissa_iter == 0 or self.pissa_iter < -1:
            raise ConfigError(f"pissa_iter={self.pissa_iter}: give a number of fast-SVD iterations >= 1, or -1 for "
                              "the full SVD.")
        if self.pissa_convert and not self.pissa_init:
            raise ConfigError("pissa_convert=true converts a PiSSA adapter: set pissa_init=true too, or remove it.")
        if self.use_dora and self.pissa_init:
            raise ConfigError("use_dora and pissa_init together are not supported; choose one.")
        # Whether `stage` names a registered stage is checked by the parser (`alignkit.config.parse`), which
        # sits above the stage registry; constructed directly (chat, export, tests), the default `sft` is used.
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


BOTH_WARMUP_KEYS = ("warmup_ratio and warmup_steps are both given; keep one (transformers 5 reads warmup_steps "
                     "below 1 as a share of the training steps, so warmup_ratio: 0.1 is warmup_steps: 0.1).")


def check_section_combinations(model: ModelArguments, data: DataArguments, finetuning: FinetuningArguments,
                               data_kind: str) -> None:
    """What the model, data and fine-tuning keys refuse together or for the run's stage (`data_kind`: the examples
    it trains on, `alignkit.stages.Stage.data_kind`). Part of the parse's `check_combinations`; the early check runs
    it too (the stages' data kinds are in the key table)."""
    f, d = finetuning, data
    if f.pissa_init and f.stage not in ("pt", "sft", "rm"):
        raise ConfigError(f"pissa_init=true with stage {f.stage}: PiSSA moves the adapter's principal part out of the "
                          "base weights, so the base with the adapter disabled (this stage's reference) is no longer "
                          "the model it starts from. Use PiSSA in pt, sft or rm, then train this stage from that "
                          "run's pissa_converted adapter.")
    if f.pissa_init and model.quantization_bit:
        raise ConfigError("pissa_init with quantization_bit is not supported here (the residual would be quantized "
                          "again); remove one of them.")
    if d.packing and data_kind not in ("text", "supervised"):
        raise ConfigError(f"packing=true applies to stage sft or pt, not {f.stage}; remove it.")
    for key in ("train_on_prompt", "mask_history"):
        if getattr(d, key) and data_kind != "supervised":
            raise ConfigError(f"{key}=true chooses which tokens of an sft conversation train; stage {f.stage} "
                              + ("trains on every token of its text" if data_kind == "text" else
                                 "trains on replies only, never on prompts") + ", so it would have no effect. "
                              "Remove it.")


# The generation keys (`GeneratingArguments`) each stage reads; a stage's own key of the same name (GRPO's
# `temperature`, online DPO's `max_new_tokens`) takes the value instead and is not counted here.
_GENERATION_KEYS_READ = {"sft": "all", "pt": "all", "ppo": {"max_new_tokens"}}
# What the online stages' sampling is, whatever the keys say: a key given with this value states it and passes
# (LLaMA-Factory's PPO example sets `top_k: 0`); any other value is refused.
_ONLINE_SAMPLING = {"do_sample": True, "num_beams": 1}
_PPO_SAMPLING = {**_ONLINE_SAMPLING, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}


def check_generation_keys(stage: str, data_kind: str, own_keys: set[str], given: Iterable[str],
                          generating: GeneratingArguments) -> None:
    """Refuse a generation key given explicitly that the stage would never read (`_GENERATION_KEYS_READ`), unless
    it states what the stage does anyway.

    Args:
        stage, data_kind: the run's stage and the examples it trains on (`prompt`: an online stage).
        own_keys: the stage's own keys (a key of the same name is the stage's, not a generation key).
        given: the keys the config gives (YAML and overrides).
        generating: the built generation section (the values given).
    """
    read = _GENERATION_KEYS_READ.get(stage, set())
    if read == "all":
        return
    generation_keys = {f.name for f in fields(GeneratingArguments)}
    fixed = (_PPO_SAMPLING if stage == "ppo" else _ONLINE_SAMPLING) if data_kind == "prompt" else {}
    for key in given:
        if key in read or key in own_keys or key not in generation_keys:
            continue
        if key in fixed and getattr(generating, key) == fixed[key]:
            continue
        if data_kind != "prompt":
            why = "it generates nothing"
        elif key == "max_new_tokens":
            why = "max_completion_length sets the completions' length"
        elif stage == "ppo":
            why = ("it samples at temperature 1 without top-k, top-p or a penalty, so that its log-probs and KL are "
                   "those of the distribution it samples")
        else:
            knobs = own_keys & {"temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens",
                                "max_completion_length"}
            why = f"it always samples, shaped by its own {', '.join(sorted(knobs))}"
        raise ConfigError(f"{key}={getattr(generating, key)}: stage {stage} does not read this generation key "
                          f"({why}). Remove it.")


def check_warmup_keys(train_kwargs: dict[str, Any], where: str) -> None:
    """Refuse `warmup_ratio` given with `warmup_steps` (`where`: " in FILE" or ""), before either is read."""
    if train_kwargs.get("warmup_ratio") is not None and "warmup_steps" in train_kwargs:
        raise ConfigError(f"{BOTH_WARMUP_KEYS[:-1]}{where}.")


def check_training_values(args: Any) -> None:
    """alignkit's checks of transformers' training keys (`TrainingArguments`), on anything that has them as attributes.

    `TrainingArguments.__post_init__` runs them before transformers' own `__post_init__`, long before the model
    loads: otherwise these values surface as torch tracebacks (`Invalid learning rate`, a DataLoader refusing
    batch_size=0, a ZeroDivisionError from gradient_accumulation_steps=0) after the weights are in memory. The early
    check (`alignkit.config.keytable.check_config_early`) runs them on the given keys over transformers' defaults,
    without importing transformers.
    """
    _check_positive(args, "per_device_train_batch_size", "per_device_eval_batch_size",
                    "gradient_accumulation_steps")
    if not math.isfinite(args.learning_rate) or args.learning_rate < 0:
        raise ConfigError(f"learning_rate={args.learning_rate} must be a finite number >= 0 (e.g. 2e-4 for "
                          "LoRA, 1e-5 for full fine-tuning).")
    if args.weight_decay < 0 or not math.isfinite(args.weight_decay):
        raise ConfigError(f"weight_decay={args.weight_decay} must be >= 0 (0 turns it off).")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(args, key) < 1:
            raise ConfigError(f"{key}={getattr(args, key)} must be in [0, 1) (defaults: 0.9 and 0.999).")
    if args.adam_epsilon < 0:
        raise ConfigError(f"adam_epsilon={args.adam_epsilon} must be >= 0 (default 1e-8).")
    if args.max_steps < -1:
        raise ConfigError(f"max_steps={args.max_steps}: give a positive number of optimizer steps, or -1 "
                          "(the default) to train for num_train_epochs.")
    if args.max_steps <= 0 and not (args.num_train_epochs > 0 and math.isfinite(args.num_train_epochs)):
        raise ConfigError(f"num_train_epochs={args.num_train_epochs} must be > 0 (or set max_steps to a "
                          "positive number of steps).")
    for key, strategy in (("logging_steps", "logging_strategy"), ("save_steps", "save_strategy"),
                          ("eval_steps", "eval_strategy")):
        value = getattr(args, key)
        if getattr(args, strategy) == "steps" and value is not None and value <= 0 \
                and not (key == "eval_steps" and value == 0):  # eval_steps 0/None: use logging_steps
            raise ConfigError(f"{key}={value} must be > 0 with {strategy}=steps (a step count, or a "
                              "share of the run below 1).")
    if args.dataloader_num_workers < 0:
        raise ConfigError(f"dataloader_num_workers={args.dataloader_num_workers} must be >= 0.")
    if not 0 <= args.seed < 2**32:
        raise ConfigError(f"seed={args.seed} must be in [0, 2**32) (numpy's range).")
    if args.warmup_ratio is not None:
        # transformers 5 reads warmup_steps >= 1 as a step count, so a ratio of 1 (warm up for the whole
        # run) cannot be carried over: int(1.0) would be one step.
        if not 0 <= args.warmup_ratio < 1:
            raise ConfigError(f"warmup_ratio={args.warmup_ratio} must be in [0, 1); for a warm-up counted in "
                              "steps give warmup_steps instead.")
        if args.warmup_steps not in (0, args.warmup_ratio):
            raise ConfigError(BOTH_WARMUP_KEYS)


def check_sampling_knobs(args: Any) -> None:
    """Raise a ConfigError for a `top_p`, `top_k`, `min_p` or `repetition_penalty` out of range (generation and the
    online stages' sampling keys)."""
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"top_p={args.top_p} must be in (0, 1] (1 turns nucleus sampling off).")
    if args.top_k < 0:
        raise ConfigError(f"top_k={args.top_k} must be >= 0 (0 turns top-k sampling off).")
    min_p = getattr(args, "min_p", None)
    if min_p is not None and not 0 <= min_p <= 1:
        raise ConfigError(f"min_p={min_p} must be in [0, 1] (unset turns min-p sampling off).")
    if not args.repetition_penalty > 0:
        raise ConfigError(f"repetition_penalty={args.repetition_penalty} must be > 0 (1 means none).")


def _check_positive(args: Any, *keys: str) -> None:
    """Raise a ConfigError naming the first of `keys` whose value is below 1."""
    for key in keys:
        value = getattr(args, key)
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value} must be at least 1.")


# Our defaults where transformers' do not suit this toolkit: logging often enough to see a curve,
# no third-party reporters, and keep our own columns (collators decide what reaches the model).
TRAINING_DEFAULTS: dict[str, Any] = {
    "output_dir": "saves/run",  # under saves/, where the examples write and `alignkit board` looks
    "logging_steps": 1,
    "report_to": "none",
    "remove_unused_columns": False,
    "save_strategy": "steps",
    "save_steps": 500,
    "include_num_input_tokens_seen": "non_padding",  # tokens/s in trainer_log.jsonl counts real tokens
}


def _cuda_available() -> bool:
    """Whether torch sees a CUDA device (imports torch: only asked for the GPU-only kernel keys)."""
    import torch

    return torch.cuda.is_available()


__all__ = ["BOTH_WARMUP_KEYS", "BUNDLED_MODEL_NAME", "DataArguments", "FinetuningArguments", "GeneratingArguments",
           "ModelArguments", "STAGE_NAMES", "TRAINING_DEFAULTS", "attention_from_flash_attn", "check_sampling_knobs",
           "check_generation_keys", "check_section_combinations", "check_training_values", "check_warmup_keys"]
