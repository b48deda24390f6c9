"""`alignkit train --nproc N` and `FORCE_TORCHRUN=1`: start the run again under torchrun.

alignkit has no distributed runtime of its own: several processes come from torchrun (or `accelerate launch`,
or `deepspeed`), each running `alignkit train` unchanged. This module only builds the torchrun command line
for users who would rather not type it:

- `alignkit train --nproc N CONFIG [key=value ...]` runs
  `python -m torch.distributed.run --standalone --nproc_per_node N -m alignkit train CONFIG [key=value ...]`.
- `FORCE_TORCHRUN=1 alignkit train CONFIG` does the same with LLaMA-Factory's variables: `NPROC_PER_NODE`
  (default: the number of GPUs, 1 without), and for several nodes `NNODES`, `NODE_RANK`, `MASTER_ADDR`
  (default 127.0.0.1) and `MASTER_PORT` (default 29500), run on every node with its own `NODE_RANK`.
- Inside a launched worker (`WORLD_SIZE` or `LOCAL_RANK` set) nothing is launched again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Mapping, Optional, Sequence

_TRUE = ("1", "true", "yes", "y", "on")


def _device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _env_int(env: Mapping[str, str], key: str, default: int) -> int:
    from .hparams import ConfigError

    value = env.get(key, "").strip()
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r} must be a whole number.") from None
    if number < (0 if key == "NODE_RANK" else 1):
        raise ConfigError(f"{key}={value!r} must be {'>= 0' if key == 'NODE_RANK' else 'at least 1'}.")
    return number


def torchrun_command(train_args: Sequence[str], nproc: Optional[int], env: Mapping[str, str],
                     python: str = sys.executable) -> Optional[list[str]]:
    """The torchrun command that runs `alignkit train *train_args`, or None to run in this process.

    Args:
        train_args: what follows `alignkit train` (config and overrides), without `--nproc`.
        nproc: the `--nproc` option (None when not given).
        env: the environment (`FORCE_TORCHRUN`, `NPROC_PER_NODE`, `NNODES`, `NODE_RANK`, `MASTER_ADDR`,
            `MASTER_PORT`; a worker's `WORLD_SIZE` / `LOCAL_RANK`).
        python: the interpreter that runs torchrun and the workers.

    Returns:
        None inside a launched worker, or with neither `--nproc` above 1 nor `FORCE_TORCHRUN`; else the
        command. Example: `torchrun_command(["c.yaml"], 2, {})` ->
        `[python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "alignkit",
        "train", "c.yaml"]`.

    Raises:
        ConfigError: a variable that is not a valid number.
    """
    from .hparams import ConfigError

    if "WORLD_SIZE" in env or "LOCAL_RANK" in env:
        return None
    forced = env.get("FORCE_TORCHRUN", "").strip().lower() in _TRUE
    if nproc is not None and nproc < 1:
        raise ConfigError(f"--nproc {nproc}: give the number of processes to start on this machine (1 or more).")
    if nproc is None:
        if not forced:
            return None
        nproc = _env_int(env, "NPROC_PER_NODE", 0) or _device_count()
    elif nproc == 1 and not forced:
        return None
    nnodes = _env_int(env, "NNODES", 1)
    command = [python, "-m", "torch.distributed.run"]
    if nnodes == 1 and not env.get("MASTER_PORT"):
        command.append("--standalone")  # a free port on localhost, chosen by torchrun
    else:
        command += ["--nnodes", str(nnodes), "--node_rank", str(_env_int(env, "NODE_RANK", 0)),
                    "--master_addr", env.get("MASTER_ADDR") or "127.0.0.1",
                    "--master_port", env.get("MASTER_PORT") or "29500"]
    return command + ["--nproc_per_node", str(nproc), "-m", "alignkit", "train", *train_args]


def relaunch(command: list[str]) -> int:
    """Run `command` (from `torchrun_command`) and return its exit status."""
    import logging

    logging.getLogger(__name__).info("Starting %s", " ".join(command))
    return subprocess.call(command, env=dict(os.environ, FORCE_TORCHRUN="0"))


__all__ = ["torchrun_command", "relaunch"]
