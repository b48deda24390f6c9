"""`alignkit train`: resolve resumption, attach callbacks, and hand the config to the stage.

Each stage lives in `alignkit/stages/<stage>.py` and exposes `run_<stage>(config, callbacks)`.
The pieces every stage does the same way after training (save, metrics, state, plots) are here.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .callbacks import LogCallback, plot_loss
from .hparams import Config, ConfigError

logger = logging.getLogger(__name__)

# `pt` is causal-LM training on raw text; it shares the SFT trainer.
STAGE_MODULES = {"pt": ("sft", "run_pt"), "sft": ("sft", "run_sft"), "rm": ("rm", "run_rm"),
                 "dpo": ("dpo", "run_dpo"), "grpo": ("grpo", "run_grpo"), "ppo": ("ppo", "run_ppo")}


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest `checkpoint-N` folder that finished saving (has `trainer_state.json`), or None.

    A process killed while saving leaves a folder without `trainer_state.json` (the Trainer writes it
    last); such a folder is skipped so that a restart resumes from the previous good one.
    """
    out = Path(output_dir)
    if not out.is_dir():
        return None
    candidates = []
    for child in out.iterdir():
        if child.is_dir() and child.name.startswith(PREFIX_CHECKPOINT_DIR + "-"):
            try:
                step = int(child.name.split("-")[-1])
            except ValueError:
                continue
            if (child / "trainer_state.json").is_file():
                candidates.append((step, child))
    return str(max(candidates)[1]) if candidates else None


def resolve_resume(config: Config) -> None:
    """Set `training.resume_from_checkpoint` from what `output_dir` holds.

    - `resume_from_checkpoint` given: kept (a path, or `true` meaning the last checkpoint).
    - `overwrite_output_dir: true`: checkpoints there are ignored and the run starts afresh.
    - otherwise the last complete checkpoint in `output_dir`, if any, is resumed.
    """
    t = config.training
    if not t.do_train:
        return
    if t.resume_from_checkpoint not in (None, "", "false", "False"):
        if str(t.resume_from_checkpoint).lower() == "true":
            found = last_complete_checkpoint(t.output_dir)
            if found is None:
                raise ConfigError(f"resume_from_checkpoint=true but {t.output_dir} holds no complete checkpoint.")
            t.resume_from_checkpoint = found
        elif not Path(t.resume_from_checkpoint).is_dir():
            raise ConfigError(f"resume_from_checkpoint={t.resume_from_checkpoint!r} is not a directory.")
        return
    t.resume_from_checkpoint = None
    if t.overwrite_output_dir:
        return
    found = last_complete_checkpoint(t.output_dir)
    if found:
        logger.warning("Resuming from %s (set overwrite_output_dir=true to start afresh).", found)
        t.resume_from_checkpoint = found


def check_output_dir(output_dir: str | os.PathLike) -> None:
    """Stop before anything loads when `output_dir` cannot be written: a regular file in the way, or a
    read-only or permission-denied location (otherwise found when the first checkpoint is saved).

    Nothing is left behind: the probe is a temporary file (inside `output_dir` when it exists) or a
    temporary folder (inside its nearest existing parent).

    Raises:
        ConfigError: naming `output_dir`, what is wrong, and the fix.
    """
    path = Path(output_dir).expanduser().absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == path else f"lies under {existing}, which is a file"
        raise ConfigError(f"output_dir={str(output_dir)!r} {what}, not a folder. Choose another output_dir "
                          "(or move the file away).")
    try:
        if existing == path:
            with tempfile.TemporaryFile(dir=path):
                pass
        else:
            tempfile.TemporaryDirectory(dir=existing).cleanup()
    except OSError as err:
        raise ConfigError(f"output_dir={str(output_dir)!r} cannot be written ({err.strerror or err} in "
                          f"{existing}). Choose an output_dir on a writable file system.") from None


def finish_training(trainer, train_result, config: Config) -> None:
    """What every stage does after `trainer.train()`: save model, metrics and state; plot curves."""
    trainer.save_model()
    trainer.log_metrics("train", train_result.metrics)
    trainer.save_metrics("train", train_result.metrics)
    trainer.save_state()
    if config.finetuning.plot_loss and trainer.is_world_process_zero():
        plot_loss(config.training.output_dir)


def save_eval_metrics(trainer, metrics: dict[str, Any], split: str) -> None:
    """Log and write `<split>_results.json`."""
    trainer.log_metrics(split, metrics)
    trainer.save_metrics(split, metrics)


def run_train(config: Config, callbacks: list[TrainerCallback] | None = None) -> None:
    """Run the stage named by `config.finetuning.stage`."""
    stage = config.finetuning.stage
    module_name, func_name = STAGE_MODULES[stage]
    try:
        module = importlib.import_module(f"alignkit.stages.{module_name}")
        run = getattr(module, func_name)
    except (ImportError, AttributeError):
        raise ConfigError(f"stage {stage!r} is not available in this version of alignkit.") from None
    check_output_dir(config.training.output_dir)
    if config.training.overwrite_output_dir and config.training.do_train:
        out = Path(config.training.output_dir)
        if out.is_dir():
            for child in out.glob(PREFIX_CHECKPOINT_DIR + "-*"):
                shutil.rmtree(child, ignore_errors=True)
    resolve_resume(config)
    all_callbacks = [LogCallback()] + list(callbacks or [])
    run(config, all_callbacks)


__all__ = ["run_train", "check_output_dir", "finish_training", "save_eval_metrics", "resolve_resume",
           "last_complete_checkpoint"]
