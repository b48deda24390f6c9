"""The board reads and writes nothing outside `--runs`, symbolic links included (issue 31).

Each test plants a link the way someone with a shell on the machine could (a run's file, a run folder or
the launch folder pointing elsewhere) or asks a launch to write elsewhere, and checks that the board
refuses, saying which file and why, and that the file outside is neither shown nor changed. Starting a
process is replaced by a recorder (`no_start`, `fake_start`) so that a refusal that fails to happen never
starts a real training run. One test goes through the page's HTTP API, as the issue's report did.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from alignkit.board import launch, runs
from alignkit.board.app import Board
from alignkit.callbacks import LOG_FILE, STOP_FILE
from alignkit.lifecycle import LOCK_FILE, STATE_FILE
from alignkit.train import RUN_CONFIG_FILE

pytestmark = pytest.mark.fault  # issue 31's bad case 2: also in the fault tier (-m fault)

SECRET = "SECRET-outside-the-runs-folder"
# What each linked file holds outside: something the board would show, if it read it.
OUTSIDE_TEXT = {
    RUN_CONFIG_FILE: f"stage: dpo\nmodel_name_or_path: {SECRET}\n",
    launch.CONSOLE_FILE: f"{SECRET}\n",
    "generated_predictions.jsonl": json.dumps({"prompt": SECRET, "predict": "x"}) + "\n",
    LOG_FILE: json.dumps({"current_steps": 1, "total_steps": 9, "loss": 1.0, SECRET: 7.0}) + "\n",
    STATE_FILE: json.dumps({"global_step": 9, "max_steps": 9, "best_model_checkpoint": SECRET}),
}


@pytest.fixture
def places(tmp_path):
    """(runs folder, working folder, a folder outside both)."""
    root, work, outside = tmp_path / "runs", tmp_path / "work", tmp_path / "outside"
    for folder in (root, work, outside):
        folder.mkdir()
    return root, work, outside


def linked_run(root: Path, outside: Path, name: str, folder: str = "a") -> Path:
    """A run folder whose file `name` is a link to a file outside the runs folder (the rest is real)."""
    run = root / folder
    (run / "checkpoint-1").mkdir(parents=True)  # a run folder whatever file is linked
    if name != LOG_FILE:
        (run / LOG_FILE).write_text(json.dumps({"current_steps": 1, "total_steps": 9, "loss": 2.0}) + "\n")
    target = outside / f"{folder}-{name}"
    target.write_text(OUTSIDE_TEXT[name], encoding="utf-8")
    (run / name).symlink_to(target)
    return run


@pytest.fixture
def no_start(monkeypatch):
    """Fails the test if the board starts a process."""
    started = []

    def refuse(command, **kwargs):
        started.append(command)
        raise AssertionError(f"the board started {command} although the request had to be refused")

    monkeypatch.setattr(launch.subprocess, "Popen", refuse)
    return started


@pytest.fixture
def fake_start(monkeypatch):
    """Stands in for the started run: writes a console line to the stdout it is given, as `alignkit train`
    does, and is a process that has already ended."""
    started, popen = [], subprocess.Popen  # launch.subprocess is this module's subprocess: keep the real one

    def start(command, stdout, **kwargs):
        stdout.write(b"the training console\n")
        stdout.flush()
        started.append(command)
        return popen([sys.executable, "-c", "pass"])

    monkeypatch.setattr(launch.subprocess, "Popen", start)
    yield started


@pytest.mark.parametrize("name", list(OUTSIDE_TEXT))
def test_a_run_file_linked_outside_is_not_read(places, name):
    root, work, outside = places
    linked_run(root, outside, name)
    board = Board(root, work)
    with pytest.raises(runs.BoardError, match=rf"a/{name} leads .*outside"):
        board.run_view("a")
    try:  # compare reads the log, state, config and results (not the console or the predictions)
        shown = board.compare_view(["a"], "loss")
    except runs.BoardError as err:
        assert f"a/{name} leads" in str(err)
    else:
        assert SECRET not in repr(shown)
    # the runs list leaves out a run it cannot read rather than show what is outside (or break for every run)
    assert SECRET not in repr([(s.name, s.stage, s.model, s.step, s.status, s.values) for s in board.summaries()])


def test_a_run_file_linked_inside_its_folder_is_read(places):
    root, work, _ = places
    run = root / "a"
    run.mkdir()
    (run / "kept.yaml").write_text("stage: dpo\n")
    (run / RUN_CONFIG_FILE).symlink_to("kept.yaml")  # a link that stays in the run folder is followed
    assert runs.summarize_run(root, run).stage == "dpo"


def test_show_run_over_http_does_not_return_linked_files(places):
    """The issue's report: `POST /gradio_api/call/show_run` returned the linked file's text."""
    root, work, outside = places
    for index, name in enumerate(OUTSIDE_TEXT):
        linked_run(root, outside, name, folder=f"run{index}")
    from alignkit.board.app import build_app

    app = build_app(Board(root, work))
    app.queue()
    app.launch(server_name="127.0.0.1", server_port=None, prevent_thread_lock=True, quiet=True, ssr_mode=False)
    try:
        for index, name in enumerate(OUTSIDE_TEXT):
            call = urllib.request.Request(f"{app.local_url}gradio_api/call/show_run",
                                          data=json.dumps({"data": [f"run{index}"]}).encode(),
                                          headers={"Content-Type": "application/json"})
            event = json.loads(urllib.request.urlopen(call, timeout=60).read())["event_id"]
            answer = urllib.request.urlopen(f"{app.local_url}gradio_api/call/show_run/{event}", timeout=60).read()
            text = answer.decode()
            assert SECRET not in text, name
            # the board's refusal, or (for a run the list leaves out) the page's own: not one of its runs
            assert f"{name} leads" in text or "not in the list of choices" in text, text[:500]
    finally:
        app.close()


def test_a_run_folder_linked_outside_is_not_listed(places):
    root, work, outside = places
    elsewhere = outside / "run"
    elsewhere.mkdir()
    (elsewhere / RUN_CONFIG_FILE).write_text(f"stage: dpo\nmodel_name_or_path: {SECRET}\n")
    (elsewhere / LOG_FILE).write_text(json.dumps({"current_steps": 3, "total_steps": 9, "loss": 1.0}) + "\n")
    (root / "linked").symlink_to(elsewhere)
    (root / "group").mkdir()
    (root / "group" / "deeper").symlink_to(elsewhere)
    assert runs.find_runs(root) == []
    assert Board(root, work).summaries() == []
    with pytest.raises(runs.BoardError, match="outside the runs folder"):
        Board(root, work).run_view("linked")


def failed_run(root: Path, work: Path, tiny_model_dir: str) -> Path:
    """`root/a`: a run that failed after its first step, with the config it was started with (resumable)."""
    run = root / "a"
    run.mkdir()
    (run / RUN_CONFIG_FILE).write_text(f"# cwd: {work}\nmodel_name_or_path: {tiny_model_dir}\nstage: sft\n"
                                       f"dataset: d.jsonl\noutput_dir: {run}\nmax_steps: 3\ndo_train: true\n")
    (run / LOG_FILE).write_text(json.dumps({"current_steps": 1, "total_steps": 3, "loss": 2.0}) + "\n")
    return run


@pytest.mark.parametrize("where", ["outside", "runs", "run"])
def test_resume_does_not_append_through_a_linked_console(places, tiny_model_dir, fake_start, where):
    """No file is opened for writing through a link: one out of the runs folder, one to elsewhere in it, even one
    that stays in the run's own folder."""
    root, work, outside = places
    run = failed_run(root, work, tiny_model_dir)
    target = {"outside": outside, "runs": root, "run": run}[where] / "console.txt"
    target.write_bytes(b"what was there before\n")
    (run / launch.CONSOLE_FILE).symlink_to(target)
    board = Board(root, work)
    assert runs.run_status(run) == "failed"
    with pytest.raises(runs.BoardError, match=rf"{launch.CONSOLE_FILE} .*link"):
        board.resume("a")
    assert target.read_bytes() == b"what was there before\n"
    assert fake_start == [] and board.launches == {}


def test_resume_appends_to_a_plain_console(places, tiny_model_dir, fake_start):
    """The refusal above is about links: a run's own console file is appended to as before."""
    root, work, _ = places
    run = failed_run(root, work, tiny_model_dir)
    (run / launch.CONSOLE_FILE).write_bytes(b"first run\n")
    Board(root, work).resume("a")
    assert (run / launch.CONSOLE_FILE).read_bytes() == b"first run\nthe training console\n"
    assert len(fake_start) == 1


@pytest.mark.parametrize("where", ["outside", "run"])
def test_stop_does_not_write_through_a_linked_stop_file(places, where):
    root, work, outside = places
    run = root / "a"
    run.mkdir()
    (run / LOG_FILE).write_text(json.dumps({"current_steps": 1, "total_steps": 3}) + "\n")
    target = {"outside": outside, "run": run}[where] / "elsewhere.txt"  # even in the run's folder: no write
    target.write_text("kept\n")
    (run / STOP_FILE).symlink_to(target)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # the run's live process
    try:
        (run / LOCK_FILE).write_text(json.dumps({"pid": holder.pid, "host": None}))
        with pytest.raises(runs.BoardError, match=rf"{STOP_FILE} .*link"):
            Board(root, work).stop("a")
    finally:
        holder.kill()
        holder.wait()
    assert target.read_text() == "kept\n"


def good_config(tiny_model_dir: str, root: Path) -> str:
    return f"model_name_or_path: {tiny_model_dir}\nstage: sft\ndataset: d.jsonl\noutput_dir: {root}/one\n"


@pytest.mark.parametrize("override", ["tokenized_path={outside}/tokens", "cache_dir={outside}/hub",
                                      "tokenized_path=../outside/tokens", "report_to=wandb"])
def test_a_launch_that_would_write_outside_is_refused_before_anything_starts(places, tiny_model_dir, no_start,
                                                                              override):
    root, work, outside = places
    override = override.format(outside=outside)
    key = override.split("=")[0]
    board = Board(root, work)
    with pytest.raises(runs.BoardError, match=rf"^{key}="):
        board.check(good_config(tiny_model_dir, root), override)
    with pytest.raises(runs.BoardError, match=rf"^{key}="):
        board.start(good_config(tiny_model_dir, root), override)
    assert no_start == [] and board.launches == {}
    assert list(outside.iterdir()) == [] and not (root / "one").exists()
    assert list((root / launch.LAUNCH_DIR).iterdir()) == []  # refused configs are not kept


def test_a_launch_that_writes_inside_is_accepted(places, tiny_model_dir):
    root, work, _ = places
    _, output_dir = launch.check_launch(root, good_config(tiny_model_dir, root),
                                        [f"tokenized_path={root}/tokens", "cache_dir=../runs/hub",
                                         "report_to=tensorboard"], work)
    assert output_dir == (root / "one").resolve()


def test_a_launch_folder_linked_outside_is_not_written(places, tiny_model_dir, no_start):
    root, work, outside = places
    (root / launch.LAUNCH_DIR).symlink_to(outside)
    with pytest.raises(runs.BoardError, match=rf"{launch.LAUNCH_DIR} leads .*outside"):
        Board(root, work).check(good_config(tiny_model_dir, root), "")
    assert list(outside.iterdir()) == []


def test_chat_refuses_a_run_whose_weights_link_outside(places):
    root, work, outside = places
    run = root / "a"
    run.mkdir()
    (run / RUN_CONFIG_FILE).write_text("model_name_or_path: base\nstage: sft\n")
    (run / "adapter_config.json").write_text("{}")
    (outside / "weights.safetensors").write_bytes(b"x")
    (run / "adapter_model.safetensors").symlink_to(outside / "weights.safetensors")
    with pytest.raises(runs.BoardError, match="adapter_model.safetensors leads .*outside"):
        Board(root, work).chat_pair("a")
