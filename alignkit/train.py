"""`alignkit train`: resolve resumption, seed, attach callbacks, and hand the config to the stage.

The stage comes from the registry (`alignkit.stages.STAGES`); what every stage does after building its
trainer (train, evaluate, predict, save) is `alignkit.stages.base.run_stage_trainer`.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from transformers import TrainerCallback, set_seed
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .callbacks import LogCallback
from .hparams import Config, ConfigError

logger = logging.getLogger(__name__)


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


def run_train(config: Config, callbacks: list[TrainerCallback] | None = None) -> None:
    """Run the stage named by `config.finetuning.stage`."""
    from .stages import STAGES

    stage = STAGES[config.finetuning.stage]
    if config.training.overwrite_output_dir and config.training.do_train:
        out = Path(config.training.output_dir)
        if out.is_dir():
            for child in out.glob(PREFIX_CHECKPOINT_DIR + "-*"):
                shutil.rmtree(child, ignore_errors=True)
    resolve_resume(config)
    # Before any model or adapter is built: a fresh LoRA adapter or score head is initialised at random.
    set_seed(config.training.seed)
    stage.run(config, [LogCallback()] + list(callbacks or []))


__all__ = ["run_train", "resolve_resume", "last_complete_checkpoint"]
