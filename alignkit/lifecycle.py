"""A run's life in its `output_dir`: one run at a time, checkpoints checked before they are trusted, and
a finished run recognised instead of trained again.

Jobs get killed, re-submitted and started twice. What this module guarantees:

- `OutputDirLock`: one process writes into an `output_dir` at a time. The lock is an `fcntl.flock` on
  `output_dir/.alignkit.lock`, which the kernel releases when its holder dies, however it dies; the file
  records the holder (pid, host, start time) for the message a second run gets. A file left by a killed
  run is therefore stale by construction and is simply taken over.
- `checkpoint_problem`: a checkpoint is trusted only if everything a resume loads is there and sound:
  `trainer_state.json` parses and names the folder's step, the model weights, optimizer, scheduler and
  RNG files load (with `weights_only=True`), and every tensor is finite. `usable_checkpoint` walks from
  the newest checkpoint back to the first sound one and moves the broken ones aside.
- `run_completed` / `complete_from_checkpoint`: a run whose final state shows the planned steps done is
  not trained again; one killed after its last checkpoint but before its final save is finished from
  that checkpoint (the Trainer, resumed at `max_steps`, would train one step past it).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .errors import ConfigError

logger = logging.getLogger(__name__)

LOCK_FILE = ".alignkit.lock"
STATE_FILE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME; the Trainer writes it last
INVALID_PREFIX = "invalid-"  # broken checkpoints are renamed `invalid-checkpoint-N`, out of the Trainer's glob
# What a checkpoint holds besides the model: `save_model` writes everything else, so the rest of the
# folder is exactly the final model `Trainer.save_model(output_dir)` would write.
TRAINING_STATE_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth", STATE_FILE,
                        "optimizer.bin", "pytorch_model_fsdp.bin")
# Where a checkpoint keeps the optimizer state, by who wrote it: the Trainer (`optimizer.pt`), or under FSDP
# accelerate's `save_fsdp_optimizer`: a full state dict (`optimizer.bin`, `fsdp_state_dict_type:
# FULL_STATE_DICT`) or a torch.distributed.checkpoint folder of shards (`optimizer_0`, SHARDED_STATE_DICT).
OPTIMIZER_STATES = ("optimizer.pt", "optimizer.bin", "optimizer_0")
MODEL_FILES = ("adapter_model.safetensors", "adapter_model.bin", "model.safetensors", "pytorch_model.bin",
               "model.safetensors.index.json", "pytorch_model.bin.index.json")


# ---------------------------------------------------------------------------------------------------
# The output_dir lock
# ---------------------------------------------------------------------------------------------------


class OutputDirLock:
    """Exclusive lock on `output_dir` for the life of a run (a context manager).

    Args:
        output_dir: the run's output folder; created if missing.

    Raises:
        ConfigError: another live process holds the lock (the message names its pid, host and start
            time), or the file system does not support locks.
    """

    def __init__(self, output_dir: str | os.PathLike) -> None:
        self.path = Path(output_dir) / LOCK_FILE
        self.fd: int | None = None

    def __enter__(self) -> "OutputDirLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                raise ConfigError(f"cannot write in output_dir {self.path.parent} ({err.strerror}): choose a "
                                  "writable output_dir.") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                holder = _read_holder(fd)
                os.close(fd)
                if err.errno in (errno.EAGAIN, errno.EACCES):
                    raise ConfigError(
                        f"output_dir {self.path.parent} is in use by another run ({_describe(holder)}); "
                        "wait for it to finish, stop it, or choose another output_dir."
                    ) from None
                raise ConfigError(f"cannot lock {self.path} ({err.strerror}): put output_dir on a file system "
                                  "that supports file locks.") from None
            # The previous holder may have removed the file between our open and our flock; then we
            # hold a lock on a deleted file, which protects nothing: open the new one and try again.
            try:
                same_file = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same_file = False
            if same_file:
                break
            os.close(fd)
        previous = _read_holder(fd)
        if previous:
            # The kernel drops a flock when its holder dies, so a file we could lock is left by a dead run.
            logger.warning("Taking over the lock on %s left by a run that is gone (%s).", self.path.parent,
                           _describe(previous))
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self.fd is None:
            return
        # Remove the file while still holding the lock, so that a finished run leaves no trace and a
        # waiting process notices (see the samestat check) that it locked a removed file.
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None


def _read_holder(fd: int) -> dict[str, Any] | None:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", errors="replace")
        return json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return {"pid": "?", "host": "?", "started": "? (unreadable lock file)"}


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "holder unknown"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"


# ---------------------------------------------------------------------------------------------------
# Checkpoint verification
# ---------------------------------------------------------------------------------------------------


def checkpoint_step(path: Path) -> int | None:
    """N of a `checkpoint-N` folder, or None for any other name."""
    prefix = PREFIX_CHECKPOINT_DIR + "-"
    if not path.name.startswith(prefix):
        return None
    try:
        return int(path.name[len(prefix):])
    except ValueError:
        return None


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The `checkpoint-N` folders of `output_dir`, newest (largest N) first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in out.iterdir() if p.is_dir()]
    return [p for step, p in sorted((s, p) for s, p in found if s is not None)[::-1]]


def read_state(path: str | os.PathLike) -> dict[str, Any] | None:
    """A `trainer_state.json` as a dict, or None when it is missing or does not parse."""
    try:
        state = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _nonfinite_tensor(obj: Any, name: str) -> str | None:
    """Name of the first non-finite tensor inside nested dicts/lists, or None."""
    import torch

    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and not bool(torch.isfinite(obj).all()):
            return name
        return None
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return None
    for key, value in items:
        found = _nonfinite_tensor(value, f"{name}[{key!r}]")
        if found:
            return found
    return None


def _check_weights_file(path: Path) -> str | None:
    """Why a weights file cannot be used (unloadable or non-finite), or None."""
    import torch

    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    tensor = f.get_tensor(key)
                    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                        return f"{path.name}: tensor {key} is not finite"
            return None
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated or foreign files raise many different errors
        return f"{path.name} does not load ({type(err).__name__}: {str(err)[:120]})"
    bad = _nonfinite_tensor(state, path.name)
    return f"{bad} is not finite" if bad else None


def _model_files(folder: Path) -> list[Path] | str:
    """The weight files of the model saved in `folder`, or why there are none."""
    present = [name for name in MODEL_FILES if (folder / name).is_file()]
    if (folder / "adapter_config.json").is_file() and not any(n.startswith("adapter_model") for n in present):
        return "adapter_config.json without adapter_model.safetensors"
    if not present:
        return "no model weights"
    files = []
    for name in present:
        if name.endswith(".index.json"):
            try:
                shards = sorted(set(json.loads((folder / name).read_text(encoding="utf-8"))["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError):
                return f"{name} does not parse"
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                return f"{name} names missing shards {missing}"
            files += [folder / s for s in shards]
        else:
            files.append(folder / name)
    return files


def checkpoint_problem(folder: str | os.PathLike, need_optimizer: bool = True) -> str | None:
    """Why `folder` cannot be resumed from, or None when everything a resume loads is sound.

    Checks, cheapest first: `trainer_state.json` parses and its `global_step` is the folder's N; the
    model weights are there (an adapter's, a full model's or all shards of one), load and are finite;
    the optimizer state (`OPTIMIZER_STATES`: `optimizer.pt`, or FSDP's `optimizer.bin` / `optimizer_0/`) and
    `scheduler.pt` (unless `need_optimizer=False`, for `save_only_model` runs) and `rng_state.pth` load with
    `weights_only=True` and the optimizer's tensors are finite (a sharded `optimizer_0/` is checked for its
    `.metadata` only: reading the shards needs the process group); a DeepSpeed checkpoint (a `latest` file) holds
    instead the engine's optimizer files in the folder `latest` names.

    Args:
        folder: a `checkpoint-N` folder.
        need_optimizer: whether the optimizer and scheduler states must be present.

    Returns:
        A short reason for the warning, or None.
    """
    import torch
    from transformers.trainer_pt_utils import safe_globals

    folder = Path(folder)
    state = read_state(folder / STATE_FILE)
    if state is None:
        reason = "missing" if not (folder / STATE_FILE).exists() else "empty or does not parse"
        return f"{STATE_FILE} {reason} (the save was interrupted)"
    step = checkpoint_step(folder)
    if step is not None and state.get("global_step") != step:
        return f"{STATE_FILE} says global_step={state.get('global_step')}, the folder says {step}"
    files = _model_files(folder)
    if isinstance(files, str):
        return files
    for path in files:
        problem = _check_weights_file(path)
        if problem:
            return problem
    deepspeed_tag = folder / "latest"
    if deepspeed_tag.is_file():
        # A DeepSpeed engine's checkpoint: the optimizer state lives in the folder `latest` names, one file
        # per process; scheduler.pt only when the Trainer's scheduler ran (a DeepSpeed `scheduler` block is
        # saved by the engine).
        problem = _deepspeed_problem(folder, deepspeed_tag) if need_optimizer else None
        if problem:
            return problem
        optimizer, required = None, []
    else:
        optimizer = next((name for name in OPTIMIZER_STATES if (folder / name).exists()), "optimizer.pt")
        if optimizer == "optimizer_0":
            if not (folder / optimizer / ".metadata").is_file():
                return "optimizer_0/.metadata missing (the sharded save was interrupted)"
            optimizer = None
        required = [name for name in (optimizer, "scheduler.pt") if name] if need_optimizer else []
    for name in required + ["rng_state.pth"]:
        path = folder / name
        if not path.is_file():
            if name in required:
                return f"{name} missing"
            continue
        try:
            with safe_globals():
                loaded = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            return f"{name} does not load ({type(err).__name__}: {str(err)[:120]})"
        if name == optimizer:
            bad = _nonfinite_tensor(loaded, name)
            if bad:
                return f"{bad} is not finite"
    return None


def _deepspeed_problem(folder: Path, tag_file: Path) -> str | None:
    """What is missing from a DeepSpeed checkpoint's engine state, or None.

    Example: `checkpoint-2/latest` says `global_step2`; `checkpoint-2/global_step2/` must hold
    `zero_pp_rank_<r>_mp_rank_00_optim_states.pt` files (ZeRO-1/2/3; `*optim_states.pt` in general), none empty.
    Their contents are DeepSpeed's own pickles, loaded by the engine at resume, so only their presence is checked.
    """
    tag = tag_file.read_text(encoding="utf-8").strip()
    state_dir = folder / tag
    if not tag or not state_dir.is_dir():
        return f"DeepSpeed's `latest` names {tag!r}, which is not a folder of {folder.name} (the save was interrupted)"
    optimizer_files = sorted(state_dir.glob("*optim_states.pt"))
    if not optimizer_files:
        return f"{tag}/ holds no *optim_states.pt (DeepSpeed's optimizer state; the save was interrupted)"
    empty = [p.name for p in optimizer_files if p.stat().st_size == 0]
    if empty:
        return f"{tag}/{empty[0]} is empty (the save was interrupted)"
    return None


def set_aside(folder: Path, reason: str) -> Path:
    """Rename a broken checkpoint to `invalid-checkpoint-N` (kept for inspection, out of the Trainer's way).

    Every process of a multi-process run checks the checkpoints before training, so several may find the same
    one broken: the first to rename it wins, and the others find it moved and leave it.
    """
    target = folder.with_name(INVALID_PREFIX + folder.name)
    try:
        if target.exists() and folder.exists():
            shutil.rmtree(target, ignore_errors=True)  # an older one; another process may be removing it too
        folder.rename(target)
    except FileNotFoundError:
        if not target.exists():
            raise
        return target  # another process of this run moved it first
    logger.warning("Checkpoint %s is unusable (%s): moved it to %s.", folder, reason, target.name)
    return target


def usable_checkpoint(output_dir: str | os.PathLike, need_optimizer: bool = True) -> str | None:
    """The newest checkpoint in `output_dir` that `checkpoint_problem` passes, or None.

    Broken checkpoints newer than it are moved aside with a warning (`set_aside`): the resumed run will
    save a folder of the same name, and files of the broken one must not mix into it. With no usable
    checkpoint left the caller starts afresh; nothing is deleted.
    """
    for folder in list_checkpoints(output_dir):
        problem = checkpoint_problem(folder, need_optimizer)
        if problem is None:
            return str(folder)
        set_aside(folder, problem)
    return None


# ---------------------------------------------------------------------------------------------------
# Finished runs
# ---------------------------------------------------------------------------------------------------


def reached_end(state: dict[str, Any], max_steps: int, num_train_epochs: float) -> bool:
    """Whether a saved `TrainerState` has done the whole plan of a run configured with these values.

    `max_steps > 0` plans a number of steps; otherwise the Trainer planned `state["max_steps"]` steps
    for `num_train_epochs` epochs, and the state must have done them and reached that epoch (a run
    asked for more epochs than a finished one did is not finished).
    """
    done = state.get("global_step") or 0
    if max_steps > 0:
        return done >= max_steps
    planned = state.get("max_steps") or 0
    epoch = state.get("epoch") or 0.0
    return planned > 0 and done >= planned and epoch >= num_train_epochs - 1e-6


def run_completed(output_dir: str | os.PathLike, max_steps: int, num_train_epochs: float) -> dict[str, Any] | None:
    """The final `trainer_state.json` of `output_dir` if it shows the planned training done, else None.

    `run_stage_trainer` writes that file after the final model and metrics, so it marks a finished run.
    """
    state = read_state(Path(output_dir) / STATE_FILE)
    if state is not None and reached_end(state, max_steps, num_train_epochs):
        return state
    return None


def final_model_problem(output_dir: str | os.PathLike) -> str | None:
    """Why `output_dir` holds no final model (its weight files are missing or name missing shards), or None."""
    files = _model_files(Path(output_dir))
    return files if isinstance(files, str) else None


def complete_from_checkpoint(checkpoint: str | os.PathLike, output_dir: str | os.PathLike) -> None:
    """Write the final model of a run whose last checkpoint is at its last step, from that checkpoint.

    A checkpoint holds exactly what `Trainer.save_model` writes plus the training state, so copying its
    model files gives the final model bit for bit; `trainer_state.json` is copied last, marking the run
    complete. The train metrics of the killed process (`train_results.json`) are lost with it.
    """
    src, out = Path(checkpoint), Path(output_dir)
    for path in sorted(src.iterdir()):
        if path.is_file() and path.name not in TRAINING_STATE_FILES and not path.name.startswith("rng_state"):
            _copy_atomically(path, out / path.name)
    _copy_atomically(src / STATE_FILE, out / STATE_FILE)


def _copy_atomically(src: Path, dst: Path) -> None:
    partial = dst.with_name(dst.name + ".partial")
    shutil.copyfile(src, partial)
    os.replace(partial, dst)


def json_safe(metrics: dict[str, Any]) -> dict[str, Any]:
    """`metrics` with non-finite floats replaced by None, so the JSON written from it is valid JSON.

    Python's `json` writes `NaN` and `Infinity`, which strict readers (jq, JavaScript, most languages)
    refuse. Example: json_safe({"eval_loss": nan, "epoch": 1.0}) -> {"eval_loss": None, "epoch": 1.0}.
    """
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}


__all__ = [
    "OutputDirLock",
    "final_model_problem",
    "checkpoint_problem",
    "checkpoint_step",
    "list_checkpoints",
    "read_state",
    "set_aside",
    "usable_checkpoint",
    "reached_end",
    "run_completed",
    "complete_from_checkpoint",
    "json_safe",
]
