"""Padding-free forward: run a padded batch as its real tokens, packed into rows of bounded width.

A padded batch `[N, L]` costs attention, MLP and activation memory for `N * L` positions, while with a
realistic spread of lengths only a half to a third of them are real tokens. Here the real tokens are
packed, whole sequences back to back, into rows no wider than the batch's longest sequence (best-fit
decreasing, `alignkit.data.packing.pack_lengths`), each row right-padded to the widest row, with
`position_ids` restarting at 0 for each sequence and no 2D attention mask. transformers 5 reads each
reset of `position_ids` as the start of a new sequence and builds a block-diagonal causal mask per row
from it in the eager and sdpa kernels (`masking_utils.find_packed_sequence_indices`: a row's sequence
ids are the cumulative count of resets, and a query attends to a key of the same row only if both carry
the same id and the key's position is not later), provided the forward gets no `attention_mask` and no
KV cache (`use_cache=False`). A row holding one sequence and no padding gets no mask at all (sdpa's
`is_causal`), exactly as the padded batch of equal lengths does. Row padding gets positions restarting
at 0, so it is a block of its own that no real token attends to, and label -100. Each token sees exactly
the prefix it sees in the padded batch, at the same relative positions (RoPE is relative, so left-padded
rows, whose padded positions do not start at 0, get the same attention scores).

Why rows bounded by the longest sequence (issue 11). Putting all the batch's tokens in ONE row (what
this module did first) makes sdpa/eager attend a `T x T` block-diagonal mask over all T tokens, so
attention's time and memory grow with the square of the whole batch. The CPU sdpa kernel computes every
score of a masked row, so a row of width W costs about `W^2` whatever it holds: rows bounded by W cost
`T * W` in attention and `R * W` slots in the linear layers. W = the longest sequence is the least W can
be; wider rows fill better but pay for it in attention. Measured with `bench/padding_free_layouts.py`
(tables in docs/performance.md, "Padding-free layouts"): rows bounded by the longest sequence never hold
more slots than the padded batch, and they beat or tied padding, one row and wider rows in every mixed
case; `cutoff_len` as the bound (LLaMA-Factory's 2048) was among the slowest choices.

Each sequence attended on its own is now what the trainers do under sdpa (issue 15): `packed_attention`
switches the model to `per_sequence_sdpa` for the packed forward, one causal sdpa call per sequence and layer
over one row of all T tokens, so the row carries no padding and attention costs sum(l_i^2) instead of a
masked row's W^2 (docs/performance.md has the step's profile before and after). Under transformers' gradient
checkpointing too: a checkpointed layer reruns its forward during backward, after `packed_attention` has ended, so
`packed_attention` wraps the layers' checkpoint function to rerun it under the same attention (`_replaying`). The
rows-of-bounded-width layout below remains for eager attention and for torch's `checkpoint_wrapper` (FSDP's or
accelerate's activation checkpointing), whose reruns that wrapping does not reach.

With eager attention, or under a `checkpoint_wrapper`, the bound is chosen per batch by a cost model
(`cheapest_row_capacity`): a layout of R rows of width W costs `R * W * (slot_cost + W)`, where
`slot_cost = attention_slot_cost(model)` is how many attention score pairs cost as much as one token slot in the
layer's weight matrices (3072 for SmolLM2-135M).
One row of all T tokens holds no padding, so it has the fewest slots and the least activation memory; rows
of the longest sequence times 1, 2, 4, ... are taken only when the cheapest of them costs under 3/4 of the
one row. Many or long sequences get rows as narrow as the longest one (the measured tables; 32 x 512 on
SmolLM2: 18% of the one-row cost); a few short chats, whose attention square is small, keep one row: the
benchmark's chats cost 708 * 3780 = 2.68M in one row against 4 * 230 * 3302 = 3.04M in four rows. Rows
bounded by the longest sequence for every batch measured +450 MB peak RSS for SFT on the benchmark (their
row padding) for a few percent of time.

On GPUs with flash attention the one-row layout is the right one: transformers turns the resets of a
single row into `cu_seqlens` for the variable-length kernel (it detects packing only at batch size 1),
whose cost is each sequence's own, so `row_token_bound` returns None (one row) under a flash-attention
implementation. That path has not run here: there is no GPU on the development machine.

Real tokens are found from the attention mask, never from the pad id (pad == eos in SmolLM2), so left and
right padding both work. Within a row the real tokens must be contiguous, as every collator here makes them.

Next-token targets never cross a sequence boundary: `next_token_targets` gives each position the label of
the next position *of the same sequence* and -100 at each sequence's last token, so the first token of a
sequence is never predicted from the previous sequence's last one.

A model whose attention ignores position resets (remote code, or a custom kernel) would attend across
sequences sharing a row: set `padding_free: false`.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from ..constants import IGNORE_INDEX


@dataclass
class FlatBatch:
    """A padded batch reduced to its real tokens, packed into rows of bounded width.

    Two orders of the same T real tokens are kept apart:
    - the *flat order*: sequence 0's tokens, then sequence 1's, ... (what `sequence_index`, `lengths`
      and the per-token helpers below work in);
    - the *packed layout* `[R, W]` the model runs on: each row holds whole sequences back to back and is
      right-padded to the widest row; `slots` says where each flat token sits in it.

    Attributes:
        input_ids: `[R, W]` the model input; row padding holds token 0 (never read).
        position_ids: `[R, W]` 0, 1, ... within each sequence; a row's padding restarts at 0 so that it
            forms a block of its own that no real token attends to.
        labels: `[R, W]` the labels in the packed layout (-100 on row padding), or None when none were given.
        sequence_index: `[T]` long, the padded row (sequence) of each flat token.
        lengths: `[N]` long, real tokens per sequence.
        real: `[N, L]` bool, where the real tokens sit in the padded layout (to scatter results back).
        slots: `[T]` long, position of each flat token in the packed layout flattened to `R * W`. With shared
            prefixes several flat tokens have the same slot.
        shared: `[N]` long, how many leading tokens each sequence takes from an earlier sequence's slots (its
            shared prefix, `shared_prefixes`), or None when the layout holds every token of every sequence.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: Optional[torch.Tensor]
    sequence_index: torch.Tensor
    lengths: torch.Tensor
    real: torch.Tensor
    slots: torch.Tensor
    shared: Optional[torch.Tensor] = None

    @property
    def num_sequences(self) -> int:
        return self.lengths.numel()

    def from_rows(self, values: torch.Tensor) -> torch.Tensor:
        """Per-slot values of the packed layout `[R, W, ...]` (e.g. logits) in flat order `[T, ...]`."""
        rows, width = self.input_ids.shape
        if values.shape[:2] != (rows, width):
            raise ValueError(f"values of shape {tuple(values.shape)} do not cover the packed layout {(rows, width)}.")
        # index_select, not `[slots]`: with shared prefixes a slot repeats, and index_select's backward sums the
        # repeats in index order (advanced indexing's accumulates with atomics across threads: float order varies).
        return values.reshape(rows * width, *values.shape[2:]).index_select(0, self.slots)

    def to_rows(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Flat-order values `[T, ...]` placed in the packed layout `[R, W, ...]`, `fill` on row padding."""
        if self.shared is not None:
            raise ValueError("to_rows needs a layout without shared prefixes: a shared slot stands for several tokens.")
        rows, width = self.input_ids.shape
        out = values.new_full((rows * width, *values.shape[1:]), fill)
        return out.index_put((self.slots,), values).view(rows, width, *values.shape[1:])


def layout_cost(sizes: Sequence[int], capacity: int, slot_cost: float) -> tuple[float, list[list[int]]]:
    """Relative cost of packing `sizes` into rows of at most `capacity` tokens, and the rows.

    A row of width W costs `W * slot_cost` in the linear layers (every slot, padding included, goes
    through every weight matrix) and `W^2` in attention (the CPU kernel scores every pair of a masked row);
    all rows are padded to the widest one.

    Example: sizes [3, 2], slot_cost 10. Capacity 3: rows [3], [2], width 3: 2 * 3 * 10 + 2 * 3^2 = 78.
    Capacity 5: one row [3, 2], width 5: 5 * 10 + 5^2 = 75, the cheaper one.
    """
    from ..data.packing import pack_lengths

    bins = pack_lengths(list(sizes), max(capacity, 1))
    width = max((sum(sizes[i] for i in members) for members in bins), default=0)
    return len(bins) * width * (slot_cost + width), bins


# A layout of several rows must cost less than this share of the one-row layout to be taken: its row padding
# costs activation memory (measured: +450 MB peak RSS for SFT on the benchmark's chats) that the FLOP count
# does not see, so a few percent of FLOPs do not pay for it.
MULTI_ROW_MAX_COST_SHARE = 0.75


def cheapest_row_capacity(sizes: Sequence[int], slot_cost: float) -> int:
    """The row-width bound: all tokens in one row, unless rows of the longest sequence times 1, 2, 4, ...
    cost (`layout_cost`) less than `MULTI_ROW_MAX_COST_SHARE` of it; then the cheapest of those.

    One row holds no padding at all (the fewest slots, so the least activation memory) and its attention
    square is small for a few short sequences; many or long sequences make that square dominate, and rows
    as narrow as the longest sequence then cost a fraction of it.

    Example (SmolLM2, slot_cost 3072): 8 chats of 708 tokens, longest 230: one row 708 * (3072 + 708) =
    2.68M, four rows of 230 cost 4 * 230 * 3302 = 3.04M: one row. 32 sequences of 512: one row
    16384 * 19456 = 319M, 32 rows of 512 cost 32 * 512 * 3584 = 58.7M (18%): rows of 512.
    """
    longest, total = max(sizes, default=0), sum(sizes)
    one_row = max(total, 1)
    candidates, capacity = [], max(longest, 1)
    while capacity < total:
        candidates.append(capacity)
        capacity *= 2
    if not candidates:
        return one_row
    best = min(candidates, key=lambda c: (layout_cost(sizes, c, slot_cost)[0], c))
    if layout_cost(sizes, best, slot_cost)[0] < MULTI_ROW_MAX_COST_SHARE * layout_cost(sizes, one_row, slot_cost)[0]:
        return best
    return one_row


def row_layout(
    lengths: torch.Tensor, max_row_tokens: Optional[int], slot_cost: Optional[float] = None
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Where each sequence goes when the sequences are packed into rows of bounded width.

    Rows hold at most `max(max_row_tokens, longest sequence)` tokens, filled best-fit decreasing
    (`alignkit.data.packing.pack_lengths`); a sequence is never split across rows, and one too long to
    share a row with any other has a row of its own. With `max_row_tokens=0` and a `slot_cost`, the bound
    is the cheapest of `cheapest_row_capacity`'s candidates instead of the longest sequence.

    Args:
        lengths: `[N]` tokens per sequence.
        max_row_tokens: the row-width bound; None puts every sequence in one row (only for attention
            kernels with variable-length support, see the module docstring).
        slot_cost: the model's `attention_slot_cost`, to choose the bound by cost when `max_row_tokens` is 0.

    Returns:
        `(row, start, num_rows, width)`: `[N]` long row of each sequence, `[N]` long offset of its first
        token within that row, the number of rows and the widest row's token count.

    Example: lengths [3, 5, 2, 4], bound 6. Decreasing: 5 -> row 0 (1 left); 4 -> row 1 (2 left);
    3 fits no row -> row 2 (3 left); 2 -> the tightest row with room, row 1 (0 left).
    Rows: [5], [4, 2], [3]; row = [2, 0, 1, 1], start = [0, 0, 4, 0], 3 rows, width 6.
    """
    from ..data.packing import pack_lengths

    sizes = lengths.tolist()
    longest = max(sizes, default=0)
    if max_row_tokens is None:
        capacity = sum(sizes)
    elif max_row_tokens == 0 and slot_cost is not None:
        capacity = cheapest_row_capacity(sizes, slot_cost)
    else:
        capacity = max(int(max_row_tokens), longest)
    bins = pack_lengths(sizes, max(capacity, 1))
    row = [0] * len(sizes)
    start = [0] * len(sizes)
    width = 0
    for row_index, members in enumerate(bins):
        used = 0
        for index in members:
            row[index], start[index] = row_index, used
            used += sizes[index]
        width = max(width, used)
    as_long = dict(dtype=torch.long, device=lengths.device)
    return torch.tensor(row, **as_long), torch.tensor(start, **as_long), len(bins), width


def shared_prefixes(flat_ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each sequence, the earlier sequence it shares the longest prefix with, and how many tokens it shares.

    A causal model computes the same hidden states for the same tokens at the same positions after the same
    prefix, so a sequence's leading tokens that equal an earlier sequence's need not run again: a preference
    pair's rejected reply shares its chosen reply's prompt (and any common start of the two replies), a KTO
    row's mismatched KL row its own row's prompt, and every chat of a batch its template's system prompt. A
    sequence keeps at least its last token (so it always has a token of its own to attend from).

    Args:
        flat_ids: `[T]` the real tokens, sequence after sequence (`FlatBatch`'s flat order).
        lengths: `[N]` long, real tokens per sequence (each >= 1).

    Returns:
        `(host, shared)`: `[N]` long each; `host[j]` is the earlier sequence (the lowest index among those
        sharing the most) whose first `shared[j]` tokens sequence j takes, -1 and 0 where it shares none.

    Example: sequences [5 6 7], [5 6 8 9], [5 6 7 1], [4]: sequence 1 shares 2 tokens with 0, sequence 2 shares
    3 with 0 (2 with 1), sequence 3 none: host [-1, 0, 0, -1], shared [0, 2, 3, 0].
    """
    count = lengths.numel()
    longest = int(lengths.max()) if count else 0
    starts = torch.cumsum(lengths, 0) - lengths
    columns = torch.arange(flat_ids.numel(), device=flat_ids.device) - torch.repeat_interleave(starts, lengths)
    rows = torch.repeat_interleave(torch.arange(count, device=flat_ids.device), lengths)
    # Left-aligned tokens, padding -1 (never a token id): prefixes compare column by column.
    aligned = flat_ids.new_full((count, longest), -1).index_put((rows, columns), flat_ids)
    common = torch.empty(count, count, dtype=torch.long, device=flat_ids.device)
    step = max(1, (1 << 24) // max(count * longest, 1))  # rows of the [step, N, longest] comparison per chunk
    for first in range(0, count, step):
        # differs[j, i, c]: sequence j's column c is not sequence i's real token there.
        differs = (aligned[first:first + step, None, :] != aligned[None, :, :]) | (aligned[None, :, :] < 0)
        # The common prefix is the first differing column (all `longest` when none differs).
        common[first:first + step] = torch.where(differs.any(-1), differs.to(torch.uint8).argmax(-1), longest)
    later = torch.ones(count, count, dtype=torch.bool, device=flat_ids.device).triu()
    # Only an earlier sequence can be a host, and a sequence keeps its last token.
    common = torch.minimum(common, (lengths - 1)[:, None]).masked_fill(later, -1)
    best, host = common.max(1) if count else (common.new_zeros(0), common.new_zeros(0))  # max: the first of ties
    shared = best.clamp(min=0)
    host = torch.where(shared > 0, host, -1)
    return host, shared


def _shared_layout(
    flat_ids: torch.Tensor, lengths: torch.Tensor, sequence_index: torch.Tensor, flat_positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row holding each sequence's own tokens (those after its shared prefix), sequences in order.

    Returns:
        `(slots [T], input_ids [1, W], position_ids [1, W], shared [N])`: a shared token's slot is its host's
        slot for the same position (hosts are earlier sequences, so chains resolve in order).
    """
    host, shared = shared_prefixes(flat_ids, lengths)
    device = flat_ids.device
    starts = torch.cumsum(lengths, 0) - lengths
    own_lengths = lengths - shared
    own_starts = torch.cumsum(own_lengths, 0) - own_lengths
    own = flat_positions >= shared[sequence_index]
    # A shared token points at the flat token of its host at the same position; follow the pointers until every
    # token points at an own token (a host may itself share that position with its own host).
    pointer = torch.arange(flat_ids.numel(), device=device)
    pointer = torch.where(own, pointer, starts[host[sequence_index].clamp(min=0)] + flat_positions)
    while not bool(own[pointer].all()):
        pointer = pointer[pointer]
    own_slot = own_starts[sequence_index] + flat_positions - shared[sequence_index]
    slots = own_slot[pointer]
    width = int(own_lengths.sum())
    input_ids = flat_ids.new_zeros(width).index_put((own_slot[own],), flat_ids[own])
    position_ids = torch.zeros(width, dtype=torch.long, device=device).index_put((own_slot[own],), flat_positions[own])
    return slots, input_ids[None], position_ids[None], shared


def flatten_padded(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: Optional[torch.Tensor] = None,
    *,
    max_row_tokens: Optional[int] = 0,
    slot_cost: Optional[float] = None,
    share_prefixes: bool = False,
) -> FlatBatch:
    """Pack the real tokens of a left- or right-padded batch into rows of bounded width.

    Args:
        input_ids: `[N, L]` token ids.
        attention_mask: `[N, L]`, 1 on real tokens, 0 on padding; each row's real tokens contiguous.
        labels: optional `[N, L]` labels aligned with `input_ids`.
        max_row_tokens: rows hold at most `max(max_row_tokens, longest sequence)` tokens; the default 0
            bounds them by the batch's longest sequence (measured fastest, see the module docstring); a
            larger bound fills rows better but widens each row's attention. None: one row of all the
            tokens (only for kernels with variable-length support, see `row_token_bound`).
        slot_cost: with `max_row_tokens=0`, choose the bound by cost instead (`attention_slot_cost(model)`;
            see `cheapest_row_capacity`).
        share_prefixes: with `max_row_tokens=None`, lay out each sequence's prefix shared with an earlier one
            (`shared_prefixes`) only once: the row holds each sequence's own tokens, position ids continuing after
            its shared prefix, and the shared tokens' slots are their host's. Only for a forward under
            `packed_attention` with per-sequence attention (`uses_per_sequence_attention`), which attends each
            sequence to its whole prefix, and for callers that read results in flat order (`from_rows`).

    Returns:
        A `FlatBatch` whose `position_ids` restart at 0 for every sequence (continue after a shared prefix).
    """
    real = attention_mask.bool()
    lengths = real.sum(-1)
    # Boolean indexing walks rows in order and each row left to right, so sequences stay contiguous.
    flat_ids = input_ids[real]
    device = input_ids.device
    sequence_index = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    flat_positions = torch.arange(flat_ids.numel(), device=device) - starts[sequence_index]

    if share_prefixes and max_row_tokens is None and lengths.numel() > 1:
        slots, layout_ids, position_ids, shared = _shared_layout(flat_ids, lengths, sequence_index, flat_positions)
        if bool(shared.any()):
            layout_labels = None
            if labels is not None:  # each slot labelled as its own token is (a shared token's label is its host's)
                own = flat_positions >= shared[sequence_index]
                layout_labels = labels.new_full((layout_ids.numel(),), IGNORE_INDEX).index_put(
                    (slots[own],), labels[real][own])[None]
            return FlatBatch(input_ids=layout_ids, position_ids=position_ids, labels=layout_labels,
                             sequence_index=sequence_index, lengths=lengths, real=real, slots=slots, shared=shared)

    row, start, num_rows, width = row_layout(lengths, max_row_tokens, slot_cost)
    slots = (row * width + start)[sequence_index] + flat_positions
    # Row padding: positions counting from 0 at the end of each row's real tokens (so a new block).
    row_used = torch.zeros(num_rows, dtype=torch.long, device=device).index_add(0, row, lengths)
    position_ids = (torch.arange(width, device=device) - row_used[:, None]).reshape(-1)
    position_ids = position_ids.index_put((slots,), flat_positions).view(num_rows, width)
    layout_ids = input_ids.new_zeros(num_rows * width).index_put((slots,), flat_ids).view(num_rows, width)
    layout_labels = None
    if labels is not None:
        layout_labels = labels.new_full((num_rows * width,), IGNORE_INDEX).index_put((slots,), labels[real])
        layout_labels = layout_labels.view(num_rows, width)
    return FlatBatch(
        input_ids=layout_ids,
        position_ids=position_ids,
        labels=layout_labels,
        sequence_index=sequence_index,
        lengths=lengths,
        real=real,
        slots=slots,
    )


def next_token_targets(labels: torch.Tensor, sequence_index: torch.Tensor) -> torch.Tensor:
    """The label each flat position predicts: the next token's label within the same sequence.

    Args:
        labels: `[..., T]` labels along the last dimension, -100 where no loss is taken.
        sequence_index: `[..., T]` the sequence of each position (any id that differs between neighbours
            at a boundary, e.g. -1 on row padding).

    Returns:
        `[..., T]`: `labels[t + 1]` where position t + 1 belongs to the same sequence as t, else -100.
    """
    targets = F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
    crosses = F.pad(sequence_index[..., 1:] != sequence_index[..., :-1], (0, 1), value=True)
    return targets.masked_fill(crosses, IGNORE_INDEX)


def first_token_unlabelled(labels: torch.Tensor, sequence_index: torch.Tensor) -> torch.Tensor:
    """Labels with each sequence's first token set to -100, for a loss that shifts labels across the row.

    A causal-LM loss over the flat row predicts `labels[t + 1]` at position t; at a boundary that is the
    next sequence's first token, which the padded batch never predicts. Masking it keeps the two equal.

    Args:
        labels: `[..., T]` labels along the last dimension (the flat order, or the packed rows).
        sequence_index: `[..., T]` the sequence of each position, broadcastable to `labels`.

    Returns:
        A copy of `labels` with -100 at every position whose sequence differs from the previous one's
        (and at position 0).
    """
    starts = F.pad(sequence_index[..., 1:] != sequence_index[..., :-1], (1, 0), value=True)
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
    """Flat position (flat order, see `FlatBatch`) of each sequence's last token.

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


# ---------------------------------------------------------------------------------------------------
# Attention of each sequence on its own (issue 15)
# ---------------------------------------------------------------------------------------------------

PER_SEQUENCE_ATTENTION = "alignkit_per_sequence_sdpa"


class _SharedContexts(NamedTuple):
    """A row with shared prefixes, as its attention reads it: each sequence's whole context is gathered by `slots`
    (flat order), `lengths` long each, and its first `shared` outputs are its host's."""

    slots: torch.Tensor
    lengths: list[int]
    shared: list[int]


# While `packed_attention` (or a checkpointed layer's rerun, `_replaying`) is active: the model config it switched to
# `per_sequence_sdpa`, and the (start, end) of each sequence in the single packed row or, for a row with shared
# prefixes, its `_SharedContexts`. Set once per forward, read by every layer.
_PACKED_STATE: contextvars.ContextVar[Optional[tuple[object, Union[list[tuple[int, int]], _SharedContexts]]]] = (
    contextvars.ContextVar("alignkit_packed_state", default=None))


# Under a CPU bf16 autocast, sequences shorter than this attend in fp32: torch's CPU flash-attention kernel runs a
# short bf16 sequence slower than fp32 (forward and backward, 9 heads of 64, 2 threads, AMD EPYC with AVX512-BF16:
# 128 tokens 0.092 s bf16 against 0.049 s fp32 (0.055 s with the casts); 384 tokens equal; 768 tokens bf16 1.25x
# faster). Not measured on an AMX machine.
FP32_ATTENTION_BELOW = 384


# Under `torch_compile: true` the compiled model calls this eagerly (a graph break per layer): its loop runs over
# the batch's own sequence lengths, which dynamo would trace as symbols (and fail on, as an autocast's `enabled`
# flag) or recompile for every new set of lengths.
@torch.compiler.disable(reason="per-sequence attention loops over the batch's sequence lengths")
def per_sequence_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Causal sdpa over each sequence of the one packed row on its own: the work of a variable-length kernel.

    Registered with transformers' `AttentionInterface` under `PER_SEQUENCE_ATTENTION` and switched on by
    `packed_attention` for one forward. The CPU sdpa kernel scores every pair of a masked row, so one row of T
    tokens holding sequences of lengths l_i costs T^2 with the block-diagonal mask, sum(l_i^2) here (8 chats of
    about 90 tokens: 8 * 90^2 = 65k pairs instead of 708^2 = 501k). Each call is plain causal attention with no
    mask, so it runs sdpa's flash kernel, and the sequences never see each other. Under a CPU bf16 autocast a
    sequence shorter than `FP32_ATTENTION_BELOW` tokens attends in fp32 (faster there), its output cast to bf16 as
    autocast's sdpa would return it.

    Args:
        module, query, key, value, dropout, scaling: as transformers passes them to `sdpa_attention_forward`;
            query/key/value are `[1, heads, T, head_dim]`.
        attention_mask: None (the implementation has no mask function, so transformers builds none).

    Returns:
        `([1, T, heads, head_dim], None)`, as `sdpa_attention_forward` returns.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    state = _PACKED_STATE.get()
    if state is None or query.size(0) != 1 or attention_mask is not None:
        raise RuntimeError(f"{PER_SEQUENCE_ATTENTION} runs only inside `packed_attention` on one packed row; the "
                           "model was called outside it (a checkpoint wrapper other than transformers' gradient "
                           "checkpointing reruns layers outside it: set padding_free: false).")
    bounds = state[1]
    own = None
    if isinstance(bounds, _SharedContexts):
        # Shared prefixes: gather every sequence's whole context (its prefix's slots, then its own) in flat order;
        # each sequence attends causally over it and keeps the outputs of its own tokens, which tile the row in
        # sequence order. One gather per tensor, so its backward is one index_add in index order (deterministic).
        query, key, value = (t.index_select(2, bounds.slots) for t in (query, key, value))
        lengths, own = bounds.lengths, bounds.shared
    else:
        lengths = [b - a for a, b in bounds]  # the sequences tile the row: split, whose backward is one cat
    cpu_autocast = query.device.type == "cpu" and torch.is_autocast_enabled("cpu")
    if cpu_autocast and min(lengths) < FP32_ATTENTION_BELOW:
        query, key, value = query.float(), key.float(), value.float()
    outputs = []
    for index, (length, q, k, v) in enumerate(zip(lengths, *(torch.split(t, lengths, dim=2)
                                                              for t in (query, key, value)))):
        # A short sequence attends in fp32 with autocast off; a long one in the autocast's dtype.
        with torch.autocast("cpu", dtype=torch.get_autocast_dtype("cpu"),
                            enabled=cpu_autocast and length >= FP32_ATTENTION_BELOW):
            out = sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True)[0]
        if own is not None and own[index]:
            out = out[:, own[index]:]  # the shared prefix's outputs are its host's
        outputs.append(out.to(torch.get_autocast_dtype("cpu")) if cpu_autocast else out)
    return torch.cat(outputs, 1) if len(outputs) > 1 else outputs[0], None


def model_config(model: torch.nn.Module):
    """The model's transformers config, also through a training wrapper (DDP, a DeepSpeed engine: `.module`).

    A DeepSpeed engine has a `config` of its own (DeepSpeed's settings, a dict), so `model.config` would be that.
    """
    return getattr(getattr(model, "module", model), "config", None)


def attention_takes_any_mask(model: torch.nn.Module) -> bool:
    """Whether the model's attention takes an arbitrary mask (sdpa or eager), such as a block mask over a packed
    row or padding in the middle of a row; flash attention and the kernels hub's take only their own layouts."""
    return getattr(model_config(model), "_attn_implementation", None) in ("sdpa", "eager")


def uses_per_sequence_attention(model: torch.nn.Module) -> bool:
    """True when a packed forward of `model` should attend each sequence on its own (`per_sequence_sdpa`).

    That is under the sdpa implementation (transformers' default on CPU), with or without transformers' gradient
    checkpointing: a checkpointed layer reruns its forward during backward, after `packed_attention` has ended, and
    `packed_attention` wraps the layers' checkpoint function so that the rerun attends as the forward did
    (`_replaying`). Eager attention keeps the block-diagonal mask (its users asked for eager); flash attention has its
    own variable-length kernel (`row_token_bound`). A model whose layers torch's `checkpoint_wrapper` wraps (FSDP's
    or accelerate's activation checkpointing) keeps the masked rows: its reruns are not replayed.
    """
    config = model_config(model)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    return not _wrapped_checkpointing(model)


class _CheckpointSites(NamedTuple):
    """The modules of a model that carry transformers' `gradient_checkpointing` flag (the decoder layers, the decoder),
    and where each sits: `(parent, key)`, `parent._modules[key]` being the module unless a wrapper replaced it."""

    holders: tuple
    places: tuple


# Per model, its `_CheckpointSites`, found once (`_checkpoint_sites`).
_CHECKPOINT_SITES: "weakref.WeakKeyDictionary[torch.nn.Module, _CheckpointSites]" = weakref.WeakKeyDictionary()


def _checkpoint_sites(model: torch.nn.Module) -> _CheckpointSites:
    inner = getattr(model, "module", model)
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    sites = _CHECKPOINT_SITES.get(base)
    if sites is None:
        places = tuple((parent, key) for parent in base.modules() for key, child in parent._modules.items()
                       if child is not None and hasattr(child, "gradient_checkpointing"))
        holders = tuple(parent._modules[key] for parent, key in places)
        if hasattr(base, "gradient_checkpointing"):
            holders = (base, *holders)
        sites = _CHECKPOINT_SITES[base] = _CheckpointSites(holders, places)
    return sites


def activation_checkpointing(model: torch.nn.Module) -> bool:
    """Whether transformers' gradient (activation) checkpointing is on anywhere in `model` (PEFT, DDP or DeepSpeed
    wrapper allowed).

    transformers' `is_activation_checkpointing` answers the same by probing every module with `hasattr`, about 5-7 ms
    for the bundled model with LoRA adapters on an AMD EPYC, and a padding-free forward asks three or four times.
    Here the modules that carry the flag are found once per model (`_checkpoint_sites`) and their flags read on every
    call, so turning checkpointing on or off later is seen; modules added to the model after the first call are not
    (wrapping in PEFT adds none that carry the flag).
    """
    return any(bool(m.gradient_checkpointing) for m in _checkpoint_sites(model).holders)


def _wrapped_checkpointing(model: torch.nn.Module) -> bool:
    """Whether torch's `checkpoint_wrapper` (FSDP's or accelerate's activation checkpointing, which wrap each decoder
    layer) wraps a layer of `model`. Its rerun calls the layer outside `packed_attention`, which `_replaying` does not
    reach, so such a model attends through masks. The wrapping is applied when the trainer prepares the model, which
    may be after the model first ran, so each call looks again where the flag-carrying layers sit (`_CheckpointSites`:
    about 60 type checks, where a walk over the bundled model's 2,499 modules with LoRA took 2.4 ms)."""
    if "torch.distributed.algorithms._checkpoint.checkpoint_wrapper" not in sys.modules:
        return False  # nothing imported the wrapper, so nothing is wrapped
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

    return any(isinstance(parent, ActivationWrapper) or isinstance(parent._modules.get(key), ActivationWrapper)
               for parent, key in _checkpoint_sites(model).places)


def _replaying(checkpoint_func):
    """`checkpoint_func` (a layer's `_gradient_checkpointing_func`) with its reruns under the packed attention of the
    forward they recompute.

    transformers checkpoints a layer as `layer._gradient_checkpointing_func(partial(forward, ...), *args)`; torch reruns
    that function during backward, when `packed_attention` has ended and the model is back on plain sdpa, which would
    attend across the sequences of the packed row. The wrapper captures the attention state at the forward
    (`_PACKED_STATE`) and reruns the function under it; outside `packed_attention` it
    is `checkpoint_func` unchanged. Works for reentrant and non-reentrant checkpointing alike.
    """
    if getattr(checkpoint_func, "_alignkit_replays", False):
        return checkpoint_func

    def replaying(function, *args, **kwargs):
        state = _PACKED_STATE.get()
        if state is None:
            return checkpoint_func(function, *args, **kwargs)

        def rerun(*inner_args, **inner_kwargs):
            if _PACKED_STATE.get() is state:  # the forward itself (or a rerun inside that same forward)
                return function(*inner_args, **inner_kwargs)
            with _attending(*state):
                return function(*inner_args, **inner_kwargs)

        return checkpoint_func(rerun, *args, **kwargs)

    replaying._alignkit_replays = True
    replaying.__wrapped__ = checkpoint_func
    return replaying


@contextlib.contextmanager
def _attending(config, bounds) -> Iterator[None]:
    """`config`'s model attends each sequence of `bounds` on its own (`per_sequence_sdpa`) within the block."""
    token = _PACKED_STATE.set((config, bounds))
    previous = config._attn_implementation
    config._attn_implementation = PER_SEQUENCE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous
        _PACKED_STATE.reset(token)


# The padded batch's width while its padding-free forward runs (`packed_attention`): NEFTune scales its noise by the
# padded length (`neftune_noise`), where the embeddings of a packed row have the row's length instead.
_PADDED_WIDTH: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("alignkit_padded_width", default=None)


def padded_width() -> Optional[int]:
    """The width of the padded batch whose padding-free forward is running (inside `packed_attention`), else None."""
    return _PADDED_WIDTH.get()


def neftune_noise(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    """NEFTune's forward hook on the input embeddings, as transformers' `neftune_post_forward_hook` computes it: while
    training, uniform noise in +-alpha / sqrt(L * d) (`module.neftune_noise_alpha`, d the embedding width), with L the
    padded batch's length also when the batch runs padding-free (`padded_width`), where the embeddings' own length
    is the packed row's (all the batch's tokens: the noise would shrink by sqrt(rows))."""
    if not module.training:
        return output
    dims = torch.tensor((padded_width() or output.size(1)) * output.size(2))
    magnitude = module.neftune_noise_alpha / torch.sqrt(dims)
    return output + torch.zeros_like(output).uniform_(-magnitude, magnitude)


@contextlib.contextmanager
def packed_attention(model: torch.nn.Module, flat: "FlatBatch") -> Iterator[None]:
    """Within the block, `model` attends each sequence of `flat` on its own when `uses_per_sequence_attention`.

    `flat` must then be one row (`row_token_bound` gives None for such a model). Otherwise nothing changes:
    transformers builds the block-diagonal mask from the position resets. Under transformers' gradient checkpointing
    the layers' checkpoint function is wrapped (`_replaying`, once) so that their reruns during backward attend the
    same way. The padded batch's width is `padded_width()` within the block.
    """
    token = _PADDED_WIDTH.set(int(flat.real.size(1)))
    try:
        with _packed_attention(model, flat):
            yield
    finally:
        _PADDED_WIDTH.reset(token)


@contextlib.contextmanager
def _packed_attention(model: torch.nn.Module, flat: "FlatBatch") -> Iterator[None]:
    config = model_config(model)
    if not uses_per_sequence_attention(model) or flat.input_ids.size(0) != 1:
        if flat.shared is not None:
            raise RuntimeError("a layout with shared prefixes needs per-sequence attention (sdpa, no "
                               "checkpoint_wrapper); build it with `flatten_for_model`, which shares only then.")
        yield
        return
    from transformers import AttentionInterface

    if PER_SEQUENCE_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(PER_SEQUENCE_ATTENTION, per_sequence_sdpa)
    if flat.shared is not None:
        bounds = _SharedContexts(flat.slots, flat.lengths.tolist(), flat.shared.tolist())
    else:
        # Sequences sit in the row in packing order, not flat order: read where each starts from the position resets.
        starts = (flat.position_ids[0] == 0).nonzero().squeeze(-1).tolist() + [flat.position_ids.size(1)]
        bounds = list(zip(starts[:-1], starts[1:]))
    if activation_checkpointing(model):
        # The layers rerun their forward during backward, after this block: make those reruns attend as this one.
        for holder in _checkpoint_sites(model).holders:
            if getattr(holder, "_gradient_checkpointing_func", None) is not None:
                holder._gradient_checkpointing_func = _replaying(holder._gradient_checkpointing_func)
    with _attending(config, bounds):
        yield


def row_token_bound(model: torch.nn.Module) -> Optional[int]:
    """The `max_row_tokens` to pack a batch with for `model`: None (one row) under flash attention or per-sequence
    attention (`uses_per_sequence_attention`), else 0.

    0 bounds each row by the batch's longest sequence, which measured fastest with sdpa on this CPU
    (module docstring); eager builds the same per-row mask. transformers' flash-attention path instead
    reads the position resets of a *single* row as `cu_seqlens` and runs the variable-length kernel, whose
    cost is already each sequence's own; it detects packing only at batch size 1, so there one row is
    right. That branch has not run here: there is no GPU on the development machine.

    Args:
        model: the model (possibly wrapped by PEFT or DDP) about to run the packed batch.
    """
    from transformers.utils.generic import is_flash_attention_requested

    config = model_config(model)
    if config is not None and is_flash_attention_requested(config=config):
        return None
    if uses_per_sequence_attention(model):
        return None  # no row padding at all; each sequence's attention is its own (`per_sequence_sdpa`)
    return 0


def flatten_for_model(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> FlatBatch:
    """`flatten_padded` with the layout `model` runs fastest: one row under per-sequence or flash attention, rows
    bounded by cost otherwise; under per-sequence attention each prefix shared with an earlier sequence of the batch
    runs once (`shared_prefixes`). The caller must read results in flat order (`FlatBatch.from_rows`) and run the
    forward under `packed_attention`.

    Shared prefixes cut the tokens a preference batch runs: the bundled model's chat template puts the same system
    prompt before every prompt, and a pair's two replies share the whole prompt (about 40 of a pair's ~50 tokens
    per reply in the demo data). The 60 held-out demo pairs, batches of 8, hold 6193 real tokens; 2191 of them run
    (35%; the 300 training pairs 37%). docs/performance.md, "Shared prefixes", has the times.
    """
    return flatten_padded(input_ids, attention_mask, max_row_tokens=row_token_bound(model),
                          slot_cost=attention_slot_cost(model), share_prefixes=uses_per_sequence_attention(model))


def attention_slot_cost(model: torch.nn.Module) -> Optional[float]:
    """How many attention score pairs cost as much as one more token slot, per decoder layer.

    A token slot costs `2 * P` FLOPs in the layer's linear weights (P = q, k, v, o and MLP weights) and a
    pair of positions `4 * heads * head_dim` in attention (scores and weighted sum); the ratio is what
    `cheapest_row_capacity` trades row padding against attention with.

    Example, SmolLM2-135M (hidden 576, 9 heads and 3 KV heads of 64, MLP 1536, gated):
    P = 576*576*2 + 576*192*2 + 3*576*1536 = 3,538,944; 2P / (4*576) = 3072.

    Returns:
        The ratio, or None when the config does not say the shapes (then rows are bounded by the longest
        sequence).
    """
    config = model_config(model)
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    intermediate = getattr(config, "intermediate_size", None)
    if not (hidden and heads and intermediate):
        return None
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    weights = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate
    return 2 * weights / (4 * heads * head_dim)


__all__ = [
    "FlatBatch",
    "PER_SEQUENCE_ATTENTION",
    "packed_attention",
    "padded_width",
    "neftune_noise",
    "per_sequence_sdpa",
    "uses_per_sequence_attention",
    "activation_checkpointing",
    "model_config",
    "attention_slot_cost",
    "MULTI_ROW_MAX_COST_SHARE",
    "cheapest_row_capacity",
    "layout_cost",
    "row_layout",
    "row_token_bound",
    "flatten_padded",
    "flatten_for_model",
    "shared_prefixes",
    "next_token_targets",
    "first_token_unlabelled",
    "segment_sum",
    "last_token_per_sequence",
    "unflatten_to_padded",
]
