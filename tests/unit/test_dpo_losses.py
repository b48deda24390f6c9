"""DPO-family losses against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from alignkit.stages.dpo import (
    _log1mexp,
    hinge_loss,
    ipo_loss,
    orpo_loss,
    preference_loss,
    chosen_nll_loss,
    sigmoid_loss,
    simpo_loss,
)

T = torch.tensor


def test_sigmoid_loss():
    """Pair 1: h = (-1 - -2) - (-3 - -2) = 1 - (-1) = 2; beta*h = 0.5*2 = 1; -log sigmoid(1) = log(1 + e^-1) = 0.3132617.
    Pair 2: policy == reference, h = 0: -log sigmoid(0) = log 2 = 0.6931472.
    Label smoothing 0.1 on pair 1: 0.9 * 0.3132617 + 0.1 * -log sigmoid(-1) = 0.9 * 0.3132617 + 0.1 * 1.3132617 = 0.4132617.
    """
    args = (T([-1.0, -2.0]), T([-3.0, -2.0]), T([-2.0, -2.0]), T([-2.0, -2.0]))
    assert sigmoid_loss(*args, beta=0.5).tolist() == pytest.approx([0.3132617, 0.6931472], abs=1e-6)
    assert sigmoid_loss(*args, beta=0.5, label_smoothing=0.1)[0].item() == pytest.approx(0.4132617, abs=1e-6)


def test_beta_scales_the_difference_not_only_the_chosen_term():
    """h = (0 - -1) - (0 - 0) = 1 with beta = 0.5: -log sigmoid(0.5) = log(1 + e^-0.5) = 0.4740770.
    (`beta * chosen_ratio - rejected_ratio` would give -log sigmoid(0.5 - 0) here too, so the rejected
    ratio is made non-zero in the second pair: h = (0 - 0) - (-2 - 0) = 2, loss = -log sigmoid(1) = 0.3132617,
    whereas beta * 0 - (-2) = 2 would give -log sigmoid(2) = 0.1269280.)
    """
    loss = sigmoid_loss(T([0.0, 0.0]), T([0.0, -2.0]), T([-1.0, 0.0]), T([0.0, 0.0]), beta=0.5)
    assert loss.tolist() == pytest.approx([0.4740770, 0.3132617], abs=1e-6)


def test_hinge_loss():
    """h = 2 (as above): beta 0.5 -> relu(1 - 1) = 0; beta 0.25 -> relu(1 - 0.5) = 0.5. h = 0 -> relu(1) = 1."""
    args = (T([-1.0, -2.0]), T([-3.0, -2.0]), T([-2.0, -2.0]), T([-2.0, -2.0]))
    assert hinge_loss(*args, beta=0.5).tolist() == pytest.approx([0.0, 1.0])
    assert hinge_loss(*args, beta=0.25).tolist() == pytest.approx([0.5, 1.0])


def test_ipo_loss_uses_per_token_average_log_ratios():
    """Chosen: (-4 - -6) / 2 tokens = 1; rejected: (-9 - -6) / 3 tokens = -1; h = 2.
    beta 0.5: (2 - 1/(2*0.5))^2 = (2 - 1)^2 = 1.  beta 0.25: (2 - 2)^2 = 0.  beta 1: (2 - 0.5)^2 = 2.25.
    """
    args = (T([-4.0]), T([-9.0]), T([-6.0]), T([-6.0]), T([2]), T([3]))
    assert ipo_loss(*args, beta=0.5).item() == pytest.approx(1.0)
    assert ipo_loss(*args, beta=0.25).item() == pytest.approx(0.0)
    assert ipo_loss(*args, beta=1.0).item() == pytest.approx(2.25)


def test_orpo_loss():
    """avg_c = ln 0.5: p = 0.5, odds = 1, log odds = 0.  avg_r = ln 0.25: p = 0.25, odds = 1/3.
    log odds ratio = 0 - ln(1/3) = ln 3; -log sigmoid(ln 3) = -ln(3/4) = 0.2876821.
    NLL = -ln 0.5 = 0.6931472; beta = 0.1: 0.6931472 + 0.1 * 0.2876821 = 0.7219154.
    """
    loss = orpo_loss(T([math.log(0.5)]), T([math.log(0.25)]), beta=0.1)
    assert loss.item() == pytest.approx(0.7219154, abs=1e-6)


def test_simpo_loss():
    """avg_c = -1, avg_r = -2, beta = 2, gamma = 0.5: 2 * (-1 - -2) - 0.5 = 1.5; -log sigmoid(1.5) = 0.2014133."""
    assert simpo_loss(T([-1.0]), T([-2.0]), beta=2.0, gamma=0.5).item() == pytest.approx(0.2014133, abs=1e-6)


def test_sft_loss_is_each_chosen_replys_mean_nll_per_token():
    """Summed log-probs -3 (2 tokens) and -5 (3 tokens): 3 / 2 = 1.5 and 5 / 3 = 1.667, one per pair (as
    LLaMA-Factory's pref_ftx; the batch mean of these is then taken with the preference losses)."""
    assert chosen_nll_loss(T([-3.0, -5.0]), T([2, 3])).tolist() == pytest.approx([1.5, 5 / 3])  # per pair: 3/2, 5/3


def test_log1mexp_is_accurate_at_both_ends():
    """log(1 - e^x): x = -1e-10 -> log(1e-10) = -23.0258509; x = -50 -> -e^-50 = -1.9287498e-22; x = ln 0.5 -> ln 0.5."""
    out = _log1mexp(T([-1e-10, -50.0, math.log(0.5)], dtype=torch.float64))
    assert out[0].item() == pytest.approx(-23.0258509, rel=1e-6)
    assert out[1].item() == pytest.approx(-1.9287498e-22, rel=1e-6)
    assert out[2].item() == pytest.approx(math.log(0.5))


def test_preference_loss_rewards():
    """Sigmoid, beta 0.5: rewards 0.5 * (-1 - -2) = 0.5 and 0.5 * (-3 - -2) = -0.5.
    SimPO, beta 2, summed -2 over 2 tokens and -6 over 3 tokens: averages -1 and -2, rewards -2 and -4,
    loss -log sigmoid(2 * 1 - 0.5) = 0.2014133.
    """
    lengths = (T([2]), T([3]))
    losses, chosen, rejected = preference_loss("sigmoid", T([-1.0]), T([-3.0]), *lengths, T([-2.0]), T([-2.0]),
                                               beta=0.5)
    assert (chosen.item(), rejected.item()) == pytest.approx((0.5, -0.5))
    assert losses.item() == pytest.approx(0.3132617, abs=1e-6)
    losses, chosen, rejected = preference_loss("simpo", T([-2.0]), T([-6.0]), *lengths, None, None,
                                               beta=2.0, simpo_gamma=0.5)
    assert (chosen.item(), rejected.item()) == pytest.approx((-2.0, -4.0))
    assert losses.item() == pytest.approx(0.2014133, abs=1e-6)
    with pytest.raises(ValueError, match="reference"):
        preference_loss("ipo", T([-1.0]), T([-3.0]), *lengths, None, None, beta=0.5)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "orpo", "simpo"])
def test_gradient_raises_chosen_and_lowers_rejected(loss_type):
    """Descending each loss must push the chosen log-prob up and the rejected one down."""
    chosen = T([-6.0], requires_grad=True)
    rejected = T([-5.0], requires_grad=True)
    losses, _, _ = preference_loss(loss_type, chosen, rejected, T([3]), T([3]), T([-5.0]), T([-5.0]), beta=0.1)
    losses.sum().backward()
    assert chosen.grad.item() < 0 < rejected.grad.item()
