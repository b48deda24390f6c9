"""`alignkit score`: read prompt/response rows from a .jsonl file, write them back with a `score` added.

The command's own part is the file: every row is read and checked (the message names the file, line and
field) before the model loads, and the scored rows are written in the input's order with every column kept.
Loading the reward model and scoring are `alignkit.rewards.scoring.RewardScorer` (the same scorer the online
stages use for a reward model loaded on its own), so a row scores here as the pair did in the rm run's
evaluation.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

from .errors import DataError
from .files import parse_mapping
from .jsonl import write_jsonl
from .rewards.scoring import Messages, RewardScorer, as_messages

logger = logging.getLogger(__name__)


def _read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row = parse_mapping(line, f"{path} line {line_no}", syntax="json", error=DataError,
                                expected="expected a JSON object", hint="Write one object per line.")
            rows.append((line_no, row))
    return rows


def _row_to_pair(path: Path, line_no: int, row: dict[str, Any]) -> tuple[Messages, str]:
    """(prompt messages, response) from a row with `messages`, or `prompt` + `response` (+ optional `system`)."""
    where = f"{path} line {line_no}"
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict) \
                or messages[-1].get("role") != "assistant":
            raise DataError(f"{where}: `messages` must be a list of {{role, content}} ending with the assistant "
                            "message to score.")
        return messages[:-1], str(messages[-1].get("content", ""))
    missing = [key for key in ("prompt", "response") if key not in row]
    if missing:
        raise DataError(f"{where}: missing {' and '.join(f'`{m}`' for m in missing)}; each row needs `prompt` and "
                        f"`response` (or `messages` ending with an assistant turn). Columns found: {sorted(row)}.")
    if not isinstance(row["response"], str):
        raise DataError(f"{where}: `response` must be a string, got {type(row['response']).__name__}.")
    return as_messages(row["prompt"], row.get("system")), row["response"]


def score_file(
    model_dir: str | os.PathLike,
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    batch_size: int = 8,
    cutoff_len: Optional[int] = None,
    template: Optional[str] = None,
) -> int:
    """Read jsonl rows (`prompt` + `response`, or `messages`), write them back with a `score` added.

    Args:
        model_dir: rm output directory or exported reward model.
        input_path: jsonl file, one row per response to score.
        output_path: where the scored rows go (same order, every input column kept).
        batch_size: sequences per forward pass.
        cutoff_len: most tokens per sequence (None: no truncation).
        template: the chat template used in training (None: the tokenizer's own).

    Returns:
        The number of rows scored.

    Raises:
        DataError: a row is not JSON or lacks the fields; the message names the file, line and field.
    """
    input_path, output_path = Path(input_path), Path(output_path)
    if not input_path.is_file():
        raise FileNotFoundError(f"input file {str(input_path)!r} does not exist.")
    rows = _read_jsonl(input_path)  # validate every row before the model loads
    pairs = [_row_to_pair(input_path, line_no, row) for line_no, row in rows]
    scorer = RewardScorer(model_dir, template=template, cutoff_len=cutoff_len, batch_size=batch_size)
    scores = scorer.score([p for p, _ in pairs], [r for _, r in pairs])
    write_jsonl(output_path, ({**row, "score": score} for (_, row), score in zip(rows, scores)))
    logger.info("Scored %d rows from %s into %s", len(rows), input_path, output_path)
    return len(rows)


__all__ = ["score_file"]
