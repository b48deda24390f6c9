"""README.md's commands agree with each other and with the files they name (issue 32, "README drift").

Cheap checks on the text only: nothing here runs a command. The same held-out evaluation is written with the same
settings everywhere, and every example, data set and docs page a README command names exists.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _code_lines(text: str) -> list[str]:
    """The lines inside ``` blocks."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S)
    return [line for block in blocks for line in block.splitlines()]


def test_the_demo_math_eval_command_uses_one_max_new_tokens_everywhere():
    """The "Other commands" line said 256 where the GRPO section and the stage pages say 64."""
    found = {}
    for page in DOCS:
        for line in page.read_text(encoding="utf-8").splitlines():
            if "--dataset demo_math_eval" in line and "--max-new-tokens" in line:
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
