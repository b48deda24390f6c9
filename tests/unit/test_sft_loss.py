"""`sft_loss`: a pure tensor function against hand-computed values (`left_pad` is tested in test_generation.py)."""

from __future__ import annotations

import math

import pytest
import torch

from alignkit.stages.sft import sft_loss


def test_sft_loss_hand_computed():
    """One row, vocab 2, logits uniform except at position 1.

    labels = [-100, 0, 1]: after the shift, position 0 targets 0, position 1 targets 1, position 2 nothing.
    position 0: logits [0, 0] -> -log softmax = log 2 = 0.693147
    position 1: logits [0, ln 3] -> p(1) = 3/4 -> -log(3/4) = 0.287682
    sum = 0.980829; 2 targets -> mean 0.490415; with num_items_in_batch = 4 (other micro-batches
    hold 2 more targets) -> 0.980829 / 4 = 0.245207.
    """
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)], [5.0, -5.0]]])
    labels = torch.tensor([[-100, 0, 1]])
    expected_sum = math.log(2) - math.log(0.75)
    assert sft_loss(logits, labels).item() == pytest.approx(expected_sum / 2, abs=1e-6)
    assert sft_loss(logits, labels, num_items_in_batch=4).item() == pytest.approx(expected_sum / 4, abs=1e-6)
    assert sft_loss(logits, labels, num_items_in_batch=torch.tensor(4)).item() == pytest.approx(expected_sum / 4)


def test_sft_loss_label_smoothing_hand_computed():
    """The same logits with eps = 0.1: each target's loss is 0.9 * nll + 0.1 * mean over the 2 tokens of -log p.

    position 0: p = [1/2, 1/2] -> nll = log 2, mean -log p = log 2 -> 0.693147
    position 1: p = [1/4, 3/4], target 1 -> nll = 0.287682, mean -log p = (1.386294 + 0.287682) / 2 = 0.836988
      -> 0.9 * 0.287682 + 0.1 * 0.836988 = 0.342613
    sum 1.035760; 2 targets -> 0.517880; num_items_in_batch = 4 -> 0.258940.
    """
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)], [5.0, -5.0]]])
    labels = torch.tensor([[-100, 0, 1]])
    position_1 = 0.9 * -math.log(0.75) + 0.1 * (math.log(4.0) - math.log(0.75)) / 2
    expected_sum = math.log(2) + position_1
    assert expected_sum == pytest.approx(1.035760, abs=1e-6)
    assert sft_loss(logits, labels, label_smoothing=0.1).item() == pytest.approx(expected_sum / 2, abs=1e-6)
    assert sft_loss(logits, labels, 4, label_smoothing=0.1).item() == pytest.approx(expected_sum / 4, abs=1e-6)


def _padded_batch(tiny_model_dir):
    """The tiny model and a padded batch of 2 rows (7 and 5 tokens), the first 3 of each unlabelled: 6 targets."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    input_ids = torch.randint(3, 100, (2, 7))
    attention_mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    labels = input_ids.clone()
    labels[:, :3] = -100
    labels[1, 5:] = -100
    return model, input_ids, attention_mask, labels


@pytest.mark.parametrize("num_items", [None, 10])
def test_sft_loss_label_smoothing_matches_transformers_label_smoother(tiny_model_dir, num_items):
    """transformers' `LabelSmoother` (what TRL's and LLaMA-Factory's SFT apply for `label_smoothing_factor`) on a
    tiny model's logits of a padded batch: the same loss within 1e-6, over the batch's own count and a step's."""
    from transformers.trainer_pt_utils import LabelSmoother

    model, input_ids, attention_mask, labels = _padded_batch(tiny_model_dir)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits * 8  # peaked, not near uniform
    for eps in (0.1, 0.3):
        theirs = LabelSmoother(epsilon=eps)({"logits": logits}, labels, shift_labels=True,
                                            num_items_in_batch=num_items)
        ours = sft_loss(logits, labels, num_items, label_smoothing=eps)
        assert ours.item() == pytest.approx(theirs.item(), abs=1e-6)
        assert abs(ours.item() - sft_loss(logits, labels, num_items).item()) > 1e-4  # smoothing moved it


def test_sft_loss_without_targets_is_zero_not_nan():
    logits = torch.randn(2, 3, 5)
    labels = torch.full((2, 3), -100)
    assert sft_loss(logits, labels).item() == 0.0


def test_sft_loss_matches_transformers_causal_lm_loss(tiny_model_dir):
    """Same shift and -100 handling as the model's own loss (ForCausalLMLoss) on a padded batch."""
    model, input_ids, attention_mask, labels = _padded_batch(tiny_model_dir)
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    ours = sft_loss(out.logits, labels)
    assert ours.item() == pytest.approx(out.loss.item(), abs=1e-6)
    count = int((labels[:, 1:] != -100).sum())  # 4 + 2 = 6 targets
    assert count == 6
    out_sum = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, num_items_in_batch=10)
    assert sft_loss(out.logits, labels, 10).item() == pytest.approx(out_sum.loss.item(), abs=1e-6)
