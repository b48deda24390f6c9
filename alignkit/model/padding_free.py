"""Padding-free forward: run a padded batch as one row of its real tokens.

A padded batch `[N, L]` costs attention, MLP and activation memory for `N * L` positions, while with a
realistic spread of lengths only a half to a third of them are real tokens. Here the real tokens of every
row are laid end to end in one row `[1, T]`, with `position_ids` restarting at 0 for each sequence and no
2D attention mask. transformers 5 reads each reset of `position_ids` as the start of a new sequence and
builds a block-diagonal causal mask from it in the eager and sdpa kernels (the same mechanism SFT packing
relies on, see `alignkit.data.packing`), provided the forward gets no `attention_mask` and no KV cache
(`use_cache=False`). Each token then sees exactly the prefix it sees in the padded batch, at the same
relative positions (RoPE is relative, so left-padded rows, whose padded positions do not start at 0, get
the same attention scores), and nothing is computed for padding.

Real tokens are found from the attention mask, never from the pad id (pad == eos in SmolLM2), so left and
right padding both work. Within a row the real tokens must be contiguous, as every collator here makes them.

Next-token targets never cross a sequence boundary: `next_token_targets` gives each position the label of
the next position *of the same sequence* and -100 at each sequence's last token, so the first token of a
sequence is never predicted from the previous sequence's last one.

transformers' flash-attention kernels read the same resets (as `cu_seqlens`); a model whose attention
ignores them (remote code, or a custom kernel) would attend across the whole row: set `padding_free: false`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ..constants import IGNORE_INDEX


@dataclass
class FlatBatch:
    """A padded batch flattened to its real tokens.

    Attributes:
        input_ids: `[1, T]` the real tokens of row 0, then row 1, ... (T = number of real tokens).
        position_ids: `[1, T]` 0, 1, ... within each sequence.
        labels: `[1, T]` the labels of the same tokens, or None when none were given.
        sequence_index: `[T]` long, the padded row each token came from.
        lengths: `[N]` long, real tokens per row.
        real: `[N, L]` bool, where the real tokens sit in the padded layout (to scatter results back).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: Optional[torch.Tensor]
    sequence_index: torch.Tensor
    lengths: torch.Tensor
    real: torch.Tensor

    @property
    def num_sequences(self) -> int:
        return self.lengths.numel()


def flatten_padded(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: Optional[torch.Tensor] = None
) -> FlatBatch:
    """Lay the real tokens of a left- or right-padded batch end to end in one row.

    Args:
        input_ids: `[N, L]` token ids.
        attention_mask: `[N, L]`, 1 on real tokens, 0 on padding; each row's real tokens contiguous.
        labels: optional `[N, L]` labels aligned with `input_ids`.

    Returns:
        A `FlatBatch` whose `position_ids` restart at 0 for every sequence.
    """
    real = attention_mask.bool()
    lengths = real.sum(-1)
    # Boolean indexing walks rows in order and each row left to right, so sequences stay contiguous.
    flat_ids = input_ids[real]
    sequence_index = torch.repeat_interleave(torch.arange(lengths.numel(), device=input_ids.device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    position_ids = torch.arange(flat_ids.numel(), device=input_ids.device) - starts[sequence_index]
    return FlatBatch(
        input_ids=flat_ids.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        labels=None if labels is None else labels[real].unsqueeze(0),
        sequence_index=sequence_index,
        lengths=lengths,
        real=real,
    )


def next_token_targets(labels: torch.Tensor, sequence_index: torch.Tensor) -> torch.Tensor:
    """The label each flat position predicts: the next token's label within the same sequence.

    Args:
        labels: `[T]` labels of the flat row, -100 where no loss is taken.
        sequence_index: `[T]` the sequence of each position.

    Returns:
        `[T]`: `labels[t + 1]` where position t + 1 belongs to the same sequence as t, else -100.
    """
    targets = F.pad(labels[1:], (0, 1), value=IGNORE_INDEX)
    crosses = F.pad(sequence_index[1:] != sequence_index[:-1], (0, 1), value=True)
    return targets.masked_fill(crosses, IGNORE_INDEX)


def first_token_unlabelled(labels: torch.Tensor, sequence_index: torch.Tensor) -> torch.Tensor:
    """Labels with each sequence's first token set to -100, for a loss that shifts labels across the row.

    A causal-LM loss over the flat row predicts `labels[t + 1]` at position t; at a boundary that is the
    next sequence's first token, which the padded batch never predicts. Masking it keeps the two equal.

    Args:
        labels: `[..., T]` labels of the flat row (the last dimension is the flat one).
        sequence_index: `[T]` the sequence of each position.

    Returns:
        A copy of `labels` with -100 at every position whose sequence differs from the previous one's
        (and at position 0).
    """
    starts = F.pad(sequence_index[1:] != sequence_index[:-1], (1, 0), value=True)
    return labels.masked_fill(starts, IGNORE_INDEX)


def segment_sum(values: torch.Tensor, sequence_index: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """Sum the flat values of each sequence (differentiable).

    Args:
        values: `[T]` per-token values.
        sequence_index: `[T]` long, the sequence of each value.
        num_sequences: N.

    Returns:
        `[N]` sums; 0 for a sequence without tokens.
    """
    out = torch.zeros(num_sequences, dtype=values.dtype, device=values.device)
    return out.index_add(0, sequence_index, values)


def last_token_per_sequence(lengths: torch.Tensor) -> torch.Tensor:
    """Flat position of each sequence's last token.

    Args:
        lengths: `[N]` tokens per sequence, each >= 1.

    Returns:
        `[N]` long: `cumsum(lengths) - 1`.
    """
    return torch.cumsum(lengths, 0) - 1


def unflatten_to_padded(values: torch.Tensor, real: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Scatter flat per-token values back into the padded layout (differentiable).

    Args:
        values: `[T, ...]` one entry per real token, in `flatten_padded` order.
        real: `[N, L]` bool, where the real tokens sit.
        fill: value written at padding positions.

    Returns:
        `[N, L, ...]`.
    """
    out = values.new_full((*real.shape, *values.shape[1:]), fill)
    return out.index_put((real,), values)


__all__ = [
    "FlatBatch",
    "flatten_padded",
    "next_token_targets",
    "first_token_unlabelled",
    "segment_sum",
    "last_token_per_sequence",
    "unflatten_to_padded",
]
