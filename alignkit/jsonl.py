"""JSON Lines files: the one writer and appender behind every `.jsonl` file alignkit writes.

`trainer_log.jsonl`, `completions.jsonl`, `generated_predictions.jsonl` and `alignkit eval --output` all go
through here, so each is strict JSON (a non-finite float is written as null, never as `NaN` or `Infinity`,
which jq, JavaScript and most languages refuse) and none is left half written:
- `write_jsonl` writes a whole file to a temporary sibling and renames it over the target, so a reader (or a
  kill) sees the old file or the new one, never a mix;
- `append_jsonl` adds its records in one `write` on a file opened for appending, so a kill leaves at most one
  line cut short at the end, which `keep_jsonl_rows` (and the readers) drop;
- `keep_jsonl_rows` rewrites a file with the records a test keeps (a resumed run cutting the steps it will run
  again), atomically as `write_jsonl` does.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable


def strict_json(value: Any) -> Any:
    """`value` with every non-finite float, at any depth of dicts, lists and tuples, replaced by None.

    Example: `{"reward": inf, "rewards": {"a": nan, "b": 1.0}}` -> `{"reward": None, "rewards": {"a": None,
    "b": 1.0}}`.
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def json_line(record: Any) -> str:
    """One record as a JSON line (UTF-8 text kept as is, non-finite floats as null, a trailing newline)."""
    return json.dumps(strict_json(record), ensure_ascii=False, allow_nan=False) + "\n"


def write_jsonl(path: str | os.PathLike, records: Iterable[Any]) -> Path:
    """Write `records` as the whole of `path`, atomically (temporary sibling, then rename); returns the path.

    The parent folder is created when missing.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.partial{os.getpid()}")
    try:
        with open(partial, "w", encoding="utf-8") as f:
            f.writelines(json_line(record) for record in records)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def append_jsonl(path: str | os.PathLike, records: Iterable[Any]) -> None:
    """Append `records` to `path` (created with its folder when missing) in one write."""
    text = "".join(json_line(record) for record in records)
    if not text:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


def keep_jsonl_rows(path: str | os.PathLike, keep: Callable[[Any], bool]) -> None:
    """Rewrite `path` with the records for which `keep(record)` holds, in their order, atomically.

    Lines that do not parse (a line cut short by a kill) are dropped. A missing file stays missing; the lines
    kept are rewritten byte for byte.
    """
    path = Path(path)
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if keep(record):
            kept.append(line + "\n")
    partial = path.with_name(f"{path.name}.partial{os.getpid()}")
    try:
        partial.write_text("".join(kept), encoding="utf-8")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


__all__ = ["strict_json", "json_line", "write_jsonl", "append_jsonl", "keep_jsonl_rows"]
