"""Starting, stopping and resuming runs from the board: always `alignkit train` with a checked config.

What the board may start is exactly what `alignkit train CONFIG key=value ...` would run: the YAML and the
overrides are parsed by `hparams.read_config` first (the command line's checks, the same messages), the
output_dir must lie inside the runs folder, and the process is `python -m alignkit train FILE key=value ...`
with an argument list (no shell, so no text from the page is ever run as a command). Stopping writes the
run's stop file (`callbacks.request_stop`), which the training loop honours at the end of the step with a
checkpoint; resuming runs the run's recorded `run_config.yaml` again, which picks up that checkpoint.
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

import yaml

from ..callbacks import request_stop
from ..hparams import ConfigError, parse_override, read_config
from ..train import RUN_CONFIG_FILE, check_output_dir
from .runs import BoardError, read_run_config, resolve_inside, run_status

CONSOLE_FILE = "board_console.log"  # the launched process's stdout and stderr, in its output_dir
LAUNCH_DIR = ".board"  # under the runs folder: the YAML files the board starts runs from


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


def check_launch(runs_root: str | os.PathLike, yaml_text: str, overrides: list[str],
                 workdir: str | os.PathLike) -> tuple[Path, Path]:
    """Check a config as `alignkit train` does and that its output_dir is inside the runs folder.

    The YAML is written to `runs_root/.board/launch-<time>.yaml` (so the run can be repeated from the same
    file) and parsed with `read_config`, relative paths read from `workdir` as the run will.

    Returns:
        (the YAML file, the run's output_dir).

    Raises:
        ConfigError: what `alignkit train` would say about the config.
        BoardError: output_dir outside the runs folder, or a run already running there.
    """
    try:
        values = yaml.safe_load(yaml_text) if yaml_text.strip() else {}
    except yaml.YAMLError as err:
        raise ConfigError(f"the config is not valid YAML: {err}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"the top level of the config must be a mapping of key: value, got {type(values).__name__}.")
    folder = Path(runs_root) / LAUNCH_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / time.strftime("launch-%Y%m%d-%H%M%S.yaml")
    n = 1
    while path.exists():
        n += 1
        path = folder / time.strftime(f"launch-%Y%m%d-%H%M%S-{n}.yaml")
    path.write_text(yaml_text, encoding="utf-8")
    cwd = os.getcwd()
    try:
        os.chdir(workdir)  # read_config resolves nothing itself, but the stage checks may look at files
        try:
            config = read_config(path, overrides)
        finally:
            os.chdir(cwd)
        output_dir = resolve_inside(runs_root, config.training.output_dir, base=workdir)
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
    """Start `alignkit train CONFIG key=value ...` in `workdir`, its console written to `output_dir/board_console.log`."""
    command = [sys.executable, "-m", "alignkit", "train", str(config_file), *overrides]
    output_dir.mkdir(parents=True, exist_ok=True)
    with open(output_dir / CONSOLE_FILE, "ab") as console:
        process = subprocess.Popen(command, cwd=workdir, stdout=console, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    return Launch(process=process, output_dir=output_dir, command=["alignkit", *command[3:]], started=time.time())


def stop_run(run_dir: Path) -> Path:
    """Ask a running run to stop at the end of its step (with a checkpoint).

    Raises:
        BoardError: the run is not running.
    """
    if run_status(run_dir) != "running":
        raise BoardError(f"{run_dir.name} is not running, so there is nothing to stop.")
    return request_stop(run_dir)


def resume_run(runs_root: str | os.PathLike, run_dir: Path) -> Launch:
    """Start a stopped or failed run again from its `run_config.yaml`; it resumes from its last checkpoint.

    Raises:
        BoardError: the run is running or finished, or has no recorded config.
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
    config_file = run_dir / RUN_CONFIG_FILE
    cwd = os.getcwd()
    try:
        os.chdir(workdir)
        config = read_config(config_file)
    finally:
        os.chdir(cwd)
    output_dir = resolve_inside(runs_root, config.training.output_dir, base=workdir)
    if output_dir != run_dir.resolve():
        raise BoardError(f"{config_file} names output_dir {output_dir}, not this run's folder; resume it from the "
                         "command line.")
    # The config is copied beside the others the board started runs from: the run rewrites its own copy.
    launch_file = Path(runs_root) / LAUNCH_DIR / time.strftime("resume-%Y%m%d-%H%M%S.yaml")
    launch_file.parent.mkdir(parents=True, exist_ok=True)
    launch_file.write_text(config_file.read_text(encoding="utf-8"), encoding="utf-8")
    return start_run(launch_file, [], output_dir, workdir)


def example_configs(*folders: Optional[Path]) -> dict[str, Path]:
    """The example YAML files the launch page offers: `examples/*.yaml` of the given folders, by file name."""
    found: dict[str, Path] = {}
    for folder in folders:
        if folder is not None and folder.is_dir():
            for path in sorted(folder.glob("*.yaml")):
                found.setdefault(path.name, path)
    return found


__all__ = ["Launch", "split_overrides", "check_launch", "start_run", "stop_run", "resume_run", "example_configs",
           "CONSOLE_FILE"]
