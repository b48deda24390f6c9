"""Model loading (local directory, hub id or the bundled default; LoRA, full or freeze; LM or reward head),
heads (hidden states, score head, value head) and named adapters on one base (`heads`, `adapters`).

Reward models (loading one with its head, scoring) live in `alignkit.rewards`."""

from .loader import load_model, load_tokenizer, resolve_model_path

__all__ = ["load_model", "load_tokenizer", "resolve_model_path"]
