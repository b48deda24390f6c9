"""Values shared by the data, model and stage layers, defined once."""

# Label of a position that carries no loss (prompt, padding, a packed example's first token); the value
# PyTorch's cross-entropy ignores by default and every Hugging Face collator writes.
IGNORE_INDEX = -100

__all__ = ["IGNORE_INDEX"]
