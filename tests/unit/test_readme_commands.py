"""Every command in README.md's code blocks is exercised here or listed as skipped with the reason (issue 32).

Cheap checks only, in this process: a `train` command's config goes through every check that runs before a model
loads (`read_config`, what `alignkit train` does first); another command's words go through the CLI's own parser,
so a renamed or removed option fails here; `--help-keys` and `env` run for real. What a command would do at length
(train for minutes, install) is listed in SKIPPED_RUNS with where it is tested instead. The text checks keep the
held-out evaluation written with one setting everywhere and every named example and data set existing.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from alignkit.cli import build_parser, main
from alignkit.config.parse import read_config

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# Commands not run here, and why. Each reason names where the run is tested instead.
SKIPPED_RUNS = {
    "bash scripts/demo.sh": "installs into .venv and trains the bundled model for minutes; its script is checked by "
                            "test_setup_scripts_install_by_purpose, alignkit demo's check and report by "
                            "tests/unit/test_demo_eval.py",
    "bash scripts/test.sh": "is the test suite itself (CI runs it: .ci/run); its script is checked by "
                            "test_setup_scripts_install_by_purpose",
}
# Where each stage runs end to end on a tiny model for a few steps (PT shares SFT's causal-LM path and file).
STAGE_RUNS_TESTED_IN = {"pt": "tests/stages/test_sft.py"}


def stage_run_test(stage: str) -> Path:
    return ROOT / STAGE_RUNS_TESTED_IN.get(stage, f"tests/stages/test_{stage}.py")


def _code_lines(text: str) -> list[str]:
    """The lines inside ``` blocks."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S)
    return [line for block in blocks for line in block.splitlines()]


def readme_commands(text: str = README) -> list[str]:
    """The commands of the README's bash blocks: comments dropped, backslash-continued lines joined."""
    commands, pending = [], ""
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S):
        for line in block.splitlines():
            code = line.split(" #", 1)[0].rstrip() if not line.lstrip().startswith("#") else ""
            if code.endswith("\\"):
                pending += code[:-1].strip() + " "
                continue
            command = " ".join((pending + code).split())
            pending = ""
            if command:
                commands.append(command)
    return commands


COMMANDS = readme_commands()
TRAIN = sorted({c for c in COMMANDS if re.match(r"alignkit train [^-]", c)})
OTHER = sorted({c for c in COMMANDS if c.startswith("alignkit ") and c not in TRAIN})


def test_every_readme_command_is_exercised_or_skipped_with_a_reason():
    assert len(COMMANDS) > 20, COMMANDS
    unchecked = [c for c in COMMANDS if c not in TRAIN and c not in OTHER and c not in SKIPPED_RUNS]
    assert not unchecked, f"add these README commands to a test here or to SKIPPED_RUNS with the reason: {unchecked}"
    assert set(SKIPPED_RUNS) <= set(COMMANDS), "SKIPPED_RUNS lists a command the README no longer has"


@pytest.mark.parametrize("command", TRAIN)
def test_readme_train_command_passes_the_checks_before_loading(command, monkeypatch):
    """What `alignkit train` checks before any model loads: keys, types, ranges, the stage's own rules. Running the
    example trains for minutes; the stage runs end to end on a tiny model in `stage_run_test(stage)`."""
    monkeypatch.chdir(ROOT)
    words = shlex.split(command)
    config = read_config(words[2], words[3:])
    assert stage_run_test(config.finetuning.stage).is_file()


@pytest.mark.parametrize("command", OTHER)
def test_readme_command_parses_with_the_cli(command):
    """Its options exist under these names; the commands that need a trained adapter or a server are not run."""
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert callable(args.func)


def test_readme_help_keys_and_env_run(capsys):
    assert "alignkit train --help-keys" in COMMANDS and "alignkit env" in COMMANDS
    assert main(["train", "--help-keys"]) == 0
    shown = capsys.readouterr().out
    # README: "every key with its help: model, data, finetuning, generation, training, each stage; transformers'
    # training keys folded last"
    headings = re.findall(r"^\[(.+)\]$", shown, flags=re.M)
    assert headings[:5] == ["model", "data", "finetuning", "generation", "training"], headings
    assert "transformers" in headings[-1]
    assert main(["env"]) == 0
    assert "torch" in capsys.readouterr().out


def test_setup_scripts_install_by_purpose():
    """demo.sh installs only what the demo needs; test.sh the test stack. Both are valid bash."""
    scripts = ROOT / "scripts"
    for name in ("setup.sh", "demo.sh", "test.sh"):
        subprocess.run(["bash", "-n", str(scripts / name)], check=True)
    assert 'scripts/setup.sh" demo\n' in (scripts / "demo.sh").read_text(encoding="utf-8")
    assert 'scripts/setup.sh" test\n' in (scripts / "test.sh").read_text(encoding="utf-8")
    setup = (scripts / "setup.sh").read_text(encoding="utf-8")
    assert '  demo) extras="" ;;' in setup and '  test) extras="[dev,board]" ;;' in setup


def test_the_demo_math_eval_command_uses_one_max_new_tokens_everywhere():
    """The "Other commands" line said 256 where the GRPO section and the stage pages say 64. An evaluation with
    `--tools` gives the tool run's budget instead (its max_completion_length counts the whole conversation, 192)."""
    found = {}
    for page in DOCS:
        for line in page.read_text(encoding="utf-8").splitlines():
            if "--dataset demo_math_eval" in line and "--max-new-tokens" in line and "--tools" not in line:
                found.setdefault(re.search(r"--max-new-tokens (\d+)", line).group(1), []).append(page.name)
    assert len(found) == 1, found


def test_every_example_and_data_set_a_readme_command_names_exists():
    registered = json.loads((ROOT / "data" / "dataset_info.json").read_text(encoding="utf-8"))
    data_table = (ROOT / "docs" / "data.md").read_text(encoding="utf-8")
    lines = _code_lines(README)
    assert lines
    for line in lines:
        for example in re.findall(r"examples/[\w/.-]+\.(?:yaml|json)", line):
            assert (ROOT / example).is_file(), line
        for name in re.findall(r"--dataset (\w+)", line):
            assert name in registered and f"| `{name}` |" in data_table, line
