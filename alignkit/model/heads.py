"""Heads on a decoder's hidden states: where the last real token is, the decoder's last hidden state, the
score head of a sequence-classification model, and PPO's per-token value head.

Reading a reward model's score from these (`sequence_rewards`, `head_rewards`) is the reward models' own
code, in `alignkit.rewards.scoring`; what lives here is what the rm stage, the reward models and PPO's critic
share: `last_token_index` (the last real token of a left- or right-padded row), `last_hidden_states` (the
decoder without its output head, padded or padding-free), `find_score_head`, and `ValueHead` with
`token_values`, one value per token.

All of these take left- or right-padded batches; with `padding_free=True` the batch runs as one row of
its real tokens with position ids restarting per sequence (`alignkit.model.padding_free`), giving the
same numbers without computing padding.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from .padding_free import (
    FlatBatch,
    flatten_for_model,
    packed_attention,
    unflatten_to_padded,
)

VALUE_HEAD_FILE = "value_head.safetensors"
# The submodule name of a value head attached to a policy (a name `lora_target: all` skips).
VALUE_HEAD_NAME = "v_head"


# ---------------------------------------------------------------------------------------------------
# Pure tensor functions
# ---------------------------------------------------------------------------------------------------


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each row's last real token, for left or right padding.

    Args:
        attention_mask: [N, L], 1 on real tokens and 0 on padding (at either end).

    Returns:
        [N] long tensor: the largest position whose mask is 1 (0 for an all-padding row).
    """
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return (positions * attention_mask.ne(0).long()).argmax(dim=-1)


def gather_last_token_scores(per_token_scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's score at its last real token.

    Args:
        per_token_scores: [N, L] (or [N, L, 1]) score head output at every position.
        attention_mask: [N, L], 1 on real tokens, 0 on padding.

    Returns:
        [N] the score of each sequence.
    """
    if per_token_scores.dim() == 3:
        per_token_scores = per_token_scores.squeeze(-1)
    index = last_token_index(attention_mask).to(per_token_scores.device)
    return per_token_scores.gather(1, index.unsqueeze(1)).squeeze(1)


# ---------------------------------------------------------------------------------------------------
# Hidden states of a (possibly wrapped) decoder
# ---------------------------------------------------------------------------------------------------


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP / DataParallel and PEFT wrappers (the PEFT layers stay in it)."""
    inner = getattr(model, "module", model)  # DDP / DataParallel
    if hasattr(inner, "get_base_model"):  # PeftModel
        inner = inner.get_base_model()
    return inner


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder stack of a causal-LM or sequence-classification model: it returns the last hidden
    state (after the final norm), which is what `lm_head` and `score` read.

    Raises:
        TypeError: the model has no `base_model_prefix` submodule (not a transformers model).
    """
    inner = unwrap_model(model)
    decoder = getattr(inner, getattr(inner, "base_model_prefix", ""), None)
    if not isinstance(decoder, nn.Module) or decoder is inner:
        raise TypeError(
            f"{type(inner).__name__} has no decoder submodule named by `base_model_prefix`; give a transformers "
            "causal-LM or sequence-classification model."
        )
    return decoder


def last_hidden_states(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, padding_free: bool = False
) -> tuple[torch.Tensor, Optional[FlatBatch]]:
    """The decoder's last hidden state, without running any output head.

    Args:
        model: causal-LM or sequence-classification model (PEFT/DDP wrappers allowed; the active
            adapter applies).
        input_ids: [N, L], left- or right-padded.
        attention_mask: [N, L], 1 on real tokens.
        padding_free: run the real tokens packed into rows (`flatten_for_model`).

    Returns:
        `(hidden, flat)`: padded, `hidden` is [N, L, H] (padding positions hold whatever the model computed
        there) and `flat` is None; padding-free, `hidden` is [1, T, H] over the real tokens in flat order
        (sequence after sequence) and `flat` the `FlatBatch` that maps them back.
    """
    decoder = decoder_of(model)
    if not padding_free:
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.last_hidden_state, None
    flat = flatten_for_model(decoder, input_ids, attention_mask)
    with packed_attention(decoder, flat):
        out = decoder(input_ids=flat.input_ids, position_ids=flat.position_ids, use_cache=False)
    return flat.from_rows(out.last_hidden_state).unsqueeze(0), flat


# ---------------------------------------------------------------------------------------------------
# The score head of a sequence-classification model
# ---------------------------------------------------------------------------------------------------


def find_score_head(model: nn.Module) -> nn.Module:
    """The `score` head of a (possibly PEFT- or DDP-wrapped) sequence-classification model.

    Under LoRA the head is PEFT's `ModulesToSaveWrapper`, which runs the active adapter's trained copy,
    so hooking it captures exactly what the forward computed.
    """
    inner = unwrap_model(model)
    head = getattr(inner, "score", None)
    if not isinstance(head, nn.Module):
        raise TypeError(
            f"{type(inner).__name__} has no `score` head: the rm stage needs a sequence-classification model "
            "over a causal LM (load it with `load_model(..., head=\"reward\")` or "
            "`AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)`)."
        )
    return head


# ---------------------------------------------------------------------------------------------------
# Value head (PPO's critic on the policy's hidden states)
# ---------------------------------------------------------------------------------------------------


class ValueHead(nn.Linear):
    """Linear map from a hidden state to a scalar value, `v_t = w . h_t + b` (PPO's critic head).

    Initialised to zero (weight and bias): every value starts at 0, so the first value loss is just the
    returns' scale; no random numbers are drawn, so adding the head does not shift a seeded run's
    random stream (resumed and uninterrupted PPO runs stay equal); and a zero `w` sends no gradient into
    the decoder at step 0, so the critic cannot disturb the policy before it has learnt anything. The
    weight still gets gradient `dL/dv * h`, so it trains from the first step.

    The parameters are float32 whatever the model's dtype, and hidden states are cast up before the
    product: the head is H + 1 numbers, so fp32 costs nothing, while value targets (returns) need more
    than bf16's ~3 significant digits and AdamW's small updates would round away in bf16 weights.

    It is an `nn.Linear`, attached to the model as `v_head` (`attach_value_head`), so `lora_target: all`
    (which skips the names in `loader.OUTPUT_HEADS`) never wraps it when a critic adapter is added later.

    Args:
        hidden_size: the decoder's hidden size H.
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__(hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)

    @property
    def hidden_size(self) -> int:
        return self.in_features

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[..., H] hidden states -> [...] float32 values."""
        return super().forward(hidden_states.to(self.weight.dtype)).squeeze(-1)


def attach_value_head(model: nn.Module, value_head: Optional[ValueHead] = None) -> ValueHead:
    """Put a value head on the policy as the submodule `v_head` and return it.

    As a submodule it follows `model.to(device)`, DDP and the Trainer's optimizer (its parameters require
    grad; nothing else changes). Attach it after the policy's adapter exists: PEFT freezes every
    non-adapter parameter when it wraps a model, while adding a further adapter later keeps the flags.
    PEFT's `save_pretrained` does not save it, so checkpoints hold it in `value_head.safetensors`
    (`save_value_head`); a full model's `save_pretrained` would include it as `v_head.*`, which
    `from_pretrained` of the causal LM then ignores. The head stays float32 (see `ValueHead`).

    Args:
        model: the policy (PEFT/DDP wrappers allowed; the head goes on the transformers model inside).
        value_head: a head to attach (e.g. from `load_value_head` on resume); None: a fresh zero head.

    Raises:
        ValueError: `value_head` was built for another hidden size.
    """
    inner = unwrap_model(model)
    hidden_size = inner.config.hidden_size
    if value_head is None:
        value_head = ValueHead(hidden_size)
    elif value_head.hidden_size != hidden_size:
        raise ValueError(f"the value head has hidden size {value_head.hidden_size}, the model {hidden_size}.")
    device = next(inner.parameters()).device
    inner.add_module(VALUE_HEAD_NAME, value_head.to(device))
    return value_head


def values_from_hidden(
    value_head: ValueHead, hidden: torch.Tensor, attention_mask: torch.Tensor, flat: Optional[FlatBatch] = None
) -> torch.Tensor:
    """Per-token values in the padded layout, 0 at padding.

    Args:
        value_head: the critic's head.
        hidden: [N, L, H] padded hidden states, or [1, T, H] when `flat` is given.
        attention_mask: [N, L], 1 on real tokens.
        flat: the `FlatBatch` the flat hidden states came from (padding-free), else None.

    Returns:
        [N, L] float32: `values[i, t]` is the value of the state after token t of row i (the prefix up to
        and including t); 0 where `attention_mask` is 0.
    """
    if flat is None:
        return value_head(hidden) * attention_mask.to(hidden.device).float()
    return unflatten_to_padded(value_head(hidden[0]), flat.real)


def token_values(
    model: nn.Module,
    value_head: ValueHead,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    padding_free: bool = False,
) -> torch.Tensor:
    """One decoder pass (no LM head) and the value head at every real token.

    When the policy's forward already has the hidden states, call `values_from_hidden` on them instead
    of running the decoder twice.

    Args:
        model: the policy (causal LM, PEFT/DDP wrappers allowed; the active adapter applies).
        value_head: the critic's head.
        input_ids: [N, L], left- or right-padded.
        attention_mask: [N, L], 1 on real tokens.
        padding_free: run the real tokens as one row.

    Returns:
        [N, L] float32 values, 0 at padding (see `values_from_hidden`).
    """
    hidden, flat = last_hidden_states(model, input_ids, attention_mask, padding_free=padding_free)
    return values_from_hidden(value_head, hidden, attention_mask, flat)


def save_value_head(value_head: ValueHead, directory: str | os.PathLike) -> Path:
    """Write `value_head.safetensors` into `directory` (a checkpoint or output dir).

    File format: safetensors with two float32 tensors, `weight` [1, H] and `bias` [1] (the `nn.Linear`
    of `v = w . h + b`), and metadata `{"format": "pt", "hidden_size": "<H>"}`. Plain
    `safetensors.torch.load_file` reads it; nothing else is needed to rebuild the head.

    Returns:
        The file's path.
    """
    from safetensors.torch import save_file

    path = Path(directory) / VALUE_HEAD_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in value_head.state_dict().items()}
    save_file(tensors, str(path), metadata={"format": "pt", "hidden_size": str(value_head.hidden_size)})
    return path


def load_value_head(directory: str | os.PathLike, hidden_size: Optional[int] = None) -> ValueHead:
    """Rebuild the `ValueHead` that `save_value_head` wrote into `directory`.

    Args:
        directory: the checkpoint or output dir holding `value_head.safetensors`.
        hidden_size: the policy's hidden size, to check against the file (None: take the file's).

    Raises:
        FileNotFoundError: no `value_head.safetensors` in `directory`.
        ValueError: the file's tensors do not form a [1, H] + [1] head, or H differs from `hidden_size`.
    """
    from safetensors.torch import load_file

    path = Path(directory) / VALUE_HEAD_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; a PPO checkpoint with a value head holds one.")
    tensors = load_file(str(path))
    weight, bias = tensors.get("weight"), tensors.get("bias")
    if weight is None or bias is None or weight.dim() != 2 or weight.shape[0] != 1 or bias.shape != (1,):
        shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        raise ValueError(f"{path}: expected tensors weight [1, H] and bias [1], found {shapes}.")
    if hidden_size is not None and weight.shape[1] != hidden_size:
        raise ValueError(f"{path}: the value head has hidden size {weight.shape[1]}, the model {hidden_size}; "
                         "it was saved for another model.")
    head = ValueHead(weight.shape[1])
    head.load_state_dict({"weight": weight.float(), "bias": bias.float()})
    return head


__all__ = [
    "VALUE_HEAD_FILE",
    "last_token_index",
    "gather_last_token_scores",
    "unwrap_model",
    "decoder_of",
    "last_hidden_states",
    "find_score_head",
    "VALUE_HEAD_NAME",
    "ValueHead",
    "attach_value_head",
    "values_from_hidden",
    "token_values",
    "save_value_head",
    "load_value_head",
]
