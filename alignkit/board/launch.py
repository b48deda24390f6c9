"""Starting, stopping and resuming runs from the board: always `alignkit train` with a checked config.

What the board may start is exactly what `alignkit train CONFIG key=value ...` would run: the YAML and the
overrides are parsed by `config.parse.read_config` first (the command line's checks, the same messages), every
place the run would write to must lie inside the runs folder (`confine_writes`), and the process is
`python -m alignkit train FILE key=value ...` with an argument list (no shell, so no text from the page is
ever run as a command). Stopping writes the run's stop file (`STOP_FILE`, as `callbacks.request_stop` does),
which the training loop honours at the end of the step with a checkpoint; resuming runs the run's recorded
`run_config.yaml` again, which picks up that checkpoint.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..callbacks import STOP_FILE
from ..config import Config
from ..config.parse import parse_override, read_config
from ..errors import BoardError, ConfigError
from ..files import parse_mapping
from ..train import RUN_CONFIG_FILE, check_output_dir
from .runs import check_run_folder, open_to_write, read_run_config, resolve_inside, run_file, run_status

CONSOLE_FILE = "board_console.log"  # the launched process's stdout and stderr, in its output_dir
LAUNCH_DIR = ".board"  # under the runs folder: the YAML files the board starts runs from
# Where a run writes files, by key: each must lie inside the runs folder. (A run also fills the shared caches,
# alignkit's data cache and the hub cache when cache_dir is unset: those are the environment's, as for any run.)
WRITE_PATH_KEYS = {"output_dir": ("training", "output_dir"), "tokenized_path": ("data", "tokenized_path"),
                   "cache_dir": ("model", "cache_dir")}
# Reporters whose files stay in output_dir (TensorBoard's go to output_dir/runs/). The others write where no key
# confines them (wandb's ./wandb and mlflow's ./mlruns in the working folder, trackio's under the home folder).
BOARD_REPORTERS = ("none", "tensorboard")


@dataclass
class Launch:
    """A run started by the board: its process, its folder and the command (for the page)."""

    process: subprocess.Popen
    output_dir: Path
    command: list[str]
    started: float

    def describe(self) -> str:
        code = self.process.poll()
        state = "running" if code is None else f"exited with status {code}"
        return f"pid {self.process.pid}, {state}: {shlex.join(self.command)}"


def split_overrides(text: str) -> list[str]:
    """`key=value` overrides from the page's box: one per line or separated by spaces (shell-style quoting).

    Raises:
        ConfigError: an item that is not key=value (the command line's message).
    """
    items = [item for line in text.splitlines() for item in shlex.split(line, comments=True)]
    for item in items:
        parse_override(item)
    return items


def confine_writes(runs_root: str | os.PathLike, config: Config, workdir: str | os.PathLike) -> Path:
    """Refuse a config that would have its run write outside the runs folder; its output_dir otherwise.

    The keys of `WRITE_PATH_KEYS` (relative ones read from `workdir`, as the run will) must resolve inside
    the runs folder, `report_to` may name only `BOARD_REPORTERS`, and an output_dir that exists must hold no
    link out of it (the run would write through it: `check_run_folder`).

    Raises:
        BoardError: naming the key, its value and why.
    """
    places = {}
    for key, (group, name) in WRITE_PATH_KEYS.items():
        value = getattr(getattr(config, group), name)
        if value:
            try:
                places[key] = resolve_inside(runs_root, value, base=workdir,
                                             fix="a run started from the board writes only inside it; give a path "
                                                 "under it, or start the board with --runs pointing higher up")
            except BoardError as err:  # its message opens with the value: name the key in front of it
                raise BoardError(f"{key}={err}") from None
    elsewhere = [name for name in config.training.report_to or [] if name not in BOARD_REPORTERS]
    if elsewhere:
        raise BoardError(f"report_to={','.join(elsewhere)} writes its own files outside the runs folder, where the "
                         f"board cannot keep them; use report_to: {' or '.join(BOARD_REPORTERS)}, or start this "
                         "run with `alignkit train` on the command line.")
    output_dir = places["output_dir"]  # never empty: TRAINING_DEFAULTS gives one
    if output_dir.is_dir():
        check_run_folder(output_dir)
    return output_dir


def write_launch_file(runs_root: str | os.PathLike, kind: str, text: str) -> Path:
    """Write `text` to a new `runs_root/.board/<kind>-<time>.yaml` (the YAML files runs are started from)."""
    folder = resolve_inside(runs_root, LAUNCH_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        path = folder / (f"{kind}-{stamp}.yaml" if n == 1 else f"{kind}-{stamp}-{n}.yaml")
        try:
            with open_to_write(runs_root, path, "xb") as f:
                f.write(text.encode("utf-8"))
            return path
        except FileExistsError:
            continue
    raise BoardError(f"{folder} already holds 999 {kind} files of this second; try again.")


def check_launch(runs_root: str | os.PathLike, yaml_text: str, overrides: list[str],
                 workdir: str | os.PathLike) -> tuple[Path, Path]:
    """Check a config as `alignkit train` does and that its run writes only inside the runs folder.

    The YAML is written to `runs_root/.board/launch-<time>.yaml` (so the run can be repeated from the same
    file) and parsed with `read_config`, relative paths read from `workdir` as the run will.

    Returns:
        (the YAML file, the run's output_dir).

    Raises:
        ConfigError: what `alignkit train` would say about the config.
        BoardError: a place it writes outside the runs folder (`confine_writes`), or a run already running
            in its output_dir.
    """
    parse_mapping(yaml_text, "the config")  # refused before a launch file is written
    path = write_launch_file(runs_root, "launch", yaml_text)
    cwd = os.getcwd()
    try:
        os.chdir(workdir)  # read_config resolves nothing itself, but the stage checks may look at files
        try:
            config = read_config(path, overrides)
        finally:
            os.chdir(cwd)
        output_dir = confine_writes(runs_root, config, workdir)
        if not config.training.do_train:
            raise BoardError("the board starts training runs (do_train: true); run evaluation or prediction with "
                             "`alignkit train` on the command line.")
        check_output_dir(output_dir)
        if output_dir.is_dir() and run_status(output_dir) == "running":
            raise BoardError(f"{output_dir} is in use by a running run; stop it first or choose another "
                             "output_dir.")
    except (ConfigError, BoardError):
        path.unlink(missing_ok=True)  # a refused config is not kept among the files runs were started from
        raise
    return path, output_dir


def start_run(config_file: Path, overrides: list[str], output_dir: Path, workdir: str | os.PathLike) -> Launch:
    """Start `alignkit train CONFIG key=value ...` in `workdir`, its console written to `output_dir/board_console.log`.

    Raises:
        BoardError: the console file is a link (it is appended to, and nothing is written through a link).
    """
    command = [sys.executable, "-m", "alignkit", "train", str(config_file), *overrides]
    output_dir.mkdir(parents=True, exist_ok=True)
    with open_to_write(output_dir, output_dir / CONSOLE_FILE, "ab") as console:
        process = subprocess.Popen(command, cwd=workdir, stdout=console, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    return Launch(process=process, output_dir=output_dir, command=["alignkit", *command[3:]], started=time.time())


def stop_run(run_dir: Path) -> Path:
    """Ask a running run to stop at the end of its step (with a checkpoint).

    Raises:
        BoardError: the run is not running, or its stop file is a link.
    """
    if run_status(run_dir) != "running":
        raise BoardError(f"{run_dir.name} is not running, so there is nothing to stop.")
    with open_to_write(run_dir, run_dir / STOP_FILE, "wb") as f:
        f.write(time.strftime("%Y-%m-%dT%H:%M:%S%z\n").encode())
    return run_dir / STOP_FILE


def resume_run(runs_root: str | os.PathLike, run_dir: Path) -> Launch:
    """Start a stopped or failed run again from its `run_config.yaml`; it resumes from its last checkpoint.

    Raises:
        BoardError: the run is running or finished, has no recorded config, or would write outside the runs
            folder (`confine_writes`: its output_dir is not this folder, or a link leads out of it).
        ConfigError: the recorded config no longer passes `alignkit train`'s checks.
    """
    status = run_status(run_dir)
    if status in ("running", "finished"):
        raise BoardError(f"{run_dir.name} is {status}; only a stopped or failed run can be resumed.")
    values, workdir = read_run_config(run_dir)
    if not values:
        raise BoardError(f"{run_dir.name} has no {RUN_CONFIG_FILE} (it was started before the board existed); "
                         "resume it with the command that started it.")
    workdir = workdir if workdir and Path(workdir).is_dir() else os.getcwd()
    config_file = run_file(run_dir, RUN_CONFIG_FILE)
    cwd = os.getcwd()
    try:
        os.chdir(workdir)
        config = read_config(config_file)
    finally:
        os.chdir(cwd)
    output_dir = confine_writes(runs_root, config, workdir)
    if output_dir != run_dir.resolve():
        raise BoardError(f"{config_file} names output_dir {output_dir}, not this run's folder; resume it from the "
                         "command line.")
    # The config is copied beside the others the board started runs from: the run rewrites its own copy.
    launch_file = write_launch_file(runs_root, "resume", config_file.read_text(encoding="utf-8"))
    return start_run(launch_file, [], output_dir, workdir)


def example_configs(*folders: Optional[Path]) -> dict[str, Path]:
    """The example YAML files the launch page offers: `examples/*.yaml` of the given folders, by file name."""
    found: dict[str, Path] = {}
    for folder in folders:
        if folder is not None and folder.is_dir():
            for path in sorted(folder.glob("*.yaml")):
                found.setdefault(path.name, path)
    return found


__all__ = ["Launch", "split_overrides", "confine_writes", "write_launch_file", "check_launch", "start_run", "stop_run",
           "resume_run", "example_configs", "CONSOLE_FILE", "WRITE_PATH_KEYS", "BOARD_REPORTERS"]
