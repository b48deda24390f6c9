"""Padding collators for training: each pads to the longest sequence of its batch and returns torch tensors.

Attention masks mark the real tokens; nothing downstream may find padding by comparing ids with the pad
token (pad == eos in SmolLM2).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..constants import IGNORE_INDEX


def pad_sequences(sequences: list[list[int]], value: int, side: str = "right",
                  pad_to_multiple_of: Optional[int] = None) -> torch.Tensor:
    """Stack lists of ids into a [N, L] long tensor, L the longest (rounded up to `pad_to_multiple_of`).

    Args:
        sequences: N lists of ints.
        value: the padding value.
        side: `right` (training) or `left` (generation, so every prompt ends at the last column).
        pad_to_multiple_of: round L up to a multiple of this.
    """
    length = max((len(s) for s in sequences), default=0)
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    out = torch.full((len(sequences), length), value, dtype=torch.long)
    for i, seq in enumerate(sequences):
        if not seq:
            continue
        if side == "right":
            out[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        else:
            out[i, length - len(seq):] = torch.as_tensor(seq, dtype=torch.long)
    return out


def padding_token_id(tokenizer) -> int:
    """The id that pads `tokenizer`'s sequences: its pad token, else its eos token (as `load_tokenizer` sets it).

    Padding is always masked out by position, never found by comparing with this id (pad == eos in SmolLM2).
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token.")
    return pad


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class SupervisedCollator:
    """Right-pads `input_ids` (pad id), `attention_mask` (0) and `labels` (-100); numeric scalar columns
    such as `margin` become float tensors [B].

    `labels` are padded to their own longest length, so prompt-only eval rows (predict_with_generate,
    where labels are the reference reply) work too.

    Args:
        tokenizer: gives the pad id.
        label_pad_token_id: value for padded labels.
        pad_to_multiple_of: round the padded length up to this multiple.
    """

    def __init__(self, tokenizer, label_pad_token_id: int = IGNORE_INDEX, pad_to_multiple_of: Optional[int] = None):
        self.pad_id = padding_token_id(tokenizer)
        self.label_pad_token_id = label_pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [f["input_ids"] for f in features]
        masks = [f.get("attention_mask") or [1] * len(f["input_ids"]) for f in features]
        batch = {"input_ids": pad_sequences(ids, self.pad_id, pad_to_multiple_of=self.pad_to_multiple_of),
                 "attention_mask": pad_sequences(masks, 0, pad_to_multiple_of=self.pad_to_multiple_of)}
        if "labels" in features[0]:
            batch["labels"] = pad_sequences([f["labels"] for f in features], self.label_pad_token_id,
                                            pad_to_multiple_of=self.pad_to_multiple_of)
        for name, value in features[0].items():
            if name not in batch and _is_number(value):
                batch[name] = torch.tensor([float(f[name]) for f in features], dtype=torch.float)
        return batch


class PairwiseCollator:
    """B preference pairs → one batch of 2B rows: rows 0..B-1 chosen, B..2B-1 rejected, right-padded
    together to one length. Keys: `input_ids`, `attention_mask`, `labels` [2B, L], and `margin` [B]
    when the pairs have one.

    Args:
        tokenizer: gives the pad id.
        pad_to_multiple_of: round the padded length up to this multiple.
    """

    def __init__(self, tokenizer, pad_to_multiple_of: Optional[int] = None):
        self.pad_id = padding_token_id(tokenizer)
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [(f[f"{side}_input_ids"], f[f"{side}_attention_mask"], f[f"{side}_labels"])
                for side in ("chosen", "rejected") for f in features]
        batch = {
            "input_ids": pad_sequences([r[0] for r in rows], self.pad_id, pad_to_multiple_of=self.pad_to_multiple_of),
            "attention_mask": pad_sequences([r[1] for r in rows], 0, pad_to_multiple_of=self.pad_to_multiple_of),
            "labels": pad_sequences([r[2] for r in rows], IGNORE_INDEX, pad_to_multiple_of=self.pad_to_multiple_of),
        }
        if features and "margin" in features[0]:
            batch["margin"] = torch.tensor([float(f["margin"] or 0.0) for f in features], dtype=torch.float)
        return batch


class UnpairedCollator(SupervisedCollator):
    """KTO rows: `input_ids`, `attention_mask`, `labels` [B, L] as `SupervisedCollator` pads them, the same
    three under `kl_` [B, L'] for the mismatched (prompt, reply) rows when the features carry them, and
    `desirable` [B] bool.

    Args:
        tokenizer: gives the pad id.
        pad_to_multiple_of: round each padded length up to this multiple.
    """

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = super().__call__([{k: f[k] for k in ("input_ids", "attention_mask", "labels")} for f in features])
        if features and "kl_input_ids" in features[0]:
            kl = super().__call__([{"input_ids": f["kl_input_ids"], "labels": f["kl_labels"]} for f in features])
            batch.update({f"kl_{k}": v for k, v in kl.items()})
        batch["desirable"] = torch.tensor([bool(f["desirable"]) for f in features], dtype=torch.bool)
        return batch
