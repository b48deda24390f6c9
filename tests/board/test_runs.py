"""The board's reading of run folders (status, progress, ETA, curves, tables) and its launch checks, without a
browser or Gradio; and the stop request end to end on the tiny model (stop, checkpoint, resume)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import TrainerCallback

from alignkit.board import launch, runs
from alignkit.callbacks import LOG_FILE, STOP_FILE, read_log, request_stop
from alignkit.config.parse import parse_config
from alignkit.errors import ConfigError
from alignkit.lifecycle import LOCK_FILE, STATE_FILE
from alignkit.train import RUN_CONFIG_FILE, run_train


def write_log(folder: Path, records: list[dict], tail: str = "") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records) + tail
    (folder / LOG_FILE).write_text(text, encoding="utf-8")


def step(n: int, total: int = 10, **metrics) -> dict:
    return {"current_steps": n, "total_steps": total, "percentage": 100 * n / total, "elapsed_time": 2.0 * n,
            "remaining_time": 2.0 * (total - n), **metrics}


def write_lock(folder: Path, pid: int, host: str | None = None) -> None:
    (folder / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "started": "t"}))


def test_half_written_last_line_is_skipped_and_the_rest_read(tmp_path):
    run = tmp_path / "run"
    write_log(run, [step(1, loss=2.5), step(2, loss=2.0)], tail='{"current_steps": 3, "total_steps": 10, "lo')
    write_lock(run, os.getpid())  # this test's own process: alive, so the run counts as running
    summary = runs.summarize_run(tmp_path, run, now=time.time())
    assert (summary.status, summary.step, summary.total_steps, summary.loss) == ("running", 2, 10, 2.0)
    assert summary.progress == pytest.approx(0.2)
    # remaining_time of the last record (2 s x 8 steps = 16 s) less the seconds since the log was written
    assert 0 <= summary.eta_seconds <= 16.0
    assert runs.curves(runs.read_records(run))["loss"] == [(1, 2.5), (2, 2.0)]
    # the training code's reader too: a record being written is not an error ...
    assert [r["current_steps"] for r in read_log(run)] == [1, 2]


def test_a_broken_line_in_the_middle_is_an_error_for_training_code_and_skipped_by_the_board(tmp_path):
    run = tmp_path / "run"
    write_log(run, [step(1, loss=1.0)], tail='{"broken\n' + json.dumps(step(2, loss=0.5)) + "\n")
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        read_log(run)
    assert [r["current_steps"] for r in runs.read_records(run)] == [1, 2]


def test_folders_that_are_not_runs_are_not_listed(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "rows.jsonl").write_text("{}\n")
    (tmp_path / "notes.txt").write_text("hello")
    write_log(tmp_path / "group" / "a", [step(1, loss=1.0)])
    (tmp_path / "group" / "b" / "checkpoint-2").mkdir(parents=True)
    write_log(tmp_path / ".board" / "hidden", [step(1)])
    found = [runs.run_name(tmp_path, p) for p in runs.find_runs(tmp_path)]
    assert sorted(found) == ["group/a", "group/b"]
    assert not runs.is_run_dir(tmp_path / "data")
    # a run's checkpoints are part of it, not runs of their own
    assert runs.checkpoints_of(tmp_path / "group" / "b") == [2]


def test_status_finished_failed_stopped_running(tmp_path):
    finished = tmp_path / "finished"
    write_log(finished, [step(10, loss=0.1)])
    (finished / STATE_FILE).write_text(json.dumps({"global_step": 10, "max_steps": 10}))
    assert runs.run_status(finished) == "finished"
    assert runs.summarize_run(tmp_path, finished).progress == 1.0

    killed = tmp_path / "killed"  # kill -9 leaves the lock file with a pid that is gone
    write_log(killed, [step(4)])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_lock(killed, dead.pid)
    assert runs.run_status(killed) == "failed"
    assert runs.summarize_run(tmp_path, killed).eta_seconds is None  # no ETA for a run that is not running

    errored = tmp_path / "errored"  # an exception: the lock is released and removed, the state never written
    write_log(errored, [step(3)])
    assert runs.run_status(errored) == "failed"

    stopped = tmp_path / "stopped"  # stopped on request: the stop file stays, the state shows 5 of 10
    write_log(stopped, [step(5)])
    (stopped / STATE_FILE).write_text(json.dumps({"global_step": 5, "max_steps": 10}))
    (stopped / STOP_FILE).write_text("t\n")
    assert runs.run_status(stopped) == "stopped"

    running = tmp_path / "running"
    write_log(running, [step(2)])
    write_lock(running, os.getpid())
    (running / STOP_FILE).write_text("t\n")  # requested, not yet honoured: still running
    summary = runs.summarize_run(tmp_path, running)
    assert (summary.status, summary.stop_requested) == ("running", True)

    elsewhere = tmp_path / "elsewhere"  # a holder on another host cannot be checked: counted as running
    write_log(elsewhere, [step(1)])
    write_lock(elsewhere, 1, host="another-host.invalid")
    assert runs.run_status(elsewhere) == "running"

    evaluated = tmp_path / "evaluated"  # do_eval only: results, no training files
    evaluated.mkdir()
    (evaluated / "eval_results.json").write_text(json.dumps({"eval_loss": 1.5}))
    (evaluated / RUN_CONFIG_FILE).write_text("stage: sft\n")
    assert runs.run_status(evaluated) == "finished"


def test_summary_reads_stage_model_dataset_and_last_stage_metrics(tmp_path):
    run = tmp_path / "dpo"
    write_log(run, [step(1, loss=0.69, **{"rewards/margins": 0.1, "rewards/accuracies": 0.5, "logps/chosen": -9.0}),
                    {"current_steps": 1, "eval_loss": 0.7},
                    step(2, loss=0.6, **{"rewards/margins": 0.3, "rewards/accuracies": 0.75}),
                    {"current_steps": 2, "total_steps": 10, "train_runtime": 3.0, "train_loss": 0.65}])
    (run / RUN_CONFIG_FILE).write_text("# cwd: /somewhere\nstage: dpo\nmodel_name_or_path: m\ndataset: demo_pref\n")
    summary = runs.summarize_run(tmp_path, run)
    assert (summary.stage, summary.model, summary.dataset) == ("dpo", "m", "demo_pref")
    assert (summary.loss, summary.reward, summary.accuracy) == (0.6, 0.3, 0.75)  # the summary's train_loss is no point
    series = runs.curves(runs.read_records(run))
    assert series["eval_loss"] == [(1, 0.7)] and series["loss"] == [(1, 0.69), (2, 0.6)]
    assert "train_loss" not in series
    assert runs.stage_metric_keys("dpo", list(series)) == ["rewards/margins", "rewards/accuracies"]
    # A stage without an entry in STAGE_METRICS shows every metric it logged but the shared ones.
    logged = ["loss", "learning_rate", "grad_norm", "my_metric", "rewards/f/mean", "aux/kl"]
    assert runs.stage_metric_keys("a_new_stage", logged) == ["aux/kl", "my_metric", "rewards/f/mean"]
    assert runs.read_run_config(run) == ({"stage": "dpo", "model_name_or_path": "m", "dataset": "demo_pref"},
                                         "/somewhere")
    # a run without run_config.yaml: the stage is read from what it logged
    (run / RUN_CONFIG_FILE).unlink()
    assert runs.summarize_run(tmp_path, run).stage == "dpo"


def test_grpo_metrics_and_completions_table(tmp_path):
    run = tmp_path / "grpo"
    write_log(run, [step(1, loss=0.0, reward=0.25, reward_std=0.1, kl=0.01, **{"rewards/accuracy/mean": 0.25})])
    rows = [{"step": 1, "prompt": f"p{i}", "completion": "c", "rewards": {"accuracy": 1.0}} for i in range(3)]
    (run / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2, "pro')
    summary = runs.summarize_run(tmp_path, run)
    assert (summary.stage, summary.reward) == ("grpo", 0.25)
    keys = runs.stage_metric_keys("grpo", list(runs.curves(runs.read_records(run))))
    assert keys == ["reward", "reward_std", "kl", "rewards/accuracy/mean"]
    name, table = runs.table_rows(run)
    assert name == "completions.jsonl" and [r["prompt"] for r in table] == ["p0", "p1", "p2"]
    assert table[0]["rewards"] == '{"accuracy": 1.0}'


def test_final_metrics_prefer_all_results(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_results.json").write_text(json.dumps({"train_loss": 1.0, "epoch": 1.0}))
    (run / "eval_results.json").write_text(json.dumps({"eval_loss": 2.0}))
    assert runs.final_metrics(run) == {"train_loss": 1.0, "epoch": 1.0, "eval_loss": 2.0}


def test_paths_outside_the_runs_folder_are_refused(tmp_path):
    root = tmp_path / "runs"
    (root / "a").mkdir(parents=True)
    assert runs.resolve_inside(root, "a") == (root / "a").resolve()
    for outside in ("..", "../x", str(tmp_path), "/etc"):
        with pytest.raises(runs.BoardError, match="outside the runs folder"):
            runs.resolve_inside(root, outside)
    (root / "link").symlink_to(tmp_path)  # a symbolic link out of the folder does not get around it
    with pytest.raises(runs.BoardError, match="outside the runs folder"):
        runs.resolve_inside(root, "link/x")


def test_format_duration():
    assert [runs.format_duration(s) for s in (None, 42, 185, 3725)] == ["", "42s", "3m 05s", "1h 02m"]


def test_launch_check_gives_the_command_lines_errors_and_keeps_output_dir_inside(tmp_path, tiny_model_dir):
    root, work = tmp_path / "runs", tmp_path / "work"
    work.mkdir()
    good = f"model_name_or_path: {tiny_model_dir}\nstage: sft\ndataset: d.jsonl\noutput_dir: {root}/one\n"
    with pytest.raises(ConfigError, match="Did you mean `learning_rate`"):
        launch.check_launch(root, good, ["learnig_rate=1e-4"], work)
    with pytest.raises(ConfigError, match="not of the form key=value"):
        launch.split_overrides("max_steps 3")
    with pytest.raises(ConfigError, match="not valid YAML"):
        launch.check_launch(root, "stage: [sft", [], work)
    with pytest.raises(runs.BoardError, match="outside the runs folder"):
        launch.check_launch(root, good, [f"output_dir={tmp_path}/elsewhere"], work)
    with pytest.raises(runs.BoardError, match="outside the runs folder"):
        launch.check_launch(root, good, ["output_dir=../../x"], work)
    assert not list((root / launch.LAUNCH_DIR).glob("*.yaml"))  # refused configs are not kept
    config_file, output_dir = launch.check_launch(root, good, ["max_steps=3"], work)
    assert output_dir == (root / "one").resolve() and config_file.read_text() == good
    assert launch.split_overrides("max_steps=3 learning_rate=1e-3\n# a comment\nlogging_steps=1") == [
        "max_steps=3", "learning_rate=1e-3", "logging_steps=1"]


class StopAt(TrainerCallback):
    """Writes the stop request while step `n` trains, as the board's Stop button does from outside."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.n:
            request_stop(args.output_dir)


def test_stop_request_ends_the_step_with_a_checkpoint_and_a_rerun_resumes(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"question {i}?", "output": f"answer {i}."}) + "\n"
                            for i in range(8)))
    values = {"model_name_or_path": tiny_model_dir, "stage": "sft", "finetuning_type": "lora", "lora_rank": 4,
              "dataset": str(data), "cutoff_len": 64, "output_dir": str(out), "per_device_train_batch_size": 2,
              "max_steps": 6, "learning_rate": 5e-3, "use_cpu": True, "save_strategy": "steps", "save_steps": 100,
              "logging_steps": 1, "do_train": True}
    run_train(parse_config(values), callbacks=[StopAt(3)])
    assert [r["current_steps"] for r in read_log(out) if "loss" in r] == [1, 2, 3]
    assert runs.checkpoints_of(out) == [3]  # saved at the stop although save_steps is 100
    assert runs.run_status(out) == "stopped"
    assert not (out / LOCK_FILE).exists()
    recorded, _ = runs.read_run_config(out)
    assert recorded["max_steps"] == 6 and recorded["output_dir"] == str(out)

    run_train(parse_config(values))  # the same config again: the stale request is dropped, step 3 resumed
    assert [r["current_steps"] for r in read_log(out) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert runs.run_status(out) == "finished" and not (out / STOP_FILE).exists()


def test_a_whitespace_reply_is_shown_as_such():
    from alignkit.board.app import _shown

    assert _shown("Paris.") == "Paris."
    assert _shown("\n\n") == "(the model replied with whitespace only: 2 characters)"
    assert _shown("") == "(no reply yet)"


def test_a_log_is_read_from_where_the_last_read_ended_and_bounded(tmp_path, monkeypatch):
    """The page reads a run's log every 2 s: only what was appended since is read; a log rewritten (a resume
    replaces it; rewritten in place, it keeps its inode) is read again; a long one is held to its newest records
    and, met for the first time, read from its last bytes only."""
    run = tmp_path / "run"
    write_log(run, [step(1, loss=2.5), step(2, loss=2.0)], tail='{"current_steps": 3, "total_steps": 10, "lo')
    assert [r["current_steps"] for r in runs.read_records(run)] == [1, 2]
    log = run / LOG_FILE
    reads = []
    real_open = open

    def counting_open(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        if Path(file) == log:
            real_read = handle.read
            handle.read = lambda size=-1: reads.append(size) or real_read(size)
        return handle

    monkeypatch.setattr("builtins.open", counting_open)
    with log.open("a", encoding="utf-8") as f:  # the half-written line is finished, and one more appended
        f.write('ss": 1.5}\n' + json.dumps(step(4, loss=1.0)) + "\n")
    appended = len('ss": 1.5}\n' + json.dumps(step(4, loss=1.0)) + "\n")
    assert [r["current_steps"] for r in runs.read_records(run)] == [1, 2, 3, 4]
    assert reads[-1] == appended + len('{"current_steps": 3, "total_steps": 10, "lo')  # from the cut line on
    assert [r["current_steps"] for r in runs.read_records(run)] == [1, 2, 3, 4]
    assert reads[-1] == 0  # nothing new: nothing read past the first bytes

    write_log(run, [step(7, loss=0.7)] * 3)  # rewritten in place (same inode), longer than what was read
    assert [r["current_steps"] for r in runs.read_records(run)] == [7, 7, 7]

    monkeypatch.setattr(runs, "LOG_RECORDS_KEPT", 5)
    monkeypatch.setattr(runs, "LOG_TAIL_BYTES", 10 * len(json.dumps(step(10, total=100))) + 5)
    long_run = tmp_path / "long"
    write_log(long_run, [step(n, total=100, loss=1.0 / n) for n in range(10, 100)])
    got = [r["current_steps"] for r in runs.read_records(long_run)]
    assert got == list(range(95, 100))  # the newest records, none cut at the tail's first line
    assert max(reads) <= runs.LOG_TAIL_BYTES
