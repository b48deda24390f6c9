"""What the board knows about runs, read from the files a run writes; no web framework, no browser.

A run is a folder that holds what `alignkit train` writes (`trainer_log.jsonl`, `trainer_state.json`,
`run_config.yaml`, the output_dir lock, `checkpoint-N/`). Everything here is read again on each call (a
training log from where the previous call stopped: `read_records`), so runs started from the command line show
up exactly like runs started from the board.

Status, from the files alone:
- running: the output_dir lock (`.alignkit.lock`) names a live process on this host (the lock file is
  removed when a run ends, and left by one that was killed, whose process is then gone);
- finished: the final `trainer_state.json` (written last) shows the planned steps done, or an
  evaluation/prediction-only run left its results;
- stopped: ended on a stop request (`alignkit.stop` is still there: `StopOnRequest` honoured it);
- failed: any other run whose process is gone (an error, a kill, a crash) before it finished.

Nothing outside the runs folder is read or written, links included: a run folder is found or named
through `resolve_inside`, each file of a run is read through `run_file` (which refuses a link out of the
run's folder), and each file the board writes is opened by `open_to_write` (never through a link).
"""

from __future__ import annotations

import collections
import errno
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Optional

import yaml

from ..callbacks import LOG_FILE, STOP_FILE, is_run_summary
from ..errors import BoardError
from ..lifecycle import LOCK_FILE, STATE_FILE, checkpoint_step, list_checkpoints, read_state
from ..train import RUN_CONFIG_FILE

logger = logging.getLogger(__name__)

RESULT_FILES = ("all_results.json", "train_results.json", "eval_results.json", "predict_results.json")
TABLE_FILES = ("generated_predictions.jsonl", "completions.jsonl")  # sft/rm/dpo/kto predictions; grpo/ppo rollouts
STATUSES = ("running", "finished", "failed", "stopped")
# Log keys that describe progress rather than a metric worth a curve.
PROGRESS_KEYS = {"current_steps", "total_steps", "percentage", "epoch", "elapsed_time", "remaining_time",
                 "total_tokens", "total_flos"}
# The stage's own curves, first match per group: what a user of that stage watches.
STAGE_METRICS = {
    "dpo": ["rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"],
    "kto": ["rewards/chosen", "rewards/rejected", "rewards/margins", "kl"],
    "rm": ["rewards/accuracies", "rewards/margins", "eval_accuracy"],
    # The online stages share TRL's GRPO names (`alignkit.rl`); PPO adds its adaptive KL coefficient.
    "grpo": ["reward", "reward_std", "kl"],
    "rloo": ["reward", "reward_std", "kl"],
    "ppo": ["reward", "reward_std", "kl", "objective/kl_coef"],
    # Distillation has no reward: its loss is the divergence to the teacher; TRL logs the student's entropy.
    "distill": ["entropy", "completions/mean_length"],
    # Online DPO logs TRL's names: the judged rewards (`objective/scores`) and DPO's implicit-reward metrics.
    "online_dpo": ["objective/scores", "objective/scores_margin", "rewards/margins", "rewards/accuracies",
                   "objective/kl"],
    "sft": ["grad_norm"],
    "pt": ["grad_norm"],
}
# Curves the run page shows for every stage on their own (the losses) or that say nothing stage-specific.
SHARED_CURVES = {"loss", "eval_loss", "learning_rate", "grad_norm", "train_loss"}
LAST_REWARD_KEYS = ("reward", "reward/mean", "rewards/margins")
LAST_ACCURACY_KEYS = ("rewards/accuracies", "accuracy", "eval_rewards/accuracies", "eval_accuracy")


@dataclass
class RunSummary:
    """One line of the runs list.

    Attributes:
        name: the run's folder relative to the runs folder (how the board names it).
        path: the folder.
        stage, model, dataset: from `run_config.yaml` (or guessed from the files for older runs; "?" unknown).
        status: one of `STATUSES`.
        step, total_steps: the last logged step and the plan.
        progress: step / total_steps in [0, 1] (1 for a finished run), None when unknown.
        eta_seconds: the time left by the last record's estimate, less the time since it was written
            (running runs only).
        loss, reward, accuracy: the last logged values (None when the stage logs none).
        updated: when the run last wrote its log or state (seconds since the epoch).
        stop_requested: a stop request is pending (running) or was honoured (stopped).
    """

    name: str
    path: Path
    stage: str = "?"
    model: str = "?"
    dataset: str = "?"
    status: str = "failed"
    step: int = 0
    total_steps: int = 0
    progress: Optional[float] = None
    eta_seconds: Optional[float] = None
    loss: Optional[float] = None
    reward: Optional[float] = None
    accuracy: Optional[float] = None
    updated: float = 0.0
    stop_requested: bool = False
    values: dict[str, Any] = field(default_factory=dict, repr=False)


# ---------------------------------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------------------------------


def resolve_inside(root: str | os.PathLike, path: str | os.PathLike, base: str | os.PathLike | None = None,
                   inside: str = "the runs folder",
                   fix: str = "the board reads and writes nothing outside it; start the board with --runs "
                              "pointing higher up to reach that folder") -> Path:
    """`path` as an absolute path with every symbolic link followed, refused unless it lies inside `root`.

    The one check in front of everything the board reads or writes: a run it is asked for, each file of a
    run (`run_file`), a path a config gives a run to write to (`launch.confine_writes`), and the folder of
    each file it writes (`open_to_write`).

    Args:
        root: the folder to stay in: the runs folder, or a run's folder for that run's files.
        path: a run name relative to `root`, or a path relative to `base` (an output_dir from a config).
        base: the folder a relative `path` is relative to (default: `root`).
        inside, fix: how the refusal names `root`, and its last sentence (why, and what to do instead).

    Raises:
        BoardError: the path leads outside `root`, saying whether a link took it there.
    """
    root_real = Path(root).resolve()
    candidate = Path(path)
    if not candidate.is_absolute():
        candidate = Path(base if base is not None else root_real) / candidate
    real = candidate.resolve()
    if real == root_real or root_real in real.parents:
        return real
    how = "is" if real == Path(os.path.abspath(candidate)) else f"leads through a symbolic link to {real},"
    raise BoardError(f"{path} {how} outside {inside} {root_real}: {fix}.")


def run_file(run_dir: str | os.PathLike, name: str | os.PathLike) -> Path:
    """The real path of a run's file `name`, refused when a link leads it out of the run's folder.

    Every file of a run that the board reads comes through here. The run's folder was checked against the
    runs folder when it was found (`find_runs`) or named (`resolve_inside`), so a file that stays in it
    stays in the runs folder too; a link to a file elsewhere, even elsewhere under `--runs`, is no file
    `alignkit train` writes, and is refused rather than followed.

    Raises:
        BoardError: naming the file and where its link leads.
    """
    return resolve_inside(run_dir, Path(run_dir) / name, inside="its run folder",
                          fix="the board follows no link out of a run's folder; replace the link by a copy of "
                              "the file")


def check_run_folder(run_dir: str | os.PathLike) -> None:
    """Refuse a run with any link (file or folder, checkpoints included) that leads out of its folder.

    Checked before the board hands the folder to a process that reads and writes in it as it likes (a
    resumed or relaunched run, a chat model loading its weights), which `run_file` cannot stand in front of.

    Raises:
        BoardError: naming the first such link and where it leads.
    """
    for folder, dirs, files in os.walk(run_dir):  # links to folders are listed, not entered
        for name in sorted(dirs + files):
            if os.path.islink(os.path.join(folder, name)):
                run_file(run_dir, os.path.relpath(os.path.join(folder, name), run_dir))


def open_to_write(root: str | os.PathLike, file: str | os.PathLike, mode: str = "ab") -> BinaryIO:
    """Open `file` for writing, never through a link: every file the board writes is opened here.

    The file's folder must lie inside `root` (`resolve_inside`), and the file itself is opened with
    O_NOFOLLOW, so a link at its name is refused wherever it leads (inside `--runs` too): a link there
    was not made by alignkit, and writing through it would write somewhere the board did not choose.

    Args:
        root: the folder to stay in.
        file: the file.
        mode: "ab" append (created if missing), "wb" replace, "xb" create a new file (FileExistsError if the
            name is taken).

    Raises:
        BoardError: the folder leads outside `root`, or the file is a link.
    """
    file = Path(file)
    target = resolve_inside(root, file.parent) / file.name
    flags = {"ab": os.O_APPEND, "wb": os.O_TRUNC, "xb": os.O_EXCL}[mode]
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | flags, 0o644)
    except OSError as err:
        # O_NOFOLLOW answers ELOOP for a link; O_EXCL answers EEXIST before it looks at what is there.
        if err.errno == errno.ELOOP or target.is_symlink():
            raise BoardError(f"{file} is a symbolic link (to {os.readlink(target)}); the board writes no file "
                             "through a link, which could lead anywhere. Remove the link.") from None
        raise
    return os.fdopen(fd, mode)


def is_run_dir(path: Path) -> bool:
    """Whether a folder holds what `alignkit train` writes (any one of its files, or a checkpoint).

    Only names are looked at here; what the files hold is read through `run_file`.
    """
    if not path.is_dir():
        return False
    if any((path / name).is_file() for name in (LOG_FILE, STATE_FILE, RUN_CONFIG_FILE, LOCK_FILE)):
        return True
    return bool(list_checkpoints(path))


def find_runs(root: str | os.PathLike, max_depth: int = 4) -> list[Path]:
    """Every run folder under `root` (itself included), newest activity first.

    A run's own subfolders (checkpoints) are not searched, nor are hidden folders, nor folders a link leads
    out of `root` (`resolve_inside`); `max_depth` bounds the walk so that pointing `--runs` at a large tree
    stays cheap.
    """
    root = Path(root)
    found: list[Path] = []

    def walk(folder: Path, depth: int) -> None:
        try:
            resolve_inside(root, folder)
        except BoardError:
            return
        if is_run_dir(folder):
            found.append(folder)
            return
        if depth >= max_depth:
            return
        try:
            children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            return
        for child in children:
            walk(child, depth + 1)

    if root.is_dir():
        walk(root, 0)
    return sorted(found, key=lambda p: (-last_activity(p), str(p)))


def last_activity(path: Path) -> float:
    """The latest modification time of the files that change while a run trains."""
    times = [0.0]
    for name in (LOG_FILE, STATE_FILE, RUN_CONFIG_FILE, LOCK_FILE, STOP_FILE):
        try:
            times.append(run_file(path, name).stat().st_mtime)
        except (OSError, BoardError):  # a refused link says nothing about the run; reading it will say why
            pass
    return max(times)


def run_name(root: str | os.PathLike, path: Path) -> str:
    """How the board names a run: its folder relative to the runs folder ("." for the folder itself)."""
    return Path(os.path.relpath(path, Path(root))).as_posix()


# ---------------------------------------------------------------------------------------------------
# Reading one run
# ---------------------------------------------------------------------------------------------------


# A run's log grows by a line per logging step and the page reads it every 2 s: a 200 MB log took 3.9 s to read
# whole and 2 GB to hold. So each log is read from where the last read ended (a rewritten file, which a resume
# makes, from its start), and the board keeps its newest `LOG_RECORDS_KEPT` records; a log met for the first time
# is read from its last `LOG_TAIL_BYTES`.
LOG_RECORDS_KEPT = 50_000
LOG_TAIL_BYTES = 32 * 2**20
_HEAD_BYTES = 256  # compared on each read: a log rewritten in place keeps its inode


@dataclass
class _LogTail:
    """What the board holds of one log file: its identity (inode, first bytes), how far it has been read, its
    newest records."""

    inode: int
    head: bytes
    offset: int
    records: collections.deque


_log_tails: dict[Path, _LogTail] = {}


def read_records(path: Path) -> list[dict[str, Any]]:
    """`trainer_log.jsonl`'s records, skipping a line being written and lines a killed run left broken; at most
    the newest `LOG_RECORDS_KEPT` (see above)."""
    file = run_file(path, LOG_FILE)
    try:
        handle = open(file, "rb")
    except FileNotFoundError:
        _log_tails.pop(file, None)
        return []
    with handle:
        stat = os.fstat(handle.fileno())
        head = handle.read(_HEAD_BYTES)
        tail = _log_tails.get(file)
        fresh = (tail is None or tail.inode != stat.st_ino or stat.st_size < tail.offset
                 or head[:len(tail.head)] != tail.head)
        if fresh:
            tail = _LogTail(stat.st_ino, head, max(stat.st_size - LOG_TAIL_BYTES, 0),
                            collections.deque(maxlen=LOG_RECORDS_KEPT))
            _log_tails[file] = tail
        handle.seek(tail.offset)
        chunk = handle.read(max(stat.st_size - tail.offset, 0))
    partial = b""
    if chunk:
        if fresh and tail.offset > 0:  # a tail read starts inside a line: skip to the first whole one
            start = chunk.find(b"\n") + 1
            chunk, tail.offset = chunk[start:], tail.offset + start
        complete = chunk.rfind(b"\n") + 1
        partial = chunk[complete:]
        tail.offset += complete
        tail.records.extend(_parsed_lines(chunk[:complete]))
    # A last line without its newline is left for the next read, but shown when it is already whole JSON.
    return list(tail.records) + _parsed_lines(partial)


def _parsed_lines(data: bytes) -> list[dict[str, Any]]:
    records = []
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8", errors="replace"))
        except ValueError:  # a line a killed run left broken, or one being written
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_run_config(path: Path) -> tuple[dict[str, Any], Optional[str]]:
    """The keys of `run_config.yaml` and the folder the run was started from (None when unrecorded)."""
    file = run_file(path, RUN_CONFIG_FILE)
    try:
        text = file.read_text(encoding="utf-8")
        values = yaml.safe_load(text) or {}
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return {}, None
    cwd = next((line[len("# cwd: "):].strip() for line in text.splitlines() if line.startswith("# cwd: ")), None)
    return (values if isinstance(values, dict) else {}), cwd


def run_config_source(path: Path) -> Optional[str]:
    """The config file a run was started from, as `run_config.yaml`'s `# source:` line records it (None when it was
    started from keys only or the line is missing)."""
    try:
        text = run_file(path, RUN_CONFIG_FILE).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    source = next((line[len("# source: "):].strip() for line in text.splitlines() if line.startswith("# source: ")),
                  None)
    return None if not source or source.startswith("(") else source


def _read_json(path: Path, name: str) -> Optional[dict[str, Any]]:
    file = run_file(path, name)  # outside the try: a refusal is a BoardError, which is a ValueError
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def lock_holder(path: Path) -> Optional[dict[str, Any]]:
    """The process recorded in the run's output_dir lock, or None when there is no lock file."""
    return _read_json(path, LOCK_FILE)


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holder_alive(holder: Optional[dict[str, Any]]) -> bool:
    """Whether the lock's holder still runs. One on another host cannot be checked and counts as running
    (its file is removed when it ends cleanly)."""
    if not holder:
        return False
    if holder.get("host") not in (None, socket.gethostname()):
        return True
    pid = holder.get("pid")
    return isinstance(pid, int) and process_alive(pid)


def run_status(path: Path, records: Optional[list[dict[str, Any]]] = None) -> str:
    """running, finished, stopped or failed, from the run's files (see the module docstring)."""
    if run_file(path, LOCK_FILE).exists() and holder_alive(lock_holder(path)):
        return "running"
    state = read_state(run_file(path, STATE_FILE))
    if state is not None:
        done, planned = state.get("global_step") or 0, state.get("max_steps") or 0
        if planned > 0 and done >= planned:
            return "finished"
    if run_file(path, STOP_FILE).exists():
        return "stopped"
    if state is None and not list_checkpoints(path):
        logged = records if records is not None else read_records(path)
        if not logged and any(run_file(path, name).is_file() for name in RESULT_FILES):
            return "finished"  # an evaluation- or prediction-only run: results, no training
    return "failed"


def guess_stage(path: Path, records: list[dict[str, Any]]) -> str:
    """The stage of a run without `run_config.yaml`, from what it logged and saved ("?" when unclear)."""
    keys = {k for r in records for k in r}
    if "ppo/loss/total" in keys or run_file(path, "value_head.safetensors").is_file():
        return "ppo"
    if "reward_std" in keys:
        return "grpo"
    if "kl" in keys and "rewards/chosen" in keys:
        return "kto"
    if "logps/chosen" in keys:
        return "dpo"
    adapter = _read_json(path, "adapter_config.json") or {}
    if adapter.get("task_type") == "SEQ_CLS" or "rewards/accuracies" in keys:
        return "rm"
    return "?"


def base_model_of(path: Path, values: dict[str, Any]) -> str:
    """The model a run trained: its config's `model_name_or_path`, else what its saved adapter names."""
    if values:
        return str(values.get("model_name_or_path") or "smollm2-135m-instruct")
    adapter = _read_json(path, "adapter_config.json") or {}
    return str(adapter.get("base_model_name_or_path") or "?")


def _last(records: list[dict[str, Any]], keys: tuple[str, ...]) -> Optional[float]:
    for record in reversed(records):
        if is_run_summary(record):
            continue
        for key in keys:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
    return None


def summarize_run(root: str | os.PathLike, path: Path, now: Optional[float] = None) -> RunSummary:
    """Everything the runs list shows about one run."""
    now = time.time() if now is None else now
    records = read_records(path)
    values, _ = read_run_config(path)
    status = run_status(path, records)
    summary = RunSummary(name=run_name(root, path), path=path, status=status, values=values,
                         updated=last_activity(path), stop_requested=run_file(path, STOP_FILE).exists())
    summary.stage = str(values.get("stage", "sft")) if values else guess_stage(path, records)
    summary.model = base_model_of(path, values)
    summary.dataset = str(values.get("dataset") or "?")
    steps = [r for r in records if isinstance(r.get("current_steps"), int)]
    if steps:
        last = steps[-1]
        summary.step = last["current_steps"]
        summary.total_steps = int(last.get("total_steps") or 0)
    state = read_state(run_file(path, STATE_FILE))
    if state is not None and (state.get("global_step") or 0) >= summary.step:
        summary.step = int(state.get("global_step") or 0)
        summary.total_steps = int(state.get("max_steps") or summary.total_steps)
    if summary.total_steps:
        summary.progress = min(summary.step / summary.total_steps, 1.0)
    if status == "finished":
        summary.progress = 1.0
    if status == "running" and steps and isinstance(steps[-1].get("remaining_time"), (int, float)):
        written = _mtime(run_file(path, LOG_FILE)) or now
        summary.eta_seconds = max(float(steps[-1]["remaining_time"]) - (now - written), 0.0)
    summary.loss = _last(records, ("loss",))
    summary.reward = _last(records, LAST_REWARD_KEYS)
    summary.accuracy = _last(records, LAST_ACCURACY_KEYS)
    return summary


def _mtime(file: Path) -> Optional[float]:
    try:
        return file.stat().st_mtime
    except OSError:
        return None


_LEFT_OUT: set[str] = set()  # the refusals already warned about (the list is read again every few seconds)


def list_runs(root: str | os.PathLike, now: Optional[float] = None) -> list[RunSummary]:
    """`summarize_run` for every run under `root`, newest activity first.

    A run with a file the board refuses to read (`run_file`) is left out, with a warning once: showing it
    would mean guessing, and failing would hide every other run.
    """
    listed = []
    for path in find_runs(root):
        try:
            listed.append(summarize_run(root, path, now))
        except BoardError as err:
            if str(err) not in _LEFT_OUT:
                _LEFT_OUT.add(str(err))
                logger.warning("%s is not listed: %s", run_name(root, path), err)
    return listed


def format_duration(seconds: Optional[float]) -> str:
    """`1h 02m`, `3m 05s`, `42s`; "" for None. Example: 3725 s -> "1h 02m"."""
    if seconds is None:
        return ""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


# ---------------------------------------------------------------------------------------------------
# Curves, metrics, tables
# ---------------------------------------------------------------------------------------------------


def curves(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Every numeric series of the log as (step, value) points in step order.

    Run summaries (`is_run_summary`) are not points, and a step logged twice keeps its last value (as in
    `plot_loss`). Evaluation records give the `eval_*` series.
    """
    series: dict[str, dict[int, float]] = {}
    for record in records:
        step = record.get("current_steps")
        if not isinstance(step, int) or is_run_summary(record):
            continue
        for key, value in record.items():
            if key in PROGRESS_KEYS or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if key.endswith(("_runtime", "_per_second")) and key != "tokens_per_second":
                continue
            series.setdefault(key, {})[step] = float(value)
    return {key: sorted(points.items()) for key, points in series.items()}


def stage_metric_keys(stage: str, available: list[str]) -> list[str]:
    """The stage's own curves present in the log: `STAGE_METRICS` where the stage has an entry, else every logged
    metric but the ones each stage shares (`SHARED_CURVES`), so a new stage gets its curves without an entry here;
    then the per-reward-function means (`rewards/<name>/mean`, the online stages)."""
    per_reward = sorted(k for k in available if k.startswith("rewards/") and k.endswith("/mean"))
    if stage in STAGE_METRICS:
        wanted = [k for k in STAGE_METRICS[stage] if k in available]
    else:
        wanted = sorted(k for k in available if k not in SHARED_CURVES and k not in per_reward)
    return wanted + [k for k in per_reward if k not in wanted]


def final_metrics(path: Path) -> dict[str, Any]:
    """The run's results files merged (`all_results.json` when there, else train/eval/predict results)."""
    merged: dict[str, Any] = {}
    for name in RESULT_FILES[1:]:
        merged.update(_read_json(path, name) or {})
    merged.update(_read_json(path, RESULT_FILES[0]) or {})
    return merged


def table_rows(path: Path, limit: int = 200) -> tuple[Optional[str], list[dict[str, Any]]]:
    """The run's predictions or completions file and its last `limit` rows (nested values as JSON text).

    A line being written, or one a kill cut short, is skipped.
    """
    for name in TABLE_FILES:
        file = run_file(path, name)
        if not file.is_file():
            continue
        rows = []
        with open(file, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict):
                    rows.append({k: v if isinstance(v, (str, int, float, bool)) or v is None
                                 else json.dumps(v, ensure_ascii=False) for k, v in row.items()})
        return name, rows[-limit:]
    return None, []


def checkpoints_of(path: Path) -> list[int]:
    """The steps of the run's `checkpoint-N` folders, oldest first."""
    return sorted(step for step in (checkpoint_step(p) for p in list_checkpoints(path)) if step is not None)


__all__ = ["BoardError", "RunSummary", "resolve_inside", "run_file", "check_run_folder", "open_to_write",
           "is_run_dir", "find_runs", "run_name", "read_records", "read_run_config", "run_status", "summarize_run",
           "list_runs", "format_duration", "curves", "stage_metric_keys", "final_metrics", "table_rows",
           "checkpoints_of", "guess_stage", "STATUSES"]
