"""Packing: several tokenised examples per row, each attending only to itself.

Short chat examples padded to the longest of a batch waste most of a CPU step on padding. Packing
concatenates examples into rows of at most `cutoff_len` tokens (best-fit decreasing, so rows fill up)
and gives each example its own `position_ids` starting at 0. transformers 5 reads a reset of
`position_ids` as the start of a new sequence and builds a block-diagonal causal mask from it, in the
eager and sdpa attention kernels alike, as long as the forward gets no 2D `attention_mask` and no KV
cache: the SFT trainer drops the mask and passes `use_cache=False` when a batch has `position_ids`.

Two details make the packed loss equal to the unpacked one:
- the first label of every example is set to -100: unpacked, position 0 is never a target (the causal
  shift drops it), but packed, it would be predicted from the previous example's last token;
- padding rows are given positions restarting at 0, so the padding forms its own block that no real
  token attends to, and its labels are -100.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..constants import IGNORE_INDEX


def pack_lengths(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group example indices into bins of total length <= capacity (best-fit decreasing).

    Used for SFT packing (dataset rows) and for the padding-free forward's rows (`alignkit.model.padding_free`).

    Args:
        lengths: token count of each example.
        capacity: tokens per packed row; an example longer than this gets a row of its own.

    Returns:
        A list of bins, each a list of example indices in the order they are placed.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    # (remaining space, bin index) sorted ascending, so bisect finds the tightest bin that still fits.
    spaces: list[tuple[int, int]] = []
    for index in order:
        length = lengths[index]
        position = bisect.bisect_left(spaces, (length, -1))
        if position < len(spaces):
            space, bin_index = spaces.pop(position)
            bins[bin_index].append(index)
            bisect.insort(spaces, (space - length, bin_index))
        else:
            bins.append([index])
            if capacity - length > 0:
                bisect.insort(spaces, (capacity - length, len(bins) - 1))
    return bins


def pack_dataset(dataset, cutoff_len: int):
    """Pack a tokenised SFT dataset (`input_ids`, `labels`) into rows of at most `cutoff_len` tokens.

    Args:
        dataset: a `datasets.Dataset` with `input_ids` and `labels` columns (other columns are dropped).
        cutoff_len: the most tokens per packed row.

    Returns:
        A `datasets.Dataset` with `input_ids`, `labels`, `position_ids` and `attention_mask` (all ones).
    """
    from datasets import Dataset

    input_ids, labels = list(dataset["input_ids"]), list(dataset["labels"])
    packed: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": [], "attention_mask": []}
    for bin_indices in pack_lengths([len(ids) for ids in input_ids], cutoff_len):
        row_ids: list[int] = []
        row_labels: list[int] = []
        row_positions: list[int] = []
        for index in bin_indices:
            ids = list(input_ids[index])
            row_ids.extend(ids)
            row_labels.extend([IGNORE_INDEX] + list(labels[index][1:]))
            row_positions.extend(range(len(ids)))
        packed["input_ids"].append(row_ids)
        packed["labels"].append(row_labels)
        packed["position_ids"].append(row_positions)
        packed["attention_mask"].append([1] * len(row_ids))
    return Dataset.from_dict(packed)


def unpack_rows(input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed rows (`PackedCollator`'s batch) back into one right-padded row per example.

    An example starts at each real token whose position is 0 and runs to the next such token or the row's last
    real token; a token's position is its column. The training step of `packing: true` runs these rows
    through the padding-free forward (each example attending to itself alone, a prefix shared between examples
    run once), so the examples a packed batch holds cost what the same examples cost unpacked. Labels come along
    as they are: each packed example's first label is already -100, so the targets and their count are the
    packed batch's.

    Args:
        input_ids, position_ids, attention_mask, labels: `(rows, width)` as `PackedCollator` returns them;
            padding has attention 0.

    Returns:
        `(input_ids, attention_mask, labels)`, `(examples, longest example)`, in packing order, padded with
        the rows' padding id, attention 0 and label -100.

    Raises:
        ValueError: a row's real tokens do not start at position 0, or positions do not count up by one inside
            an example (rows that did not come from `pack_dataset`).
    """
    real = attention_mask.bool()
    positions = position_ids[real]
    starts = positions == 0
    per_row = real.sum(1)
    first_of_row = (torch.cumsum(per_row, 0) - per_row)[per_row > 0]
    if not bool(starts[first_of_row].all()):
        raise ValueError("packed rows: a row's first real token must have position 0 (rows from pack_dataset).")
    if not bool(((positions[1:] == positions[:-1] + 1) | starts[1:]).all()):
        raise ValueError("packed rows: position_ids must count 0, 1, 2, ... inside each example.")
    example = torch.cumsum(starts.long(), 0) - 1
    count = int(starts.sum())
    width = int(positions.max()) + 1 if positions.numel() else 0
    padding = input_ids[~real]
    ids = input_ids.new_full((count, width), int(padding[0]) if padding.numel() else 0)
    mask = attention_mask.new_zeros((count, width))
    targets = labels.new_full((count, width), IGNORE_INDEX)
    ids[example, positions] = input_ids[real]
    mask[example, positions] = 1
    targets[example, positions] = labels[real]
    return ids, mask, targets


@dataclass
class PackedCollator:
    """Right-pads packed rows to the longest row of the batch.

    Padding gets the pad id, label -100, attention 0 (the Trainer counts real tokens from the mask) and
    positions 0, 1, ... so that it forms a block of its own in the position-derived mask.
    """

    pad_token_id: int

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(f["input_ids"]) for f in features)
        batch: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": [], "attention_mask": []}
        for f in features:
            gap = width - len(f["input_ids"])
            batch["input_ids"].append(list(f["input_ids"]) + [self.pad_token_id] * gap)
            batch["labels"].append(list(f["labels"]) + [IGNORE_INDEX] * gap)
            batch["position_ids"].append(list(f["position_ids"]) + list(range(gap)))
            batch["attention_mask"].append([1] * len(f["input_ids"]) + [0] * gap)
        return {key: torch.tensor(value, dtype=torch.long) for key, value in batch.items()}
