"""Data: load, validate, convert, template, tokenise (cached), collate. See docs/ARCHITECTURE.md."""

from ..constants import IGNORE_INDEX
from .collator import PairwiseCollator, SupervisedCollator, UnpairedCollator
from .loader import get_dataset
from .template import ChatFormatter

__all__ = ["get_dataset", "SupervisedCollator", "PairwiseCollator", "UnpairedCollator",
           "ChatFormatter", "IGNORE_INDEX"]
