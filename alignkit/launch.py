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
- A DeepSpeed run started alone (`alignkit train ds.yaml`, no launcher) gets the variables torchrun would give
  one process (`single_process_rendezvous`), since DeepSpeed sets up torch.distributed even for one process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Optional, Sequence

_TRUE = ("1", "true", "yes", "y", "on")


def _device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _env_int(env: Mapping[str, str], key: str, default: int) -> int:
    from .errors import ConfigError

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
    from .errors import ConfigError

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


def asks_for_deepspeed(config_path: str, overrides: Sequence[str]) -> bool:
    """Whether `alignkit train CONFIG key=value ...` sets the `deepspeed` key (a later override wins)."""
    from .config.values import parse_override
    from .files import load_yaml

    value = load_yaml(config_path).get("deepspeed")
    for item in overrides:
        key, given = parse_override(item)
        if key == "deepspeed":
            value = given
    return bool(value)


def single_process_rendezvous(env: Mapping[str, str]) -> dict[str, str]:
    """The variables torchrun would give one process, for a DeepSpeed run started without a launcher.

    DeepSpeed sets up torch.distributed even for one process, and without a launcher's variables it looks for
    MPI (and fails without mpi4py), so `alignkit train ds.yaml` alone would crash inside DeepSpeed. With these
    it is what `torchrun --standalone --nproc_per_node 1 -m alignkit train ds.yaml` runs. Inside a launched
    worker (`WORLD_SIZE` or `LOCAL_RANK` set): nothing. The port is a free one on localhost.

    Example: `{}` -> `{"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "<free port>"}`.
    """
    if "WORLD_SIZE" in env or "LOCAL_RANK" in env:
        return {}
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": env.get("MASTER_ADDR") or "127.0.0.1", "MASTER_PORT": env.get("MASTER_PORT") or str(port)}


# Where the workers of a relaunched run leave the messages of errors in the user's input (`report_worker_error`).
ERROR_DIR_VARIABLE = "ALIGNKIT_ERROR_DIR"
_TRACEBACK = b"Traceback (most recent call last):"


def relaunch(command: list[str]) -> int:
    """Run `command` (from `torchrun_command`) and return its exit status.

    An error in the user's input that only the workers meet (a dataset that does not load, say) ends every worker
    with it; each leaves its message in a folder this process gives them instead of printing it. This process
    then prints it once and returns 2, as a one-process run does, and leaves out torchrun's traceback reporting
    the failed workers, which says nothing more. Any other failure keeps its output and torchrun's status.
    """
    import logging
    import tempfile

    logging.getLogger(__name__).info("Starting %s", " ".join(command))
    with tempfile.TemporaryDirectory(prefix="alignkit-errors-") as errors:
        proc = subprocess.Popen(command, env=dict(os.environ, FORCE_TORCHRUN="0", **{ERROR_DIR_VARIABLE: errors}),
                                stderr=subprocess.PIPE)
        held = _forward_until_traceback(proc.stderr)
        status = proc.wait()
        messages = sorted({path.read_text(encoding="utf-8") for path in Path(errors).iterdir()})
    if status != 0 and messages:
        for message in messages:
            print(f"alignkit: error: {message}", file=sys.stderr)
        return 2
    sys.stderr.buffer.write(held)
    sys.stderr.flush()
    return status


def _forward_until_traceback(stream) -> bytes:
    """Copy `stream` to stderr as it comes (progress bars included) until a traceback starts; return the rest."""
    out, pending, held = sys.stderr.buffer, b"", bytearray()
    while True:
        chunk = os.read(stream.fileno(), 65536)
        if held or not chunk:
            held += pending + chunk
            pending = b""
            if not chunk:
                break
            continue
        pending += chunk
        start = pending.find(_TRACEBACK)
        if start >= 0:
            out.write(pending[:start])
            held += pending[start:]
            pending = b""
        else:  # keep the bytes a traceback marker split across two reads may start with
            keep = len(_TRACEBACK) - 1
            out.write(pending[:-keep])
            pending = pending[-keep:]
        out.flush()
    stream.close()
    return bytes(held)


def report_worker_error(message: str) -> bool:
    """In a worker of `relaunch`, leave `message` for the launching process to print once; False elsewhere."""
    errors = os.environ.get(ERROR_DIR_VARIABLE)
    if not errors or not os.path.isdir(errors):
        return False
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(errors, f"rank-{rank}.txt"), "w", encoding="utf-8") as file:
        file.write(message)
    return True


__all__ = ["torchrun_command", "relaunch", "report_worker_error", "asks_for_deepspeed", "single_process_rendezvous"]
