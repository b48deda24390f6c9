"""Write data/lm_eval/demo_reply_choice.jsonl: a multiple-choice task for `alignkit eval --tasks` from demo_sft_eval.

Each of demo_sft_eval's 60 rows (prompts the demo's SFT never trains on) becomes a question with four replies: its
own and three other rows' replies, drawn with a fixed seed and shuffled; `label` is the index of its own. A model
that follows the demo's data scores above chance (0.25). Run from the checkout: python scripts/make_lm_eval_task.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    rows = json.loads((ROOT / "data" / "demo_sft_eval.json").read_text(encoding="utf-8"))
    rng = random.Random(0)
    lines = []
    for index, row in enumerate(rows):
        question = "\n".join(part for part in (row["instruction"], row.get("input", "")) if part)
        others = [other["output"] for i, other in enumerate(rows) if i != index and other["output"] != row["output"]]
        choices = rng.sample(others, 3) + [row["output"]]
        rng.shuffle(choices)
        lines.append(json.dumps({"question": question, "choices": choices, "label": choices.index(row["output"])},
                                ensure_ascii=False))
    out = ROOT / "data" / "lm_eval" / "demo_reply_choice.jsonl"
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} rows to {out}")


if __name__ == "__main__":
    main()
