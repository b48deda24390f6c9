"""Data: load, validate, convert, template, tokenise (cached), collate. See docs/ARCHITECTURE.md.

The names below are imported on first use (PEP 562 `__getattr__`): the collators import torch, and importing
this package (as `alignkit.data.loader` does on the way) must not load it, so that `alignkit train` can resolve a
config's datasets before torch is imported.
"""

from __future__ import annotations

from typing import Any

_COLLATORS = ("PairwiseCollator", "SupervisedCollator", "UnpairedCollator")


def __getattr__(name: str) -> Any:
    if name == "IGNORE_INDEX":
        from .. import constants as module
    elif name in _COLLATORS:
        from . import collator as module
    elif name == "get_dataset":
        from . import loader as module
    elif name == "ChatFormatter":
        from . import template as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


__all__ = ["get_dataset", "SupervisedCollator", "PairwiseCollator", "UnpairedCollator",
           "ChatFormatter", "IGNORE_INDEX"]
