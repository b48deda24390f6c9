"""Helpers shared by test files (imported as `tests.helpers`; fixtures live in the conftest files).

`tiny_config` is the one way a test builds a parsed config: the keys a test names, over defaults that change no
number (`use_cpu`, `disable_tqdm`), with the model folder and output folder as plain arguments. A stage's test file
keeps only the keys its runs share (its own small wrapper) and passes them here.
"""

from __future__ import annotations

from typing import Any, Optional

from alignkit.config import Config
from alignkit.config.parse import parse_config

# Keys every tiny test run may take without changing what it computes.
QUIET_DEFAULTS: dict[str, Any] = {"use_cpu": True, "disable_tqdm": True}


def tiny_config(model_dir: Optional[Any] = None, out: Optional[Any] = None, **keys: Any) -> Config:
    """`parse_config` of `keys` over `QUIET_DEFAULTS`, with `model_name_or_path=model_dir` and `output_dir=out` where
    given (paths as strings)."""
    values: dict[str, Any] = dict(QUIET_DEFAULTS)
    if model_dir is not None:
        values["model_name_or_path"] = str(model_dir)
    if out is not None:
        values["output_dir"] = str(out)
    values.update(keys)
    return parse_config(values)
