"""The reward-model loss and metrics against hand-computed numbers (last-token selection: test_model_heads.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import EvalPrediction

from alignkit.stages.rm import (
    compute_reward_eval_metrics,
    reward_eval_metrics,
    pairwise_reward_loss,
    reward_metrics,
)

CHOSEN = torch.tensor([2.0, 0.0])
REJECTED = torch.tensor([0.0, 0.0])


def test_loss_plain():
    """Pairs (2, 0) and (0, 0): differences 2 and 0.

    -log sigmoid(2) = log(1 + e^-2) = log(1.1353353) = 0.1269280
    -log sigmoid(0) = log 2                          = 0.6931472
    mean = (0.1269280 + 0.6931472) / 2 = 0.4100376
    """
    loss = pairwise_reward_loss(CHOSEN, REJECTED)
    assert loss.item() == pytest.approx(0.4100376, abs=1e-6)


def test_loss_with_margin():
    """Margins (1, -1) turn both differences into 1: 2 - 1 = 1 and 0 - (-1) = 1.

    -log sigmoid(1) = log(1 + e^-1) = log(1.3678794) = 0.3132617 for both pairs, mean 0.3132617.
    """
    loss = pairwise_reward_loss(CHOSEN, REJECTED, margin=torch.tensor([1.0, -1.0]))
    assert loss.item() == pytest.approx(0.3132617, abs=1e-6)


def test_loss_with_centering():
    """Centring with c = 0.01: sums r_c + r_r = (2, 0), squares (4, 0), mean 2, penalty 0.01 * 2 = 0.02.

    loss = 0.4100376 (plain, above) + 0.02 = 0.4300376
    """
    loss = pairwise_reward_loss(CHOSEN, REJECTED, center_rewards_coefficient=0.01)
    assert loss.item() == pytest.approx(0.4300376, abs=1e-6)


def test_loss_with_margin_and_centering():
    """Margin 0.5 on one pair (-1, 1): difference -1 - 1 - 0.5 = -2.5.

    -log sigmoid(-2.5) = log(1 + e^2.5) = log(13.1824940) = 2.5788897
    centring c = 0.1: (r_c + r_r)^2 = 0^2 = 0, no penalty. loss = 2.5788897
    """
    loss = pairwise_reward_loss(
        torch.tensor([-1.0]), torch.tensor([1.0]), margin=torch.tensor([0.5]), center_rewards_coefficient=0.1
    )
    assert loss.item() == pytest.approx(2.5788897, abs=1e-6)


def test_loss_gradient_pushes_chosen_up():
    """d/dr_c of -log sigmoid(r_c - r_r) = -(1 - sigmoid(d)); at d = 0 that is -0.5, over B = 1 pair."""
    chosen = torch.tensor([0.0], requires_grad=True)
    rejected = torch.tensor([0.0], requires_grad=True)
    pairwise_reward_loss(chosen, rejected).backward()
    assert chosen.grad.item() == pytest.approx(-0.5)
    assert rejected.grad.item() == pytest.approx(0.5)


def test_reward_metrics():
    """chosen (3, 0, 1), rejected (1, 2, 1): means 4/3 and 4/3, margins (2, -2, 0) -> 0,
    accuracy: only pair 0 has chosen > rejected (the tie counts as wrong) -> 1/3."""
    m = reward_metrics(torch.tensor([3.0, 0.0, 1.0]), torch.tensor([1.0, 2.0, 1.0]))
    assert m["rewards/chosen"] == pytest.approx(4 / 3)
    assert m["rewards/rejected"] == pytest.approx(4 / 3)
    assert m["rewards/margins"] == pytest.approx(0.0)
    assert m["rewards/accuracies"] == pytest.approx(1 / 3)


def test_eval_metrics_from_predictions():
    """Predictions [[1, 0], [0, 2]]: accuracy 1/2, chosen mean 0.5, rejected mean 1, margin -0.5."""
    m = compute_reward_eval_metrics(EvalPrediction(predictions=np.array([[1.0, 0.0], [0.0, 2.0]]), label_ids=None))
    assert m == pytest.approx(
        {"accuracy": 0.5, "rewards/chosen": 0.5, "rewards/rejected": 1.0, "rewards/margins": -0.5}
    )


def test_eval_metrics_batch_by_batch_equal_the_whole_set():
    rewards = np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 1.0]])
    whole = compute_reward_eval_metrics(EvalPrediction(predictions=rewards, label_ids=None))
    metric = reward_eval_metrics()
    assert metric(EvalPrediction(predictions=rewards, label_ids=None)) == whole
    assert metric(EvalPrediction(predictions=torch.tensor(rewards[:2]), label_ids=torch.zeros(2)),
                  compute_result=False) is None
    assert metric(EvalPrediction(predictions=torch.tensor(rewards[2:]), label_ids=torch.zeros(1))) == whole
    assert whole["accuracy"] == pytest.approx(2 / 3)
