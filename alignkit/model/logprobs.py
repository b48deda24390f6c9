"""Per-token log-probabilities of given tokens, without a second full-vocabulary copy of the logits.

Every preference and RL stage needs `log p(token | prefix)` for the tokens of a response. The obvious
`logits.log_softmax(-1).gather(-1, labels)` allocates a second `[N, L, V]` tensor for the log-softmax
and keeps it alive for the backward pass; with SmolLM2's 49k-token vocabulary that copy is the largest
tensor of a training step. Here the log-probability is `logit[label] - logsumexp(logits)`, computed in
row chunks, and the backward pass writes `onehot - softmax` chunk by chunk into the one gradient buffer
the output layer needs anyway. The logits themselves are kept by reference, not copied.

The padding-free forward goes one step further when the output layer is a plain linear layer of a model
family that does nothing to the logits after it (`_fusable_head`): the model returns the hidden states of
the scored positions and `head_log_softmax` multiplies them by the head's weight one chunk of rows at a time,
so no `[K, V]` logits (K scored tokens) and no `[K, V]` gradient exist at all (at 4096 scored tokens and
SmolLM2's vocabulary those two were 1.6 GB of fp32).

Conventions: `labels` are the input ids with `-100` (ignore) on positions that carry no loss (prompt,
padding), aligned with `input_ids`, as the data collators return them; the shift by one
(logits at position t predict the token at t + 1) happens here and nowhere else.

`forward_token_logps` / `forward_sequence_logps` run the model too; with `padding_free=True` the batch's
real tokens go through packed into rows no wider than its longest sequence (`alignkit.model.padding_free`) and
only the positions whose next token is labelled reach the output layer (a pre-hook on it picks them), so
neither padding nor prompt costs a vocabulary projection.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F

from ..constants import IGNORE_INDEX
from .distributed import is_zero3_partitioned
from .lora_fused import frozen_cast, shadowed_forward
from .padding_free import (
    FlatBatch,
    flatten_for_model,
    next_token_targets,
    packed_attention,
    segment_sum,
)

# Rows per chunk of `head_log_softmax` are chosen so one chunk holds about this many logits (64 MiB in float32):
# each chunk multiplies by the whole output layer, which wants many rows per product.
_CHUNK_ELEMENTS = 1 << 24
# Rows per chunk of the purely element-wise passes over given `[K, V]` logits (`selective_log_softmax`,
# `rl.rollout.token_entropy`, distillation's divergence): 512 K numbers, so a chunk's fp32 temporaries (2 MB each)
# stay in the CPU's caches between the passes. Forward and backward of `selective_log_softmax` on 600 x 49152 bf16
# logits on an AMD EPYC, 2 threads: 0.22 s at 2^24, 0.09 s at 2^19 or 2^20; the entropy 0.081 s at 2^24, 0.014 s at
# 2^19 (256 rows).
ELEMENTWISE_CHUNK_ELEMENTS = 1 << 19


def _rows_per_chunk(vocab_size: int, elements: int = _CHUNK_ELEMENTS) -> int:
    return max(1, elements // max(vocab_size, 1))


def elementwise_rows(vocab_size: int) -> int:
    """Rows per chunk of an element-wise pass over `[K, vocab_size]` logits (`ELEMENTWISE_CHUNK_ELEMENTS`)."""
    return _rows_per_chunk(vocab_size, ELEMENTWISE_CHUNK_ELEMENTS)


class _SelectiveLogSoftmax(torch.autograd.Function):
    """`log_softmax(logits)[..., index]` with O(chunk) extra memory in forward and backward."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        vocab = logits.size(-1)
        rows = logits.reshape(-1, vocab)  # a view for the usual contiguous model output
        flat_index = index.reshape(-1, 1)
        out = torch.empty(rows.size(0), dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        step = elementwise_rows(vocab)
        for start in range(0, rows.size(0), step):
            chunk = rows[start : start + step].float()  # a no-op for fp32; bf16 logits get fp32 maths per chunk
            chunk_lse = torch.logsumexp(chunk, dim=-1)
            lse[start : start + step] = chunk_lse
            out[start : start + step] = chunk.gather(-1, flat_index[start : start + step]).squeeze(-1) - chunk_lse
        ctx.save_for_backward(logits, index, lse)
        ctx.mark_non_differentiable(index)
        return out.view(index.shape)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, index, lse = ctx.saved_tensors
        vocab = logits.size(-1)
        rows = logits.reshape(-1, vocab)
        flat_index = index.reshape(-1, 1)
        flat_grad = grad_out.reshape(-1, 1).float()
        grad_rows = torch.empty(rows.shape, dtype=logits.dtype, device=logits.device)
        # Into the gradient buffer, never into the logits themselves.
        _log_softmax_backward(rows, lse, flat_index, flat_grad, out=grad_rows)
        return grad_rows.view(logits.shape), None


def _log_softmax_backward(rows: torch.Tensor, lse: torch.Tensor, index: torch.Tensor, grad: torch.Tensor,
                          out: torch.Tensor) -> None:
    """Write `grad * (onehot(index) - softmax(rows))`, the gradient of `grad * log_softmax(rows)[index]`, into
    `out` in blocks of `elementwise_rows` rows, with fp32 maths.

    Args:
        rows: `[R, V]` logits of any float dtype; `lse`: `[R]` their fp32 log-partition.
        index, grad: `[R, 1]` token ids and fp32 incoming gradients.
        out: `[R, V]`, `rows`' dtype; may be `rows` itself. fp32 is computed straight into it, other dtypes
            through one fp32 block.
    """
    step = elementwise_rows(rows.size(-1))
    in_place = out.dtype == torch.float32
    for start in range(0, rows.size(0), step):
        end = start + step
        # d/dz [z_y - logsumexp(z)] = onehot(y) - softmax(z).
        chunk = out[start:end] if in_place else None
        chunk = torch.sub(rows[start:end].float(), lse[start:end, None], out=chunk)
        chunk.exp_().mul_(-grad[start:end])
        chunk.scatter_add_(-1, index[start:end], grad[start:end])
        if not in_place:
            out[start:end] = chunk


def _log_partition_(logits: torch.Tensor, probs: bool = False) -> torch.Tensor:
    """`logsumexp(logits, -1)` in fp32 for `[R, V]` logits of any float dtype, in cache-sized blocks of rows (each
    block's fp32 temporaries stay in the CPU's caches between the max, exp and sum passes). `logits` is
    overwritten: with `softmax(logits)` in its own dtype when `probs`, else with intermediate values."""
    lse = torch.empty(logits.size(0), dtype=torch.float32, device=logits.device)
    sub = elementwise_rows(logits.size(-1))
    for first in range(0, logits.size(0), sub):
        rows = slice(first, first + sub)
        block = logits[rows].float()  # the rows themselves when fp32, else an fp32 copy of a few rows
        peak = block.amax(-1, keepdim=True)
        block_lse = (block - peak).exp_().sum(-1, keepdim=True).log_().add_(peak)
        lse[rows] = block_lse.squeeze(-1)
        if probs:
            block.sub_(block_lse).exp_()
            if block.dtype != logits.dtype:
                logits[rows] = block
    return lse


class _HeadLogSoftmax(torch.autograd.Function):
    """`log_softmax(hidden @ weight.T + bias)[k, index[k]]` computed chunk by chunk: the `[K, V]` logits never exist.

    Frozen output layer (LoRA, or any head without gradients): the gradient of each log-prob with respect to its
    own hidden state, `weight[y] - softmax(z) @ weight` (`[K, H]`), is computed in the forward from the chunk's
    probabilities, while they are at hand, and backward only scales it by the incoming gradient. That is the
    same two `K x H x V` products the unfused forward and backward do, without the `[K, V]` logits, their
    `[K, V]` gradient, or a second pass over the vocabulary. A trainable output layer instead keeps the hidden
    states and recomputes each chunk's logits in backward for the weight gradient (one more product).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, index):
        rows, vocab = hidden.size(0), weight.size(0)
        out = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        trainable_head = ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2])
        unit_grad = (torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
                     if ctx.needs_input_grad[0] and not trainable_head else None)
        step = _rows_per_chunk(vocab)
        device = hidden.device.type
        inputs, low, low_bias = hidden, weight, bias
        if torch.is_autocast_enabled(device):  # cast once here, not per chunk and product as autocast would
            dtype = torch.get_autocast_dtype(device)
            inputs, low = hidden.to(dtype), frozen_cast(weight, dtype)
            low_bias = None if bias is None else bias.to(dtype)
        with torch.autocast(device, enabled=False):
            for start in range(0, rows, step):
                end = start + step
                logits = F.linear(inputs[start:end], low, low_bias)
                out[start:end] = logits.gather(-1, index[start:end, None]).squeeze(-1).float()
                chunk_lse = _log_partition_(logits, probs=unit_grad is not None)
                lse[start:end] = chunk_lse
                out[start:end] -= chunk_lse
                if unit_grad is not None:
                    # d/dh [z_y - logsumexp(z)] with z = W h + b: W[y] - softmax(z) @ W (`logits` now holds
                    # softmax(z)).
                    unit_grad[start:end] = weight[index[start:end]].float() - (logits @ low).float()
        ctx.trainable_head, ctx.hidden_dtype, ctx.product_dtype = trainable_head, hidden.dtype, low.dtype
        if unit_grad is not None:
            ctx.save_for_backward(unit_grad)
        else:
            ctx.save_for_backward(hidden, weight, bias, index, lse)
        ctx.mark_non_differentiable(index)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.trainable_head:
            (unit_grad,) = ctx.saved_tensors
            return (grad_out.float()[:, None] * unit_grad).to(ctx.hidden_dtype), None, None, None
        hidden, weight, bias, index, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[2] else None
        step = _rows_per_chunk(weight.size(0))
        # The products in the forward's dtype (bf16 under its autocast, as autocast's own backward would run them),
        # so the recomputed logits are those whose log-partition `lse` holds.
        dtype = ctx.product_dtype
        low_hidden, low_weight = hidden.to(dtype), weight.to(dtype)
        low_bias = None if bias is None else bias.to(dtype)
        for start in range(0, hidden.size(0), step):
            end = start + step
            # The logits' gradient, written over the chunk's logits.
            grad_logits = F.linear(low_hidden[start:end], low_weight, low_bias)
            _log_softmax_backward(grad_logits, lse[start:end], index[start:end, None],
                                  grad_out[start:end, None].float(), out=grad_logits)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits @ low_weight
            if grad_weight is not None:
                grad_weight += grad_logits.T @ low_hidden[start:end]
            if grad_bias is not None:
                grad_bias += grad_logits.float().sum(0)
        return grad_hidden, grad_weight, grad_bias, None


def head_log_softmax(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     index: torch.Tensor) -> torch.Tensor:
    """Log-probability of `index` under the output layer `hidden @ weight.T + bias`, never holding `[K, V]` logits.

    Equal to `selective_log_softmax(F.linear(hidden, weight, bias), index)`, with at most one chunk of
    `_CHUNK_ELEMENTS` logits alive at a time, in the forward and in the backward (`_HeadLogSoftmax`).

    Args:
        hidden: `[K, H]` hidden states entering the output layer.
        weight: `[V, H]` the output layer's weight; `bias`: `[V]` or None.
        index: `[K]` token ids in `[0, V)`.

    Returns:
        `[K]` float32 log-probabilities; differentiable in `hidden` (and `weight`, `bias` when they require grad).
    """
    if hidden.dim() != 2 or index.shape != hidden.shape[:1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [K, H] and index {tuple(index.shape)} [K].")
    return _HeadLogSoftmax.apply(hidden, weight, bias, index)


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Log-softmax of `logits` over the last dimension, read at `index`, memory-lean.

    Equal to `logits.log_softmax(-1).gather(-1, index[..., None]).squeeze(-1)` but never allocates a
    second tensor of the logits' size in the forward pass, and only the one gradient buffer in backward.

    Args:
        logits: `[..., V]` float tensor. Pass a tensor whose leading dimensions flatten without a copy
            (a model's output does; a slice such as `logits[:, :-1]` does not, so shift the index instead).
        index: `[...]` integer tensor of token ids in `[0, V)`, same leading shape as `logits`.

    Returns:
        `[...]` float32 log-probabilities.
    """
    if index.shape != logits.shape[:-1]:
        raise ValueError(f"index shape {tuple(index.shape)} must equal logits shape without the vocabulary "
                         f"dimension {tuple(logits.shape[:-1])}.")
    return _SelectiveLogSoftmax.apply(logits, index)


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each next token under `logits`, and which positions count.

    Args:
        logits: `[N, T, V]` logits of a causal LM; position t scores the token at t + 1.
        labels: `[N, T]` token ids aligned with the logits' input positions, `-100` where no loss is taken.

    Returns:
        `(logps, mask)`, both `[N, T - 1]`: `logps[:, t] = log p(labels[:, t + 1] | prefix)`, zero where
        `mask` (= `labels[:, 1:] != -100`) is False.
    """
    # Shift the labels left and pad the last position with -100 instead of slicing the logits, which
    # would turn the flatten inside selective_log_softmax into a full copy.
    next_tokens = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    mask = next_tokens != IGNORE_INDEX
    logps = selective_log_softmax(logits, next_tokens.clamp(min=0))
    logps = logps.masked_fill(~mask, 0.0)
    return logps[:, :-1], mask[:, :-1]


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probability of each row's labelled tokens, and how many there are.

    Args:
        logits: `[N, T, V]` causal LM logits.
        labels: `[N, T]` ids aligned with the inputs, `-100` on positions without loss.

    Returns:
        `(logps, lengths)`: `[N]` float32 sums of `log p(token)` over labelled tokens, `[N]` int64 counts.
    """
    logps, mask = token_logps(logits, labels)
    return logps.sum(-1), mask.sum(-1)


# Model families whose logits are exactly `lm_head(hidden)`: no soft-capping (Gemma 2/3), logit scale (Cohere) or
# division (Granite) after the head, which the fused log-probs (`head_log_softmax`) would leave out.
_PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3",
                                     "smollm3", "olmo2"})


def _fusable_head(model: torch.nn.Module) -> Optional[torch.nn.Linear]:
    """The output layer when log-probs can be computed from its weight directly (`head_log_softmax`), else None.

    That needs a plain `nn.Linear` head (not LoRA-wrapped, not quantized, not partitioned by DeepSpeed ZeRO-3) of a
    model family whose forward does nothing to the logits after it (`_PLAIN_HEAD_MODEL_TYPES`).
    """
    inner = getattr(model, "module", model)
    config = getattr(inner, "config", None)
    head = inner.get_output_embeddings()
    if type(head) is not torch.nn.Linear or getattr(config, "model_type", None) not in _PLAIN_HEAD_MODEL_TYPES:
        return None
    if is_zero3_partitioned(head.weight):
        # DeepSpeed ZeRO-3: the weight is whole only inside the head's own forward and backward (the engine's
        # hooks gather it there); read here it would be this process's empty partition. The head runs as a module.
        return None
    return head


@contextlib.contextmanager
def _hidden_instead_of_logits(head: torch.nn.Linear, seen: dict[str, Any]) -> Iterator[None]:
    """Within the block, the output layer passes its input through: the model returns hidden states as `logits`.

    `seen["autocast"]` receives the autocast the layer was called under, `(device type, dtype)` or None: the caller
    computes the log-probs from those hidden states after the model's call, where a mixed-precision wrapper's
    autocast (accelerate's wraps `model.forward` alone) has ended, and re-enters it so that the output layer's
    product runs in the precision it would have run in inside the model.
    """

    def passthrough(hidden: torch.Tensor) -> torch.Tensor:
        device = hidden.device.type
        seen["autocast"] = (device, torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else None
        return hidden

    with shadowed_forward(head, passthrough):  # hooks still run
        yield


@contextlib.contextmanager
def _output_layer_on(model: torch.nn.Module, slots: torch.Tensor,
                     seen: Optional[dict[str, torch.Tensor]] = None) -> Iterator[None]:
    """Within the block, the model's output layer sees only the hidden states at `slots`.

    `logits_to_keep` selects the same columns in every row, which cannot pick scattered positions of a
    multi-row packed layout, so the selection happens in a pre-hook on the output layer instead: the
    model is still called as a whole (PEFT and DDP wrappers run their own forward) and its logits come
    out as `[1, K, V]`, one row per slot.

    Args:
        model: a causal LM, possibly wrapped by PEFT or DDP.
        slots: `[K]` long positions in the model input flattened to `R * W`.
        seen: where given, `seen["hidden"]` receives the whole `[R, W, H]` input of the output layer.
    """
    inner = getattr(model, "module", model)  # DDP / DataParallel; PeftModel forwards the lookup itself
    head = inner.get_output_embeddings()
    if not isinstance(head, torch.nn.Module):
        raise TypeError(f"{type(inner).__name__} has no output layer (get_output_embeddings() is None): "
                        "padding-free log-probs need a causal LM; set padding_free: false for this model.")

    def select(_module, args):
        hidden = args[0]
        if seen is not None:
            seen["hidden"] = hidden
        # index_select: a shared prefix's last slot can be kept twice (for each sequence's next token), and its
        # backward sums repeats in index order (`FlatBatch.from_rows`).
        return (hidden.reshape(-1, hidden.size(-1)).index_select(0, slots).unsqueeze(0), *args[1:])

    handle = head.register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()


@dataclass
class LabelledForward:
    """What one call of a causal LM gives at the K positions whose next token is labelled.

    Attributes:
        values: `[K]` float32 log-probabilities of the targets, or `[K, V]` logits (`labelled_forward(logits=True)`).
        targets: `[K]` the token each kept position predicts.
        place: `[K]` long, each kept position in the padded `[N, L]` layout, flattened (`row * L + column`); the
            position at column t predicts the token at t + 1.
        shape: `(N, L)` of the padded batch.
        hidden: with `keep_hidden`, the hidden states entering the output layer, as
            `alignkit.model.heads.last_hidden_states` returns them: `[N, L, H]` padded, or `[1, T, H]` in flat order
            with `flat`; else None.
        flat: the `FlatBatch` of a padding-free call, else None.
    """

    values: torch.Tensor
    targets: torch.Tensor
    place: torch.Tensor
    shape: tuple[int, int]
    hidden: Optional[torch.Tensor] = None
    flat: Optional[FlatBatch] = None

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(logps, mask)`, both `[N, L - 1]`: column t holds `log p(token t + 1)`, 0 where `mask` is False."""
        rows, length = self.shape
        logps = self.values.new_zeros(rows * length).index_put((self.place,), self.values).view(rows, length)
        mask = torch.zeros(rows * length, dtype=torch.bool, device=self.place.device)
        mask[self.place] = True
        return logps[:, :-1], mask.view(rows, length)[:, :-1]

    def sequence_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(logps, lengths)`: `[N]` float32 sums of the kept log-probs of each row, `[N]` int64 counts."""
        rows, length = self.shape
        sequences = torch.div(self.place, length, rounding_mode="floor")
        return segment_sum(self.values, sequences, rows), torch.bincount(sequences, minlength=rows)


def labelled_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    *,
    padding_free: bool = False,
    call: Optional[torch.nn.Module] = None,
    keep_hidden: bool = False,
    logits: bool = False,
    model_inputs: Optional[dict] = None,
) -> LabelledForward:
    """The one per-token forward: run a causal LM once and score only the positions whose next token is labelled.

    Every stage that needs `log p(token | prefix)` of given tokens goes through here: DPO, KTO and SFT's sequence
    log-probs, PPO's policy and reference log-probs (with the hidden states its value head reads), `alignkit eval`'s
    KL logits, and the rollouts' scoring (`alignkit.rl.rollout.completion_logps`, whose KV-cache prompt pass for
    attention that is not per-sequence is the one strategy beside it). The model runs as a whole (`call`, e.g. a
    DeepSpeed engine around `model`, or `model` itself), so PEFT, DDP and ZeRO-3 hooks run as in a training step. A
    pre-hook on the output layer passes it only the kept positions (`_output_layer_on`), so no `[N, L, V]` logits
    exist; where the head is a plain linear layer of a family that does nothing after it (`_fusable_head`) the
    log-probs come from its weight chunk by chunk (`head_log_softmax`) and no `[K, V]` logits exist either.

    Layouts: padded (the batch as given) or padding-free (`padding_free=True`: the real tokens packed into rows no
    wider than the longest sequence, `alignkit.model.padding_free`). Both score the same positions.

    Args:
        model: a causal LM (PEFT/DDP wrapper allowed).
        input_ids, attention_mask: `[N, L]`, left or right padded.
        labels: `[N, L]` aligned with `input_ids`, `-100` on positions without loss (all -100: nothing is scored,
            e.g. when only `keep_hidden` is wanted).
        padding_free: pack the real tokens into rows for the call.
        call: what to call instead of `model` (a wrapper whose forward runs `model`'s); None: `model`.
        keep_hidden: also return the hidden states entering the output layer (`LabelledForward.hidden`).
        logits: return the kept positions' `[K, V]` logits instead of their log-probs (e.g. for a temperature, an
            entropy or a KL over the whole vocabulary).
        model_inputs: more inputs of the model's call, rows as in `input_ids` (a vision-language model's
            `pixel_values` and what comes with them); padded layout only.
    """
    if model_inputs and padding_free:
        raise ValueError("model_inputs (e.g. pixel_values) need the padded layout: padding_free=False.")
    inner = getattr(model, "module", model)  # DDP / DataParallel; PeftModel forwards the lookup itself
    if not isinstance(inner.get_output_embeddings(), torch.nn.Module):
        raise TypeError(f"{type(inner).__name__} has no output layer (get_output_embeddings() is None): per-token "
                        "log-probs need a causal LM.")
    rows, length = input_ids.shape
    flat = None
    if padding_free:
        flat = flatten_for_model(model, input_ids, attention_mask)
        targets = next_token_targets(labels[flat.real], flat.sequence_index)
        positions = (targets != IGNORE_INDEX).nonzero().squeeze(-1)
        slots = flat.slots[positions]
        place = flat.real.reshape(-1).nonzero().squeeze(-1)[positions]
    else:
        next_tokens = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
        place = (next_tokens != IGNORE_INDEX).nonzero().squeeze(-1)
        slots, targets, positions = place, next_tokens, place
    targets = targets[positions]
    head = None if logits else _fusable_head(model)
    seen: dict[str, Any] = {}
    call = model if call is None else call
    with (_output_layer_on(model, slots, seen if keep_hidden else None),
          packed_attention(model, flat) if flat is not None else contextlib.nullcontext(),
          _hidden_instead_of_logits(head, seen) if head is not None else contextlib.nullcontext()):
        if flat is None:
            outputs = call(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                           **(model_inputs or {})).logits
        else:
            outputs = call(input_ids=flat.input_ids, position_ids=flat.position_ids, use_cache=False).logits
    if logits:
        values = outputs[0]
    elif head is not None:  # `outputs` are the selected hidden states: no [K, V] logits, in forward or backward
        autocast = seen.get("autocast")
        with torch.autocast(autocast[0], dtype=autocast[1]) if autocast else contextlib.nullcontext():
            values = head_log_softmax(outputs[0], head.weight, head.bias, targets)
    else:
        values = selective_log_softmax(outputs[0], targets)
    hidden = seen.get("hidden")
    if hidden is not None and flat is not None:
        hidden = flat.from_rows(hidden).unsqueeze(0)
    return LabelledForward(values, targets, place, (rows, length), hidden, flat)


def forward_token_logps(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    *,
    padding_free: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a causal LM and return `token_logps` for `labels`, computing logits only where needed.

    Both layouts (padded, padding-free) return the same tensors (`labelled_forward`).

    Args:
        model: a causal LM (or a PEFT model around one).
        input_ids: `[N, L]`.
        attention_mask: `[N, L]`, 1 on real tokens (left or right padding).
        labels: `[N, L]`, `-100` on positions without loss.
        padding_free: pack the batch's real tokens into rows no wider than its longest sequence for the
            forward (`alignkit.model.padding_free`).

    Returns:
        `(logps, mask)`, both `[N, L - 1]`, as `token_logps` returns them for the whole sequence.
    """
    return labelled_forward(model, input_ids, attention_mask, labels, padding_free=padding_free).padded()


def forward_sequence_logps(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    *,
    padding_free: bool = False,
    model_inputs: Optional[dict] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a causal LM and return each row's summed log-probability of its labelled tokens.

    Args:
        model, input_ids, attention_mask, labels, padding_free: as for `forward_token_logps`.
        model_inputs: as for `labelled_forward` (a vision-language batch's pixel inputs).

    Returns:
        `(logps, lengths)`: `[N]` float32 sums of `log p(token)` over labelled tokens, `[N]` int64 counts.
    """
    return labelled_forward(model, input_ids, attention_mask, labels, padding_free=padding_free,
                            model_inputs=model_inputs).sequence_sums()


__all__ = [
    "IGNORE_INDEX",
    "selective_log_softmax",
    "head_log_softmax",
    "token_logps",
    "sequence_logps",
    "LabelledForward",
    "labelled_forward",
    "forward_token_logps",
    "forward_sequence_logps",
]
