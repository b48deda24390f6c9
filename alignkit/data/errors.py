"""The one exception the data layer raises for input the user must fix.

Validation happens where the data enters: every message names the file, the row (or the
1-based line of a .jsonl file), the field, what was expected, and the fix, so a bad row stops the run
before any model is loaded instead of surfacing as a pyarrow or tokenizer error deep inside training.
"""

from __future__ import annotations

from typing import Optional


class DataError(ValueError):
    """A dataset problem the user must fix; the message says where (file, row, field) and how."""


class RowError(ValueError):
    """A problem inside one row, raised by the format converters before the file and row are known.

    The loader catches it, adds the file and row number, and either raises a `DataError` or (with
    `skip_invalid_rows`) records the row as skipped.

    Args:
        field: the column (or `column[index].key` path) that is wrong.
        problem: what is wrong and what was expected.
    """

    def __init__(self, field: Optional[str], problem: str) -> None:
        super().__init__(f"field `{field}`: {problem}" if field else problem)
        self.field = field
        self.problem = problem


def describe_value(value: object) -> str:
    """A short description of a wrong value for messages: its JSON type and a clipped repr."""
    kinds = {bool: "boolean", int: "number", float: "number", str: "text", list: "list", dict: "object"}
    kind = "null" if value is None else kinds.get(type(value), type(value).__name__)
    text = repr(value)
    return f"{kind} {text[:40] + '...' if len(text) > 40 else text}"
