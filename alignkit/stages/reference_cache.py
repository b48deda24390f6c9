"""Reference log-probs computed once for a whole dataset and cached on disk (`precompute_ref_log_probs`).

DPO and KTO score every row against a frozen reference. With `precompute_ref_log_probs` the stage runs the
reference over each dataset once, when the trainer is built (before any update, so a full fine-tuning policy
can still serve as its own reference), adds the results as float columns and reads them from each batch
instead of running the reference again. The file is keyed by the token columns and every weight of the
reference, so a changed dataset, cutoff, template or base model gets its own, and a second or resumed run
reads it. Each stage names its columns and how to score a batch; the rest is here.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
from torch import nn

if TYPE_CHECKING:
    from datasets import Dataset

    from .base import StageTrainer

logger = logging.getLogger(__name__)


def _hash_arrow_columns(digest: "hashlib._Hash", dataset: "Dataset", columns: Sequence[str]) -> None:
    """Feed the bytes of `columns` (and the row selection, if any) into `digest`, without copying them."""
    for name in columns:
        digest.update(name.encode())
        for chunk in dataset.data.column(name).chunks:
            # The offset and length tell apart two slices that share buffers (e.g. after `select`).
            digest.update(f"{chunk.offset}:{len(chunk)}".encode())
            for buffer in chunk.buffers():
                if buffer is not None:
                    digest.update(memoryview(buffer))
    indices = getattr(dataset, "_indices", None)
    if indices is not None:
        for chunk in indices.column(0).chunks:
            digest.update(f"idx{chunk.offset}:{len(chunk)}".encode())
            for buffer in chunk.buffers():
                if buffer is not None:
                    digest.update(memoryview(buffer))


def _hash_parameters(digest: "hashlib._Hash", named_parameters: Iterator[tuple[str, nn.Parameter]]) -> None:
    for name, param in named_parameters:
        tensor = param.detach().contiguous().cpu()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(memoryview(tensor.view(-1).view(torch.uint8).numpy()))


def reference_cache_path(dataset: "Dataset", reference_parameters: Iterator[tuple[str, nn.Parameter]],
                         token_columns: Sequence[str], mixed_precision: str = "no") -> Path:
    """Where the reference log-probs of `dataset` under these weights are cached.

    The key covers `token_columns` (those the dataset has: token ids and labels of every scored sequence), every
    weight of the reference and the run's mixed precision (accelerate's `mixed_precision`: log-probs computed
    under bf16 autocast are not fp32's; `no` leaves the key as it was before precision counted). The file sits beside the dataset's own cache files when it has them, else
    under the tokenised-data cache (`alignkit.data.loader.cache_root`).
    """
    digest = hashlib.sha256(b"alignkit-ref-logps-v1")
    _hash_arrow_columns(digest, dataset, [c for c in token_columns if c in dataset.column_names])
    _hash_parameters(digest, reference_parameters)
    if mixed_precision != "no":
        digest.update(f"mixed_precision:{mixed_precision}".encode())
    cache_files = getattr(dataset, "cache_files", None)
    if cache_files:
        folder = Path(cache_files[0]["filename"]).parent
    else:
        from ..data.loader import cache_root

        folder = cache_root()
    return folder / "ref_logps" / f"{digest.hexdigest()[:32]}.pt"


class CollateWithReference:
    """Runs the stage's collator on the token columns and adds the precomputed reference columns as [B] floats."""

    def __init__(self, collator: Callable[[list[dict[str, Any]]], dict[str, Any]], columns: Sequence[str]) -> None:
        self.collator = collator
        self.columns = tuple(columns)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.collator([{k: v for k, v in f.items() if k not in self.columns} for f in features])
        if features and self.columns[0] in features[0]:
            for name in self.columns:
                batch[name] = torch.tensor([f[name] for f in features], dtype=torch.float32)
        return batch


def precompute_reference_logps(trainer: "StageTrainer", columns: Sequence[str], token_columns: Sequence[str],
                               batch_logps: Callable[[dict[str, Any]], Sequence[torch.Tensor]],
                               unit: str = "rows") -> None:
    """Give the trainer's train and eval datasets their reference `columns` (`with_reference_logps`).

    Call it when the trainer is built, before any update; the passes run under the run's autocast (bf16 where the
    run trains in it). Under several processes the main one of each node
    computes and writes the cache, the others then read it; the weights are gathered once for the whole pass
    under ZeRO-3/FSDP2. The gather comes first: it is a collective every process must enter together, so inside
    `main_process_first` (where the others wait at a barrier) it would hang (seen under DeepSpeed ZeRO-3 on 2
    processes).
    """
    from ..model.distributed import full_weights

    # Under the run's mixed precision, as the reference passes it replaces would run: accelerate wraps the model's
    # forward in its autocast only when training or evaluation prepares it, which has not happened yet here.
    with full_weights(trainer.ref_model or trainer.model), trainer.accelerator.autocast(), \
            trainer.args.main_process_first(local=True, desc="reference log-probs"):
        def with_logps(dataset: "Dataset", name: str) -> "Dataset":
            return with_reference_logps(trainer, dataset, name, columns, token_columns, batch_logps, unit)

        if trainer.train_dataset is not None:
            trainer.train_dataset = with_logps(trainer.train_dataset, "train")
        if isinstance(trainer.eval_dataset, dict):
            trainer.eval_dataset = {k: with_logps(v, f"eval {k}") for k, v in trainer.eval_dataset.items()}
        elif trainer.eval_dataset is not None:
            trainer.eval_dataset = with_logps(trainer.eval_dataset, "eval")


def with_reference_logps(trainer: "StageTrainer", dataset: "Dataset", name: str, columns: Sequence[str],
                         token_columns: Sequence[str], batch_logps: Callable[[dict[str, Any]], Sequence[torch.Tensor]],
                         unit: str = "rows") -> "Dataset":
    """`dataset` plus the float `columns` that `batch_logps(batch)` gives ([B] each, in that order), from the
    cache when it has them.

    Batches of `per_device_eval_batch_size` rows go through the stage's collator (unwrapped from
    `CollateWithReference`) and `trainer._prepare_inputs`. The file is written atomically: a killed run never
    leaves a half-written cache.
    """
    if all(c in dataset.column_names for c in columns):
        return dataset
    path = reference_cache_path(dataset, trainer.reference_parameters(), token_columns,
                                str(trainer.accelerator.mixed_precision))
    table = torch.load(path, weights_only=True) if path.is_file() else {}  # a dict of tensors: nothing to unpickle
    if all(c in table for c in columns):
        logger.info("Reading reference log-probs of the %s dataset from %s", name, path)
    else:
        logger.info("Computing reference log-probs of the %s dataset (%d %s) once", name, len(dataset), unit)
        collator = trainer.data_collator
        if isinstance(collator, CollateWithReference):
            collator = collator.collator
        batch_size = trainer.args.per_device_eval_batch_size
        parts: list[list[torch.Tensor]] = [[] for _ in columns]
        for start in range(0, len(dataset), batch_size):
            rows = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
            for part, logps in zip(parts, batch_logps(trainer._prepare_inputs(collator(rows)))):
                part.append(logps.float().cpu())
        table = {column: torch.cat(part) for column, part in zip(columns, parts)}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(table, tmp)
        os.replace(tmp, path)
    for column in columns:
        dataset = dataset.add_column(column, table[column].tolist())
    return dataset
