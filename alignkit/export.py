"""`alignkit export`: merge adapters into their base and write a standalone model directory (and, with
`--format gguf`, the same model as one GGUF file beside it: `alignkit.gguf_export`).

The result is what plain transformers loads with `AutoModelForCausalLM.from_pretrained(dir)` (or
`AutoModelForSequenceClassification` for a reward model): safetensors weights, the tokenizer with its
chat template, and a generation config whose eos/pad are the tokenizer's.

An export never costs a file it did not mean to replace. The model is built whole in a hidden folder beside the target
(`.NAME.export-*`, on the same file system) and only then moved in by renames, so a failure on the way (a damaged
adapter, a full disk) leaves the target as it was and removes the hidden folder. The target may not be a folder the
export reads (the base's, or an adapter's of the chain, as real paths): replacing the model files there would destroy
the source, so that is refused before anything loads, `--force` or not. A target inside or around such a folder is
allowed: only the target's own model files are replaced, never a subfolder, and nothing is written into a source.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from .config import BUNDLED_MODEL_NAME, FinetuningArguments, ModelArguments
from .errors import ConfigError
from .model.bundled import bundled_model_dir
from .model.loader import (is_reward_adapter, load_model, load_tokenizer, read_base_quantization, resolve_adapter_chain,
                           split_adapters)
from .train import check_output_dir

logger = logging.getLogger(__name__)

# The files of a model folder that `from_pretrained` reads, which a forced export replaces: those it writes, and those
# a previous export or a training run may have left that would be mixed with them (an `adapter_config.json` makes
# transformers load the folder as a PEFT adapter; an old shard index or shard is read instead of the new weights; a
# reward export has no generation config; a tokenizer without a chat template writes no `chat_template.jinja`).
_MODEL_FILE_PATTERNS = (
    "config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
    "pytorch_model*.bin", "pytorch_model.bin.index.json", "adapter_config.json", "adapter_model.*",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "*.gguf", "Modelfile",
)


def export_model(model_args: ModelArguments, export_dir: str, *, force: bool = False, head: str | None = None,
                 gguf_type: str | None = None, ollama: bool = False) -> Path:
    """Load the base and the adapters of `model_args.adapter_name_or_path`, merge them, and save.

    Args:
        model_args: the base (`model_name_or_path`) and the adapters to merge (`adapter_name_or_path`).
        export_dir: the directory to write.
        force: write into `export_dir` even if it is not empty: its model files (`_MODEL_FILE_PATTERNS`, an
            earlier export's or a training run's) are replaced; other files and subfolders stay.
        head: `causal_lm` or `reward`; by default `reward` when the (last) adapter belongs to a reward
            model, else `causal_lm`.
        gguf_type: also write the merged model as one GGUF file, `<export_dir name>-<gguf_type>.gguf`, of tensor
            type `f32`, `f16` or `q8_0` (`alignkit.gguf_export`; causal LMs of its `SUPPORTED` architectures).
        ollama: with `gguf_type`, also write an Ollama `Modelfile` for that file (its chat template as an Ollama
            template and its stop tokens: `gguf_export.ollama_modelfile`).

    Returns:
        The export directory.

    Raises:
        ConfigError: `export_dir` is a file, unwritable, the base's or an adapter's folder, or not empty and
            `force` is false; an adapter folder is damaged or does not fit the base; writing the export failed
            (nothing in `export_dir` is changed then).
    """
    out = Path(export_dir).expanduser()
    adapters = resolve_adapter_chain(split_adapters(model_args.adapter_name_or_path))  # each folder checked whole
    _refuse_a_source(out, model_args, adapters)
    existing = check_output_dir(out, key="export_dir")  # a file in the way, or a folder that cannot be written
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(
            f"export_dir {out} is not empty; choose an empty or new directory, or pass --force to "
            "replace the model files there."
        )
    if head is None:
        head = "reward" if adapters and is_reward_adapter(adapters[-1]) else "causal_lm"
    if ollama and gguf_type is None:
        raise ConfigError("--ollama writes a Modelfile for the GGUF file; add --format gguf.")
    gguf_name = f"{Path(os.path.realpath(out)).name}-{gguf_type}.gguf"
    modelfile = None
    if gguf_type is not None:
        _check_gguf(model_args, head, gguf_type)
        if ollama:  # the template is checked before the model loads
            from .data.template import ChatFormatter
            from .gguf_export import ollama_modelfile

            modelfile = ollama_modelfile(ChatFormatter(load_tokenizer(model_args)), gguf_name)
    for adapter in adapters:
        quantized = read_base_quantization(adapter)
        if quantized:
            # LLaMA-Factory's answer too: the export is a full-precision model, not the quantized one trained on.
            logger.warning("%s was trained on a %s-bit quantized base (%s); it is merged into the full-precision base "
                           "%s, so the exported model is full precision and differs from the trained one by the "
                           "base's quantization error.", adapter, quantized["quantization_bit"],
                           ", ".join(f"{k}={v}" for k, v in quantized.items()),
                           model_args.model_name_or_path or "(the bundled model)")

    # Beside the target, on its file system (a symlinked target counts where it points): moving in is renames.
    target = Path(os.path.realpath(out))
    beside = target.parent if target.is_dir() else existing
    built = Path(tempfile.mkdtemp(prefix=f".{target.name}.export-", dir=beside))
    try:
        tokenizer = load_tokenizer(model_args)
        model = load_model(model_args, FinetuningArguments(), is_trainable=False, head=head)
        model.config.use_cache = True  # the exported model is for inference
        if head == "reward":
            model.config.pad_token_id = tokenizer.pad_token_id
        else:
            model.generation_config.eos_token_id = tokenizer.eos_token_id
            model.generation_config.pad_token_id = tokenizer.pad_token_id
        try:
            model.save_pretrained(built)
            tokenizer.save_pretrained(built)
            if gguf_type is not None:
                from .gguf_export import write_gguf

                write_gguf(model, built, built / gguf_name, gguf_type)
            if modelfile is not None:
                (built / "Modelfile").write_text(modelfile, encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"export_dir {out}: writing the export beside it failed ({err}); {out} is as it was. "
                              "Free space for one copy of the model there, or choose another --export-dir.") from None
        _move_in(built, target, shown=out)
    finally:
        shutil.rmtree(built, ignore_errors=True)
    logger.info("Exported %s%s to %s (%s).", model_args.model_name_or_path or "the bundled model",
                f" + {model_args.adapter_name_or_path}" if model_args.adapter_name_or_path else "", out, head)
    return out


def _check_gguf(model_args: ModelArguments, head: str, gguf_type: str) -> None:
    """Refuse a GGUF export that cannot be written, before the model loads: a reward model, an architecture or a
    type `gguf_export` does not write."""
    from transformers import AutoConfig

    from .gguf_export import GGUF_TYPES, check_supported
    from .model.loader import resolve_model_path

    if gguf_type not in GGUF_TYPES:
        raise ConfigError(f"--gguf-type {gguf_type}: choose one of {', '.join(GGUF_TYPES)}.")
    if head == "reward":
        raise ConfigError("--format gguf writes causal language models; this is a reward model (export it without "
                          "--format gguf).")
    check_supported(AutoConfig.from_pretrained(resolve_model_path(model_args)).model_type)


def _refuse_a_source(out: Path, model_args: ModelArguments, adapters: list[str]) -> None:
    """Raise a ConfigError when `out` is the base model's folder or an adapter folder of the chain (real paths)."""
    name = model_args.model_name_or_path
    base = bundled_model_dir() if not name or name == BUNDLED_MODEL_NAME else Path(name).expanduser()
    target = os.path.realpath(out)
    for key, source in [("model_name_or_path", base)] + [("adapter_name_or_path", Path(a)) for a in adapters]:
        if source.is_dir() and os.path.realpath(source) == target:
            what = "the base model's folder" if key == "model_name_or_path" else "the folder of an adapter it merges"
            raise ConfigError(
                f"export_dir {out} is {what} ({key}: {source}); the export would replace the files it reads "
                f"(--force does not change that). Give --export-dir a folder of its own, e.g. {out}-merged."
            )


def _move_in(built: Path, out: Path, shown: Path) -> None:
    """Replace the model files in `out` (a real path) by the export built in `built`, by renames only.

    The model files already in `out` are first set aside (in a hidden folder beside it), the new ones moved in,
    then the old ones deleted. If a rename fails, what was moved is put back and a ConfigError (naming `out` as
    the user gave it, `shown`) says why.
    """
    created = [folder for folder in [out, *out.parents] if not folder.exists()]
    out.mkdir(parents=True, exist_ok=True)
    new = sorted(built.iterdir())
    old = sorted({path for pattern in _MODEL_FILE_PATTERNS for path in out.glob(pattern) if not path.is_dir()}
                 | {out / path.name for path in new if (out / path.name).is_file()})
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced-", dir=out.parent))
    set_aside, moved_in = [], []
    try:
        for path in old:
            os.replace(path, aside / path.name)
            set_aside.append(path)
        for path in new:
            os.replace(path, out / path.name)
            moved_in.append(path)
    except OSError as err:
        for path in moved_in:
            os.replace(out / path.name, path)
        for path in set_aside:
            os.replace(aside / path.name, path)
        for folder in [aside, *created]:
            folder.rmdir()
        raise ConfigError(f"export_dir {shown}: moving the export in failed ({err}); {shown} is as it was.") from None
    shutil.rmtree(aside, ignore_errors=True)


__all__ = ["export_model"]
