"""`alignkit export`: merge adapters into their base and write a standalone model directory.

The result is what plain transformers loads with `AutoModelForCausalLM.from_pretrained(dir)` (or
`AutoModelForSequenceClassification` for a reward model): safetensors weights, the tokenizer with its
chat template, and a generation config whose eos/pad are the tokenizer's.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .hparams import ConfigError, FinetuningArguments, ModelArguments
from .model.loader import is_reward_adapter, load_model, load_tokenizer, split_adapters

logger = logging.getLogger(__name__)

# Files a previous export (or a training run) may have left that would change what `from_pretrained`
# reads: an `adapter_config.json` makes transformers load the directory as a PEFT adapter, and an old
# shard index or shard would be mixed with the new weights.
_STALE_PATTERNS = ("adapter_config.json", "adapter_model.*", "model*.safetensors", "model.safetensors.index.json",
                   "pytorch_model*.bin", "pytorch_model.bin.index.json")


def export_model(model_args: ModelArguments, export_dir: str, *, force: bool = False, head: str | None = None) -> Path:
    """Load the base and the adapters of `model_args.adapter_name_or_path`, merge them, and save.

    Args:
        model_args: the base (`model_name_or_path`) and the adapters to merge (`adapter_name_or_path`).
        export_dir: the directory to write.
        force: write into `export_dir` even if it is not empty (replacing earlier model files there).
        head: `causal_lm` or `reward`; by default `reward` when the (last) adapter belongs to a reward
            model, else `causal_lm`.

    Returns:
        The export directory.

    Raises:
        ConfigError: `export_dir` is not empty and `force` is false, or an adapter does not fit the base.
    """
    out = Path(export_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"export_dir {out} is a file; give a directory.")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ConfigError(
                f"export_dir {out} is not empty; choose an empty or new directory, or pass --force to "
                "write over the model files there."
            )
        for pattern in _STALE_PATTERNS:
            for stale in out.glob(pattern):
                stale.unlink()
    if head is None:
        adapters = split_adapters(model_args.adapter_name_or_path)
        head = "reward" if adapters and is_reward_adapter(adapters[-1]) else "causal_lm"

    tokenizer = load_tokenizer(model_args)
    model = load_model(model_args, FinetuningArguments(), is_trainable=False, head=head)
    model.config.use_cache = True  # the exported model is for inference
    if head == "reward":
        model.config.pad_token_id = tokenizer.pad_token_id
    else:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    logger.info("Exported %s%s to %s (%s).", model_args.model_name_or_path or "the bundled model",
                f" + {model_args.adapter_name_or_path}" if model_args.adapter_name_or_path else "", out, head)
    return out


__all__ = ["export_model"]
