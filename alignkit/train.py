"""`alignkit train`: resolve resumption, seed, attach callbacks, and hand the config to the stage.

The stage comes from the registry (`alignkit.stages.STAGES`); what every stage does after building its
trainer (train, evaluate, predict, save) is `alignkit.stages.base.run_stage_trainer`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from transformers import TrainerCallback, enable_full_determinism, set_seed
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .callbacks import STOP_FILE, DivergenceGuard, LogCallback, StopOnRequest, readable_trainer_logs
from .trackers import tracker_callbacks
from .config import Config
from .errors import ConfigError
from .lifecycle import (
    STATE_FILE,
    OutputDirLock,
    checkpoint_problem,
    complete_from_checkpoint,
    final_model_problem,
    reached_end,
    read_state,
    run_completed,
    usable_checkpoint,
)

logger = logging.getLogger(__name__)

RUN_CONFIG_FILE = "run_config.yaml"  # the keys a training run was started with, written into its output_dir


def last_complete_checkpoint(output_dir: str | os.PathLike, need_optimizer: bool = True) -> str | None:
    """The newest `checkpoint-N` folder a run can resume from, or None.

    A checkpoint is trusted only after `lifecycle.checkpoint_problem` finds its state, weights,
    optimizer, scheduler and RNG files sound and finite; a broken newer one (a save cut short by a kill,
    a truncated or NaN file) is moved aside as `invalid-checkpoint-N` with a warning and the previous one
    is tried.
    """
    return usable_checkpoint(output_dir, need_optimizer)


def resolve_resume(config: Config) -> None:
    """Set `training.resume_from_checkpoint` from what `output_dir` holds.

    - `resume_from_checkpoint` a path: kept if that checkpoint is sound, else a ConfigError saying why.
    - `resume_from_checkpoint: true`: the last sound checkpoint; a ConfigError if there is none.
    - `overwrite_output_dir: true`: checkpoints there are ignored and the run starts afresh.
    - otherwise the last sound checkpoint in `output_dir`, if any, is resumed; with none (or none left
      after moving broken ones aside, with a warning) the run starts afresh.
    """
    t = config.training
    if not t.do_train:
        return
    need_optimizer = not t.save_only_model
    if t.resume_from_checkpoint not in (None, "", "false", "False"):
        if str(t.resume_from_checkpoint).lower() == "true":
            found = last_complete_checkpoint(t.output_dir, need_optimizer)
            if found is None:
                raise ConfigError(f"resume_from_checkpoint=true but {t.output_dir} holds no complete checkpoint.")
            t.resume_from_checkpoint = found
        elif not Path(t.resume_from_checkpoint).is_dir():
            raise ConfigError(f"resume_from_checkpoint={t.resume_from_checkpoint!r} is not a directory.")
        else:
            problem = checkpoint_problem(t.resume_from_checkpoint, need_optimizer)
            if problem:
                raise ConfigError(f"resume_from_checkpoint={t.resume_from_checkpoint!r} cannot be resumed from: "
                                  f"{problem}. Choose an earlier checkpoint.")
        return
    t.resume_from_checkpoint = None
    if t.overwrite_output_dir:
        return
    found = last_complete_checkpoint(t.output_dir, need_optimizer)
    if found:
        logger.warning("Resuming from %s (set overwrite_output_dir=true to start afresh).", found)
        t.resume_from_checkpoint = found


def check_output_dir(output_dir: str | os.PathLike, key: str = "output_dir") -> Path:
    """Stop before anything loads when `output_dir` cannot be written: a regular file in the way, or a
    read-only or permission-denied location (otherwise found when the first checkpoint is saved).

    Nothing is left behind: the probe is a temporary file (inside `output_dir` when it exists) or a
    temporary folder (inside its nearest existing parent).

    Args:
        output_dir: the folder a command will write.
        key: what the messages call it (`export_dir` for `alignkit export`).

    Returns:
        The nearest existing folder: `output_dir` itself (absolute) or its nearest existing parent.

    Raises:
        ConfigError: naming `output_dir`, what is wrong, and the fix.
    """
    path = Path(output_dir).expanduser().absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == path else f"lies under {existing}, which is a file"
        raise ConfigError(f"{key}={str(output_dir)!r} {what}, not a folder. Choose another {key} "
                          "(or move the file away).")
    try:
        if existing == path:
            with tempfile.TemporaryFile(dir=path):
                pass
        else:
            tempfile.TemporaryDirectory(dir=existing).cleanup()
    except OSError as err:
        raise ConfigError(f"{key}={str(output_dir)!r} cannot be written ({err.strerror or err} in "
                          f"{existing}). Choose an {key} on a writable file system.") from None
    return existing


def _already_complete(config: Config) -> bool:
    """Whether `output_dir`'s final state shows this run's planned steps done (then say so).

    Only a run that resumes by itself is checked: `overwrite_output_dir` or an explicit checkpoint path
    asks for training again.
    """
    t = config.training
    explicit = str(t.resume_from_checkpoint).lower() not in ("none", "", "false", "true")
    if not t.do_train or t.overwrite_output_dir or explicit:
        return False
    state = run_completed(t.output_dir, t.max_steps, t.num_train_epochs)
    if state is None:
        return False
    missing = final_model_problem(t.output_dir)
    if missing is not None:
        _restore_final_model(config, state, missing)
        return True
    logger.warning(
        "%s is already complete: %d of %d steps; nothing to do. To train again set overwrite_output_dir=true; "
        "to continue raise max_steps or num_train_epochs; to evaluate or predict run with do_train=false.",
        t.output_dir, state.get("global_step"), t.max_steps if t.max_steps > 0 else state.get("max_steps"))
    return True


def _restore_final_model(config: Config, state: dict, missing: str) -> None:
    """A finished run whose final model files are gone: copy them back from a checkpoint at the last step, or
    stop saying that the model is lost and how to train it again."""
    t = config.training
    checkpoint = usable_checkpoint(t.output_dir, need_optimizer=False)
    last = read_state(Path(checkpoint) / STATE_FILE) if checkpoint else None
    if last is None or last.get("global_step") != state.get("global_step"):
        raise ConfigError(
            f"{t.output_dir} is marked complete ({state.get('global_step')} steps) but its final model is gone "
            f"({missing}) and no checkpoint holds the last step. Set overwrite_output_dir=true to train it again.")
    complete_from_checkpoint(checkpoint, t.output_dir)
    logger.warning("%s is complete but its final model was gone (%s): restored it from %s. Nothing left to train.",
                   t.output_dir, missing, checkpoint)


def _finish_interrupted_save(config: Config) -> bool:
    """Whether the checkpoint to resume from already holds the last step (then write the final model).

    A run killed after saving its last checkpoint but before its final save would otherwise be resumed,
    and the Trainer, resumed at `max_steps`, trains one step past it.
    """
    t = config.training
    if not t.resume_from_checkpoint or t.overwrite_output_dir:
        return False
    state = read_state(Path(t.resume_from_checkpoint) / STATE_FILE)
    if state is None or not reached_end(state, t.max_steps, t.num_train_epochs):
        return False
    complete_from_checkpoint(t.resume_from_checkpoint, t.output_dir)
    logger.warning(
        "%s holds the last step (%d of %d) but the final save was interrupted: wrote the final model from it "
        "(the killed run's train_results.json is lost). Nothing left to train.",
        t.resume_from_checkpoint, state.get("global_step"), t.max_steps if t.max_steps > 0 else state.get("max_steps"))
    return True


def run_train(config: Config, callbacks: list[TrainerCallback] | None = None) -> None:
    """Run the stage named by `config.finetuning.stage`, under the output_dir lock, unless it is finished."""
    from .stages import STAGES

    stage = STAGES[config.finetuning.stage]
    t = config.training
    # Before the lock, which writes into output_dir: a read-only folder must fail with this message.
    check_output_dir(t.output_dir)
    # Every run that writes into output_dir holds its lock, evaluation-only runs too: their results
    # files (all_results.json is read, updated and rewritten) would interleave with a training run's.
    writes = t.do_train or t.do_eval or t.do_predict
    lock = OutputDirLock(t.output_dir) if writes and _is_main_process() else contextlib.nullcontext()
    with lock:
        if _is_main_process():
            # A stop request is for the run it was made to; this one starts now (requests made from here
            # on, while it loads, are honoured at its first step).
            (Path(t.output_dir) / STOP_FILE).unlink(missing_ok=True)
        if t.overwrite_output_dir and t.do_train:
            out = Path(t.output_dir)
            if out.is_dir():
                for child in out.glob(PREFIX_CHECKPOINT_DIR + "-*"):
                    shutil.rmtree(child, ignore_errors=True)
                # The final state marks a finished run: left in place, a later plain rerun of this new
                # run, killed before its end, would be taken for finished.
                (out / STATE_FILE).unlink(missing_ok=True)
        if _already_complete(config):
            return
        resolve_resume(config)
        if _finish_interrupted_save(config):
            return
        # One seed for every stage, before the model and its adapters are built (LoRA and score-head
        # initialisation draw from it); the Trainer seeds its data order from `data_seed`, else `seed`.
        enable_full_determinism(t.seed) if t.full_determinism else set_seed(t.seed)
        if t.do_train and _is_main_process():
            write_run_config(config)
        all_callbacks = [LogCallback(), DivergenceGuard(), StopOnRequest()] + tracker_callbacks(
            config.training.report_to) + list(callbacks or [])
        if config.finetuning.pissa_convert:
            from .model.pissa import PissaConvertCallback

            all_callbacks.append(PissaConvertCallback())
        with readable_trainer_logs():
            stage.run(config, all_callbacks)


def write_run_config(config: Config) -> Path:
    """Write the keys this run was started with to `output_dir/run_config.yaml` (what `alignkit board` shows).

    Relative paths in it are relative to the folder the run was started from, which the header names:
    `alignkit train output_dir/run_config.yaml` run from there repeats, or resumes, the run.
    """
    import yaml

    path = Path(config.training.output_dir) / RUN_CONFIG_FILE
    header = (f"# alignkit train {path} (run from the folder below) resumes or repeats this run\n"
              f"# cwd: {os.getcwd()}\n# source: {config.source or '(keys only)'}\n")
    body = yaml.safe_dump(config.values, sort_keys=False, allow_unicode=True)
    partial = path.with_name(RUN_CONFIG_FILE + ".partial")
    partial.write_text(header + body, encoding="utf-8")
    os.replace(partial, path)
    return path


def _is_main_process() -> bool:
    """Rank 0 of a torchrun launch (or a plain single process): the one that holds the output_dir lock."""
    return os.environ.get("RANK", "0") == "0"


__all__ = ["run_train", "check_output_dir", "resolve_resume", "last_complete_checkpoint", "write_run_config",
           "RUN_CONFIG_FILE"]
