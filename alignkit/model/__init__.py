"""Model loading (local directory, hub id or the bundled default; LoRA, full or freeze; LM or reward head),
heads (rewards, value head) and named adapters on one base (`heads`, `adapters`)."""

from .loader import load_model, load_reward_model, load_tokenizer, resolve_model_path

__all__ = ["load_model", "load_reward_model", "load_tokenizer", "resolve_model_path"]
