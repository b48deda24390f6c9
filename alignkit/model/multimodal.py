"""Vision-language models: which parts a model has, which of them train, and its processor.

A model is vision-language when its config has a `vision_config`; it then loads with transformers'
`AutoModelForImageTextToText` and its `AutoProcessor` (tokenizer + image processor). Its three parts are found by
module name (`VISION_PARTS`, transformers 5's names) and frozen as LLaMA-Factory's keys say: `freeze_vision_tower`
(default true), `freeze_multi_modal_projector` (default true), `freeze_language_model` (default false). Under LoRA
a frozen part gets no adapter either, so by default LoRA targets the language model alone, as LLaMA-Factory's
does. Only the architectures in `VISION_PARTS` are accepted; docs/multimodal.md says which have run.
"""

from __future__ import annotations

import logging
import re
from typing import Optional

from ..errors import ConfigError

logger = logging.getLogger(__name__)

# model_type -> (vision tower, projector, language model): module-name prefixes inside the model.
VISION_PARTS = {
    "llava": ("model.vision_tower", "model.multi_modal_projector", "model.language_model"),
    "idefics3": ("model.vision_model", "model.connector", "model.text_model"),
}
FREEZE_KEYS = ("freeze_vision_tower", "freeze_multi_modal_projector", "freeze_language_model")
# model_type -> why it is refused, where that is known (docs/multimodal.md has the checks behind each).
NOT_RUN_BECAUSE = {
    "smolvlm": "its processor (SmolVLMProcessor) cannot be built on the machine alignkit is tested on: it needs "
               "torchvision (its video processor, a required part even for images) and num2words, neither installed "
               "there. SmolVLM v1 checkpoints (SmolVLM-Instruct, -256M, -500M) are model_type idefics3 and run as "
               "Idefics3",
}


def vision_language_type(config) -> Optional[str]:
    """The `model_type` of a vision-language model's config (one with a `vision_config`), else None."""
    return config.model_type if getattr(config, "vision_config", None) is not None else None


def check_supported(model_type: str, path: str) -> None:
    """Refuse a vision-language architecture whose parts `VISION_PARTS` does not name."""
    if model_type not in VISION_PARTS:
        why = f" ({NOT_RUN_BECAUSE[model_type]})" if model_type in NOT_RUN_BECAUSE else ""
        raise ConfigError(f"{path} is a vision-language model of type {model_type!r}, which alignkit has not been "
                          f"built and tested for{why}; supported: {', '.join(sorted(VISION_PARTS))} "
                          "(docs/multimodal.md).")


def frozen_prefixes(model_type: str, finetuning_args) -> list[str]:
    """The module-name prefixes of the parts the freeze keys keep frozen."""
    parts = VISION_PARTS[model_type]
    return [prefix for prefix, key in zip(parts, FREEZE_KEYS) if getattr(finetuning_args, key)]


def _under(name: str, prefixes: list[str]) -> bool:
    return any(name == p or name.startswith(p + ".") or f".{p}." in f".{name}." for p in prefixes)


def freeze_parts(model, model_type: str, finetuning_args) -> None:
    """Full fine-tuning: every weight trains but those of the frozen parts (the language model's output head
    goes with the language model)."""
    prefixes = frozen_prefixes(model_type, finetuning_args)
    if finetuning_args.freeze_language_model:
        prefixes.append("lm_head")
    for name, param in model.named_parameters():
        param.requires_grad_(not _under(name, prefixes))


def lora_target_pattern(model, model_type: str, finetuning_args, targets: list[str]) -> str:
    """A peft `target_modules` regex: the linear layers named `targets` outside the frozen parts.

    Raises:
        ConfigError: every part is frozen, or no target layer is left.
    """
    prefixes = frozen_prefixes(model_type, finetuning_args)
    if len(prefixes) == len(FREEZE_KEYS):
        raise ConfigError("freeze_vision_tower, freeze_multi_modal_projector and freeze_language_model are all true: "
                          "nothing would train. Set one of them to false.")
    names = "|".join(re.escape(t) for t in targets)
    frozen = "|".join(re.escape(p) for p in prefixes)
    pattern = rf"^(?!(?:.*\.)?(?:{frozen})\.).*\.(?:{names})$" if frozen else rf"^.*\.(?:{names})$"
    if not any(re.fullmatch(pattern, name) for name, _ in model.named_modules()):
        raise ConfigError(f"lora_target: none of {', '.join(targets)} lies outside the frozen parts "
                          f"({', '.join(prefixes)}); unfreeze a part or name other layers.")
    return pattern


def load_processor(path: str, tokenizer, hub_kwargs: dict):
    """The model's `AutoProcessor`, holding `tokenizer` (the one the run trains and saves with).

    Raises:
        ConfigError: the folder has no processor, or no image processor in it.
    """
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path, **hub_kwargs)
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(f"{path} is a vision-language model but its processor does not load ({err}); the folder "
                          "needs the processor's files (processor_config.json / preprocessor_config.json).") from None
    if getattr(processor, "image_processor", None) is None or not hasattr(processor, "image_token"):
        raise ConfigError(f"{path}: the processor {type(processor).__name__} has no image processor or image token.")
    processor.tokenizer = tokenizer
    return processor


__all__ = ["VISION_PARTS", "FREEZE_KEYS", "NOT_RUN_BECAUSE", "vision_language_type", "check_supported", "frozen_prefixes",
           "freeze_parts", "lora_target_pattern", "load_processor"]
