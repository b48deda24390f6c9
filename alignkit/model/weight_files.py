"""Is a local model (or adapter) folder whole? Cheap checks of its weight files, run before anything is tokenised.

A copy or download that stopped half way leaves a folder with `config.json` and the tokenizer but no
weights, or a weights file cut short. `from_pretrained` notices only when it loads the weights, which
the stages do after tokenising the data; these checks read only file headers (the safetensors header,
the end of a zip archive), so they cost milliseconds even for large models.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Optional

from ..errors import ConfigError

# What `from_pretrained` looks for, in its order of preference: safetensors before pickles.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
# What peft's `load_peft_weights` looks for in an adapter folder, in the same order.
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def safetensors_problem(path: Path) -> Optional[str]:
    """What is wrong with a `.safetensors` file (missing, truncated, bad header), or None when it is whole.

    `safe_open` parses the header and checks that the tensors' byte ranges cover the file exactly, which
    is what a truncated file fails; it maps the file without reading the tensors.
    """
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        return "is missing"
    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError) as err:
        return f"is damaged or incomplete ({err})"
    return None


def torch_pickle_problem(path: Path) -> Optional[str]:
    """What is wrong with a `torch.save` file (missing, empty, a zip archive cut short), or None."""
    if not path.is_file():
        return "is missing"
    with path.open("rb") as f:
        magic = f.read(4)
    if not magic:
        return "is empty"
    # torch >= 1.6 writes a zip archive, whose directory sits at the end of the file: a cut-off copy
    # starts like a zip but has no directory. Older files are plain pickles and are left to torch.
    if magic == b"PK\x03\x04" and not zipfile.is_zipfile(path):
        return "is incomplete (its zip directory is missing: the file was cut short)"
    return None


def _shard_problems(index_path: Path, check) -> list[str]:
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return [f"{index_path.name} is not a valid shard index ({type(err).__name__}: {err})"]
    problems = []
    for shard in shards:
        problem = check(index_path.parent / shard)
        if problem:
            problems.append(f"{shard} (listed in {index_path.name}) {problem}")
    return problems


def _weights_problems(folder: Path, names: tuple[str, ...]) -> list[str] | None:
    """What is wrong with the first of `names` in `folder` (the file a loader reads; for a shard index, its
    shards): [] when it is whole, None when `folder` holds none of them."""
    present = [name for name in names if (folder / name).is_file()]
    if not present:
        return None
    name = present[0]
    check = safetensors_problem if ".safetensors" in name else torch_pickle_problem
    if name.endswith(".index.json"):
        return _shard_problems(folder / name, check)
    return [f"{name} {p}" for p in [check(folder / name)] if p]


def check_model_files(model_dir: str | Path) -> None:
    """Raise a ConfigError when the local model folder `model_dir` lacks whole weights.

    A folder with `adapter_config.json` and no `config.json` is a PEFT adapter, which transformers loads
    over its base model; it is left to that loader.

    Raises:
        ConfigError: no `config.json`, no weights file, or a weights file (or shard) that is missing,
            truncated or unreadable; the message names the file and how to fix it.
    """
    folder = Path(model_dir)
    if not (folder / "config.json").is_file():
        if (folder / "adapter_config.json").is_file():
            return
        raise ConfigError(f"model_name_or_path={str(model_dir)!r} holds no config.json, so it is not a model "
                          "folder. Give the folder that `save_pretrained` wrote (config.json + weights).")
    problems = _weights_problems(folder, WEIGHT_FILES)
    if problems is None:
        raise ConfigError(
            f"model_name_or_path={str(model_dir)!r} has a config.json but no weights (none of "
            f"{', '.join(WEIGHT_FILES)}). The copy or download is incomplete: copy the weights files into it "
            "(or download the model again)."
        )
    if problems:
        raise ConfigError(
            f"model_name_or_path={str(model_dir)!r}: {'; '.join(problems)}. The copy or download of the "
            "weights did not finish: copy them again (or download the model again)."
        )


def check_adapter_files(adapter_dir: str | Path) -> None:
    """Raise a ConfigError when the PEFT adapter folder `adapter_dir` lacks whole weights.

    Its `adapter_config.json` is read, and checked, by `loader.read_adapter_config`. Without this check a
    save cut short reaches peft, which reports a truncated file as a raw `SafetensorError` and a missing one
    as a weights mismatch with the base.

    Raises:
        ConfigError: no adapter weights file, or one that is truncated or unreadable; the message names the
            folder, the file and how to fix it.
    """
    problems = _weights_problems(Path(adapter_dir), ADAPTER_WEIGHT_FILES)
    if problems is None:
        raise ConfigError(
            f"adapter_name_or_path: {adapter_dir} has an adapter_config.json but no weights (neither of "
            f"{', '.join(ADAPTER_WEIGHT_FILES)}). The save or the copy did not finish: copy the adapter again, "
            "or give one of its run's checkpoint-N folders."
        )
    if problems:
        raise ConfigError(f"adapter_name_or_path: {adapter_dir}: {'; '.join(problems)}. The save or the copy did "
                          "not finish: copy the adapter again, or give one of its run's checkpoint-N folders.")


__all__ = ["ADAPTER_WEIGHT_FILES", "WEIGHT_FILES", "check_adapter_files", "check_model_files", "safetensors_problem",
           "torch_pickle_problem"]
