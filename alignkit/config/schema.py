"""The config schema: one dataclass per concern, each checking its own fields (the low floor of the config).

A run's settings arrive as flat `key: value` pairs (YAML and `key=value` overrides); `alignkit.config.parse`
hands each key to the dataclass here that owns it (or to the stage's own dataclass, `Config.method`) and
builds them. Each dataclass checks its own fields in `__post_init__` and raises `ConfigError` naming the key
and the fix, before any model is loaded. Checks that span sections, or need the stage registry (whether
`stage` names a stage, which keys a stage has, what a stage refuses), are the parser's: this module sits
below the stages, which import it, so it imports none of them.

Key names follow LLaMA-Factory where it has the feature and TRL otherwise; every field of
`transformers.Seq2SeqTrainingArguments` is accepted as is.

The sections that need neither torch nor transformers (model, data, fine-tuning, generation) are defined in
`alignkit.config.sections`, so the early check can build them; this module adds `TrainingArguments` and `Config`.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import Seq2SeqTrainingArguments

from ..env import launched_processes
from ..errors import ConfigError
from .deepspeed import check_deepspeed_config
from .sections import (
    BOTH_WARMUP_KEYS,
    BUNDLED_MODEL_NAME,
    STAGE_NAMES,
    TRAINING_DEFAULTS,
    DataArguments,
    FinetuningArguments,
    GeneratingArguments,
    ModelArguments,
    check_sampling_knobs,
    check_training_values,
)


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
    bf16: bool = field(
        default="auto",  # type: ignore[assignment]  # `auto` is settled before training (see the help)
        metadata={
            "help": "bf16 mixed precision: true, false, or auto (the default). auto trains in bf16 on an "
            "accelerator that has it; on a CPU with bf16 hardware (AVX512-BF16, AMX) it times one training step "
            "of the model in fp32 and in bf16 autocast (cached per machine and model) and keeps fp32 unless bf16 "
            "is at least 1.1x faster; fp32 on other CPUs and under DeepSpeed/FSDP on a CPU. One info line says "
            "which and why; ALIGNKIT_PRECISION_PROBE=off makes auto fp32 on a CPU."
        },
    )
    warmup_ratio: Optional[float] = field(
        default=None,
        metadata={
            "help": "Warm up over this share of the training steps, in [0, 1) (LLaMA-Factory's and transformers "
            "4's key). transformers 5 folded it into `warmup_steps`, where a value below 1 is a share; it is "
            "copied there, so give one of the two."
        },
    )

    def __post_init__(self) -> None:
        check_training_values(self)
        if self.warmup_ratio is not None:
            self.warmup_steps = self.warmup_ratio
        if self.deepspeed:
            _check_deepspeed(self.deepspeed)
            check_deepspeed_config(
                self.deepspeed, micro_batch=self.per_device_train_batch_size, grad_accum=self.gradient_accumulation_steps,
                processes=launched_processes() if "WORLD_SIZE" in os.environ else None,
                on_gpu=torch.cuda.is_available())
        # `bf16: auto` left for a probe (`config.parse.settle_auto_bf16`): fp32 until the training run's first
        # trainer settles it at the model's own shapes (`model.precision.resolve_auto_bf16`).
        self.bf16_auto = self.bf16 == "auto"
        if self.bf16_auto:
            self.bf16 = False
        super().__post_init__()


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


ARG_CLASSES = (ModelArguments, DataArguments, TrainingArguments, FinetuningArguments, GeneratingArguments)

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

    @property
    def dir(self) -> Optional[str]:
        """The config file's folder, where relative paths (reward files, reward models, tools) are looked up
        first; None for a run given by keys alone."""
        return str(Path(self.source).parent) if self.source else None


__all__ = ["ARG_CLASSES", "BOTH_WARMUP_KEYS", "BUNDLED_MODEL_NAME", "Config", "DataArguments", "FinetuningArguments",
           "GeneratingArguments", "ModelArguments", "STAGE_NAMES", "TRAINING_DEFAULTS", "TrainingArguments",
           "check_sampling_knobs"]
