"""Every shipped example YAML opens with the command that runs it and parses without error."""

from pathlib import Path

import pytest

from alignkit.hparams import read_config

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def test_there_are_examples():
    assert EXAMPLES, "examples/ holds no YAML"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_opens_with_its_command_and_parses(path):
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith(f"# alignkit train examples/{path.name}"), first
    config = read_config(path)
    assert path.name.split("_")[0] == config.finetuning.stage  # sft_lora.yaml runs stage sft
