"""The exceptions alignkit raises for things a user must fix: the ground floor, importable from anywhere.

Each message says what is wrong, where (the config key; the file, row and field; the reward function), and
how to fix it. This module imports nothing of alignkit's, so a module that only needs to raise or catch one
of these does not tie itself to the config parser, the data loader or the stage registry.
"""

from __future__ import annotations

from typing import Optional


class ConfigError(ValueError):
    """A configuration problem the user must fix; the message says which key and how."""


class DataError(ValueError):
    """A dataset problem the user must fix; the message says where (file, row, field) and how.

    Validation happens where the data enters: every message names the file, the row (or the 1-based line
    of a .jsonl file), the field, what was expected, and the fix, so a bad row stops the run before any
    model is loaded instead of surfacing as a pyarrow or tokenizer error deep inside training.
    """


class RowError(ValueError):
    """A problem inside one row, raised by the format converters before the file and row are known.

    The data loader catches it, adds the file and row number, and either raises a `DataError` or (with
    `skip_invalid_rows`) records the row as skipped.

    Args:
        field: the column (or `column[index].key` path) that is wrong.
        problem: what is wrong and what was expected.
    """

    def __init__(self, field: Optional[str], problem: str) -> None:
        super().__init__(f"field `{field}`: {problem}" if field else problem)
        self.field = field
        self.problem = problem


class RewardFunctionError(ValueError):
    """A reward function failed or returned something unusable; the message names it, the row and the fix."""


class TrainingDiverged(RuntimeError):
    """Training produced a non-finite gradient norm, weight or loss; raised by `callbacks.DivergenceGuard`."""


class BoardError(ValueError):
    """A request the board refuses (a path outside the runs folder, a run that is not there); the message says why."""


def describe_value(value: object) -> str:
    """A short description of a wrong value for messages: its JSON type and a clipped repr."""
    kinds = {bool: "boolean", int: "number", float: "number", str: "text", list: "list", dict: "object"}
    kind = "null" if value is None else kinds.get(type(value), type(value).__name__)
    text = repr(value)
    return f"{kind} {text[:40] + '...' if len(text) > 40 else text}"


__all__ = ["BoardError", "ConfigError", "DataError", "RewardFunctionError", "RowError", "TrainingDiverged",
           "describe_value"]
