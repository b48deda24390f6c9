"""`alignkit board` in a real browser: headless Chromium (the system's package) driven by Playwright.

One walk through the page, as a user would: check a config with a typo and see the command line's error;
launch two tiny-model SFT runs; watch the first one's progress and loss curve appear and the run finish;
stop the second one and see it stopped with a checkpoint; compare the two; chat with the first one's model
beside its base. Each page is saved as a screenshot to a folder the test prints, and the browser console
must show no errors. If the browser cannot run, the test fails saying exactly why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
# What Chromium needs in a container without a display, a GPU or a network (and a fresh profile each run).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
WAIT_MS = 120_000
# A plot shows n curves: line marks whose paths go through at least two points (an empty plot has the mark
# element with an empty path).
LINES_DRAWN = """([id, n]) => [...document.querySelectorAll(id + ' svg .mark-line path')]
    .filter(p => (p.getAttribute('d') || '').split('L').length >= 2).length >= n"""  # the longest wait for one thing to appear (a run on a busy 2-core machine)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def browser_problem() -> str | None:
    """Why the browser test cannot run here, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed: run scripts/setup.sh (the dev extra installs it)"
    try:
        import gradio  # noqa: F401
    except ImportError:
        return "gradio is not installed: run scripts/setup.sh (it installs the board extra)"
    if not CHROMIUM.is_file():
        return f"{CHROMIUM} is missing: scripts/setup.sh installs Debian's chromium package (apt-get install chromium)"
    return None


@pytest.fixture
def board_workdir(tmp_path, tiny_model_dir):
    """A folder to run the board from: examples/tiny_sft.yaml over the tiny model, data/qa.jsonl, runs/."""
    work = tmp_path / "work"
    (work / "examples").mkdir(parents=True)
    (work / "data").mkdir()
    rows = [{"instruction": f"What is {i} plus {i}?", "output": f"{i} plus {i} is {2 * i}."} for i in range(16)]
    (work / "data" / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (work / "examples" / "tiny_sft.yaml").write_text(
        "# alignkit train examples/tiny_sft.yaml\n"
        f"model_name_or_path: {tiny_model_dir}\n"
        "stage: sft\nfinetuning_type: lora\nlora_rank: 4\n"
        "dataset: data/qa.jsonl\ntemplate: chatml\ncutoff_len: 64\n"
        "output_dir: runs/sft_a\nper_device_train_batch_size: 4\nmax_steps: 8\nlearning_rate: 5.0e-3\n"
        "logging_steps: 1\nsave_steps: 4\nuse_cpu: true\nmax_new_tokens: 12\n", encoding="utf-8")
    (work / "runs").mkdir()
    return work


@pytest.fixture
def board_url(board_workdir, tmp_path):
    """`alignkit board --runs runs --port N` started in `board_workdir` as a user would; its URL."""
    problem = browser_problem()
    if problem:
        pytest.fail(f"the browser test cannot run: {problem}")
    port = free_port()
    log = open(tmp_path / "board.log", "wb")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               GRADIO_ANALYTICS_ENABLED="False", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    board = subprocess.Popen([sys.executable, "-m", "alignkit", "board", "--runs", "runs", "--port", str(port)],
                             cwd=board_workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 180
    while True:
        try:
            urllib.request.urlopen(url, timeout=5)
            break
        except OSError:
            if board.poll() is not None or time.time() > deadline:
                board.kill()
                pytest.fail(f"alignkit board did not start: {(tmp_path / 'board.log').read_text()[-3000:]}")
            time.sleep(1)
    yield url
    board.terminate()
    try:
        board.wait(timeout=30)
    except subprocess.TimeoutExpired:
        board.kill()
    log.close()
    for child in (board_workdir / "runs").glob("*/.alignkit.lock"):  # a run still going: stop it with the board
        holder = json.loads(child.read_text() or "{}")
        if isinstance(holder.get("pid"), int):
            try:
                os.kill(holder["pid"], 9)
            except ProcessLookupError:
                pass


def pick(page, dropdown_id: str, option: str) -> None:
    """Choose `option` in a Gradio dropdown."""
    page.locator(f"#{dropdown_id} input").click()
    page.get_by_role("option", name=option, exact=True).click()


def test_board_in_a_browser(board_url, board_workdir, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    shots = Path(os.environ.get("ALIGNKIT_BOARD_SCREENSHOTS", tmp_path / "screenshots"))
    shots.mkdir(parents=True, exist_ok=True)
    print(f"\nboard screenshots: {shots}")
    errors: list[str] = []
    with sync_playwright() as p:
        try:
            context = p.chromium.launch_persistent_context(
                str(tmp_path / "chromium-profile"), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
                # Tall enough for every page: a full-page screenshot of a longer page resizes the viewport, and the
                # plots, redrawn for the new size, would be caught blank.
                viewport={"width": 1280, "height": 1600})
        except Exception as err:
            pytest.fail(f"the browser test cannot run: Chromium ({CHROMIUM}) did not start: {err}")
        page = context.new_page()
        page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
        page.set_default_timeout(WAIT_MS)
        expect.set_options(timeout=WAIT_MS)
        page.goto(board_url)
        expect(page.locator("#runs-table")).to_be_visible()

        # Launch: an example config, a typo caught as the command line catches it, then two runs.
        page.get_by_role("tab", name="Launch", exact=True).click()
        pick(page, "example-pick", "tiny_sft.yaml")
        expect(page.locator("#yaml-box textarea")).to_have_value(re.compile("output_dir: runs/sft_a"))
        for overrides, refusal in (("learnig_rate=1e-3", "Did you mean learning_rate?"),
                                   ("output_dir=/tmp/elsewhere", "outside the runs folder")):
            page.locator("#overrides-box textarea").fill(overrides)
            page.locator("#check-button").click()
            expect(page.locator("#launch-message")).to_contain_text(refusal)
        page.screenshot(path=str(shots / "launch.png"), full_page=True)
        page.locator("#overrides-box textarea").fill("")
        page.locator("#start-button").click()
        expect(page.locator("#launch-message")).to_contain_text("Started sft_a")
        # The second run: long enough to be stopped while it trains.
        page.locator("#overrides-box textarea").fill("output_dir=runs/sft_b learning_rate=1e-3\nmax_steps=2000")
        page.locator("#start-button").click()
        expect(page.locator("#launch-message")).to_contain_text("Started sft_b")

        # One run: progress, then the loss curve, then finished.
        page.get_by_role("tab", name="Run", exact=True).click()
        expect(page.locator("#run-pick")).to_be_visible()
        page.wait_for_function("document.querySelector('#run-pick input') !== null")
        _wait_for_option(page, "run-pick", "sft_a")
        status = page.locator("#run-status")
        expect(status).to_contain_text(re.compile(r"step \d+ of 8"))
        page.wait_for_function(LINES_DRAWN, arg=["#loss-plot", 1])  # the curve appears while the run trains
        expect(status).to_contain_text("finished")
        expect(status).to_contain_text("step 8 of 8")
        expect(page.locator("#final-metrics")).to_contain_text("train_loss")
        # Selecting a run draws its plots, and the next refresh may draw them once more: screenshot after that.
        page.wait_for_timeout(3000)
        page.wait_for_function(LINES_DRAWN, arg=["#loss-plot", 1])
        page.wait_for_function(LINES_DRAWN, arg=["#lr-plot", 1])
        page.screenshot(path=str(shots / "run.png"), full_page=True)

        # Stop the second run from its page: it ends at a step boundary with a checkpoint.
        _wait_for_option(page, "run-pick", "sft_b")
        expect(status).to_contain_text("running")
        expect(status).to_contain_text(re.compile(r"step \d+ of 2000"))
        expect(page.locator("#stop-button")).to_be_enabled()
        page.locator("#stop-button").click()
        expect(page.locator("#run-action")).to_contain_text("Stop requested")
        expect(status).to_contain_text("stopped")
        expect(status).to_contain_text("checkpoints at steps")
        expect(page.locator("#resume-button")).to_be_enabled()
        page.screenshot(path=str(shots / "run_stopped.png"), full_page=True)

        # Runs list: both, with their statuses.
        page.get_by_role("tab", name="Runs", exact=True).click()
        expect(page.locator("#runs-table")).to_contain_text("finished")
        expect(page.locator("#runs-table")).to_contain_text("stopped")
        page.screenshot(path=str(shots / "runs.png"), full_page=True)

        # Compare the two runs' loss curves and final metrics.
        page.get_by_role("tab", name="Compare", exact=True).click()
        _wait_for_option(page, "compare-pick", "sft_a", multiselect=True)
        _wait_for_option(page, "compare-pick", "sft_b", multiselect=True)
        expect(page.locator("#compare-table")).to_contain_text("train_loss")
        expect(page.locator("#compare-table")).to_contain_text("sft_b")
        expect(page.locator("#compare-plot")).to_contain_text("sft_b")  # the legend names both runs
        expect(page.locator("#compare-plot")).to_contain_text("sft_a")
        page.wait_for_function(LINES_DRAWN, arg=["#compare-plot", 2])
        page.screenshot(path=str(shots / "compare.png"), full_page=True)

        # Chat with the finished run's model beside its base, streaming.
        page.get_by_role("tab", name="Chat", exact=True).click()
        _wait_for_option(page, "chat-pick", "sft_a")
        page.locator("#chat-message textarea").fill("What is 2 plus 2?")
        page.locator("#chat-send").click()
        # Both replies streamed in: each chat shows the question and, after it, text the model wrote.
        question = "What is 2 plus 2?"
        replies_js = """([q]) => ['#run-bot', '#base-bot'].map(id => {
            const text = document.querySelector(id).innerText;
            const at = text.indexOf(q);
            return at < 0 ? '' : text.slice(at + q.length).trim(); })"""
        page.wait_for_function(f"({replies_js})([{question!r}]).every(r => r.length > 0)", timeout=WAIT_MS)
        expect(page.locator("#chat-message textarea")).to_have_value("")  # the last yield clears the box
        replies = page.evaluate(replies_js, [question])
        print(f"chat replies (run's model, base): {replies}")
        expect(page.locator("#chat-error")).not_to_contain_text("Error")
        page.screenshot(path=str(shots / "chat.png"), full_page=True)
        context.close()

    assert not errors, "the browser console shows errors:\n" + "\n".join(errors)
    # What the page showed is what the folders hold: the stopped run resumes from its checkpoint.
    stopped = board_workdir / "runs" / "sft_b"
    assert (stopped / "alignkit.stop").exists() and list(stopped.glob("checkpoint-*"))
    docs = os.environ.get("ALIGNKIT_BOARD_DOCS")  # refresh docs/board/*.png for docs/board.md
    if docs:
        for shot in shots.glob("*.png"):
            shutil.copy(shot, Path(docs) / shot.name)


def _wait_for_option(page, dropdown_id: str, option: str, multiselect: bool = False) -> None:
    """Choose `option` once the refreshing list offers it (runs appear as they start)."""
    deadline = time.time() + WAIT_MS / 1000
    box = page.locator(f"#{dropdown_id} input")
    while True:
        box.click()
        if not multiselect:
            box.fill(option)  # the list shows the choices matching what the box holds
        found = page.get_by_role("option", name=option, exact=True)
        if found.count():
            found.first.click()
            if multiselect:  # the list stays open for more choices
                page.keyboard.press("Escape")
            box.blur()
            if multiselect or box.input_value() == option:
                return
        else:
            page.keyboard.press("Escape")
            # The list opens when the input gains focus: let it go, so the next click opens it again.
            box.blur()
        if time.time() > deadline:
            page.screenshot(path=str(Path(os.environ.get("ALIGNKIT_BOARD_SCREENSHOTS", "/tmp")) / "failed.png"),
                            full_page=True)
            raise AssertionError(f"{option} never appeared in #{dropdown_id}")
        page.wait_for_timeout(1000)
