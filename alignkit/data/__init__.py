"""Data: load, validate, convert, template, tokenise (cached), collate. See docs/ARCHITECTURE.md."""

from .collator import PairwiseCollator, PromptCollator, SupervisedCollator
from .errors import DataError
from .loader import get_dataset
from .processors import IGNORE_INDEX
from .template import ChatFormatter

__all__ = ["get_dataset", "DataError", "SupervisedCollator", "PairwiseCollator", "PromptCollator",
           "ChatFormatter", "IGNORE_INDEX"]
