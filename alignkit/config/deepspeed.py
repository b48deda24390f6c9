"""A DeepSpeed JSON config checked against the run's own keys before anything loads.

DeepSpeed reads its JSON when the Trainer builds the engine, after the model has loaded, and answers a batch size
that disagrees with the config, a ZeRO stage it does not have or fp16 on a CPU with an assertion traceback from
each process. transformers fills the values written `"auto"` from the config; everything else must already agree.
These checks name the JSON file and its key, and say what to write instead.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional, Union

from ..errors import ConfigError
from ..files import parse_mapping

logger = logging.getLogger(__name__)

ZERO_STAGES = (0, 1, 2, 3)


def read_deepspeed_config(deepspeed: Union[str, dict]) -> tuple[dict[str, Any], str]:
    """The DeepSpeed config as a mapping, and how messages name it (the JSON file, or the `deepspeed` key)."""
    if isinstance(deepspeed, dict):
        return deepspeed, "the deepspeed key"
    path = Path(deepspeed)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"deepspeed={deepspeed!r}: cannot read the file ({err}).") from None
    return parse_mapping(text, str(path), syntax="json", expected="a DeepSpeed config must be a JSON object"), str(path)


def _number(value: Any) -> Optional[float]:
    """A number DeepSpeed will read as is; None for `"auto"` (transformers fills it) or a missing key."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def check_deepspeed_config(deepspeed: Union[str, dict], *, micro_batch: int, grad_accum: int,
                           processes: Optional[int], on_gpu: bool) -> dict[str, Any]:
    """Refuse a DeepSpeed config that disagrees with the run, before the model loads; warn where it overrides it.

    Args:
        deepspeed: the `deepspeed` key: a JSON file's path or the config itself.
        micro_batch: `per_device_train_batch_size`.
        grad_accum: `gradient_accumulation_steps`.
        processes: how many processes train (None: not known yet, as in `alignkit train --nproc N` before the
            launch; each launched process checks again).
        on_gpu: whether a GPU is there (DeepSpeed's fp16 needs one).

    Returns:
        The config as a mapping.

    Raises:
        ConfigError: naming the JSON file, the key and the fix.
    """
    config, where = read_deepspeed_config(deepspeed)
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"{where}: zero_optimization must be a JSON object, e.g. {{\"stage\": 2}}.")
    stage = zero.get("stage", 0)
    if stage != "auto" and stage not in ZERO_STAGES:
        raise ConfigError(f"{where}: zero_optimization.stage={stage!r}; DeepSpeed has the ZeRO stages 0, 1, 2 and 3.")
    fp16 = config.get("fp16", {})
    if isinstance(fp16, dict) and fp16.get("enabled") is True and not on_gpu:
        raise ConfigError(f"{where}: fp16.enabled is true, but there is no GPU: DeepSpeed's fp16 runs on GPUs. Set "
                          "it to \"auto\" (follows the config's fp16 key) or false.")
    micro = _number(config.get("train_micro_batch_size_per_gpu"))
    if micro is not None and micro != micro_batch:
        raise ConfigError(f"{where}: train_micro_batch_size_per_gpu={micro:g} but per_device_train_batch_size="
                          f"{micro_batch}; write \"auto\" there (transformers fills it from the config), or make them "
                          "equal.")
    accum = config.get("gradient_accumulation_steps")
    if accum is None and grad_accum != 1:
        raise ConfigError(f"{where} has no gradient_accumulation_steps, so DeepSpeed takes 1, but the config sets "
                          f"gradient_accumulation_steps={grad_accum}; add \"gradient_accumulation_steps\": \"auto\".")
    if _number(accum) is not None and accum != grad_accum:
        raise ConfigError(f"{where}: gradient_accumulation_steps={accum:g} but the config sets {grad_accum}; write "
                          "\"auto\" there, or make them equal.")
    total = _number(config.get("train_batch_size"))
    if total is not None and processes is not None and total != micro_batch * grad_accum * processes:
        raise ConfigError(f"{where}: train_batch_size={total:g}, but per_device_train_batch_size x "
                          f"gradient_accumulation_steps x processes = {micro_batch} x {grad_accum} x {processes} = "
                          f"{micro_batch * grad_accum * processes}; write \"auto\" there, or make them agree.")
    if "scheduler" in config:
        logger.warning("%s has a scheduler block: DeepSpeed's %s schedule replaces the config's lr_scheduler_type "
                       "and warm-up (its \"auto\" values are filled from them). Remove the block to train with the "
                       "config's schedule.", where, (config["scheduler"] or {}).get("type", "own"))
    return config


__all__ = ["check_deepspeed_config", "read_deepspeed_config"]
