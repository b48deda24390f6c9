"""Write data/demo_math_eval.json: held-out word problems for `alignkit eval` before/after GRPO.

    python scripts/make_math_eval.py [--data data] [--rows 100] [--seed 12]

Rows come from the same problem families as data/demo_math.json (`scripts/make_demo_data.py`'s
`MATH_TEMPLATES`, English and Chinese, with the answer computed by each template's own formula), drawn
with a fixed seed. No problem of the training file is repeated: a problem is its prompt with the
person's name blanked out, so "Tom has 5 apples..." and "Anna has 5 apples..." count as the same one
and only one of them can appear in either file. The script checks this and the answers before writing,
and adds the `demo_math_eval` entry to data/dataset_info.json (same columns as `demo_math`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
from pathlib import Path

_spec = importlib.util.spec_from_file_location("make_demo_data", Path(__file__).with_name("make_demo_data.py"))
make_demo_data = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_demo_data)

ENTRY = {"file_name": "demo_math_eval.json", "columns": {"prompt": "prompt", "response": "answer"}}
_NAMES = sorted(make_demo_data.NAMES + make_demo_data.NAMES_ZH, key=len, reverse=True)
_NAME_RE = re.compile("|".join(r"\b" + re.escape(n) + r"\b" if n.isascii() else re.escape(n) for n in _NAMES))


def problem_key(prompt: str) -> str:
    """The prompt with every person's name replaced by `{name}`: the problem, whoever it is about."""
    return _NAME_RE.sub("{name}", prompt)


def solve(prompt: str) -> int | None:
    """The answer of a prompt written by one of the templates (its numbers read back), else None."""
    for template, formula in make_demo_data.MATH_TEMPLATES + make_demo_data.MATH_TEMPLATES_ZH:
        pattern = re.escape(template).replace(re.escape("{name}"), "(?:" + _NAME_RE.pattern + ")")
        pattern = pattern.replace(re.escape("{a}"), r"(?P<a>\d+)").replace(re.escape("{b}"), r"(?P<b>\d+)")
        match = re.fullmatch(pattern, prompt)
        if match:
            return formula(int(match.group("a")), int(match.group("b")))
    return None


def make_eval_rows(train_rows: list[dict], n: int, seed: int) -> list[dict]:
    """`n` rows whose problems are in neither `train_rows` nor each other."""
    rng = random.Random(seed)
    seen = {problem_key(row["prompt"]) for row in train_rows}
    rows = []
    for _ in range(100 * n):
        row = make_demo_data._math_row(rng)
        key = problem_key(row["prompt"])
        if key not in seen:
            seen.add(key)
            rows.append(row)
            if len(rows) == n:
                return rows
    raise RuntimeError(f"could not draw {n} new problems; the families have too few left.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data", help="folder with demo_math.json and dataset_info.json")
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument("--seed", type=int, default=12)
    args = parser.parse_args()
    data = Path(args.data)
    train_rows = json.loads((data / "demo_math.json").read_text(encoding="utf-8"))
    rows = make_eval_rows(train_rows, args.rows, args.seed)
    for row in rows:  # the answers are each template's formula applied to the numbers in the prompt
        assert solve(row["prompt"]) == int(row["answer"]), row
    out = data / ENTRY["file_name"]
    out.write_text(json.dumps(rows, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}: {len(rows)} rows")
    info_path = data / "dataset_info.json"
    info = json.loads(info_path.read_text(encoding="utf-8"))
    if info.get("demo_math_eval") != ENTRY:
        info["demo_math_eval"] = ENTRY
        info_path.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        print(f"added demo_math_eval to {info_path}")


if __name__ == "__main__":
    main()
