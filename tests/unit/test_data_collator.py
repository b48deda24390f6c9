"""Collators: padding side and values, pairwise row order, pass-through columns."""

from __future__ import annotations

import torch

from alignkit.data import PairwiseCollator, SupervisedCollator

PAD = 2  # the tiny tokenizer's pad == eos


def test_supervised_collator_right_pads_each_key_with_its_value(tiny_tokenizer):
    features = [{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, 6, 7], "margin": 0.5},
                {"input_ids": [8], "attention_mask": [1], "labels": [8], "margin": 2.0}]
    batch = SupervisedCollator(tiny_tokenizer)(features)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, PAD, PAD]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["margin"].dtype == torch.float and batch["margin"].tolist() == [0.5, 2.0]


def test_supervised_collator_pad_to_multiple_of(tiny_tokenizer):
    batch = SupervisedCollator(tiny_tokenizer, pad_to_multiple_of=4)([{"input_ids": [5] * 5, "labels": [5] * 5}])
    assert batch["input_ids"].shape == (1, 8)
    assert batch["attention_mask"].tolist() == [[1] * 5 + [0] * 3]
    assert batch["labels"].tolist() == [[5] * 5 + [-100] * 3]


def test_pairwise_collator_puts_chosen_rows_first_then_rejected(tiny_tokenizer):
    def pair(c, r, margin):
        return {"chosen_input_ids": c, "chosen_attention_mask": [1] * len(c), "chosen_labels": [-100] + c[1:],
                "rejected_input_ids": r, "rejected_attention_mask": [1] * len(r), "rejected_labels": [-100] + r[1:],
                "margin": margin}

    batch = PairwiseCollator(tiny_tokenizer)([pair([1, 10, 11], [1, 20], 1.0), pair([1, 30], [1, 40, 41, 42], 0.0)])
    assert batch["input_ids"].tolist() == [[1, 10, 11, PAD], [1, 30, PAD, PAD], [1, 20, PAD, PAD], [1, 40, 41, 42]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[-100, 10, 11, -100], [-100, 30, -100, -100], [-100, 20, -100, -100],
                                        [-100, 40, 41, 42]]
    assert batch["margin"].tolist() == [1.0, 0.0]

