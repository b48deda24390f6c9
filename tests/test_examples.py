"""Every shipped example YAML opens with the command that runs it and parses without error."""

from pathlib import Path

import pytest

from alignkit.config.parse import read_config

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def test_there_are_examples():
    assert EXAMPLES, "examples/ holds no YAML"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_opens_with_its_command_and_parses(path):
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith(f"# alignkit train examples/{path.name}"), first
    config = read_config(path)
    # sft_lora.yaml runs stage sft; a stage name may hold an underscore itself (online_dpo_lora.yaml)
    assert path.name.startswith(f"{config.finetuning.stage}_")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_rerun_after_a_kill_resumes(path):
    """README: re-running a shipped example resumes it, so none may start afresh on each run."""
    config = read_config(path)
    assert config.training.do_train and config.training.overwrite_output_dir is False
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    assert "re-running one after a kill resumes it" in " ".join(readme.split())
